"""The serving half of ``scripts/gpu_check.sh``: the tiny GLM-Image and the tiny BAGEL served with vLLM's
defaults (CUDA graphs on, async scheduling on, vLLM's own model runner: V2 on CUDA) through the stock
``vllm`` script, text to image and an edit each; every image compared with a reference computed on this
host's CPU (fp32, greedy AR); one summary table, saying which runner each AR stage reported.

    python -m vllm_omni_testkit.harness.gpu_check [--device cuda|cpu] [--runners choice,v2] [--out DIR]

``--device cpu`` runs the same path on the CPU (V1 only: vLLM's CPU V2 runner needs Triton's CPU
backend), which is how the test suite checks this driver. Exit status 0 when every row passes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.images import pixels
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

REPO = Path(__file__).resolve().parents[4]
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
PROMPT = "a red fox in the snow"
EDIT_PROMPT = "make it blue"
SIZE = 64
SEED = 7
MAX_DIFF = 8
"""Largest per-pixel difference (of 255) allowed between a served image and its CPU reference: the GPU
computes in other kernels (cuDNN convolutions may use TF32) and the tiny random models amplify it."""
MEAN_DIFF = 1.0
"""Largest mean difference (of 255) allowed."""


@dataclass
class Row:
    model: str
    runner: str
    request: str
    status: str
    max_diff: float | None = None
    mean_diff: float | None = None
    verdict: str = "FAIL"
    detail: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(row.verdict in ("pass", "expected") for row in self.rows)

    def table(self) -> str:
        head = ("model", "runner", "request", "status", "max diff", "mean diff", "verdict", "detail")
        lines = [head]
        for r in self.rows:
            lines.append(
                (
                    r.model,
                    r.runner,
                    r.request,
                    r.status,
                    "-" if r.max_diff is None else f"{r.max_diff:.0f}",
                    "-" if r.mean_diff is None else f"{r.mean_diff:.3f}",
                    r.verdict,
                    r.detail,
                )
            )
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
        return "\n".join(
            " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines
        )


def source_png(seed: int = 3) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def compare(row: Row, ours: np.ndarray, reference: np.ndarray) -> Row:
    if ours.shape != reference.shape:
        row.detail = f"shape {ours.shape} != reference {reference.shape}"
        return row
    diff = np.abs(ours.astype(int) - reference.astype(int))
    row.max_diff, row.mean_diff = float(diff.max()), float(diff.mean())
    row.verdict = "pass" if row.max_diff <= MAX_DIFF and row.mean_diff <= MEAN_DIFF else "FAIL"
    return row


# --- the references (this host's CPU, fp32) ---------------------------------------------------------


def glm_image_references(model: Path, steps: int, guidance: float) -> dict[str, np.ndarray]:
    from PIL import Image

    from vllm_omni_testkit.reference.glm_image import glm_image_reference_image

    source = Image.open(io.BytesIO(source_png())).convert("RGB")
    common = {"num_inference_steps": steps, "guidance_scale": guidance, "seed": SEED}
    return {
        "t2i": glm_image_reference_image(model, PROMPT, SIZE, SIZE, **common),
        "edit": glm_image_reference_image(model, EDIT_PROMPT, SIZE, SIZE, images=[source], **common),
    }


def bagel_references(model: Path, steps: int) -> dict[str, np.ndarray]:
    import torch
    from PIL import Image

    from vllm_omni_testkit.reference.bagel import BagelReference

    reference = BagelReference(str(model), dtype=torch.float32)
    source = Image.open(io.BytesIO(source_png())).convert("RGB")
    t2i = reference.interleave(
        [PROMPT], height=SIZE, width=SIZE, seed=SEED, cfg_text_scale=4.0, cfg_img_scale=1.0,
        num_inference_steps=steps,
    )  # fmt: skip
    edit = reference.interleave(
        [source, EDIT_PROMPT], seed=SEED, cfg_text_scale=4.0, cfg_img_scale=2.0, cfg_interval=(0.0, 1.0),
        cfg_renorm_type="text_channel", num_inference_steps=steps,
    )  # fmt: skip
    return {"t2i": np.asarray(t2i.image), "edit": np.asarray(edit.image)}


# --- serving ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    """The tiny model builder's kind."""
    deploy: str
    steps: int
    guidance: float = 1.5


CASES = (
    Case("glm-image", "glm-image", "tiny_glm_image_cpu.yaml", steps=4),
    Case("bagel", "bagel", "tiny_bagel_cpu.yaml", steps=6),
)


def overrides(case: Case, device: str) -> dict[str, Any]:
    """vLLM's defaults on the GPU (the CPU test files pin eager execution), greedy AR for a reference."""
    ar: dict[str, Any] = {"default_sampling_params": {"temperature": 0.0}}
    dit: dict[str, Any] = {"num_inference_steps": case.steps}
    if device == "cuda":
        ar["enforce_eager"] = False  # CUDA graphs: vLLM's default
    return {"0": ar, "1": dit}


def serve_and_check(case: Case, model: Path, runner: str, device: str, out: Path, refs: dict) -> list[Row]:
    env = dict(os.environ) if device == "cuda" else cpu_test_env()
    env.pop(RUNNER_ENV, None)
    if runner == "v2":
        env[RUNNER_ENV] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    port = free_port()
    argv = [
        bin_script("vllm"), "serve", str(model), "--omni", "--port", str(port),
        "--deploy-config", str(REPO / "deploy" / case.deploy),
        "--stage-overrides", json.dumps(overrides(case, device)),
    ]  # fmt: skip
    rows: list[Row] = []
    log = out / f"{case.name}-{runner}.log"
    server = ServerProcess(argv, port=port, log_path=log, env=env)
    try:
        server.start()
        try:
            server.wait_ready(timeout=600)
        except (RuntimeError, TimeoutError) as exc:
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            return [Row(case.name, runner, "start", "no server", detail=f"{last[:150]} (log: {log})")]
        started = Row(
            case.name, runner, "start", "ready", verdict="pass", detail=runner_seen(server.log_text())
        )
        rows.append(started)
        body = {"prompt": PROMPT, "size": f"{SIZE}x{SIZE}", "seed": SEED, "response_format": "b64_json"}
        rows.append(request_row(case, runner, "t2i", server, "/v1/images/generations", body, None, refs))
        edit = {"prompt": EDIT_PROMPT, "seed": str(SEED), "response_format": "b64_json"}
        if case.name == "glm-image":
            edit["size"] = f"{SIZE}x{SIZE}"
        files = {"image": ("in.png", source_png(), "image/png")}
        rows.append(request_row(case, runner, "edit", server, "/v1/images/edits", edit, files, refs))
    finally:
        server.stop()
    return rows


def runner_seen(log: str) -> str:
    """What the AR stage's worker said it runs (``ar_worker/worker_mixin.py: log_model_runner``)."""
    graphs = "CUDA graphs captured" if "Graph capturing finished" in log else "no CUDA graphs"
    if "AR stage on vLLM's V2 model runner" in log:
        runner = "V2 runner"
    elif "AR stage on vLLM's V1 model runner" in log:
        runner = "V1 runner"
    else:
        runner = "runner not reported"
    return f"{runner}; {graphs}"


def request_row(
    case: Case, runner: str, name: str, server: ServerProcess, path: str, body: dict, files: Any, refs: dict
) -> Row:
    row = Row(case.name, runner, name, "")
    try:
        if files is None:
            response = http_client.post(server.base_url + path, json=body, timeout=600)
        else:
            response = http_client.post(server.base_url + path, data=body, files=files, timeout=600)
    except httpx.HTTPError as exc:
        row.status, row.detail = "no answer", f"{type(exc).__name__}: {exc}"
        return row
    row.status = str(response.status_code)
    if response.status_code != 200:
        message = (
            response.json().get("error", {}).get("message", response.text[:200]) if response.text else ""
        )
        row.detail = message[:200]
        return row
    return compare(row, pixels(response.json()["data"][0]["b64_json"]), refs[name])


def run(device: str, runners: list[str], out: Path, models: list[str]) -> Report:
    from vllm_omni_plugin.tiny_models import build

    report = Report()
    cache = Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", REPO / ".cache" / "tiny_models"))
    for case in CASES:
        if case.name not in models:
            continue
        model = build(case.kind, cache / case.kind)
        start = time.perf_counter()
        if case.name == "glm-image":
            refs = glm_image_references(model, case.steps, case.guidance)
        else:
            refs = bagel_references(model, case.steps)
        print(f"{case.name}: CPU references in {time.perf_counter() - start:.1f}s", flush=True)
        for runner in runners:
            start = time.perf_counter()
            report.rows.extend(serve_and_check(case, model, runner, device, out, refs))
            print(f"{case.name} / {runner}: {time.perf_counter() - start:.1f}s", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_omni_testkit.harness.gpu_check", description=__doc__
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--runners", default="choice", help="comma list of: choice (vLLM's own: V2 on CUDA), v2 (forced)"
    )
    parser.add_argument("--models", default="glm-image,bagel")
    parser.add_argument("--out", default="gpu_check_out", help="where server logs and the table go")
    args = parser.parse_args(argv)
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    if not set(runners) <= {"choice", "v2"}:
        print("error: --runners takes choice and/or v2", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(args.device, runners, out, [m.strip() for m in args.models.split(",")])
    table = report.table()
    (out / "summary.txt").write_text(table + "\n")
    print(table)
    print(
        "gpu_check: " + ("every row passed" if report.passed else "FAILED (see the rows above and the logs)")
    )
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
