"""The generic diffusers runner: loads a diffusers pipeline and runs a batch of compatible requests through
one pipeline call. It reads what the pipeline's ``__call__`` takes from its signature (prompt, size, steps,
generators, output type; guidance, negative prompt and a source image where the signature has them). A
family that differs (Qwen-Image's ``true_cfg_scale``, GLM-Image's prior tokens) is one small subclass
registered by dotted path in ``diffusion/diffusers_registry.py``, which also chooses the runner of a model.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from vllm_omni_plugin.diffusion.blocks import CompileSpec, repeated_blocks
from vllm_omni_plugin.diffusion.cfg_parallel import ParallelDenoiserLayer
from vllm_omni_plugin.diffusion.diffusers_registry import (
    CALL_ARGUMENTS,
    STEP_FAMILIES,
    call_parameters,
    checked_pipeline_class,
    companion_class,
    model_components,
    pipeline_class_name,
)
from vllm_omni_plugin.diffusion.lora import AdapterLayer, AdapterRows, LoadedAdapters
from vllm_omni_plugin.diffusion.memory import (
    TILED_OUTPUT_WIDTHS,
    DecodePlan,
    transformer_block_bytes,
    vae_decode_bytes,
    vae_tile_pixels,
)
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.preview_decoder import PreviewDecoder
from vllm_omni_plugin.diffusion.previews import CallPreviews, PreviewLayer
from vllm_omni_plugin.diffusion.runner import (
    BatchAborted,
    BatchOutput,
    DiffusionDefaults,
    DiffusionRunner,
    ModelDefaults,
    SizeLimits,
    StepCallback,
    StopCheck,
    preview_steps,
)
from vllm_omni_plugin.diffusion.step_batching import DecodeCalls, GroupVae, SameValue
from vllm_omni_plugin.diffusion.step_cache import CachedDenoiser, CallCache, StepCacheLayer
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.cfg_parallel import PairedBranches
    from vllm_omni_plugin.diffusion.peer_group import PeerSpec
    from vllm_omni_plugin.diffusion.quantization import QuantizationSpec
    from vllm_omni_plugin.diffusion.step_batching import ArgumentJoin, StepBatcher

logger = get_logger(__name__)

SHARED_DENOISER_ARGUMENTS = ("txt_ids", "img_ids")
"""Denoiser arguments of the diffusers families that are one value for the whole call, not per row."""
DEFAULT_TEXT_TOKENS = 512
"""Prompt tokens a pipeline's transformer attends to when its ``__call__`` names no
``max_sequence_length`` default (T5-conditioned pipelines pad to 256 or 512)."""


@dataclass(frozen=True, slots=True)
class DenoiserShape:
    """What a pipeline's activation memory follows, read from its modules' configs (no weights needed:
    meta-device modules give the same)."""

    hidden: int
    """Width of the denoiser's token stream (heads x head size)."""
    ff_inner: int
    """Width of its widest feed-forward (before the down projection)."""
    patch_pixels: int
    """Image pixels per token side (the VAE's scale times the patch, packing included)."""
    decoder_channels: int
    """Channels of the VAE decoder at full resolution (its last upsampled level)."""
    element: int
    vae_element: int
    guidance_embedded: bool
    """The transformer takes guidance as an input (FLUX's distilled guidance): one pass, not two."""
    frames_per_token: int = 0
    """A video denoiser's frames per token (its VAE's temporal compression times its temporal patch; 0: an
    image denoiser)."""

    def image_tokens(self, height: int, width: int, frames: int | None = None) -> int:
        """Tokens of an image, or of a video of ``frames`` frames (its first frame a latent frame of its
        own, as causal video VAEs encode it)."""
        tokens = -(-height // self.patch_pixels) * -(-width // self.patch_pixels)
        if self.frames_per_token and frames:
            tokens *= (frames - 1) // self.frames_per_token + 1
        return tokens


def denoiser_attribute(pipe: Any) -> str | None:
    """The pipeline attribute its denoiser is: ``transformer``, else ``unet`` (None: neither)."""
    # Optional attributes of a diffusers pipeline: a class has the one its architecture uses.
    return next((name for name in ("transformer", "unet") if getattr(pipe, name, None) is not None), None)


def denoiser_of(pipe: Any) -> Any:
    """The pipeline's denoiser module (``None``: it has neither a transformer nor a unet)."""
    name = denoiser_attribute(pipe)
    return None if name is None else getattr(pipe, name)


def denoiser_shape(pipe: Any) -> DenoiserShape:
    """The :class:`DenoiserShape` of a loaded (or meta-device) diffusers pipeline."""
    import math

    model = denoiser_of(pipe)
    if model is None:
        raise ValueError(f"{type(pipe).__name__} has neither a transformer nor a unet")
    cfg = dict(model.config)
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
    hidden = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else 0
    if hidden <= 0:  # a UNet: its widest level (an overestimate: that level runs at a lower resolution)
        hidden = max(cfg.get("block_out_channels") or [1280])
    widths = [m.net[-1].in_features for m in model.modules() if type(m).__name__ == "FeedForward"]
    vae_cfg = dict(pipe.vae.config)
    latent = vae_cfg.get("latent_channels") or vae_cfg.get("z_dim") or cfg.get("in_channels") or 4
    in_channels = cfg.get("in_channels") or latent
    patch, frame_patch = _patch(cfg)
    if in_channels != latent and in_channels % latent == 0:  # latents packed into tokens (FLUX, Qwen-Image)
        patch = math.isqrt(in_channels // latent)
    temporal = video_frame_step(pipe)
    return DenoiserShape(
        hidden=hidden,
        ff_inner=max(widths, default=4 * hidden),
        patch_pixels=spatial_scale(pipe) * max(1, patch),
        decoder_channels=_decoder_channels(vae_cfg),
        element=next(model.parameters()).element_size(),
        vae_element=next(pipe.vae.parameters()).element_size(),
        guidance_embedded=bool(cfg.get("guidance_embeds")),
        frames_per_token=temporal * frame_patch,
    )


def _patch(cfg: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) patch of a denoiser's config: an int for images, (t, h, w) for videos (Wan)."""
    patch = cfg.get("patch_size")
    if isinstance(patch, list | tuple) and len(patch) == 3:
        return int(patch[1]), int(patch[0])
    return (patch if isinstance(patch, int) else 1), 1


def spatial_scale(pipe: Any) -> int:
    """Pixels per latent side: ``vae_scale_factor`` (image pipelines) or ``vae_scale_factor_spatial``
    (video pipelines); 8 where the pipeline states neither."""
    # Optional attributes of a diffusers pipeline: image pipelines have the first, video ones the second.
    for name in ("vae_scale_factor", "vae_scale_factor_spatial"):
        value = getattr(pipe, name, None)
        if isinstance(value, int):
            return value
    return 8


def video_frame_step(pipe: Any) -> int:
    """A video pipeline's frames per latent frame (its VAE's temporal compression: frame counts are
    ``k * step + 1``); 0 for a pipeline that makes images (its call takes no ``num_frames``)."""
    if "num_frames" not in call_parameters(type(pipe)):
        return 0
    step = getattr(pipe, "vae_scale_factor_temporal", None)  # optional, as above
    return step if isinstance(step, int) and step > 0 else 1


def _decoder_channels(vae_cfg: dict[str, Any]) -> int:
    """The decoder's channels at full resolution: those of the level above the finest (its upsample
    writes them at full resolution); 512 when the config says neither way."""
    levels = vae_cfg.get("block_out_channels")
    if levels:
        return int(levels[min(1, len(levels) - 1)])
    base, mult = vae_cfg.get("base_dim"), vae_cfg.get("dim_mult")
    if base and mult:
        return int(base * mult[min(1, len(mult) - 1)])
    return 512


def _default(params: Mapping[str, inspect.Parameter], name: str, kind: type) -> Any:
    """The signature's default of ``name`` when it is a number (``None`` otherwise)."""
    param = params.get(name)
    value = None if param is None else param.default
    if isinstance(value, int | float) and not isinstance(value, bool):
        return kind(value)
    return None


class DiffusersPipelineRunner(DiffusionRunner):
    """Loads one diffusers pipeline and runs batches of compatible requests through it.

    The engine hands :meth:`run` complete requests that share :meth:`batch_key` (size, steps, guidance,
    image-to-image-ness and :meth:`call_key`), with one seeded ``torch.Generator`` per request. Used as is,
    it is the generic runner of any pipeline whose ``__call__`` takes :data:`CALL_ARGUMENTS`: the request's
    guidance goes to ``guidance_argument``, its negative prompt and its one source image
    (``image_argument``) where the signature takes them; its model's defaults (steps, guidance, size) are
    the pipeline's own (:meth:`model_defaults`). Subclasses set ``pipeline_class`` and, as
    needed, the class attributes below and :meth:`load_overrides`, :meth:`validate`, :meth:`call_key`,
    :meth:`call_kwargs`. ``run`` asks ``should_stop`` after every step.

    A request with source images that the pipeline itself does not take (a variation or an edit of a
    text-to-image model), or with a mask, runs on diffusers' image-to-image or inpainting pipeline of the
    same family (:meth:`task_pipeline`), built once from the loaded pipeline's components.
    """

    request_type = DiffusionRequest

    pipeline_class: ClassVar[str] = ""
    """The diffusers class name, as in ``model_index.json`` ``_class_name`` ("": the model's own)."""
    load_kwargs: ClassVar[dict[str, Any]] = {}
    """Extra ``from_pretrained`` arguments (e.g. components to skip)."""
    guidance_argument: ClassVar[str] = "guidance_scale"
    """The ``__call__`` argument a request's ``guidance_scale`` goes to."""
    image_argument: ClassVar[str] = "image"
    """The ``__call__`` argument a request's source images go to."""
    needs_images: ClassVar[bool] = False
    """The pipeline cannot run without a source image (an edit pipeline)."""
    max_images: ClassVar[int | None] = 1
    """Source images a request may have (``None``: any number)."""
    prompt_token_limit: ClassVar[int | None] = None
    """The most prompt tokens its text encoder takes where the pipeline encodes a prompt whole (the
    server refuses longer prompts before any stage runs); None where the pipeline truncates prompts to
    its encoders' lengths itself (SD3, FLUX: CLIP's 77 tokens, T5's ``max_sequence_length``)."""
    prompt_tokenizer: ClassVar[str] = "tokenizer"
    """The model folder's tokenizer that counts them."""
    # Set on a subclass to fix them; left None, they come from the pipeline's signature and config.
    default_num_inference_steps: int | None = None
    default_guidance_scale: float | None = None
    default_size: ClassVar[tuple[int, int] | None] = None
    """``(height, width)`` its model makes when a request gives none (None: the pipeline's own)."""
    size_required: ClassVar[bool] = False
    """The model states no default size, not even the pipeline's (its pipeline says which)."""
    supports_negative_prompt: bool | None = None
    supports_image_to_image: bool | None = None
    batched_guidance: ClassVar[bool] = True
    """Guidance runs the conditional and unconditional passes as one batch of twice the rows (SD3's
    classifier-free guidance), unless the transformer embeds guidance; False where the pipeline runs them
    one after the other (Qwen-Image's true CFG, GLM-Image)."""

    def __init__(self, pipe: Any, *, device: Any, dtype: Any) -> None:
        cls = type(self)
        self.pipe = pipe
        self._encode_lock = threading.Lock()
        """Held while a group encodes its prompts (:meth:`_one_at_a_time`)."""
        self._encoding = threading.local()
        """Seconds the calling thread's pipeline call spent encoding prompts (``seconds``)."""
        self._encodes: dict[int, Callable[..., Any]] = {}
        """Each loaded pipeline's own ``encode_prompt`` (by ``id``), before :meth:`_time_encoding`."""
        self._time_encoding(pipe)
        self._vae_lock = threading.Lock()
        """Held while a VAE that keeps state (:func:`vae_keeps_state`) encodes or decodes for a group, or
        decodes a group's preview."""
        self._preview_decoder = PreviewDecoder(getattr(pipe, "vae", None))
        self._decode_flags_lock = threading.Lock()
        """Held while a decode runs with the slicing and tiling flags its :meth:`decode_plan` set."""
        self._plan_decodes()
        self._companions: dict[type, Any] = {}
        """diffusers' pipelines of the family for the tasks ``pipe`` does not do, by class (built once)."""
        self._companions_lock = threading.Lock()
        self.device = device
        self.dtype = dtype
        self.pipeline_class = cls.pipeline_class or type(pipe).__name__
        params = call_parameters(type(pipe))
        self.call_arguments = frozenset(params)
        self.default_num_inference_steps, self.default_guidance_scale = cls.call_defaults(params)
        """What the pipeline's call does with steps and guidance left out (a warm-up's, a bare request's)."""
        self.supports_negative_prompt, self.supports_image_to_image = cls.input_support(params)
        self.text_tokens = _default(params, "max_sequence_length", int) or DEFAULT_TEXT_TOKENS
        """Prompt tokens the transformer attends to (the pipeline's ``max_sequence_length`` default)."""
        self.frame_step = video_frame_step(pipe)
        """A video pipeline's frames per latent frame (0: it makes images)."""
        self.step_cache = "callback_on_step_end" in self.call_arguments
        """Caching counts the steps by the pipeline's step-end callback (a pipeline without one never
        calls ``on_step``)."""

    @classmethod
    def call_defaults(cls, params: Mapping[str, inspect.Parameter]) -> tuple[int, float | None]:
        """(steps, guidance) the pipeline's call uses when given none: the class's, else its signature's
        (50 steps where the signature names none)."""
        steps = cls.default_num_inference_steps or _default(params, "num_inference_steps", int) or 50
        guidance = cls.default_guidance_scale
        if guidance is None:
            guidance = _default(params, cls.guidance_argument, float)
        return steps, guidance

    @classmethod
    def model_defaults(cls, model: str) -> ModelDefaults:
        """Steps and guidance from the pipeline's class, its default size and size limits from its
        components' configs: the pipeline built on the meta device (no weights), read as a loaded one."""
        return _model_defaults(cls, model)

    @classmethod
    def input_support(cls, params: Mapping[str, inspect.Parameter]) -> tuple[bool, bool]:
        """(takes a negative prompt, takes source images), from the class or else the signature."""
        negative = cls.supports_negative_prompt
        images = cls.supports_image_to_image
        return (
            "negative_prompt" in params if negative is None else negative,
            cls.image_argument in params if images is None else images,
        )

    @classmethod
    def task_pipeline(cls, pipeline_cls: type, task: str) -> type | None:
        """The pipeline class that runs a request of ``task`` (``diffusers_registry.TASKS``) for a model of
        ``pipeline_cls``: the class itself where its call does it, else diffusers' image-to-image or
        inpainting pipeline of its family; None where neither can."""
        params = call_parameters(pipeline_cls)
        inpainting = "mask_image" in params and cls.image_argument in params
        if task == "mask":
            return pipeline_cls if inpainting else companion_class(pipeline_cls, task)
        if inpainting:  # an inpainting model (FLUX.1 Fill): every request has its mask
            return None
        if task == "text":
            image = params.get(cls.image_argument)
            required = image is not None and image.default is inspect.Parameter.empty  # image-to-video
            return None if cls.needs_images or required else pipeline_cls
        if cls.input_support(params)[1]:
            return pipeline_cls
        return companion_class(pipeline_cls, task)

    def _shared(self, pipe: Any) -> bool:
        """``pipe`` is the runner's own pipeline or one of its companions (a call changes a copy)."""
        return pipe is self.pipe or any(pipe is c for c in self._companions.values())

    @staticmethod
    def task_of(request: DiffusionRequest) -> str:
        return "mask" if request.mask is not None else "images" if request.images else "text"

    def pipeline_for(self, request: DiffusionRequest) -> Any:
        """The loaded pipeline that runs ``request``: the runner's own, or the family's companion for its
        task, built from the own one's components on first use."""
        task = self.task_of(request)
        cls = self.task_pipeline(type(self.pipe), task)
        if cls is None or cls is type(self.pipe):
            return self.pipe
        with self._companions_lock:
            companion = self._companions.get(cls)
            if companion is None:
                companion = cls.from_pipe(self.pipe)
                companion.set_progress_bar_config(disable=True)
                self._time_encoding(companion)
                logger.info("%s runs %s requests with %s (same components)", self.label, task, cls.__name__)
                self._companions[cls] = companion
        return companion

    def _time_encoding(self, pipe: Any) -> None:
        """``pipe``'s prompt encoding timed for the call's ``encode`` (``/metrics``): every text-conditioned
        diffusers pipeline has an ``encode_prompt``; its own is kept for step-batched groups."""
        encode = getattr(pipe, "encode_prompt", None)
        if encode is not None:
            self._encodes[id(pipe)] = encode
            pipe.__dict__["encode_prompt"] = self._timed(encode)

    @classmethod
    def missing_call_arguments(cls, pipeline_cls: type) -> list[str]:
        """What :meth:`run` passes that ``pipeline_cls.__call__`` does not take (empty: drivable)."""
        params = call_parameters(pipeline_cls)
        return [name for name in CALL_ARGUMENTS if name not in params]

    @classmethod
    def load_overrides(cls, model: str) -> dict[str, Any]:
        """``from_pretrained`` arguments for this model (``load_kwargs`` unless a family needs more)."""
        return dict(cls.load_kwargs)

    @property
    def label(self) -> str:
        return self.pipeline_class

    @classmethod
    def diffusers_class(cls, model: str) -> tuple[str, type]:
        """The diffusers pipeline class it runs ``model`` with (its name, and the class)."""
        name = cls.pipeline_class or pipeline_class_name(model)
        return name, checked_pipeline_class(name, cls)

    @classmethod
    def load(
        cls, model: str, *, dtype: Any, device: Any, quantization: QuantizationSpec | None = None
    ) -> DiffusersPipelineRunner:
        """``from_pretrained`` on the model directory (or hub id), moved to ``device``; with
        ``quantization``, its denoiser (and text encoders) quantized as diffusers loads them."""
        name, pipeline_cls = cls.diffusers_class(model)
        start = time.perf_counter()
        overrides = cls.load_overrides(model)
        if quantization is not None and quantization.active:
            overrides.update(cls.quantized_loading(model, quantization, dtype))
        pipe = pipeline_cls.from_pretrained(model, dtype=dtype, **overrides)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        logger.info(
            "loaded %s from %s (%s, %s%s) in %.2f s",
            name,
            model,
            dtype,
            device,
            f", quantized: {quantization.describe()}"
            if quantization is not None and quantization.active
            else "",
            time.perf_counter() - start,
        )
        runner = cls(pipe, device=device, dtype=dtype)
        runner.quantization = quantization
        return runner

    @classmethod
    def quantized_loading(cls, model: str, spec: QuantizationSpec, dtype: Any) -> dict[str, Any]:
        """``from_pretrained`` arguments that quantize: diffusers' ``quantization_config`` for the torchao
        components, the denoiser itself when it comes from a GGUF file."""
        from vllm_omni_plugin.diffusion import quantization

        components = model_components(model)
        kwargs: dict[str, Any] = {}
        config = quantization.pipeline_quantization(spec, list(components))
        if config is not None:
            kwargs["quantization_config"] = config
        if spec.denoiser == "gguf":
            assert spec.gguf_file is not None
            name = next((n for n in quantization.DENOISERS if n in components), None)
            if name is None:
                raise ValueError(f"denoiser: gguf: {model} has no transformer or unet component")
            library, class_name = components[name]
            model_cls = getattr(importlib.import_module(library), class_name)
            kwargs[name] = quantization.gguf_denoiser(model, name, model_cls, spec.gguf_file, dtype)
        return kwargs

    # --- per-request hooks -------------------------------------------------------------------------

    def validate(self, request: DiffusionRequest) -> None:
        """Raise ``ValueError`` naming what is wrong; run before batching, so one bad request fails alone."""
        images = len(request.images or [])
        task = self.task_of(request)
        runs_it = self.task_pipeline(type(self.pipe), task)
        repaints_only = self.task_pipeline(type(self.pipe), "mask") is type(self.pipe)
        if task != "mask" and repaints_only:
            raise ValueError(
                f"{self.pipeline_class} repaints the masked area of a source image: the request needs an "
                "image and a mask"
            )
        if task == "images" and runs_it is None:
            raise ValueError(f"{self.pipeline_class} runs text-to-image only; this request has source images")
        if task == "mask" and runs_it is None:
            edits = self.task_pipeline(type(self.pipe), "images") is not None
            can = "edits of source images" if edits else "text-to-image"
            raise ValueError(
                f"{self.pipeline_class} cannot repaint a masked area (diffusers has no inpainting pipeline "
                f"of its family); it runs {can} without a mask"
            )
        if task == "mask":
            if images != 1:
                raise ValueError("a mask goes with exactly one source image")
            height, width = image_size(request.images[0])
            if tuple(request.mask.shape) != (height, width):
                raise ValueError(
                    f"the mask is {request.mask.shape[1]}x{request.mask.shape[0]} (uint8 HxW), its image "
                    f"{width}x{height}: they must match"
                )
        takes_strength = runs_it is not None and "strength" in call_parameters(runs_it)
        if request.strength is not None and not takes_strength:
            what = runs_it.__name__ if runs_it is not None else self.pipeline_class
            raise ValueError(f"{what} takes no strength; leave strength unset")
        if self.needs_images and not images:
            raise ValueError(f"{self.pipeline_class} edits an image: the request needs a source image")
        if self.max_images is not None and images > self.max_images:
            raise ValueError(
                f"{self.pipeline_class} takes at most {self.max_images} source image(s) per request, "
                f"got {images}"
            )
        if request.num_frames is not None and not self.frame_step:
            raise ValueError(f"{self.pipeline_class} makes images; leave num_frames unset")
        if request.negative_prompt and not self.supports_negative_prompt:
            raise ValueError(f"{self.pipeline_class} takes no negative prompt; leave negative_prompt unset")
        if request.guidance_scale is not None and self.guidance_argument not in self.call_arguments:
            raise ValueError(f"{self.pipeline_class} takes no {self.guidance_argument}; leave guidance unset")
        if request.lora is not None:
            self.adapters.get(request.lora)  # loaded now: an adapter that is no LoRA of it fails alone

    # --- LoRA adapters ----------------------------------------------------------------------------------

    lora = True

    @functools.cached_property
    def adapters(self) -> LoadedAdapters:
        """The LoRA adapters its denoiser's rows may run with (``max_loras`` of them loaded)."""
        return LoadedAdapters(denoiser_of(self.pipe), self.context.max_loras)

    def _adapter_rows(self, batch: list[DiffusionRequest], denoiser: Any) -> AdapterRows:
        rows = [(self.adapters.get(r.lora), r.lora.scale) if r.lora is not None else None for r in batch]
        return AdapterRows(denoiser, rows)

    def batch_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        """Size, steps, guidance and image-to-image-ness, then what the family adds (:meth:`call_key`)."""
        common = (
            request.height,
            request.width,
            request.num_inference_steps,
            float(request.guidance_scale or 0.0),
            request.image_to_image,
            request.mask is not None,
            request.strength,
            request.num_frames,
        )
        return common + tuple(self.call_key(request))

    def call_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        """What else (beyond size, steps, guidance, i2i) must match for requests to share a call: whether
        a negative prompt is given (``None`` and ``""`` differ for pipelines whose guidance needs one)
        and the source images' sizes (a pipeline resizes a batch's images to one size); an image-to-video
        request shares no call (diffusers' video pipelines encode one source frame per call)."""
        alone = request.request_id if self.frame_step and request.images else None
        return (
            request.negative_prompt is not None,
            tuple(image_size(i) for i in request.images or []),
            alone,  # a video pipeline conditions a call on one source frame: each image-to-video runs alone
        )

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        """Pipeline arguments beyond prompt, size, steps, guidance, generators and output type."""
        kwargs: dict[str, Any] = {}
        if self.supports_negative_prompt and batch[0].negative_prompt is not None:
            kwargs["negative_prompt"] = [r.negative_prompt or "" for r in batch]
        if batch[0].images:  # validate let them through: the batch's pipeline takes them
            kwargs[self.image_argument] = [as_pil(r.images[0]) for r in batch if r.images]
        if batch[0].mask is not None:
            import PIL.Image

            kwargs["mask_image"] = [PIL.Image.fromarray(r.mask) for r in batch]
        if batch[0].strength is not None:
            kwargs["strength"] = batch[0].strength
        return kwargs

    # --- memory ------------------------------------------------------------------------------------

    def steps_of(self, request: DiffusionRequest) -> int | None:
        return request.num_inference_steps

    def describe_request(self, request: DiffusionRequest) -> str:
        if request.num_frames:
            return f"a {request.height}x{request.width} video of {request.num_frames} frames"
        return f"a {request.height}x{request.width} image"

    def weight_tensors(self) -> list[Any]:
        """The pipeline's modules (what its weights are, counted where no allocator counts them)."""
        import torch

        return [c for c in self.pipe.components.values() if isinstance(c, torch.nn.Module)]

    def weight_components(self) -> dict[str, list[Any]]:
        import torch

        return {n: [c] for n, c in self.pipe.components.items() if isinstance(c, torch.nn.Module)}

    @functools.cached_property
    def memory_shape(self) -> DenoiserShape:
        return denoiser_shape(self.pipe)

    def source_pixels(self, request: DiffusionRequest) -> list[int]:
        """Pixels of each source image as the pipeline encodes it (their own size unless resized)."""
        return [h * w for h, w in (image_size(i) for i in request.images or [])]

    def activation_bytes(self, batch: list[DiffusionRequest]) -> int:
        """Estimated peak activations of ``batch`` (one batch key) as one call: the
        largest of its phases (:meth:`activation_phases`), which follow one another."""
        return max(self.activation_phases(batch).values())

    def activation_phases(self, batch: list[DiffusionRequest]) -> dict[str, int]:
        """Estimated peak of each phase of the call: ``encode`` (the VAE over the largest source image),
        ``denoise`` (one transformer block over every row: image, prompt and source-image tokens; twice
        the rows where guidance is batched; and beside it the VAE over the rows that ask for previews,
        which are decoded while the steps go on) and ``decode`` (the VAE over the whole batch)."""
        shape = self.memory_shape
        first = batch[0]
        guided = (first.guidance_scale or 0.0) > 1.0 and self.batched_guidance and not shape.guidance_embedded
        rows = len(batch) * (2 if guided else 1)
        sources = [self.source_pixels(r) for r in batch]
        tokens = (
            shape.image_tokens(first.height, first.width, first.num_frames)
            + self.prompt_tokens(batch)
            + max(sum(p) // shape.patch_pixels**2 for p in sources)
        )
        largest_source = max((max(p, default=0) for p in sources), default=0)
        return {
            "encode": vae_decode_bytes(1, largest_source, shape.decoder_channels, shape.vae_element),
            "denoise": transformer_block_bytes(rows, tokens, shape.hidden, shape.ff_inner, shape.element)
            + vae_decode_bytes(
                sum(1 for r in batch if r.partial_images),
                first.height * first.width,
                shape.decoder_channels,
                shape.vae_element,
            ),
            "decode": self.decode_bytes(
                len(batch),
                first.height,
                first.width,
                self.decode_plan(len(batch), first.height, first.width, first.num_frames or 1),
                first.num_frames or 1,
            ),
        }

    @property
    def tiles_decode(self) -> bool:
        """Its VAE decodes in tiles and slices (diffusers' ``enable_tiling`` / ``enable_slicing``)."""
        vae = getattr(self.pipe, "vae", None)
        return vae is not None and hasattr(vae, "use_tiling") and hasattr(vae, "use_slicing")

    def decode_plan(self, images: int, height: int, width: int, frames: int = 1) -> DecodePlan:
        """How ``images`` latents of a ``height`` x ``width`` image (or video of ``frames`` frames) decode:
        ``whole`` (one call), ``sliced`` (one image at a time) or ``tiled`` (overlapping tiles of the VAE's
        tile size, blended): with ``vae_tiling: auto``, the least of those whose estimate fits the stage's
        memory budget."""
        tiling, budget = self.context.vae_tiling, self.context.decode_budget
        if not self.tiles_decode or tiling == "never":
            return "whole"
        if tiling == "always":
            return "tiled"
        if budget is None or self.decode_bytes(images, height, width, "whole", frames) <= budget:
            return "whole"
        if images > 1 and self.decode_bytes(images, height, width, "sliced", frames) <= budget:
            return "sliced"
        return "tiled"

    def decode_bytes(self, images: int, height: int, width: int, plan: DecodePlan, frames: int = 1) -> int:
        """Estimated peak of decoding ``images`` images so: the decoder over all of them, one of them, or
        one tile (of the VAE's tile size and its overlap) with the finished tiles' pixels kept beside it.
        A video VAE decodes one latent frame (``frame_step`` frames) at a time, its causal caches carrying
        the rest: its decoder's activations are those of a chunk of frames, beside the frames decoded so
        far (kept whole, and once more as the float array the pipeline post-processes)."""
        shape = self.memory_shape
        pixels = height * width
        held, chunk = 0, 1
        if self.frame_step:
            held = images * frames * pixels * 3 * shape.vae_element * 2
            chunk = min(frames, self.frame_step)
        if plan == "whole":
            return vae_decode_bytes(images, pixels * chunk, shape.decoder_channels, shape.vae_element) + held
        if plan == "sliced":
            return vae_decode_bytes(1, pixels * chunk, shape.decoder_channels, shape.vae_element) + held
        tile = min(pixels, vae_tile_pixels(self.pipe.vae)) * chunk
        return (
            vae_decode_bytes(1, tile, shape.decoder_channels, shape.vae_element)
            + TILED_OUTPUT_WIDTHS * pixels * chunk * shape.vae_element
            + held
        )

    def _plan_decodes(self) -> None:
        """Every decode of the pipeline's VAE (the pipeline's own, the step loop's, a decode batcher's)
        runs with the slicing and tiling its :meth:`decode_plan` picks, set for that call alone."""
        if not self.tiles_decode:
            return
        vae = self.pipe.vae
        decode, scale = vae.decode, spatial_scale(self.pipe)

        def planned(z: Any, *args: Any, **kwargs: Any) -> Any:
            frames = (int(z.shape[2]) - 1) * self.frame_step + 1 if self.frame_step and z.ndim == 5 else 1
            plan = self.decode_plan(
                int(z.shape[0]), int(z.shape[-2]) * scale, int(z.shape[-1]) * scale, frames
            )
            with self._decode_flags_lock:
                kept = vae.use_slicing, vae.use_tiling
                vae.use_slicing, vae.use_tiling = plan != "whole", plan == "tiled"
                try:
                    return decode(z, *args, **kwargs)
                finally:
                    vae.use_slicing, vae.use_tiling = kept

        vae.__dict__["decode"] = planned

    def step_tokens(self, request: DiffusionRequest) -> int:
        """Its image tokens, twice with classifier-free guidance (a second row, or a second call). A
        request without a size (its pipeline draws one from its source) counts one token."""
        shape = self.memory_shape
        guided = (request.guidance_scale or 0.0) > 1.0 and not shape.guidance_embedded
        height, width = request.height, request.width
        tokens = shape.image_tokens(height, width, request.num_frames) if height and width else 1
        return tokens * (2 if guided else 1)

    def prompt_tokens(self, batch: list[DiffusionRequest]) -> int:
        """Prompt tokens each row of the batch carries into the transformer."""
        return self.text_tokens

    # --- the call ----------------------------------------------------------------------------------

    step_batching = True

    def step_family(self) -> Any:
        """The pipeline's step-loop pieces, with this runner's adapters, a parallel replica's group,
        previews and step caching as their layers."""
        path = STEP_FAMILIES.get(type(self.pipe).__name__)
        if path is None:
            return None
        family = import_object(path)(self.pipe, layers=[AdapterLayer(self.adapters)])
        family.layers += [
            ParallelDenoiserLayer(lambda: self.context.parallel_denoiser),
            PreviewLayer(family.decode, family.steps, family.estimate, lambda: self.context.on_preview),
            StepCacheLayer(
                family.steps,
                self.step_joins(),
                self.cache_blocks,
                lambda: self.context.on_cache_counts,
                passes=self.cache_passes,
            ),  # fmt: skip
        ]
        return family

    def run(
        self, batch: list[DiffusionRequest], generators: list[Any], should_stop: StopCheck | None = None
    ) -> BatchOutput:
        """One pipeline call for the whole batch; images as uint8 HxWx3 arrays, in batch order. Raises
        :class:`BatchAborted` at the end of the first step after which ``should_stop()`` is true."""
        pipe = own = self.pipeline_for(batch[0])
        if self._previewing(batch):  # its own scheduler: the previews wrap its step for this call
            import copy

            pipe = copy.copy(own)
            pipe.__dict__["scheduler"] = copy.deepcopy(own.scheduler)
        return self._call(pipe, batch, generators, should_stop, self.context.on_step, None)

    def denoiser(self) -> Any:
        return denoiser_of(self.pipe)

    def run_rows(
        self,
        batch: list[DiffusionRequest],
        generators: list[Any],
        should_stop: StopCheck | None,
        batcher: StepBatcher,
        group: str,
        on_step: StepCallback,
    ) -> BatchOutput:
        """The batch's own pipeline call: a shallow copy of the pipeline (the same modules) with its own
        scheduler, whose denoiser is ``batcher``'s proxy."""
        import copy

        own = self.pipeline_for(batch[0])
        pipe = copy.copy(own)
        # A group with LoRA adapters runs its denoiser itself, beside the other groups' shared forwards:
        # its rows' adapters apply on its own thread.
        if not any(r.lora is not None for r in batch):
            # Set in __dict__: the pipeline's __setattr__ would re-register the component in its config.
            pipe.__dict__[denoiser_attribute(self.pipe)] = batcher.proxy(group, len(batch))
        pipe.__dict__["scheduler"] = copy.deepcopy(own.scheduler)
        encode = self._encodes.get(id(own))
        if encode is not None:  # its wait for the lock counts as encoding
            pipe.__dict__["encode_prompt"] = self._timed(self._one_at_a_time(encode))
        vae, decodes = getattr(self.pipe, "vae", None), self.context.decode_batcher
        if vae is not None and decodes is not None:  # decodes joined with other groups'
            pipe.__dict__["vae"] = GroupVae(vae, decodes, group, self._state_lock(vae))
        try:
            return self._call(pipe, batch, generators, should_stop, on_step, lambda: batcher.leave(group))
        finally:
            batcher.leave(group)

    def decode_calls(self) -> DecodeCalls | None:
        vae = getattr(self.pipe, "vae", None)
        return None if vae is None else DecodeCalls(vae, self._state_lock(vae))

    def _state_lock(self, vae: Any) -> threading.Lock | None:
        """The lock a VAE's calls take where it keeps state while it runs (groups, their decode and the
        preview thread use it at once); None where it keeps none."""
        return self._vae_lock if vae_keeps_state(vae) else None

    def step_joins(self) -> dict[str, ArgumentJoin]:
        """FLUX's and Qwen-Image's position ids are the same for every row of a size, whatever their first
        dimension."""
        return {name: SameValue() for name in SHARED_DENOISER_ARGUMENTS}

    def _timed(self, encode: Callable[..., Any]) -> Callable[..., Any]:
        """``encode``, adding its seconds to the calling thread's count (:meth:`_call` reads it)."""
        counted = self._encoding

        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return encode(*args, **kwargs)
            finally:
                counted.seconds = getattr(counted, "seconds", 0.0) + time.perf_counter() - start

        return encode_prompt

    def _one_at_a_time(self, encode: Callable[..., Any]) -> Callable[..., Any]:
        """``encode`` behind the runner's lock: a fast tokenizer keeps its padding and truncation as state
        set per call, so two rows encoding at once can get each other's (unpadded prompts)."""
        lock = self._encode_lock

        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return encode(*args, **kwargs)

        return encode_prompt

    def _call(
        self,
        pipe: Any,
        batch: list[DiffusionRequest],
        generators: list[Any],
        should_stop: StopCheck | None,
        on_step: StepCallback | None,
        on_denoised: Callable[[], None] | None,
    ) -> BatchOutput:
        """``pipe`` called on ``batch``; ``on_denoised`` once its last step is done (before decode)."""
        import numpy as np

        first = batch[0]
        arguments = call_parameters(type(pipe))
        latents_box: list[Any] = []
        step_done: list[float] = []
        kwargs: dict[str, Any] = {
            "prompt": [r.prompt for r in batch],
            "height": first.height,
            "width": first.width,
            "generator": generators,
            "output_type": "np",
        }
        if first.num_inference_steps is not None:  # unset: the pipeline's own
            kwargs["num_inference_steps"] = first.num_inference_steps
        if first.guidance_scale is not None and self.guidance_argument in arguments:
            kwargs[self.guidance_argument] = first.guidance_scale
        if first.num_frames is not None:
            kwargs["num_frames"] = first.num_frames

        previews = CallPreviews()
        pipe, pairs = self._parallel_denoiser(pipe, batch)
        pipe, cache = self._cached(pipe, batch)

        def on_step_end(caller: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if cache is not None:
                cache.step_done()
            # The last step's latents are the denoised ones; its time splits denoise from decode.
            latents_box[:] = [tensors["latents"]]
            step_done[:] = [time.perf_counter()]
            if step + 1 == _timesteps_of(caller):
                # Some VAEs keep state while they decode (Qwen-Image's causal cache): the previews are
                # done before the call's own decode starts.
                previews.wait()
                if on_denoised is not None:
                    on_denoised()
            if on_step is not None:
                on_step(step)
            if should_stop is not None and should_stop():
                raise BatchAborted(f"stopped after step {step + 1}")
            return {}

        if "callback_on_step_end" in arguments:
            kwargs["callback_on_step_end"] = on_step_end
            kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
        if self._previewing(batch):
            self._preview_steps(pipe, batch, previews)
        self._encoding.seconds = 0.0
        start = time.perf_counter()
        try:
            with previews, self._adapter_rows(batch, denoiser_of(self.pipe)).applied():
                out = pipe(**kwargs, **self.call_kwargs(batch))
        finally:
            if pairs is not None:
                pairs.close()
        end = time.perf_counter()
        denoised = step_done[0] if step_done else end
        # diffusers' own float -> uint8 conversion (numpy_to_pil), so arrays equal its PIL output; a video
        # pipeline's output is its frames (batch x frames x H x W x 3).
        made = out.frames if self.frame_step else out.images
        pixels = (np.asarray(made) * 255).round().astype(np.uint8)
        latents = None
        if any(r.return_latents for r in batch) and latents_box:
            latents = [
                lat.detach().to("cpu").clone() if r.return_latents else None
                for r, lat in zip(batch, latents_box[0], strict=True)
            ]
        timings = {"denoise": denoised - start, "decode": end - denoised, "total": end - start}
        timings["encode"] = self._encoding.seconds
        return BatchOutput(list(pixels), latents, timings)

    # --- step caching ----------------------------------------------------------------------------------

    @functools.cached_property
    def cache_blocks(self) -> int:
        """The denoiser's repeated blocks (a cached step skips each; one where it has none)."""
        return len(repeated_blocks(denoiser_of(self.pipe))) or 1

    cfg_parallel = True
    sequence_parallel = True

    def peer_spec(self, model: str, device: str, num_threads: int | None) -> PeerSpec:
        from vllm_omni_plugin.diffusion.peer_group import PeerSpec

        module, name = denoiser_of(self.pipe), denoiser_attribute(self.pipe)
        if name is None:
            raise ValueError(f"{self.label} has no denoiser to run CFG-parallel")
        return PeerSpec(
            model=model,
            subfolder=name,
            module=type(module).__module__,
            qualname=type(module).__qualname__,
            dtype=str(self.dtype),
            device=device,
            num_threads=num_threads,
            quantization=msgspec.to_builtins(self.quantization) if self.quantization else None,
        )

    compiles_blocks = True
    quantizes = True

    def compile_blocks(self, spec: CompileSpec) -> int:
        from vllm_omni_plugin.diffusion.compiled_blocks import compile_blocks

        count = compile_blocks(denoiser_of(self.pipe), mode=spec.mode or "default", dynamic=spec.dynamic)
        if not count:
            raise ValueError(
                f"{self.label}'s denoiser has no repeated blocks to compile; remove the compile block"
            )
        return count

    def warmup_requests(self, height: int, width: int, count: int, *, guided: bool) -> list[DiffusionRequest]:
        unguided = 1.0 if self.guidance_argument in self.call_arguments else None  # 1.0: no second branch
        return [
            DiffusionRequest(
                request_id=f"warm-up-{i}",
                prompt="warm-up",
                height=height,
                width=width,
                num_inference_steps=2,
                guidance_scale=None if guided else unguided,
                num_frames=self.frame_step + 1 if self.frame_step else None,  # a video's shortest
            )
            for i in range(count)
        ]

    def cache_passes(self, kwargs: dict[str, Any]) -> bool:
        """A denoiser call that is no step of the denoising, which caching must leave alone (none)."""
        return False

    def _parallel_denoiser(
        self, pipe: Any, batch: list[DiffusionRequest]
    ) -> tuple[Any, PairedBranches | None]:
        """``pipe`` with its denoiser's forwards over the CFG- or sequence-parallel group (a shallow copy
        where ``pipe`` is the runner's own), and, where the pipeline makes a guided step's branches as two
        calls in turn, the call's :class:`PairedBranches` (closed after the call); as it is without a
        group, or where a step batcher's proxy stands in for the denoiser (the batcher's forwards are the
        group's then)."""
        name = denoiser_attribute(self.pipe)
        if (
            self.context.parallel_denoiser is None
            or name is None
            or getattr(pipe, name) is not denoiser_of(self.pipe)
        ):
            return pipe, None
        import copy

        from vllm_omni_plugin.diffusion.cfg_parallel import PairedBranches, RowParallelDenoiser

        if self._shared(pipe):
            pipe = copy.copy(pipe)
        denoiser, pairs = self.context.parallel_denoiser, None
        guided = (batch[0].guidance_scale or self.default_guidance_scale or 0.0) > 1.0
        if isinstance(denoiser, RowParallelDenoiser) and not self.batched_guidance and guided:
            denoiser = pairs = PairedBranches(denoiser, self.cache_passes, self.step_joins())
        pipe.__dict__[name] = denoiser
        return pipe, pairs

    def _cached(self, pipe: Any, batch: list[DiffusionRequest]) -> tuple[Any, CallCache | None]:
        """``pipe`` with its denoiser behind the batch's step caches (a shallow copy where ``pipe`` is the
        runner's own), or as it is where no request of the batch caches."""
        specs = [r.cache for r in batch]
        if not CallCache.wanted(specs):
            return pipe, None
        import copy

        if self._shared(pipe):
            pipe = copy.copy(pipe)
        name = denoiser_attribute(self.pipe)
        module = denoiser_of(self.pipe)
        inner = getattr(pipe, name)
        steps = batch[0].num_inference_steps or self.default_num_inference_steps
        cache = CallCache(
            specs, lambda: _timesteps_of(pipe) or steps, self.cache_blocks, self.context.on_cache_counts
        )
        pipe.__dict__[name] = CachedDenoiser(
            inner,
            cache,
            module=module,
            joins=self.step_joins(),
            # a step-batched group's proxy and rows with their own adapters keep every row
            takes_rows=inner in (module, self.context.parallel_denoiser)
            and not any(r.lora is not None for r in batch),
            passes=self.cache_passes,
        )
        return pipe, cache

    # --- previews ---------------------------------------------------------------------------------------

    previews = True

    def _previewing(self, batch: list[DiffusionRequest]) -> bool:
        return self.context.on_preview is not None and any(r.partial_images for r in batch)

    def preview_size(self, batch: list[DiffusionRequest]) -> tuple[int, int] | None:
        """(height, width) the call makes (None: the pipeline decides it as it runs, so no previews)."""
        first = batch[0]
        if first.height is None or first.width is None:
            return None
        return int(first.height), int(first.width)

    def _preview_steps(self, pipe: Any, batch: list[DiffusionRequest], previews: CallPreviews) -> None:
        """Wrap the call's own scheduler's ``step``: at the steps a row asked a preview for, the clean
        image it estimates (the flow-matching schedulers': ``sample - sigma * velocity``; others': their
        ``pred_original_sample``) is decoded for those rows beside the next steps (``previews``) and
        handed to the context's ``on_preview``."""
        size, sink = self.preview_size(batch), self.context.on_preview
        if size is None or sink is None:
            return
        wanted: dict[int, list[tuple[int, int]]] = {}

        def spread() -> None:
            """At the call's first step: the previews spread over the steps it runs (an edit's strength
            skips some of ``num_inference_steps``; the pipeline has counted them by then)."""
            counted = _timesteps_of(pipe)
            for row, request in enumerate(batch):
                steps = counted or request.num_inference_steps or 0
                for index, step in enumerate(preview_steps(request.partial_images, steps)):
                    wanted.setdefault(step, []).append((row, index))

        scheduler = pipe.scheduler
        step_of_scheduler = scheduler.step
        count = [0]
        # The runner's own VAE, traced where it can be; one that keeps state decodes in turn, eagerly.
        vae = pipe.vae.vae_alone if isinstance(pipe.vae, GroupVae) else pipe.vae
        decode = self._preview_decoder.decode if vae is self._preview_decoder.vae else None

        def step(model_output: Any, timestep: Any, sample: Any, *args: Any, **kwargs: Any) -> Any:
            if count[0] == 0:
                spread()
            rows = wanted.get(count[0], [])
            count[0] += 1
            if not rows:
                return step_of_scheduler(model_output, timestep, sample, *args, **kwargs)
            flow = getattr(scheduler, "sigmas", None) is not None and "FlowMatch" in type(scheduler).__name__
            if flow:
                if scheduler.step_index is None:  # as step itself does on its first call
                    scheduler._init_step_index(timestep)
                sigma = scheduler.sigmas[scheduler.step_index]
                clean = (sample.float() - sigma * model_output.float()).to(sample.dtype)
                out = step_of_scheduler(model_output, timestep, sample, *args, **kwargs)
            else:
                asked_dict = kwargs.pop("return_dict", True)
                out = step_of_scheduler(model_output, timestep, sample, *args, return_dict=True, **kwargs)
                estimate = getattr(out, "pred_original_sample", None)
                clean = estimate if estimate is not None else out.prev_sample
                out = out if asked_dict else (out.prev_sample,)
            if clean.shape[0] == len(batch):
                chosen = clean[[row for row, _ in rows]]  # a copy: the steps go on meanwhile
                asked = [(batch[row].request_id, index) for row, index in rows]
                previews.decode(lambda: decode_latents(pipe, chosen, *size, decode=decode), asked, sink)
            return out

        scheduler.step = step


def vae_keeps_state(vae: Any) -> bool:
    """Qwen-Image's (and Wan's) VAE keeps its causal convolutions' caches on the module while it runs
    (``clear_cache``, ``_feat_map``): two calls at once would read each other's."""
    return callable(getattr(vae, "clear_cache", None))


STD_MULTIPLIED = frozenset({"GlmImagePipeline"})
"""Pipelines that denormalize their latents as ``latents * std + mean``; the others with latent statistics
(Qwen-Image's, Wan's) divide by ``1 / std``, which differs from it in the last bit of some values."""


UNSHIFTED_DECODES = frozenset({"StableDiffusion3InpaintPipeline"})
"""Pipelines that scale their latents back without the VAE's shift factor before decoding (SD3's
inpainting pipeline: its encode subtracts it)."""


def decode_latents(
    pipe: Any, latents: Any, height: int, width: int, decode: Callable[[Any], Any] | None = None,
    shifted: bool | None = None,
) -> list[Any]:  # fmt: skip
    """A diffusers pipeline's latents (as its denoising loop holds them) as uint8 HxWx3 images: unpacked
    where the pipeline packs them (FLUX, Qwen-Image), denormalized by the VAE's latent statistics
    (Qwen-Image, GLM-Image) or its scaling and shift factors (SD3, FLUX, UNets; ``shifted=False``: its
    scaling alone, as SD3's inpainting pipeline decodes; None: as ``pipe`` decodes,
    :data:`UNSHIFTED_DECODES`), decoded, post-processed as the pipeline does for ``output_type="np"``."""
    import numpy as np
    import torch

    vae = pipe.vae
    config = dict(vae.config)
    unpack = getattr(type(pipe), "_unpack_latents", None)
    if unpack is not None:
        latents = unpack(latents, height, width, pipe.vae_scale_factor)
    latents = latents.to(vae.dtype)
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is not None and std is not None:
        shape = (1, len(mean)) + (1,) * (latents.ndim - 2)
        stds = torch.tensor(std).view(shape).to(latents)
        means = torch.tensor(mean).view(shape).to(latents)
        if type(pipe).__name__ in STD_MULTIPLIED:
            latents = latents * stds + means
        else:  # as Qwen-Image's and Wan's pipelines write it
            latents = latents / (1.0 / stds) + means
    else:
        latents = latents / config.get("scaling_factor", 1.0)
        if shifted is None:
            shifted = type(pipe).__name__ not in UNSHIFTED_DECODES
        if shifted:
            latents = latents + (config.get("shift_factor") or 0.0)
    image = decode(latents) if decode is not None else vae.decode(latents, return_dict=False)[0]
    if image.ndim == 5:  # a video VAE's one frame (Qwen-Image)
        image = image[:, :, 0]
    pixels = pipe.image_processor.postprocess(image, output_type="np")
    return list((np.asarray(pixels) * 255).round().astype(np.uint8))


def _timesteps_of(pipe: Any) -> int | None:
    """How many steps the running call takes (diffusers pipelines keep it as ``_num_timesteps``; an
    image-to-image ``strength`` makes it fewer than ``num_inference_steps``)."""
    value = pipe.__dict__.get("_num_timesteps")
    return value if isinstance(value, int) else None


@functools.lru_cache(maxsize=8)
def _model_defaults(cls: type[DiffusersPipelineRunner], model: str) -> ModelDefaults:
    name, pipeline_cls = cls.diffusers_class(model)
    params = call_parameters(pipeline_cls)
    steps, guidance = cls.call_defaults(params)
    pipe = meta_pipeline(model, pipeline_cls)
    size = None if cls.size_required else cls.default_size or _pipeline_default_size(pipe, params)
    height, width = size or (None, None)
    frames = _default(params, "num_frames", int) if video_frame_step(pipe) else None
    defaults = DiffusionDefaults(
        height=height, width=width, num_inference_steps=steps, guidance_scale=guidance, num_frames=frames
    )
    return ModelDefaults(defaults=defaults, limits=_pipeline_size_limits(pipe), label=name)


def meta_pipeline(model: str, pipeline_cls: type) -> Any:
    """``pipeline_cls`` over ``model``'s diffusers components built from their configs on the meta device
    (no weights read), its other components (text encoders, tokenizers, schedulers) left out: what its
    ``__init__`` derives from the configs (``vae_scale_factor``, ``default_sample_size``) is there."""
    import diffusers
    import torch

    index = pipeline_cls.load_config(model)  # model_index.json (a directory, or a hub id's)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    wanted = [p for p in inspect.signature(pipeline_cls.__init__).parameters.values() if p.kind in named]
    missing = [p.name for p in wanted[1:] if p.default is p.empty and p.name not in index]  # [0]: self
    if missing:
        raise ValueError(f"{model}: its model_index.json names no {', '.join(missing)}")
    components: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2:
            continue
        library, class_name = spec
        component = getattr(diffusers, class_name, None) if library == "diffusers" and class_name else None
        if not (isinstance(component, type) and issubclass(component, torch.nn.Module)):
            components[name] = None
            continue
        with torch.device("meta"):
            components[name] = component.from_config(component.load_config(model, subfolder=name))
    return pipeline_cls(**components)


def _pipeline_default_size(pipe: Any, params: Mapping[str, inspect.Parameter]) -> tuple[int, int] | None:
    """The size the pipeline draws when given none (``default_sample_size * vae_scale_factor``), else the
    one its call's signature names (video pipelines: Wan's 480x832)."""
    # Optional attributes of a diffusers pipeline: not every pipeline class defines them.
    sample, scale = getattr(pipe, "default_sample_size", None), getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(scale, int):
        return sample * scale, sample * scale
    height, width = _default(params, "height", int), _default(params, "width", int)
    return (height, width) if height and width else None


def _pipeline_size_limits(pipe: Any) -> SizeLimits:
    """The sizes a diffusers pipeline can make: multiples of its VAE scale times its transformer's patch
    (packed latents: the packing too, as FLUX and Qwen-Image pack 2x2), and at most the side its
    position embedding covers (SD3: ``pos_embed_max_size * patch_size * vae_scale_factor``)."""
    import math

    frame_step = video_frame_step(pipe)
    # optional pipeline attributes, as above (a video pipeline's: spatial_scale)
    scale = spatial_scale(pipe) if frame_step else getattr(pipe, "vae_scale_factor", None)
    model = denoiser_of(pipe)
    if not isinstance(scale, int) or model is None:
        return SizeLimits(frame_step=frame_step)
    cfg = dict(model.config)
    patch = _patch(cfg)[0]
    vae = getattr(pipe, "vae", None)
    latent = dict(vae.config).get("latent_channels") if vae is not None else None
    in_channels = cfg.get("in_channels")
    if isinstance(latent, int) and isinstance(in_channels, int) and in_channels != latent:
        if in_channels % latent == 0:  # latents packed into tokens
            patch = max(patch, math.isqrt(in_channels // latent))
    pos_embed = cfg.get("pos_embed_max_size")
    max_side = pos_embed * patch * scale if isinstance(pos_embed, int) else None
    return SizeLimits(multiple=scale * patch, max_side=max_side, frame_step=frame_step)


def image_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a PIL image or an HxWxC array."""
    if hasattr(image, "size") and not hasattr(image, "shape"):
        width, height = image.size
        return int(height), int(width)
    return int(image.shape[0]), int(image.shape[1])


def as_pil(image: Any) -> Any:
    """Source images reach diffusers as PIL, as in its own pipeline (uint8 arrays are converted)."""
    import numpy as np
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(
            f"source images must be PIL images or uint8 HxWx3 arrays, got {array.dtype} {array.shape}"
        )
    return PIL.Image.fromarray(array)
