"""Previews (``partial_images``): a request that asks for N gets N images decoded from its estimate of the
clean image at steps spread over its denoising, its neighbours in the batch get none, and nobody's final
image changes; on tiny SD3, FLUX, Qwen-Image, Qwen-Image-Edit, GLM-Image and BAGEL, batching whole
requests and step by step (where previews made on a group's thread reach the loop's report)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from test_step_batching import BAGEL_RUNNER, FAMILIES, WAIT_S, ask
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
from vllm_omni_plugin.diffusion.runner import preview_steps
from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput, StageDiffusionCoreRequest
from vllm_omni_plugin.stage.diffusion_loop import DiffusionBatchLoop

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

Previews = dict[str, list[tuple[int, np.ndarray]]]


@pytest.mark.parametrize(
    ("partial_images", "steps", "at"),
    [(0, 8, []), (1, 10, [4]), (2, 4, [0, 1]), (3, 28, [6, 13, 20]), (3, 3, [0, 1]), (2, 1, [])],
)
def test_preview_steps_spread_over_the_denoising_before_its_last_step(
    partial_images: int, steps: int, at: list[int]
) -> None:
    assert preview_steps(partial_images, steps) == at


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest) -> Iterator[Callable[[str, str], DiffusionEngine]]:
    loaded: dict[tuple[str, str], DiffusionEngine] = {}

    def get(family: str, batching: str = "request") -> DiffusionEngine:
        if (family, batching) not in loaded:
            model = request.getfixturevalue(f"tiny_{family}")
            runner = {"runner_cls": BAGEL_RUNNER} if family == "bagel" else {}
            loaded[family, batching] = DiffusionEngine(
                model, DiffusionEngineConfig(max_batch_size=4, batching=batching, **runner)
            )
        return loaded[family, batching]

    yield get
    for engine in loaded.values():
        engine.close()


def collecting(engine: DiffusionEngine, threads: set[str] | None = None) -> Previews:
    previews: Previews = {}
    lock = threading.Lock()

    def sink(request_id: str, index: int, image: Any) -> None:
        with lock:
            previews.setdefault(request_id, []).append((index, image))
            if threads is not None:
                threads.add(threading.current_thread().name)

    engine.on_preview = sink
    return previews


def with_previews(request: Any, partial_images: int) -> Any:
    return msgspec.structs.replace(request, partial_images=partial_images)


def edit_request(request_id: str, seed: int) -> Any:
    from vllm_omni_plugin.diffusion.params import DiffusionRequest

    source = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    # a small image asked: unasked, it is the source's size as the pipeline resizes it (about a megapixel),
    # and each of its decodes and previews then costs seconds here
    return DiffusionRequest(request_id=request_id, prompt=f"make it red {seed}", seed=seed, images=[source],
                            height=48, width=64, num_inference_steps=6, guidance_scale=2.0)  # fmt: skip


def request_of(family: str, request_id: str, seed: int) -> Any:
    if family == "qwen_image_edit":
        return edit_request(request_id, seed)
    return ask(request_id, seed, steps=6, family=family)


@pytest.mark.parametrize("family", [*FAMILIES, "qwen_image_edit"])
def test_a_request_gets_its_previews_and_no_final_image_changes(
    engines: Callable[[str, str], DiffusionEngine], family: str
) -> None:
    engine = engines(family)
    plain = [request_of(family, "a", 1), request_of(family, "b", 2)]
    threads: set[str] = set()
    previews = collecting(engine, threads)
    without = engine.generate(plain)
    assert previews == {}  # nobody asked: no preview work at all
    streamed = engine.generate([with_previews(plain[0], 3), plain[1]])
    for before, after in zip(without, streamed, strict=True):
        assert after.ok, after.error
        np.testing.assert_array_equal(after.image, before.image)  # bit for bit, batch unchanged
    assert list(previews) == ["a"]
    assert [index for index, _ in previews["a"]] == [0, 1, 2]
    assert {name.rpartition("_")[0] for name in threads} == {"dit-previews"}  # decoded beside the steps
    final = streamed[0].image.astype(np.int16)
    distances = [float(np.abs(image.astype(np.int16) - final).mean()) for _, image in previews["a"]]
    assert all(image.shape == final.shape and image.dtype == np.uint8 for _, image in previews["a"])
    # estimates of the clean image: the last is nearer the final image than the first
    assert distances[-1] < distances[0], distances


class LoopReport:
    def __init__(self) -> None:
        self.outputs_by_id: dict[str, StageDiffusionCoreOutput] = {}
        self.previews: Previews = {}
        self.threads: set[str] = set()
        self.changed = threading.Condition()

    def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
        with self.changed:
            self.outputs_by_id.update((o.request_id, o) for o in outputs)
            self.changed.notify_all()

    def dropped(self, request_ids: list[str], where: str) -> None:
        pass

    def progress(self, counters: Any, *, force: bool, steps: Any = None) -> None:
        pass

    def preview(self, request_id: str, index: int, image: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.previews.setdefault(request_id, []).append((index, image))


@pytest.mark.parametrize("family", ["sd3", "qwen_image"])
def test_step_batched_requests_get_their_own_previews_through_the_loop(
    engines: Callable[[str, str], DiffusionEngine], family: str
) -> None:
    """Rows sharing forwards: each gets the previews it asked for, made on its group's thread and
    reported from the loop's, and the image it gets alone."""
    stepped, whole = engines(family, "step"), engines(family)
    report = LoopReport()
    loop = DiffusionBatchLoop(stepped, 1, report, max_batch=4)
    loop.engine.close = lambda: None  # the module's engine outlives this loop
    serving = threading.Thread(target=loop.serve, name="dit-loop", daemon=True)
    serving.start()
    asked = {"a": 2, "b": 0, "c": 1}
    requests = [with_previews(request_of(family, rid, seed), asked[rid]) for seed, rid in enumerate(asked)]
    try:
        for request in requests:
            loop.inbox.add(
                StageDiffusionCoreRequest(
                    request_id=request.request_id, stage_id=1, diffusion=msgspec.to_builtins(request)
                )
            )
        with report.changed:
            assert report.changed.wait_for(lambda: len(report.outputs_by_id) == 3, WAIT_S)
    finally:
        loop.inbox.drain()
        serving.join(WAIT_S)
    assert {rid: [i for i, _ in shown] for rid, shown in report.previews.items()} == {"a": [0, 1], "c": [0]}
    assert report.threads == {"dit-loop"}
    for request in requests:
        output = report.outputs_by_id[request.request_id]
        assert output.error is None, output.error
        (alone,) = whole.generate([with_previews(request, 0)])
        diff = np.abs(np.asarray(output.image).astype(np.int16) - alone.image.astype(np.int16))
        assert diff.max() <= 1


@pytest.mark.parametrize("family", ["sd3", "bagel"])
def test_the_steps_go_on_while_a_preview_is_decoded(
    engines: Callable[[str, str], DiffusionEngine], family: str
) -> None:
    """A preview held on the preview thread does not hold the denoising: the call makes every step, then
    waits for the preview before its own decode; released, the request gets its image, unchanged."""
    engine = engines(family)
    request = with_previews(request_of(family, "held", 5), 1)
    (alone,) = engine.generate([with_previews(request, 0)])
    release, reached = threading.Event(), threading.Event()
    steps: list[int] = []
    stepped = threading.Condition()

    def sink(request_id: str, index: int, image: Any) -> None:
        reached.set()
        assert release.wait(WAIT_S)

    def on_progress() -> None:
        with stepped:
            steps.append(1)
            stepped.notify_all()

    engine.on_preview, engine.on_progress = sink, on_progress
    results: list[Any] = []
    call = threading.Thread(target=lambda: results.extend(engine.generate([request])), daemon=True)
    try:
        call.start()
        assert reached.wait(WAIT_S)
        # Every step of the 6 is made while the preview (after step 3) is held; the diffusers runners
        # wait for it at the last step's end, before reporting that step.
        with stepped:
            assert stepped.wait_for(lambda: len(steps) >= 5, WAIT_S), steps
        assert call.is_alive()  # and the call waits for the preview before its decode
    finally:
        release.set()
        call.join(WAIT_S)
        engine.on_preview = engine.on_progress = None
    (result,) = results
    assert result.ok, result.error
    np.testing.assert_array_equal(result.image, alone.image)


def test_a_failing_preview_fails_its_call(engines: Callable[[str, str], DiffusionEngine]) -> None:
    engine = engines("sd3")

    def sink(request_id: str, index: int, image: Any) -> None:
        raise RuntimeError("the preview listener broke")

    engine.on_preview = sink
    (result,) = engine.generate([with_previews(request_of("sd3", "broken", 6), 2)])
    assert not result.ok and "the preview listener broke" in str(result.error)
    collecting(engine)
    (again,) = engine.generate([with_previews(request_of("sd3", "next", 7), 2)])
    assert again.ok, again.error  # the preview thread goes on serving


def test_a_bagel_whole_call_stopped_mid_way_has_handed_over_the_previews_asked_before_the_stop(
    engines: Callable[[str, str], DiffusionEngine],
) -> None:
    """BAGEL's whole call runs its step pieces to their end (``step_loop.run_whole``): stopped after its
    second step, it raises once the previews those steps asked for have reached the listener (decoded on
    the preview thread), so none arrives after the call, for a request already given up."""
    import torch

    from vllm_omni_plugin.diffusion.runner import BatchAborted

    engine = engines("bagel")
    previews = collecting(engine)
    request = with_previews(request_of("bagel", "stopped", 3), 3)  # 5 steps: previews after 0, 1 and 2
    asked = []

    def stop() -> bool:
        asked.append(len(asked))
        return len(asked) == 2

    with pytest.raises(BatchAborted):
        engine.runner.run([request], [torch.Generator().manual_seed(3)], stop)
    assert [index for index, _ in previews["stopped"]] == [0, 1]


def test_whole_request_batches_report_previews_from_the_loop_before_their_outputs(
    engines: Callable[[str, str], DiffusionEngine],
) -> None:
    """Decoded on the preview thread, a batch's previews are reported by the loop's thread (at its step
    ends, and the rest before the batch's outputs), in order."""
    engine = engines("sd3")
    order: list[str] = []

    class OrderedReport(LoopReport):
        def outputs(self, outputs: list[StageDiffusionCoreOutput]) -> None:
            order.extend(f"output {o.request_id}" for o in outputs)
            super().outputs(outputs)

        def preview(self, request_id: str, index: int, image: Any) -> None:
            order.append(f"preview {request_id} {index}")
            super().preview(request_id, index, image)

    report = OrderedReport()
    loop = DiffusionBatchLoop(engine, 1, report, max_batch=4)
    loop.engine.close = lambda: None  # the module's engine outlives this loop
    serving = threading.Thread(target=loop.serve, name="dit-loop", daemon=True)
    serving.start()
    request = with_previews(request_of("sd3", "w", 8), 3)
    try:
        loop.inbox.add(
            StageDiffusionCoreRequest(request_id="w", stage_id=1, diffusion=msgspec.to_builtins(request))
        )
        with report.changed:
            assert report.changed.wait_for(lambda: "w" in report.outputs_by_id, WAIT_S)
    finally:
        loop.inbox.drain()
        serving.join(WAIT_S)
    assert report.outputs_by_id["w"].error is None
    assert order == ["preview w 0", "preview w 1", "preview w 2", "output w"]
    assert report.threads == {"dit-loop"}


@pytest.mark.parametrize(("family", "serial"), [("qwen_image", True), ("sd3", False)])
def test_step_batched_groups_decode_a_vae_that_keeps_state_one_at_a_time(
    engines: Callable[[str, str], DiffusionEngine], family: str, serial: bool
) -> None:
    """Qwen-Image's VAE keeps its causal caches on the module while it decodes: a step-batched group's
    decodes (its previews on the preview thread, its images on its own) run under the runner's VAE lock,
    which every group shares. SD3's keeps none and decodes freely."""
    engine = engines(family, "step")
    runner: Any = engine.runner
    held: list[bool] = []
    hook = runner.pipe.vae.decoder.register_forward_pre_hook(
        lambda module, args: held.append(runner._vae_lock.locked())
    )
    try:
        collecting(engine)
        (group,), failed = engine.admit([with_previews(request_of(family, "s", 9), 2)])
        assert not failed
        (result,) = engine.run_group(group)
    finally:
        hook.remove()
        engine.on_preview = None
    assert result.ok, result.error
    if serial:
        assert held == [True] * 3  # two previews, then the image
    else:  # a traced preview decode runs no Python hook: the image's decode, and a preview's trace
        assert held and not any(held), held


@pytest.mark.parametrize("family", ["sd3", "flux", "glm_image", "qwen_image"])
def test_previews_decode_with_a_traced_vae_giving_the_eager_pixels(
    engines: Callable[[str, str], DiffusionEngine], family: str
) -> None:
    """AutoencoderKL decoders are traced once per latent shape, bit for bit the eager decode; a VAE that
    keeps state between calls (Qwen-Image's) is decoded eagerly."""
    import torch

    from vllm_omni_plugin.diffusion.preview_decoder import PreviewDecoder

    vae = engines(family, "request").runner.pipe.vae
    decoder = PreviewDecoder(vae)
    assert decoder.traceable is (family != "qwen_image")
    channels = vae.config.get("latent_channels") or vae.config["z_dim"]
    frames = () if decoder.traceable else (1,)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows, side in [(1, 8), (2, 8), (1, 4), (1, 8)]:
            latents = torch.randn(rows, channels, *frames, side, side, generator=generator)
            torch.testing.assert_close(
                decoder.decode(latents), vae.decode(latents, return_dict=False)[0], rtol=0, atol=0
            )
    assert len(decoder._graphs) == (3 if decoder.traceable else 0)  # one trace per shape, reused
