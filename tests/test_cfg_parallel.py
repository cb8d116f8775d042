"""CFG parallelism (``diffusion/cfg_parallel.py``, ``diffusion/peer_group.py``) over two processes with gloo, on tiny SD3 (batched guidance),
FLUX (embedded guidance: rows split as data), Qwen-Image (true CFG), GLM-Image (two calls a step: rank 1
computes each step's second call while rank 0 computes the first) and BAGEL (rows of request x branch over
their own contexts, which a peer keeps for the batch; also over three processes): every image
equals the single-process engine's within one level of 255 (the ranks compute different row counts than
one process does, and a matmul's float sums depend on its rows); rank 0 computes only its share of each
forward (counted by a pre-hook on its denoiser); caching, step batching and the step loop go through the
group; a peer
that dies costs no request; a peer that cannot load stops start-up in one line; closing leaves no peer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from test_bagel_dit import STEPS as BAGEL_STEPS
from test_bagel_dit import edit, t2i
from test_step_batching import BAGEL_RUNNER, ask, assert_within_one_level, glm_edit
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
from vllm_omni_plugin.diffusion.cfg_parallel import split_rows
from vllm_omni_plugin.diffusion.diffusers_runner import denoiser_of
from vllm_omni_plugin.diffusion.peer_group import DenoiserGroup, PeerSpec
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec, fixed_plan
from vllm_omni_plugin.families.bagel.transformer import AttentionRows
from vllm_omni_plugin.processes import ProcessId, cmdline, descendants
from vllm_omni_testkit.harness import http_client

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

STEPS = 4
ROWS_PER_REQUEST = {"sd3": 2, "flux": 1, "qwen_image": 1}
"""Rows a guided request puts in one denoiser call: SD3 batches its guidance pair; FLUX embeds guidance;
Qwen-Image calls once per branch."""


def test_rows_split_contiguously_and_evenly() -> None:
    assert split_rows(4, 2) == [range(0, 2), range(2, 4)]
    assert split_rows(3, 2) == [range(0, 2), range(2, 3)]
    assert split_rows(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_rows(1, 2) == [range(0, 1), range(1, 1)]


class Pair:
    """A family's single-process engine and its two-rank CFG-parallel engine, loaded once; rank 0's
    denoiser rows per forward recorded by a pre-hook on the denoiser itself (a hook on the top module
    leaves the forwards split; one inside it would keep them on rank 0, as LoRA's do)."""

    def __init__(self, model: Path, **kwargs: Any) -> None:
        self.plain = DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4, **kwargs))
        self.parallel = DiffusionEngine(
            model, DiffusionEngineConfig(max_batch_size=4, cfg_parallel_size=2, **kwargs)
        )
        self.rows: list[int] = []
        denoiser = denoiser_of(self.parallel.runner.pipe)
        self._hook = denoiser.register_forward_pre_hook(
            lambda module, args, kwargs: self.rows.append(int(kwargs["hidden_states"].shape[0])),
            with_kwargs=True,
        )

    def close(self) -> None:
        self._hook.remove()
        self.plain.close()
        self.parallel.close()


@pytest.fixture(scope="module")
def pairs(request: pytest.FixtureRequest) -> Iterator[dict[str, Pair]]:
    loaded: dict[str, Pair] = {}

    class Lazy(dict):
        def __missing__(self, family: str) -> Pair:
            loaded[family] = Pair(request.getfixturevalue(f"tiny_{family}"))
            return loaded[family]

    yield Lazy()
    for pair in loaded.values():
        pair.close()


def _images(results: list[Any]) -> list[np.ndarray]:
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.image for r in results]


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_a_cfg_parallel_engine_gives_the_single_process_images(pairs: dict[str, Pair], family: str) -> None:
    pair = pairs[family]
    batch = [ask(f"{family}-{i}", seed=i, steps=STEPS, family=family) for i in range(2)]
    expected = _images(pair.plain.generate(batch))
    pair.rows.clear()
    split_before = pair.parallel.context.parallel_denoiser.split_calls
    got = _images(pair.parallel.generate(batch))
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)
    split = pair.parallel.context.parallel_denoiser.split_calls - split_before
    if family == "qwen_image":
        # Its branches are two calls a step: the first step's are cut by rows (one of each call's two
        # here); then rank 0 computes each step's first call whole while rank 1 computes the second.
        assert pair.rows == [1, 1] + [2] * (STEPS - 1) and split == 2
        return
    # Two requests: rank 0 computed half of every forward's rows (SD3: the unconditional branch of both).
    calls = len(pair.rows)
    assert calls > 0 and pair.rows == [ROWS_PER_REQUEST[family]] * calls
    assert split == calls


@pytest.mark.parametrize("family", ["qwen_image", "glm_image"])
def test_a_request_whose_branches_are_two_calls_has_its_second_call_computed_on_rank_1(
    pairs: dict[str, Pair], family: str
) -> None:
    """Qwen-Image's true CFG and GLM-Image make a guided step's branches as two calls of one row: after
    the first step (where rank 0 learns what the branches share), rank 1 computes each step's second call
    while rank 0 computes the first."""
    pair = pairs[family]
    request = ask(f"{family}-paired", seed=11, steps=STEPS, family=family)
    expected = _images(pair.plain.generate([request]))
    pair.rows.clear()
    got = _images(pair.parallel.generate([request]))
    assert_within_one_level(got[0], expected[0])
    assert pair.rows == [1] * (2 + (STEPS - 1))  # the first step's two calls, then one a step


def loop_images(
    engine: DiffusionEngine, first: Any, late: list[Any], join_at: int = 2
) -> dict[str, np.ndarray]:
    """Each request's image from ``engine``'s step loop (its default batching): ``first`` alone, ``late``
    joining after ``join_at`` steps."""
    from test_step_loop import run
    from vllm_omni_plugin.diffusion.step_loop import StepLoop

    assert engine.batching == "loop"
    loop = StepLoop(engine.step_family, max_rows=16)
    loop.add(first.request_id, first)
    done = run(loop, until=join_at)
    for r in late:
        loop.add(r.request_id, r)
    done |= run(loop)
    return {request_id: finished.image for request_id, finished in done.items()}


@pytest.mark.parametrize("family", ["sd3", "qwen_image"])
def test_the_step_loop_cuts_every_forward_of_several_rows_over_the_group(
    pairs: dict[str, Pair], family: str
) -> None:
    """CFG parallelism as a layer of the step loop: requests joining mid-way (one unguided, leaving
    early) share forwards whose rows are cut over the ranks; each gets the image its whole call gives
    alone in one process (within 1/255). A forward of one row (Qwen-Image's branches of a request alone)
    stays on rank 0."""
    pair = pairs[family]
    first = ask(f"{family}-loop-0", seed=30, steps=STEPS, family=family)
    late = [
        ask(f"{family}-loop-1", seed=31, steps=STEPS, family=family),
        ask(f"{family}-loop-2", seed=32, steps=2, guidance=1.0, family=family),
    ]
    expected = {r.request_id: _images(pair.plain.generate([r]))[0] for r in (first, *late)}
    plain_rows: list[int] = []
    hook = denoiser_of(pair.plain.runner.pipe).register_forward_pre_hook(
        lambda module, args, kwargs: plain_rows.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    try:
        plain = loop_images(pair.plain, first, late)
    finally:
        hook.remove()
    pair.rows.clear()
    split_before = pair.parallel.context.parallel_denoiser.split_calls
    got = loop_images(pair.parallel, first, late)
    for request_id, image in expected.items():
        assert_within_one_level(got[request_id], image)
        assert_within_one_level(plain[request_id], image)
    assert pair.rows == [(rows + 1) // 2 for rows in plain_rows]  # rank 0's share of each forward
    split = pair.parallel.context.parallel_denoiser.split_calls - split_before
    assert split == sum(rows > 1 for rows in plain_rows) and max(plain_rows) >= 3


def test_a_glm_image_edit_pairs_its_branches_around_its_source_image_cache(pairs: dict[str, Pair]) -> None:
    """An edit's first call writes its source image's keys and values (rank 0), each step's first call
    reads them (rank 0), and its second skips them: rank 1 computes that one, without the cache."""
    pair = pairs["glm_image"]
    request = glm_edit("glm-edit-paired", seed=12, steps=STEPS)
    expected = _images(pair.plain.generate([request]))
    pair.rows.clear()
    got = _images(pair.parallel.generate([request]))
    assert_within_one_level(got[0], expected[0])
    assert pair.rows == [1] * (1 + 2 + (STEPS - 1))


def test_an_unguided_request_alone_runs_on_rank_0(pairs: dict[str, Pair]) -> None:
    pair = pairs["sd3"]
    request = ask("alone", seed=5, steps=STEPS, guidance=1.0)
    expected = _images(pair.plain.generate([request]))
    pair.rows.clear()
    split_before = pair.parallel.context.parallel_denoiser.split_calls
    got = _images(pair.parallel.generate([request]))
    assert np.array_equal(got[0], expected[0])  # one row: nothing to split, the same forward
    assert pair.rows == [1] * STEPS
    assert pair.parallel.context.parallel_denoiser.split_calls == split_before


def test_cached_requests_split_the_steps_they_compute(pairs: dict[str, Pair]) -> None:
    pair = pairs["sd3"]
    fixed = StepCacheSpec(policy="fixed", warmup_steps=1, final_steps=0).resolved()
    computed = sum(fixed_plan(fixed, STEPS))
    assert computed < STEPS
    batch = [ask(f"cached-{i}", seed=i, steps=STEPS, cache=fixed) for i in range(2)]
    expected = _images(pair.plain.generate(batch))
    pair.rows.clear()
    got = _images(pair.parallel.generate(batch))
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)
    assert pair.rows == [2] * computed  # the steps no request computes skip the forward whole


def _step_batched(engine: DiffusionEngine, batch: list[Any]) -> list[np.ndarray]:
    """``batch`` admitted as one group of a step-batching engine and run as the stage runs it (a thread)."""
    groups, failed = engine.admit(batch)
    assert not failed and len(groups) == 1
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.extend(engine.run_group(groups[0])))
    thread.start()
    thread.join(timeout=300)
    return _images(results)


def test_a_step_batched_group_goes_through_the_group(tiny_sd3: Path) -> None:
    plain = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=4))
    batch = [ask(f"step-{i}", seed=i, steps=STEPS) for i in range(2)]
    expected = _images(plain.generate(batch))
    plain.close()
    engine = DiffusionEngine(
        tiny_sd3, DiffusionEngineConfig(max_batch_size=4, batching="step", cfg_parallel_size=2)
    )
    try:
        got = _step_batched(engine, batch)
        assert engine.context.parallel_denoiser.split_calls == STEPS
    finally:
        engine.close()
    for a, b in zip(got, expected, strict=True):
        assert_within_one_level(a, b)


@pytest.mark.parametrize("field", ["cfg_parallel_size", "sequence_parallel_size"])
def test_a_dead_peer_costs_no_request_and_closing_leaves_no_peer(
    tiny_sd3: Path, caplog: pytest.LogCaptureFixture, field: str
) -> None:
    engine = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=4, **{field: 2}))
    group = engine.parallel
    assert group is not None and group.alive
    batch = [ask(f"dead-{i}", seed=i, steps=STEPS) for i in range(2)]
    try:
        expected = _images(engine.generate(batch))
        peer = group.processes[0]
        peer.kill()
        peer.wait(timeout=30)
        with caplog.at_level("ERROR"):
            got = _images(engine.generate(batch))
        assert group.failed is not None and not group.alive
        assert "computes every forward whole from now on" in caplog.text
        for a, b in zip(got, expected, strict=True):
            assert_within_one_level(a, b)
    finally:
        engine.close()
    healthy = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=4, **{field: 2}))
    processes = healthy.parallel.processes
    assert all(p.poll() is None for p in processes)
    healthy.close()
    assert all(p.poll() is not None for p in processes)


def test_a_start_up_that_fails_leaves_no_peer(tiny_sd3: Path, tiny_bagel: Path) -> None:
    """A refusal the engine can make before its peers start is made before (BAGEL's runner compiles no
    blocks); a start-up step that fails after they started (a warm-up size the pipeline refuses) stops
    them before the error goes up."""
    import os

    from vllm_omni_plugin.diffusion.blocks import CompileSpec

    # the peers there before (the module's engines', and an earlier test's that may still be leaving):
    # a failed start adds none
    before = set(_peers(os.getpid()))
    with pytest.raises(ValueError, match="cannot compile its denoiser's blocks"):
        DiffusionEngine(
            tiny_bagel,
            DiffusionEngineConfig(
                runner_cls=BAGEL_RUNNER, cfg_parallel_size=2, compile=CompileSpec(blocks=True)
            ),
        )
    assert set(_peers(os.getpid())) <= before
    with pytest.raises(ValueError):
        DiffusionEngine(
            tiny_sd3,
            DiffusionEngineConfig(
                cfg_parallel_size=2, compile=CompileSpec(blocks=True, warmup_sizes=[(65, 64)])
            ),
        )
    assert set(_peers(os.getpid())) <= before


def test_a_peer_that_cannot_load_stops_start_up_in_one_line(tmp_path: Path) -> None:
    spec = PeerSpec(
        model=str(tmp_path / "no-such-model"),
        subfolder="transformer",
        module="diffusers",
        qualname="SD3Transformer2DModel",
        dtype="float32",
        device="cpu",
        num_threads=1,
    )
    with pytest.raises(
        RuntimeError, match=r"the denoiser group's peers did not start: rank 1 exited with code 1"
    ):
        DenoiserGroup(2, [spec])


# --- BAGEL: rows are (request, branch) pairs over their own contexts, which a peer keeps for the batch ---


class BagelRanks:
    """BAGEL's single-process engine and a CFG-parallel one of ``size`` ranks; the rows rank 0 computes
    per velocity forward, and the contexts rank 0 sends (one ``wire_state`` per rank and row set)."""

    def __init__(self, model: Path, size: int, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> None:
        self.plain = DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4, runner_cls=BAGEL_RUNNER))
        self.parallel = DiffusionEngine(
            model,
            DiffusionEngineConfig(
                max_batch_size=4, runner_cls=BAGEL_RUNNER, cfg_parallel_size=size, **kwargs
            ),
        )
        self.rows: list[int] = []
        self.sent: list[int] = []
        model_of = self.parallel.runner.transformer
        velocity = model_of.velocity

        def counted(latents: Any, rows: Any) -> Any:
            self.rows.append(int(latents.shape[0]))
            return velocity(latents, rows)

        monkeypatch.setattr(model_of, "velocity", counted)
        wire_state = AttentionRows.wire_state

        def sent(rows: AttentionRows) -> Any:
            self.sent.append(len(rows.lengths))
            return wire_state(rows)

        monkeypatch.setattr(AttentionRows, "wire_state", sent)

    def compare(self, batch: list[Any]) -> None:
        expected = _images(self.plain.generate(batch))
        self.rows.clear()
        self.sent.clear()
        got = _images(self.parallel.generate(batch))
        for a, b in zip(got, expected, strict=True):
            assert_within_one_level(a, b)

    def close(self) -> None:
        self.plain.close()
        self.parallel.close()


@pytest.fixture
def bagel_pair(tiny_bagel: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BagelRanks]:
    ranks = BagelRanks(tiny_bagel, 2, monkeypatch)
    yield ranks
    ranks.close()


def test_bagel_guidance_branches_split_over_two_ranks_with_contexts_sent_once_per_batch(
    bagel_pair: BagelRanks,
) -> None:
    """Two text-to-image requests (cond and no-text rows each) and two edits (cond, no-text and no-image
    rows each): rank 0 computes half the rows of each forward (rounded up); rank 1's rows' contexts go
    to it once for each set of rows, not once a step."""
    forwards = BAGEL_STEPS - 1
    bagel_pair.compare([t2i("t0", 1), t2i("t1", 2)])
    # guidance runs at the steps with t > 0.4 (text-to-image's interval): 4 rows, then the 2 cond rows
    guided = sum(bagel_pair.rows[i] == 2 for i in range(forwards))
    assert bagel_pair.rows == [2] * guided + [1] * (forwards - guided) and 0 < guided < forwards
    assert bagel_pair.sent == [2, 1]  # rank 1's two no-text rows, then its one cond row
    bagel_pair.compare([edit("e0", 3, image_len=40), edit("e1", 4, image_len=24, text_len=5)])
    assert bagel_pair.rows == [3] * forwards and bagel_pair.sent == [3]


def test_bagel_edit_branches_run_one_per_rank_over_three_ranks(
    tiny_bagel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cfg_parallel_size: 3``: an edit's three branches (cond, no text, no image) on three ranks."""
    ranks = BagelRanks(tiny_bagel, 3, monkeypatch)
    try:
        ranks.compare([edit("e", 5)])
        assert ranks.rows == [1] * (BAGEL_STEPS - 1) and ranks.sent == [1, 1]
        # fewer rows than ranks at the unguided steps: rank 2 gets no call
        ranks.compare([t2i("t", 6)])
        assert set(ranks.rows) == {1} and ranks.sent == [1]
    finally:
        ranks.close()


def test_a_bagel_step_batched_group_splits_and_a_dead_peer_costs_no_request(
    tiny_bagel: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ranks = BagelRanks(tiny_bagel, 2, monkeypatch, batching="step")
    engine = ranks.parallel
    batch = [edit("s0", 7), edit("s1", 8, image_len=24)]
    try:
        expected = _images(ranks.plain.generate(batch))
        for a, b in zip(_step_batched(engine, batch), expected, strict=True):
            assert_within_one_level(a, b)
        assert ranks.rows == [3] * (BAGEL_STEPS - 1)
        group = engine.parallel
        assert group is not None
        group.processes[0].kill()
        group.processes[0].wait(timeout=30)
        ranks.rows.clear()
        with caplog.at_level("ERROR"):
            got = _step_batched(engine, batch)
        assert "computes every forward whole from now on" in caplog.text and not group.alive
        for a, b in zip(got, expected, strict=True):
            assert_within_one_level(a, b)
        assert ranks.rows[-1] == 6  # every row on rank 0 now
    finally:
        ranks.close()


def _peers(root: int) -> list[ProcessId]:
    """The denoiser groups' peer processes under ``root`` (not another user's of the machine)."""
    found = [
        ProcessId.of(pid) for pid in descendants(root) if "-m vllm_omni_plugin.diffusion.peer" in cmdline(pid)
    ]
    return [p for p in found if p is not None]


def _server(model: Path, deploy: Path, tmp_path: Path) -> Any:
    """``vllm serve model --omni --deploy-config deploy`` on a free port (not started yet)."""
    from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port

    port = free_port()
    return ServerProcess(
        [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
         "--port", str(port), "--host", "127.0.0.1"],
        port=port,
        log_path=tmp_path / "server.log",
    )  # fmt: skip


@pytest.mark.server
@pytest.mark.parametrize("field", ["cfg_parallel_size", "sequence_parallel_size"])
def test_a_served_parallel_stage_gives_diffusers_images_and_stops_its_peer(
    tiny_sd3: Path, tmp_path: Path, field: str
) -> None:
    """``vllm serve --omni`` with ``cfg_parallel_size: 2`` or ``sequence_parallel_size: 2``: the stage's
    replica starts its peer, the images equal a stock diffusers call's, and stopping the server leaves
    no peer."""
    import base64
    import io

    from PIL import Image

    from vllm_omni_testkit.reference.diffusers import reference_image

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"pipeline: diffusion\nstages:\n  - {{stage_id: 0, {field}: 2}}\n")
    server = _server(tiny_sd3, deploy, tmp_path)
    with server:
        server.wait_ready(timeout=300)
        assert server.proc is not None
        started = _peers(server.proc.pid)
        assert len(started) == 1
        body = {"prompt": "a red fox", "size": "64x64", "n": 2, "num_inference_steps": STEPS,
                "guidance_scale": 3.0, "seed": 21}  # fmt: skip
        answer = http_client.post(f"{server.base_url}/v1/images/generations", json=body, timeout=300)
        answer.raise_for_status()
        for i, item in enumerate(answer.json()["data"]):
            image = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))
            expected = reference_image(
                tiny_sd3, prompt="a red fox", seed=21 + i, height=64, width=64, steps=STEPS, guidance=3.0
            )
            assert_within_one_level(image, expected)
    assert not any(p.alive() for p in started)


@pytest.mark.server
def test_a_served_bagel_with_a_cfg_parallel_dit_gives_the_reference_images(
    tiny_bagel: Path, tmp_path: Path
) -> None:
    """``vllm serve`` of BAGEL with ``cfg_parallel_size: 2`` on its DiT stage: the DiT replica starts one
    peer, text-to-image and an edit (three branches over two ranks) equal BAGEL's own inference, and
    stopping the server leaves no peer."""
    import openai
    import yaml

    from test_bagel_server import DEPLOY, assert_reference_images

    config = yaml.safe_load(Path(DEPLOY).read_text())
    config["stages"][1]["cfg_parallel_size"] = 2
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(config))
    server = _server(tiny_bagel, deploy, tmp_path)
    with server:
        server.wait_ready(timeout=300)
        assert server.proc is not None
        started = _peers(server.proc.pid)
        assert len(started) == 1
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)
        assert_reference_images(client, client.models.list().data[0].id, tiny_bagel)
    assert not any(p.alive() for p in started)
