"""Hold points and the fault hook, both sides: what a served process runs at the points of
``vllm_omni_plugin.test_hooks`` (this module is the one ``VLLM_OMNI_TEST_HOOKS`` names: :data:`HOOKS`), and
what a test uses to arm a point, wait until work is held there, act and release it (:class:`HoldPoints`,
:class:`Hold`).

A point holds only while ``VLLM_OMNI_HOLD_DIR`` names a directory (the harness sets it on the servers it
starts), and is one-shot. A test arms it by creating ``<dir>/<point>.armed``; the first process that
reaches it claims that file (a rename, so there is one holder, and a replica restarted later does not
hold again), writes ``<point>.reached`` with what it holds, and waits until ``<point>.release`` exists.
The points are listed in ``vllm_omni_plugin.test_hooks``; ``dit.preview`` holds the preview thread, the
steps go on, and the call waits for it before its own decode.

The fault hook: with ``VLLM_OMNI_FAULT_SEED`` set, a diffusion process that is about to run a batch holding
a request of that seed kills itself (SIGKILL, as the kernel's OOM killer would), every time: the poison
request the retry and quarantine rules are tested with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from vllm_omni_plugin.test_hooks import HOOKS_ENV

# Under vLLM's ``vllm`` logger, whose handlers every process of a server has (as the plugin's own).
logger = logging.getLogger("vllm.omni_testkit.holds")

HOLD_DIR_ENV = "VLLM_OMNI_HOLD_DIR"
FAULT_SEED_ENV = "VLLM_OMNI_FAULT_SEED"
POLL_S = 0.01
HOOKS: dict[str, str] = {HOOKS_ENV: __name__}
"""What a process's environment needs for the product's test seam to call this module."""


# --- the served process's side ---------------------------------------------------------------------


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
    with contextlib.suppress(FileNotFoundError):
        os.unlink(base + ".release")  # the holder has gone on: the test may arm the point again
    logger.warning("test hold point %s: released", point)


def hold_armed(point: str) -> bool:
    """Whether ``point`` is armed in this process's hold directory."""
    directory = os.environ.get(HOLD_DIR_ENV)
    return bool(directory) and os.path.exists(os.path.join(directory, point + ".armed"))


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


# --- the test's side --------------------------------------------------------------------------------


class Hold:
    """One armed point. As a context manager it releases the point (or disarms it, if nothing reached
    it) on leaving, so a failing test never leaves a stage held."""

    def __init__(self, directory: Path, point: str) -> None:
        self.base = directory / point
        self.point = point
        self.rearm()

    def rearm(self) -> None:
        """Arm the point again (e.g. before killing the holder, so that its restarted replica holds the
        retried request too); what the last holder reached is forgotten."""
        for suffix in (".reached", ".release"):
            self._path(suffix).unlink(missing_ok=True)
        self._path(".armed").touch()

    def _path(self, suffix: str) -> Path:
        return self.base.with_name(self.point + suffix)

    @property
    def reached(self) -> bool:
        return self._path(".reached").exists()

    def wait(self, timeout: float = 600.0, alive: Callable[[], bool] | None = None) -> str:
        """Until work is held at the point; what it holds. ``alive`` (e.g. the server process is
        running) turns a deployment that died into an error at once instead of at the timeout."""
        deadline = time.monotonic() + timeout
        while not self.reached:
            if alive is not None and not alive():
                raise AssertionError(f"the deployment died before work reached hold point {self.point}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no work reached hold point {self.point} in {timeout:.0f} s")
            time.sleep(POLL_S)
        return self._path(".reached").read_text(encoding="utf-8")

    def next(self, timeout: float = 600.0, alive: Callable[[], bool] | None = None) -> str:
        """Let the held work go on to the point's next visit (one step further, for ``dit.step``) and
        hold it there again: what it then holds. The point is armed again before the release, so no
        visit passes unheld."""
        self._path(".reached").unlink()
        self._path(".armed").touch()
        self._path(".release").touch()
        deadline = time.monotonic() + timeout
        while self._path(".release").exists():  # the holder takes the release file away as it goes on
            if alive is not None and not alive():
                raise AssertionError(f"the deployment died while work was held at {self.point}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the work held at {self.point} did not go on in {timeout:.0f} s")
            time.sleep(POLL_S)
        return self.wait(timeout, alive)

    def release(self) -> None:
        self._path(".armed").unlink(missing_ok=True)
        if self.reached or self._path(".taken").exists():
            self._path(".release").touch()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HoldPoints:
    """The hold directory of one served deployment (``env`` goes into its environment: the directory, and
    this module as the test seam's hooks)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="vllm_omni_holds_"))

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_DIR_ENV: str(self.directory), **HOOKS}

    def arm(self, point: str) -> Hold:
        self.directory.mkdir(exist_ok=True)  # a server started again after stop()
        return Hold(self.directory, point)

    def release_all(self) -> None:
        for reached in [*self.directory.glob("*.reached"), *self.directory.glob("*.taken")]:
            (self.directory / (reached.name.rsplit(".", 1)[0] + ".release")).touch()
        for armed in self.directory.glob("*.armed"):
            armed.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
