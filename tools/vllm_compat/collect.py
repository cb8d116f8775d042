"""What the plugin needs from vLLM, read from its own code by AST, so the list follows the code: the names
of ``compat.LOCATIONS``, direct ``from vllm... import``s, methods our classes (and mixins in front of vLLM
classes) override or call through ``super()``, the ``EngineArgs`` fields resolution writes and the packaged
deploy configs set, calls of vLLM callables and attributes read from vLLM classes, the ``--omni`` hook.

What the code cannot show (an attribute of an object vLLM hands us, read with ``getattr``/``hasattr`` or
as a struct field: types are not inferred) ``compat.VLLM_READS`` declares; :func:`undeclared_reads` keeps
the declaration in step with the ``getattr``/``hasattr`` reads. What only vLLM's V1 runner needs (modules
of ours marked ``V1_ONLY``, ``compat.V1_ONLY_NAMES``, reads marked ``@v1``) is needed only by a release
that has the V1 runner."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_compat import ROOT, CheckError
from vllm_compat.needs import (
    RUNNER_ENV,
    V1_RUNNER_MODULE,
    V1_RUNNER_VALUE,
    AttributeNeed,
    CallNeed,
    CompatNeed,
    EngineArgNeed,
    HookNeed,
    ImportNeed,
    MethodNeed,
    Need,
    ReadNeed,
    Ref,
    RunnerNeed,
    ref_text,
)
from vllm_compat.signatures import CallShape, Signature

PACKAGE_NAME = "vllm_omni_plugin"
PACKAGE_DIR = ROOT / "src" / PACKAGE_NAME


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


OPTIONAL_MARK = "?"
V1_MARK = "@v1"
"""Ends a name of ``compat.VLLM_READS`` that the plugin does without (absent: shown, not failed)."""

READ_SCOPE = ("ar_worker", "schedulers", "models", "compat.py")
"""Where every ``getattr``/``hasattr`` read of a literal name must be declared (:func:`undeclared_reads`)."""

NOT_VLLM_READS: dict[str, str] = {
    "take_stage_outputs": "ours: the context export connector's (ar_worker/context_export.py)",
    "stage_outputs": "ours: the context export connector's worker metadata",
    "exports": "ours: the context export connector's metadata",
    "omni_stage_outputs": "ours: the hook of our models that compute stage outputs",
    "downsample": "ours: BAGEL's autoencoder stages (models/bagel/autoencoder.py)",
    "upsample": "ours: BAGEL's autoencoder stages (models/bagel/autoencoder.py)",
    "head_dim": "the model's Hugging Face config",
    "attention_bias": "the model's Hugging Face config",
    "embedding_vocab_size": "GLM-Image's Hugging Face text config",
    "grid_bos_token": "GLM-Image's tokenizer",
    "grid_eos_token": "GLM-Image's tokenizer",
    "weight_loader": "a parameter's, set per parameter by vLLM's layers; vLLM's default_weight_loader else",
    "name": "a Python Enum member's",
    "pid": "a multiprocessing process's",
}
"""Names read with ``getattr``/``hasattr`` in ``READ_SCOPE`` that are not a vLLM object's attribute, and
whose they are. Matched by name only (types are not inferred): a vLLM read of one of these names goes
unseen, so keep the list short."""


def _compat_values(package_dir: Path) -> tuple[Path, dict[str, tuple[int, ast.expr]]]:
    """compat.py's top-level assignments: name -> (line, value)."""
    path = package_dir / "compat.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except OSError as exc:  # a wrong --package: exit 2 (cannot check), not a traceback's 1 (failed)
        raise CheckError(f"{path}: {exc.strerror or exc}") from None
    out: dict[str, tuple[int, ast.expr]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        else:
            continue
        if isinstance(target, ast.Name):
            out[target.id] = (stmt.lineno, value)
    return path, out


def _literal(path: Path, line: int, value: ast.expr) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError):
        raise CheckError(f"{path}:{line}: not a literal") from None


def compat_locations(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[str, ...]]:
    path, values = _compat_values(package_dir)
    if "LOCATIONS" not in values:
        raise CheckError(f"{path}: no LOCATIONS dict")
    return {k: tuple(v) for k, v in _literal(path, *values["LOCATIONS"]).items()}


@dataclass(frozen=True)
class DeclaredRead:
    owner: str
    """A name of ``compat.LOCATIONS`` (a class, or a module such as ``envs``)."""
    attr: str
    optional: bool
    where: str
    v1_only: bool = False


def compat_reads(package_dir: Path = PACKAGE_DIR) -> list[DeclaredRead]:
    """``compat.VLLM_READS`` (none when compat declares none); each owner must be a ``LOCATIONS`` name."""
    path, values = _compat_values(package_dir)
    if "VLLM_READS" not in values:
        return []
    line, value = values["VLLM_READS"]
    locations = compat_locations(package_dir)
    if not isinstance(value, ast.Dict):
        raise CheckError(f"{path}:{line}: VLLM_READS is not a dict literal")
    out = []
    for key, names in zip(value.keys, value.values, strict=True):
        owner = _literal(path, names.lineno, key) if key is not None else None
        attrs = _literal_strings(names)
        if owner not in locations or not attrs:
            raise CheckError(
                f"{path}:{names.lineno}: VLLM_READS maps a name of LOCATIONS to a tuple of attribute names"
            )
        for text in attrs:
            v1_only = text.endswith(V1_MARK)
            text = text.removesuffix(V1_MARK)
            optional = text.endswith(OPTIONAL_MARK)
            attr = text.removesuffix(OPTIONAL_MARK)
            out.append(DeclaredRead(owner, attr, optional, f"{_shown(path)}:{names.lineno}", v1_only))
    return out


def v1_only_names(package_dir: Path = PACKAGE_DIR) -> frozenset[str]:
    """``compat.V1_ONLY_NAMES``: the compat names only the V1 runner's modules resolve."""
    path, values = _compat_values(package_dir)
    if "V1_ONLY_NAMES" not in values:
        return frozenset()
    return frozenset(_literal(path, *values["V1_ONLY_NAMES"]))


def _is_v1_only(tree: ast.Module) -> bool:
    """Whether a module of ours says ``V1_ONLY = True`` at its top (it is imported only where V1 runs)."""
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "V1_ONLY" for t in node.targets)
        and isinstance(node.value, ast.Constant)
        and node.value.value is True
        for node in tree.body
    )


def optional_reads(reads: list[DeclaredRead]) -> dict[str, frozenset[str]]:
    """compat name -> the names of it declared optional."""
    out: dict[str, set[str]] = {}
    for read in reads:
        if read.optional:
            out.setdefault(read.owner, set()).add(read.attr)
    return {owner: frozenset(names) for owner, names in out.items()}


def runner_need(package_dir: Path = PACKAGE_DIR) -> RunnerNeed:
    """The model runner need, with the V1 runner's module ``compat.V1_RUNNER_MODULE`` names."""
    path, values = _compat_values(package_dir)
    module = _literal(path, *values["V1_RUNNER_MODULE"]) if "V1_RUNNER_MODULE" in values else V1_RUNNER_MODULE
    label = f"{RUNNER_ENV}={V1_RUNNER_VALUE} (a user's V1 runner) refused where V1 is gone"
    return RunnerNeed("runner", label, _shown(path), v1_module=module)


class _OurModule:
    """One module of our package: how it refers to vLLM (compat aliases, direct imports), scope by scope."""

    def __init__(self, name: str, path: Path, tree: ast.Module, compat_names: set[str]) -> None:
        self.name = name
        self.path = path
        self.tree = tree
        self.compat_names = compat_names
        self.compat_modules: set[str] = set()  # local names of the compat module
        self.resolvers: set[str] = set()  # local names of compat.resolve
        self.refs: dict[str, Ref | None] = {}  # module-level name -> what of vLLM's it is
        self.our_imports: dict[str, tuple[str, str]] = {}  # local name -> (our module, name)
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        compat_module = f"{PACKAGE_NAME}.compat"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if node.module == PACKAGE_NAME and alias.name == "compat":
                        self.compat_modules.add(local)
                    elif node.module == compat_module and alias.name == "resolve":
                        self.resolvers.add(local)
                    elif node.module == compat_module and alias.name in compat_names:
                        self.refs[local] = ("compat", alias.name)
                    elif node.module == "vllm" or node.module.startswith("vllm."):
                        self.refs[local] = ("vllm", node.module, alias.name)
                    elif node.module.startswith(PACKAGE_NAME):
                        self.our_imports[local] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == compat_module and alias.asname:
                        self.compat_modules.add(alias.asname)
        self.refs.update(self._assigned(tree.body, [self.refs]))
        self.nodes: list[tuple[ast.AST, list[dict[str, Ref | None]]]] = []
        self._visit(tree, [self.refs])

    def _assigned(self, body: list[ast.stmt], chain: list[dict[str, Ref | None]]) -> dict[str, Ref | None]:
        """Names a scope binds (not inside nested functions): ``NAME = resolve("X")`` -> X, others -> None."""
        out: dict[str, Ref | None] = {}
        stack: list[ast.AST] = list(body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                if not isinstance(node, ast.Lambda):
                    out.setdefault(node.name, None)
                continue
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                ref = self.ref_of(node.value, chain) if isinstance(node.value, ast.Call) else None
                if ref is not None:
                    out[node.targets[0].id] = ref
                    continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.setdefault(node.id, None)
            stack.extend(ast.iter_child_nodes(node))
        return out

    def _visit(self, node: ast.AST, chain: list[dict[str, Ref | None]]) -> None:
        self.nodes.append((node, chain))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            local: dict[str, Ref | None] = {
                a.arg: None for a in ast.walk(node.args) if isinstance(a, ast.arg)
            }
            body = node.body if isinstance(node.body, list) else [node.body]
            local.update(self._assigned(body, [*chain, local]))
            chain = [*chain, local]
        for child in ast.iter_child_nodes(node):
            self._visit(child, chain)

    def where(self, node: ast.AST) -> str:
        return f"{_shown(self.path)}:{getattr(node, 'lineno', 0)}"

    def ref_of(self, expr: ast.expr, chain: list[dict[str, Ref | None]] | None = None) -> Ref | None:
        chain = chain if chain is not None else [self.refs]
        if isinstance(expr, ast.Name):
            for scope in reversed(chain):
                if expr.id in scope:
                    return scope[expr.id]
            return None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            if expr.value.id in self.compat_modules and expr.attr in self.compat_names:
                return ("compat", expr.attr)
        if isinstance(expr, ast.Call) and len(expr.args) == 1 and isinstance(expr.args[0], ast.Constant):
            func = expr.func
            is_resolve = (isinstance(func, ast.Name) and func.id in self.resolvers) or (
                isinstance(func, ast.Attribute)
                and func.attr == "resolve"
                and isinstance(func.value, ast.Name)
                and func.value.id in self.compat_modules
            )
            if is_resolve and expr.args[0].value in self.compat_names:
                return ("compat", expr.args[0].value)
        return None


def _super_calls(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[CallShape]]:
    out: dict[str, list[CallShape]] = {}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
            and not node.func.value.args
        ):
            out.setdefault(node.func.attr, []).append(CallShape.of(node))
    return out


def _literal_strings(expr: ast.expr) -> list[str]:
    """The strings of a literal tuple/list/set, also inside ``frozenset(...)``; [] for anything computed."""
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id in ("frozenset", "set", "tuple")
    ):
        return _literal_strings(expr.args[0]) if len(expr.args) == 1 else []
    try:
        value = ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError):
        return []
    if isinstance(value, tuple | list | set | frozenset) and all(isinstance(v, str) for v in value):
        return list(value)
    return []


def _is_dict_update(call: ast.Call) -> bool:
    """``x.update(k=...)`` or ``dict(k=...)``: the keywords are keys."""
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "update") or (
        isinstance(func, ast.Name) and func.id == "dict"
    )


def _engine_arg_names(modules: list[_OurModule], package_dir: Path) -> dict[str, str]:
    """EngineArgs fields we write -> where: the ``*ENGINE_ARG*`` field tuples, the keys that the resolver's
    functions named ``*engine_args*`` put into dicts, the top-level keys of what ``engine_args_provider``
    functions return (their nested values, e.g. ``hf_overrides``, are not EngineArgs fields), the packaged
    configs' ``engine_extras``."""
    out: dict[str, str] = {}
    providers: set[str] = set()
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and "ENGINE_ARG" in t.id for t in targets) and node.value:
                    for name in _literal_strings(node.value):
                        out.setdefault(name, module.where(node))
            if isinstance(node, ast.keyword) and node.arg == "engine_args_provider":
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    providers.add(node.value.value)
            if (
                isinstance(node, ast.FunctionDef)
                and "engine_args" in node.name
                and module.name.split(".")[1:2] == ["config"]
                and "legacy" not in module.name
            ):
                for inner in ast.walk(node):
                    keys: list[ast.expr | None] = []
                    if isinstance(inner, ast.Dict):
                        keys = list(inner.keys)
                    elif isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store):
                        keys = [inner.slice]
                    elif isinstance(inner, ast.Call) and _is_dict_update(inner):  # args.update(key=...)
                        keys = [ast.Constant(value=k.arg) for k in inner.keywords if k.arg]
                    for key in keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            out.setdefault(key.value, module.where(inner))
    by_name = {m.name: m for m in modules}
    for provider in providers:
        module_name, _, function_name = provider.rpartition(".")
        module = by_name.get(module_name)
        function = next(
            (
                n
                for n in (module.tree.body if module else [])
                if isinstance(n, ast.FunctionDef) and n.name == function_name
            ),
            None,
        )
        if module is None or function is None:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        out.setdefault(key.value, module.where(node))
    import yaml  # a dependency of the package

    for path in sorted((package_dir / "deploy").glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        sections = [document, *((document.get("platforms") or {}).values())]
        for section in sections:
            for stage in (section or {}).get("stages") or []:
                for key in (stage or {}).get("engine_extras") or {}:
                    out.setdefault(key, _shown(path))
    return out


_COLLECTED: dict[tuple[Any, ...], list[Need]] = {}
""":func:`collect_needs` per package and state of its sources: reading them costs seconds, and one
process (the test suite) checks several vLLM trees against the same package."""


def _sources_state(package_dir: Path) -> tuple[Any, ...]:
    """What :func:`collect_needs` reads, as paths with their sizes and modification times."""
    paths = [*package_dir.rglob("*.py"), *(package_dir / "deploy").glob("*.yaml")]
    stats = ((str(p), p.stat()) for p in paths)
    return (package_dir.resolve(), *sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def collect_needs(package_dir: Path = PACKAGE_DIR) -> list[Need]:
    """Everything of vLLM's that the package at ``package_dir`` uses, read from its sources (once per
    state of them in a process; each caller gets its own copy)."""
    state = _sources_state(package_dir)
    if state not in _COLLECTED:
        _COLLECTED[state] = _collect_needs(package_dir)
    return copy.deepcopy(_COLLECTED[state])


def _collect_needs(package_dir: Path) -> list[Need]:
    locations = compat_locations(package_dir)
    compat_names = set(locations)
    modules = []
    for path in sorted(package_dir.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            raise CheckError(f"{path}: {exc}") from None
        modules.append(_OurModule(_module_name(path, package_dir), path, tree, compat_names))
    by_name = {m.name: m for m in modules}
    needs: dict[tuple[str, str], Need] = {}
    v1_scope = [False]
    """Whether the needs being added come from a module of ours that only the V1 runner uses."""

    def add(need: Need) -> Need:
        need.v1_only = need.v1_only or v1_scope[0]
        kept = needs.setdefault((need.kind, need.label), need)
        kept.v1_only = kept.v1_only and need.v1_only  # needed by anything else: needed everywhere
        return kept

    add(HookNeed("hook", "vllm --omni hands over to vllm_omni", "vllm/entrypoints/cli/main.py"))
    v1_names = v1_only_names(package_dir)
    for name in locations:
        add(CompatNeed("compat", name, "compat.py", v1_only=name in v1_names, name=name))
    for read in compat_reads(package_dir):
        label = f"{read.owner}.{read.attr}{OPTIONAL_MARK if read.optional else ''}"
        add(
            ReadNeed(
                "read", label, read.where, v1_only=read.v1_only, owner=read.owner, attr=read.attr,
                optional=read.optional,
            )
        )  # fmt: skip
    add(runner_need(package_dir))

    for module in modules:
        v1_scope[0] = _is_v1_only(module.tree)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    for alias in node.names:
                        label = f"{node.module}:{alias.name}"
                        add(
                            ImportNeed(
                                "import", label, module.where(node), module=node.module, attr=alias.name
                            )
                        )

    # classes built on vLLM classes, with the methods of our own bases (mixins) they carry
    def our_class(module: _OurModule, expr: ast.expr) -> tuple[_OurModule, ast.ClassDef] | None:
        if isinstance(expr, ast.Name) and expr.id in module.classes:
            return module, module.classes[expr.id]
        if isinstance(expr, ast.Name) and expr.id in module.our_imports:
            source, name = module.our_imports[expr.id]
            other = by_name.get(source)
            if other is not None and name in other.classes:
                return other, other.classes[name]
        return None

    def our_methods(
        module: _OurModule, cls: ast.ClassDef, seen: set[str]
    ) -> Iterator[tuple[_OurModule, ast.FunctionDef]]:
        if cls.name in seen:
            return
        seen.add(cls.name)
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                yield module, stmt
        for base in cls.bases:
            hit = our_class(module, base)
            if hit is not None:
                yield from our_methods(*hit, seen)

    for module in modules:
        v1_scope[0] = _is_v1_only(module.tree)
        for cls in module.classes.values():
            vllm_bases = tuple(ref for base in cls.bases if (ref := module.ref_of(base)) is not None)
            outside = any(
                module.ref_of(base) is None and our_class(module, base) is None for base in cls.bases
            )
            if not vllm_bases:
                continue
            names_seen: set[str] = set()
            callers: dict[str, str] = {}  # self.name(...) called from another method of ours
            for _, method in our_methods(module, cls, set()):
                for node in ast.walk(method):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "self"
                        and node.func.attr != method.name
                    ):
                        callers.setdefault(node.func.attr, method.name)
            for owner_module, method in our_methods(module, cls, set()):
                if method.name in names_seen:
                    continue  # shadowed by a class nearer the front
                names_seen.add(method.name)
                supers = _super_calls(method)
                label = f"{cls.name}.{method.name}"
                add(
                    MethodNeed(
                        "method",
                        label,
                        owner_module.where(method),
                        bases=vllm_bases,
                        method=method.name,
                        ours=Signature.of(method, bound=True),
                        super_calls=tuple(supers.pop(method.name, [])),
                        outside_bases=outside,
                        called_by_us=callers.get(method.name, ""),
                    )
                )
                for other, shapes in supers.items():  # super().other() from inside a different method
                    need = add(
                        MethodNeed(
                            "method",
                            f"{cls.name}.{other}",
                            owner_module.where(method),
                            bases=vllm_bases,
                            method=other,
                            outside_bases=outside,
                        )
                    )
                    assert isinstance(need, MethodNeed)
                    need.super_calls = (*need.super_calls, *shapes)

    v1_scope[0] = False
    for name, where in sorted(_engine_arg_names(modules, package_dir).items()):
        add(EngineArgNeed("engine-arg", f"EngineArgs.{name}", where, name=name))

    for module in modules:
        v1_scope[0] = _is_v1_only(module.tree)
        call_funcs = set()
        for node, chain in module.nodes:
            if not isinstance(node, ast.Call):
                continue
            call_funcs.add(id(node.func))
            ref = module.ref_of(node.func, chain)
            method = None
            if ref is None and isinstance(node.func, ast.Attribute):
                ref = module.ref_of(node.func.value, chain)
                method = node.func.attr
            if ref is None or module.ref_of(node, chain) is not None:  # resolve("X") itself
                continue
            label = f"{ref_text(ref)}{'.' + method if method else ''}()"
            need = add(CallNeed("call", label, module.where(node), ref=ref, method=method))
            assert isinstance(need, CallNeed)
            shape = CallShape.of(node)
            if shape not in need.shapes:
                need.shapes = (*need.shapes, shape)
        for node, chain in module.nodes:
            if (
                isinstance(node, ast.Attribute)
                and id(node) not in call_funcs
                and isinstance(node.ctx, ast.Load)
            ):
                ref = module.ref_of(node.value, chain)
                if ref is not None and module.ref_of(node, chain) is None and not node.attr.startswith("__"):
                    add(
                        AttributeNeed(
                            "attribute",
                            f"{ref_text(ref)}.{node.attr}",
                            module.where(node),
                            ref=ref,
                            attr=node.attr,
                        )
                    )
    v1_scope[0] = False
    return list(needs.values())


def attribute_reads(package_dir: Path = PACKAGE_DIR) -> list[tuple[str, str]]:
    """``(where, name)`` of each ``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` in ``READ_SCOPE``; a
    module-level string constant given as the name counts as its value."""
    paths: list[Path] = []
    for part in READ_SCOPE:
        target = package_dir / part
        paths += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        constants = {
            t.id: stmt.value.value
            for stmt in tree.body
            if isinstance(stmt, ast.Assign)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
            for t in stmt.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
            ):
                continue
            arg = node.args[1]
            name = (
                arg.value
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                else constants.get(arg.id)
                if isinstance(arg, ast.Name)
                else None
            )
            if name is not None:
                out.append((f"{_shown(path)}:{node.lineno}", name))
    return out


def undeclared_reads(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """The ``getattr``/``hasattr`` reads in ``READ_SCOPE`` of names neither ``compat.VLLM_READS`` declares
    nor ``NOT_VLLM_READS`` lists: each a vLLM attribute the checker would not check."""
    declared = {read.attr for read in compat_reads(package_dir)}
    return [
        f"{where}: {name}"
        for where, name in attribute_reads(package_dir)
        if name not in declared and name not in NOT_VLLM_READS
    ]
