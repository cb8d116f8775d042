"""The one reader of a BAGEL model folder (the hub layout of ``ByteDance-Seed/BAGEL-7B-MoT``).

The folder holds ``llm_config.json``, ``vit_config.json`` (also nested in ``config.json``), ``config.json``
with the top-level settings, ``ema.safetensors`` (LLM, ViT, connector, generation heads), ``ae.safetensors``
(the FLUX autoencoder) and the tokenizer files. Like BAGEL's own loader this forces QK-norm, untied
embeddings and Mixture-of-Transformers layers, and drops the ViT's last layer (the checkpoint has one fewer
than its config says). Values the original hard-codes (image transform sizes, autoencoder parameters) are
read from optional ``config.json`` keys with the original's values as defaults (a tiny model shrinks them).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import msgspec

LLM_WEIGHTS_FILE = "ema.safetensors"
VAE_WEIGHTS_FILE = "ae.safetensors"
LATENT_POS_EMBED_KEY = "latent_pos_embed.pos_embed"
VIT_POS_EMBED_KEY = "vit_pos_embed.pos_embed"


class BagelConfigError(ValueError):
    """The model folder is missing something BAGEL needs, or holds contradicting values."""


class LlmConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The Qwen2 language model (both experts share these dimensions)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    qk_norm: bool = True
    """Forced on, as BAGEL's loader does (the hub's llm_config.json predates it)."""
    tie_word_embeddings: bool = False
    """Forced off, as BAGEL's loader does."""
    layer_module: str = "Qwen2MoTDecoderLayer"
    """Forced: every layer carries an understanding and a generation expert."""


class VitConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The SigLIP vision encoder, without its head, with the layers the checkpoint holds."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    """Layers that run: ``vit_config.num_hidden_layers - 1`` (the original loader's rule)."""
    patch_size: int
    image_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str


class VaeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """FLUX autoencoder parameters (the original hard-codes FLUX's; ``config.json`` ``vae_config`` may
    override any of them)."""

    resolution: int = 256
    in_channels: int = 3
    downsample: int = 8
    ch: int = 128
    out_ch: int = 3
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159


class TransformConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ImageTransform(max_image_size, min_image_size, image_stride)`` of the original."""

    max_image_size: int
    """Longest edge at most this."""
    min_image_size: int
    """Shortest edge at least this (then clipped by the longest-edge and pixel limits)."""
    image_stride: int
    """Both edges are multiples of this."""
    max_pixels: int = 14 * 14 * 9 * 1024


VAE_TRANSFORM_DEFAULT = TransformConfig(max_image_size=1024, min_image_size=512, image_stride=16)
VIT_TRANSFORM_DEFAULT = TransformConfig(max_image_size=980, min_image_size=224, image_stride=14)


class SpecialTokens(msgspec.Struct, frozen=True, kw_only=True):
    """BAGEL's ``new_token_ids`` plus the placeholders a serving processor needs."""

    bos: int
    """``<|im_start|>``: opens every text segment of a context."""
    eos: int
    """``<|im_end|>``: closes every text segment; ends generated text."""
    start_of_image: int
    """``<|vision_start|>``: opens every image block (ViT, VAE and the generated latents)."""
    end_of_image: int
    """``<|vision_end|>``: closes every image block."""
    vision_pad: int
    """``<|vision_pad|>``."""
    image_pad: int
    """``<|image_pad|>``: the image placeholder in prompts."""


SPECIAL_TOKEN_TEXT = {
    "bos": "<|im_start|>",
    "eos": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
    "vision_pad": "<|vision_pad|>",
    "image_pad": "<|image_pad|>",
}


class BagelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_dir: str
    llm: LlmConfig
    vit: VitConfig
    vae: VaeConfig
    tokens: SpecialTokens
    latent_patch_size: int
    max_latent_size: int
    """Latent grid side the position table covers (``latent_pos_embed`` has ``max_latent_size**2`` rows)."""
    vit_max_num_patch_per_side: int
    connector_act: str
    interpolate_pos: bool
    timestep_shift: float
    """The config's value (1.0 in the hub); generation takes its shift from the request."""
    visual_gen: bool
    visual_und: bool
    vae_transform: TransformConfig
    vit_transform: TransformConfig

    @property
    def latent_downsample(self) -> int:
        """Pixels per latent token side: autoencoder downsample x latent patch (16)."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def latent_channels(self) -> int:
        return self.vae.z_channels

    @property
    def latent_token_dim(self) -> int:
        """Channels of one patchified latent token (``p * p * z``, 64)."""
        return self.latent_patch_size**2 * self.vae.z_channels

    @property
    def max_image_side(self) -> int:
        """Largest generated height or width in pixels."""
        return self.max_latent_size * self.latent_downsample

    @property
    def llm_weights(self) -> Path:
        return Path(self.model_dir) / LLM_WEIGHTS_FILE

    @property
    def vae_weights(self) -> Path:
        return Path(self.model_dir) / VAE_WEIGHTS_FILE


@functools.lru_cache(maxsize=8)
def cached_bagel_config(model_dir: str) -> BagelConfig:
    """:func:`load_bagel_config`, read once per process (the processors and the thinker ask per request)."""
    return load_bagel_config(model_dir)


def load_bagel_config(model_dir: str | Path) -> BagelConfig:
    """Read a BAGEL model folder; :class:`BagelConfigError` names the file and key when one is wrong."""
    root = Path(model_dir)
    if not root.is_dir():
        raise BagelConfigError(f"{root}: no such BAGEL model directory")
    top = _read_json(root / "config.json") if (root / "config.json").is_file() else {}
    llm_raw = _sub_config(root, top, "llm_config")
    vit_raw = _sub_config(root, top, "vit_config")
    table_sides = _position_table_sides(root / LLM_WEIGHTS_FILE)

    llm = _llm_config(llm_raw)
    vit = _vit_config(vit_raw)
    vae = _vae_config(top.get("vae_config") or {}, root)
    latent_patch_size = _int(top, "latent_patch_size", root / "config.json", default=2)
    max_latent_size = table_sides.get(LATENT_POS_EMBED_KEY) or _int(
        top, "max_latent_size", root / "config.json", default=32
    )
    vit_side = table_sides.get(VIT_POS_EMBED_KEY) or _int(
        top, "vit_max_num_patch_per_side", root / "config.json", default=70
    )
    return BagelConfig(
        model_dir=str(root),
        llm=llm,
        vit=vit,
        vae=vae,
        tokens=read_special_tokens(root),
        latent_patch_size=latent_patch_size,
        max_latent_size=max_latent_size,
        vit_max_num_patch_per_side=vit_side,
        connector_act=str(top.get("connector_act", "gelu_pytorch_tanh")),
        interpolate_pos=bool(top.get("interpolate_pos", False)),
        timestep_shift=float(top.get("timestep_shift", 1.0)),
        visual_gen=bool(top.get("visual_gen", True)),
        visual_und=bool(top.get("visual_und", True)),
        vae_transform=_transform(top, "vae_transform", VAE_TRANSFORM_DEFAULT, root),
        vit_transform=_transform(top, "vit_transform", VIT_TRANSFORM_DEFAULT, root),
    )


def read_special_tokens(model_dir: str | Path) -> SpecialTokens:
    """Token ids from the tokenizer files, read as JSON (no tokenizer library is loaded)."""
    root = Path(model_dir)
    ids: dict[str, int] = {}
    vocab_sources: list[dict[str, Any]] = []
    tokenizer_json = root / "tokenizer.json"
    if tokenizer_json.is_file():
        data = _read_json(tokenizer_json)
        for entry in data.get("added_tokens") or []:
            ids.setdefault(str(entry["content"]), int(entry["id"]))
        vocab_sources.append((data.get("model") or {}).get("vocab") or {})
    tokenizer_config = root / "tokenizer_config.json"
    if tokenizer_config.is_file():
        for token_id, entry in (_read_json(tokenizer_config).get("added_tokens_decoder") or {}).items():
            ids.setdefault(str(entry["content"]), int(token_id))
    if (root / "vocab.json").is_file():
        vocab_sources.append(_read_json(root / "vocab.json"))
    for vocab in vocab_sources:
        for text in SPECIAL_TOKEN_TEXT.values():
            if text not in ids and text in vocab:
                ids[text] = int(vocab[text])
    missing = [text for text in SPECIAL_TOKEN_TEXT.values() if text not in ids]
    if missing:
        raise BagelConfigError(
            f"{root}: the tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json) define no "
            f"{', '.join(missing)}; BAGEL needs them"
        )
    return SpecialTokens(**{field: ids[text] for field, text in SPECIAL_TOKEN_TEXT.items()})


# --- helpers ---------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise BagelConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise BagelConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BagelConfigError(f"{path}: expected a JSON object")
    return data


def _sub_config(root: Path, top: dict[str, Any], name: str) -> tuple[dict[str, Any], Path]:
    """``NAME.json`` as the original loader reads it; else the copy nested in ``config.json``."""
    path = root / f"{name}.json"
    if path.is_file():
        return _read_json(path), path
    nested = top.get(name)
    if isinstance(nested, dict):
        return nested, root / "config.json"
    raise BagelConfigError(f"{root}: neither {name}.json nor a {name!r} object in config.json")


def _int(data: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise BagelConfigError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def _float(data: dict[str, Any], key: str, where: Path, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BagelConfigError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _llm_config(source: tuple[dict[str, Any], Path]) -> LlmConfig:
    raw, where = source
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    if raw.get("head_dim"):
        head_dim = _int(raw, "head_dim", where)
    elif heads > 0 and hidden % heads == 0:
        head_dim = hidden // heads
    else:
        raise BagelConfigError(
            f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    kv_heads = _int(raw, "num_key_value_heads", where, default=heads)
    if kv_heads <= 0 or heads % kv_heads:
        raise BagelConfigError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads"
        )
    return LlmConfig(
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_layers=_int(raw, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(raw, "vocab_size", where),
        rope_theta=_rope_theta(raw, where),
        rms_norm_eps=_float(raw, "rms_norm_eps", where, default=1e-6),
        max_position_embeddings=_int(raw, "max_position_embeddings", where, default=32768),
        hidden_act=str(raw.get("hidden_act", "silu")),
    )


def _rope_theta(raw: dict[str, Any], where: Path) -> float:
    if "rope_theta" in raw:
        return _float(raw, "rope_theta", where)
    params = raw.get("rope_parameters")  # transformers 5 writes it here
    if isinstance(params, dict) and "rope_theta" in params:
        return _float(params, "rope_theta", where)
    return 10000.0


def _vit_config(source: tuple[dict[str, Any], Path]) -> VitConfig:
    raw, where = source
    layers = _int(raw, "num_hidden_layers", where)
    if layers < 2:
        raise BagelConfigError(
            f"{where}: num_hidden_layers {layers}: BAGEL runs num_hidden_layers - 1 ViT layers"
        )
    return VitConfig(
        hidden_size=_int(raw, "hidden_size", where),
        intermediate_size=_int(raw, "intermediate_size", where),
        num_heads=_int(raw, "num_attention_heads", where),
        num_layers=layers - 1,
        patch_size=_int(raw, "patch_size", where),
        image_size=_int(raw, "image_size", where),
        num_channels=_int(raw, "num_channels", where, default=3),
        layer_norm_eps=_float(raw, "layer_norm_eps", where, default=1e-6),
        hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
    )


def _vae_config(raw: dict[str, Any], root: Path) -> VaeConfig:
    where = root / "config.json"
    if not isinstance(raw, dict):
        raise BagelConfigError(f"{where}: vae_config must be an object")
    known = set(VaeConfig.__struct_fields__)
    values = {k: v for k, v in raw.items() if k in known}
    if "ch_mult" in values:
        values["ch_mult"] = tuple(values["ch_mult"])
    try:
        vae = msgspec.convert(values, VaeConfig)
    except msgspec.ValidationError as exc:
        raise BagelConfigError(f"{where}: vae_config: {exc}") from None
    if vae.downsample != 2 ** (len(vae.ch_mult) - 1):
        raise BagelConfigError(
            f"{where}: vae_config downsample {vae.downsample} does not match ch_mult {list(vae.ch_mult)} "
            f"({len(vae.ch_mult)} levels downsample by {2 ** (len(vae.ch_mult) - 1)})"
        )
    if vae.ch % 32 or any((vae.ch * m) % 32 for m in vae.ch_mult):
        raise BagelConfigError(f"{where}: vae_config channels must be multiples of 32 (GroupNorm(32))")
    return vae


def _transform(top: dict[str, Any], key: str, default: TransformConfig, root: Path) -> TransformConfig:
    raw = top.get(key)
    if raw is None:
        return default
    where = root / "config.json"
    if not isinstance(raw, dict):
        raise BagelConfigError(f"{where}: {key} must be an object")
    merged = msgspec.structs.asdict(default) | raw
    try:
        spec = msgspec.convert(merged, TransformConfig)
    except msgspec.ValidationError as exc:
        raise BagelConfigError(f"{where}: {key}: {exc}") from None
    if min(spec.max_image_size, spec.min_image_size, spec.image_stride, spec.max_pixels) <= 0:
        raise BagelConfigError(f"{where}: {key}: sizes must be positive")
    return spec


def _position_table_sides(weights: Path) -> dict[str, int]:
    """Sides of the 2-D position tables stored in the checkpoint (its header only: the 29 GB body is neither
    read nor mapped).

    The weights are the authority: the hub's config.json says ``max_latent_size`` 32 while the released
    table has 64 x 64 rows, and BAGEL's own loader passes 64.
    """
    if not weights.is_file():
        return {}
    from vllm_omni_plugin.models.bagel.weights import read_header  # here: weights.py imports this module

    entries = read_header(weights)
    sides: dict[str, int] = {}
    for key in (LATENT_POS_EMBED_KEY, VIT_POS_EMBED_KEY):
        if key in entries:
            rows = entries[key].shape[0] if entries[key].shape else 0
            side = math.isqrt(rows)
            if side * side != rows:
                raise BagelConfigError(f"{weights}: {key} has {rows} rows, not a square grid")
            sides[key] = side
    return sides
