"""Step-level batching (``batching: step``) in the diffusion engine and the stage's loop, on tiny SD3, FLUX
and Qwen-Image: requests that join a running batch mid-way, leave it early (fewer steps), are aborted
mid-way or mix guidance scales each get the image they get alone (at most 1/255 apart), while their
denoiser calls really share forwards. Rows are held at a step end by their step callback (an event the
test sets), so what runs together is decided by the test, not by the machine's speed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_omni_plugin.diffusion import (
    DiffusionEngine,
    DiffusionEngineConfig,
    DiffusionRequest,
    DiffusionResult,
)
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput, StageDiffusionCoreRequest
from vllm_omni_plugin.stage.diffusion_loop import DiffusionBatchLoop
from vllm_omni_testkit.holds import HOLD_DIR_ENV, HOOKS

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

SIZE = 64
FAMILIES = ("sd3", "flux", "qwen_image", "glm_image", "bagel")
BAGEL_RUNNER = "vllm_omni_plugin.families.bagel.runner.BagelGenerationRunner"
CODEBOOK = 16384
"""The tiny GLM-Image's VQ codebook: its prior token ids are drawn below it."""
WAIT_S = 60.0
"""A bound on waits for what the test itself sets in motion (never reached unless something hangs)."""


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[str], tuple[DiffusionEngine, DiffusionEngine]]]:
    """Per family: (an engine with step batching, the same model batching whole requests), loaded once."""
    loaded: dict[str, tuple[DiffusionEngine, DiffusionEngine]] = {}

    def get(family: str) -> tuple[DiffusionEngine, DiffusionEngine]:
        if family not in loaded:
            model = request.getfixturevalue(f"tiny_{family}")
            runner = {"runner_cls": BAGEL_RUNNER} if family == "bagel" else {}
            args = {"max_batch_size": 4, **runner}
            stepped = DiffusionEngine(model, DiffusionEngineConfig(batching="step", **args))
            loaded[family] = (stepped, DiffusionEngine(model, DiffusionEngineConfig(**args)))
        return loaded[family]

    yield get
    for stepped, _ in loaded.values():
        stepped.close()


def ask(
    request_id: str, seed: int, steps: int = 4, guidance: float = 4.0, family: str = "sd3", **kw: Any
) -> DiffusionRequest:
    """A 64x64 request of ``family`` (GLM-Image's with random prior tokens: its DiT takes any)."""
    fields: dict[str, Any] = {
        "request_id": request_id,
        "prompt": f"a small red house number {seed}",
        "height": SIZE,
        "width": SIZE,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
        **kw,
    }
    if family == "bagel":  # its contexts as the thinker would send them (random: the DiT takes any)
        import msgspec

        from test_bagel_dit import t2i

        request = t2i(request_id, seed, cfg_text_scale=guidance)
        sampling = msgspec.structs.replace(request.sampling, num_inference_steps=steps)
        return msgspec.structs.replace(request, sampling=sampling)
    if family != "glm_image":
        return DiffusionRequest(**fields)
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

    fields["prompt"] = "a small red house"  # its DiT reads quoted text only: one glyph length for all
    fields["prior_token_ids"] = token_ids((SIZE // 16) ** 2, seed)
    return GlmImageRequest(**fields)


def glm_edit(request_id: str, seed: int, steps: int = 4) -> DiffusionRequest:
    """A 64x64 GLM-Image edit of a random source image (its prior tokens random too)."""
    image = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    grid = [1, SIZE // 16, SIZE // 16]
    return ask(
        request_id, seed, steps=steps, family="glm_image", images=[image],
        prior_token_image_ids=[token_ids(grid[1] * grid[2], seed + 100)], source_image_grid_thw=[grid],
    )  # fmt: skip


def token_ids(count: int, seed: int) -> Any:
    import torch

    return torch.randint(0, CODEBOOK, (count,), generator=torch.Generator().manual_seed(seed))


def assert_within_one_level(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= 1, diff.max()
    assert (diff > 0).mean() < 0.01


class Rows:
    """Groups of requests run on threads of their own (as the stage's loop runs them), each stoppable at
    any of its step ends; a group is named by its requests' ids."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine
        self.results: dict[str, DiffusionResult] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.holds: dict[tuple[str, int], tuple[threading.Event, threading.Event]] = {}
        self.aborted: set[str] = set()
        self.forwards: list[list[str]] = []
        engine.step_batcher.on_forward = lambda calls, rows, seconds: self.forwards.append(calls)

    def hold(self, request_id: str, step: int) -> None:
        """Hold the row at the end of its step ``step`` (0-based) until :meth:`release`."""
        self.holds[(request_id, step)] = (threading.Event(), threading.Event())

    def reached(self, request_id: str, step: int) -> None:
        assert self.holds[(request_id, step)][0].wait(WAIT_S)

    def release(self, request_id: str, step: int) -> None:
        self.holds[(request_id, step)][1].set()

    def start(self, *requests: DiffusionRequest) -> None:
        """One group of ``requests`` (compatible ones)."""
        groups, failed = self.engine.admit(requests)
        assert not failed and len(groups) == 1, (failed, groups)
        name = " ".join(r.request_id for r in requests)

        def on_step(step: int) -> None:
            hold = self.holds.get((name, step))
            if hold is not None:
                hold[0].set()
                assert hold[1].wait(WAIT_S)

        def run() -> None:
            results = self.engine.run_group(groups[0], self.aborted.__contains__, on_step)
            self.results.update((r.request_id, r) for r in results)

        thread = threading.Thread(target=run, daemon=True)
        self.threads[name] = thread
        thread.start()

    def wait_at_boundary(self, request_id: str) -> None:
        """Until the row's call waits at the step boundary."""
        batcher = self.engine.step_batcher
        with batcher._lock:
            assert batcher._lock.wait_for(lambda: request_id in batcher._waiting, WAIT_S)

    def join(self) -> dict[str, DiffusionResult]:
        for thread in self.threads.values():
            thread.join(WAIT_S)
            assert not thread.is_alive()
        return self.results


def forwards_alone(engine: DiffusionEngine, request: DiffusionRequest) -> int:
    """Denoiser forwards the request makes when it runs alone."""
    rows = Rows(engine)
    rows.start(request)
    rows.join()
    return len(rows.forwards)


def join_after_the_first_step(
    stepped: DiffusionEngine, whole: DiffusionEngine, requests: list[DiffusionRequest]
) -> list[list[str]]:
    """The first request held after its first step while the others come to wait at the boundary, then
    all released: each must get its image alone. Returns the forwards (the requests each ran)."""
    first = requests[0].request_id
    rows = Rows(stepped)
    rows.hold(first, 0)
    rows.start(requests[0])
    rows.reached(first, 0)
    for request in requests[1:]:
        rows.start(request)
        rows.wait_at_boundary(request.request_id)
    rows.release(first, 0)
    results = rows.join()
    for request in requests:
        assert results[request.request_id].ok, results[request.request_id].error
        assert_within_one_level(results[request.request_id].image, alone(whole, request))
    return rows.forwards


def alone(engine: DiffusionEngine, request: DiffusionRequest) -> np.ndarray:
    (result,) = engine.generate([request])
    assert result.ok, result.error
    return result.image


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_joining_mid_way_and_one_leaving_early_each_get_their_image_alone(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]], family: str
) -> None:
    stepped, whole = engines(family)
    first, late, short = (
        ask("first", 1, steps=5, family=family),
        ask("late", 2, steps=4, family=family),
        ask("short", 3, steps=2, family=family),
    )
    rows = Rows(stepped)
    rows.hold("first", 1)
    rows.start(first)
    rows.start(short)
    rows.reached("first", 1)  # first has run two steps (short at most two: it waits for first's boundary)
    rows.start(late)
    rows.wait_at_boundary("late")  # its first call waits for first's next one
    rows.release("first", 1)
    results = rows.join()
    for request in (first, late, short):
        result = results[request.request_id]
        assert result.ok, result.error
        assert_within_one_level(result.image, alone(whole, request))
    # late joined first's third step: some forward ran both
    assert any({"first", "late"} <= set(calls) for calls in rows.forwards), rows.forwards
    # short left after its second step: it was in as many forwards as when it runs alone (two steps; a
    # pipeline with true CFG, Qwen-Image, calls its denoiser twice a step)
    assert sum("short" in calls for calls in rows.forwards) == forwards_alone(stepped, short)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_aborted_row_leaves_at_its_step_end_and_the_others_are_unaffected(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]], family: str
) -> None:
    stepped, whole = engines(family)
    kept, dropped = ask("kept", 4, family=family), ask("dropped", 5, family=family)
    rows = Rows(stepped)
    rows.hold("dropped", 1)
    rows.start(kept)
    rows.start(dropped)
    rows.reached("dropped", 1)
    rows.aborted.add("dropped")
    rows.release("dropped", 1)
    results = rows.join()
    assert results["dropped"].aborted and results["dropped"].image is None
    # it ran two steps and no further: two steps' worth of the forwards it makes alone
    made_alone = forwards_alone(stepped, dropped)
    steps = stepped.runner.steps_of(dropped)
    assert sum("dropped" in calls for calls in rows.forwards) == 2 * made_alone // steps
    assert results["kept"].ok, results["kept"].error
    assert_within_one_level(results["kept"].image, alone(whole, kept))


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "glm_image"])
def test_an_aborted_request_leaves_the_forwards_of_its_group_at_its_next_step(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]], family: str
) -> None:
    """Three requests admitted together run as one group (one pipeline call); one aborted after the
    group's second step leaves the shared forwards from the next step on (its rows get zeros, which the
    call steps and drops), and the other two get the images they get alone."""
    stepped, whole = engines(family)
    requests = [ask(name, 40 + i, steps=4, family=family) for i, name in enumerate(("a", "b", "c"))]
    rows = Rows(stepped)
    shapes: list[int] = []
    stepped.step_batcher.on_forward = lambda calls, count, seconds: shapes.append(count)
    rows.hold("a b c", 1)
    rows.start(*requests)
    rows.reached("a b c", 1)
    before = len(shapes)
    rows.aborted.add("b")
    rows.release("a b c", 1)
    results = rows.join()
    per_step = shapes[0]  # rows of the group's forwards while all three run (3, or 6 with batched guidance)
    assert set(shapes[:before]) == {per_step} and shapes[before:]
    assert set(shapes[before:]) == {per_step * 2 // 3}, shapes
    for request in (requests[0], requests[2]):
        result = results[request.request_id]
        assert result.ok, result.error
        assert_within_one_level(result.image, alone(whole, request))


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_different_guidance_share_forwards_and_match_alone(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]], family: str
) -> None:
    stepped, whole = engines(family)
    requests = [ask(f"g{i}", 10 + i, guidance=g, family=family) for i, g in enumerate((1.0, 3.0, 7.5))]
    # g1 and g2 wait for g0's second step: from there on, the three go together
    forwards = join_after_the_first_step(stepped, whole, requests)
    assert [calls for calls in forwards if len(calls) > 1], forwards


def test_glm_image_edits_join_with_their_own_source_images(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]],
) -> None:
    """Each edit's denoiser reads the K/V its own source image wrote: joined per row, in row order."""
    stepped, whole = engines("glm_image")
    requests = [glm_edit("e0", 30), glm_edit("e1", 31), ask("t", 32, family="glm_image")]
    forwards = join_after_the_first_step(stepped, whole, requests)
    assert any({"e0", "e1"} <= set(calls) for calls in forwards), forwards


def test_bagel_edits_and_text_to_image_join_with_contexts_of_every_length(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]],
) -> None:
    """BAGEL's rows attend to their own contexts, of different lengths per request and branch: joined
    side by side (padded, masked), each request's image is still its own."""
    from test_bagel_dit import edit

    stepped, whole = engines("bagel")
    requests = [
        edit("e0", 40, image_len=40),
        edit("e1", 41, image_len=24, text_len=5),
        ask("t", 42, family="bagel"),
    ]
    forwards = join_after_the_first_step(stepped, whole, requests)
    assert any({"e0", "e1", "t"} <= set(calls) for calls in forwards), forwards


def test_a_forward_that_fails_fails_its_rows_and_the_engine_goes_on(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]],
) -> None:
    stepped, whole = engines("sd3")
    batcher = stepped.step_batcher
    real = batcher.module
    fail_once = [True]

    class FailingOnce:
        """The real denoiser, but its first call raises (an out-of-memory forward, say)."""

        def __call__(self, **kwargs: Any) -> Any:
            if fail_once.pop() if fail_once else False:
                raise RuntimeError("forward failed")
            return real(**kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    batcher.module = FailingOnce()
    try:
        rows = Rows(stepped)
        rows.start(ask("unlucky", 7))
        results = rows.join()
    finally:
        batcher.module = real
    assert not results["unlucky"].ok and "forward failed" in (results["unlucky"].error or "")
    assert stepped.step_batcher.in_flight == 0
    after = Rows(stepped)
    after.start(ask("next", 8))
    assert_within_one_level(after.join()["next"].image, alone(whole, ask("next", 8)))


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image", "glm_image"])
def test_steps_go_on_while_a_decode_runs_and_decodes_that_wait_together_run_as_one(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]], family: str
) -> None:
    """The diffusers families decode on the stage's decode thread: while it is held inside one group's
    decode, two other groups run every step of theirs (a step never waits on a decode), and their decodes,
    waiting together, then run as one VAE call; every image is the one its request gets alone."""
    stepped, whole = engines(family)
    decodes = stepped.decode_batcher
    assert decodes is not None
    real = decodes.module
    entered, release = threading.Event(), threading.Event()
    decoded: list[list[str]] = []

    class HeldFirst:
        """The real decode, its first call held until the test releases it."""

        def __call__(self, **kwargs: Any) -> Any:
            if not entered.is_set():
                entered.set()
                assert release.wait(WAIT_S)
            return real(**kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    decodes.module = HeldFirst()
    decodes.on_forward = lambda calls, rows, seconds: decoded.append(calls)
    try:
        rows = Rows(stepped)
        requests = [ask("first", 31, steps=2, family=family), ask("a", 32, family=family),
                    ask("b", 33, family=family)]  # fmt: skip
        rows.start(requests[0])
        assert entered.wait(WAIT_S)  # first's decode runs (held); a and b start after it
        rows.start(requests[1])
        rows.start(requests[2])
        with decodes._lock:  # both denoised all their steps and wait to decode
            assert decodes._lock.wait_for(lambda: len(decodes._waiting) == 2, WAIT_S)
        stepped_while_held = list(rows.forwards)
        release.set()
        results = rows.join()
    finally:
        release.set()
        decodes.module, decodes.on_forward = real, None
    assert sum("a" in calls for calls in stepped_while_held) == forwards_alone(stepped, requests[1])
    assert [sorted(calls) for calls in decoded[:2]] == [["first"], ["a", "b"]]
    for request in requests:
        result = results[request.request_id]
        assert result.ok, result.error
        assert_within_one_level(result.image, alone(whole, request))


def test_step_batching_is_refused_where_it_cannot_run(tiny_sd3: Path) -> None:
    with pytest.raises(ValueError, match="batching: step is not available: batch_invariant runs"):
        DiffusionEngine(tiny_sd3, DiffusionEngineConfig(batching="step", batch_invariant=True))
    with pytest.raises(ValueError, match="batching must be one of request, step"):
        DiffusionEngine(tiny_sd3, DiffusionEngineConfig(batching="rows"))


def test_the_stage_loop_serves_rows_as_they_come_and_drops_an_aborted_one(
    engines: Callable[[str], tuple[DiffusionEngine, DiffusionEngine]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from msgspec import to_builtins

    stepped, whole = engines("sd3")
    report = LoopReport()
    loop = DiffusionBatchLoop(stepped, 1, report, max_batch=2)
    loop.engine.close = lambda: None  # the module's engine outlives this loop
    monkeypatch.setenv(HOLD_DIR_ENV, str(tmp_path))
    for name, value in HOOKS.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "dit.step.armed").touch()
    serving = threading.Thread(target=loop.serve, daemon=True)
    serving.start()
    try:
        requests = [ask("a", 21), ask("b", 22), ask("c", 23)]
        bad = StageDiffusionCoreRequest(
            request_id="bad", stage_id=1, diffusion={"kind": "diffusion", "request_id": "bad"}
        )
        for request in requests:
            loop.inbox.add(
                StageDiffusionCoreRequest(
                    request_id=request.request_id, stage_id=1, diffusion=to_builtins(request)
                )
            )
        loop.inbox.add(bad)
        # the first row to end a step holds there; two run (max_batch 2), c and bad wait their turn
        held = _wait_file(tmp_path / "dit.step.reached").split()
        assert held == ["a", "b"]
        assert loop.abort(["b"]) == []  # running: dropped at its next step end, not from the queue
        assert loop.abort(["c"]) == ["c"]  # queued: dropped at once
        (tmp_path / "dit.step.release").touch()
        report.wait_for({"a", "b", "bad"})
    finally:
        loop.inbox.drain()
        serving.join(WAIT_S)
    assert not serving.is_alive()
    assert report.drops == {"b": "batch"}
    assert report.by_id["bad"].invalid and "bad diffusion request" in (report.by_id["bad"].error or "")
    assert_within_one_level(report.by_id["a"].image, alone(whole, requests[0]))
    assert set(report.by_id) == {"a", "bad"}


class LoopReport:
    """The loop's host as a test sees it: outputs and drops by request id."""

    def __init__(self) -> None:
        self.by_id: dict[str, StageDiffusionCoreOutput] = {}
        self.drops: dict[str, str] = {}
        self.changed = threading.Condition()

    def wait_for(self, ids: set[str]) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: ids <= self.by_id.keys() | self.drops.keys(), WAIT_S)

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        with self.changed:
            self.by_id.update((o.request_id, o) for o in outputs)
            self.changed.notify_all()

    def dropped(self, request_ids: list[str], where: str) -> None:
        with self.changed:
            self.drops.update((i, where) for i in request_ids)
            self.changed.notify_all()

    def progress(self, denoise_steps: Any, *, force: bool, steps: Any = None) -> None:
        pass


def _wait_file(path: Path) -> str:
    import time

    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)
    return path.read_text()
