"""Test seam: the places where a test can hold work inside a stage or fault a process, so that it acts
(kills a stage, disconnects, stops the server) while a request is inside a stage, without timing.

Every function here is a no-op, at the cost of one environment lookup, unless ``VLLM_OMNI_TEST_HOOKS``
names an importable module that provides the same three functions; then each call goes to it (imported
once per process, at the first call). The implementation is the test kit's (``vllm_omni_testkit.holds``,
outside the wheel), which the test harness names for the servers it starts.

Hold points (``hold_point``): ``ar.load`` (in the AR engine core's start-up, its workers and KV cache
made, before it answers the engine), ``ar.step`` (in the AR engine core, after a step made output),
``dit.step`` (in the diffusion batch loop, after a denoising step), ``dit.preview`` (on the preview
thread, after a preview was handed to the loop), ``api.input`` (in the API server, on the thread that
works on a request's inputs: ``stage/input_work.py``). ``fault_point``: a diffusion process about to run
a batch, with its requests' seeds; ``settle_before_fault``: what that process does before a fault ends it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from types import ModuleType

HOOKS_ENV = "VLLM_OMNI_TEST_HOOKS"
_modules: dict[str, ModuleType] = {}


def _hooks(name: str) -> ModuleType:
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(name)
    return module


def hold_point(point: str, holding: str = "", give_up: Callable[[], bool] | None = None) -> None:
    """Where ``point`` may hold work; ``holding`` says what is held, ``give_up`` (asked while held) lets a
    holder that is being stopped go on."""
    if name := os.environ.get(HOOKS_ENV):
        _hooks(name).hold_point(point, holding, give_up)


def hold_armed(point: str) -> bool:
    """Whether a test armed ``point`` (the next visit holds)."""
    if name := os.environ.get(HOOKS_ENV):
        return bool(_hooks(name).hold_armed(point))
    return False


def fault_point(seeds: Iterable[int | None]) -> None:
    """Where a diffusion process about to run a batch of these seeds may be faulted."""
    if name := os.environ.get(HOOKS_ENV):
        _hooks(name).fault_point(seeds)


def settle_before_fault(action: Callable[[], None]) -> None:
    """What this process does before a fault ends it (deliver what it has sent)."""
    if name := os.environ.get(HOOKS_ENV):
        _hooks(name).settle_before_fault(action)
