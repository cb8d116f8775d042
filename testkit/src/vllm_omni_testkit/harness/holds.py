"""The test side of ``vllm_omni_plugin.hold_points``: arm a point in a served deployment, wait until work
is held there, act, release it."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_omni_plugin.hold_points import HOLD_DIR_ENV, POLL_S


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

    def release(self) -> None:
        self._path(".armed").unlink(missing_ok=True)
        if self.reached or self._path(".taken").exists():
            self._path(".release").touch()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class HoldPoints:
    """The hold directory of one served deployment (``env`` goes into its environment)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="vllm_omni_holds_"))

    @property
    def env(self) -> dict[str, str]:
        return {HOLD_DIR_ENV: str(self.directory)}

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
