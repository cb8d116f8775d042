"""Regional ``torch.compile`` of a DiT's repeated transformer blocks (as diffusers'
``compile_repeated_blocks``, vllm-omni and SGLang do): the blocks of a class share compiled graphs, so
warm-up compiles a few small graphs instead of the whole denoiser, and the code between blocks (embeddings,
step caching, LoRA bookkeeping) stays eager Python. Opt-in per deployment: compilation costs tens of seconds
per block class on CPU (cold inductor cache), paid at warm-up.

Shapes: with the default ``dynamic=True`` a block class compiles twice, once for batch 1 (Dynamo always
specialises sizes 0 and 1) and once for every other batch size and image size; ``dynamic=None`` compiles a
static graph first and a third when batch 1 comes after another size; ``dynamic=False`` compiles per shape
until Dynamo's recompile limit (8 per block class), after which the block silently runs eager. Blocks of one
class with different structure (SD3's last block has no context output) count as separate classes.

Hooks: only a block's ``forward`` is compiled, so its own forward hooks run eagerly around it, once per
call, whenever registered. Hooks on modules *inside* a block (our LoRA hooks on its linears) would be traced
into the graph without a guard (``torch._dynamo.config.skip_nnmodule_hook_guards``): one registered after
compilation would be silently skipped, one removed would keep running. So a block runs eagerly for any call
during which a module inside it has a forward hook, and compiled otherwise; graphs never contain hooks.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from vllm_omni_plugin.diffusion.blocks import repeated_blocks

DEFAULT_DYNAMIC: bool | None = True
"""Symbolic shapes from the first compilation: at most two graphs per block class over every batch and
image size, where ``None`` compiles up to five."""
WARM_UP_BATCH_SIZES = (2, 1)
"""What a warm-up runs, with the default ``dynamic``: after these two, no batch or image size compiles."""


def compile_unavailable_reason(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` (inductor) cannot run on ``device`` here, in one line; ``None`` when it can.
    Checked up front, so that a deployment asking for compilation fails at start-up with a reason rather
    than at its first request with a compiler traceback. Starts no process."""
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return f"torch.compile does not support this Python ({sys.version.split()[0]})"
    kind = torch.device(device).type
    if kind == "cpu":
        import torch._inductor.config as inductor_config

        candidates = [c for c in inductor_config.cpp.cxx if c]
        if not any(shutil.which(c) for c in candidates):
            return (
                f"inductor compiles CPU kernels with a C++ compiler and found none of {candidates} "
                "(install g++, or set CXX)"
            )
        header = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not header.exists():
            return f"inductor's CPU kernels include Python.h, missing at {header} (install python3-dev)"
        return None
    if kind in ("cuda", "xpu"):
        from torch.utils._triton import has_triton, has_triton_package

        if not has_triton_package():
            return f"inductor compiles {kind} kernels with triton, which is not installed"
        if not has_triton():
            return f"triton cannot compile for this {kind} device (CUDA needs compute capability 7.0+)"
        return None
    return f"inductor has no backend for device type {kind!r}"


def compile_count() -> int:
    """Graphs Dynamo has compiled in this process so far: first compilations, recompilations, and one per
    piece of a graph split by a graph break. Its change across a run says whether that run compiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _CompiledForward:
    """A compiled block's ``forward`` (an instance attribute over the class's): the compiled forward with
    canonical-stride arguments, or the eager one while a module inside the block (or every module,
    globally) has forward hooks. The check is a few dict truth tests per block call."""

    __slots__ = ("compiled", "eager", "inner", "replaced")

    def __init__(self, block: torch.nn.Module, compiled: Callable[..., Any], replaced: Any) -> None:
        self.eager = block.forward
        self.compiled = compiled
        self.inner = [m for m in block.modules() if m is not block]
        self.replaced = replaced
        """The instance's own ``forward`` before compilation (a diffusers hook's), or ``None``."""

    def hooked(self) -> bool:
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.hooked():
            return self.eager(*args, **kwargs)
        args = tuple(_dense(a) for a in args)
        kwargs = {k: _dense(v) for k, v in kwargs.items()}
        return self.compiled(*args, **kwargs)


def _dense(value: Any) -> Any:
    """A tensor argument contiguous, with canonical strides. Graphs are specialised on strides, and FLUX's
    single blocks hand the next one slices (``hidden_states[:, text:]``) whose batch stride is the
    unsliced tensor's, even at batch 1 where ``contiguous()`` keeps it: every block class compiled twice
    per shape and hit the recompile limit. Copies only a non-contiguous tensor."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.contiguous()
    strides, step = [], 1
    for size in reversed(value.shape):
        strides.append(step)
        step *= size
    strides.reverse()
    if list(value.stride()) == strides:
        return value
    return value.as_strided(value.shape, strides, value.storage_offset())


def compile_blocks(
    model: Any,
    *,
    mode: str = "default",
    dynamic: bool | None = DEFAULT_DYNAMIC,
    fullgraph: bool = False,
) -> int:
    """Compiles the ``forward`` of each of ``model``'s repeated blocks in place and returns how many: the
    modules, their parameters and hooks stay the same objects. Not ``nn.Module.compile``, which compiles
    the whole call: Dynamo then also compiles the block's own hooks (one that computes, as a hook that
    replaces the output does, became a graph of its own). Graphs are built at each block class's first
    calls: see :func:`warm_up`. ``fullgraph`` is off so that a graph break (an attention processor's
    Python) costs speed, not the request. Calling it again recompiles with the new settings."""
    blocks = repeated_blocks(model)
    for block in blocks:
        _restore_forward(block)
        replaced = block.__dict__.get("forward")
        compiled = torch.compile(block.forward, mode=mode, dynamic=dynamic, fullgraph=fullgraph)
        block.forward = _CompiledForward(block, compiled, replaced)
    return len(blocks)


def _restore_forward(block: Any) -> bool:
    current = block.__dict__.get("forward")
    if not isinstance(current, _CompiledForward):
        return False
    if current.replaced is None:
        del block.forward
    else:
        block.forward = current.replaced
    return True


def uncompile_blocks(model: Any) -> int:
    """Back to eager for every repeated block of ``model``; returns how many were compiled."""
    return sum(_restore_forward(block) for block in repeated_blocks(model))


def warm_up(
    run_at_batch: Callable[[int], object], batch_sizes: Iterable[int] = WARM_UP_BATCH_SIZES
) -> tuple[float, int]:
    """Runs ``run_at_batch(b)`` (a denoiser forward, or a one-step pipeline call, at batch ``b``) for each
    batch size, so that serving compiles nothing; returns the seconds it took and the graphs it compiled.
    Under ``no_grad``, as diffusers pipelines run: grad mode is part of every graph's guards (and inference
    mode would be another)."""
    start, graphs = time.perf_counter(), compile_count()
    with torch.no_grad():
        for batch in batch_sizes:
            run_at_batch(batch)
    return time.perf_counter() - start, compile_count() - graphs


def release_compile_workers() -> None:
    """Stops inductor's pool of compile worker processes (one per core: 16 on a GPU host), which outlives
    every compile in its process; an engine that compiled calls it when it closes, so that a stopped
    engine leaves no process behind (a later compile starts the pool again)."""
    from torch._inductor import async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()
