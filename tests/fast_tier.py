"""The fast tier (``bash scripts/test.sh --fast``): every test that starts no process and builds no tiny
model. A test is in it unless it is marked ``server``, ``processes``, ``slow`` or ``cuda`` or asks for a tiny
model, or uses the ``spawn`` fixture; one in it that starts a process (an engine, a stage, a server, Ray, a Python script) fails, in
every run, naming the mark to add, so the tier stays fast without anyone keeping a list."""

from __future__ import annotations

import importlib
import multiprocessing.process
import os
import subprocess
import sys
from typing import Any, NoReturn

import pytest

SLOW_MARKS = ("server", "processes", "slow", "cuda")
PROCESS_FIXTURES = frozenset({"spawn", "vllm_cli"})
"""Fixtures that start processes: a test using one, directly or through another fixture, is not fast."""
ALLOWED_COMMANDS = frozenset({"git"})
"""Programs a fast test may run: quick, and never an engine."""
PREIMPORTED = ("vllm.engine.arg_utils", "vllm.config")
"""Imported before the guard goes up: importing vLLM runs a probe subprocess (py-cpuinfo), which is no
test starting something."""
ENGINE_CLASSES = ("vllm.v1.engine.core:EngineCore", "vllm.v1.engine.llm_engine:LLMEngine")
"""vLLM engines a test could build in this process; refused where their module is imported."""


class FastTierViolation(AssertionError):
    pass


def is_fast(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(mark) is not None for mark in SLOW_MARKS):
        return False
    names = getattr(item, "fixturenames", ())
    return not any(name.startswith("tiny_") or name in PROCESS_FIXTURES for name in names)


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the fast tests ``fast``; with ``--fast``, deselects the others."""
    keep, drop = [], []
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)
            keep.append(item)
        else:
            drop.append(item)
    if config.getoption("fast_tier") and drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def forbid_processes(monkeypatch: pytest.MonkeyPatch, nodeid: str) -> None:
    for module in PREIMPORTED:
        importlib.import_module(module)

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> NoReturn:
            raise FastTierViolation(
                f"{nodeid} starts {what}: mark it `processes` (or `server`), the fast tier starts none"
            )

        return refused

    popen_init = subprocess.Popen.__init__

    def popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(os.fsdecode(argv[0]).split()[0]) if argv else ""
        if program not in ALLOWED_COMMANDS:
            refuse(f"a subprocess ({program})")()
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a multiprocessing process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    for target in ENGINE_CLASSES:
        module_name, cls_name = target.split(":")
        module = sys.modules.get(module_name)
        if module is not None:
            monkeypatch.setattr(getattr(module, cls_name), "__init__", refuse(f"a vLLM {cls_name}"))
