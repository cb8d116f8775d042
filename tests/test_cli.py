"""``vllm serve ... --omni`` through the stock ``vllm`` console script."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from vllm_omni_testkit.harness.forks import run_to_end
from vllm_omni_testkit.harness.server import bin_script, cpu_test_env

pytestmark = pytest.mark.processes


def vllm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``vllm *args`` to its end: a fork of the session's fork server in the suite's usual environment,
    a fresh ``vllm`` in a changed one."""
    return run_to_end([bin_script("vllm"), *args], env or cpu_test_env(drop=("VLLM_PLUGINS",)), timeout=300)


def test_help_shows_vllm_flags_and_the_omni_group(tiny_text_model: Path) -> None:
    result = vllm("serve", str(tiny_text_model), "--omni", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # vLLM's own serve parser: its config groups ...
    for group in ("Frontend", "ModelConfig", "SchedulerConfig", "CacheConfig"):
        assert group in out
    # ... and ours, in full.
    for flag in ("--omni", "--deploy-config", "--stage-configs-path", "--stage-overrides"):
        assert flag in out


def test_help_all_lists_vllm_serve_flags(tiny_text_model: Path) -> None:
    result = vllm("serve", str(tiny_text_model), "--omni", "--help=all")
    assert result.returncode == 0, result.stderr
    for flag in ("--max-model-len", "--kv-cache-memory-bytes", "--api-key", "--port"):
        assert flag in result.stdout
    assert "--deploy-config" in result.stdout


def test_vllm_plugins_without_omni_exits_2() -> None:
    env = cpu_test_env({"VLLM_PLUGINS": "lora_filesystem_resolver"})
    result = vllm("serve", "X", "--omni", env=env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "VLLM_PLUGINS" in lines[0] and "omni" in lines[0]
    assert "Traceback" not in result.stderr


def test_vllm_plugins_naming_omni_is_accepted(tiny_text_model: Path) -> None:
    env = cpu_test_env({"VLLM_PLUGINS": "lora_filesystem_resolver,omni"})
    result = vllm("serve", str(tiny_text_model), "--omni", "--help", env=env)
    assert result.returncode == 0, result.stderr


def test_vllm_omni_distribution_conflict_exits_2(tmp_path: Path) -> None:
    dist = tmp_path / "vllm_omni-0.20.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-omni\nVersion: 0.20.0\n")
    env = cpu_test_env({"PYTHONPATH": str(tmp_path)}, drop=("VLLM_PLUGINS",))
    result = vllm("serve", "X", "--omni", env=env)
    assert result.returncode == 2
    assert "vllm-omni distribution (0.20.0) is installed" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--deploy-config", "a.yaml", "--stage-configs-path", "b.yaml"], "give only one"),
        (["--deploy-config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml: no such file"),
        (["--stage-overrides", "[1]"], "expected a JSON object keyed by stage id"),
        (["--stage-overrides", "{bad"], "not valid JSON"),
        (["--headless"], "give --stage-id N and --head ADDR:PORT"),
        (["--stage-id", "1", "--head", "10.0.0.1:29600"], "add --headless"),
        (["--headless", "--stage-id", "1", "--head", "10.0.0.1"], "expected ADDR:PORT"),
    ],
)
def test_bad_omni_arguments_exit_2(args: list[str], message: str) -> None:
    result = vllm("serve", "X", "--omni", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_omni_with_another_subcommand_exits_2() -> None:
    result = vllm("chat", "--omni")
    assert result.returncode == 2
    assert "vllm serve MODEL --omni" in result.stderr


# --- configuration through the command line ------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glm-image")
    (path / "model_index.json").write_text('{"_class_name": "GlmImagePipeline"}')
    return path


def test_print_resolved_config(glm_dir: Path) -> None:
    import yaml

    result = vllm(
        "serve", str(glm_dir), "--omni", "--deploy-config", str(REPO / "deploy" / "glm_image.yaml"),
        "--print-resolved-config", "--max-num-seqs", "3",
        "--stage-overrides", '{"1": {"num_inference_steps": 7}}',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    ar, dit = resolved["stages"]
    assert resolved["pipeline"] == "glm_image" and resolved["platform"] == "cpu"
    assert ar["engine_args"]["scheduler_cls"].endswith(".OmniARScheduler")  # CPU: sync
    assert ar["engine_args"]["async_scheduling"] is False
    assert ar["engine_args"]["max_num_seqs"] == 3  # vLLM flag on the command line
    assert dit["request_defaults"]["num_inference_steps"] == 7  # --stage-overrides
    assert dit["diffusion_args"]["scheduling_policy"] == "fcfs"  # the default, shown


def test_legacy_file_through_stage_configs_path(glm_dir: Path) -> None:
    import yaml

    legacy = REPO / "tests" / "data" / "legacy_glm_image_nixl.yaml"
    result = vllm(
        "serve", str(glm_dir), "--omni", "--stage-configs-path", str(legacy), "--print-resolved-config"
    )
    assert result.returncode == 0, result.stderr
    hints = [line for line in result.stderr.splitlines() if "legacy stage_args schema" in line]
    assert len(hints) == 1
    resolved = yaml.safe_load(result.stdout)
    assert resolved["stages"][0]["engine_args"]["scheduler_cls"].endswith(".OmniARScheduler")
    assert {e["to"]: e["connector"] for e in resolved["edges"]} == {
        1: "nixl_ar2dit",
        "router": "dit_to_router",
    }


def test_config_error_is_one_line_and_exit_2(glm_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipeline: glm_image\nstages:\n  - stage_id: 0\n    max_num_seqs: four\n")
    result = vllm("serve", str(glm_dir), "--omni", "--deploy-config", str(bad), "--print-resolved-config")
    assert result.returncode == 2
    assert f'error: {bad}:4: stages[0].max_num_seqs: expected int, got "four"' in result.stderr
    assert "Traceback" not in result.stderr


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "NixlConnector", "InProcessConnector"])
def test_typo_in_a_connectors_extra_stops_serve_at_start_up(
    glm_dir: Path, tmp_path: Path, connector: str
) -> None:
    """Checked by resolution against the connector's settings, before any stage process could trip on it."""
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        "pipeline: glm_image\n"
        "connectors:\n"
        f"  edge: {{name: {connector}, extra: {{lease_timout_s: 5}}}}\n"
        "stages:\n"
        "  - {stage_id: 1, input_connectors: {from_stage_0: edge}}\n"
    )
    result = vllm("serve", str(glm_dir), "--omni", "--deploy-config", str(bad), "--port", "0")
    line = one_error_line(result)
    assert line.startswith(f"error: {bad}:3: connectors.edge.extra.lease_timout_s: unknown field"), line
    assert ("did you mean 'lease_timeout_s'" in line) is (connector != "InProcessConnector")
    assert " ready" not in result.stderr


@pytest.mark.parametrize("model", ["/nonexistent/glm-image", "./no-such-dir"])
def test_missing_model_directory_exits_2(model: str) -> None:
    line = one_error_line(vllm("serve", model, "--omni"))
    assert f"model directory {model} does not exist" in line


def test_busy_port_exits_2_before_any_stage_starts(glm_dir: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = vllm("serve", str(glm_dir), "--omni", "--host", "127.0.0.1", "--port", str(port))
    line = one_error_line(result)
    assert f"127.0.0.1:{port}" in line and "already in use" in line
    assert " ready" not in result.stderr  # nothing was started ("already" aside)


def test_headless_worker_for_a_stage_the_head_runs_exits_2(glm_dir: Path) -> None:
    result = vllm("serve", str(glm_dir), "--omni", "--deploy-config", str(REPO / "deploy" / "glm_image.yaml"),
                  "--headless", "--stage-id", "1", "--head", "127.0.0.1:29600")  # fmt: skip
    assert result.returncode == 2
    assert "stage 1 (dit) is not marked `headless: true`" in result.stderr
    assert "Traceback" not in result.stderr
