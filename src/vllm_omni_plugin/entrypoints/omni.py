"""The offline Python API: ``Omni`` (blocking) and ``AsyncOmni`` (asyncio).

    from vllm_omni_plugin.entrypoints.omni import Omni
    with Omni("./glm-image", deploy_config="deploy/tiny_glm_image_cpu.yaml") as omni:
        results = omni.generate(["a red fox"], height=64, width=64, seed=0)

Both resolve the deployment exactly as ``vllm serve --omni`` does, start every stage replica and run
requests through the same ``Orchestrator``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from vllm_omni_plugin.config import ResolvedDeployment, resolve_deployment
from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.core_client import StageCoreClientBase
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult, Orchestrator
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


def build_connectors(deployment: ResolvedDeployment) -> dict[str, Any]:
    from vllm_omni_plugin.connectors.base import make_connector

    return {
        name: make_connector(name, spec.name, dict(spec.extra))
        for name, spec in deployment.connectors.items()
    }


def build_pools(
    deployment: ResolvedDeployment,
    connectors: dict[str, Any],
    stage_ids: Sequence[int] | None = None,
    *,
    headless_worker: bool = False,
) -> dict[int, StageReplicaPool]:
    """A replica pool per stage. Headless stages get a ``RemoteStageClient`` (their worker registers
    later), except in the headless worker itself, which runs them here."""
    from vllm_omni_plugin.stage.diffusion_core_client import (
        InlineStageDiffusionClient,
        StageDiffusionCoreClient,
    )
    from vllm_omni_plugin.stage.diffusion_core_proc import StageDiffusionProcConfig
    from vllm_omni_plugin.stage.headless import RemoteStageClient
    from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient

    pools: dict[int, StageReplicaPool] = {}
    for stage in deployment.stages:
        if stage_ids is not None and stage.stage_id not in stage_ids:
            continue
        clients: list[StageCoreClientBase] = []
        # The connectors this stage reads its input through and sends its final output back through.
        router = stage.output_connectors.get("to_stage_router")
        source = next(iter(sorted(stage.input_connectors.items())), None)
        in_name = source[1] if source else None
        if stage.headless and not headless_worker:
            remote = RemoteStageClient(
                stage.stage_id,
                stage.name,
                input_connector=connectors.get(in_name) if in_name else None,
                output_connector=connectors.get(router) if router else None,
            )
            pools[stage.stage_id] = StageReplicaPool(stage.stage_id, stage.name, [remote])
            continue
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
                spec = deployment.connectors.get(router) if router else None
                out_connector = (router, spec.name, dict(spec.extra)) if spec and router else None
                in_spec = deployment.connectors.get(in_name) if in_name else None
                in_connector = (in_name, in_spec.name, dict(in_spec.extra)) if in_spec and in_name else None
                config = StageDiffusionProcConfig(
                    stage_id=stage.stage_id,
                    replica_id=replica.replica_id,
                    input_address="",
                    output_address="",
                    diffusion_args={
                        **stage.diffusion_args,
                        "default_sampling_params": stage.default_sampling_params,
                    },
                    platform=deployment.platform,
                    env=replica.env,
                    output_connector=out_connector,
                    input_connector=in_connector,
                )
                clients.append(
                    StageDiffusionCoreClient(
                        config,
                        name=stage.name,
                        output_connector=connectors.get(router) if router else None,
                        input_connector=connectors.get(in_name) if in_name else None,
                    )
                )
            else:
                clients.append(
                    InlineStageDiffusionClient(
                        stage.stage_id,
                        replica.replica_id,
                        {**stage.diffusion_args, "default_sampling_params": stage.default_sampling_params},
                        name=stage.name,
                        platform=deployment.platform,
                    )
                )
        pools[stage.stage_id] = StageReplicaPool(stage.stage_id, stage.name, clients)
    return pools


class AsyncOmni:
    """All stages of one deployment, driven from the caller's event loop."""

    def __init__(self, deployment: ResolvedDeployment) -> None:
        self.deployment = deployment
        self.connectors: dict[str, Any] = {}
        self.pools: dict[int, StageReplicaPool] = {}
        self.orchestrator: Orchestrator | None = None
        self.registry: Any = None
        """Where headless stage workers register, when the deployment has headless stages."""

    @classmethod
    async def create(
        cls,
        model: str,
        *,
        deploy_config: str | None = None,
        stage_configs_path: str | None = None,
        stage_overrides: dict[str, Any] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> AsyncOmni:
        if not os.path.isdir(model):
            raise ConfigError(f"model directory {model!r} does not exist")
        deployment = resolve_deployment(
            model,
            deploy_config=deploy_config,
            stage_configs_path=stage_configs_path,
            stage_overrides=stage_overrides,
            cli_engine_args=engine_args,
        )
        for note in deployment.notes:
            logger.warning("%s", note)
        omni = cls(deployment)
        await omni.start()
        return omni

    async def start(self) -> None:
        from vllm_omni_plugin.stage.headless import HeadlessStageRegistry, RemoteStageClient

        self.connectors = build_connectors(self.deployment)
        self.pools = build_pools(self.deployment, self.connectors)
        remote = {
            sid: client
            for sid, pool in self.pools.items()
            for client in pool.clients
            if isinstance(client, RemoteStageClient)
        }
        started: list[StageReplicaPool] = []
        try:
            for pool in self.pools.values():
                await pool.start()
                started.append(pool)
            if remote:  # only once the local stages run: starting them blocks this loop at times
                self.registry = HeadlessStageRegistry(self.deployment, remote)
                await self.registry.start()
        except BaseException:
            for pool in started:
                await pool.shutdown()
            await self._stop_registry()
            self._close_connectors()
            raise
        self.orchestrator = Orchestrator(self.deployment, self.pools, self.connectors)

    async def generate(self, request: OmniRequest) -> OmniResult:
        assert self.orchestrator is not None, "start() first"
        return await self.orchestrator.generate(request)

    async def shutdown(self) -> None:
        await self._stop_registry()
        await asyncio.gather(*(pool.shutdown() for pool in self.pools.values()), return_exceptions=True)
        self._close_connectors()

    async def _stop_registry(self) -> None:
        """Tell headless workers that the head is going (they stop their replicas and exit)."""
        if self.registry is not None:
            registry, self.registry = self.registry, None
            await registry.shutdown()

    def _close_connectors(self) -> None:
        for connector in self.connectors.values():
            try:
                connector.close()
            except Exception:  # closing must release the rest
                logger.exception("closing a connector failed")


class Omni:
    """Blocking twin of :class:`AsyncOmni`: runs it on an event loop in a background thread."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-loop", daemon=True)
        self._thread.start()
        try:
            self._async = self._call(AsyncOmni.create(model, **kwargs))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def deployment(self) -> ResolvedDeployment:
        return self._async.deployment

    def submit(self, request: OmniRequest) -> Future[OmniResult]:
        return asyncio.run_coroutine_threadsafe(self._async.generate(request), self._loop)

    def generate(self, prompts: Sequence[str | OmniRequest], **params: Any) -> list[OmniResult]:
        """Run every prompt concurrently (stages overlap and batch) and return results in order."""
        requests = [p if isinstance(p, OmniRequest) else OmniRequest(prompt=p, **params) for p in prompts]
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._async.shutdown())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
