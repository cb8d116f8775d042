"""best_effort: a failure it swallows is logged, never raised; cancellation still passes."""

from __future__ import annotations

import asyncio
import logging

import pytest

from vllm_omni_plugin.log import best_effort


def test_a_swallowed_failure_is_logged_with_what_failed(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test_best_effort")
    with caplog.at_level(logging.DEBUG, logger="test_best_effort"):
        with best_effort("closing the thing", logger):
            raise RuntimeError("gone")
        with best_effort("removing the other thing", logger, warn=True):
            raise OSError("busy")
        with best_effort("nothing to fail", logger):
            pass
    (debug, warning) = caplog.records
    assert debug.levelno == logging.DEBUG and debug.exc_info is not None
    assert debug.getMessage() == "closing the thing failed: RuntimeError: gone"
    assert warning.levelno == logging.WARNING and not warning.exc_info
    assert warning.getMessage() == "removing the other thing failed: OSError: busy"


def test_cancellation_is_not_swallowed() -> None:
    with pytest.raises(asyncio.CancelledError), best_effort("waiting"):
        raise asyncio.CancelledError
    with pytest.raises(KeyboardInterrupt), best_effort("waiting"):
        raise KeyboardInterrupt
