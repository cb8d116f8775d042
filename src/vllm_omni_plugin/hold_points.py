"""Test-only hold points: places inside a stage where work can be held until a test lets it go, so that
a test acts (kills a stage, disconnects, stops the server) while a request is inside a stage, however
fast or busy the machine is.

Off unless ``VLLM_OMNI_HOLD_DIR`` names a directory (the test harness sets it on the servers it starts);
then a point is one-shot. A test arms it by creating ``<dir>/<point>.armed``; the first process that
reaches it claims that file (a rename, so there is one holder, and a replica restarted later does not
hold again), writes ``<point>.reached`` with what it holds, and waits until ``<point>.release`` exists.

Points: ``ar.load`` (in the AR engine core's start-up, its workers and KV cache made, before it
answers the engine), ``ar.step`` (in the AR engine core, after a step made output), ``dit.step`` (in
the diffusion batch loop, after a denoising step), ``dit.preview`` (on the preview thread, after a
preview was handed to the loop; the steps go on, and the call waits for it before its own decode),
``api.input`` (in the API server, on the thread that works on a request's inputs:
``stage/input_work.py``).

A fault hook beside them: with ``VLLM_OMNI_FAULT_SEED`` set, a diffusion process that is about to run a
batch holding a request of that seed kills itself (SIGKILL, as the kernel's OOM killer would), every time:
the poison request the retry and quarantine rules are tested with.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable

from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

HOLD_DIR_ENV = "VLLM_OMNI_HOLD_DIR"
FAULT_SEED_ENV = "VLLM_OMNI_FAULT_SEED"
POLL_S = 0.01


def hold_point(point: str, holding: str = "", give_up: Callable[[], bool] | None = None) -> None:
    """Wait here while ``point`` is armed (see the module); ``holding`` says what is held, for the test.
    ``give_up`` (asked while waiting) lets a holder that is being stopped (its parent died, a shutdown)
    go on without a release, so a test never keeps a process from stopping."""
    directory = os.environ.get(HOLD_DIR_ENV)
    if not directory:
        return
    base = os.path.join(directory, point)
    try:
        os.rename(base + ".armed", base + ".taken")
    except FileNotFoundError:
        return
    logger.warning("test hold point %s: holding %s until the test releases it", point, holding or "work")
    with open(base + ".reached.tmp", "w", encoding="utf-8") as out:
        out.write(holding)
    os.replace(base + ".reached.tmp", base + ".reached")
    os.unlink(base + ".taken")
    while not os.path.exists(base + ".release"):
        if give_up is not None and give_up():
            logger.warning("test hold point %s: stopping, no longer held", point)
            return
        time.sleep(POLL_S)
    logger.warning("test hold point %s: released", point)


_settle_before_fault: Callable[[], None] | None = None


def settle_before_fault(action: Callable[[], None]) -> None:
    """What this process does before the fault hook kills it: deliver what it has sent (the stage
    process's last outputs), as a process that dies in the middle of a batch has long done. Killed the
    instant it took the next batch, it could take its previous batch's outputs along, and its client
    would then blame a request that had finished for the death."""
    global _settle_before_fault
    _settle_before_fault = action


def fault_point(seeds: Iterable[int | None]) -> None:
    """Kill this process if the batch it is about to run holds the poison seed (see the module)."""
    poison = os.environ.get(FAULT_SEED_ENV)
    if poison and any(seed is not None and str(seed) == poison for seed in seeds):
        logger.warning("test fault hook: a request of seed %s kills this diffusion process", poison)
        if _settle_before_fault is not None:
            _settle_before_fault()
        os.kill(os.getpid(), signal.SIGKILL)
