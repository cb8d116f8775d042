"""msgspec encoding for stage messages: no pickle on any socket.

Tensors and numpy arrays travel as msgpack extension types carrying dtype, shape and raw bytes (small
ones: large ones go through a connector and only their handle is in the message). PIL images travel as
uint8 arrays.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

EXT_TENSOR = 1
EXT_NDARRAY = 2

_TORCH_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _TORCH_DTYPES:
            raise TypeError(f"cannot send tensors of dtype {tensor.dtype}")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header = msgspec.msgpack.encode([dtype, list(tensor.shape)])
        return msgspec.msgpack.Ext(EXT_TENSOR, len(header).to_bytes(4, "little") + header + raw)
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode([array.dtype.str, list(array.shape)])
        return msgspec.msgpack.Ext(EXT_NDARRAY, len(header).to_bytes(4, "little") + header + array.tobytes())
    if isinstance(obj, Image.Image):
        return _enc_hook(np.asarray(obj.convert("RGB")))
    raise TypeError(f"cannot encode {type(obj).__name__} in a stage message")


def _ext_hook(code: int, data: memoryview) -> Any:
    size = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + size])
    raw = data[4 + size :]
    if code == EXT_TENSOR:
        torch_dtype = _TORCH_DTYPES[dtype]
        if not raw:
            return torch.empty(shape, dtype=torch_dtype)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(torch_dtype).reshape(shape)
    if code == EXT_NDARRAY:
        return np.frombuffer(bytes(raw), dtype=np.dtype(dtype)).reshape(shape)
    raise ValueError(f"unknown msgpack extension {code}")


class StageMessageCodec:
    """Encoder/decoder pair for one message type."""

    def __init__(self, message_type: Any) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.decoder = msgspec.msgpack.Decoder(message_type, ext_hook=_ext_hook)

    def encode(self, message: Any) -> bytes:
        return self.encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Any:
        return self.decoder.decode(data)
