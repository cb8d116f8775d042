"""Images on the wire: uploaded bytes and ``data:`` URIs in (bounded by the operator's ``ImageLimits``),
PNG/JPEG/WebP bytes and ``data:`` URIs out, so the server modules only route."""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

import numpy as np

from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_protocol import ImageLimits

MEDIA_TYPES: dict[str, str] = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


PIL_FORMATS: dict[str, str] = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def decode_image(
    data: bytes, limits: ImageLimits, param: str = "image", name: str | None = None, *, mode: str = "RGB"
) -> np.ndarray:
    """Uploaded bytes -> uint8 HxWx3 RGB (HxWx4 with ``mode="RGBA"``); too many bytes or pixels -> 413,
    empty or not an image -> 400. ``name`` (the upload's file name) says which image in the messages."""
    from PIL import Image, UnidentifiedImageError

    subject = repr(name) if name else "the image"
    if len(data) > limits.max_upload_bytes:
        raise OmniAPIError(
            f"{param}: {subject} is {len(data)} bytes; this server accepts at most {limits.max_upload_bytes} "
            "bytes per image",
            status=413,
            param=param,
        )
    if not data:
        raise OmniAPIError(f"{param}: {subject} is empty (0 bytes)", param=param)
    max_pixels = max_image_pixels(limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise OmniAPIError(
                    f"{param}: {subject} is too large: {width}x{height} is {width * height} pixels; this "
                    f"server accepts at most {max_pixels} pixels",
                    status=413,
                    param=param,
                )
            if max(width, height) > limits.max_aspect_ratio * max(1, min(width, height)):
                most = f"{limits.max_aspect_ratio:g}:1"
                raise OmniAPIError(
                    f"{param}: {subject} is {width}x{height}, an aspect ratio over {most}; this server "
                    f"accepts at most {most}",
                    param=param,
                )
            image.load()
            if mode == "RGBA" and not _has_alpha(image):
                raise OmniAPIError(
                    f"{param}: {subject} has no alpha channel: a mask marks the area to repaint with fully "
                    "transparent pixels (a PNG with transparency)",
                    param=param,
                )
            return np.asarray(image.convert(mode), dtype=np.uint8).copy()
    except OmniAPIError:
        raise
    except Image.DecompressionBombError as exc:
        # PIL refuses, in Image.open, a header declaring more than twice its MAX_IMAGE_PIXELS, before our
        # own check sees the size; its message carries the pixel count.
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = f"{found.group(1)} pixels" if found else "more pixels than PIL decodes"
        raise OmniAPIError(
            f"{param}: {subject} is too large: {pixels}; this server accepts at most {max_pixels} pixels",
            status=413,
            param=param,
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise OmniAPIError(
            f"{param}: cannot decode {subject} as a PNG, JPEG or WebP image", param=param
        ) from None


def _has_alpha(image: Any) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def decode_mask(
    data: bytes, limits: ImageLimits, size: tuple[int, int], param: str = "mask", name: str | None = None
) -> np.ndarray:
    """An uploaded mask, as OpenAI's edits read it (a PNG whose fully transparent pixels mark where the
    image is repainted, of the image's ``size``, (height, width)) -> uint8 HxW, 255 where repainted, 0
    where kept: diffusers' ``mask_image``. No alpha channel, another size or nothing transparent -> 400."""
    return mask_from_alpha(decode_image(data, limits, param, name, mode="RGBA"), size, param)


def mask_from_alpha(rgba: np.ndarray, size: tuple[int, int], param: str) -> np.ndarray:
    """A decoded RGBA mask -> uint8 HxW (255: repaint where alpha is 0), checked against its image's
    (height, width)."""
    if rgba.shape[:2] != tuple(size):
        raise OmniAPIError(
            f"{param}: the mask is {rgba.shape[1]}x{rgba.shape[0]}, the image {size[1]}x{size[0]}: a mask "
            "has the size of the image it marks",
            param=param,
        )
    repaint = rgba[..., 3] == 0
    if not repaint.any():
        raise OmniAPIError(
            f"{param}: the mask has no fully transparent pixel, so nothing would be repainted (transparent "
            "pixels, alpha 0, mark the area to edit)",
            param=param,
        )
    return np.where(repaint, 255, 0).astype(np.uint8)


def max_image_pixels(limits: ImageLimits) -> int:
    """The most pixels a source image may have: room to resize one four times the largest output side."""
    return (4 * limits.max_side) ** 2


_DATA_URI = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S | re.I
)
"""RFC 2397: the scheme, media type and ``base64`` are case-insensitive (``DATA:image/PNG;BASE64,``)."""


def decode_data_uri(url: str, limits: ImageLimits, param: str, *, mode: str = "RGB") -> np.ndarray:
    """A ``data:image/...;base64,...`` URI -> uint8 HxWx3 (HxWx4 with ``mode="RGBA"``); this server never
    fetches remote URLs."""
    match = _DATA_URI.match(url.strip())
    if match is None:
        raise OmniAPIError(
            f"{param}: only base64 data URIs (data:image/png;base64,...) are accepted; this server does "
            "not fetch URLs",
            param=param,
        )
    payload = match.group("data")
    if len(payload) > 4 * (limits.max_upload_bytes // 3 + 2):
        raise OmniAPIError(
            f"{param}: the image is about {len(payload) * 3 // 4} bytes; this server accepts at most "
            f"{limits.max_upload_bytes} bytes per image",
            status=413,
            param=param,
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise OmniAPIError(f"{param}: the data URI is not valid base64", param=param) from None
    return decode_image(raw, limits, param, mode=mode)


def encode_image(image: Any, output_format: str = "png", compression: int | None = None) -> bytes:
    """A uint8 HxWx3 array -> encoded bytes (``compression`` is OpenAI's 0-100, for JPEG/WebP)."""
    from PIL import Image

    pil = Image.fromarray(np.asarray(image, dtype=np.uint8))
    out = io.BytesIO()
    kwargs: dict[str, Any] = {}
    if output_format in ("jpeg", "webp"):
        kwargs["quality"] = 100 - compression if compression is not None else 90
    pil.save(out, format=PIL_FORMATS[output_format], **kwargs)
    return out.getvalue()


def data_uri(encoded: bytes, output_format: str) -> str:
    return f"data:{MEDIA_TYPES[output_format]};base64,{base64.b64encode(encoded).decode('ascii')}"
