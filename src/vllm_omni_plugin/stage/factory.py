"""Stages from a resolved deployment: this process's connectors and one replica pool per stage.

Which clients serve a stage's replicas is its *placement* (``placement.base.StagePlacement``), chosen
from the deployment by :func:`placement_for`: this host (``LocalPlacement``), a Ray cluster when the
``backend`` is ``ray`` (``RayPlacement``), and for a stage marked ``headless`` a worker on another host
(``HeadlessPlacement``). This is the one place that knows which kinds a deployment chooses; the Dynamo
router's placement (``vllm_omni_plugin.dynamo.placement``, every stage on the stage workers Dynamo's
discovery finds) is chosen by its role, not by the deployment, so the router builds it and passes it in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_omni_plugin.config.resolved import RUNNER_ENV, ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.connectors.base import ConnectorError, OmniConnector, make_connector
from vllm_omni_plugin.log import best_effort, get_logger
from vllm_omni_plugin.stage.errors import StageStartError
from vllm_omni_plugin.stage.placement.base import PerStagePlacement, StagePlacement
from vllm_omni_plugin.stage.placement.headless.head import HeadlessPlacement
from vllm_omni_plugin.stage.placement.local.placement import LocalPlacement
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


def build_connectors(deployment: ResolvedDeployment) -> dict[str, OmniConnector]:
    """One connector object per deploy-config connector, for this process. A transport that cannot start
    here (no device, a busy port, a package missing) is one line, not a trace; those built before it
    are closed."""
    built: dict[str, OmniConnector] = {}
    for name, spec in deployment.connectors.items():
        try:
            built[name] = make_connector(name, spec.name, dict(spec.extra))
        except (ConnectorError, ImportError, ValueError, TypeError) as exc:
            for connector in built.values():
                with best_effort("closing a connector after another failed to start", logger):
                    connector.close()
            raise StageStartError(str(exc)) from None
    return built


def placement_for(deployment: ResolvedDeployment) -> StagePlacement:
    """The placement of the deployment's stages: its backend's, and headless stages on their workers."""
    backend: StagePlacement
    if deployment.backend == "ray":
        from vllm_omni_plugin.stage.placement.ray.head import RayPlacement

        backend = RayPlacement(deployment)
    else:
        backend = LocalPlacement()
    headless = [stage.stage_id for stage in deployment.stages if stage.headless]
    if not headless:
        return backend
    remote = HeadlessPlacement(deployment)
    return PerStagePlacement(backend, dict.fromkeys(headless, remote))


def adopt_model_runner(stage: ResolvedStage) -> None:
    """This process takes the AR stage's model-runner choice before it builds any ``VllmConfig`` (vLLM
    reads the variable, and may cache it, in every process that builds one), and says why once."""
    chosen = next((r.env[RUNNER_ENV] for r in stage.replicas if RUNNER_ENV in r.env), None)
    if chosen is not None and RUNNER_ENV not in os.environ:
        os.environ[RUNNER_ENV] = chosen
    logger.info(
        "stage %d (%s) runs vLLM's %s model runner: %s",
        stage.stage_id,
        stage.name,
        (stage.model_runner or "").upper(),
        stage.model_runner_reason,
    )


def build_stages(
    deployment: ResolvedDeployment,
    connectors: dict[str, OmniConnector],
    stage_ids: Sequence[int] | None = None,
    *,
    placement: StagePlacement | None = None,
) -> dict[int, StageReplicaPool]:
    """A replica pool per stage (``stage_ids``: only those) by stage id, placed by ``placement`` (default:
    :func:`placement_for` the deployment)."""
    placement = placement or placement_for(deployment)
    for stage in deployment.stages:
        if stage.model_runner is not None and (stage_ids is None or stage.stage_id in stage_ids):
            adopt_model_runner(stage)
    pools: dict[int, StageReplicaPool] = {}
    for stage in deployment.stages:
        if stage_ids is not None and stage.stage_id not in stage_ids:
            continue
        clients = placement.place(deployment, stage, connectors)
        pools[stage.stage_id] = StageReplicaPool(stage.stage_id, stage.name, clients)
    return pools
