"""Lazy reads from BAGEL's safetensors files: only the named tensors are read (the real ``ema.safetensors`` is
29 GB, and each stage needs a part of it).

The header (an 8-byte little-endian length, then that many bytes of JSON) is parsed here, and each tensor is
read with one positioned read of its own byte range: nothing maps the file, and learning names and shapes
reads the header alone (a truncated or still-downloading file answers them too).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_plugin.models.bagel.config import BagelConfigError

HEADER_LIMIT = 100 * 1024 * 1024
"""The largest header safetensors itself accepts."""

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors header; ``start``/``end`` are byte offsets in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares, from its header alone (the body is neither read nor mapped).

    :class:`BagelConfigError` names the file when the header is short, oversized, not JSON or malformed.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise BagelConfigError(
                    f"{path}: not a safetensors file (shorter than its 8-byte header size)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_LIMIT:
                raise BagelConfigError(f"{path}: not a safetensors file (header size {length} bytes)")
            raw = f.read(length)
    except OSError as exc:
        raise BagelConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) < length:
        raise BagelConfigError(f"{path}: truncated safetensors header ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise BagelConfigError(f"{path}: the safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BagelConfigError(f"{path}: the safetensors header is not a JSON object")
    body = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BagelConfigError(f"{path}: malformed safetensors header entry {name!r}") from None
        size = DTYPE_BYTES.get(dtype)
        if size is None or min(shape, default=0) < 0 or end - begin != math.prod(shape) * size or begin < 0:
            raise BagelConfigError(
                f"{path}: safetensors header entry {name!r} ({dtype} {list(shape)}, bytes {begin}-{end}) "
                "is inconsistent"
            )
        entries[name] = TensorEntry(dtype, shape, body + begin, body + end)
    return entries


def _torch_dtype(name: str) -> Any:
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
        "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
        "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    }[name]  # fmt: skip


def _is_meta(device: Any) -> bool:
    return device is not None and str(device).split(":")[0] == "meta"


class CheckpointReader:
    """One open safetensors file; records the names of the tensors it has read (``read``).

    ``device="meta"`` gives a tensor of the entry's shape without reading its data (loading a model's
    layout, never its weights).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise BagelConfigError(f"{self.path}: no such weights file")
        self.entries = read_header(self.path)
        self.names = frozenset(self.entries)
        self.read: list[str] = []
        self._file: Any = open(self.path, "rb")  # noqa: SIM115 - closed by close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise BagelConfigError(f"{self.path}: the checkpoint has no tensor {name!r}")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        """From the header; reads no data."""
        return self._entry(name).shape

    def _bytes(self, name: str, start: int, end: int) -> Any:
        """``[start, end)`` of the file as a uint8 tensor, read in place (no mapping)."""
        import torch

        if self._file is None:
            raise BagelConfigError(f"{self.path}: the reader is closed")
        size = os.fstat(self._file.fileno()).st_size
        if end > size:
            raise BagelConfigError(
                f"{self.path}: {name} ends at byte {end} but the file has {size} bytes (truncated download?)"
            )
        out = torch.empty(end - start, dtype=torch.uint8)
        view = memoryview(out.numpy())
        done = 0
        while done < len(view):
            count = os.preadv(self._file.fileno(), [view[done:]], start + done)
            if count <= 0:
                raise BagelConfigError(f"{self.path}: short read of {name} at byte {start + done}")
            done += count
        return out

    def tensor(self, name: str, *, dtype: Any = None, device: Any = None) -> Any:
        import torch

        entry = self._entry(name)
        self.read.append(name)
        stored = _torch_dtype(entry.dtype)
        scale_name = f"{name}_scale"
        quantized = stored == torch.int8 and scale_name in self.names
        if _is_meta(device):
            return torch.empty(
                entry.shape, dtype=dtype or (torch.float32 if quantized else stored), device="meta"
            )
        value = self._bytes(name, entry.start, entry.end).view(stored).reshape(entry.shape)
        if quantized:  # a compressed-tensors int8 weight (the thinker's kernels run it): dequantized here
            value = value.to(torch.float32) * self.tensor(scale_name, dtype=torch.float32)
        return value.to(device=device, dtype=dtype) if dtype is not None or device is not None else value

    def rows(self, name: str, indices: list[int], *, dtype: Any = None, device: Any = None) -> Any:
        """Selected rows of a 2-D tensor, each read on its own (e.g. two rows of a 152k-row embedding)."""
        import torch

        entry = self._entry(name)
        self.read.append(name)
        if len(entry.shape) != 2:
            raise BagelConfigError(f"{self.path}: {name} has shape {list(entry.shape)}, not rows")
        count, width = entry.shape
        for index in indices:
            if not 0 <= index < count:
                raise BagelConfigError(f"{self.path}: {name} has {count} rows; row {index} does not exist")
        stored = _torch_dtype(entry.dtype)
        if _is_meta(device):
            return torch.empty((len(indices), width), dtype=dtype or stored, device="meta")
        row_bytes = (entry.end - entry.start) // count
        parts = [
            self._bytes(name, entry.start + i * row_bytes, entry.start + (i + 1) * row_bytes) for i in indices
        ]
        value = torch.cat(parts).view(stored).reshape(len(indices), width)
        return value.to(device=device, dtype=dtype) if dtype is not None or device is not None else value

    def with_prefix(self, prefix: str) -> list[str]:
        return sorted(name for name in self.names if name.startswith(prefix))
