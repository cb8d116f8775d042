"""The kinds of thing the plugin needs from vLLM (a ``compat`` name, an import, an overridden method, an
``EngineArgs`` field, a call, an attribute, a declared read of a vLLM object, the model runner setting,
the ``--omni`` hook) and how each is checked against one release's sources, as one table cell."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from vllm_compat.signatures import CallShape, Signature
from vllm_compat.tree import Found, SourceTree

OMNI_HOOK = ("vllm.entrypoints.cli.main", "vllm_omni.entrypoints.cli.main", "main")
"""Stock vLLM's ``--omni`` hook: the module that imports our forwarding shim, and what it imports."""

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER_VALUE = "0"
"""A user's choice of vLLM's V1 model runner, which resolution refuses where V1 is gone."""
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
"""vLLM's V1 model runner, unless ``compat.V1_RUNNER_MODULE`` names another."""

# A reference to something of vLLM's: ("compat", NAME) or ("vllm", MODULE, ATTR).
Ref = tuple[str, ...]


@dataclass
class Cell:
    status: str  # "ok" | "missing" | "changed" | "unchecked" | "note" (shown with its reason, never failing)
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

    def __init__(
        self,
        tree: SourceTree,
        locations: dict[str, tuple[str, ...]],
        optional: dict[str, frozenset[str]] | None = None,
    ) -> None:
        self.tree = tree
        self.locations = locations
        self.optional = optional or {}
        """compat name -> the attributes of it the plugin does without (optional in ``VLLM_READS``)."""
        self._compat: dict[str, tuple[str, Found] | None] = {}

    @property
    def has_v1_runner(self) -> bool:
        return self.tree.module(V1_RUNNER_MODULE) is not None

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
    v1_only: bool = False
    """Used only with vLLM's V1 model runner (a module of ours marked ``V1_ONLY``, a compat name in
    ``compat.V1_ONLY_NAMES``, a read marked ``@v1``): a release without V1 does not need it."""

    def check(self, checker: Checker) -> Cell:
        raise NotImplementedError

    def cell(self, checker: Checker) -> Cell:
        """:meth:`check`, except where the release has no V1 runner and only V1 needs this."""
        if self.v1_only and not checker.has_v1_runner:
            return Cell("note", "V1 only", f"used only on the V1 runner, absent here ({V1_RUNNER_MODULE})")
        return self.check(checker)


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
        optional_in = [
            ref[1]
            for ref in self.bases
            if ref[0] == "compat" and self.method in checker.optional.get(ref[1], ())
        ]
        if hit is None and optional_in:
            return Cell(
                "note", "absent", f"no {self.method} in {optional_in[0]}; optional in compat.VLLM_READS"
            )
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
class ReadNeed(Need):
    """An attribute or field of a vLLM object that ``compat.VLLM_READS`` declares the plugin reads (the
    reads nothing else sees: ``getattr`` with a default, ``hasattr``, fields of objects vLLM hands us)."""

    owner: str = ""
    attr: str = ""
    optional: bool = False
    """The plugin handles its absence: absent is shown, not failed."""

    def check(self, checker: Checker) -> Cell:
        found = checker.target(("compat", self.owner))
        if found is None:
            return Cell("unchecked", "-", f"{self.owner} is missing")
        if found.kind == "module":
            present = checker.tree.lookup(found.module, self.attr) is not None
        else:
            cls = checker.tree.class_of(found)
            if cls is None:
                return Cell("unchecked", "ok?", f"{self.owner} is not a class")
            present = checker.tree.has_attribute(cls, self.attr)
        if present:
            return _ok()
        if self.optional:
            return Cell("note", "absent", f"{self.owner} has no {self.attr}; the plugin handles its absence")
        return _missing(f"{self.owner} has no {self.attr}")


def _release(version: str | None) -> tuple[int, int] | None:
    parts = (version or "").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _compares_true(test: ast.expr, value: str) -> bool | None:
    """Whether ``test``, a comparison of the setting's value with constants, holds for ``value``; None
    when ``test`` is not such a comparison."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _compares_true(test.operand, value)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        parts = [_compares_true(v, value) for v in test.values]
        if None in parts:
            return None
        return all(parts) if isinstance(test.op, ast.And) else any(parts)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    try:
        constant = ast.literal_eval(test.comparators[0])
    except (ValueError, TypeError, SyntaxError):
        return None
    op = test.ops[0]
    if isinstance(op, ast.Eq | ast.NotEq) and isinstance(constant, str):
        return (value == constant) == isinstance(op, ast.Eq)
    if isinstance(op, ast.In | ast.NotIn) and isinstance(constant, tuple | list | set | frozenset):
        return (value in constant) == isinstance(op, ast.In)
    return None


def _raises(body: list[ast.stmt]) -> bool:
    return any(isinstance(stmt, ast.Raise) for stmt in body)


def setting_refusal(tree: SourceTree, env: str, value: str) -> tuple[bool | None, str]:
    """Whether the release raises for ``env=value`` (``(True, where)``), cannot be read on it
    (``(None, where)``) or does not refuse it (``(False, "")``). Read statically: an ``if`` on the
    variable's name (``env == "X"``) whose body raises, directly or under a comparison of the value with
    constants (vLLM 0.34's ``Platform.validate_environ``); an ``if`` comparing the value itself
    (``os.environ.get("X") != "1"``) that raises; the name as a key of a ``removed_*`` dict."""
    unreadable = ""
    for name in tree.files_containing(env):
        module_name = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        module = tree.module(module_name)
        for node in ast.walk(module.tree) if module else ():
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                removed = any(isinstance(t, ast.Name) and "removed" in t.id for t in targets)
                if removed and any(isinstance(k, ast.Constant) and k.value == env for k in node.value.keys):
                    return True, f"{name}:{node.lineno}"
            if not isinstance(node, ast.If) or not any(
                isinstance(n, ast.Constant) and n.value == env for n in ast.walk(node.test)
            ):
                continue
            names_it = isinstance(node.test, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == env for c in node.test.comparators
            )
            if names_it and _raises(node.body):
                return True, f"{name}:{node.lineno}"
            # the value compared itself, or a comparison of it under the `if` on the name
            raising = (
                [node]
                if not names_it
                else [
                    branch
                    for inner in node.body
                    for branch in ast.walk(inner)
                    if isinstance(branch, ast.If) and _raises(branch.body)
                ]
            )
            for branch in raising:
                if not _raises(branch.body):
                    continue
                verdict = _compares_true(branch.test, value)
                if verdict:
                    return True, f"{name}:{branch.lineno}"
                if verdict is None:
                    unreadable = unreadable or f"{name}:{branch.lineno}"
    return (None, unreadable) if unreadable else (False, "")


@dataclass
class RunnerNeed(Need):
    """A user's ``VLLM_USE_V2_MODEL_RUNNER=0`` (the V1 runner): configuration resolution refuses it, in one
    line, exactly where the release has no V1 runner module (``compat.vllm_has_v1_runner``). A release
    that refuses the value although it still ships that module would get it from resolution and raise in
    the engine instead."""

    v1_module: str = V1_RUNNER_MODULE

    def check(self, checker: Checker) -> Cell:
        tree = checker.tree
        setting = f"{RUNNER_ENV}={V1_RUNNER_VALUE}"
        path = self.v1_module.replace(".", "/")
        has_v1 = f"{path}.py" in tree.names or f"{path}/__init__.py" in tree.names
        refused, where = setting_refusal(tree, RUNNER_ENV, V1_RUNNER_VALUE)
        if not has_v1:
            return _ok("V2 only")  # resolution refuses the setting itself
        if refused:
            return _changed(
                f"the release refuses {setting} ({where}) but still has {path}.py, so resolution lets it "
                "through (compat.vllm_has_v1_runner)"
            )
        if refused is None:
            return Cell("unchecked", "?", f"may refuse {setting} ({where}: cannot read the condition)")
        return _ok("V1 and V2")


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
