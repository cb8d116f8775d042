"""The shape of the repository: self-contained (nothing points outside it), layered (no import cycle
between the subpackages of ``vllm_omni_plugin``, each model family a unit of its own; no generic module
imports a family), the wheel free of test-only code (that is the test kit's, ``testkit/``), and described
(``docs/architecture.md`` names every subpackage)."""

from __future__ import annotations

import ast
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path

import setuptools

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
    """Every package below ``vllm_omni_plugin``, as a path (``stage/placement``)."""
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


FAMILIES = PACKAGE / "families"
FAMILY_FILES = ("pipeline.py", "processors.py", "runner.py", "settings.py")
"""What every model family folder holds (its ``Pipeline``, stage-input processors, DiT runner and request
type, request settings type)."""
ABOVE_FAMILIES = ("tiny_models",)
"""The one layer that may import families: each family's tiny model (its reference is in the test kit,
outside the package)."""


def unit_of(parts: tuple[str, ...] | list[str]) -> str:
    """The unit a module of ``vllm_omni_plugin`` belongs to (its parts below the package): its top-level
    subpackage or module, except that each model family is a unit of its own (``families.bagel``)."""
    if parts[0] == "families" and len(parts) > 1 and parts[1] != "__init__":
        return f"families.{parts[1]}"
    return parts[0]


def import_graph() -> dict[str, set[str]]:
    """Unit of ``vllm_omni_plugin`` (:func:`unit_of`) -> the units it imports, counting imports inside
    functions too (a deferred import is still a dependency)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "vllm_omni_plugin":
                targets = [f"vllm_omni_plugin.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
                if node.module == "vllm_omni_plugin.families":
                    targets = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in targets:
                parts = name.split(".")
                if parts[0] == "vllm_omni_plugin" and len(parts) > 1:
                    target = unit_of(parts[1:])
                    if target != unit:
                        graph[unit].add(target)
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
    assert {"families.glm_image", "families.bagel", "families.diffusers"} <= set(graph)


def test_no_generic_module_imports_a_family() -> None:
    """Families sit above config, diffusion and stage: generic code names them by dotted path (strings)
    only, never by an import (inside functions neither); only test support imports them."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "families" or parts[0] in ABOVE_FAMILIES:
            continue
        hits = [m for m in imported_modules(path) if m.startswith("vllm_omni_plugin.families")]
        offenders += [f"{path.relative_to(PACKAGE)} imports {m}" for m in sorted(hits)]
    assert offenders == []
    graph = import_graph()
    assert [u for u in graph if not u.startswith("families") and u not in ABOVE_FAMILIES
            and any(t.startswith("families") for t in graph[u])] == []  # fmt: skip


def test_every_family_folder_holds_its_files() -> None:
    folders = [p for p in FAMILIES.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert {p.name for p in folders} >= {"glm_image", "bagel", "diffusers"}
    missing = [f"{p.name}/{name}" for p in folders for name in FAMILY_FILES if not (p / name).is_file()]
    assert missing == []


PLACEMENT = PACKAGE / "stage" / "placement"
PLACEMENT_FOLDERS = ("local", "headless", "ray")
"""The placement implementations, each in a folder of its own below ``stage/placement/`` (Dynamo's lives
with the rest of Dynamo, in ``dynamo/``: :data:`DYNAMO_PLACEMENT`)."""
DYNAMO = PACKAGE / "dynamo"
DYNAMO_PLACEMENT = ("placement.py", "stage_worker.py", "stage_wire.py")
"""The Dynamo placement: the router's ``DynamoPlacement``, the stage worker and what they say."""


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
    """The remote placements share only ``placement/wire.py``; the local placement knows no remote one; the
    crossing is the headless stage worker, which runs its own stage on this host's ``LocalPlacement``."""
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


def test_the_dynamo_placement_is_a_remote_placement_like_the_others() -> None:
    """The Dynamo placement (in ``dynamo/``) takes from ``stage/placement/`` only the interface and the
    shared ``wire.py``, its stage worker aside, which runs its stage on this host's ``LocalPlacement``;
    nothing below ``stage/`` imports ``dynamo/`` (the router builds its placement and hands it in)."""
    assert all((DYNAMO / name).is_file() for name in DYNAMO_PLACEMENT)
    shared = {"vllm_omni_plugin.stage.placement.base", "vllm_omni_plugin.stage.placement.wire"}
    offenders = []
    for name in DYNAMO_PLACEMENT:
        allowed = shared | (
            {"vllm_omni_plugin.stage.placement.local"} if name == "stage_worker.py" else set()
        )
        offenders += [
            f"dynamo/{name} imports {m}"
            for m in sorted(imported_modules(DYNAMO / name))
            if m.startswith("vllm_omni_plugin.stage.placement")
            and not any(m == a or m.startswith(a + ".") for a in allowed)
        ]
    for path in sorted((PACKAGE / "stage").rglob("*.py")):
        hits = [m for m in imported_modules(path) if m.startswith("vllm_omni_plugin.dynamo")]
        offenders += [f"{path.relative_to(PACKAGE)} imports {m}" for m in sorted(hits)]
    assert offenders == []


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
    """Every folder of the package (each family's too) is named, as ``name/`` or ``parent/name/``."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert subpackages(), "no subpackages found"
    folders = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    assert set(subpackages()) <= folders
    missing = [name for name in sorted(folders) if f"{name}/" not in text]
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


def module_import_graph() -> dict[str, set[str]]:
    """Module of ``vllm_omni_plugin`` -> the modules of ours it imports when it is imported: top-level
    statements only (not inside functions, not under ``if TYPE_CHECKING``), which is what an import
    circle breaks on."""
    modules = {
        ".".join(("vllm_omni_plugin", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        ): path
        for path in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                    ).rstrip(".")
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles_in(graph: dict[str, set[str]]) -> list[str]:
    """Every import circle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return circles


def test_no_import_circle_between_modules() -> None:
    """Not between subpackages (above), and not between any two modules either."""
    graph = module_import_graph()
    assert (
        len(graph) > 100
        and "vllm_omni_plugin.stage.core_types" in graph["vllm_omni_plugin.stage.orchestrator"]
    )
    assert circles_in(graph) == []
    assert circles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]


def test_no_family_imports_another() -> None:
    """Each model family is a unit of its own: what two share lives below them (config, diffusion,
    stage, models), never in one of them."""
    graph = import_graph()
    crossings = sorted(
        f"{unit} imports {target}"
        for unit, targets in graph.items()
        if unit.startswith("families.")
        for target in targets
        if target.startswith("families.")
    )
    assert crossings == []


FRONT_ENDS = ("entrypoints", "dynamo")
"""The layers that read a transport (HTTP, chat, Dynamo) and the offline API: they parse, and hand parsed
requests to the runtime."""
RUNNER_MODULES = (
    "vllm_omni_plugin.diffusion.runner",
    "vllm_omni_plugin.diffusion.engine",
    "vllm_omni_plugin.diffusion.diffusers_registry",
    "vllm_omni_plugin.ar_worker",
)
"""Runners and what loads them (besides each family's ``runner.py``, which no generic module imports)."""


def runner_imports(path: Path) -> list[str]:
    return sorted(
        m
        for m in imported_modules(path)
        if any(m == r or m.startswith(r + ".") for r in RUNNER_MODULES)
        or (m.startswith("vllm_omni_plugin.families.") and m.split(".")[3:4] == ["runner"])
    )


def test_the_front_ends_import_no_runner() -> None:
    """The HTTP layer (and Dynamo's, which runs the same calls) knows no runner: what a model makes and
    takes comes to it from the runtime's input processor, read once at start-up."""
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {m}"
        for folder in FRONT_ENDS
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for m in runner_imports(path)
    ]
    assert offenders == []
    assert runner_imports(PACKAGE / "stage" / "input_processor.py")  # the scan sees one where it is


DEFAULT_NAMES = frozenset(
    {
        "DiffusionDefaults",
        "ModelDefaults",
        "diffusion_defaults",
        "request_defaults",
        "model_defaults",
        "with_defaults",
    }
)
"""The request defaults and their readers: a pipeline's declared ones (``Pipeline.diffusion_defaults``), the
deploy config's (``ResolvedStage.request_defaults``), the model's own (``DiffusionRunner.model_defaults``)
and a family's settings' (``RequestSettings.with_defaults``)."""
DEFAULTS_DECLARED = frozenset(
    {
        "config/__init__.py",
        "config/pipeline.py",
        "config/diffusion_stage.py",
        "config/resolve.py",
        "config/resolved.py",
        "config/settings.py",
        "diffusion/runner.py",
        "diffusion/diffusers_runner.py",
    }
)
"""Where the defaults are declared, merged from the deploy config and read from a model's configs (the
runner interface and the generic diffusers runner; each family's pipeline, runner and settings declare and
read its own)."""
FILLS_DEFAULTS = "stage/input_processor.py"
"""The one module that applies them to requests."""


def default_names(path: Path) -> set[str]:
    """The names of :data:`DEFAULT_NAMES` that ``path``'s code uses (names, attributes, definitions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
    return found & DEFAULT_NAMES


def test_nothing_but_the_input_processor_fills_request_defaults() -> None:
    """Request defaults are read where they are declared (config, the runner interface, each family's
    pipeline, runner and settings) and applied in one place, the input processor: no front end, stage
    processor, orchestrator, placement, engine or runner reaches for them."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        parts = path.relative_to(PACKAGE).parts
        declared = name in DEFAULTS_DECLARED or (
            parts[0] == "families" and path.name in ("pipeline.py", "runner.py", "settings.py")
        )
        if declared or name == FILLS_DEFAULTS:
            continue
        offenders += [f"{name} uses {n}" for n in sorted(default_names(path))]
    assert offenders == []
    assert default_names(PACKAGE / FILLS_DEFAULTS) >= {"model_defaults", "request_defaults", "with_defaults"}


TEST_KIT = "vllm_omni_testkit"
TEST_ONLY_NAMES = ("testing", "harness", "reference", "holds")
"""Names of the test support that left the package for the test kit: none may come back under src/."""
HOLD_PROTOCOL = ("VLLM_OMNI_HOLD_DIR", "VLLM_OMNI_FAULT_SEED", '".armed"', '".reached"')
"""What only an implementation of the hold points and the fault hook spells (the product keeps the seam,
``test_hooks.py``, which names none of them)."""


def test_the_wheel_holds_no_test_only_code() -> None:
    """Nothing under src/ imports the test kit or carries test support: no ``testing`` folder, no hold
    point implementation (only the seam, whose calls go nowhere unless a test names the kit's module);
    ``tiny_models`` is the one test-facing part that ships, a builder users run for CPU trials."""
    sources = sorted((REPO / "src").rglob("*.py"))
    offenders = []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] == TEST_KIT
            ]
        offenders += [f"{path.relative_to(REPO)} spells {w!r}" for w in HOLD_PROTOCOL if w in text]
        offenders += [
            f"{path.relative_to(REPO)} is test support"
            for part in path.relative_to(REPO / "src").with_suffix("").parts
            if part in TEST_ONLY_NAMES
        ]
    assert offenders == []
    assert (PACKAGE / "test_hooks.py").is_file() and (PACKAGE / "tiny_models" / "__main__.py").is_file()
    kit = REPO / "testkit" / "src" / TEST_KIT
    assert any(w in (kit / "holds.py").read_text(encoding="utf-8") for w in HOLD_PROTOCOL)  # the scan's words
    # What the wheel's package search (pyproject.toml) finds: the plugin's packages and none of the kit's.
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(where=str(REPO / find["where"][0]))
    assert "vllm_omni_plugin.tiny_models" in packages
    assert [p for p in packages if p.split(".")[0] not in ("vllm_omni_plugin", "vllm_omni")] == []
    assert [p for p in packages if set(p.split(".")) & set(TEST_ONLY_NAMES)] == []
    kit_project = tomllib.loads((REPO / "testkit" / "pyproject.toml").read_text())["project"]
    assert (
        kit_project["name"] == "vllm-omni-plugin-testkit"
        and "vllm-omni-plugin" in kit_project["dependencies"]
    )


DIFFUSION = PACKAGE / "diffusion"


def module_of(path: Path, package: Path = PACKAGE) -> str:
    """The dotted name of a module file of ``vllm_omni_plugin`` (a package by its ``__init__.py``)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def imports_in(path: Path, package: Path = PACKAGE) -> list[tuple[str, str | None, str]]:
    """Every import of ``path``, module level and inside functions (``if TYPE_CHECKING`` too), as ``(module,
    None, bound)`` for ``import module`` and ``(module, name, bound)`` for ``from module import name``
    (relative ones resolved), ``bound`` the local name it binds."""
    name = module_of(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, a.asname or a.name.partition(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).rstrip(".")
            found += [(base, a.name, a.asname or a.name) for a in node.names]
    return found


def diffusion_import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module of ``diffusion/`` -> the modules of ``diffusion/`` it imports, wherever the import stands
    (a deferred import inside a function still ties the two modules together)."""
    folder = package / "diffusion"
    modules = {module_of(path, package) for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for path in folder.glob("*.py"):
        name = module_of(path, package)
        for module, imported, _ in imports_in(path, package):
            target = f"{module}.{imported}" if f"{module}.{imported}" in modules else module
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def private_imports(folder: Path, package: Path = PACKAGE) -> list[str]:
    """The private names (``_x``) that the modules of ``folder`` take from another module of the package:
    by ``from module import _x``, or as ``module._x`` of a module they imported."""
    modules = {module_of(path, package) for path in package.rglob("*.py")}
    found: set[str] = set()
    for path in sorted(folder.glob("*.py")):
        name = module_of(path, package)
        aliases: dict[str, str] = {}  # a local name -> the module of ours it stands for
        for module, imported, bound in imports_in(path, package):
            whole = module if imported is None else f"{module}.{imported}"
            if whole in modules and (imported is not None or bound != module.partition(".")[0]):
                aliases[bound] = whole
            if module in modules and module != name and imported is not None and _private(imported):
                found.add(f"{name} imports {module}.{imported}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = ast.unparse(node.value)  # a dotted module path, or a name bound to a module
                module = owner if owner in modules else aliases.get(owner)
                if module is not None and module != name:
                    found.add(f"{name} uses {module}.{node.attr}")
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_diffusion_modules_form_no_import_circle_and_take_no_private_name() -> None:
    """The diffusion layer's modules import each other one way only (counting imports inside functions,
    which a top-level circle check misses: the denoiser group and sequence parallelism once imported each
    other), and each keeps its private names to itself: what another module needs is public."""
    graph = diffusion_import_graph()
    assert "vllm_omni_plugin.diffusion.peer_group" in graph["vllm_omni_plugin.diffusion.sequence_parallel"]
    assert circles_in(graph) == []
    assert private_imports(DIFFUSION) == []
