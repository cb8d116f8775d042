"""Wire types of the model endpoints: ``GET /v1/models`` (the served model and its LoRA adapters) and
vLLM's LoRA load/unload bodies."""

from __future__ import annotations

import msgspec
from pydantic import BaseModel, Field


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "vllm-omni-plugin"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (as vLLM lists its adapters)."""
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
