"""Stages from a resolved deployment: this process's connectors and one replica pool per stage.

Which client serves each replica is a *placement*, chosen by the deployment's ``backend``
(:func:`placement_for`). :func:`local_clients` runs every replica on this host (an AR stage on a vLLM
engine, a diffusion stage in a ``StageDiffusionCoreProc`` or in this process); backend ``ray`` makes
every replica a Ray actor (``placement.ray.RayPlacement``). A headless stage, seen from its head, is one
``RemoteStageClient`` that its worker registers with.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_omni_plugin.config.resolved import ROUTER, RUNNER_ENV, ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.connectors.base import OmniConnector, make_connector
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase
from vllm_omni_plugin.stage.diffusion_core_client import InlineStageDiffusionClient, StageDiffusionCoreClient
from vllm_omni_plugin.stage.diffusion_core_proc import ConnectorSpecTuple, StageDiffusionProcConfig
from vllm_omni_plugin.stage.headless import RemoteStageClient
from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)

Placement = Callable[[ResolvedDeployment, ResolvedStage, dict[str, OmniConnector]], list[StageCoreClientBase]]
"""``(deployment, stage, connectors) -> one client per replica of the stage``."""


def build_connectors(deployment: ResolvedDeployment) -> dict[str, OmniConnector]:
    """One connector object per deploy-config connector, for this process."""
    return {
        name: make_connector(name, spec.name, dict(spec.extra))
        for name, spec in deployment.connectors.items()
    }


@dataclass(frozen=True)
class StageConnectors:
    """The connectors of a stage's client side, by deploy-config name (None: values travel inline)."""

    input: str | None
    """What the stage's request tensors travel through (the edge from its first source)."""
    output: str | None
    """What the final stage's output comes back through (its edge to the router)."""

    @classmethod
    def of(cls, deployment: ResolvedDeployment, stage: ResolvedStage) -> StageConnectors:
        sources = stage.input_sources
        return cls(
            input=deployment.edge(sources[0], stage.stage_id).connector if sources else None,
            output=deployment.edge(stage.stage_id, ROUTER).connector if stage.final_output else None,
        )

    def spec(self, deployment: ResolvedDeployment, name: str | None) -> ConnectorSpecTuple | None:
        """What a stage process needs to build the connector itself: (name, class, extra)."""
        if name is None:
            return None
        spec = deployment.connectors[name]
        return (name, spec.name, dict(spec.extra))


def local_clients(
    deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
) -> list[StageCoreClientBase]:
    """Every replica of ``stage`` on this host."""
    ends = StageConnectors.of(deployment, stage)
    clients: list[StageCoreClientBase] = []
    for replica in stage.replicas:
        if stage.execution_type == "llm_ar":
            clients.append(
                StageLLMCoreClient(
                    stage.stage_id,
                    replica.replica_id,
                    stage.engine_args,
                    name=stage.name,
                    env=replica.env,
                    default_sampling_params=stage.default_sampling_params,
                )
            )
        elif stage.process:
            config = StageDiffusionProcConfig(
                stage_id=stage.stage_id,
                replica_id=replica.replica_id,
                input_address="",
                output_address="",
                diffusion_args=stage.diffusion_args,
                env=replica.env,
                output_connector=ends.spec(deployment, ends.output),
                input_connector=ends.spec(deployment, ends.input),
            )
            clients.append(
                StageDiffusionCoreClient(
                    config,
                    name=stage.name,
                    output_connector=connectors.get(ends.output) if ends.output else None,
                    input_connector=connectors.get(ends.input) if ends.input else None,
                )
            )
        else:
            clients.append(
                InlineStageDiffusionClient(
                    stage.stage_id, replica.replica_id, stage.diffusion_args, name=stage.name
                )
            )
    return clients


def remote_client(
    deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
) -> RemoteStageClient:
    """The head's one client of a headless stage (its worker runs the replicas)."""
    ends = StageConnectors.of(deployment, stage)
    return RemoteStageClient(
        stage.stage_id,
        stage.name,
        input_connector=connectors.get(ends.input) if ends.input else None,
        output_connector=connectors.get(ends.output) if ends.output else None,
    )


def placement_for(deployment: ResolvedDeployment) -> Placement:
    """The placement of the deployment's backend."""
    if deployment.backend == "ray":
        from vllm_omni_plugin.stage.placement.ray import RayPlacement

        return RayPlacement(deployment)
    return local_clients


@dataclass
class Stages:
    pools: dict[int, StageReplicaPool]
    """Stage id -> its replica pool."""
    remote: dict[int, RemoteStageClient]
    """Headless stages (served by workers that register with this head), by stage id."""


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
    placement: Placement | None = None,
    headless_worker: bool = False,
) -> Stages:
    """A replica pool per stage (``stage_ids``: only those), placed by ``placement`` (default: the one of
    the deployment's backend). Headless stages get a ``RemoteStageClient``, except in the headless worker
    itself (``headless_worker``), which places them like any other."""
    placement = placement or placement_for(deployment)
    stages = Stages(pools={}, remote={})
    for stage in deployment.stages:
        if stage.model_runner is not None and (stage_ids is None or stage.stage_id in stage_ids):
            adopt_model_runner(stage)
    for stage in deployment.stages:
        if stage_ids is not None and stage.stage_id not in stage_ids:
            continue
        clients: list[StageCoreClientBase]
        if stage.headless and not headless_worker:
            remote = remote_client(deployment, stage, connectors)
            stages.remote[stage.stage_id] = remote
            clients = [remote]
        else:
            clients = placement(deployment, stage, connectors)
        stages.pools[stage.stage_id] = StageReplicaPool(stage.stage_id, stage.name, clients)
    return stages
