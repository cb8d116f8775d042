"""Signatures and call shapes, read from the AST: whether our calls bind to vLLM's callables, and whether
vLLM, calling our overrides as it calls its own methods, would bind to ours."""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]
    required_positional: int
    kwonly: tuple[str, ...]
    required_kwonly: frozenset[str]
    varargs: bool
    varkw: bool

    @classmethod
    def of(cls, node: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> Signature:
        """``bound``: drop the first parameter (self or cls) unless the method is a staticmethod."""
        args = node.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        defaults = len(args.defaults)
        is_static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
        required = len(positional) - defaults
        if bound and not is_static and positional:
            positional = positional[1:]
            required -= 1
        kwonly = tuple(a.arg for a in args.kwonlyargs)
        required_kwonly = frozenset(
            a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None
        )
        return cls(
            tuple(positional), max(required, 0), kwonly, required_kwonly, bool(args.vararg), bool(args.kwarg)
        )

    def text(self) -> str:
        parts = list(self.positional)
        if self.varargs:
            parts.append("*args")
        elif self.kwonly:
            parts.append("*")
        parts.extend(self.kwonly)
        if self.varkw:
            parts.append("**kwargs")
        return f"({', '.join(parts)})"

    def call_problem(self, shape: CallShape) -> str | None:
        """Why a call of this shape would fail against this signature (None: it binds)."""
        if not self.varargs and shape.positional > len(self.positional):
            return (
                f"takes {len(self.positional)} positional arguments {self.text()}, we pass {shape.positional}"
            )
        accepted = set(self.positional[shape.positional :]) | set(self.kwonly)
        for name in shape.keywords:
            if name not in accepted and not self.varkw:
                return f"has no parameter {name!r} {self.text()}"
        if shape.star_args or shape.star_kwargs:
            return None
        missing = [
            name
            for name in (
                *self.positional[shape.positional : self.required_positional],
                *sorted(self.required_kwonly),
            )
            if name not in shape.keywords
        ]
        if missing:
            return f"now requires {', '.join(missing)} {self.text()}"
        return None

    def override_problem(self, ours: Signature) -> str | None:
        """Why vLLM, calling our override as it calls its own method (``self``), would fail."""
        if ours.varargs and ours.varkw:
            return None
        if not ours.varargs and len(ours.positional) < len(self.positional):
            return f"vLLM's takes {self.text()}, ours {ours.text()}"
        if ours.required_positional > len(self.positional) and not self.varargs:
            return f"ours requires more than vLLM's {self.text()} passes: {ours.text()}"
        ours_names = set(ours.positional) | set(ours.kwonly)
        for name in self.kwonly:
            if name not in ours_names and not ours.varkw:
                return f"vLLM's takes keyword {name!r} {self.text()}, ours {ours.text()}"
        extra_required = ours.required_kwonly - set(self.kwonly)
        if extra_required:
            return f"ours requires keyword(s) {', '.join(sorted(extra_required))} that vLLM does not pass"
        return None


@dataclass(frozen=True)
class CallShape:
    positional: int
    keywords: tuple[str, ...]
    star_args: bool
    star_kwargs: bool

    @classmethod
    def of(cls, call: ast.Call) -> CallShape:
        return cls(
            sum(1 for a in call.args if not isinstance(a, ast.Starred)),
            tuple(sorted(k.arg for k in call.keywords if k.arg is not None)),
            any(isinstance(a, ast.Starred) for a in call.args),
            any(k.arg is None for k in call.keywords),
        )

    def text(self) -> str:
        parts = ["_"] * self.positional + (["*"] if self.star_args else [])
        parts += [f"{k}=" for k in self.keywords] + (["**"] if self.star_kwargs else [])
        return f"({', '.join(parts)})"
