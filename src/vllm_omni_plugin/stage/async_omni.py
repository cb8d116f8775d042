"""``AsyncOmni``: every stage of one deployment, started, run and stopped from an asyncio event loop.

The runtime under ``vllm serve --omni`` and the offline API (``entrypoints.omni.Omni`` is its blocking
twin, as vLLM keeps ``AsyncLLM`` in its engine layer and ``LLM`` in its entry points). It resolves the
deployment exactly as ``vllm serve --omni`` does, completes requests with its ``InputProcessor``, places
every stage's replicas through one ``StagePlacement`` (whatever kinds it holds) and runs requests through
the ``Orchestrator``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from vllm_omni_plugin.config import ResolvedDeployment, resolve_deployment
from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.schema import Backend
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.factory import build_connectors, build_stages, placement_for
from vllm_omni_plugin.stage.input_processor import InputProcessor, OmniCoreRequest, OmniRequest, RequestBounds
from vllm_omni_plugin.stage.orchestrator import OmniResult, Orchestrator
from vllm_omni_plugin.stage.placement.base import StagePlacement
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


class AsyncOmni:
    """All stages of one deployment, driven from the caller's event loop.

    ``placement`` decides where each stage's replicas run (default: ``factory.placement_for`` the
    deployment: this host or a Ray cluster, headless stages on their workers).
    """

    def __init__(self, deployment: ResolvedDeployment, *, placement: StagePlacement | None = None) -> None:
        self.deployment = deployment
        self.inputs = InputProcessor(deployment)
        """The request defaults and limits, read from the deployment's configuration at once."""
        self.placement = placement or placement_for(deployment)
        self.connectors: dict[str, OmniConnector] = {}
        self.pools: dict[int, StageReplicaPool] = {}
        self.orchestrator: Orchestrator | None = None

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        deploy_config: str | None = None,
        stage_configs_path: str | None = None,
        stage_overrides: dict[str, Any] | None = None,
        engine_args: dict[str, Any] | None = None,
        backend: Backend | None = None,
    ) -> AsyncOmni:
        if not os.path.isdir(model):
            raise ConfigError(f"model directory {model!r} does not exist")
        deployment = resolve_deployment(
            model,
            deploy_config=deploy_config,
            stage_configs_path=stage_configs_path,
            stage_overrides=stage_overrides,
            cli_engine_args=engine_args,
            backend=backend,
        )
        for note in deployment.notes:
            logger.warning("%s", note)
        omni = cls(deployment)
        await omni.start()
        return omni

    async def start(self) -> None:
        self.connectors = build_connectors(self.deployment)
        self.pools = build_stages(self.deployment, self.connectors, placement=self.placement)
        starting: list[asyncio.Task[None]] = []
        try:
            if stages_start_side_by_side(self.deployment):
                # the stages that keep the environment while they load last, each once the one before
                # runs its processes: a DiT loads while the AR engine does
                for pool in sorted(self.pools.values(), key=lambda p: p.holds_environment_while_loading):
                    starting.append(asyncio.create_task(pool.start(), name=f"start {pool.name}"))
                    await pool.launched(starting[-1])
                done, _ = await asyncio.wait(starting, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if (error := task.exception()) is not None:
                        raise error
            else:
                for pool in self.pools.values():
                    await pool.start()
            await self.placement.start()  # only once the pools run: starting them blocks this loop at times
        except BaseException:  # including an interrupt half-way: every pool, also the ones starting
            for task in starting:
                task.cancel()
            await asyncio.gather(*starting, return_exceptions=True)  # their outcomes read: none is logged
            self.placement.abandon()
            for pool in self.pools.values():
                await pool.shutdown()
            await self.placement.shutdown()
            self._close_connectors()
            raise
        self.orchestrator = Orchestrator(self.deployment, self.pools, self.connectors, self.inputs)

    async def process(self, request: OmniRequest, bounds: RequestBounds | None = None) -> OmniCoreRequest:
        """``request`` complete and checked (``InputProcessor.process``; an ``InputError`` says why not)."""
        return await self.inputs.process(request, bounds)

    async def generate(self, request: OmniRequest | OmniCoreRequest) -> OmniResult:
        """Run a request (a parsed one is completed first; a refusal is its result's error)."""
        assert self.orchestrator is not None, "start() first"
        return await self.orchestrator.generate(request)

    async def shutdown(self) -> None:
        for pool in self.pools.values():  # a replica that dies from here on stays down
            pool.stop_restarting()
        await self.placement.shutdown()  # e.g. headless workers hear that the head goes
        await asyncio.gather(*(pool.shutdown() for pool in self.pools.values()), return_exceptions=True)
        self._close_connectors()

    def _close_connectors(self) -> None:
        for connector in self.connectors.values():
            try:
                connector.close()
            except Exception:  # closing must release the rest
                logger.exception("closing a connector failed")


def stages_start_side_by_side(deployment: ResolvedDeployment) -> bool:
    """Whether the stages may load at the same time. On a GPU, vLLM's engine sizes its KV cache from the
    device memory it measures while it loads, so another stage loading on the same device meanwhile would
    be counted against it: stages start one after the other unless every replica names its devices and
    no device serves two stages. On CPU the KV cache has a set size."""
    if deployment.platform == "cpu":
        return True
    if any(not replica.devices for stage in deployment.stages for replica in stage.replicas):
        return False
    taken: set[str] = set()
    for stage in deployment.stages:
        if stage.devices() & taken:
            return False
        taken |= stage.devices()
    return True
