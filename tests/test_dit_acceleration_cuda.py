"""DiT acceleration on a CUDA device (``scripts/gpu_check.sh`` runs these; they skip without one): a
step-cached request, a compiled tiny SD3 deployment, the step loop's decoder on a stream of its own, a
preempted state parked in pinned host memory and (with two devices) CFG- and sequence-parallel tiny SD3
and a CFG-parallel tiny BAGEL on ``cuda``, float32 so that the images compare with the CPU's cached ones
and the eager, single-device ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, DiffusionRequest
from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::FutureWarning")]

STEPS = 12
FIXED_COMPUTED = 8
"""Of 12 steps, the fixed policy's defaults compute 0, 1, 2, 4, 6, 8, 10 and 11."""


def requests(count: int, cache: StepCacheSpec | None = None) -> list[DiffusionRequest]:
    return [
        DiffusionRequest(
            request_id=f"r{i}",
            prompt=f"a red fox number {i}",
            height=64,
            width=64,
            num_inference_steps=STEPS,
            seed=i,
            cache=cache,
        )
        for i in range(count)
    ]


def test_cached_and_compiled_tiny_sd3_on_cuda(tiny_sd3: Path) -> None:
    eager = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(dtype="float32", max_batch_size=4), device="cuda")
    plain = [r.image for r in eager.generate(requests(3))]
    before = eager.counters()
    cached = eager.generate(requests(3, StepCacheSpec(policy="fixed")))
    counts = eager.counters()
    blocks = 2  # the tiny SD3's transformer blocks
    assert counts.computed_blocks - before.computed_blocks == 3 * blocks * FIXED_COMPUTED
    assert counts.cached_blocks - before.cached_blocks == 3 * blocks * (STEPS - FIXED_COMPUTED)
    eager.close()
    # how far caching moves an image is the CPU tests' business (tests/test_step_cache.py); here the
    # cached requests give on the device what they give on the CPU
    on_cpu = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(dtype="float32", max_batch_size=4), device="cpu")
    try:
        expected = [r.image for r in on_cpu.generate(requests(3, StepCacheSpec(policy="fixed")))]
    finally:
        on_cpu.close()
    for result, image in zip(cached, expected, strict=True):
        assert result.ok and np.abs(result.image.astype(np.int16) - image).mean() <= 1.0

    compiled = DiffusionEngine(
        tiny_sd3,
        DiffusionEngineConfig(
            dtype="float32", max_batch_size=4, compile=CompileSpec(blocks=True, warmup_sizes=[(64, 64)])
        ),
        device="cuda",
    )
    try:
        for batch in (1, 3):  # a batch size the warm-up did not run
            for result, image in zip(compiled.generate(requests(batch)), plain, strict=False):
                assert result.ok
                assert np.abs(result.image.astype(np.int16) - image).max() <= 2
    finally:
        compiled.close()


@pytest.mark.parametrize("field", ["cfg_parallel_size", "sequence_parallel_size"])
def test_a_parallel_tiny_sd3_over_two_cuda_devices(tiny_sd3: Path, field: str) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"{field} 2 needs two CUDA devices")
    plain = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(dtype="float32", max_batch_size=4), device="cuda")
    expected = [r.image for r in plain.generate(requests(2))]
    plain.close()
    engine = DiffusionEngine(
        tiny_sd3, DiffusionEngineConfig(dtype="float32", max_batch_size=4, **{field: 2}), device="cuda"
    )
    try:
        results = engine.generate(requests(2))
        assert engine.context.parallel_denoiser.split_calls == STEPS
        assert engine.parallel is not None and engine.parallel.failed is None
    finally:
        engine.close()
    for result, image in zip(results, expected, strict=True):
        assert result.ok and np.abs(result.image.astype(np.int16) - image).max() <= 2


def test_a_cfg_parallel_tiny_bagel_over_two_cuda_devices(tiny_bagel: Path) -> None:
    """BAGEL's edit branches on two devices: rank 1 keeps its row's context on ``cuda:1``."""
    import torch

    from test_bagel_dit import edit, t2i
    from test_step_batching import BAGEL_RUNNER

    if torch.cuda.device_count() < 2:
        pytest.skip("cfg_parallel_size 2 needs two CUDA devices")
    batch = [edit("e", 1), t2i("t", 2)]
    args = {"dtype": "float32", "max_batch_size": 4, "runner_cls": BAGEL_RUNNER}
    plain = DiffusionEngine(tiny_bagel, DiffusionEngineConfig(**args), device="cuda")
    expected = [[r.image for r in plain.generate([request])] for request in batch]
    plain.close()
    engine = DiffusionEngine(tiny_bagel, DiffusionEngineConfig(cfg_parallel_size=2, **args), device="cuda")
    try:
        got = [engine.generate([request]) for request in batch]
        assert engine.context.parallel_denoiser.split_calls > 0
        assert engine.parallel is not None and engine.parallel.failed is None
    finally:
        engine.close()
    for results, images in zip(got, expected, strict=True):
        assert results[0].ok and np.abs(results[0].image.astype(np.int16) - images[0]).max() <= 2


def test_the_step_loop_decodes_beside_its_next_step_on_a_stream_of_its_own(tiny_sd3: Path) -> None:
    """``DecodeBeside`` on a CUDA device: a request finished while another runs decodes on the decoder's
    stream beside the next step, with the image it gets when it decodes inline (the same kernels, after
    the stream waited for the latents' last step)."""
    import msgspec
    import torch

    from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
    from vllm_omni_plugin.diffusion.step_loop import DecodeBeside, StepLoop

    runner = load_pipeline_runner(str(tiny_sd3), dtype=torch.float32, device="cuda")
    short, long = requests(2)
    short = msgspec.structs.replace(short, num_inference_steps=4)

    def images(decoder: DecodeBeside | None) -> dict[str, np.ndarray]:
        loop = StepLoop(runner.step_family(), max_rows=8, decoder=decoder)
        for r in (short, long):
            loop.add(r.request_id, r)
        done = {}
        with torch.no_grad():
            while not loop.idle():
                done.update({f.request_id: f.image for f in loop.step()})
        return done

    beside, inline = images(DecodeBeside(torch.device("cuda"))), images(None)
    for request_id in ("r0", "r1"):
        assert np.array_equal(beside[request_id], inline[request_id]), request_id


@pytest.mark.parametrize("family", ["sd3", "bagel"])
def test_a_preempted_state_parked_in_host_memory_frees_its_device_memory_and_resumes_exact(
    request: pytest.FixtureRequest, family: str
) -> None:
    """``StateParking`` from a CUDA device: with no room in the memory budget, the worse request's state is
    parked in pinned host memory while a better one runs (the device's allocated bytes fall by what it
    moved; BAGEL's state holds its context K/V), then resumes, and both images equal those of a loop that
    parks nothing."""
    import msgspec
    import torch

    from vllm_omni_plugin.diffusion.parking import StateParking, state_tensors, storage_bytes, storage_key
    from vllm_omni_plugin.diffusion.step_loop import StepLoop

    model = request.getfixturevalue(f"tiny_{family}")
    if family == "bagel":
        from test_bagel_dit import t2i
        from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

        runner = BagelGenerationRunner.load(str(model), dtype=torch.float32, device="cuda")
        low, high = t2i("w0", 0), t2i("w1", 1)
    else:
        from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

        runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cuda")
        low, high = requests(2)
        low = msgspec.structs.replace(low, num_inference_steps=5)
        high = msgspec.structs.replace(high, num_inference_steps=3)
    device = torch.device("cuda", torch.cuda.current_device())

    def images(parking: StateParking | None) -> tuple[dict[str, np.ndarray], list[int]]:
        """Each request's image, and the device bytes the worse one's state held after each step."""
        loop = StepLoop(runner.step_family(), max_rows=3, parking=parking)
        loop.add(low.request_id, low, priority=1)
        done, held = {}, []
        with torch.no_grad():
            loop.step()
            loop.step()
            loop.add(high.request_id, high, priority=0)
            while not loop.idle():
                done.update({f.request_id: f.image for f in loop.step()})
                worse = next((i for i in loop.running if i.request_id == "w0"), None)
                if worse is not None:
                    held.append(storage_bytes(state_tensors(worse.state), device))
                    if worse.parked is not None:
                        moved = [
                            t for t in state_tensors(worse.state) if storage_key(t) in worse.parked.storages
                        ]
                        assert moved and all(t.is_pinned() for t in moved)
        return done, held

    parked, held_parked = images(StateParking(device, room=0, need=lambda r: 0))
    kept, held_kept = images(None)
    # parked while the better request ran: its device bytes fell to what it shares, then came back
    assert min(held_parked) < min(held_kept) and held_parked[-1] == held_kept[-1]
    for request_id in ("w0", "w1"):
        assert np.array_equal(parked[request_id], kept[request_id]), request_id
