"""Translation of legacy vllm-omni ``stage_args`` documents into the deploy ("stages") form.

After translation a legacy file IS a stages document: it takes the same defaults and the same
resolution, so the scheduler class and the async flag are derived, never taken as written. Topology
that the pipeline already fixes (stage types, subdirs, input sources, processors, final-output flags)
is checked against the pipeline and dropped; fields nothing consumes are reported as ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin.config.errors import Path
from vllm_omni_plugin.config.pipeline import Pipeline
from vllm_omni_plugin.config.platform import is_omni_worker
from vllm_omni_plugin.config.schema import DIFFUSION_ONLY_FIELDS, ENGINE_ARG_FIELDS
from vllm_omni_plugin.config.yaml_source import Document

OMNI_WORKER_TYPES = frozenset({"ar", "generation", "diffusion", "llm"})

# vllm-omni stage-input processors -> ours.
LEGACY_PROCESSORS: dict[str, str] = {
    "vllm_omni.model_executor.stage_input_processors.glm_image.ar2diffusion": (
        "vllm_omni_plugin.families.glm_image.processors.ar2diffusion"
    ),
}

LEGACY_STAGE_TYPES = {"llm": "llm_ar", "ar": "llm_ar", "llm_ar": "llm_ar", "diffusion": "diffusion"}
LEGACY_OUTPUT_TYPES = {"token_ids": "token_ids", "latent": "latents", "latents": "latents", "text": "text"}

# engine_args keys that are stage fields of the stages form (everything else goes to engine_extras).
STAGE_FIELDS_FROM_ENGINE_ARGS = (
    frozenset(ENGINE_ARG_FIELDS) | (DIFFUSION_ONLY_FIELDS - {"max_batch_size"}) | {"quantization"}
)


def is_legacy_document(data: Any) -> bool:
    return isinstance(data, dict) and "stage_args" in data


@dataclass
class Translation:
    data: dict[str, Any]
    origins: dict[Path, Path] = field(default_factory=dict)
    """Path in the translated document -> path in the legacy document (for error lines)."""
    notes: list[str] = field(default_factory=list)


class _Translator:
    def __init__(self, doc: Document, pipeline: Pipeline | None) -> None:
        self.doc = doc
        self.pipeline = pipeline
        self.out: dict[str, Any] = {}
        self.origins: dict[Path, Path] = {}
        self.notes: list[str] = []

    def where(self, path: Path) -> str:
        line = self.doc.line_of(path)
        return f"{self.doc.source}:{line}" if line else self.doc.source

    def ignore(self, path: Path, reason: str) -> None:
        self.notes.append(f"{self.where(path)}: ignored legacy field {_fmt(path)}: {reason}")

    def put(self, new_path: Path, value: Any, old_path: Path) -> None:
        node: Any = self.out
        for index, part in enumerate(new_path[:-1]):
            if isinstance(node, list):
                assert isinstance(part, int)
                node = node[part]
                continue
            nxt = new_path[index + 1]
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
        if isinstance(node, list):
            node.append(value)
        else:
            node[new_path[-1]] = value
        self.origins[new_path] = old_path

    def expect_mapping(self, value: Any, path: Path) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.doc.error(path, f"expected a mapping, got {_kind(value)}")
        return value

    def check_fixed(self, path: Path, given: Any, fixed: Any, what: str) -> None:
        """A field the pipeline fixes: equal is dropped silently, different is an error."""
        if given != fixed:
            name = self.pipeline.name if self.pipeline is not None else "?"
            raise self.doc.error(
                path,
                f"{what} is fixed by pipeline {name!r} as {fixed!r}, the legacy file says {given!r}; "
                "remove the field",
            )

    def translate(self) -> Translation:
        data = self.doc.data
        for key, value in data.items():
            path: Path = (key,)
            if key == "stage_args":
                if not isinstance(value, list):
                    raise self.doc.error(path, f"expected a list of stages, got {_kind(value)}")
                for index, stage in enumerate(value):
                    self.stage(index, stage)
            elif key == "runtime":
                self.runtime(self.expect_mapping(value, path))
            elif key in ("async_chunk", "pipeline", "dtype", "trust_remote_code", "seed"):
                self.put((key,), value, path)
            elif key in ("connectors", "edges"):
                self.put((key,), value, path)
            else:
                raise self.doc.error(
                    path,
                    "unknown top-level field of a stage_args document "
                    "(known: stage_args, runtime, async_chunk, connectors, edges, pipeline)",
                )
        return Translation(self.out, self.origins, self.notes)

    def runtime(self, runtime: dict[str, Any]) -> None:
        defaults: dict[str, Any] = {}
        for key, value in runtime.items():
            path: Path = ("runtime", key)
            if key == "enabled":
                self.ignore(path, "the multi-stage runtime is always on with --omni")
            elif key == "defaults":
                defaults = self.expect_mapping(value, path)
                for dkey in defaults:
                    if dkey not in ("window_size", "max_inflight"):
                        raise self.doc.error(
                            (*path, dkey), "unknown runtime default (known: window_size, max_inflight)"
                        )
            elif key == "connectors":
                self.put(("connectors",), value, path)
            elif key == "edges":
                if not isinstance(value, list):
                    raise self.doc.error(path, f"expected a list of edges, got {_kind(value)}")
                self.out.setdefault("edges", [])
                self.origins[("edges",)] = path
                for index, edge in enumerate(value):
                    self.put(("edges", index), edge, (*path, index))
            else:
                raise self.doc.error(
                    path, "unknown runtime field (known: enabled, defaults, connectors, edges)"
                )
        # runtime.defaults apply to every edge that does not set the value itself.
        for index, edge in enumerate(self.out.get("edges", [])):
            if isinstance(edge, dict):
                for dkey, dvalue in defaults.items():
                    if dkey not in edge:
                        edge[dkey] = dvalue
                        self.origins[("edges", index, dkey)] = ("runtime", "defaults", dkey)
        if defaults and not self.out.get("edges"):
            self.ignore(("runtime", "defaults"), "no edges are declared for the defaults to apply to")

    def stage(self, index: int, stage: Any) -> None:
        base: Path = ("stage_args", index)
        stage = self.expect_mapping(stage, base)
        if "stage_id" not in stage:
            raise self.doc.error(base, "missing stage_id")
        stage_id = stage["stage_id"]
        if not isinstance(stage_id, int) or isinstance(stage_id, bool):
            raise self.doc.error((*base, "stage_id"), f"expected int, got {_show(stage_id)}")
        fixed = self.pipeline.stage(stage_id) if self.pipeline else None
        if self.pipeline is not None and fixed is None:
            raise self.doc.error(
                (*base, "stage_id"),
                f"pipeline {self.pipeline.name!r} has no stage {stage_id} "
                f"(stages: {list(self.pipeline.stage_ids)})",
            )
        new: Path = ("stages", index)
        self.put(new, {"stage_id": stage_id}, base)
        self.origins[(*new, "stage_id")] = (*base, "stage_id")
        for key, value in stage.items():
            path: Path = (*base, key)
            if key == "stage_id":
                continue
            if key == "stage_type":
                kind = LEGACY_STAGE_TYPES.get(str(value))
                if kind is None:
                    raise self.doc.error(path, f"unknown stage_type {value!r} (known: llm, diffusion)")
                if fixed:
                    self.check_fixed(path, kind, fixed.execution_type, "the stage type")
            elif key == "runtime":
                self.stage_runtime(self.expect_mapping(value, path), path, new)
            elif key == "engine_args":
                self.engine_args(self.expect_mapping(value, path), path, new, fixed)
            elif key == "engine_input_source":
                if not isinstance(value, list):
                    raise self.doc.error(path, f"expected a list of stage ids, got {_kind(value)}")
                if fixed:
                    self.check_fixed(path, list(value), list(fixed.input_sources), "the input sources")
            elif key == "custom_process_input_func":
                ours = LEGACY_PROCESSORS.get(str(value), value)
                if fixed:
                    self.check_fixed(path, ours, fixed.input_processor, "the stage-input processor")
            elif key == "final_output":
                if fixed:
                    self.check_fixed(path, bool(value), fixed.final_output, "final_output")
            elif key == "final_output_type":
                if fixed:
                    final_type = fixed.output_type if fixed.final_output else None
                    self.check_fixed(path, value, final_type, "final_output_type")
            elif key == "is_comprehension":
                self.ignore(path, "the pipeline defines which stage produces which output")
            elif key in ("default_sampling_params", "input_connectors", "output_connectors"):
                self.put((*new, key), value, path)
            else:
                raise self.doc.error(
                    path,
                    "unknown stage_args field (known: stage_id, stage_type, runtime, engine_args, "
                    "engine_input_source, custom_process_input_func, final_output, "
                    "final_output_type, is_comprehension, default_sampling_params, "
                    "input_connectors, output_connectors)",
                )

    def stage_runtime(self, runtime: dict[str, Any], base: Path, new: Path) -> None:
        for key, value in runtime.items():
            path: Path = (*base, key)
            if key == "process":
                self.put((*new, "process"), value, path)
            elif key == "devices":
                self.put((*new, "devices"), str(value) if isinstance(value, int) else value, path)
            elif key == "max_batch_size":
                self.put((*new, "max_batch_size"), value, path)
            else:
                raise self.doc.error(
                    path, "unknown stage runtime field (known: process, devices, max_batch_size)"
                )

    def engine_args(self, args: dict[str, Any], base: Path, new: Path, fixed: Any) -> None:
        extras: dict[str, Any] = {}
        for key, value in args.items():
            path: Path = (*base, key)
            if key == "model_stage":
                if fixed:
                    self.check_fixed(path, value, fixed.name, "the stage name (model_stage)")
            elif key == "model_arch":
                if fixed and fixed.model_arch:
                    self.check_fixed(path, value, fixed.model_arch, "the model architecture")
            elif key == "engine_output_type":
                if fixed:
                    ours = LEGACY_OUTPUT_TYPES.get(str(value), value)
                    self.check_fixed(path, ours, fixed.output_type, "engine_output_type")
            elif key in ("model_subdir", "tokenizer_subdir"):
                if fixed:
                    self.check_fixed(path, value, getattr(fixed, key), key)
            elif key == "worker_type":
                if str(value) not in OMNI_WORKER_TYPES:
                    raise self.doc.error(
                        path, f"unknown worker_type {value!r} (known: {sorted(OMNI_WORKER_TYPES)})"
                    )
                self.ignore(path, "the worker is chosen for the platform by resolution")
            elif key == "worker_cls":
                if isinstance(value, str) and is_omni_worker(value):
                    self.ignore(path, "the Omni worker is chosen for the platform by resolution")
                else:
                    extras["worker_cls"] = value
                    self.origins[(*new, "engine_extras", "worker_cls")] = path
            elif key in STAGE_FIELDS_FROM_ENGINE_ARGS:
                self.put((*new, key), value, path)
            else:
                # scheduler_cls and any other EngineArgs: checked by resolution like engine_extras.
                extras[key] = value
                self.origins[(*new, "engine_extras", key)] = path
        if extras:
            self.put((*new, "engine_extras"), extras, base)


def translate_legacy(doc: Document, pipeline: Pipeline | None) -> Translation:
    if not isinstance(doc.data, dict):
        raise doc.error((), f"expected a mapping at the top level, got {_kind(doc.data)}")
    return _Translator(doc, pipeline).translate()


def _fmt(path: Path) -> str:
    from vllm_omni_plugin.config.errors import format_path

    return format_path(path)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__
    )


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)
