"""Which command lines the session's fork server starts as forks (the others start fresh), and that a fork
runs one as a fresh interpreter would: the same ``sys.argv``, ``sys.path[0]``, ``__main__``, output and exit
status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_omni_plugin.processes import ProcessId
from vllm_omni_testkit.harness.forks import VllmForks, read_when_used, run_to_end
from vllm_omni_testkit.harness.server import bin_script, cpu_test_env

SERVE = [bin_script("vllm"), "serve", "/models/any", "--omni"]
SCRIPT = str(Path(__file__).resolve().parent / "engine_scripts" / "resume_path.py")

PROBE = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path": sys.path, "name": __name__, "file": __file__,
                  "spec": __spec__ and __spec__.name, "cwd": os.getcwd(), "value": VALUE,
                  "seen": {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "DYN_NAMESPACE", "PROBE",
                                                          "PYTEST_CURRENT_TEST")}}))
print(json.dumps({"forked": "torch" in sys.modules}))  # a fresh interpreter has imported no torch
"""
"""What a probe prints: how it was started, then whether it is a fork."""


def test_python_command_lines_under_the_fork_servers_environment_fork() -> None:
    env = cpu_test_env()
    forks = VllmForks(env)
    # the test seam's variables, those read only when used, Dynamo's may differ
    read_when_used = {"VLLM_OMNI_HOLD_DIR": "/tmp/h", "RAY_ADDRESS": "127.0.0.1:1", "PYTEST_CURRENT_TEST": "t (call)",
                      "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHINDUCTOR_CACHE_DIR": "/tmp/c",
                      "DYN_NAMESPACE": "n", "DYN_SYSTEM_PORT": "20001", "VLLM_PLUGINS": "",
                      "VLLM_USE_V2_MODEL_RUNNER": "0"}  # fmt: skip
    assert forks.can_fork(SERVE, {**env, **read_when_used})
    # anything imported could read these: a fresh process
    assert not forks.can_fork(SERVE, {**env, "PYTHONPATH": "/site"})
    assert not forks.can_fork(SERVE, {**env, "OMP_NUM_THREADS": "2"})
    assert not forks.can_fork(SERVE, {**env, "TMPDIR": "/tmp/own"})
    assert not forks.can_fork(SERVE, {**env, "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert not forks.can_fork(SERVE, {**env, "DYNAMO_HOME": "/d"})  # not Dynamo's prefix
    assert not forks.can_fork(SERVE, {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"})
    # this interpreter's `-m MODULE` and absolute `.py` scripts
    assert forks.can_fork([sys.executable, "-m", "vllm_omni_plugin.dynamo", "/models/any"], env)
    assert forks.can_fork([sys.executable, "-m", "vllm_omni_plugin.dynamo.frontend"], env)
    assert forks.can_fork(
        [sys.executable, SCRIPT, "/models/any"], {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )
    assert not forks.can_fork([sys.executable, "-m", "vllm_omni_plugin"], {**env, "PYTHONPATH": "/site"})
    # another program, another interpreter or environment, an interpreter option, not a .py file
    assert not forks.can_fork([str(Path("/elsewhere/bin/vllm")), "serve"], env)
    assert not forks.can_fork(["/usr/bin/python3", "-m", "vllm_omni_plugin.dynamo"], env)
    assert not forks.can_fork([sys.executable, "-B", "-m", "vllm_omni_plugin.dynamo"], env)
    assert not forks.can_fork([sys.executable, "-c", "print(1)"], env)
    assert not forks.can_fork([sys.executable, "-m"], env)
    assert not forks.can_fork([sys.executable, "-m", "-x"], env)
    assert not forks.can_fork([sys.executable, "tests/engine_scripts/resume_path.py"], env)  # relative
    assert not forks.can_fork([sys.executable, SCRIPT + ".missing.py"], env)
    assert not forks.can_fork([sys.executable, bin_script("vllm")], env)
    assert not forks.can_fork([], env)


def _probe(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[dict, bool, str, int]:
    """``argv`` run fresh, then through ``run_to_end`` (a fork of the session's fork server where it can be
    one): what the second run printed, whether it was a fork, and the ends both runs share (stderr,
    status)."""
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    second = run_to_end(argv, env, timeout=120, cwd=cwd)
    fresh_said, fresh_forked = (json.loads(line) for line in fresh.stdout.splitlines())
    said, forked = (json.loads(line) for line in second.stdout.splitlines())
    assert not fresh_forked["forked"]
    # sys.path: the same first entry and order; a fork's may hold more, which the fork server's imports
    # added (Ray's bundled packages, setuptools' vendored ones), as they add them in a fresh process
    path, fresh_path = said.pop("path"), fresh_said.pop("path")
    assert path[0] == fresh_path[0] and [p for p in path if p in fresh_path] == fresh_path
    assert said == fresh_said
    assert (second.stderr, second.returncode) == (fresh.stderr, fresh.returncode)
    return said, forked["forked"], second.stderr, second.returncode


def _differing(env: dict[str, str], forks: VllmForks) -> list[str]:
    """The variables that keep ``env`` from forking: those differing from the fork server's, but for
    those read when used."""
    names = set(env) | set(forks.env)
    return sorted(k for k in names if env.get(k) != forks.env.get(k) and not read_when_used(k))


@pytest.mark.processes
def test_a_module_runs_as_a_fork_as_python_m_runs_it(tmp_path: Path, vllm_forks: VllmForks) -> None:
    (tmp_path / "fork_probe.py").write_text("import sys\nVALUE = 1\n" + PROBE + "sys.exit(3)\n")
    # the environment as the suite's helpers make it, in this test (frozen at the run's start: no
    # PYTEST_CURRENT_TEST, which pytest sets in this process for each test phase)
    env = cpu_test_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DYN_NAMESPACE": "probe"})
    said, forked, stderr, status = _probe([sys.executable, "-m", "fork_probe", "a", "--b"], env, tmp_path)
    assert forked, _differing(env, vllm_forks)
    assert said["argv"] == [str(tmp_path / "fork_probe.py"), "a", "--b"] and said["spec"] == "fork_probe"
    assert said["name"] == "__main__" and said["cwd"] == str(tmp_path)
    assert said["seen"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DYN_NAMESPACE": "probe", "PROBE": None,
                            "PYTEST_CURRENT_TEST": env.get("PYTEST_CURRENT_TEST")}  # fmt: skip
    assert (stderr, status) == ("", 3)


@pytest.mark.processes
def test_a_script_runs_as_a_fork_as_python_runs_it(tmp_path: Path, vllm_forks: VllmForks) -> None:
    """From its own directory (``sys.path[0]``: a module beside it imports), to an uncaught exception printed
    as the interpreter prints it."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "fork_probe_value.py").write_text("VALUE = 2\n")
    script = scripts / "fork_probe.py"
    script.write_text(PROBE.replace("import json, os, sys", "import json, os, sys\nfrom fork_probe_value import VALUE")
                      + textwrap.dedent("""
                      def fail():
                          raise ValueError("as a fresh interpreter prints it")
                      fail()
                      """))  # fmt: skip
    env = cpu_test_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    said, forked, stderr, status = _probe([sys.executable, str(script), "x"], env, tmp_path)
    assert forked, _differing(env, vllm_forks)
    assert said["argv"] == [str(script), "x"] and said["name"] == "__main__" and said["spec"] is None
    assert said["value"] == 2 and said["cwd"] == str(tmp_path)
    assert status == 1 and stderr.startswith(f'Traceback (most recent call last):\n  File "{script}", line')
    assert stderr.endswith("ValueError: as a fresh interpreter prints it\n")


@pytest.mark.processes
def test_another_environment_runs_fresh(tmp_path: Path, vllm_forks: VllmForks) -> None:
    (tmp_path / "fork_probe.py").write_text("VALUE = 3\n" + PROBE)
    env = cpu_test_env({"PROBE": "1"})  # read by whoever wants it: no fork
    said, forked, _, status = _probe([sys.executable, "-m", "fork_probe"], env, tmp_path)
    assert not forked and said["seen"]["PROBE"] == "1" and status == 0
    # what the fork server's imports set may differ only where it holds what they set (the fork server's
    # value after them), not another value
    argv = [sys.executable, "-m", "fork_probe"]
    assert vllm_forks.can_fork(argv, cpu_test_env())
    assert not vllm_forks.can_fork(argv, cpu_test_env({"TORCHINDUCTOR_COMPILE_THREADS": "2"}))
    libraries = ":".join(p for p in (str(tmp_path), os.environ.get("LD_LIBRARY_PATH")) if p)
    assert not vllm_forks.can_fork(argv, cpu_test_env({"LD_LIBRARY_PATH": libraries}))


@pytest.mark.processes
def test_a_module_the_fork_server_imported_runs_in_a_fresh_interpreter(vllm_forks: VllmForks) -> None:
    """Run by runpy beside the fork server's copy, it would warn so (and be a second copy): the fork execs
    a fresh interpreter instead, whose output is a fresh process's."""
    argv = [sys.executable, "-m", "vllm_omni_testkit.harness.leaks"]  # the fork server imports it
    assert vllm_forks.can_fork(argv, vllm_forks.env)
    forked = vllm_forks.complete(argv, vllm_forks.env, timeout=120)
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=vllm_forks.env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.stderr == ""


@pytest.mark.processes
def test_a_fork_past_its_timeout_is_killed_with_its_session(tmp_path: Path, vllm_forks: VllmForks) -> None:
    """As ``subprocess.run`` ends one, with what it printed; and its children go with it. The script
    starts its child and prints its pid at once (no import to wait for): ten seconds leave it time to
    get there however busy the machine is."""
    script = tmp_path / "sleeps.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "print(child.pid, flush=True)\ntime.sleep(600)\n")  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        vllm_forks.complete([sys.executable, str(script)], vllm_forks.env, timeout=10)
    printed = str(timed_out.value.output).strip()
    assert printed.isdigit(), f"the script printed no child pid in 10 s: {printed!r}"
    child = ProcessId.of(int(printed))
    deadline = time.monotonic() + 10
    while child is not None and child.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child is None or not child.alive()
