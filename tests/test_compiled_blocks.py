"""Regional compilation (``diffusion/compiled_blocks.py``) on tiny SD3 and FLUX: the pipeline's image with
compiled blocks is the eager one within one level of 255 (inductor reorders float sums: about 1e-6 apart);
forward hooks on a block fire once per call whether registered before or after compilation, and a hook on a
module inside a block (as LoRA's are) applies while registered and is gone once removed; hooks compile
nothing; over batch sizes 1 to 4 a block compiles at most twice (batch 1, and every other size).

Compiling is the cost here (inductor builds C++ kernels, several seconds per graph on two cores): one
pipeline per model, compiled once per module."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch._inductor.async_compile import AsyncCompile

from helpers import wait_for
from vllm_omni_plugin.diffusion.blocks import CompileSpec, repeated_blocks
from vllm_omni_plugin.diffusion.compiled_blocks import (
    compile_blocks,
    compile_count,
    compile_unavailable_reason,
    release_compile_workers,
    uncompile_blocks,
    warm_up,
)
from vllm_omni_plugin.diffusion.step_loop import StepLoop

STEPS = 2
SIZE = 64


@dataclass
class Compiled:
    """One pipeline, its eager image, then its blocks compiled and the same request run again."""

    pipe: Any
    blocks: list[Any]
    compiled_blocks: int
    eager: np.ndarray
    compiled: np.ndarray
    image_graphs: int
    """Graphs compiled during the compiled run (after any warm-up)."""
    warm_graphs: int
    calls: Counter[int]
    """Block calls during the compiled run, counted by hooks registered before compilation."""
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    """The denoiser's keyword arguments at the first step of the eager run."""

    @property
    def denoiser(self) -> Any:
        return self.pipe.transformer


def _image(pipe: Any) -> np.ndarray:
    out = pipe(
        "a cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    return (np.clip(out, 0, 1) * 255).round().astype(np.int16)


def _compiled(model_dir: Path, warm: Callable[[Compiled], object] | None = None) -> Iterator[Compiled]:
    from diffusers import DiffusionPipeline

    unavailable = compile_unavailable_reason("cpu")
    if unavailable is not None:
        pytest.skip(f"no torch.compile here: {unavailable}")
    pipe = DiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    blocks = repeated_blocks(pipe.transformer)
    captured: dict[str, Any] = {}
    capture = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: None if captured else captured.update(kwargs), with_kwargs=True
    )
    eager = _image(pipe)
    capture.remove()
    calls: Counter[int] = Counter()
    handles = [
        block.register_forward_hook(lambda module, args, out, index=index: calls.update([index]))
        for index, block in enumerate(blocks)
    ]
    state = Compiled(pipe, blocks, compile_blocks(pipe.transformer), eager, eager, 0, 0, calls, captured)
    if warm is not None:
        graphs = compile_count()
        warm(state)
        state.warm_graphs = compile_count() - graphs
    calls.clear()
    graphs = compile_count()
    state.compiled = _image(pipe)
    state.image_graphs = compile_count() - graphs
    state.calls = Counter(calls)
    for handle in handles:
        handle.remove()
    yield state
    uncompile_blocks(pipe.transformer)


def _at_batch(kwargs: dict[str, Any], batch: int) -> dict[str, Any]:
    """The denoiser call's arguments with the first row's repeated ``batch`` times."""
    rows = kwargs["hidden_states"].shape[0]

    def grow(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[:1].repeat(batch, *[1] * (value.dim() - 1))
        return value

    return {name: grow(value) for name, value in kwargs.items()}


def _forward(denoiser: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return denoiser(**kwargs)[0]


@pytest.fixture(scope="module")
def sd3(tiny_sd3: Path) -> Iterator[Compiled]:
    yield from _compiled(tiny_sd3)


@pytest.fixture(scope="module")
def flux(tiny_flux: Path) -> Iterator[Compiled]:
    # FLUX's pipeline calls its denoiser at batch 1: a warm-up of that batch (denoiser forwards with the
    # captured arguments) leaves the pipeline nothing to compile.
    def warm(state: Compiled) -> None:
        warm_up(lambda batch: _forward(state.denoiser, _at_batch(state.call_kwargs, batch)), (1,))

    yield from _compiled(tiny_flux, warm)


def test_compile_availability_says_why() -> None:
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
        reason = compile_unavailable_reason("cpu")
    assert reason is not None and "no-such-c++-compiler" in reason
    assert "'meta'" in (compile_unavailable_reason("meta") or "")


def _check_image_and_calls(state: Compiled, blocks: int, image_graphs: int) -> None:
    assert state.compiled_blocks == len(state.blocks) == blocks
    assert all("forward" in vars(block) for block in state.blocks)  # the compiled forward, per instance
    assert np.abs(state.compiled - state.eager).max() <= 1
    assert state.image_graphs == image_graphs
    # Hooks registered before compilation: once per block call. SD3 batches its guidance pair into one
    # call per step, FLUX embeds guidance: one call per step each.
    assert state.calls == {index: STEPS for index in range(blocks)}


def test_sd3_compiled_blocks_give_the_eager_image(sd3: Compiled) -> None:
    # The run compiles one graph per block structure (SD3's last block has no context output).
    _check_image_and_calls(sd3, blocks=2, image_graphs=2)


def test_flux_compiled_blocks_give_the_eager_image_after_warm_up(flux: Compiled) -> None:
    # One joint and two single blocks: one graph per class (the second single block gets a strided slice
    # of the first one's output, which compiled a graph of its own until arguments were made dense); the
    # warm-up compiled everything the run needs.
    assert flux.warm_graphs == 2
    _check_image_and_calls(flux, blocks=3, image_graphs=0)


def test_block_hooks_registered_after_compilation_fire_and_replace_outputs(sd3: Compiled) -> None:
    kwargs, graphs = sd3.call_kwargs, compile_count()
    plain = _forward(sd3.denoiser, kwargs)
    calls: Counter[int] = Counter()
    handles = [
        block.register_forward_hook(lambda module, args, out, index=index: calls.update([index]))
        for index, block in enumerate(sd3.blocks)
    ]
    # A hook returning a new output, as LoRA's do (SD3's joint block returns (context, image) states).
    handles.append(sd3.blocks[0].register_forward_hook(lambda module, args, out: (out[0], out[1] * 1.5)))
    try:
        hooked = _forward(sd3.denoiser, kwargs)
        with torch.compiler.set_stance("force_eager"):
            expected = _forward(sd3.denoiser, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {0: 2, 1: 2}  # once per call: the hooked run and its eager reference
    assert not torch.allclose(hooked, plain, atol=1e-3)
    torch.testing.assert_close(hooked, expected, rtol=0, atol=1e-5)
    assert compile_count() == graphs


def test_a_hook_inside_a_block_applies_while_registered(sd3: Compiled) -> None:
    """Dynamo does not guard on hooks of modules inside a compiled block: without the eager fallback this
    hook would be skipped (registered after compilation) or kept (after its removal)."""
    kwargs, graphs = sd3.call_kwargs, compile_count()
    plain = _forward(sd3.denoiser, kwargs)
    layer = sd3.blocks[0].attn.to_q
    handle = layer.register_forward_hook(lambda module, args, out: out + 0.5 * args[0][..., : out.shape[-1]])
    try:
        hooked = _forward(sd3.denoiser, kwargs)
        with torch.compiler.set_stance("force_eager"):
            expected = _forward(sd3.denoiser, kwargs)
    finally:
        handle.remove()
    after = _forward(sd3.denoiser, kwargs)
    assert not torch.allclose(hooked, plain, atol=1e-3)
    torch.testing.assert_close(hooked, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(after, plain, rtol=0, atol=0)
    assert compile_count() == graphs


def test_batch_sizes_compile_at_most_twice_per_block(sd3: Compiled) -> None:
    """The pipeline ran batch 2 (its guidance pair); batch 1 is a graph of its own (Dynamo specialises
    sizes 0 and 1), at most one per block; every later size reuses what is there."""
    new = []
    for batch in (1, 2, 3, 4):
        before = compile_count()
        _forward(sd3.denoiser, _at_batch(sd3.call_kwargs, batch))
        new.append(compile_count() - before)
    assert new[0] <= len(sd3.blocks)
    assert new[1:] == [0, 0, 0]


def test_a_compiled_engine_warms_up_so_that_no_request_compiles(tiny_sd3: Path) -> None:
    """A stage's ``compile: {blocks: true}``: the engine compiles and warms up at start-up (a guided
    batch and an unguided request), then batches of every size, guided or not, compile nothing and give
    the eager engine's images within one level."""
    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, DiffusionRequest

    if compile_unavailable_reason("cpu") is not None:
        pytest.skip("no torch.compile here")

    def requests() -> list[DiffusionRequest]:
        return [
            DiffusionRequest(
                request_id=f"r{i}",
                prompt=f"a cat number {i}",
                height=SIZE,
                width=SIZE,
                num_inference_steps=STEPS,
                guidance_scale=1.0 if i == 2 else None,
                seed=i,
            )
            for i in range(3)
        ]

    eager = DiffusionEngine(tiny_sd3, DiffusionEngineConfig(max_batch_size=4))
    plain = eager.generate(requests())
    eager.close()
    # the pool of compile workers a GPU host's compile starts (this CPU's compiles run in-process)
    AsyncCompile.process_pool()
    try:
        wait_for(lambda: bool(inductor_workers()), 30, "inductor's compile workers to start")
        engine = DiffusionEngine(
            tiny_sd3,
            DiffusionEngineConfig(
                max_batch_size=4, compile=CompileSpec(blocks=True, warmup_sizes=[(SIZE, SIZE)])
            ),
        )
        try:
            assert engine.compile_seconds > 0
            assert all("forward" in vars(b) for b in repeated_blocks(engine.runner.pipe.transformer))
            graphs = compile_count()
            # One at a time (denoiser batches 2, 2, 1), then all three in one call (5 rows).
            served = [r for one in requests() for r in engine.generate([one])]
            together = engine.generate(requests())
            # The stage's default, the step loop, through the same compiled blocks: rows of 2, 4 and 5.
            assert engine.batching == "loop" and not engine.overlap_decode  # a CPU decodes between steps
            loop = StepLoop(engine.step_family, max_rows=8)
            looped: dict[str, Any] = {}
            with torch.no_grad():  # as the stage's loop runs (and the pipelines' calls the warm-up made)
                for one in requests():
                    loop.add(one.request_id, one)
                    looped |= {f.request_id: f for f in loop.step()}
                while not loop.idle():
                    looped |= {f.request_id: f for f in loop.step()}
            assert compile_count() == graphs
        finally:
            engine.close()
        wait_for(lambda: not inductor_workers(), 30, "the closed engine to stop inductor's compile workers")
    finally:
        release_compile_workers()  # also where the test failed before the engine closed
    for results in (served, together):
        for got, want in zip(results, plain, strict=True):
            assert got.ok and want.ok
            assert np.abs(np.asarray(got.image, np.int16) - np.asarray(want.image, np.int16)).max() <= 1
    for want in plain:
        got = looped[want.request_id].image
        assert np.abs(np.asarray(got, np.int16) - np.asarray(want.image, np.int16)).max() <= 1


def inductor_workers() -> list[psutil.Process]:
    workers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any("compile_worker" in part for part in child.cmdline()):
                workers.append(child)
        except psutil.Error:  # gone, or a zombie another test's process left for its parent to reap
            pass
    return workers


def test_a_runner_that_cannot_compile_refuses_the_compile_block(tiny_bagel: Path) -> None:
    from test_step_batching import BAGEL_RUNNER
    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig

    with pytest.raises(ValueError, match="cannot compile its denoiser's blocks; remove the compile block"):
        DiffusionEngine(
            tiny_bagel, DiffusionEngineConfig(runner_cls=BAGEL_RUNNER, compile=CompileSpec(blocks=True))
        )
