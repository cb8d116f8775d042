"""``vllm bench serve --omni`` against a plain OpenAI-compatible image server written here (a few Starlette
routes that answer the Images API and chat with one PNG, served by uvicorn on a thread): it is not tied to
our server. The stock ``vllm`` script hands the command to the plugin; the saved result is vLLM's JSON
shape and matches the requests the stub received, request for request. Against our own servers:
``test_diffusers_serve.py`` (the tiny SD3) and ``test_api_server.py`` (the tiny GLM-Image)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_omni_plugin.bench.serve import main as bench_main
from vllm_omni_testkit.harness.server import bin_script, cpu_test_env, free_port

pytestmark = pytest.mark.processes


def tiny_png() -> str:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


class StubImageServer:
    """OpenAI's Images API and image chat, answered at once with one small PNG per image; every request
    body it read is kept (``received``)."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.port = free_port()
        image = tiny_png()

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "stub-images", "object": "model"}]})

        async def generations(request: Request) -> Response:
            body = await request.json()
            self.received.append({"route": "generations", **body})
            return JSONResponse({"created": 0, "data": [{"b64_json": image}] * int(body.get("n", 1))})

        async def edits(request: Request) -> Response:
            form = await request.form()
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            upload = form["image"]
            assert not isinstance(upload, str)
            source = Image.open(io.BytesIO(await upload.read()))
            self.received.append({"route": "edits", "source_size": list(source.size), **fields})
            return JSONResponse({"created": 0, "data": [{"b64_json": image}] * int(fields.get("n", 1))})

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.received.append({"route": "chat", **body})
            part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
            return JSONResponse(
                {"choices": [{"index": 0, "message": {"role": "assistant", "content": [part]}}]}
            )

        app = Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/v1/images/generations", generations, methods=["POST"]),
                Route("/v1/images/edits", edits, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StubImageServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the stub server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def stub() -> Iterator[StubImageServer]:
    with StubImageServer() as server:
        yield server


def saved_result(directory: Path) -> dict[str, Any]:
    (path,) = directory.glob("*.json")
    return json.loads(path.read_text())


def test_the_stock_vllm_script_runs_it_and_the_saved_result_is_what_was_sent(
    stub: StubImageServer, tmp_path: Path
) -> None:
    argv = [bin_script("vllm"), "bench", "serve", "--omni", "--base-url", stub.url, "--num-prompts", "6",
            "--request-rate", "40", "--max-concurrency", "2", "--size", "64x64,32x48", "--num-inference-steps",
            "2,4", "--guidance-scale", "3.5", "--seed", "7", "--goodput", "e2el:60000", "--metric-percentiles",
            "50,99", "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--metadata", "run=ci",
            "--num-warmups", "2"]  # fmt: skip
    done = subprocess.run(argv, env=cpu_test_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Serving Benchmark Result (images)" in done.stdout and "Image throughput" in done.stdout
    result = saved_result(tmp_path)
    # vLLM's result fields, with images where it has tokens
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "failed", "request_throughput", "request_goodput", "mean_e2el_ms",
                "median_e2el_ms", "p50_e2el_ms", "p99_e2el_ms", "latencies", "errors"):  # fmt: skip
        assert key in result, key
    assert (result["model_id"], result["num_prompts"], result["request_rate"], result["max_concurrency"]) == (
        "stub-images", 6, 40.0, 2,
    )  # fmt: skip
    assert (result["completed"], result["failed"], result["total_images"], result["run"]) == (6, 0, 6, "ci")
    assert result["max_concurrent_requests"] <= 2 and result["request_goodput"] > 0
    # request for request, what the stub received is what the result says was sent
    warmups, measured = stub.received[:2], stub.received[2:]  # the warm-ups first, not counted
    assert [w["seed"] for w in warmups] == [7, 8]
    sent = sorted(result["requests"], key=lambda r: r["seed"])
    got = sorted(measured, key=lambda r: r["seed"])
    assert [r["seed"] for r in sent] == list(range(7, 13))
    for asked, received in zip(sent, got, strict=True):
        assert received["route"] == "generations" and received["model"] == "stub-images"
        assert (received["prompt"], received["size"], received["num_inference_steps"]) == (
            asked["prompt"], asked["size"], asked["num_inference_steps"],
        )  # fmt: skip
        assert received["guidance_scale"] == 3.5 and received["n"] == 1
    assert {r["size"] for r in sent} <= {"64x64", "32x48"} and {r["num_inference_steps"] for r in sent} <= {
        2,
        4,
    }


def test_edits_and_chat_workloads_and_clear_errors(stub: StubImageServer, tmp_path: Path, capsys) -> None:
    common = ["--omni", "--base-url", stub.url, "--num-prompts", "3", "--size", "48x32", "--save-result"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red door"}\n{"prompt": "a blue window"}\n')
    assert bench_main([*common, "--workload", "edits", "--dataset-name", "prompts", "--dataset-path",
                       str(prompts), "--result-dir", str(tmp_path / "edits")]) == 0  # fmt: skip
    edits = [r for r in stub.received if r["route"] == "edits"]
    assert sorted(r["prompt"] for r in edits) == ["a blue window", "a red door", "a red door"]  # sent at once
    assert all(r["source_size"] == [48, 32] and r["size"] == "48x32" for r in edits)  # sources of the size
    assert saved_result(tmp_path / "edits")["completed"] == 3

    assert bench_main([*common, "--workload", "chat", "--result-dir", str(tmp_path / "chat")]) == 0
    chats = [r for r in stub.received if r["route"] == "chat"]
    assert len(chats) == 3 and all(r["modalities"] == ["image"] for r in chats)
    assert saved_result(tmp_path / "chat")["total_images"] == 3

    # mistakes: one line and exit code 2, no traceback
    capsys.readouterr()
    for argv, says in (
        (["--base-url", f"http://127.0.0.1:{free_port()}"], "cannot reach"),
        (["--base-url", stub.url, "--size", "big"], "--size 'big': expected WIDTHxHEIGHT"),
        (["--base-url", stub.url, "--goodput", "e2el=5"], "expected METRIC:MILLISECONDS"),
        (["--base-url", stub.url, "--dataset-name", "prompts", "--dataset-path", str(tmp_path / "none")],
         "No such file"),
    ):  # fmt: skip
        assert bench_main(["--omni", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err, err
