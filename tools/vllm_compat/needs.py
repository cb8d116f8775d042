"""The kinds of thing the plugin needs from vLLM (a ``compat`` name, an import, an overridden method, an
``EngineArgs`` field, a call, an attribute, the ``--omni`` hook) and how each is checked against one
release's sources, as one table cell."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from vllm_compat.signatures import CallShape, Signature
from vllm_compat.tree import Found, SourceTree

OMNI_HOOK = ("vllm.entrypoints.cli.main", "vllm_omni.entrypoints.cli.main", "main")
"""Stock vLLM's ``--omni`` hook: the module that imports our forwarding shim, and what it imports."""

# A reference to something of vLLM's: ("compat", NAME) or ("vllm", MODULE, ATTR).
Ref = tuple[str, ...]


@dataclass
class Cell:
    status: str  # "ok" | "missing" | "changed" | "unchecked"
    text: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("missing", "changed")


def _ok(text: str = "ok") -> Cell:
    return Cell("ok", text)


def _missing(detail: str) -> Cell:
    return Cell("missing", "MISSING", detail)


def _changed(detail: str) -> Cell:
    return Cell("changed", "CHANGED", detail)


class Checker:
    """Checks every need against one source tree (caches the compat resolutions)."""

    def __init__(self, tree: SourceTree, locations: dict[str, tuple[str, ...]]) -> None:
        self.tree = tree
        self.locations = locations
        self._compat: dict[str, tuple[str, Found] | None] = {}

    def compat(self, name: str) -> tuple[str, Found] | None:
        if name not in self._compat:
            self._compat[name] = None
            for location in self.locations.get(name, ()):
                found = self.tree.resolve_location(location)
                if found is not None:
                    self._compat[name] = (location, found)
                    break
        return self._compat[name]

    def target(self, ref: Ref) -> Found | None:
        if ref[0] == "compat":
            hit = self.compat(ref[1])
            return hit[1] if hit else None
        return self.tree.lookup(ref[1], ref[2])


def ref_text(ref: Ref) -> str:
    return ref[1] if ref[0] == "compat" else ref[2]


@dataclass
class Need:
    kind: str
    label: str
    where: str

    def check(self, checker: Checker) -> Cell:
        raise NotImplementedError


@dataclass
class CompatNeed(Need):
    name: str = ""

    def check(self, checker: Checker) -> Cell:
        hit = checker.compat(self.name)
        if hit is None:
            return _missing(f"none of {', '.join(checker.locations[self.name])}")
        index = checker.locations[self.name].index(hit[0]) + 1
        return _ok(f"{index}:{'.'.join(hit[0].partition(':')[0].split('.')[-2:])}")


@dataclass
class ImportNeed(Need):
    module: str = ""
    attr: str = ""

    def check(self, checker: Checker) -> Cell:
        if checker.tree.module(self.module) is None:
            return _missing(f"no module {self.module}")
        found = checker.tree.lookup(self.module, self.attr)
        if found is None:
            return _missing(f"{self.module} has no {self.attr}")
        return _ok()


@dataclass
class MethodNeed(Need):
    """A method of a vLLM base that our class overrides (``ours``) and/or calls through ``super()``."""

    bases: tuple[Ref, ...] = ()
    method: str = ""
    ours: Signature | None = None
    super_calls: tuple[CallShape, ...] = ()
    outside_bases: bool = False
    """The class also has bases from outside vLLM (``nn.Module``), which may provide the method."""
    called_by_us: str = ""
    """Another method of ours that calls this one (``init_device``): a release without it still works."""

    def base_method(self, checker: Checker) -> tuple[Found, Found] | None | str:
        for ref in self.bases:
            base = checker.target(ref)
            if base is None:
                return f"base {ref_text(ref)} is missing"
            cls = checker.tree.class_of(base)
            if cls is None:
                continue
            hit = checker.tree.member(cls, self.method)
            if hit is not None:
                return hit
        return None

    def check(self, checker: Checker) -> Cell:
        hit = self.base_method(checker)
        if isinstance(hit, str):
            return Cell("unchecked", "-", hit)
        if hit is None and self.outside_bases and self.super_calls:
            return Cell("unchecked", "ok?", f"{self.method} comes from a base outside vLLM")
        if hit is None and self.called_by_us and not self.super_calls:
            return Cell("ok", "ours", f"not in vLLM; our {self.called_by_us} calls it")
        if hit is None:
            return _missing(
                f"no {self.method} in {', '.join(ref_text(r) for r in self.bases)} or their bases"
            )
        owner, member = hit
        if member.kind != "function":
            return Cell("unchecked", "ok?", f"{owner.name}.{self.method} is not a plain method")
        theirs = Signature.of(member.node, bound=True)
        if self.ours is not None:
            problem = theirs.override_problem(self.ours)
            if problem:
                return _changed(f"{owner.name}.{self.method}: {problem}")
        for shape in self.super_calls:
            problem = theirs.call_problem(shape)
            if problem:
                return _changed(f"super().{self.method}{shape.text()}: {owner.name}.{self.method} {problem}")
        return _ok()


@dataclass
class EngineArgNeed(Need):
    name: str = ""

    def check(self, checker: Checker) -> Cell:
        hit = checker.compat("EngineArgs")
        if hit is None or hit[1].kind != "class":
            return _missing("EngineArgs is missing")
        fields = checker.tree.fields(hit[1])
        if fields is None:
            return Cell("unchecked", "ok?", "EngineArgs is not a dataclass")
        return _ok() if self.name in fields else _missing(f"EngineArgs has no field {self.name!r}")


@dataclass
class CallNeed(Need):
    """A call of a vLLM callable (``method``: of one of its attributes) with the shapes we use."""

    ref: Ref = ()
    method: str | None = None
    shapes: tuple[CallShape, ...] = ()

    def check(self, checker: Checker) -> Cell:
        found = checker.target(self.ref)
        if found is None:
            return Cell("unchecked", "-", f"{ref_text(self.ref)} is missing")
        if self.method is not None:
            cls = checker.tree.class_of(found)
            if cls is None:
                return Cell("unchecked", "ok?", f"{ref_text(self.ref)} is not a class")
            hit = checker.tree.member(cls, self.method)
            if hit is None:
                return _missing(f"{cls.name} has no {self.method}")
            found = hit[1]
            signature = Signature.of(found.node, bound=True) if found.kind == "function" else None
        else:
            signature = checker.tree.call_signature(found)
        if found.kind == "external":
            return Cell("unchecked", "ok?", f"defined outside vLLM ({found.module})")
        if signature is None:
            return Cell("unchecked", "ok?", f"cannot read how {found.name} is called")
        for shape in self.shapes:
            problem = signature.call_problem(shape)
            if problem:
                return _changed(f"{found.name}{shape.text()}: {found.name} {problem}")
        return _ok()


@dataclass
class AttributeNeed(Need):
    ref: Ref = ()
    attr: str = ""

    def check(self, checker: Checker) -> Cell:
        found = checker.target(self.ref)
        if found is None:
            return Cell("unchecked", "-", f"{ref_text(self.ref)} is missing")
        if found.kind == "module":
            return _ok() if checker.tree.lookup(found.module, self.attr) else _missing(f"no {self.attr}")
        cls = checker.tree.class_of(found)
        if cls is None:
            return Cell("unchecked", "ok?", f"{ref_text(self.ref)} is not a class")
        if checker.tree.member(cls, self.attr) is None:
            fields = checker.tree.fields(cls) or {}
            if self.attr not in fields:
                return _missing(f"{cls.name} has no {self.attr}")
        return _ok()


@dataclass
class HookNeed(Need):
    def check(self, checker: Checker) -> Cell:
        module_name, target, attr = OMNI_HOOK
        module = checker.tree.module(module_name)
        if module is None:
            return _missing(f"no module {module_name}")
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == target
                and any(a.name == attr for a in node.names)
            ):
                return _ok()
        return _missing(f"{module_name} no longer imports {target}.{attr} for --omni")
