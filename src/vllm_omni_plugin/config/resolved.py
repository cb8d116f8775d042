"""The resolved form of a deployment: what resolution hands the stage layer.

Everything here is final: defaults applied, every layer merged, the scheduler and workers derived, each
edge's connector chosen. The stage layer reads these structs and never a deploy config.
"""

from __future__ import annotations

from typing import Any

import msgspec
import yaml

from vllm_omni_plugin.config.schema import ConnectorSpec, DeployConfig

ROUTER = "router"
"""The destination of the final stage's output: the API server (or offline API) that asked."""
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its V1 (``0``) and V2 (``1``) model runners."""
CPU_RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
"""How many cores vLLM's CPU build keeps free of a worker's OpenMP threads (for its engine core process)."""


class ResolvedReplica(msgspec.Struct, kw_only=True):
    replica_id: int
    devices: str | None = None
    env: dict[str, str] = {}


class ResolvedEdge(msgspec.Struct, kw_only=True):
    from_stage: int = msgspec.field(name="from")
    to: int | str
    """A stage id, or ``"router"`` for the final output's way back to the API server."""
    connector: str
    max_inflight: int | None = None
    """Requests that may be handed over on this edge at once (the rest wait); None: no limit."""
    same_node_connector: str | None = None
    """Backend ``ray``: the connector used instead of ``connector`` when both ends of the hand-over run
    on one Ray node; None: ``connector`` everywhere."""

    def connector_between(self, same_node: bool) -> str:
        """The connector of this edge for two ends on one node (``same_node``) or on two."""
        return self.same_node_connector if same_node and self.same_node_connector else self.connector


class ResolvedHead(msgspec.Struct, frozen=True, kw_only=True):
    """Where headless stage workers register (``HeadSpec`` with its defaults applied)."""

    host: str = "0.0.0.0"
    port: int = 29600
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0


class ResolvedRay(msgspec.Struct, frozen=True, kw_only=True):
    """How the ``ray`` backend reaches its cluster (``RaySpec`` with its defaults applied)."""

    address: str | None = None
    """None: ``RAY_ADDRESS``, else the cluster ``ray start`` made on this host (never a new one)."""
    namespace: str = "vllm_omni"
    placement_timeout_s: float = 120.0


class RayResources(msgspec.Struct, frozen=True, kw_only=True):
    """What each replica of a stage asks the Ray cluster for (backend ``ray``)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = {}
    node_labels: dict[str, str] = {}
    max_restarts: int = -1
    """-1: Ray restarts a dead replica's actor every time."""

    @property
    def placement_group(self) -> bool:
        """Multi-device replicas reserve their devices together, on one node, in a placement group."""
        return self.num_gpus > 1

    def describe(self) -> str:
        """``{CPU: 1, dit_host: 1} on nodes labelled {...}`` (what is asked for), for messages."""
        wants = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        text = "{" + ", ".join(f"{k}: {v:g}" for k, v in wants.items() if v) + "}"
        if self.node_labels:
            text += " on nodes labelled {" + ", ".join(f"{k}={v}" for k, v in self.node_labels.items()) + "}"
        return text


class ResolvedStage(msgspec.Struct, kw_only=True):
    stage_id: int
    name: str
    execution_type: str
    process: bool
    num_replicas: int
    replicas: list[ResolvedReplica]
    input_sources: list[int]
    input_processor: str | None
    final_output: bool
    output_type: str
    input_connectors: dict[str, str]
    output_connectors: dict[str, str]
    default_sampling_params: dict[str, Any]
    engine_args: dict[str, Any] = {}
    """AR stages: the vLLM ``EngineArgs`` of every replica."""
    diffusion_args: dict[str, Any] = {}
    """Diffusion stages: the diffusion worker's ``load_model`` arguments."""
    request_defaults: dict[str, Any] = {}
    """Diffusion stages: what requests get for fields they leave unset (the stage's fields, else its
    ``default_sampling_params``, else the pipeline's diffusion defaults); the input processor applies them
    over the model's own."""
    headless: bool = False
    """Served by a headless worker that registers with the head (see ``StageDeployConfig.headless``)."""
    continuation: str | None = None
    """The pipeline's next-round function for this stage (see ``PipelineStage.continuation``)."""
    companion_timeout_s: float = 30.0
    """AR stages: how long a request's companion requests may take after its main one."""
    ray_resources: RayResources | None = msgspec.field(default=None, name="placement")
    """Backend ``ray``: what each replica asks the cluster for; None on the local backend. Printed (and
    encoded) as ``placement``, the key ``--print-resolved-config`` has always shown."""
    model_runner: str | None = None
    """AR stages: ``v1`` or ``v2``, the vLLM model runner the stage's engine runs."""
    model_runner_reason: str | None = None
    """AR stages: why that runner (who chose it, and what it means for the stage)."""

    def devices(self) -> set[str]:
        """The devices its replicas name (a replica that names none takes the platform's default)."""
        return {d for replica in self.replicas for d in (replica.devices or "").split(",") if d}


class ResolvedDeployment(msgspec.Struct, kw_only=True):
    pipeline: str
    model: str
    platform: str
    async_chunk: bool
    connectors: dict[str, ConnectorSpec]
    edges: list[ResolvedEdge]
    stages: list[ResolvedStage]
    deploy: DeployConfig
    """The completed deploy config: resolving it again gives this same result."""
    head: ResolvedHead = ResolvedHead()
    backend: str = "local"
    """Where stage replicas run: ``local`` (processes of this host) or ``ray`` (actors of a Ray cluster)."""
    ray: ResolvedRay | None = None
    """Backend ``ray``: the cluster and the placement deadline; None on the local backend."""
    max_retries: int = 1
    """Runs again a request may get after replica deaths interrupted it (see ``DeployConfig``)."""
    notes: list[str] = []
    legacy_source: str | None = None
    """The legacy stage_args file this was translated from, if any."""

    def stage(self, stage_id: int) -> ResolvedStage:
        return next(s for s in self.stages if s.stage_id == stage_id)

    def edge(self, from_stage: int, to: int | str) -> ResolvedEdge:
        """The edge ``from_stage -> to`` (``to="router"``: the final output's way back), and with it the
        one answer to which connector serves that hand-over."""
        return next(e for e in self.edges if e.from_stage == from_stage and e.to == to)

    def summary(self) -> dict[str, Any]:
        """Everything that decides how the deployment runs (no notes, no completed config)."""
        out = msgspec.to_builtins(self)
        out.pop("deploy")
        out.pop("notes")
        out.pop("legacy_source", None)
        return out

    def to_yaml(self) -> str:
        head = "".join(f"# note: {note}\n" for note in self.notes)
        return head + yaml.safe_dump(self.summary(), sort_keys=False, default_flow_style=False)
