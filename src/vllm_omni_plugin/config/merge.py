"""Layer merging: a later layer's set fields win; mappings merge key by key; stages merge by id."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from vllm_omni_plugin.config.schema import (
    DeployConfig,
    EdgeSpec,
    PlatformSection,
    StageDeployConfig,
)

S = TypeVar("S", bound=msgspec.Struct)


def set_fields(struct: msgspec.Struct) -> dict[str, Any]:
    """The fields a layer actually sets (None and empty collections mean "not set here")."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(struct):
        value = getattr(struct, f.name)
        if value is None or (isinstance(value, dict | list) and not value):
            continue
        out[f.name] = value
    return out


def merge_stage(base: StageDeployConfig, over: msgspec.Struct) -> StageDeployConfig:
    changes: dict[str, Any] = {}
    for name, value in set_fields(over).items():
        if name == "stage_id":
            continue
        current = getattr(base, name)
        if isinstance(value, dict) and isinstance(current, dict):
            value = {**current, **value}
        elif isinstance(value, msgspec.Struct) and type(current) is type(value):  # a block: field by field
            value = msgspec.structs.replace(current, **set_fields(value))
        changes[name] = value
    return msgspec.structs.replace(base, **changes)


def merge_stage_lists(
    base: list[StageDeployConfig], over: list[StageDeployConfig]
) -> list[StageDeployConfig]:
    merged = {s.stage_id: s for s in base}
    order = [s.stage_id for s in base]
    for stage in over:
        if stage.stage_id in merged:
            merged[stage.stage_id] = merge_stage(merged[stage.stage_id], stage)
        else:
            merged[stage.stage_id] = stage
            order.append(stage.stage_id)
    return [merged[i] for i in order]


def merge_edges(base: list[EdgeSpec], over: list[EdgeSpec]) -> list[EdgeSpec]:
    merged = {(e.from_stage, e.to): e for e in base}
    for edge in over:
        key = (edge.from_stage, edge.to)
        if key in merged:
            merged[key] = msgspec.structs.replace(merged[key], **set_fields(edge))
        else:
            merged[key] = edge
    return list(merged.values())


def merge_deploy(base: DeployConfig, over: DeployConfig) -> DeployConfig:
    changes: dict[str, Any] = {}
    for name, value in set_fields(over).items():
        if name == "stages":
            value = merge_stage_lists(base.stages, value)
        elif name == "edges":
            value = merge_edges(base.edges, value)
        elif name == "platforms":
            platforms = dict(base.platforms)
            for key, section in value.items():
                if key in platforms:
                    section = PlatformSection(stages=merge_stage_lists(platforms[key].stages, section.stages))
                platforms[key] = section
            value = platforms
        elif isinstance(value, msgspec.Struct) and isinstance(getattr(base, name), msgspec.Struct):
            value = msgspec.structs.replace(getattr(base, name), **set_fields(value))
        elif isinstance(value, dict) and isinstance(getattr(base, name), dict):
            value = {**getattr(base, name), **value}
        changes[name] = value
    changes["base_config"] = None
    return msgspec.structs.replace(base, **changes)
