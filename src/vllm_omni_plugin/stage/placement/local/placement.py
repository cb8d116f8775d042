"""Every replica on this host: an AR stage on a vLLM engine, a diffusion stage in a
``StageDiffusionCoreProc`` or in this process."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.stage.core_client import StageCoreClientBase
from vllm_omni_plugin.stage.diffusion_core_client import InlineStageDiffusionClient, StageDiffusionCoreClient
from vllm_omni_plugin.stage.diffusion_core_proc import StageDiffusionProcConfig
from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient
from vllm_omni_plugin.stage.placement.base import StageConnectors, StagePlacement


class LocalPlacement(StagePlacement):
    """The replicas are this host's processes, which their clients start, watch and stop themselves:
    the placement holds nothing of its own."""

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
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

    async def start(self) -> None:
        """Nothing beyond the clients, which started with their pools."""

    def abandon(self) -> None:
        """Nothing outside the clients: the pools' shutdown stops their processes."""

    async def shutdown(self) -> None:
        """Nothing beyond the clients, which their pools shut down."""

    def health(self) -> dict[str, Any]:
        return {}
