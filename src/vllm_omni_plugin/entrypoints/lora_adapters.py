"""The LoRA adapters a deployment serves for its diffusion stage's denoiser, by name, as vLLM serves LLM
adapters: named at start-up (``--lora-modules name=path ...``), loaded and unloaded at run time through
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
allows it, listed in ``/v1/models`` (``parent``: the base model), and chosen per request by its ``lora``
field or by ``model`` naming the adapter.

An adapter is checked when it is named, against the model's denoiser built on the meta device (no
weights): a file that is no LoRA of this model, or whose ranks or layer shapes do not match, is refused
then (a one-line start-up error, or 400), never by a stage at run time. Requests carry the adapter's path;
each diffusion replica loads what its requests name (``diffusion/lora.py``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from vllm_omni_plugin.diffusion.lora import LoraError, LoraSpec, check_lora, denoiser_skeleton, read_lora
from vllm_omni_plugin.entrypoints.errors import OmniAPIError

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    """vLLM's switch for loading and unloading adapters while serving."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


class ServedAdapters:
    """Name -> adapter path. ``refusal``: why this deployment cannot apply adapters (None: it can)."""

    def __init__(self, model: str, refusal: str | None) -> None:
        self.model = model
        self.refusal = refusal
        self._paths: dict[str, str] = {}
        self._lock = threading.Lock()
        self._skeleton: Any = None

    @property
    def names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._paths)

    def check(self, name: str, path: str) -> None:
        """Raise :class:`LoraError` when ``path`` is no LoRA this deployment can apply (reads the file and
        builds the denoiser's skeleton: run it off the event loop)."""
        if self.refusal is not None:
            raise LoraError(self.refusal)
        if not name.strip():
            raise LoraError("an adapter needs a name")
        if self._skeleton is None:
            self._skeleton = denoiser_skeleton(self.model)
        check_lora(read_lora(name, path), self._skeleton)

    def add(self, name: str, path: str) -> None:
        """Serve the (checked) adapter under ``name``; a name in use is refused."""
        with self._lock:
            if name in self._paths:
                raise OmniAPIError(
                    f"a LoRA adapter named {name!r} is already loaded; unload it first", param="lora_name"
                )
            self._paths[name] = os.path.abspath(path)

    def remove(self, name: str) -> None:
        with self._lock:
            if self._paths.pop(name, None) is None:
                raise OmniAPIError(f"no LoRA adapter named {name!r} is loaded", status=404, param="lora_name")

    def spec(self, name: str, scale: float, param: str = "lora") -> LoraSpec:
        """The adapter a request names; an unknown name is the client's mistake."""
        if self.refusal is not None:
            raise OmniAPIError(self.refusal, param=param)
        path = self.names.get(name)
        if path is None:
            known = ", ".join(sorted(self.names)) or "none"
            raise OmniAPIError(f"no LoRA adapter named {name!r} (loaded: {known})", param=param)
        return LoraSpec(name=name, path=path, scale=scale)
