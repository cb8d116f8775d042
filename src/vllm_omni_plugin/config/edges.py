"""Connectors and edges: the declared connectors checked against their classes, each stage's connector
keys checked against the pipeline's edges, and one connector per edge (what either end names, else shared
memory), with the checks a headless stage or backend ray adds."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_omni_plugin.config.loader import convert
from vllm_omni_plugin.config.pipeline import Pipeline
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.resolved import ROUTER, ResolvedEdge
from vllm_omni_plugin.config.schema import Backend, ConnectorSpec, DeployConfig, EdgeSpec, StageDeployConfig
from vllm_omni_plugin.connectors import CONNECTOR_CLASSES, DEFAULT_CONNECTOR_CLASS

WHOLE_OUTPUT = -1
"""``window_size`` of an edge that hands each output over whole, the only hand-over we implement."""
_CONNECTOR_KEY = re.compile(r"^(from|to)_stage_(\d+|router)$")

StageIO = dict[str, dict[str, str]]
"""A stage's connectors: ``{"input": {"from_stage_N": name}, "output": {"to_stage_N": name}}``."""


@dataclass(frozen=True)
class Wiring:
    """What resolution decided about connectors: the checked ones (plus the default one edges fell back
    to), each stage's connectors with both ends of every edge filled in, and the edges."""

    connectors: dict[str, ConnectorSpec]
    ios: dict[int, StageIO]
    edges: list[ResolvedEdge]

    def output_edge(self, stage_id: int) -> ResolvedEdge | None:
        """The stage's edge to another stage (not to the router), if any."""
        return next((e for e in self.edges if e.from_stage == stage_id and e.to != ROUTER), None)


def wire(
    cfg: DeployConfig,
    pipeline: Pipeline,
    backend: Backend,
    stages: dict[int, StageDeployConfig],
    report: Reporter,
) -> Wiring:
    """Connectors and edges of the layered ``stages``."""
    connectors = checked_connectors(cfg, stages, report)
    ios = stage_connectors(pipeline, stages, connectors, report)
    wiring = resolve_edges(cfg, pipeline, backend, ios, connectors, report)
    if backend == "ray":
        check_ray_connectors(wiring, report)
    return wiring


def checked_connectors(
    cfg: DeployConfig, stages: dict[int, StageDeployConfig], report: Reporter
) -> dict[str, ConnectorSpec]:
    """The declared connectors, each class known and its ``extra`` valid for that class: a typo there
    is a config error now, not a stage that fails to start. A connector of an unknown class that no
    stage names is left out with a note: it would have no effect. A transport that is not installed
    here is an error only where a stage names its connector."""
    from vllm_omni_plugin.connectors.base import connector_class

    named = {
        name
        for stage in stages.values()
        for mapping in (stage.input_connectors, stage.output_connectors)
        for name in (mapping or {}).values()
    }
    checked: dict[str, ConnectorSpec] = {}
    for key, spec in cfg.connectors.items():
        if key not in named and spec.name not in CONNECTOR_CLASSES:
            report.note(f"connector {key!r} ({spec.name}) is defined but no stage uses it; ignored")
            continue
        checked[key] = spec
        if spec.name not in CONNECTOR_CLASSES:
            raise report.doc_error(
                f"unknown connector class {spec.name!r} (known: {', '.join(sorted(CONNECTOR_CLASSES))})",
                ("connectors", key, "name"),
            )
        try:
            cls = connector_class(key, spec.name)
        except (ImportError, TypeError) as exc:
            raise report.doc_error(str(exc), ("connectors", key, "name")) from None
        if key in named and (missing := cls.unavailable()):
            raise report.doc_error(missing, ("connectors", key, "name"))
        convert(
            spec.extra,
            cls.Settings,
            source=report.source,
            line_of=report.loaded.locate,
            prefix=("connectors", key, "extra"),
        )
    return checked


def pipeline_edges(pipeline: Pipeline) -> list[tuple[int, int]]:
    return [(src, s.stage_id) for s in pipeline.stages for src in s.input_sources]


def no_edge(pipeline: Pipeline, src: int, dst: int) -> str:
    edges = ", ".join(f"{a} -> {b}" for a, b in pipeline_edges(pipeline))
    return f"pipeline {pipeline.name!r} has no edge {src} -> {dst} (edges: {edges})"


def stage_connectors(
    pipeline: Pipeline,
    stages: dict[int, StageDeployConfig],
    connectors: dict[str, ConnectorSpec],
    report: Reporter,
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
                check_connector_key(pipeline, sid, direction, key, name, connectors, report)
    return ios


def check_connector_key(
    pipeline: Pipeline,
    sid: int,
    direction: str,
    key: str,
    name: str,
    connectors: dict[str, ConnectorSpec],
    report: Reporter,
) -> None:
    field = f"{direction}_connectors"
    final = pipeline.final_stage.stage_id
    match = _CONNECTOR_KEY.match(key)
    want = "from" if direction == "input" else "to"
    if not match or match.group(1) != want:
        router = " or to_stage_router" if direction == "output" else ""
        raise report.error(f"key {key!r}: expected {want}_stage_N{router}", sid, field)
    other = match.group(2)
    if other == ROUTER:
        if direction == "input" or sid != final:
            raise report.error(
                f"{key}: only the final stage ({final}) sends its output to the router", sid, field
            )
    else:
        edge = (int(other), sid) if direction == "input" else (sid, int(other))
        if edge not in pipeline_edges(pipeline):
            raise report.error(f"{key}: {no_edge(pipeline, *edge)}", sid, field)
    if name not in connectors:
        defined = ", ".join(sorted(connectors)) or "none"
        raise report.error(
            f"{key}: connector {name!r} is not defined under connectors: (defined: {defined})", sid, field
        )


def checked_edge_specs(
    cfg: DeployConfig, pipeline: Pipeline, report: Reporter
) -> dict[tuple[int, int | str], EdgeSpec]:
    """The ``edges:`` entries: on a pipeline edge (or the final stage's to the router), and asking only
    for what we implement."""
    final = pipeline.final_stage.stage_id
    for index, e in enumerate(cfg.edges):
        if e.to == ROUTER:
            if e.from_stage != final:
                raise report.doc_error(
                    f"only the final stage ({final}) sends its output to the router",
                    ("edges", index, "from"),
                )
            if e.max_inflight is not None:
                raise report.doc_error(
                    "max_inflight limits requests into a stage, and the router is none; remove it",
                    ("edges", index, "max_inflight"),
                )
        elif (e.from_stage, e.to) not in pipeline_edges(pipeline):
            raise report.doc_error(no_edge(pipeline, e.from_stage, e.to), ("edges", index))
        if e.window_size is not None and e.window_size != WHOLE_OUTPUT:
            raise report.doc_error(
                f"window_size {e.window_size} would hand the output over in chunks, which has no effect "
                f"here: every edge hands each output over whole; set window_size: {WHOLE_OUTPUT} or "
                "remove it",
                ("edges", index, "window_size"),
            )
    return {(e.from_stage, e.to): e for e in cfg.edges}


def resolve_edges(
    cfg: DeployConfig,
    pipeline: Pipeline,
    backend: Backend,
    written: dict[int, StageIO],
    checked: dict[str, ConnectorSpec],
    report: Reporter,
) -> Wiring:
    """One connector per edge: what either end names (both must agree), else shared memory. Returns the
    stages' connectors with both ends filled in, and the connectors with the default one added where an
    edge needed it."""
    specs = checked_edge_specs(cfg, pipeline, report)
    ios = {
        sid: {direction: dict(mapping) for direction, mapping in io.items()} for sid, io in written.items()
    }
    connectors = dict(checked)
    edges: list[ResolvedEdge] = []
    for src, dst in pipeline_edges(pipeline):
        out_name = ios[src]["output"].get(f"to_stage_{dst}")
        in_name = ios[dst]["input"].get(f"from_stage_{src}")
        if out_name and in_name and out_name != in_name:
            raise report.error(
                f"from_stage_{src} uses connector {in_name!r} but stage {src}'s "
                f"output_connectors.to_stage_{dst} says {out_name!r}; both ends must agree",
                dst,
                "input_connectors",
            )
        name = out_name or in_name or default_connector(connectors)
        ios[src]["output"][f"to_stage_{dst}"] = name
        ios[dst]["input"][f"from_stage_{src}"] = name
        spec = specs.get((src, dst))
        edges.append(
            ResolvedEdge(
                from_stage=src,
                to=dst,
                connector=name,
                max_inflight=spec.max_inflight if spec else None,
                same_node_connector=same_node_connector(cfg, backend, spec, connectors, report),
            )
        )
    final = pipeline.final_stage.stage_id
    router = ios[final]["output"].get(f"to_stage_{ROUTER}") or default_connector(connectors)
    ios[final]["output"][f"to_stage_{ROUTER}"] = router
    router_spec = specs.get((final, ROUTER))
    edges.append(
        ResolvedEdge(
            from_stage=final,
            to=ROUTER,
            connector=router,
            same_node_connector=same_node_connector(cfg, backend, router_spec, connectors, report),
        )
    )
    used = {e.connector for e in edges} | {e.same_node_connector for e in edges}
    for key in connectors:
        if key not in used:
            report.note(f"connector {key!r} is defined but not used; ignored")
    connectors = {key: spec for key, spec in connectors.items() if key in used}  # nothing builds the rest
    return Wiring(connectors=connectors, ios=ios, edges=edges)


def same_node_connector(
    cfg: DeployConfig,
    backend: Backend,
    spec: EdgeSpec | None,
    connectors: dict[str, ConnectorSpec],
    report: Reporter,
) -> str | None:
    """An edge's ``same_node_connector``: defined under ``connectors:``, and only where it can matter."""
    if spec is None or spec.same_node_connector is None:
        return None
    index = cfg.edges.index(spec)
    name = spec.same_node_connector
    if name not in connectors:
        defined = ", ".join(sorted(connectors)) or "none"
        raise report.doc_error(
            f"connector {name!r} is not defined under connectors: (defined: {defined})",
            ("edges", index, "same_node_connector"),
        )
    if backend != "ray":
        report.note(
            f"edges[{index}].same_node_connector applies to backend ray only; ignored (every replica runs "
            "on this host)"
        )
        return None
    return name


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
    stage_id: int, connectors: dict[str, ConnectorSpec], io: StageIO, report: Reporter
) -> None:
    """A headless stage's connectors must cross processes, and usually hosts."""
    for direction in ("input", "output"):
        for key, name in io[direction].items():
            cls = connectors[name].name
            if cls == "InProcessConnector":
                raise report.error(
                    f"{key}: connector {name!r} is an InProcessConnector, which cannot reach a "
                    "headless worker; use NixlConnector or MooncakeTransferEngineConnector",
                    stage_id,
                    f"{direction}_connectors",
                )
            if cls == "SharedMemoryConnector":
                report.note(
                    f"stage {stage_id} is headless and {key} uses the SharedMemoryConnector {name!r}: that "
                    "works only when the worker runs on the head's host; use NixlConnector or "
                    "MooncakeTransferEngineConnector across hosts"
                )


def check_ray_connectors(wiring: Wiring, report: Reporter) -> None:
    """Backend ray: every replica is an actor in a process of its own, on a node Ray picks."""
    connectors = wiring.connectors
    for edge in wiring.edges:
        where = f"edge {edge.from_stage} -> {edge.to}"
        cls = connectors[edge.connector].name
        if cls == "InProcessConnector" or (
            edge.same_node_connector and connectors[edge.same_node_connector].name == "InProcessConnector"
        ):
            raise report.doc_error(
                f"{where} uses an InProcessConnector, which cannot reach a Ray actor's process; use "
                "NixlConnector (and SharedMemoryConnector as its same_node_connector)",
                ("connectors",),
            )
        if cls == "SharedMemoryConnector":
            report.note(
                f"{where} uses the SharedMemoryConnector {edge.connector!r} with backend ray: a replica Ray "
                "places on another node than the other end fails to start; use NixlConnector with "
                "same_node_connector for shared memory on one node"
            )
