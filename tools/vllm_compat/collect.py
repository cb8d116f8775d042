"""What the plugin needs from vLLM, read from its own code by AST, so the list follows the code: the names
of ``compat.LOCATIONS``, direct ``from vllm... import``s, methods our classes (and mixins in front of vLLM
classes) override or call through ``super()``, the ``EngineArgs`` fields resolution writes and the packaged
deploy configs set, calls of vLLM callables and attributes read from vLLM classes, the ``--omni`` hook."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from vllm_compat import ROOT, CheckError
from vllm_compat.needs import (
    AttributeNeed,
    CallNeed,
    CompatNeed,
    EngineArgNeed,
    HookNeed,
    ImportNeed,
    MethodNeed,
    Need,
    Ref,
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


def compat_locations(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[str, ...]]:
    path = package_dir / "compat.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except OSError as exc:  # a wrong --package: exit 2 (cannot check), not a traceback's 1 (failed)
        raise CheckError(f"{path}: {exc.strerror or exc}") from None
    for stmt in tree.body:
        target = (
            stmt.target
            if isinstance(stmt, ast.AnnAssign)
            else (stmt.targets[0] if isinstance(stmt, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "LOCATIONS" and stmt.value is not None:
            return {k: tuple(v) for k, v in ast.literal_eval(stmt.value).items()}
    raise CheckError(f"{path}: no LOCATIONS dict")


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


def collect_needs(package_dir: Path = PACKAGE_DIR) -> list[Need]:
    """Everything of vLLM's that the package at ``package_dir`` uses, read from its sources."""
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

    def add(need: Need) -> Need:
        return needs.setdefault((need.kind, need.label), need)

    add(HookNeed("hook", "vllm --omni hands over to vllm_omni", "vllm/entrypoints/cli/main.py"))
    for name in locations:
        add(CompatNeed("compat", name, "compat.py", name=name))

    for module in modules:
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

    for name, where in sorted(_engine_arg_names(modules, package_dir).items()):
        add(EngineArgNeed("engine-arg", f"EngineArgs.{name}", where, name=name))

    for module in modules:
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
    return list(needs.values())
