"""Quantized weights of a diffusion stage: its denoiser (and, where asked, its text encoders) through
diffusers' own quantization support, so a 12B DiT fits the GPU people own.

Two ways in, both diffusers':

- **torchao**, applied as the pipeline loads (``PipelineQuantizationConfig`` with diffusers' or
  transformers' ``TorchAoConfig`` per component): the weights of the component's linear layers become
  torchao tensors (int8 or float8 with a scale per output row, int4 per group), which dequantize in the
  matmul or run it in int8 / float8. :data:`SCHEMES` lists them and the devices they run on.
- **GGUF**: the denoiser read from a single-file GGUF checkpoint (the files the ComfyUI community shares:
  Q8_0, Q4_K, ...; diffusers' ``from_single_file`` with ``GGUFQuantizationConfig``), the rest of the
  pipeline from the model directory. Its weights stay in their GGUF blocks and dequantize per forward.

What stays exact: the quantized layers are still ``nn.Linear`` modules (or diffusers' GGUF linear, a
subclass), so per-request LoRA's forward hooks add each adapter's ``B(A(x))`` to their output as before,
and step caching, step batching, the step loop and compiled blocks see a denoiser like any other.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

TorchaoScheme = Literal[
    "int8_weight_only", "int8_dynamic", "float8_weight_only", "float8_dynamic", "int4_weight_only"
]
Scheme = Literal[
    "int8_weight_only", "int8_dynamic", "float8_weight_only", "float8_dynamic", "int4_weight_only", "gguf"
]
INSTALL_HINT = "pip install 'vllm-omni-plugin[quant]'"


@dataclass(frozen=True)
class SchemeInfo:
    """What a torchao scheme is and where it runs."""

    config: str
    """The ``torchao.quantization`` config class."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    cuda_capability: tuple[int, int] | None = None
    """The least CUDA compute capability it runs on; None: any device, CPU included."""
    bfloat16: bool = False
    """Its kernels take bfloat16 activations only."""
    about: str = ""


SCHEMES: dict[str, SchemeInfo] = {
    "int8_weight_only": SchemeInfo(
        "Int8WeightOnlyConfig", about="int8 weights, a scale per output row; any device"
    ),
    "int8_dynamic": SchemeInfo(
        "Int8DynamicActivationInt8WeightConfig",
        about="int8 weights, activations quantized per token at run time (int8 matmuls); any device",
    ),
    "float8_weight_only": SchemeInfo(
        "Float8WeightOnlyConfig", about="float8 (e4m3) weights, a scale per output row; any device"
    ),
    "float8_dynamic": SchemeInfo(
        "Float8DynamicActivationFloat8WeightConfig",
        cuda_capability=(8, 9),
        about="float8 weights and activations (float8 matmuls); CUDA, compute capability 8.9+ (Ada, Hopper)",
    ),
    "int4_weight_only": SchemeInfo(
        "Int4WeightOnlyConfig",
        kwargs=(("group_size", 128), ("int4_packing_format", "tile_packed_to_4d")),
        cuda_capability=(8, 0),
        bfloat16=True,
        about="int4 weights in groups of 128 (tinygemm kernels); CUDA, compute capability 8.0+, bfloat16",
    ),
}
"""The torchao schemes a stage's ``quantization`` may name."""
TEXT_ENCODER_PREFIX = "text_encoder"
DENOISERS = ("transformer", "unet")
"""diffusers' names for a pipeline's denoiser component."""


class QuantizationSpec(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """A diffusion stage's ``quantization``: a scheme for its denoiser and one for its text encoders.

    In a deploy file either the scheme alone (``quantization: int8_weight_only``: the denoiser) or::

        quantization:
          denoiser: gguf
          gguf_file: /models/flux1-dev-Q8_0.gguf
          text_encoders: int8_weight_only
    """

    denoiser: Scheme | None = None
    """How the denoiser's weights are stored: a torchao scheme, or ``gguf`` (read from ``gguf_file``)."""
    text_encoders: TorchaoScheme | None = None
    """A torchao scheme for every text encoder of the pipeline (``text_encoder``, ``text_encoder_2``, ...)."""
    gguf_file: str | None = None
    """``denoiser: gguf``: the denoiser's single-file GGUF checkpoint."""

    def __post_init__(self) -> None:
        if self.denoiser == "gguf" and not self.gguf_file:
            raise ValueError("denoiser: gguf needs gguf_file (the denoiser's .gguf checkpoint)")
        if self.gguf_file and self.denoiser != "gguf":
            raise ValueError("gguf_file is read only with denoiser: gguf")

    @classmethod
    def of(cls, value: str | QuantizationSpec | dict[str, Any] | None) -> QuantizationSpec | None:
        """From a stage's field: a scheme name is the denoiser's."""
        if value is None or isinstance(value, QuantizationSpec):
            return value
        if isinstance(value, str):
            return msgspec.convert({"denoiser": value}, cls)
        return msgspec.convert(value, cls)

    @property
    def active(self) -> bool:
        return self.denoiser is not None or self.text_encoders is not None

    def schemes(self) -> list[str]:
        return [s for s in (self.denoiser, self.text_encoders) if s is not None]

    def describe(self) -> str:
        """``denoiser int8_weight_only, text encoders float8_weight_only``."""
        parts = []
        if self.denoiser is not None:
            parts.append(
                f"denoiser {self.denoiser}" + (f" ({Path(self.gguf_file).name})" if self.gguf_file else "")
            )
        if self.text_encoders is not None:
            parts.append(f"text encoders {self.text_encoders}")
        return ", ".join(parts) or "none"


def check(spec: QuantizationSpec, device: Any, dtype: Any = None) -> None:
    """Raise ``ValueError`` in one line for a scheme this device, dtype or installation cannot run. A
    device without an index (``"cuda"``: the configuration's check, in a process that must not start
    CUDA) and no dtype check what they can without them."""
    import torch

    device = torch.device(device)
    if spec.denoiser == "gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"denoiser: gguf needs the gguf package: {INSTALL_HINT}")
        path = Path(spec.gguf_file or "")
        if not path.is_file():
            raise ValueError(f"gguf_file {spec.gguf_file}: no such file")
    torchao_schemes = [s for s in spec.schemes() if s != "gguf"]
    if torchao_schemes and importlib.util.find_spec("torchao") is None:
        raise ValueError(f"quantization {', '.join(torchao_schemes)} needs torchao: {INSTALL_HINT}")
    for scheme in torchao_schemes:
        info = SCHEMES[scheme]
        if info.cuda_capability is not None:
            need = ".".join(map(str, info.cuda_capability))
            if device.type != "cuda":
                raise ValueError(
                    f"quantization {scheme} runs on CUDA GPUs of compute capability {need} or later, not "
                    f"on {device.type}; int8_weight_only and float8_weight_only run anywhere"
                )
            if device.index is None:
                continue
            have = torch.cuda.get_device_capability(device)
            if have < info.cuda_capability:
                raise ValueError(
                    f"quantization {scheme} needs CUDA compute capability {need} or later; "
                    f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}"
                )
        if info.bfloat16 and dtype is not None and dtype != torch.bfloat16:
            raise ValueError(f"quantization {scheme} runs in bfloat16 only; set the stage's dtype: bfloat16")


def torchao_config(scheme: str) -> Any:
    """The torchao config object of a scheme."""
    import torchao.quantization as tq

    info = SCHEMES[scheme]
    return getattr(tq, info.config)(**dict(info.kwargs))


def pipeline_quantization(spec: QuantizationSpec, components: list[str]) -> Any:
    """diffusers' ``PipelineQuantizationConfig`` for a pipeline of ``components`` (its
    ``model_index.json`` names); None when nothing is quantized at load (GGUF is read on its own)."""
    mapping: dict[str, Any] = {}
    if spec.denoiser is not None and spec.denoiser != "gguf":
        from diffusers import TorchAoConfig

        for name in components:
            if name in DENOISERS:
                mapping[name] = TorchAoConfig(torchao_config(spec.denoiser))
    if spec.text_encoders is not None:
        from transformers import TorchAoConfig as TransformersTorchAoConfig

        for name in components:
            if name.startswith(TEXT_ENCODER_PREFIX):
                mapping[name] = TransformersTorchAoConfig(torchao_config(spec.text_encoders))
    if not mapping:
        return None
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping=mapping)


def gguf_denoiser(model: str, component: str, model_cls: type, gguf_file: str, dtype: Any) -> Any:
    """The denoiser read from ``gguf_file`` (its configuration from the model directory's ``component``
    folder); ``ValueError`` when diffusers cannot read this class or this file."""
    from diffusers import GGUFQuantizationConfig
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    if model_cls.__name__ not in SINGLE_FILE_LOADABLE_CLASSES:
        raise ValueError(
            f"denoiser: gguf: diffusers reads no single-file checkpoint of {model_cls.__name__}; use a "
            "torchao scheme (int8_weight_only)"
        )
    try:
        return model_cls.from_single_file(
            gguf_file,
            quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
            config=model,
            subfolder=component,
            torch_dtype=dtype,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(
            f"gguf_file {gguf_file} is no {model_cls.__name__} checkpoint diffusers reads: {exc}"
        ) from exc


def load_denoiser(
    model_cls: Any, model: str, subfolder: str, dtype: Any, spec: QuantizationSpec | None
) -> Any:
    """The denoiser alone (a CFG- or sequence-parallel peer's), quantized as the stage's own."""
    if spec is not None and spec.denoiser == "gguf":
        assert spec.gguf_file is not None
        return gguf_denoiser(model, subfolder, model_cls, spec.gguf_file, dtype)
    if spec is not None and spec.denoiser is not None:
        from diffusers import TorchAoConfig

        config = TorchAoConfig(torchao_config(spec.denoiser))
        return model_cls.from_pretrained(
            model, subfolder=subfolder, torch_dtype=dtype, quantization_config=config
        )
    return model_cls.from_pretrained(model, subfolder=subfolder, torch_dtype=dtype)


STORED_BYTES: dict[str, tuple[float, int, int | None]] = {
    "int8_weight_only": (1.0, 5, None),
    "int8_dynamic": (1.0, 5, None),
    "float8_weight_only": (1.0, 4, None),
    "float8_dynamic": (1.0, 4, None),
    "int4_weight_only": (0.5, 4, 128),
}
"""How torchao stores each scheme's linear weight: (bytes per weight, bytes per group of inputs, the group's
size; None: a whole row): int8 with a float32 scale and an int8 zero point per output row, float8 with a
float32 scale per row (both measured: ``tests/test_quantization.py``), int4 two weights a byte with a
bfloat16 scale and zero point per group of 128 inputs (not measured here: torchao runs it on CUDA only)."""


def estimated_bytes(components: dict[str, Any], spec: QuantizationSpec | None, element: int) -> int:
    """What a pipeline's components (name -> module, unquantized, on any device, the meta device
    included) take once ``spec`` quantizes them as diffusers does (every ``nn.Linear`` weight of a
    quantized component; everything else at ``element`` bytes). GGUF files are not estimated (their
    blocks vary per tensor): the denoiser counts unquantized."""
    import torch

    from vllm_omni_plugin.diffusion.memory import logical_bytes

    total = 0
    for name, module in components.items():
        if not isinstance(module, torch.nn.Module):  # a scheduler, a tokenizer, an absent part
            continue
        scheme = None
        if spec is not None and name in DENOISERS and spec.denoiser != "gguf":
            scheme = spec.denoiser
        elif spec is not None and name.startswith(TEXT_ENCODER_PREFIX):
            scheme = spec.text_encoders
        total += logical_bytes(module, element)
        if scheme is None:
            continue
        per_weight, per_group, group = STORED_BYTES[scheme]
        for layer in module.modules():
            if isinstance(layer, torch.nn.Linear):
                rows, inputs = layer.weight.shape
                groups = 1 if group is None else -(-inputs // group)
                total += int(rows * inputs * per_weight) + rows * groups * per_group - rows * inputs * element
    return total


def quantized_layers(module: Any) -> int:
    """Parameters of ``module`` stored quantized (torchao tensors, GGUF blocks)."""
    import torch

    return sum(
        1
        for p in module.parameters()
        if type(p) is not torch.nn.Parameter or p.dtype in (torch.uint8, torch.int8)
    )


@dataclass(frozen=True)
class ComponentWeights:
    """One pipeline component's weights as loaded, and what the same tensors take unquantized."""

    name: str
    bytes: int
    unquantized_bytes: int
    """The same tensors at the pipeline's dtype (what the stage would hold without quantization)."""
    quantized: int
    """Its parameters stored quantized."""


def component_weights(name: str, objects: list[Any], dtype: Any) -> ComponentWeights:
    """``objects``' (modules, tensors) bytes now and unquantized."""
    import torch

    from vllm_omni_plugin.diffusion.memory import element_bytes, logical_bytes, tensor_bytes

    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    return ComponentWeights(
        name=name,
        bytes=tensor_bytes(objects),
        unquantized_bytes=sum(logical_bytes(m, element_bytes(dtype)) for m in modules)
        + tensor_bytes(o for o in objects if not isinstance(o, torch.nn.Module)),
        quantized=sum(quantized_layers(m) for m in modules),
    )


def describe_weights(weights: list[ComponentWeights]) -> str:
    """``weights 6.6 MiB: transformer 3.1 MiB (360 tensors quantized: 0.29x of 10.8 MiB), vae ...``."""
    total = sum(w.bytes for w in weights)
    parts = []
    for w in weights:
        text = f"{w.name} {_mib(w.bytes)}"
        if w.quantized:
            ratio = w.bytes / max(1, w.unquantized_bytes)
            text += f" ({w.quantized} tensors quantized: {ratio:.2f}x of {_mib(w.unquantized_bytes)})"
        parts.append(text)
    return f"weights {_mib(total)}: " + ", ".join(parts)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
