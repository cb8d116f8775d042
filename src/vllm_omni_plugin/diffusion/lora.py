"""LoRA adapters of a diffusion stage's denoiser, a different one (or none) per row of one batch.

An adapter file is what diffusers' ``save_lora_weights`` and PEFT write: safetensors of ``lora_A`` /
``lora_B`` pairs for the denoiser's linear layers, keyed ``transformer.<module>.lora_A.weight`` (or
``unet.``, or PEFT's ``base_model.model.``), with an ``alpha`` per module where the trainer saved one (else
``adapter_config.json``'s ``lora_alpha``, else the rank: scaling 1). A folder holding such a file
(``pytorch_lora_weights.safetensors``, ``adapter_model.safetensors``) is taken too. Text-encoder LoRAs
are not served: only the denoiser's layers.

Rows get their adapter by forward hooks on the targeted layers for the duration of one call
(:class:`AdapterRows`): a layer adds ``B(A(x)) * scaling * scale`` to its output for each row whose
request names an adapter with that layer, exactly PEFT's LoRA forward (``lora_B(lora_A(x)) * scaling``),
so a request's image is the one diffusers gives with the adapter loaded and set to that scale. Calls
whose rows are more than the batch (classifier-free guidance batched as [unconditional, conditional])
apply the mapping to each part. Which rows a hook sees is per thread, so a call on another thread (the
step batcher's) is untouched. In the step loop the same hooks apply per forward, as its row layer
(:class:`AdapterLayer`): each row's request is known there, whatever shares the step.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.step_loop import Forward, LoopLayer

ADAPTER_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")
DENOISER_PREFIXES = ("transformer.", "unet.", "base_model.model.", "diffusion_model.")
MAX_LORAS = 4
"""Adapters a stage keeps loaded at once unless configured (``max_loras``): the least recently used
leaves first."""


class LoraSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A request's adapter: its served name, its file, and the scale it is applied at."""

    name: str
    path: str
    scale: float = 1.0


class LoraError(ValueError):
    """An adapter that is not a LoRA of this model (named in the message)."""


@dataclass(frozen=True)
class LoraLayer:
    down: Any
    """``lora_A``: [rank, in_features]."""
    up: Any
    """``lora_B``: [out_features, rank]."""
    scaling: float
    """``alpha / rank``."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's layers, by the denoiser's module name."""

    name: str
    layers: dict[str, LoraLayer]


def adapter_file(path: str) -> str:
    """The safetensors file of an adapter ``path`` (the file, or a folder holding one)."""
    if os.path.isdir(path):
        for name in ADAPTER_FILES:
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise LoraError(f"{path} holds no LoRA weights ({' or '.join(ADAPTER_FILES)})")
    if not os.path.isfile(path):
        raise LoraError(f"{path}: no such LoRA file or folder")
    return path


def read_lora(name: str, path: str) -> LoraWeights:
    """The adapter's layers (on the CPU, float32); a file that is no denoiser LoRA is a :class:`LoraError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = adapter_file(path)
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraError(f"LoRA {name!r}: {file} is not a safetensors file ({exc})") from None
    default_alpha = _config_alpha(file)
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        module = key
        for prefix in DENOISER_PREFIXES:
            if module.startswith(prefix):
                module = module[len(prefix) :]
                break
        else:
            raise LoraError(
                f"LoRA {name!r}: {key} is not a layer of the denoiser (keys start with "
                f"{', '.join(DENOISER_PREFIXES)}; text-encoder LoRAs are not served)"
            )
        for part, field in ((".lora_A.weight", "down"), (".lora_B.weight", "up"), (".alpha", "alpha")):
            if module.endswith(part):
                pairs.setdefault(module[: -len(part)], {})[field] = tensor
                break
        else:
            raise LoraError(f"LoRA {name!r}: {key} is neither a lora_A, lora_B nor alpha tensor")
    if not pairs:
        raise LoraError(f"LoRA {name!r}: {file} holds no LoRA layers")
    layers = {}
    for module, parts in pairs.items():
        if "down" not in parts or "up" not in parts:
            raise LoraError(f"LoRA {name!r}: {module} has no {'lora_B' if 'down' in parts else 'lora_A'}")
        down, up = parts["down"].float(), parts["up"].float()
        if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
            shapes = f"lora_A {tuple(down.shape)}, lora_B {tuple(up.shape)}"
            raise LoraError(f"LoRA {name!r}: {module}'s ranks differ ({shapes})")
        rank = down.shape[0]
        alpha = float(parts["alpha"]) if "alpha" in parts else default_alpha or float(rank)
        layers[module] = LoraLayer(down, up, alpha / rank)
    return LoraWeights(name, layers)


def _config_alpha(file: str) -> float | None:
    """``lora_alpha`` of a PEFT ``adapter_config.json`` beside the weights."""
    config = os.path.join(os.path.dirname(file), "adapter_config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as handle:
            alpha = json.load(handle).get("lora_alpha")
    except (OSError, ValueError):
        return None
    return float(alpha) if isinstance(alpha, int | float) else None


def check_lora(weights: LoraWeights, denoiser: Any) -> None:
    """Every layer the adapter names is a linear layer of ``denoiser`` of the adapter's shapes (a meta-
    device module does: nothing is computed)."""
    import torch

    modules = dict(denoiser.named_modules())
    for module, layer in weights.layers.items():
        target = modules.get(module)
        what = f"LoRA {weights.name!r}: {module}"
        if not isinstance(target, torch.nn.Linear):
            kind = "no layer" if target is None else f"a {type(target).__name__}, not a linear layer"
            raise LoraError(f"{what} is {kind} of this model's {type(denoiser).__name__}")
        if layer.down.shape[1] != target.in_features or layer.up.shape[0] != target.out_features:
            raise LoraError(
                f"{what} maps {layer.down.shape[1]} -> {layer.up.shape[0]} features; the model's layer maps "
                f"{target.in_features} -> {target.out_features}"
            )


def denoiser_skeleton(model: str) -> Any:
    """The model's denoiser (``transformer``, else ``unet`` in ``model_index.json``) built from its config
    on the meta device: its layers' names and shapes, no weights, for checking adapters where the model is
    not loaded (the API server)."""
    import importlib

    import torch

    with open(os.path.join(model, "model_index.json"), encoding="utf-8") as handle:
        index = json.load(handle)
    name = next((n for n in ("transformer", "unet") if isinstance(index.get(n), list)), None)
    if name is None:
        raise LoraError(f"{model} has no transformer or unet to apply a LoRA to")
    library, class_name = index[name][0], index[name][1]
    module = importlib.import_module(library if library != "diffusers" else "diffusers")
    cls = getattr(module, class_name)
    with torch.device("meta"):
        return cls.from_config(cls.load_config(os.path.join(model, name)))


class LoadedAdapters:
    """The adapters a runner holds on its device, at most ``capacity`` (least recently used out first)."""

    def __init__(self, denoiser: Any, capacity: int = MAX_LORAS) -> None:
        self.denoiser = denoiser
        self.capacity = max(1, capacity)
        self._loaded: OrderedDict[tuple[str, str], LoraWeights] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: LoraSpec) -> LoraWeights:
        key = (spec.name, spec.path)
        with self._lock:
            weights = self._loaded.get(key)
            if weights is not None:
                self._loaded.move_to_end(key)
                return weights
        weights = self._load(spec)
        with self._lock:
            self._loaded[key] = weights
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
        return weights

    def _load(self, spec: LoraSpec) -> LoraWeights:
        read = read_lora(spec.name, spec.path)
        check_lora(read, self.denoiser)
        # the compute dtype: a quantized denoiser's GGUF blocks are bytes, its torchao weights say theirs
        parameter = next(p for p in self.denoiser.parameters() if p.is_floating_point())
        layers = {
            module: LoraLayer(
                layer.down.to(parameter.device, parameter.dtype),
                layer.up.to(parameter.device, parameter.dtype),
                layer.scaling,
            )
            for module, layer in read.layers.items()
        }
        return LoraWeights(spec.name, layers)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self._loaded]


class AdapterLayer(LoopLayer):
    """Per-request adapters as a layer of the step loop's forwards (``diffusion/step_loop.py``): each
    admitted request's adapter is taken from the loaded ones once, and every forward applies it to that
    request's rows, whichever requests share the forward."""

    field = "lora"

    def __init__(self, adapters: LoadedAdapters) -> None:
        self.adapters = adapters
        self.chosen: dict[Any, tuple[LoraWeights, float]] = {}
        """The adapter and scale of each admitted state that names one (kept while it runs, even if
        the least recently used adapter leaves the loaded ones meanwhile)."""

    def admit(self, request: Any, state: Any) -> None:
        if request.lora is not None:
            self.chosen[state] = (self.adapters.get(request.lora), request.lora.scale)

    def leave(self, state: Any) -> None:
        self.chosen.pop(state, None)

    def wrap(self, call: Forward) -> Forward:
        def with_adapters(owners: list[Any], inputs: dict[str, Any]) -> Any:
            with AdapterRows(self.adapters.denoiser, [self.chosen.get(owner) for owner in owners]).applied():
                return call(owners, inputs)

        return with_adapters


_rows = threading.local()
"""Per thread: the running call's adapter per batch row (``AdapterRows``)."""


class AdapterRows:
    """Which adapter (and scale) each row of a call gets: hooks on the layers its adapters name, live for
    the ``with`` block on the calling thread."""

    def __init__(self, denoiser: Any, rows: Sequence[tuple[LoraWeights, float] | None]) -> None:
        self.denoiser = denoiser
        self.rows = list(rows)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        adapters = {id(row[0]): row[0] for row in self.rows if row is not None}
        if not adapters:
            yield
            return
        modules = dict(self.denoiser.named_modules())
        targets = {m for weights in adapters.values() for m in weights.layers}
        handles = [modules[m].register_forward_hook(_hook(m)) for m in sorted(targets)]
        previous = getattr(_rows, "rows", None)
        _rows.rows = self.rows
        try:
            yield
        finally:
            _rows.rows = previous
            for handle in handles:
                handle.remove()


def _hook(module: str) -> Any:
    def hook(layer: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        rows = getattr(_rows, "rows", None)
        if rows is None or not inputs or output.shape[0] % len(rows):
            return output
        x = inputs[0]
        per_row = rows * (output.shape[0] // len(rows))  # guidance batched as parts of the batch
        groups: dict[tuple[int, float], list[int]] = {}
        for index, row in enumerate(per_row):
            if row is not None and module in row[0].layers:
                groups.setdefault((id(row[0]), row[1]), []).append(index)
        if not groups:
            return output
        import torch
        import torch.nn.functional as F

        weights = {id(row[0]): row[0] for row in per_row if row is not None}
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(per_row):
            ((key, scale),) = groups
            layer_weights = weights[key].layers[module]
            return output + F.linear(F.linear(x, layer_weights.down), layer_weights.up) * (
                layer_weights.scaling * scale
            )
        output = output.clone()
        for (key, scale), indices in groups.items():
            layer_weights = weights[key].layers[module]
            chosen = torch.tensor(indices, device=x.device)
            delta = F.linear(F.linear(x.index_select(0, chosen), layer_weights.down), layer_weights.up)
            output.index_add_(0, chosen, delta * (layer_weights.scaling * scale))
        return output

    return hook
