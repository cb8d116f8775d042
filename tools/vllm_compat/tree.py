"""One vLLM release's Python sources, resolved statically (nothing of vLLM is imported): modules and what
they bind, re-exports (also through ``*`` and ``TYPE_CHECKING``), module ``__getattr__``s, classes with
their bases and members, dataclass and msgspec fields."""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_compat import CheckError
from vllm_compat.signatures import Signature


def is_source(name: str) -> bool:
    """A file of a release that the checker reads (a wheel's or a cache zip's member name)."""
    return name.startswith("vllm/") and name.endswith(".py")


@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    bindings: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    """name -> [(kind, payload)]: ("def", node), ("value", node), ("annotation", node) (no value),
    ("from", (module, attr)), ("module", m)."""
    stars: list[str] = field(default_factory=list)

    def absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.name.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, module] if module else base)


_BINDING_ORDER = {"def": 0, "from": 1, "module": 1, "value": 2, "annotation": 3}


def _index_bindings(module: Module) -> None:
    def bind(name: str, kind: str, payload: Any) -> None:
        module.bindings.setdefault(name, []).append((kind, payload))

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                bind(stmt.name, "def", stmt)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for node in ast.walk(target):
                        if isinstance(node, ast.Name):
                            bind(node.id, "value", stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.value is not None:
                    bind(stmt.target.id, "value", stmt.value)
                else:  # `current_platform: Platform` (provided by a module __getattr__)
                    bind(stmt.target.id, "annotation", stmt.annotation)
            elif isinstance(stmt, ast.ImportFrom):
                source = module.absolute(stmt.module, stmt.level)
                for alias in stmt.names:
                    if alias.name == "*":
                        module.stars.append(source)
                    else:
                        bind(alias.asname or alias.name, "from", (source, alias.name))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        bind(alias.asname, "module", alias.name)
                    else:
                        bind(alias.name.split(".")[0], "module", alias.name.split(".")[0])
            elif isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
                visit(stmt.orelse)
                visit(stmt.finalbody)
            elif isinstance(stmt, ast.With):
                visit(stmt.body)

    visit(module.tree.body)
    for entries in module.bindings.values():
        # definitions first, the last one first (an implementation follows its @overload stubs)
        entries.reverse()
        entries.sort(key=lambda entry: (_BINDING_ORDER[entry[0]], _is_overload(entry[1])))


def _is_overload(payload: Any) -> bool:
    decorators = getattr(payload, "decorator_list", [])
    return any(ast.unparse(d).split(".")[-1] == "overload" for d in decorators)


def _dynamic_names(module: Module) -> set[str]:
    """Names a module-level ``__getattr__`` provides: strings it compares with, keys of dicts it reads."""
    getattr_defs = [p for kind, p in module.bindings.get("__getattr__", []) if kind == "def"]
    names: set[str] = set()
    for function in getattr_defs:
        used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        names |= {
            n.value for n in ast.walk(function) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        for name in used:
            for kind, payload in module.bindings.get(name, []):
                if kind == "value" and isinstance(payload, ast.Dict):
                    names |= {k.value for k in payload.keys if isinstance(k, ast.Constant)}
    return names


@dataclass(frozen=True)
class Found:
    """Where a name is defined: a class or function (``node``), another value, a module, or outside vLLM."""

    module: str
    kind: str
    """"class", "function", "value", "instance" (annotated only), "module", "dynamic" (from a module
    ``__getattr__``) or "external" (outside vLLM)."""
    node: Any = None
    name: str = ""


class SourceTree:
    """One vLLM release's Python sources, read without importing anything."""

    def __init__(self, label: str, names: Iterable[str], read: Callable[[str], bytes]) -> None:
        self.label = label
        self.names = set(names)
        self._dirs = {name.rsplit("/", 1)[0] for name in self.names}
        self._dirs |= {
            "/".join(d.split("/")[:i]) for d in list(self._dirs) for i in range(1, d.count("/") + 1)
        }
        self._read = read
        self._modules: dict[str, Module | None] = {}

    @classmethod
    def from_zip(cls, path: Path, label: str) -> SourceTree:
        try:
            archive = zipfile.ZipFile(path)
            names = [name for name in archive.namelist() if is_source(name)]
        except (OSError, zipfile.BadZipFile) as exc:
            raise CheckError(f"cached sources {path} are unreadable ({exc}); delete the file") from None
        return cls(label, names, archive.read)

    @classmethod
    def from_dir(cls, path: Path) -> SourceTree:
        """A directory holding the ``vllm`` package (a checkout, a site-packages) or the package itself."""
        root = path / "vllm" if (path / "vllm" / "__init__.py").exists() else path
        if not (root / "__init__.py").exists() or root.name != "vllm":
            raise CheckError(f"{path}: no vllm package there (expected {path}/vllm/__init__.py)")
        names = [f"vllm/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py")]
        tree = cls("", names, lambda name: (root.parent / name).read_bytes())
        tree.label = f"{path} ({tree.version() or 'unknown version'})"
        return tree

    def version(self) -> str | None:
        for name in ("vllm._version", "vllm.version"):
            module = self.module(name)
            for entry in module.bindings.get("__version__", []) if module else []:
                if entry[0] == "value" and isinstance(entry[1], ast.Constant):
                    return str(entry[1].value)
        return None

    def module(self, name: str) -> Module | None:
        if name in self._modules:
            return self._modules[name]
        path = name.replace(".", "/")
        module: Module | None = None
        for candidate, is_package in ((f"{path}.py", False), (f"{path}/__init__.py", True)):
            if candidate in self.names:
                try:
                    tree = ast.parse(self._read(candidate), filename=candidate)
                except SyntaxError:
                    tree = ast.Module(body=[], type_ignores=[])
                module = Module(name, is_package, tree)
                _index_bindings(module)
                break
        else:
            if path in self._dirs and name.startswith("vllm"):  # a namespace package
                module = Module(name, True, ast.Module(body=[], type_ignores=[]))
        self._modules[name] = module
        return module

    # --- names ---

    def lookup(self, module_name: str, attr: str, _depth: int = 0) -> Found | None:
        """What ``from module_name import attr`` gives, following re-exports; None when it would fail."""
        if _depth > 30:
            return None
        if not module_name.startswith("vllm"):
            return Found(module_name, "external", name=attr)
        module = self.module(module_name)
        if module is None:
            return None
        for kind, payload in module.bindings.get(attr, []):
            found = self._follow(module, attr, kind, payload, _depth)
            if found is not None:
                return found
        if self.module(f"{module_name}.{attr}") is not None:
            return Found(f"{module_name}.{attr}", "module", name=attr)
        for star in module.stars:
            found = self.lookup(star, attr, _depth + 1)
            if found is not None and found.kind != "external":
                return found
        if attr in _dynamic_names(module):
            return Found(module_name, "dynamic", name=attr)
        return None

    def _follow(self, module: Module, attr: str, kind: str, payload: Any, depth: int) -> Found | None:
        if kind == "def":
            return Found(
                module.name, "class" if isinstance(payload, ast.ClassDef) else "function", payload, attr
            )
        if kind == "value":
            return Found(module.name, "value", payload, attr)
        if kind == "annotation":
            return Found(module.name, "instance", payload, attr)
        if kind == "module":
            if not payload.startswith("vllm"):
                return Found(payload, "external", name=attr)
            return Found(payload, "module", name=attr) if self.module(payload) else None
        source, name = payload
        found = self.lookup(source, name, depth + 1)
        if found is None and self.module(f"{source}.{name}") is not None:
            return Found(f"{source}.{name}", "module", name=name)
        return found

    def resolve_location(self, location: str) -> Found | None:
        """A ``module:attribute`` location of ``compat.LOCATIONS``."""
        module_name, _, attr = location.partition(":")
        return self.lookup(module_name, attr)

    def resolve_expr(self, module_name: str, expr: ast.expr) -> Found | None:
        """A name or dotted attribute as written in ``module_name`` (a class's base, an instance's class)."""
        if isinstance(expr, ast.Subscript):  # Generic[T], SomeBase[Config]
            return self.resolve_expr(module_name, expr.value)
        if isinstance(expr, ast.Name):
            return self.lookup(module_name, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(module_name, expr.value)
            if owner is None:
                return None
            if owner.kind == "module":
                return self.lookup(owner.module, expr.attr)
            if owner.kind == "class":
                member = self.member(owner, expr.attr)
                return member[1] if member else None
            return Found(owner.module, "external", name=expr.attr)
        return None

    # --- classes ---

    def class_of(self, found: Found) -> Found | None:
        """The class itself, or the class of a module-level instance (``ModelRegistry = _Registry(...)``)."""
        if found.kind == "class":
            return found
        if found.kind == "instance":
            target = self.resolve_expr(found.module, found.node)
            return target if target is not None and target.kind == "class" else None
        if found.kind == "value" and isinstance(found.node, ast.Call):
            target = self.resolve_expr(found.module, found.node.func)
            if target is not None and target.kind == "class":
                return target
        return None

    def mro(self, cls: Found) -> tuple[list[Found], list[str]]:
        """vLLM classes from ``cls`` up (depth first, left to right) and the names of bases outside vLLM."""
        out: list[Found] = []
        external: list[str] = []
        seen: set[tuple[str, str]] = set()

        def walk(current: Found) -> None:
            key = (current.module, current.name)
            if key in seen or len(seen) > 200:
                return
            seen.add(key)
            out.append(current)
            for base in current.node.bases:
                found = self.resolve_expr(current.module, base)
                if found is not None and found.kind == "class":
                    walk(found)
                elif found is not None:
                    external.append(found.name or ast.unparse(base))
                else:
                    external.append(ast.unparse(base))

        walk(cls)
        return out, external

    def member(self, cls: Found, name: str) -> tuple[Found, Found] | None:
        """(owning class, member) for ``name`` looked up on ``cls`` as Python would (vLLM classes only)."""
        for owner in self.mro(cls)[0]:
            for stmt in owner.node.body:
                if (
                    isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and stmt.name == name
                ):
                    kind = "class" if isinstance(stmt, ast.ClassDef) else "function"
                    return owner, Found(owner.module, kind, stmt, name)
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in stmt.targets
                ):
                    return owner, Found(owner.module, "value", stmt.value, name)
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name
                ):
                    return owner, Found(owner.module, "value", stmt.value, name)
        return None

    def has_attribute(self, cls: Found, name: str) -> bool:
        """Whether instances of ``cls`` have ``name``: a member (method, property, class attribute, field)
        or an attribute that a method of ``cls`` or of its vLLM bases assigns on ``self`` (most of vLLM's
        state is set in ``__init__``, invisible to :meth:`member`)."""
        if self.member(cls, name) is not None:
            return True
        for owner in self.mro(cls)[0]:
            for stmt in owner.node.body:
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) or not stmt.args.args:
                    continue
                me = stmt.args.args[0].arg
                for node in ast.walk(stmt):
                    if (
                        isinstance(node, ast.Attribute)
                        and isinstance(node.ctx, ast.Store)
                        and node.attr == name
                        and isinstance(node.value, ast.Name)
                        and node.value.id == me
                    ):
                        return True
        return False

    def files_containing(self, text: str) -> list[str]:
        """The source files whose text contains ``text`` (to find where a release reads a setting)."""
        needle = text.encode()
        return sorted(name for name in self.names if needle in self._read(name))

    def fields(self, cls: Found) -> dict[str, bool] | None:
        """Dataclass or msgspec fields (name -> has a default), base classes first; None for other classes."""
        classes, external = self.mro(cls)
        is_record = any(name in ("Struct", "msgspec.Struct", "NamedTuple") for name in external) or any(
            any("dataclass" in ast.unparse(d) for d in c.node.decorator_list) for c in classes
        )
        if not is_record:
            return None
        out: dict[str, bool] = {}
        for owner in reversed(classes):
            for stmt in owner.node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if "ClassVar" in ast.unparse(stmt.annotation):
                        continue
                    out[stmt.target.id] = stmt.value is not None
        return out

    def call_signature(self, found: Found) -> Signature | None:
        """How ``found`` is called: a function's parameters, a class's ``__init__`` or fields."""
        if found.kind == "function":
            return Signature.of(found.node, bound=False)
        if found.kind != "class":
            return None
        init = self.member(found, "__init__")
        if init is not None and init[1].kind == "function":
            return Signature.of(init[1].node, bound=True)
        fields = self.fields(found)
        if fields is None:
            return None
        kw_only = any(
            kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value
            for c in self.mro(found)[0]
            for kw in c.node.keywords
        )
        names = tuple(fields)
        required = sum(1 for name in names if not fields[name]) if not kw_only else 0
        if kw_only:
            return Signature((), 0, names, frozenset(n for n in names if not fields[n]), False, False)
        return Signature(names, required, (), frozenset(), False, False)
