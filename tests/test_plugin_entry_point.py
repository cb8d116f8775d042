"""The package registers with vLLM's plugin system and stays cheap and idempotent."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from vllm_omni_testkit.harness.server import cpu_test_env

pytestmark = pytest.mark.processes


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=cpu_test_env(env, drop=() if "VLLM_PLUGINS" in env else ("VLLM_PLUGINS",)),
        timeout=300,
    )


def test_entry_point_declared() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "omni"]
    assert ep.value == "vllm_omni_plugin:register"


def test_import_is_cheap_and_register_is_lazy() -> None:
    code = (
        "import sys, json; import vllm_omni_plugin as p;"
        "heavy = ('torch', 'vllm', 'diffusers', 'transformers');"
        "at_import = sorted(m for m in heavy if m in sys.modules);"
        "p.register(); p.register();"
        "from vllm import ModelRegistry;"
        "print(json.dumps({'at_import': at_import,"
        " 'model_module_loaded': 'vllm_omni_plugin.models.glm_image_ar' in sys.modules,"
        " 'diffusers_loaded': 'diffusers' in sys.modules,"
        " 'registered': 'GlmImageForConditionalGeneration' in ModelRegistry.get_supported_archs()}))"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "at_import": [],
        "model_module_loaded": False,  # registered as a lazy "module:Class" string
        "diffusers_loaded": False,
        "registered": True,
    }


LOAD_CODE = (
    "import json, vllm_omni_plugin as p; from vllm.plugins import load_general_plugins;"
    "load_general_plugins(); load_general_plugins(); print(json.dumps(p._registered))"
)


def test_vllm_loads_the_plugin() -> None:
    result = _run_python(LOAD_CODE)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) is True


def test_vllm_plugins_switch_excludes_it() -> None:
    result = _run_python(LOAD_CODE, VLLM_PLUGINS="lora_filesystem_resolver")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) is False
    result = _run_python(LOAD_CODE, VLLM_PLUGINS="omni")
    assert json.loads(result.stdout.strip().splitlines()[-1]) is True


def test_registration_failure_does_not_raise() -> None:
    code = (
        "import vllm_omni_plugin as p, vllm_omni_plugin.registry as r;"
        "r.MODEL_ARCHITECTURES['X'] = 42;"  # not a lazy string: ModelRegistry rejects it
        "p.register(); print('alive')"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("alive")
    assert "registration failed" in result.stderr
