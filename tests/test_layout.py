"""The shape of the repository: self-contained (nothing points outside it), layered (no import cycle
between the subpackages of ``vllm_omni_plugin``), and described (``docs/architecture.md`` names every
subpackage)."""

from __future__ import annotations

import ast
import subprocess
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "src" / "vllm_omni_plugin"
ARCHITECTURE = REPO / "docs" / "architecture.md"
OUTSIDE = ("../" + "shared", "shared/" + "seeds")
"""Paths of the machine this project was started on, which a clone does not have (spelled in two
parts so that this file does not match itself)."""


def project_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


def subpackages() -> list[str]:
    """Every package below ``vllm_omni_plugin``, as a path (``stage/processors``)."""
    return sorted(
        str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
    )


def test_nothing_points_outside_the_repository() -> None:
    offenders = []
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{path.relative_to(REPO)}: {word}" for word in OUTSIDE if word in text]
    assert offenders == []


def import_graph() -> dict[str, set[str]]:
    """Top-level unit of ``vllm_omni_plugin`` (a subpackage or a module) -> the units it imports,
    counting imports inside functions too (a deferred import is still a dependency)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        unit = path.relative_to(PACKAGE).with_suffix("").parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "vllm_omni_plugin":
                targets = [f"vllm_omni_plugin.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            for name in targets:
                parts = name.split(".")
                if parts[0] == "vllm_omni_plugin" and len(parts) > 1 and parts[1] != unit:
                    graph[unit].add(parts[1])
    return graph


def test_no_import_cycle_between_subpackages() -> None:
    graph = import_graph()
    assert {"config", "stage", "entrypoints"} <= set(graph)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo.extend(graph.get(unit, ()))
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert cycles == []
    assert "entrypoints" not in graph["stage"]  # the stage layer never reaches up to the entry points


PLACEMENT = PACKAGE / "stage" / "placement"
PLACEMENT_FOLDERS = ("local", "headless", "ray")
"""The placement implementations, each in a folder of its own below ``stage/placement/``."""


def imported_modules(path: Path) -> set[str]:
    """The modules of ``vllm_omni_plugin`` that ``path`` imports (inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("vllm_omni_plugin.")}


def test_placement_folders_do_not_import_each_other() -> None:
    """Ray and headless share only ``placement/wire.py``; the local placement knows no remote one; the one
    crossing is the headless worker, which runs its own stage on this host's ``LocalPlacement``."""
    allowed = {("headless", "local"): {"worker.py"}}
    assert {p.name for p in PLACEMENT.iterdir() if (p / "__init__.py").is_file()} == set(PLACEMENT_FOLDERS)
    offenders = []
    for folder in PLACEMENT_FOLDERS:
        for path in (PLACEMENT / folder).rglob("*.py"):
            for other in PLACEMENT_FOLDERS:
                prefix = f"vllm_omni_plugin.stage.placement.{other}"
                if other == folder or path.name in allowed.get((folder, other), set()):
                    continue
                hits = [m for m in imported_modules(path) if m == prefix or m.startswith(prefix + ".")]
                offenders += [f"{path.relative_to(PACKAGE)} imports {m}" for m in hits]
    assert offenders == []
    ray_head = imported_modules(PLACEMENT / "ray" / "head.py") | imported_modules(
        PLACEMENT / "ray" / "actor.py"
    )
    assert "vllm_omni_plugin.stage.placement.wire" in ray_head  # the shared replies, not the head's module


def test_the_runtime_knows_only_the_placement_interface() -> None:
    """``AsyncOmni`` places stages through ``StagePlacement`` (chosen by the factory), no kind of its own."""
    imported = imported_modules(PACKAGE / "stage" / "async_omni.py")
    assert "vllm_omni_plugin.stage.placement.base" in imported
    kinds = [
        m
        for m in imported
        for f in PLACEMENT_FOLDERS
        if m.startswith(f"vllm_omni_plugin.stage.placement.{f}")
    ]
    assert kinds == []
    assert not [m for m in imported if m.startswith("vllm_omni_plugin.entrypoints")]


def test_architecture_document_names_every_subpackage() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert subpackages(), "no subpackages found"
    missing = [name for name in subpackages() if f"{name}/" not in text]
    assert missing == []
    for readme in ("README.md", "CONTRIBUTING.md"):
        assert "docs/architecture.md" in (REPO / readme).read_text(encoding="utf-8")


def test_no_type_ignore_comments() -> None:
    """No type checker runs over this project, so a suppression comment for one would be honoured by nobody."""
    marker = "type: " + "ignore"
    offenders = [
        str(path.relative_to(REPO))
        for path in project_files()
        if path.suffix == ".py" and marker in path.read_text()
    ]
    assert offenders == []
