"""Lazy reads from BAGEL's safetensors files: only the named tensors are read (the real ``ema.safetensors`` is
29 GB, and each stage needs a part of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open

from vllm_omni_plugin.models.bagel.config import BagelConfigError


class CheckpointReader:
    """One open safetensors file; records the names of the tensors it has read (``read``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise BagelConfigError(f"{self.path}: no such weights file")
        try:
            self._file = safe_open(str(self.path), framework="pt", device="cpu")
        except Exception as exc:
            raise BagelConfigError(f"{self.path}: not a readable safetensors file: {exc}") from None
        self.names = frozenset(self._file.keys())
        self.read: list[str] = []

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file = None

    def _require(self, name: str) -> None:
        if name not in self.names:
            raise BagelConfigError(f"{self.path}: the checkpoint has no tensor {name!r}")

    def shape(self, name: str) -> tuple[int, ...]:
        """From the header; reads no data."""
        self._require(name)
        return tuple(self._file.get_slice(name).get_shape())

    def tensor(self, name: str, *, dtype: Any = None, device: Any = None) -> Any:
        self._require(name)
        self.read.append(name)
        value = self._file.get_tensor(name)
        return value.to(device=device, dtype=dtype) if dtype is not None or device is not None else value

    def rows(self, name: str, indices: list[int], *, dtype: Any = None, device: Any = None) -> Any:
        """Selected rows of a 2-D tensor, each read on its own (e.g. two rows of a 152k-row embedding)."""
        import torch

        self._require(name)
        self.read.append(name)
        view = self._file.get_slice(name)
        count = view.get_shape()[0]
        for index in indices:
            if not 0 <= index < count:
                raise BagelConfigError(f"{self.path}: {name} has {count} rows; row {index} does not exist")
        value = torch.cat([view[index : index + 1] for index in indices])
        return value.to(device=device, dtype=dtype) if dtype is not None or device is not None else value

    def with_prefix(self, prefix: str) -> list[str]:
        return sorted(name for name in self.names if name.startswith(prefix))
