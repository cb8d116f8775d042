"""Images as the API carries them: base64 PNG in answers (``b64_json``, a chat answer's data URI) and PNG
bytes in requests. One place for the tests, the GPU check and the served references."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

DATA_URI_PREFIX = "data:image/png;base64,"


def pixels(b64: str) -> np.ndarray:
    """The RGB pixels of a base64-encoded image (an answer's ``b64_json``)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def png(image: np.ndarray) -> bytes:
    """``image`` (uint8 RGB) as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def data_uri(image: np.ndarray) -> str:
    """``image`` as a chat message's ``image_url``."""
    return DATA_URI_PREFIX + base64.b64encode(png(image)).decode()


def chat_image(content: Any) -> np.ndarray:
    """The pixels of a chat answer's first content part (an ``image_url`` data URI)."""
    return pixels(content[0]["image_url"]["url"].removeprefix(DATA_URI_PREFIX))
