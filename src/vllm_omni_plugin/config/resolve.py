"""Resolution: one function that turns every configuration layer into per-stage, per-replica arguments.

Layers, lowest first: ``base_config`` parents, the file, its ``platforms:`` section for the current
platform, vLLM flags given on the command line (AR stages) and ``--stage-overrides``. Only after all of
them does resolution derive what must never be hand-declared: the AR scheduler class follows the final
``async_scheduling`` flag (which the platform may force off), the workers follow the platform, every
edge gets its connector and every connector's ``extra`` is checked. What comes out
(:mod:`vllm_omni_plugin.config.resolved`) is complete: nothing downstream applies defaults again.
"""

from __future__ import annotations

import os
import re
from typing import Any

import msgspec

from vllm_omni_plugin.ar_channel import context_export_kv_transfer_config
from vllm_omni_plugin.compat import picks_v1_runner
from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.config.loader import LoadedConfig, convert
from vllm_omni_plugin.config.merge import merge_stage, set_fields
from vllm_omni_plugin.config.pipeline import Pipeline, PipelineStage
from vllm_omni_plugin.config.platform import PLATFORM_SECTIONS, PlatformInfo, current_platform, is_omni_worker
from vllm_omni_plugin.config.resolved import (
    ROUTER,
    RUNNER_ENV,
    ResolvedDeployment,
    ResolvedEdge,
    ResolvedHead,
    ResolvedPlacement,
    ResolvedRay,
    ResolvedReplica,
    ResolvedStage,
)
from vllm_omni_plugin.config.schema import (
    AR_ONLY_FIELDS,
    DIFFUSION_ONLY_FIELDS,
    ENGINE_ARG_FIELDS,
    RAY_PLACEMENT_FIELDS,
    Backend,
    ConnectorSpec,
    DeployConfig,
    EdgeSpec,
    EngineCommon,
    HeadSpec,
    RaySpec,
    StageDeployConfig,
    StageOverride,
)
from vllm_omni_plugin.config.vllm_fields import (
    check_engine_value,
    check_sampling_params,
    engine_arg_types,
    sampling_param_fields,
)
from vllm_omni_plugin.connectors import CONNECTOR_CLASSES, DEFAULT_CONNECTOR_CLASS
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.schedulers import OMNI_AR_ASYNC_SCHEDULER, OMNI_AR_SCHEDULER, is_omni_ar_scheduler

DEFAULT_COMPANION_TIMEOUT_S = 30.0
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""What a vLLM engine takes of its device when ``gpu_memory_utilization`` is not set."""
DIFFUSION_DEFAULT_KEYS = ("num_inference_steps", "guidance_scale", "height", "width", "seed")
"""What a diffusion stage's ``default_sampling_params`` may set: defaults of the diffusion engine for
requests that leave them unset (a stage field of the same name wins)."""
DIFFUSION_ENGINE_FIELDS = ("dtype", "trust_remote_code", "enforce_eager", "gpu_memory_utilization")
"""Further stage fields handed to the diffusion engine as they are."""
RESERVED_ENGINE_EXTRAS = frozenset({"model", "tokenizer"})
WHOLE_OUTPUT = -1
DEFAULT_MAX_RETRIES = 1
"""``window_size`` of an edge that hands each output over whole, the only hand-over we implement."""
IMAGES_NEED_V1 = (
    "image-to-image needs the V1 runner (what the stage hands the DiT about source images travels on its "
    "step output) and is refused; text-to-image runs on V2"
)
_CONNECTOR_KEY = re.compile(r"^(from|to)_stage_(\d+|router)$")

StageIO = dict[str, dict[str, str]]
"""A stage's connectors: ``{"input": {"from_stage_N": name}, "output": {"to_stage_N": name}}``."""


class _Resolver:
    def __init__(
        self,
        loaded: LoadedConfig,
        model: str,
        platform: PlatformInfo,
        cli_engine_args: dict[str, Any],
        stage_overrides: dict[int, StageOverride],
        backend: Backend | None = None,
    ) -> None:
        self.loaded = loaded
        self.pipeline: Pipeline = loaded.pipeline
        self.cfg = loaded.config
        self.model = model
        self.platform = platform
        self.cli = cli_engine_args
        self.overrides = stage_overrides
        self.backend: Backend = backend or self.cfg.backend or "local"
        """The command line's ``--worker-backend`` wins over the file's ``backend:``."""
        self.notes: list[str] = list(loaded.notes)
        self.where: dict[tuple[int, str], str] = dict(loaded.lines)
        self.connectors: dict[str, ConnectorSpec] = {}
        """The checked connectors (set by ``run`` before the stages are resolved)."""
        self.resolved_edges: list[ResolvedEdge] = []

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

    def unknown_stage(self, stage_id: int) -> str:
        stages = list(self.pipeline.stage_ids)
        return f"pipeline {self.pipeline.name!r} has no stage {stage_id} (stages: {stages})"

    # --- layers -----------------------------------------------------------------------------------

    def layered_stages(self) -> dict[int, StageDeployConfig]:
        """Every stage of the pipeline with all layers merged, lowest first."""
        common = {k: v for k, v in set_fields(self.cfg).items() if k in EngineCommon.__struct_fields__}
        stages = {sid: StageDeployConfig(stage_id=sid, **common) for sid in self.pipeline.stage_ids}
        self.merge_file_stages(stages)
        self.merge_platform_section(stages)
        self.merge_command_line(stages)
        self.merge_overrides(stages)
        return stages

    def merge_file_stages(self, stages: dict[int, StageDeployConfig]) -> None:
        seen: set[int] = set()
        for stage in self.cfg.stages:
            if stage.stage_id not in stages:
                raise self.error(self.unknown_stage(stage.stage_id), stage.stage_id, "stage_id")
            if stage.stage_id in seen:
                raise self.error(f"stage {stage.stage_id} is listed twice", stage.stage_id, "stage_id")
            seen.add(stage.stage_id)
            stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)

    def merge_platform_section(self, stages: dict[int, StageDeployConfig]) -> None:
        """Every section is checked; only the current platform's is merged."""
        for key, section in self.cfg.platforms.items():
            if key not in PLATFORM_SECTIONS:
                raise self.doc_error(
                    f"unknown platform {key!r} (known: {', '.join(PLATFORM_SECTIONS)})", ("platforms", key)
                )
            for index, stage in enumerate(section.stages):
                if stage.stage_id not in stages:
                    raise self.doc_error(
                        f"pipeline {self.pipeline.name!r} has no stage {stage.stage_id}",
                        ("platforms", key, "stages", index, "stage_id"),
                    )
                if key == self.platform.name:
                    for name in set_fields(stage):
                        self.where[(stage.stage_id, name)] = f"{self.loaded.source} (platforms.{key})"
                    stages[stage.stage_id] = merge_stage(stages[stage.stage_id], stage)

    def merge_command_line(self, stages: dict[int, StageDeployConfig]) -> None:
        """vLLM flags given on the command line apply to the AR stages."""
        if not self.cli:
            return
        fields = {k: v for k, v in self.cli.items() if k in StageDeployConfig.__struct_fields__}
        extras = {k: v for k, v in self.cli.items() if k not in fields}
        for s in self.pipeline.stages:
            if s.execution_type != "llm_ar":
                continue
            layer = StageDeployConfig(stage_id=s.stage_id, engine_extras=extras or None, **fields)
            for name in self.cli:
                key = name if name in fields else f"engine_extras.{name}"
                self.where[(s.stage_id, key)] = f"command line (--{name.replace('_', '-')})"
            stages[s.stage_id] = merge_stage(stages[s.stage_id], layer)

    def merge_overrides(self, stages: dict[int, StageDeployConfig]) -> None:
        for stage_id, override in self.overrides.items():
            if stage_id not in stages:
                raise ConfigError(
                    self.unknown_stage(stage_id), source="--stage-overrides", path=(str(stage_id),)
                )
            for name in set_fields(override):
                self.where[(stage_id, name)] = "--stage-overrides"
            for key in override.engine_extras or {}:
                self.where[(stage_id, f"engine_extras.{key}")] = "--stage-overrides"
            stages[stage_id] = merge_stage(stages[stage_id], override)

    # --- connectors and edges -----------------------------------------------------------------------

    def checked_connectors(self, stages: dict[int, StageDeployConfig]) -> dict[str, ConnectorSpec]:
        """The declared connectors, each class known and its ``extra`` valid for that class: a typo there
        is a config error now, not a stage that fails to start. A connector no stage names (e.g. a
        vllm-omni document's ``MooncakeTransferEngineConnector``) is left out with a note: whatever its
        class, it would have no effect."""
        from vllm_omni_plugin.connectors.base import connector_class

        named = {
            name
            for stage in stages.values()
            for mapping in (stage.input_connectors, stage.output_connectors)
            for name in (mapping or {}).values()
        }
        checked: dict[str, ConnectorSpec] = {}
        for key, spec in self.cfg.connectors.items():
            if key not in named and spec.name not in CONNECTOR_CLASSES:
                self.notes.append(
                    f"{self.loaded.source}: connector {key!r} ({spec.name}) is defined but no stage uses it; "
                    "ignored"
                )
                continue
            checked[key] = spec
            if spec.name not in CONNECTOR_CLASSES:
                raise self.doc_error(
                    f"unknown connector class {spec.name!r} (known: {', '.join(sorted(CONNECTOR_CLASSES))})",
                    ("connectors", key, "name"),
                )
            try:
                cls = connector_class(key, spec.name)
            except (ImportError, TypeError) as exc:
                raise self.doc_error(str(exc), ("connectors", key, "name")) from None
            convert(
                spec.extra,
                cls.Settings,
                source=self.loaded.source,
                line_of=self.loaded.locate,
                prefix=("connectors", key, "extra"),
            )
        return checked

    def pipeline_edges(self) -> list[tuple[int, int]]:
        return [(src, s.stage_id) for s in self.pipeline.stages for src in s.input_sources]

    def stage_connectors(
        self, stages: dict[int, StageDeployConfig], connectors: dict[str, ConnectorSpec]
    ) -> dict[int, StageIO]:
        """Each stage's ``input_connectors`` / ``output_connectors`` as written, checked."""
        ios = {
            sid: {
                "input": dict(stage.input_connectors or {}),
                "output": dict(stage.output_connectors or {}),
            }
            for sid, stage in stages.items()
        }
        for sid, io in ios.items():
            for direction, mapping in io.items():
                for key, name in mapping.items():
                    self.check_connector_key(sid, direction, key, name, connectors)
        return ios

    def check_connector_key(
        self, sid: int, direction: str, key: str, name: str, connectors: dict[str, ConnectorSpec]
    ) -> None:
        field = f"{direction}_connectors"
        final = self.pipeline.final_stage.stage_id
        match = _CONNECTOR_KEY.match(key)
        want = "from" if direction == "input" else "to"
        if not match or match.group(1) != want:
            router = " or to_stage_router" if direction == "output" else ""
            raise self.error(f"key {key!r}: expected {want}_stage_N{router}", sid, field)
        other = match.group(2)
        if other == ROUTER:
            if direction == "input" or sid != final:
                raise self.error(
                    f"{key}: only the final stage ({final}) sends its output to the router", sid, field
                )
        else:
            edge = (int(other), sid) if direction == "input" else (sid, int(other))
            if edge not in self.pipeline_edges():
                raise self.error(f"{key}: {self.no_edge(*edge)}", sid, field)
        if name not in connectors:
            defined = ", ".join(sorted(connectors)) or "none"
            raise self.error(
                f"{key}: connector {name!r} is not defined under connectors: (defined: {defined})", sid, field
            )

    def no_edge(self, src: int, dst: int) -> str:
        edges = ", ".join(f"{a} -> {b}" for a, b in self.pipeline_edges())
        return f"pipeline {self.pipeline.name!r} has no edge {src} -> {dst} (edges: {edges})"

    def checked_edge_specs(self) -> dict[tuple[int, int | str], EdgeSpec]:
        """The ``edges:`` entries: on a pipeline edge (or the final stage's to the router), and asking only
        for what we implement."""
        final = self.pipeline.final_stage.stage_id
        for index, e in enumerate(self.cfg.edges):
            if e.to == ROUTER:
                if e.from_stage != final:
                    raise self.doc_error(
                        f"only the final stage ({final}) sends its output to the router",
                        ("edges", index, "from"),
                    )
                if e.max_inflight is not None:
                    raise self.doc_error(
                        "max_inflight limits requests into a stage, and the router is none; remove it",
                        ("edges", index, "max_inflight"),
                    )
            elif (e.from_stage, e.to) not in self.pipeline_edges():
                raise self.doc_error(self.no_edge(e.from_stage, e.to), ("edges", index))
            if e.window_size is not None and e.window_size != WHOLE_OUTPUT:
                raise self.doc_error(
                    f"window_size {e.window_size} would hand the output over in chunks, which has no effect "
                    f"here: every edge hands each output over whole; set window_size: {WHOLE_OUTPUT} or "
                    "remove it",
                    ("edges", index, "window_size"),
                )
        return {(e.from_stage, e.to): e for e in self.cfg.edges}

    def resolve_edges(
        self, ios: dict[int, StageIO], connectors: dict[str, ConnectorSpec]
    ) -> list[ResolvedEdge]:
        """One connector per edge: what either end names (both must agree), else shared memory. Fills
        ``ios`` (both ends) and ``connectors`` (the default connector) in place."""
        specs = self.checked_edge_specs()
        edges: list[ResolvedEdge] = []
        for src, dst in self.pipeline_edges():
            out_name = ios[src]["output"].get(f"to_stage_{dst}")
            in_name = ios[dst]["input"].get(f"from_stage_{src}")
            if out_name and in_name and out_name != in_name:
                raise self.error(
                    f"from_stage_{src} uses connector {in_name!r} but stage {src}'s "
                    f"output_connectors.to_stage_{dst} says {out_name!r}; both ends must agree",
                    dst,
                    "input_connectors",
                )
            name = out_name or in_name or self.default_connector(connectors)
            ios[src]["output"][f"to_stage_{dst}"] = name
            ios[dst]["input"][f"from_stage_{src}"] = name
            spec = specs.get((src, dst))
            edges.append(
                ResolvedEdge(
                    from_stage=src,
                    to=dst,
                    connector=name,
                    max_inflight=spec.max_inflight if spec else None,
                    same_node_connector=self.same_node_connector(spec, connectors),
                )
            )
        final = self.pipeline.final_stage.stage_id
        router = ios[final]["output"].get(f"to_stage_{ROUTER}") or self.default_connector(connectors)
        ios[final]["output"][f"to_stage_{ROUTER}"] = router
        router_spec = specs.get((final, ROUTER))
        edges.append(
            ResolvedEdge(
                from_stage=final,
                to=ROUTER,
                connector=router,
                same_node_connector=self.same_node_connector(router_spec, connectors),
            )
        )
        used = {e.connector for e in edges} | {e.same_node_connector for e in edges}
        for key in connectors:
            if key not in used:
                self.notes.append(f"{self.loaded.source}: connector {key!r} is defined but not used")
        return edges

    def same_node_connector(self, spec: EdgeSpec | None, connectors: dict[str, ConnectorSpec]) -> str | None:
        """An edge's ``same_node_connector``: defined under ``connectors:``, and only where it can matter."""
        if spec is None or spec.same_node_connector is None:
            return None
        index = self.cfg.edges.index(spec)
        name = spec.same_node_connector
        if name not in connectors:
            defined = ", ".join(sorted(connectors)) or "none"
            raise self.doc_error(
                f"connector {name!r} is not defined under connectors: (defined: {defined})",
                ("edges", index, "same_node_connector"),
            )
        if self.backend != "ray":
            self.notes.append(
                f"{self.loaded.source}: edges[{index}].same_node_connector applies to backend ray only; "
                "ignored (every replica runs on this host)"
            )
            return None
        return name

    @staticmethod
    def default_connector(connectors: dict[str, ConnectorSpec]) -> str:
        """The first declared connector of the default class, else a new one added to ``connectors``."""
        for key, spec in connectors.items():
            if spec.name == DEFAULT_CONNECTOR_CLASS:
                return key
        name = "shared_memory"
        while name in connectors:
            name += "_default"
        connectors[name] = ConnectorSpec(name=DEFAULT_CONNECTOR_CLASS)
        return name

    def check_headless_connectors(
        self, stage_id: int, connectors: dict[str, ConnectorSpec], io: StageIO
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

    # --- stages -------------------------------------------------------------------------------------

    def replicas(
        self, stage: StageDeployConfig, tp: int, extra_env: dict[str, str] | None = None
    ) -> list[ResolvedReplica]:
        n = stage.num_replicas or 1
        env = {**(extra_env or {}), **(stage.env or {})}
        devices = [d.strip() for d in (stage.devices or "").split(",") if d.strip()]
        device_env = self.platform.device_env
        if devices and self.backend == "ray":
            self.note_at(
                stage.stage_id,
                "devices",
                "ignored with backend ray: Ray gives each replica its devices (num_gpus)",
            )
            devices = []
        if devices and device_env is None:
            self.note_at(stage.stage_id, "devices", f"ignored on {self.platform.name}")
            devices = []
        if not devices or device_env is None:
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
        return [
            ResolvedReplica(replica_id=i, devices=",".join(chunk), env={**env, device_env: ",".join(chunk)})
            for i, chunk in enumerate(chunks)
        ]

    def check_not_applicable(self, stage: StageDeployConfig, fixed: PipelineStage) -> None:
        wrong = AR_ONLY_FIELDS if fixed.execution_type == "diffusion" else DIFFUSION_ONLY_FIELDS
        for name in set_fields(stage):
            if name in wrong:
                self.note_at(
                    stage.stage_id, name, f"does not apply to a {fixed.execution_type} stage; ignored"
                )

    def process_mode(self, stage: StageDeployConfig, fixed: PipelineStage) -> tuple[bool, bool]:
        """(runs in its own process, served by a headless worker)."""
        sid, is_ar = fixed.stage_id, fixed.execution_type == "llm_ar"
        if not is_ar and (stage.tensor_parallel_size or 1) != 1:
            raise self.error("diffusion stages run with tensor_parallel_size 1", sid, "tensor_parallel_size")
        process = True if stage.process is None else stage.process
        if is_ar and not process:
            raise self.error("the AR stage always runs in its own vLLM EngineCore process", sid, "process")
        headless = bool(stage.headless)
        if self.backend == "ray" and headless:
            raise self.error(
                "backend ray places every stage on the Ray cluster; a headless stage (a worker started by "
                "hand) cannot be one of them: drop headless or use backend local",
                sid,
                "headless",
            )
        if self.backend == "ray" and not process:
            raise self.error(
                "backend ray runs every stage replica as a Ray actor; drop process: false", sid, "process"
            )
        if headless and not process:
            raise self.error(
                "a headless stage runs in processes of its own on its worker; drop process: false",
                sid,
                "process",
            )
        return process, headless

    def checked_engine_extras(self, stage: StageDeployConfig) -> dict[str, Any]:
        """``engine_extras``, every key a vLLM EngineArgs field that no stage field or pipeline owns."""
        sid = stage.stage_id
        extras = dict(stage.engine_extras or {})
        known = engine_arg_types()
        for key, value in extras.items():
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
        return extras

    def final_async_scheduling(self, stage: StageDeployConfig) -> bool:
        requested = stage.async_scheduling
        if self.platform.supports_async_scheduling:
            return True if requested is None else requested
        if requested:
            self.note_at(
                stage.stage_id,
                "async_scheduling",
                f"{self.platform.name} does not support async scheduling; using synchronous scheduling "
                "(OmniARScheduler)",
            )
        return False

    def scheduler(self, stage: StageDeployConfig, pinned: Any, async_final: bool) -> str:
        """The Omni scheduler that matches ``async_final``; a pin of the other variant is corrected."""
        sid = stage.stage_id
        variant = OMNI_AR_ASYNC_SCHEDULER if async_final else OMNI_AR_SCHEDULER
        if pinned is None:
            return variant
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
            return variant
        if stage.allow_custom_scheduler:
            self.notes.append(f"{where}: stage {sid} uses the custom scheduler {pinned}")
            return pinned
        raise self.error(
            f"scheduler_cls {pinned} is not an Omni AR scheduler; the AR stage runs "
            "OmniARScheduler or OmniARAsyncScheduler, chosen from async_scheduling. "
            "Remove it, or set allow_custom_scheduler: true to run your own",
            sid,
            "engine_extras.scheduler_cls",
        )

    def ar_worker(self, stage: StageDeployConfig, pinned: Any) -> str:
        """The platform's Omni worker; a pin may only name the Omni worker family."""
        sid = stage.stage_id
        if pinned is not None and not (isinstance(pinned, str) and is_omni_worker(pinned)):
            raise self.error(
                f"worker_cls {pinned} is not an Omni worker; the AR stage needs the "
                "Omni worker for the platform (chosen by resolution). Remove it",
                sid,
                "engine_extras.worker_cls",
            )
        if self.platform.ar_worker_cls is None:
            raise self.error(f"the AR stage is not supported on platform {self.platform.name!r}", sid)
        return self.platform.ar_worker_cls

    def model_runner(self, stage: StageDeployConfig, fixed: PipelineStage) -> tuple[str, str, dict[str, str]]:
        """``(runner, why, environment to add)`` of an AR stage: the user's ``VLLM_USE_V2_MODEL_RUNNER``
        (the stage's ``env:``, else this process's environment) wins; else, where vLLM would pick its V2
        runner and the pipeline's stage prefers V1 (vLLM 0.31-0.33), V1."""
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
                raise self.error(
                    f"{RUNNER_ENV}={chosen!r} ({where}): vLLM reads an integer; set 0 (V1 model runner) "
                    "or 1 (V2), or unset it",
                    sid,
                    "env",
                ) from None
            why = f"{RUNNER_ENV}={chosen} set in {where}"
            if v2 and not self.platform.v2_runner_default:
                self.check_v2_runner_possible(sid, why)
            if v2 and fixed.images_need_v1_runner:
                why += f"; {IMAGES_NEED_V1}"
            return ("v2" if v2 else "v1"), why, {}
        if self.platform.v2_runner_default and fixed.v1_runner and picks_v1_runner():
            return "v1", f"{RUNNER_ENV}=0 set for this stage: {fixed.v1_runner}", {RUNNER_ENV: "0"}
        if self.platform.v2_runner_default:
            return "v2", f"vLLM's default on {self.platform.name}", {}
        return "v1", f"vLLM's runner on {self.platform.name}", {}

    def check_v2_runner_possible(self, sid: int, why: str) -> None:
        """vLLM's V2 runner off CUDA/ROCm (the CPU build) needs Triton with a backend for this device."""
        try:
            from vllm.triton_utils import HAS_TRITON
        except ImportError:
            HAS_TRITON = False
        if not HAS_TRITON:
            raise self.error(
                f"{why}, but vLLM's V2 model runner needs Triton with a {self.platform.name} backend, "
                "which this installation lacks; unset it (vLLM's V1 runner serves this stage)",
                sid,
                "env",
            )

    def ar_engine_args(self, stage: StageDeployConfig, fixed: PipelineStage) -> dict[str, Any]:
        extras = self.checked_engine_extras(stage)
        async_final = self.final_async_scheduling(stage)
        scheduler = self.scheduler(stage, extras.pop("scheduler_cls", None), async_final)
        worker = self.ar_worker(stage, extras.pop("worker_cls", None))
        args: dict[str, Any] = {"model": os.path.join(self.model, fixed.model_subdir or "")}
        if fixed.tokenizer_subdir:
            args["tokenizer"] = os.path.join(self.model, fixed.tokenizer_subdir)
        for name in ENGINE_ARG_FIELDS:
            value = getattr(stage, name)
            if value is not None and name != "async_scheduling":
                args[name] = value
        args.update(async_scheduling=async_final, scheduler_cls=scheduler, worker_cls=worker)
        if fixed.engine_args_provider:
            try:
                provided = import_object(fixed.engine_args_provider)(args["model"])
            except (OSError, ValueError) as exc:  # the model folder is not what the pipeline reads
                raise self.error(
                    f"pipeline {self.pipeline.name!r} cannot read its model {self.model!r}: {exc}",
                    stage.stage_id,
                ) from None
            args.update({k: v for k, v in provided.items() if k not in extras})
        args.update(extras)
        args.setdefault("enforce_eager", False)  # written out: whether vLLM captures CUDA graphs
        if fixed.exports_context:
            args["kv_transfer_config"] = self.context_export_config(stage, fixed, args)
        return dict(sorted(args.items()))

    def context_export_config(
        self, stage: StageDeployConfig, fixed: PipelineStage, args: dict[str, Any]
    ) -> dict[str, Any]:
        """``kv_transfer_config`` for an AR stage that exports contexts: vLLM runs the context export KV
        connector, which puts each context into the connector of the stage's output edge (the next
        stage's processes read it back)."""
        sid = stage.stage_id
        if "kv_transfer_config" in args:
            raise self.error(
                "kv_transfer_config: this stage hands its KV cache to the next stage through the plugin's "
                "context export KV connector, and vLLM runs one KV connector per engine; remove it",
                sid,
                "engine_extras.kv_transfer_config",
            )
        from vllm_omni_plugin.runners.paged_kv import kv_cache_dtype_refusal

        refusal = kv_cache_dtype_refusal(args.get("kv_cache_dtype"))
        if refusal is not None:
            raise self.error(refusal, sid, "engine_extras.kv_cache_dtype")
        if args.get("tensor_parallel_size", 1) != 1 or args.get("pipeline_parallel_size", 1) != 1:
            raise self.error(
                "a stage that hands its KV cache over runs with tensor_parallel_size 1 and "
                "pipeline_parallel_size 1 (each worker would export a part of every context)",
                sid,
                "tensor_parallel_size",
            )
        edge = next(
            (e for e in self.resolved_edges if e.from_stage == stage.stage_id and e.to != ROUTER), None
        )
        if edge is None:
            raise self.error("this stage hands its KV cache over but has no output edge", stage.stage_id)
        spec = self.connectors[edge.connector]
        if spec.name == "InProcessConnector":
            raise self.error(
                f"connector {edge.connector!r} is an InProcessConnector; the AR stage's context export runs "
                "in the vLLM worker process, so this edge needs SharedMemoryConnector or NixlConnector",
                stage.stage_id,
                "output_connectors",
            )
        context_connector = {"name": edge.connector, "class": spec.name, "extra": dict(spec.extra)}
        return context_export_kv_transfer_config(context_connector, fixed.context_position)

    def diffusion_args(self, stage: StageDeployConfig, sampling: dict[str, Any]) -> dict[str, Any]:
        """The diffusion worker's arguments, with its request defaults merged here once: the stage's
        field, else its ``default_sampling_params``, else the pipeline's diffusion defaults."""
        if self.platform.diffusion_worker_cls is None:
            raise self.error(
                f"diffusion stages are not supported on platform {self.platform.name!r}", stage.stage_id
            )
        pipeline_defaults = set_fields(self.pipeline.diffusion_defaults)
        args: dict[str, Any] = {
            "model": self.model,
            "max_batch_size": stage.max_batch_size or 1,
            "worker_cls": self.platform.diffusion_worker_cls,
        }
        fixed = self.pipeline.stage(stage.stage_id)
        if fixed is not None and fixed.diffusion_runner:
            args["runner_cls"] = fixed.diffusion_runner
        for name in DIFFUSION_ENGINE_FIELDS:
            if getattr(stage, name) is not None:
                args[name] = getattr(stage, name)
        if stage.gpu_memory_utilization is not None and self.platform.device_env is None:
            self.note_at(
                stage.stage_id,
                "gpu_memory_utilization",
                f"on {self.platform.name} a share of the machine's memory (as vLLM's CPU backend reads it): "
                "the stage admits requests by their estimated activation memory within it, but nothing "
                "caps what it allocates",
            )
        for name in DIFFUSION_DEFAULT_KEYS:
            for value in (getattr(stage, name), sampling.get(name), pipeline_defaults.get(name)):
                if value is not None:
                    args[name] = value
                    break
        return dict(sorted(args.items()))

    def sampling_params(self, stage: StageDeployConfig, fixed: PipelineStage) -> dict[str, Any]:
        params = dict(stage.default_sampling_params or {})
        sid = stage.stage_id
        if fixed.execution_type == "diffusion":
            known = {*DIFFUSION_DEFAULT_KEYS, *self.pipeline.generation_params}
            unknown = sorted(set(params) - known)
            if unknown:
                raise self.error(
                    f"unknown diffusion sampling parameter(s) {', '.join(unknown)}, which would have no "
                    f"effect (known: {', '.join(sorted(known))})",
                    sid,
                    "default_sampling_params",
                )
            return params
        unknown = sorted(set(params) - sampling_param_fields())
        if unknown:
            raise self.error(
                f"{', '.join(unknown)}: not a vLLM SamplingParams field", sid, "default_sampling_params"
            )
        problem = check_sampling_params(params)
        if problem is not None:
            raise self.error(f"rejected by vLLM: {problem}", sid, "default_sampling_params")
        return params

    def placement(self, stage: StageDeployConfig, engine_args: dict[str, Any]) -> ResolvedPlacement | None:
        """What each replica asks the Ray cluster for (backend ray); on the local backend the fields are
        noted as having no effect."""
        if self.backend != "ray":
            for name in RAY_PLACEMENT_FIELDS:
                if getattr(stage, name) is not None:
                    self.note_at(stage.stage_id, name, "applies to backend ray only; ignored")
            return None
        devices = 0.0
        if self.platform.device_env is not None:  # a GPU platform: each replica's devices
            devices = float(
                engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
            )
        if stage.num_gpus is not None and stage.num_gpus > 1 and not float(stage.num_gpus).is_integer():
            raise self.error(
                f"{stage.num_gpus:g} GPUs: Ray gives a replica a fraction of one GPU or whole GPUs",
                stage.stage_id,
                "num_gpus",
            )
        return ResolvedPlacement(
            num_cpus=1.0 if stage.num_cpus is None else stage.num_cpus,
            num_gpus=devices if stage.num_gpus is None else stage.num_gpus,
            resources=dict(sorted((stage.resources or {}).items())),
            node_labels=dict(sorted((stage.node_labels or {}).items())),
            max_restarts=-1 if stage.max_restarts is None else stage.max_restarts,
        )

    def check_ray_connectors(self, edges: list[ResolvedEdge], connectors: dict[str, ConnectorSpec]) -> None:
        """Backend ray: every replica is an actor in a process of its own, on a node Ray picks."""
        for edge in edges:
            where = f"edge {edge.from_stage} -> {edge.to}"
            cls = connectors[edge.connector].name
            if cls == "InProcessConnector" or (
                edge.same_node_connector and connectors[edge.same_node_connector].name == "InProcessConnector"
            ):
                raise self.doc_error(
                    f"{where} uses an InProcessConnector, which cannot reach a Ray actor's process; use "
                    "NixlConnector (and SharedMemoryConnector as its same_node_connector)",
                    ("connectors",),
                )
            if cls == "SharedMemoryConnector":
                self.notes.append(
                    f"{self.loaded.source}: {where} uses the SharedMemoryConnector {edge.connector!r} with "
                    "backend ray: a replica Ray places on another node than the other end fails to start; "
                    "use NixlConnector with same_node_connector for shared memory on one node"
                )

    def ray_settings(self) -> ResolvedRay | None:
        if self.backend != "ray":
            if self.cfg.ray is not None:
                self.notes.append(f"{self.loaded.source}: ray: applies to backend ray only; ignored")
            return None
        return ResolvedRay(**set_fields(self.cfg.ray or RaySpec()))

    def head(self) -> ResolvedHead:
        head = ResolvedHead(**set_fields(self.cfg.head or HeadSpec()))
        if head.heartbeat_timeout_s <= head.heartbeat_interval_s:
            raise self.doc_error(
                f"heartbeat_timeout_s ({head.heartbeat_timeout_s}) must be longer than "
                f"heartbeat_interval_s ({head.heartbeat_interval_s})",
                ("head", "heartbeat_timeout_s"),
            )
        return head

    def resolve_stage(
        self,
        stage: StageDeployConfig,
        fixed: PipelineStage,
        io: StageIO,
        connectors: dict[str, ConnectorSpec],
    ) -> ResolvedStage:
        self.check_not_applicable(stage, fixed)
        is_ar = fixed.execution_type == "llm_ar"
        process, headless = self.process_mode(stage, fixed)
        if headless:
            self.check_headless_connectors(fixed.stage_id, connectors, io)
        engine_args = self.ar_engine_args(stage, fixed) if is_ar else {}
        runner = why = None
        runner_env: dict[str, str] = {}
        if is_ar:
            runner, why, runner_env = self.model_runner(stage, fixed)
        replicas = self.replicas(stage, engine_args.get("tensor_parallel_size", 1), runner_env)
        placement = self.placement(stage, engine_args if is_ar else {})
        sampling = self.sampling_params(stage, fixed)
        return ResolvedStage(
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
            diffusion_args={} if is_ar else self.diffusion_args(stage, sampling),
            headless=headless,
            continuation=fixed.continuation,
            companion_timeout_s=stage.companion_timeout_s or DEFAULT_COMPANION_TIMEOUT_S,
            placement=placement,
            model_runner=runner,
            model_runner_reason=why,
        )

    def check_shared_devices(self, resolved: list[ResolvedStage]) -> None:
        """Stages placed on one device of this host split its memory: their ``gpu_memory_utilization``
        (an AR stage without one takes vLLM's default, 0.9) must add up to at most 1, or the second
        stage to start finds the device full."""
        if self.platform.device_env is None or self.backend != "local":
            return
        shares: dict[str, list[tuple[ResolvedStage, float, str]]] = {}
        for stage in resolved:
            if stage.headless:  # its devices are another host's
                continue
            if stage.execution_type == "llm_ar":
                share = stage.engine_args.get("gpu_memory_utilization")
                note = "" if share is not None else " (vLLM's default)"
                share = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION if share is None else share
            else:
                share, note = stage.diffusion_args.get("gpu_memory_utilization"), ""
                if share is None:
                    continue
            for device in {d for replica in stage.replicas for d in (replica.devices or "").split(",") if d}:
                shares.setdefault(device, []).append((stage, float(share), note))
        for device, users in sorted(shares.items()):
            total = sum(share for _, share, _ in users)
            if len(users) > 1 and total > 1.0 + 1e-9:
                parts = ", ".join(
                    f"stage {s.stage_id} ({s.name}) {share:g}{note}" for s, share, note in users
                )
                raise self.error(
                    f"device {device} is shared by {parts}: together {total:g} of its memory; lower their "
                    "gpu_memory_utilization so that they add up to at most 1 (about 0.9 leaves room for "
                    "each process's CUDA context)",
                    users[-1][0].stage_id,
                    "gpu_memory_utilization",
                )

    @staticmethod
    def completed_stage(stage: StageDeployConfig, resolved: ResolvedStage) -> StageDeployConfig:
        """The stage as a deploy config that resolves to ``resolved`` again (derived values written out,
        corrected pins dropped)."""
        done = msgspec.structs.replace(
            stage,
            num_replicas=resolved.num_replicas,
            process=resolved.process,
            input_connectors=resolved.input_connectors or None,
            output_connectors=resolved.output_connectors or None,
        )
        if resolved.execution_type != "llm_ar":
            return done
        extras = {
            k: v
            for k, v in (stage.engine_extras or {}).items()
            if k not in ("scheduler_cls", "worker_cls") or stage.allow_custom_scheduler
        }
        return msgspec.structs.replace(
            done, async_scheduling=resolved.engine_args["async_scheduling"], engine_extras=extras or None
        )

    def check_model(self) -> None:
        """A pipeline that serves what the model folder says (``model_inspector``) refuses a model it
        cannot drive now, in one line, rather than in a stage process that fails to load."""
        if self.pipeline.model_inspector is None:
            return
        try:
            import_object(self.pipeline.model_inspector)(self.model)
        except (ValueError, OSError) as exc:
            raise ConfigError(
                f"pipeline {self.pipeline.name!r} cannot serve {self.model}: {exc}", source=self.loaded.source
            ) from None

    def run(self) -> ResolvedDeployment:
        pipeline = self.pipeline
        if self.cfg.async_chunk and pipeline.streaming_processor is None:
            raise self.doc_error(
                f"async_chunk: true needs a streaming stage-input processor, and pipeline "
                f"{pipeline.name!r} has none; set async_chunk: false",
                ("async_chunk",),
            )
        stages = self.layered_stages()
        connectors = self.checked_connectors(stages)
        ios = self.stage_connectors(stages, connectors)
        edges = self.resolve_edges(ios, connectors)
        self.connectors, self.resolved_edges = connectors, edges
        if self.backend == "ray":
            self.check_ray_connectors(edges, connectors)
        resolved = [
            self.resolve_stage(stages[f.stage_id], f, ios[f.stage_id], connectors) for f in pipeline.stages
        ]
        self.check_shared_devices(resolved)
        max_retries = DEFAULT_MAX_RETRIES if self.cfg.max_retries is None else self.cfg.max_retries
        deploy = DeployConfig(
            pipeline=pipeline.name,
            async_chunk=bool(self.cfg.async_chunk),
            backend=self.backend,
            ray=self.cfg.ray,
            max_retries=max_retries,
            connectors=connectors,
            head=self.cfg.head,
            edges=list(self.cfg.edges),
            stages=[self.completed_stage(stages[r.stage_id], r) for r in resolved],
        )
        self.check_model()
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
            backend=self.backend,
            ray=self.ray_settings(),
            max_retries=max_retries,
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
    backend: Backend | None = None,
) -> ResolvedDeployment:
    """Resolve a loaded deploy config for ``model`` on ``platform`` (default: the current one);
    ``backend`` (``--worker-backend``) wins over the file's."""
    return _Resolver(
        loaded,
        model,
        platform or current_platform(),
        dict(cli_engine_args or {}),
        dict(stage_overrides or {}),
        backend,
    ).run()


def reresolve(
    resolved: ResolvedDeployment, loaded: LoadedConfig, platform: PlatformInfo
) -> ResolvedDeployment:
    """Resolve a resolution's completed config again (used to check idempotence)."""
    again = LoadedConfig(
        config=resolved.deploy, source=loaded.source, pipeline=loaded.pipeline, lines=loaded.lines
    )
    return resolve(again, model=resolved.model, platform=platform)
