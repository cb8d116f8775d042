"""The product's test seam (``vllm_omni_plugin.test_hooks``): nothing unless ``VLLM_OMNI_TEST_HOOKS``
names a module, then every call reaches it, imported once; the test kit's ``vllm_omni_testkit.holds`` is
such a module, one-shot per armed point."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from vllm_omni_plugin import test_hooks
from vllm_omni_testkit import holds

RECORDER = """
calls = []
imports = globals().get("imports", 0) + 1


def hold_point(point, holding, give_up):
    calls.append(("hold", point, holding, give_up))


def fault_point(seeds):
    calls.append(("fault", list(seeds)))


def settle_before_fault(action):
    calls.append(("settle", action))
"""


def test_off_the_seam_calls_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An armed point and a poison seed do nothing while no hooks module is named (a user's server)."""
    monkeypatch.delenv(test_hooks.HOOKS_ENV, raising=False)
    monkeypatch.setenv(holds.HOLD_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(holds.FAULT_SEED_ENV, "7")
    (tmp_path / "dit.step.armed").touch()
    test_hooks.settle_before_fault(lambda: pytest.fail("settled"))
    test_hooks.hold_point("dit.step", "a")
    test_hooks.fault_point(iter([7]))
    assert (tmp_path / "dit.step.armed").exists()


def test_on_every_call_reaches_the_named_module_imported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "omni_hooks_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(test_hooks.HOOKS_ENV, "omni_hooks_recorder")
    monkeypatch.delitem(sys.modules, "omni_hooks_recorder", raising=False)
    monkeypatch.setattr(test_hooks, "_modules", {})

    def action() -> None:
        pass

    def give_up() -> bool:
        return False

    test_hooks.settle_before_fault(action)
    test_hooks.hold_point("ar.step", "r1", give_up)
    test_hooks.hold_point("api.input")
    test_hooks.fault_point(s for s in (1, None))
    recorder = sys.modules["omni_hooks_recorder"]
    assert recorder.imports == 1
    assert recorder.calls == [
        ("settle", action),
        ("hold", "ar.step", "r1", give_up),
        ("hold", "api.input", "", None),
        ("fault", [1, None]),
    ]


def test_the_kit_holds_an_armed_point_once_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(holds.HOLD_DIR_ENV, str(tmp_path))
    for name, value in holds.HOOKS.items():
        monkeypatch.setenv(name, value)
    with holds.Hold(tmp_path, "dit.step") as hold:
        holder = threading.Thread(target=test_hooks.hold_point, args=("dit.step", "a b"))
        holder.start()
        assert hold.wait(30) == "a b"
        assert holder.is_alive()  # held until released
    holder.join(30)
    assert not holder.is_alive()
    test_hooks.hold_point("dit.step", "again")  # one-shot: not armed any more, returns at once
    stopping = holds.Hold(tmp_path, "ar.step")
    test_hooks.hold_point("ar.step", give_up=lambda: True)  # a holder being stopped goes on
    assert stopping.reached
