"""Loading deploy documents: YAML -> (legacy translation) -> strict structs, with errors that point
at the file, the line and the field."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path as FsPath
from typing import Any, TypeVar

import msgspec

from vllm_omni_plugin.config.errors import ConfigError, Path
from vllm_omni_plugin.config.legacy import is_legacy_document, translate_legacy
from vllm_omni_plugin.config.pipeline import Pipeline, detect_pipeline, get_pipeline
from vllm_omni_plugin.config.schema import DeployConfig, StageOverride
from vllm_omni_plugin.config.yaml_source import Document, load_yaml_file

T = TypeVar("T")

PACKAGED_PREFIX = "<packaged>/"


def packaged_deploy_dir() -> FsPath:
    return FsPath(str(resources.files("vllm_omni_plugin") / "deploy"))


def packaged_deploy_configs() -> list[FsPath]:
    return sorted(packaged_deploy_dir().glob("*.yaml"))


def packaged_deploy_config(name: str) -> FsPath:
    path = packaged_deploy_dir() / name
    if not path.is_file():
        known = ", ".join(p.name for p in packaged_deploy_configs())
        raise ConfigError(f"no packaged deploy config {name!r} (packaged: {known})")
    return path


@dataclass
class LoadedConfig:
    """A deploy config ready for resolution, plus what loading noticed."""

    config: DeployConfig
    source: str
    pipeline: Pipeline
    legacy: bool = False
    notes: list[str] = field(default_factory=list)
    lines: dict[tuple[int, str], str] = field(default_factory=dict)
    """(stage_id, field) -> "file:line" where a stage field was written (for warnings)."""
    locate: Callable[[Path], int | None] = lambda _path: None
    """The line of a document path (``("connectors", "a", "name")``), where known."""


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.S)
_PART = re.compile(r"\.(?P<name>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<index>\d+|\.\.\.)\]")


def _parse_path(text: str) -> list[str | int]:
    parts: list[str | int] = []
    for match in _PART.finditer(text):
        if match.group("name") is not None:
            parts.append(match.group("name"))
        elif match.group("index") == "...":
            parts.append("...")
        else:
            parts.append(int(match.group("index")))
    return parts


def _get(data: Any, path: Path) -> Any:
    for part in path:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def _replace_at(data: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(data, dict):
        return {**data, head: _replace_at(data[head], rest, value)}
    assert isinstance(head, int)
    copy = list(data)
    copy[head] = _replace_at(copy[head], rest, value)
    return copy


def _pinpoint(data: Any, type_: type, parts: list[str | int], message: str) -> list[str | int]:
    """msgspec reports dict keys as ``[...]``: find which key the error is about."""
    while "..." in parts:
        index = parts.index("...")
        prefix = tuple(parts[:index])
        container = _get(data, prefix)
        if not isinstance(container, dict):
            break
        for key in container:
            try:
                msgspec.convert(_replace_at(data, prefix, {key: container[key]}), type_)
            except msgspec.ValidationError as exc:
                if str(exc).split(" - at ")[0] == message:
                    parts[index] = key
                    break
        else:
            break
    return [p for p in parts if p != "..."]


def _type_name(text: str) -> str:
    names = [n.strip() for n in text.split("|") if n.strip() != "null"]
    return " or ".join({"object": "a mapping", "array": "a list"}.get(n, n) for n in names)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing"
    return repr(value)


def _struct_fields(type_: Any, parts: list[str | int]) -> list[str]:
    """Field names of the struct at ``parts`` (for "did you mean" hints)."""
    import typing

    current: Any = type_
    for part in parts:
        if isinstance(part, int):
            continue  # the list's item type was unwrapped already
        if isinstance(current, type) and issubclass(current, msgspec.Struct):
            hints = typing.get_type_hints(current, include_extras=True)
            enc = {f.encode_name: f.name for f in msgspec.structs.fields(current)}
            current = hints.get(enc.get(str(part), str(part)))
        origin = typing.get_origin(current)
        while origin in (typing.Union, __import__("types").UnionType, typing.Annotated):
            args = [a for a in typing.get_args(current) if a is not type(None)]
            current = args[0] if args else None
            origin = typing.get_origin(current)
        if origin in (list, dict):
            current = typing.get_args(current)[-1]
    if isinstance(current, type) and issubclass(current, msgspec.Struct):
        return [f.encode_name for f in msgspec.structs.fields(current)]
    return []


def convert(
    data: Any,
    type_: type[T],
    *,
    source: str,
    line_of: Any,
    origins: dict[Path, Path] | None = None,
    prefix: Path = (),
) -> T:
    """``msgspec.convert`` with errors rewritten as ``file:line: field.path: expected ..., got ...``."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None
        message = match.group("msg")
        parts = _pinpoint(data, type_, _parse_path(match.group("path") or ""), message)
        value = _get(data, tuple(parts))
        unknown = re.match(r"Object contains unknown field `(.+)`", message)
        missing = re.match(r"Object missing required field `(.+)`", message)
        expected = re.match(r"Expected `(.+?)`(?:, got `(.+?)`)?(.*)$", message)
        if unknown:
            name = unknown.group(1)
            known = _struct_fields(type_, parts)
            parts = [*parts, name]
            close = difflib.get_close_matches(name, known, n=1)
            text = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
        elif missing:
            text = f"missing required field {missing.group(1)!r}"
        elif match.group("key"):
            text = f"keys must be strings, got {message.split('got ')[-1].strip('`')}"
        elif expected:
            bound = expected.group(3).strip()
            text = f"expected {_type_name(expected.group(1))}{' ' + bound if bound else ''}"
            text += f", got {_show(value)}"
        else:
            text = message
        path = tuple(parts)
        shown = origins.get(path, None) if origins else None
        if origins and shown is None:
            # map to the nearest translated ancestor's legacy location
            probe = path
            while probe and probe not in origins:
                probe = probe[:-1]
            shown = origins.get(probe)
        full = (*prefix, *path) if shown is None else shown
        raise ConfigError(text, source=source, line=line_of(full), path=full) from None


def _display(path: FsPath) -> str:
    try:
        packaged = packaged_deploy_dir().resolve()
        resolved = path.resolve()
        if resolved.is_relative_to(packaged):
            return PACKAGED_PREFIX + str(resolved.relative_to(packaged))
    except OSError:
        pass
    return str(path)


def _stage_lines(doc: Document, config: DeployConfig, origins: dict[Path, Path] | None) -> dict:
    lines: dict[tuple[int, str], str] = {}
    for index, stage in enumerate(config.stages):
        for name in msgspec.structs.asdict(stage):
            path: Path = ("stages", index, name)
            where = origins.get(path, path) if origins else path
            line = doc.line_of(where)
            lines[(stage.stage_id, name)] = f"{doc.source}:{line}" if line else doc.source
        extras = stage.engine_extras or {}
        for key in extras:
            path = ("stages", index, "engine_extras", key)
            where = origins.get(path, path) if origins else path
            line = doc.line_of(where)
            lines[(stage.stage_id, f"engine_extras.{key}")] = f"{doc.source}:{line}" if line else doc.source
    return lines


def _locator(doc: Document, origins: dict[Path, Path] | None) -> Callable[[Path], int | None]:
    def locate(path: Path) -> int | None:
        if origins:
            probe = tuple(path)
            while probe and probe not in origins:
                probe = probe[:-1]
            if probe:
                return doc.line_of(origins[probe])
        return doc.line_of(path) if tuple(path) in doc.lines or not origins else None

    return locate


def _pipeline_for(doc: Document, model: str | None, pipeline_hint: str | None) -> Pipeline:
    name = doc.data.get("pipeline") if isinstance(doc.data, dict) else None
    if name is not None:
        if not isinstance(name, str):
            raise doc.error(("pipeline",), f"expected str, got {_show(name)}")
        try:
            return get_pipeline(name)
        except ConfigError as exc:
            raise doc.error(("pipeline",), exc.message) from None
    if pipeline_hint:
        return get_pipeline(pipeline_hint)
    detected = detect_pipeline(model) if model else None
    if detected is None and is_legacy_document(doc.data):
        detected = _pipeline_from_legacy_archs(doc.data)
    if detected is None:
        raise doc.error(
            (),
            f"cannot tell which pipeline model {model!r} is (no model_index.json or config.json "
            "that a registered pipeline recognises); name it with `pipeline:` in the deploy config",
        )
    return detected


def _pipeline_from_legacy_archs(data: dict[str, Any]) -> Pipeline | None:
    """Legacy files name each stage's ``model_arch``; a pipeline whose stages match them is the one."""
    from vllm_omni_plugin.config.pipeline import registered_pipelines

    stages = data.get("stage_args")
    if not isinstance(stages, list):
        return None
    archs = {
        s["engine_args"].get("model_arch")
        for s in stages
        if isinstance(s, dict)
        and isinstance(s.get("engine_args"), dict)
        and isinstance(s["engine_args"].get("model_arch"), str)
    }
    for pipeline in registered_pipelines().values():
        if archs & {s.model_arch for s in pipeline.stages}:
            return pipeline
    return None


def load_document(
    doc: Document,
    *,
    model: str | None,
    pipeline_hint: str | None = None,
    allow_legacy: bool,
    seen: tuple[str, ...] = (),
) -> LoadedConfig:
    if not isinstance(doc.data, dict):
        raise doc.error((), "expected a mapping at the top level (a deploy config)")
    pipeline = _pipeline_for(doc, model, pipeline_hint)
    origins: dict[Path, Path] | None = None
    notes: list[str] = []
    data = doc.data
    legacy = is_legacy_document(data)
    if legacy:
        if not allow_legacy:
            raise doc.error(
                ("stage_args",),
                "this is a legacy stage_args document; pass it with --stage-configs-path "
                "(it is translated), --deploy-config takes the `stages:` form",
            )
        translation = translate_legacy(doc, pipeline)
        data, origins, notes = translation.data, translation.origins, translation.notes
    config = convert(data, DeployConfig, source=doc.source, line_of=doc.line_of, origins=origins)
    loaded = LoadedConfig(
        config=config,
        source=doc.source,
        pipeline=pipeline,
        legacy=legacy,
        notes=notes,
        lines=_stage_lines(doc, config, origins),
        locate=_locator(doc, origins),
    )
    if config.base_config is not None:
        loaded = _apply_base(loaded, doc, model=model, seen=(*seen, doc.source))
    return loaded


def _apply_base(loaded: LoadedConfig, doc: Document, *, model: str | None, seen: tuple[str, ...]):
    from vllm_omni_plugin.config.merge import merge_deploy

    name = loaded.config.base_config
    assert name is not None
    here = FsPath(doc.source)
    candidate = here.parent / name
    packaged = doc.source.startswith(PACKAGED_PREFIX) or not candidate.is_file()
    if packaged:
        try:
            candidate = packaged_deploy_config(name)
        except ConfigError:
            raise doc.error(
                ("base_config",),
                f"base config {name!r} is neither a file next to this one nor a packaged config",
            ) from None
    base_doc = load_yaml_file(candidate, display=_display if packaged else None)
    if base_doc.source in seen or base_doc.source == doc.source:
        raise doc.error(("base_config",), f"base_config cycle: {' -> '.join((*seen, base_doc.source))}")
    base = load_document(
        base_doc, model=model, pipeline_hint=loaded.pipeline.name, allow_legacy=False, seen=seen
    )
    if base.pipeline.name != loaded.pipeline.name:
        raise doc.error(
            ("base_config",),
            f"base config is for pipeline {base.pipeline.name!r}, this one for {loaded.pipeline.name!r}",
        )
    merged = merge_deploy(base.config, loaded.config)
    lines = {**base.lines, **loaded.lines}
    return LoadedConfig(
        config=merged,
        source=loaded.source,
        pipeline=loaded.pipeline,
        legacy=loaded.legacy,
        notes=[*base.notes, *loaded.notes],
        lines=lines,
        locate=loaded.locate,
    )


def load_deploy_file(
    path: str | FsPath,
    *,
    model: str | None,
    allow_legacy: bool,
    pipeline_hint: str | None = None,
    packaged: bool = False,
) -> LoadedConfig:
    """Load a deploy document; user-given paths are shown as typed, packaged ones as <packaged>/NAME."""
    doc = load_yaml_file(path, display=_display if packaged else None)
    return load_document(doc, model=model, pipeline_hint=pipeline_hint, allow_legacy=allow_legacy)


def parse_stage_overrides(value: Any, source: str = "--stage-overrides") -> dict[int, StageOverride]:
    """``{"0": {"max_num_seqs": 4}}`` -> per-stage override structs."""
    if not isinstance(value, dict):
        raise ConfigError("expected a JSON object keyed by stage id", source=source)
    out: dict[int, StageOverride] = {}
    for key, fields in value.items():
        try:
            stage_id = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"stage ids are integers, got {key!r}", source=source) from None
        if isinstance(fields, dict) and "stage_id" in fields:
            raise ConfigError(
                "the key gives the stage id; remove stage_id", source=source, path=(str(key), "stage_id")
            )
        out[stage_id] = convert(
            fields, StageOverride, source=source, line_of=lambda _p: None, prefix=(str(key),)
        )
    return out
