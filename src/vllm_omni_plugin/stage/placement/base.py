"""The placement interface: where a stage's replicas run, as the runtime (``AsyncOmni``) sees it.

A placement gives each stage of a deployment one client per replica (``StageCoreClientBase``, which is
all that pools and the orchestrator use) and has a life of its own around theirs: what it serves once
the stages run (the headless registry), what it ends when start-up fails (Ray actors), what it tells
others when the runtime stops (headless workers) and what ``/health`` shows of it. The runtime calls
these and nothing else, so a new kind of placement needs no change there; the stage factory
(``factory.placement_for``) picks the kind per stage from the deployment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_omni_plugin.config.resolved import ROUTER, ResolvedDeployment, ResolvedStage

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector
    from vllm_omni_plugin.stage.core_client import StageCoreClientBase
    from vllm_omni_plugin.stage.diffusion_core_proc import ConnectorSpecTuple


class StagePlacement(ABC):
    """Where the replicas of a deployment's stages run, and the placement's own lifecycle.

    The runtime calls, in this order: :meth:`place` once per stage; the pools start the clients;
    :meth:`start`; and when it stops, :meth:`shutdown` before the pools shut down. A start-up that
    fails calls :meth:`abandon`, the pools' shutdown and :meth:`shutdown`.
    """

    @abstractmethod
    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        """``stage``'s replicas: one client each (not started; ``connectors``: this process's)."""

    @abstractmethod
    async def start(self) -> None:
        """Once every pool's clients have started: what the placement serves beyond them."""

    @abstractmethod
    def abandon(self) -> None:
        """Start-up failed: end at once what the placed replicas hold outside this process."""

    @abstractmethod
    async def shutdown(self) -> None:
        """The runtime stops (after a failed start-up too), before its pools shut down; a second call
        does nothing."""

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """What ``/health`` shows of the placement beyond its replicas (read without waiting)."""


class PerStagePlacement(StagePlacement):
    """Some stages placed by one placement, the others by another (e.g. headless stages on workers of
    other hosts, the rest on this host): each call goes to the placements it concerns."""

    def __init__(self, default: StagePlacement, by_stage: Mapping[int, StagePlacement]) -> None:
        self.default = default
        self.by_stage = dict(by_stage)

    @property
    def members(self) -> list[StagePlacement]:
        """Every placement, once each, the default first."""
        members = [self.default]
        for placement in self.by_stage.values():
            if all(placement is not m for m in members):
                members.append(placement)
        return members

    def place(
        self, deployment: ResolvedDeployment, stage: ResolvedStage, connectors: dict[str, OmniConnector]
    ) -> list[StageCoreClientBase]:
        placement = self.by_stage.get(stage.stage_id, self.default)
        return placement.place(deployment, stage, connectors)

    async def start(self) -> None:
        for placement in self.members:
            await placement.start()

    def abandon(self) -> None:
        for placement in self.members:
            placement.abandon()

    async def shutdown(self) -> None:
        for placement in self.members:
            await placement.shutdown()

    def health(self) -> dict[str, Any]:
        return {key: value for placement in self.members for key, value in placement.health().items()}


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
