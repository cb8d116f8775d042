"""Resolution: one function that turns every configuration layer into per-stage, per-replica arguments.

Layers, lowest first: ``base_config`` parents, the file, its ``platforms:`` section for the current
platform, vLLM flags given on the command line (AR stages) and ``--stage-overrides``. Only after all of
them does resolution derive what must never be hand-declared: the AR scheduler class follows the final
``async_scheduling`` flag (which the platform may force off), and the worker follows the platform.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import yaml

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.legacy import is_omni_ar_scheduler, is_omni_worker
from vllm_omni_plugin.config.loader import LoadedConfig
from vllm_omni_plugin.config.merge import merge_stage, set_fields
from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage
from vllm_omni_plugin.config.schema import (
    AR_ONLY_FIELDS,
    DIFFUSION_ONLY_FIELDS,
    ENGINE_ARG_FIELDS,
    ConnectorSpec,
    DeployConfig,
    EdgeSpec,
    EngineCommon,
    HeadSpec,
    StageDeployConfig,
    StageOverride,
)
from vllm_omni_plugin.connectors import CONNECTOR_CLASSES, DEFAULT_CONNECTOR_CLASS
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.schedulers import OMNI_AR_ASYNC_SCHEDULER, OMNI_AR_SCHEDULER

OMNI_GPU_WORKER = "vllm_omni_plugin.runners.gpu_worker.OmniGPUWorker"
OMNI_CPU_WORKER = "vllm_omni_plugin.runners.cpu_worker.OmniCPUWorker"
CPU_DIFFUSION_WORKER = "vllm_omni_plugin.diffusion.worker.CPUDiffusionWorker"
CUDA_DIFFUSION_WORKER = "vllm_omni_plugin.diffusion.worker.CUDADiffusionWorker"


@dataclass(frozen=True)
class PlatformInfo:
    name: str
    supports_async_scheduling: bool
    device_env: str | None
    """Environment variable that selects a process's devices (None: devices are not selectable)."""
    ar_worker_cls: str | None
    diffusion_worker_cls: str | None = None


PLATFORMS: dict[str, PlatformInfo] = {
    "cuda": PlatformInfo("cuda", True, "CUDA_VISIBLE_DEVICES", OMNI_GPU_WORKER, CUDA_DIFFUSION_WORKER),
    "rocm": PlatformInfo("rocm", True, "HIP_VISIBLE_DEVICES", OMNI_GPU_WORKER, CUDA_DIFFUSION_WORKER),
    "cpu": PlatformInfo("cpu", False, None, OMNI_CPU_WORKER, CPU_DIFFUSION_WORKER),
}
PLATFORM_SECTIONS = ("cuda", "rocm", "cpu", "xpu", "npu", "tpu")


def current_platform() -> PlatformInfo:
    from vllm_omni_plugin.compat import resolve as compat_resolve

    platform = compat_resolve("current_platform")
    if platform.is_cpu():
        return PLATFORMS["cpu"]
    if platform.is_rocm():
        return PLATFORMS["rocm"]
    if platform.is_cuda():
        return PLATFORMS["cuda"]
    name = str(getattr(platform, "device_type", "unknown"))
    return PlatformInfo(name, False, None, None)


# --- resolved form -----------------------------------------------------------------------------


class ResolvedReplica(msgspec.Struct, kw_only=True):
    replica_id: int
    devices: str | None = None
    env: dict[str, str] = {}


class ResolvedEdge(msgspec.Struct, kw_only=True):
    from_stage: int = msgspec.field(name="from")
    to: int | str
    """A stage id, or ``"router"`` for the final output's way back to the API server."""
    connector: str
    window_size: int = -1
    max_inflight: int | None = None


class ResolvedHead(msgspec.Struct, frozen=True, kw_only=True):
    """Where headless stage workers register (``HeadSpec`` with its defaults applied)."""

    host: str = "0.0.0.0"
    port: int = 29600
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0


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
    """Diffusion stages: the diffusion engine's arguments."""
    headless: bool = False
    """Served by a headless worker that registers with the head (see ``StageDeployConfig.headless``)."""


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
    notes: list[str] = []
    legacy_source: str | None = None
    """The legacy stage_args file this was translated from, if any."""

    def stage(self, stage_id: int) -> ResolvedStage:
        return next(s for s in self.stages if s.stage_id == stage_id)

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


# --- helpers -----------------------------------------------------------------------------------


@functools.cache
def engine_arg_types() -> dict[str, Any]:
    """EngineArgs field -> type hint (or None where vLLM's hint cannot be evaluated)."""
    from vllm_omni_plugin.compat import resolve as compat_resolve

    engine_args = compat_resolve("EngineArgs")
    module = __import__(engine_args.__module__, fromlist=["_"])
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args):
        hint: Any = f.type
        if isinstance(hint, str):  # a forward reference; some of vLLM's do not evaluate outside vLLM
            try:
                hint = eval(hint, vars(module))  # noqa: S307 - vLLM's own annotation text
            except Exception:
                hint = None
        out[f.name] = hint
    return out


def check_engine_value(name: str, value: Any) -> str | None:
    """Why ``value`` is wrong for EngineArgs field ``name``, or None when it is acceptable."""
    hint = engine_arg_types().get(name)
    if hint is None:
        return None
    try:
        msgspec.convert(value, hint, strict=False)
    except msgspec.ValidationError as exc:
        return str(exc).split(" - at ")[0].replace("Expected", "expected")
    except Exception:  # msgspec cannot express this vLLM type; vLLM checks it at start-up
        return None
    return None


@functools.cache
def sampling_param_fields() -> frozenset[str]:
    from vllm_omni_plugin.compat import resolve as compat_resolve

    sampling = compat_resolve("SamplingParams")
    return frozenset(f.name for f in msgspec.structs.fields(sampling))


DIFFUSION_SAMPLING_KEYS = frozenset(
    {
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "height",
        "width",
        "negative_prompt",
        "num_images_per_prompt",
        "output_type",
    }
)
RESERVED_ENGINE_EXTRAS = frozenset({"model", "tokenizer"})
_CONNECTOR_KEY = re.compile(r"^(from|to)_stage_(\d+|router)$")


class _Resolver:
    def __init__(
        self,
        loaded: LoadedConfig,
        model: str,
        platform: PlatformInfo,
        cli_engine_args: dict[str, Any],
        stage_overrides: dict[int, StageOverride],
    ) -> None:
        self.loaded = loaded
        self.pipeline: Pipeline = loaded.pipeline
        self.cfg = loaded.config
        self.model = model
        self.platform = platform
        self.cli = cli_engine_args
        self.overrides = stage_overrides
        self.notes: list[str] = list(loaded.notes)
        self.where: dict[tuple[int, str], str] = dict(loaded.lines)

    # errors name the file (and line, where the field was written)
    def error(self, message: str, stage_id: int | None = None, field: str | None = None) -> ConfigError:
        where = self.where.get((stage_id, field)) if stage_id is not None and field else None
        source, line = self.loaded.source, None
        if where and ":" in where and where.rsplit(":", 1)[1].isdigit():
            source, line_text = where.rsplit(":", 1)
            line = int(line_text)
        elif where:
            source = where
        path: tuple[str | int, ...] = ()
        if stage_id is not None:
            path = (f"stages[stage_id={stage_id}]",) + ((field,) if field else ())
        return ConfigError(message, source=source, line=line, path=path)

    def doc_error(self, message: str, path: tuple[str | int, ...]) -> ConfigError:
        """An error about a top-level document path (connectors, edges, platforms, ...)."""
        return ConfigError(message, source=self.loaded.source, line=self.loaded.locate(path), path=path)

    def note_at(self, stage_id: int, field: str, text: str) -> None:
        where = self.where.get((stage_id, field), self.loaded.source)
        self.notes.append(f"{where}: stage {stage_id} {field}: {text}")

    # --- layers ---

    def layered_stages(self) -> dict[int, StageDeployConfig]:
        pipeline = self.pipeline
        common = {k: v for k, v in set_fields(self.cfg).items() if k in EngineCommon.__struct_fields__}
        stages = {sid: StageDeployConfig(stage_id=sid, **common) for sid in pipeline.stage_ids}
        seen: set[int] = set()
        for stage in self.cfg.stages:
            if stage.stage_id not in stages:
                raise self.error(
                    f"pipeline {pipeline.name!r} has no stage {stage.stage_id} "
                    f"(stages: {list(pipeline.stage_ids)})",
                    stage.stage_id,
                    "stage_id",
                )
            if stage.stage_id in seen:
                raise self.error(f"stage {stage.stage_id} is listed twice", stage.stage_id, "stage_id")
            seen.add(stage.stage_id)
            stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)
        for key, section in self.cfg.platforms.items():
            if key not in PLATFORM_SECTIONS:
                raise self.doc_error(
                    f"unknown platform {key!r} (known: {', '.join(PLATFORM_SECTIONS)})", ("platforms", key)
                )
            for index, stage in enumerate(section.stages):
                if stage.stage_id not in stages:
                    raise self.doc_error(
                        f"pipeline {pipeline.name!r} has no stage {stage.stage_id}",
                        ("platforms", key, "stages", index, "stage_id"),
                    )
                if key == self.platform.name:
                    for name in set_fields(stage):
                        self.where[(stage.stage_id, name)] = f"{self.loaded.source} (platforms.{key})"
                    stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)
        if self.cli:
            fields = {k: v for k, v in self.cli.items() if k in StageDeployConfig.__struct_fields__}
            extras = {k: v for k, v in self.cli.items() if k not in fields}
            for s in pipeline.stages:
                if s.execution_type != "llm_ar":
                    continue
                layer = StageDeployConfig(stage_id=s.stage_id, engine_extras=extras or None, **fields)
                for name in self.cli:
                    key = name if name in fields else f"engine_extras.{name}"
                    self.where[(s.stage_id, key)] = f"command line (--{name.replace('_', '-')})"
                stages[s.stage_id] = merge_stage(stages[s.stage_id], layer)
        for stage_id, override in self.overrides.items():
            if stage_id not in stages:
                raise ConfigError(
                    f"pipeline {pipeline.name!r} has no stage {stage_id} "
                    f"(stages: {list(pipeline.stage_ids)})",
                    source="--stage-overrides",
                    path=(str(stage_id),),
                )
            for name in set_fields(override):
                self.where[(stage_id, name)] = "--stage-overrides"
            for key in override.engine_extras or {}:
                self.where[(stage_id, f"engine_extras.{key}")] = "--stage-overrides"
            stages[stage_id] = merge_stage(stages[stage_id], override)
        return stages

    # --- connectors and edges ---

    def connectors_and_edges(
        self, stages: dict[int, StageDeployConfig]
    ) -> tuple[dict[str, ConnectorSpec], list[ResolvedEdge], dict[int, dict[str, dict[str, str]]]]:
        pipeline = self.pipeline
        connectors = dict(self.cfg.connectors)
        for key, spec in connectors.items():
            if spec.name not in CONNECTOR_CLASSES:
                raise self.doc_error(
                    f"unknown connector class {spec.name!r} (known: {', '.join(sorted(CONNECTOR_CLASSES))})",
                    ("connectors", key, "name"),
                )
        pipeline_edges = [(src, s.stage_id) for s in pipeline.stages for src in s.input_sources]
        final = pipeline.final_stage.stage_id
        ios: dict[int, dict[str, dict[str, str]]] = {
            sid: {
                "input": dict(stages[sid].input_connectors or {}),
                "output": dict(stages[sid].output_connectors or {}),
            }
            for sid in stages
        }
        for sid, io in ios.items():
            for direction, mapping in io.items():
                field = f"{direction}_connectors"
                for key, name in mapping.items():
                    match = _CONNECTOR_KEY.match(key)
                    want = "from" if direction == "input" else "to"
                    if not match or match.group(1) != want:
                        raise self.error(
                            f"key {key!r}: expected {want}_stage_N"
                            + (" or to_stage_router" if direction == "output" else ""),
                            sid,
                            field,
                        )
                    other = match.group(2)
                    if other == "router":
                        if direction == "input" or sid != final:
                            raise self.error(
                                f"{key}: only the final stage ({final}) sends its output to the router",
                                sid,
                                field,
                            )
                    else:
                        edge = (int(other), sid) if direction == "input" else (sid, int(other))
                        if edge not in pipeline_edges:
                            raise self.error(
                                f"{key}: pipeline {pipeline.name!r} has no edge {edge[0]} -> {edge[1]} "
                                f"(edges: {', '.join(f'{a} -> {b}' for a, b in pipeline_edges)})",
                                sid,
                                field,
                            )
                    if name not in connectors:
                        defined = ", ".join(sorted(connectors)) or "none"
                        raise self.error(
                            f"{key}: connector {name!r} is not defined under connectors: "
                            f"(defined: {defined})",
                            sid,
                            field,
                        )
        configured = {(e.from_stage, e.to): e for e in self.cfg.edges}
        for index, e in enumerate(self.cfg.edges):
            if (e.from_stage, e.to) not in pipeline_edges:
                raise self.doc_error(
                    f"pipeline {pipeline.name!r} has no edge {e.from_stage} -> {e.to} "
                    f"(edges: {', '.join(f'{a} -> {b}' for a, b in pipeline_edges)})",
                    ("edges", index),
                )
        default_name: str | None = None

        def default_connector() -> str:
            nonlocal default_name
            if default_name is None:
                for key, spec in connectors.items():
                    if spec.name == DEFAULT_CONNECTOR_CLASS:
                        default_name = key
                        break
                else:
                    default_name = "shared_memory"
                    while default_name in connectors:
                        default_name += "_default"
                    connectors[default_name] = ConnectorSpec(name=DEFAULT_CONNECTOR_CLASS)
            return default_name

        edges: list[ResolvedEdge] = []
        for src, dst in pipeline_edges:
            out_name = ios[src]["output"].get(f"to_stage_{dst}")
            in_name = ios[dst]["input"].get(f"from_stage_{src}")
            if out_name and in_name and out_name != in_name:
                raise self.error(
                    f"from_stage_{src} uses connector {in_name!r} but stage {src}'s "
                    f"output_connectors.to_stage_{dst} says {out_name!r}; both ends must agree",
                    dst,
                    "input_connectors",
                )
            name = out_name or in_name or default_connector()
            ios[src]["output"][f"to_stage_{dst}"] = name
            ios[dst]["input"][f"from_stage_{src}"] = name
            spec = configured.get((src, dst))
            edges.append(
                ResolvedEdge(
                    from_stage=src,
                    to=dst,
                    connector=name,
                    window_size=spec.window_size if spec and spec.window_size is not None else -1,
                    max_inflight=spec.max_inflight if spec else None,
                )
            )
        router = ios[final]["output"].get("to_stage_router") or default_connector()
        ios[final]["output"]["to_stage_router"] = router
        edges.append(ResolvedEdge(from_stage=final, to="router", connector=router))
        used = {e.connector for e in edges}
        for key in connectors:
            if key not in used:
                self.notes.append(f"{self.loaded.source}: connector {key!r} is defined but not used")
        return connectors, edges, ios

    # --- stages ---

    def replicas(self, stage: StageDeployConfig, tp: int) -> list[ResolvedReplica]:
        n = stage.num_replicas or 1
        env = dict(stage.env or {})
        devices = [d.strip() for d in (stage.devices or "").split(",") if d.strip()]
        if devices and self.platform.device_env is None:
            self.note_at(stage.stage_id, "devices", f"ignored on {self.platform.name}")
            devices = []
        if not devices:
            return [ResolvedReplica(replica_id=i, env=env) for i in range(n)]
        if len(devices) == n * tp:
            chunks = [devices[i * tp : (i + 1) * tp] for i in range(n)]
        elif len(devices) == tp:
            chunks = [devices] * n
        else:
            raise self.error(
                f"{len(devices)} device(s) {','.join(devices)} cannot hold {n} replica(s) of "
                f"tensor_parallel_size {tp}: give {n * tp} device ids (one set per replica) or {tp} "
                "(shared by all replicas)",
                stage.stage_id,
                "devices",
            )
        out = []
        for i, chunk in enumerate(chunks):
            replica_env = dict(env)
            assert self.platform.device_env is not None
            replica_env[self.platform.device_env] = ",".join(chunk)
            out.append(ResolvedReplica(replica_id=i, devices=",".join(chunk), env=replica_env))
        return out

    def check_not_applicable(self, stage: StageDeployConfig, fixed: PipelineStage) -> None:
        wrong = AR_ONLY_FIELDS if fixed.execution_type == "diffusion" else DIFFUSION_ONLY_FIELDS
        for name in set_fields(stage):
            if name in wrong:
                self.note_at(
                    stage.stage_id,
                    name,
                    f"does not apply to a {fixed.execution_type} stage; ignored",
                )

    def ar_engine_args(self, stage: StageDeployConfig, fixed: PipelineStage) -> dict[str, Any]:
        sid = stage.stage_id
        extras = dict(stage.engine_extras or {})
        known = engine_arg_types()
        for key, value in list(extras.items()):
            field = f"engine_extras.{key}"
            if key in RESERVED_ENGINE_EXTRAS:
                raise self.error(f"{key} is set by the pipeline (model directory + subdir)", sid, field)
            if key in StageDeployConfig.__struct_fields__:
                raise self.error(f"{key} is a stage field; set `{key}:` on the stage instead", sid, field)
            if key not in known:
                raise self.error(f"{key!r} is not a vLLM EngineArgs field", sid, field)
            problem = check_engine_value(key, value)
            if problem:
                raise self.error(f"{problem}, got {value!r}", sid, field)

        requested = stage.async_scheduling
        if self.platform.supports_async_scheduling:
            async_final = True if requested is None else requested
        else:
            if requested:
                self.note_at(
                    sid,
                    "async_scheduling",
                    f"{self.platform.name} does not support async scheduling; using synchronous "
                    "scheduling (OmniARScheduler)",
                )
            async_final = False
        variant = OMNI_AR_ASYNC_SCHEDULER if async_final else OMNI_AR_SCHEDULER

        scheduler = variant
        pinned = extras.pop("scheduler_cls", None)
        if pinned is not None:
            where = self.where.get((sid, "engine_extras.scheduler_cls"), self.loaded.source)
            if not isinstance(pinned, str):
                raise self.error(
                    "scheduler_cls: expected a dotted class path", sid, "engine_extras.scheduler_cls"
                )
            if is_omni_ar_scheduler(pinned):
                if pinned.replace(":", ".").rsplit(".", 1)[1] != variant.rsplit(".", 1)[1]:
                    self.notes.append(
                        f"{where}: stage {sid} scheduler_cls pinned to {pinned}, which contradicts the "
                        f"final async_scheduling={str(async_final).lower()}; using {variant} instead"
                    )
            elif stage.allow_custom_scheduler:
                scheduler = pinned
                self.notes.append(f"{where}: stage {sid} uses the custom scheduler {pinned}")
            else:
                raise self.error(
                    f"scheduler_cls {pinned} is not an Omni AR scheduler; the AR stage runs "
                    "OmniARScheduler or OmniARAsyncScheduler, chosen from async_scheduling. "
                    "Remove it, or set allow_custom_scheduler: true to run your own",
                    sid,
                    "engine_extras.scheduler_cls",
                )

        worker = self.platform.ar_worker_cls
        pinned_worker = extras.pop("worker_cls", None)
        if pinned_worker is not None:
            if isinstance(pinned_worker, str) and is_omni_worker(pinned_worker):
                pass
            else:
                raise self.error(
                    f"worker_cls {pinned_worker} is not an Omni worker; the AR stage needs the "
                    "Omni worker for the platform (chosen by resolution). Remove it",
                    sid,
                    "engine_extras.worker_cls",
                )
        if worker is None:
            raise self.error(f"the AR stage is not supported on platform {self.platform.name!r}", sid)

        args: dict[str, Any] = {
            "model": os.path.join(self.model, fixed.model_subdir or ""),
        }
        if fixed.tokenizer_subdir:
            args["tokenizer"] = os.path.join(self.model, fixed.tokenizer_subdir)
        for name in ENGINE_ARG_FIELDS:
            value = getattr(stage, name)
            if value is not None and name != "async_scheduling":
                args[name] = value
        args["async_scheduling"] = async_final
        args["scheduler_cls"] = scheduler
        args["worker_cls"] = worker
        if fixed.engine_args_provider:
            provided = import_object(fixed.engine_args_provider)(args["model"])
            for key, value in provided.items():
                if key not in extras:
                    args[key] = value
        args.update(extras)
        return dict(sorted(args.items()))

    def diffusion_args(self, stage: StageDeployConfig) -> dict[str, Any]:
        if self.platform.diffusion_worker_cls is None:
            raise self.error(
                f"diffusion stages are not supported on platform {self.platform.name!r}", stage.stage_id
            )
        args: dict[str, Any] = {
            "model": self.model,
            "max_batch_size": stage.max_batch_size or 1,
            "worker_cls": self.platform.diffusion_worker_cls,
        }
        for name in (
            "dtype",
            "trust_remote_code",
            "enforce_eager",
            "seed",
            "num_inference_steps",
            "guidance_scale",
            "height",
            "width",
        ):
            value = getattr(stage, name)
            if value is not None:
                args[name] = value
        return dict(sorted(args.items()))

    def sampling_params(self, stage: StageDeployConfig, fixed: PipelineStage) -> dict[str, Any]:
        params = dict(stage.default_sampling_params or {})
        sid = stage.stage_id
        if fixed.execution_type == "diffusion":
            unknown = sorted(set(params) - DIFFUSION_SAMPLING_KEYS)
            if unknown:
                raise self.error(
                    f"unknown diffusion sampling parameter(s) {', '.join(unknown)} "
                    f"(known: {', '.join(sorted(DIFFUSION_SAMPLING_KEYS))})",
                    sid,
                    "default_sampling_params",
                )
            return params
        known = sampling_param_fields()
        unknown = sorted(set(params) - known)
        if unknown:
            raise self.error(
                f"{', '.join(unknown)}: not a vLLM SamplingParams field", sid, "default_sampling_params"
            )
        from vllm_omni_plugin.compat import resolve as compat_resolve

        try:
            compat_resolve("SamplingParams")(**params)
        except Exception as exc:  # vLLM's own validation message
            raise self.error(f"rejected by vLLM: {exc}", sid, "default_sampling_params") from None
        return params

    def head(self) -> ResolvedHead:
        head = ResolvedHead(**set_fields(self.cfg.head or HeadSpec()))
        if head.heartbeat_timeout_s <= head.heartbeat_interval_s:
            raise self.doc_error(
                f"heartbeat_timeout_s ({head.heartbeat_timeout_s}) must be longer than "
                f"heartbeat_interval_s ({head.heartbeat_interval_s})",
                ("head", "heartbeat_timeout_s"),
            )
        return head

    def check_headless_connectors(
        self, stage_id: int, connectors: dict[str, ConnectorSpec], io: dict[str, dict[str, str]]
    ) -> None:
        """A headless stage's connectors must cross processes, and usually hosts."""
        for direction in ("input", "output"):
            for key, name in io[direction].items():
                cls = connectors[name].name
                if cls == "InProcessConnector":
                    raise self.error(
                        f"{key}: connector {name!r} is an InProcessConnector, which cannot reach a "
                        "headless worker; use NixlConnector",
                        stage_id,
                        f"{direction}_connectors",
                    )
                if cls == "SharedMemoryConnector":
                    self.notes.append(
                        f"{self.loaded.source}: stage {stage_id} is headless and {key} uses the "
                        f"SharedMemoryConnector {name!r}: that works only when the worker runs on the "
                        "head's host; use NixlConnector across hosts"
                    )

    def run(self) -> ResolvedDeployment:
        pipeline = self.pipeline
        if self.cfg.async_chunk and pipeline.streaming_processor is None:
            raise self.doc_error(
                f"async_chunk: true needs a streaming stage-input processor, and pipeline "
                f"{pipeline.name!r} has none; set async_chunk: false",
                ("async_chunk",),
            )
        stages = self.layered_stages()
        connectors, edges, ios = self.connectors_and_edges(stages)
        resolved: list[ResolvedStage] = []
        completed: list[StageDeployConfig] = []
        for fixed in pipeline.stages:
            stage = stages[fixed.stage_id]
            self.check_not_applicable(stage, fixed)
            is_ar = fixed.execution_type == "llm_ar"
            if not is_ar and (stage.tensor_parallel_size or 1) != 1:
                raise self.error(
                    "diffusion stages run with tensor_parallel_size 1", fixed.stage_id, "tensor_parallel_size"
                )
            process = True if stage.process is None else stage.process
            if is_ar and not process:
                raise self.error(
                    "the AR stage always runs in its own vLLM EngineCore process", fixed.stage_id, "process"
                )
            headless = bool(stage.headless)
            if headless and not process:
                raise self.error(
                    "a headless stage runs in processes of its own on its worker; drop process: false",
                    fixed.stage_id,
                    "process",
                )
            if headless:
                self.check_headless_connectors(fixed.stage_id, connectors, ios[fixed.stage_id])
            engine_args = self.ar_engine_args(stage, fixed) if is_ar else {}
            tp = engine_args.get("tensor_parallel_size", 1) if is_ar else 1
            replicas = self.replicas(stage, tp)
            sampling = self.sampling_params(stage, fixed)
            io = ios[fixed.stage_id]
            resolved.append(
                ResolvedStage(
                    stage_id=fixed.stage_id,
                    name=fixed.name,
                    execution_type=fixed.execution_type,
                    process=process,
                    num_replicas=len(replicas),
                    replicas=replicas,
                    input_sources=list(fixed.input_sources),
                    input_processor=fixed.input_processor,
                    final_output=fixed.final_output,
                    output_type=fixed.output_type,
                    input_connectors=dict(sorted(io["input"].items())),
                    output_connectors=dict(sorted(io["output"].items())),
                    default_sampling_params=sampling,
                    engine_args=engine_args,
                    diffusion_args={} if is_ar else self.diffusion_args(stage),
                    headless=headless,
                )
            )
            done = msgspec.structs.replace(
                stage,
                num_replicas=len(replicas),
                process=process,
                input_connectors=dict(sorted(io["input"].items())) or None,
                output_connectors=dict(sorted(io["output"].items())) or None,
            )
            if is_ar:
                extras = {
                    k: v
                    for k, v in (stage.engine_extras or {}).items()
                    if k not in ("scheduler_cls", "worker_cls") or stage.allow_custom_scheduler
                }
                done = msgspec.structs.replace(
                    done,
                    async_scheduling=engine_args["async_scheduling"],
                    engine_extras=extras or None,
                )
            completed.append(done)
        deploy = DeployConfig(
            pipeline=pipeline.name,
            async_chunk=bool(self.cfg.async_chunk),
            connectors=connectors,
            head=self.cfg.head,
            edges=[
                EdgeSpec(
                    from_stage=e.from_stage, to=e.to, window_size=e.window_size, max_inflight=e.max_inflight
                )
                for e in edges
                if isinstance(e.to, int)
            ],
            stages=completed,
        )
        return ResolvedDeployment(
            pipeline=pipeline.name,
            model=self.model,
            platform=self.platform.name,
            async_chunk=bool(self.cfg.async_chunk),
            connectors=dict(sorted(connectors.items())),
            edges=edges,
            stages=resolved,
            deploy=deploy,
            head=self.head(),
            notes=self.notes,
            legacy_source=self.loaded.source if self.loaded.legacy else None,
        )


def resolve(
    loaded: LoadedConfig,
    *,
    model: str,
    platform: PlatformInfo | None = None,
    cli_engine_args: dict[str, Any] | None = None,
    stage_overrides: dict[int, StageOverride] | None = None,
) -> ResolvedDeployment:
    """Resolve a loaded deploy config for ``model`` on ``platform`` (default: the current one)."""
    return _Resolver(
        loaded,
        model,
        platform or current_platform(),
        dict(cli_engine_args or {}),
        dict(stage_overrides or {}),
    ).run()


def reresolve(
    resolved: ResolvedDeployment, loaded: LoadedConfig, platform: PlatformInfo
) -> ResolvedDeployment:
    """Resolve a resolution's completed config again (used to check idempotence)."""
    again = LoadedConfig(
        config=resolved.deploy, source=loaded.source, pipeline=loaded.pipeline, lines=loaded.lines
    )
    return resolve(again, model=resolved.model, platform=platform)
