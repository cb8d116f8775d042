"""Host synchronisation in a forward pass, made visible on a machine without a GPU.

A CUDA graph capture fails on any host synchronisation: reading a device value (``.item()``, ``bool()``,
``.cpu()``, ``.tolist()``, ``.numpy()``) or an op whose output shape depends on device values
(``nonzero``, ``masked_select``, boolean indexing). On CPU all of these succeed, and the host reads of a
CPU tensor do not even reach PyTorch's dispatcher. :class:`HostSyncGuard` records them:

* a ``TorchDispatchMode`` flags the ops (data-dependent outputs and shapes, boolean index masks, copies
  from a device to the host), whatever tensor they run on;
* tensors marked with :meth:`HostSyncGuard.device` (a subclass whose results stay marked) flag the host
  reads that never dispatch.

Ops run on as usual, so one pass lists every synchronisation, each with the line that caused it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

HOST_READS = frozenset(
    {"cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__array__"}
)
"""Tensor methods that hand a tensor's values to the host."""

_INDEX_OPS = frozenset(
    {
        aten.index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
    }
)
_HERE = __file__.removesuffix("c")


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    """``host read``, ``data-dependent value``, ``data-dependent shape``, ``boolean index`` or
    ``device to host copy``."""
    op: str
    where: str
    """``file:line function`` of the innermost frame outside torch and this module."""

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}"


_active: list[HostSyncGuard] = []
_quiet = [0]
"""Above zero while a recorded host read runs (its ``_local_scalar_dense`` is the same violation)."""


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        name = frame.filename.replace("\\", "/")
        if name == _HERE or "/torch/" in name:
            continue
        return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


def _record(kind: str, op: str) -> None:
    if _active and not _quiet[0]:
        _active[-1].violations.append(Violation(kind, op, _caller()))


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, str | torch.device) and torch.device(t).type == "cpu" for t in targets)


class DeviceTensor(torch.Tensor):
    """A tensor standing for one on an accelerator: while a guard is active, handing its values to the
    host is recorded. Results of ops on it are marked too."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _active and (name in HOST_READS or (name == "to" and _to_host(args, kwargs))):
            _record("host read", f"Tensor.{name}")
            _quiet[0] += 1
            try:
                return super().__torch_function__(func, types, args, kwargs)
            finally:
                _quiet[0] -= 1
        return super().__torch_function__(func, types, args, kwargs)


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class _SyncOps(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            _record("data-dependent value", str(func))
        elif func in _INDEX_OPS:
            if any(_is_mask(i) for i in args[1] or ()):
                _record("boolean index", str(func))
        elif torch.Tag.dynamic_output_shape in tags:
            _record("data-dependent shape", str(func))
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0].device if func is aten.copy_.default else kwargs.get("device")
            if src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu":
                _record("device to host copy", str(func))
        return func(*args, **kwargs)


class HostSyncGuard:
    """``with HostSyncGuard() as guard: ...`` records every host synchronisation in ``guard.violations``."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self._mode = _SyncOps()

    @staticmethod
    def device(tensor: torch.Tensor) -> torch.Tensor:
        """The same storage, marked as an accelerator's tensor."""
        return tensor.as_subclass(DeviceTensor)

    @staticmethod
    def host(tensor: torch.Tensor) -> torch.Tensor:
        """The same storage, unmarked."""
        return tensor.as_subclass(torch.Tensor)

    @classmethod
    @contextlib.contextmanager
    def device_attributes(cls, obj: Any) -> Iterator[Any]:
        """Marks the tensor attributes of ``obj`` (e.g. attention metadata) while inside, in place."""
        names = [k for k, v in vars(obj).items() if isinstance(v, torch.Tensor)]
        saved = {k: getattr(obj, k) for k in names}
        for k in names:
            object.__setattr__(obj, k, cls.device(saved[k]))
        try:
            yield obj
        finally:
            for k, v in saved.items():
                object.__setattr__(obj, k, v)

    def __enter__(self) -> HostSyncGuard:
        self._mode.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)
        self._mode.__exit__(*exc)
