"""The plugin on a vLLM whose V1 model runner is gone (as in vLLM 0.34), on the installed vLLM: run with a
``sitecustomize`` on ``PYTHONPATH`` that makes vLLM's V1 runner modules unimportable in this process and in
every process it starts (``V1_MODULES``; a blocked import raises ``ModuleNotFoundError`` and is recorded
with the file that asked for it).

    python without_v1_runner.py TINY_GLM_IMAGE TINY_BAGEL TINY_SD3

Prints one ``RESULT {json}`` line: each plugin module that did not import and who imported the V1 module
(ours or vLLM's own), which runner resolution picks for every shipped pipeline on CUDA and CPU, the line a
``VLLM_USE_V2_MODEL_RUNNER=0`` gets, and the shape of an image a diffusers deployment made.
"""

from __future__ import annotations

import json
import os
import pkgutil
import sys
import traceback
from pathlib import Path

BLOCKED_LOG_ENV = "VLLM_OMNI_TEST_BLOCKED_LOG"


def main() -> None:
    glm_dir, bagel_dir, sd3_dir = sys.argv[1:4]
    import importlib

    import vllm_omni_plugin
    from vllm_omni_plugin import compat

    result: dict[str, object] = {"blocker_active": "vllm_omni_test_no_v1" in sys.modules}
    failed: dict[str, str] = {}
    v1_only: list[str] = []
    for info in pkgutil.walk_packages(vllm_omni_plugin.__path__, "vllm_omni_plugin."):
        if info.name.endswith(".__main__"):
            continue  # a command, which runs when imported
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            failed[info.name] = f"{type(exc).__name__}: {exc}"
            continue
        if getattr(module, "V1_ONLY", False):
            v1_only.append(info.name)
    result["failed_imports"] = failed
    result["v1_only_imported"] = v1_only
    log = Path(os.environ[BLOCKED_LOG_ENV])
    result["blocked"] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    result["has_v1"] = compat.vllm_has_v1_runner()
    result["uses_v2"] = compat.uses_v2_model_runner(object())

    from vllm_omni_plugin.config import PLATFORMS, ConfigError, resolve_deployment

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    runners: dict[str, list[str | None]] = {}
    for model, name, platform in (
        (glm_dir, "glm_image.yaml", "cuda"),
        (bagel_dir, "bagel.yaml", "cuda"),
        (glm_dir, "tiny_glm_image_cpu.yaml", "cpu"),
        (bagel_dir, "tiny_bagel_cpu.yaml", "cpu"),
    ):
        resolved = resolve_deployment(model, deploy_config=str(deploy / name), platform=PLATFORMS[platform])
        runners[f"{name}@{platform}"] = [
            stage.model_runner for stage in resolved.stages if stage.execution_type == "llm_ar"
        ] + [replica.env.get("VLLM_USE_V2_MODEL_RUNNER") for s in resolved.stages for replica in s.replicas]
    result["runners"] = runners
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        resolve_deployment(glm_dir, deploy_config=str(deploy / "glm_image.yaml"), platform=PLATFORMS["cuda"])
        result["v1_refusal"] = None
    except ConfigError as exc:
        result["v1_refusal"] = str(exc)
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]

    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    try:
        with Omni(sd3_dir) as omni:
            (served,) = omni.generate(
                [OmniRequest(prompt="a red fox", height=64, width=64, seed=0, num_inference_steps=2)]
            )
        result["image"] = list(served.output.image.shape) if served.error is None else served.error
    except Exception:  # noqa: BLE001 - reported to the test
        result["image"] = traceback.format_exc()[-3000:]
    log = Path(os.environ[BLOCKED_LOG_ENV])
    result["blocked_anywhere"] = (
        [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
