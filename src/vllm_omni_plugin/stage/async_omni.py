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
from vllm_omni_plugin.config.schema import Backend
from vllm_omni_plugin.connectors.base import OmniConnector
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.factory import Placement, build_connectors, build_stages
from vllm_omni_plugin.stage.headless import HeadlessStageRegistry
from vllm_omni_plugin.stage.orchestrator import OmniRequest, OmniResult, Orchestrator
from vllm_omni_plugin.stage.replica_pool import StageReplicaPool

logger = get_logger(__name__)


class AsyncOmni:
    """All stages of one deployment, driven from the caller's event loop.

    ``placement`` decides where each stage's replicas run (default: the deployment's backend, this
    host or a Ray cluster).
    """

    def __init__(self, deployment: ResolvedDeployment, *, placement: Placement | None = None) -> None:
        self.deployment = deployment
        self.placement = placement
        self.connectors: dict[str, OmniConnector] = {}
        self.pools: dict[int, StageReplicaPool] = {}
        self.orchestrator: Orchestrator | None = None
        self.registry: HeadlessStageRegistry | None = None
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
        stages = build_stages(self.deployment, self.connectors, placement=self.placement)
        self.pools, remote = stages.pools, stages.remote
        try:
            for pool in self.pools.values():
                await pool.start()
            if remote:  # only once the local stages run: starting them blocks this loop at times
                self.registry = HeadlessStageRegistry(self.deployment, remote)
                await self.registry.start()
        except BaseException:  # including an interrupt half-way: every pool, also the one starting
            for pool in self.pools.values():
                await pool.shutdown()
            await self._stop_registry()
            self._close_connectors()
            raise
        self.orchestrator = Orchestrator(self.deployment, self.pools, self.connectors)

    async def generate(self, request: OmniRequest) -> OmniResult:
        assert self.orchestrator is not None, "start() first"
        return await self.orchestrator.generate(request)

    async def shutdown(self) -> None:
        for pool in self.pools.values():  # a replica that dies from here on stays down
            pool.stop_restarting()
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
