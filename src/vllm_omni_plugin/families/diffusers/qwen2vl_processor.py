"""The ``Qwen2VLProcessor`` of Qwen-Image-Edit pipelines, also where torchvision is not installed.

transformers builds and loads a ``Qwen2VLProcessor`` with its video processor, which needs torchvision
(CPU deployments often run without it). Edit pipelines only hand the processor text and images, so
without torchvision :func:`load_qwen2vl_processor` builds the same processor from the folder's tokenizer
and image processor alone; with torchvision it is transformers' own ``from_pretrained``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` for text and images only: it has no video processor to check or load."""

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs
    ):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def load_qwen2vl_processor(folder: str | Path) -> Any:
    if importlib.util.find_spec("torchvision") is not None:
        return Qwen2VLProcessor.from_pretrained(folder)
    return Qwen2VLImageTextProcessor(
        AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    )
