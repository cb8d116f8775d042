"""The input processor: the one place a parsed request (:class:`OmniRequest`) becomes a complete, frozen
one (:class:`OmniCoreRequest`), as vLLM's input processor finishes a request once into an
``EngineCoreRequest``.

What it applies is read once, when the deployment starts, from configuration alone (no replica reports
anything): the deploy config's request defaults over the model's own (``DiffusionRunner.model_defaults``:
the pipeline's configs, no weights), the model's sizes, the family's settings (the deploy config's
``default_sampling_params`` over the family's own defaults) and the AR stage's token budget. Every size
and token limit of a request is checked here, once; the front ends (HTTP, chat, Dynamo, the offline API)
only parse, and stage processors and runners read complete requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm_omni_plugin.config.pipeline import get_pipeline
from vllm_omni_plugin.config.resolved import ResolvedDeployment
from vllm_omni_plugin.config.settings import RequestSettings, SettingError, read_settings
from vllm_omni_plugin.diffusion.diffusers_registry import stage_runner_class
from vllm_omni_plugin.diffusion.lora import LoraSpec
from vllm_omni_plugin.diffusion.params import RunnerRequest
from vllm_omni_plugin.diffusion.runner import DiffusionDefaults, ModelDefaults
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.errors import StageRequestError
from vllm_omni_plugin.stage.input_work import input_work
from vllm_omni_plugin.stage.request_events import EventSink

logger = get_logger(__name__)

R = TypeVar("R", bound=RunnerRequest)


@dataclass
class OmniRequest:
    """What a user asks for, as parsed (the API server and the offline API build these); ``None``: not
    given."""

    prompt: str
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    images: list[Any] = field(default_factory=list)
    """Source images for image-to-image (PIL images or uint8 arrays)."""
    mask: Any | None = None
    """Where the one source image is repainted (uint8 HxW, 255: repaint), for inpainting models."""
    strength: float | None = None
    """How far an image-to-image or inpainting request departs from its source (None: the pipeline's)."""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    """AR sampling overrides (e.g. ``{"temperature": 0}`` for greedy decoding)."""
    modality: str = "image"
    """What the client wants back: ``"image"``, ``"video"`` (a video pipeline's frames), or ``"text"`` from
    pipelines whose AR stage can answer in text (BAGEL's understanding and chat; the later stages are then
    skipped)."""
    num_frames: int | None = None
    """A video's frames (None: the model's default)."""
    generation_params: dict[str, Any] = field(default_factory=dict)
    """The pipeline's own settings the request gives (its family's settings type's fields, e.g. BAGEL's
    ``cfg_text_scale`` or ``think``)."""
    return_latents: bool = False
    partial_images: int = 0
    """Previews of the image to report while it denoises (``on_event``; diffusion runners with
    ``previews``)."""
    lora: LoraSpec | None = None
    """A LoRA adapter its diffusion stage's denoiser runs with (runners with ``lora``)."""
    cache: StepCacheSpec | None = None
    """Step caching settings over its diffusion stage's (runners with ``step_cache``)."""
    priority: int = 0
    """Lower first, where a stage's ``scheduling_policy`` is ``priority`` (refused elsewhere)."""
    on_event: EventSink | None = field(default=None, repr=False, compare=False)
    """Where its stages' events go while it runs (AR progress, previews: ``stage/request_events.py``);
    None: nobody streams it."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival_time: float = field(default_factory=time.perf_counter)
    """When the request arrived (``time.perf_counter``); the gap to its start is its queue time."""


@dataclass(frozen=True, kw_only=True)
class OmniCoreRequest:
    """A request as the stages run it: every default applied and every limit checked
    (:meth:`InputProcessor.process`); stage processors read it and fill nothing."""

    request_id: str
    arrival_time: float
    prompt: str
    height: int | None
    """None only where the model states no default size (its pipeline draws one)."""
    width: int | None
    num_inference_steps: int | None
    """None only where neither the deploy config nor the model states one (the pipeline's own)."""
    guidance_scale: float | None
    seed: int | None
    negative_prompt: str | None
    images: list[Any]
    sampling_params: dict[str, Any]
    modality: str
    settings: RequestSettings | None
    """The family's settings, complete: the request's over the deploy config's over the family's own
    (None: the pipeline has no settings type)."""
    return_latents: bool = False
    partial_images: int = 0
    lora: LoraSpec | None = None
    cache: StepCacheSpec | None = None
    priority: int = 0
    """The diffusion stage's priority (0 where its ``scheduling_policy`` is ``fcfs``)."""
    ar_priority: int = 0
    """The AR stages' priority (0 where their ``scheduling_policy`` is ``fcfs``)."""
    mask: Any | None = None
    strength: float | None = None
    num_frames: int | None = None
    """A video's frames (None: an image request)."""
    on_event: EventSink | None = field(default=None, repr=False, compare=False)

    def runner_request(self, cls: type[R], **family: Any) -> R:
        """``cls`` (a diffusion runner's request type) carrying this request's fields of the same names,
        with ``family``'s (the family's own fields, its images as it sends them) over them: the one place
        a request's fields are copied into a stage's."""
        own = {f.name for f in dataclasses.fields(self)} - {"images"}
        shared = {name: getattr(self, name) for name in cls.__struct_fields__ if name in own}
        return cls(**{**shared, **family})


class InputError(ValueError):
    """A request the deployment cannot run as asked; ``field`` says which of its fields (``size``, a side,
    ``source`` for its prompt and images together, or a setting's name), for the front end to name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class RequestBounds:
    """What the operator of a front end allows beyond the model's limits (``--image-max-size``); the
    offline API has none."""

    max_side: int | None = None
    max_frames: int | None = None
    """The most frames of a video (``--video-max-frames``)."""


def request_size(request: OmniCoreRequest, stage_id: int) -> tuple[int, int]:
    """(height, width) of a request whose model needs a size (GLM-Image's AR grid, BAGEL's latents)."""
    if request.height is None or request.width is None:
        raise StageRequestError(
            "the request has no size and the deployment states no default: give height and width",
            stage_id=stage_id,
            request_id=request.request_id,
        )
    return request.height, request.width


def fit_to_grid(width: int, height: int, multiple: int, max_side: int | None) -> tuple[int, int]:
    """The output size for an edit that names none: its source's aspect, within ``max_side``, on the
    grid."""
    scale = 1.0 if max_side is None else min(1.0, max_side / max(width, height))
    return (
        max(multiple, int(width * scale) // multiple * multiple),
        max(multiple, int(height * scale) // multiple * multiple),
    )


def _source_size(image: Any) -> tuple[int, int]:
    """(width, height) of a uint8 HxWx3 array or a PIL image."""
    shape = getattr(image, "shape", None)
    return (int(shape[1]), int(shape[0])) if shape is not None else tuple(image.size)


class InputProcessor:
    """The deployment's request defaults and limits, read once at start-up, applied to each request."""

    def __init__(self, deployment: ResolvedDeployment) -> None:
        pipeline = get_pipeline(deployment.pipeline)
        dit = next((s for s in deployment.stages if s.execution_type == "diffusion" and s.final_output), None)
        model = _model_defaults(dit.diffusion_args) if dit is not None else ModelDefaults()
        configured = dit.request_defaults if dit is not None else {}
        own = model.defaults
        self.defaults = DiffusionDefaults(
            **{name: configured.get(name, getattr(own, name)) for name in DiffusionDefaults.__struct_fields__}
        )
        """What requests get for fields they leave unset: the deploy config's, else the model's own."""
        self.multiple = math.lcm(pipeline.image_size_multiple, model.limits.multiple)
        """Height and width must be multiples of this: the pipeline's grid and its model's."""
        self.max_side = model.limits.max_side
        """The model's largest side (None: it states none)."""
        self.frame_step = model.limits.frame_step
        """A video model's frame counts are ``k * frame_step + 1`` (0: the model makes images)."""
        self.size_label = model.label or deployment.pipeline
        """Who states the sizes (the runner's pipeline), for messages."""
        self.facts: Any = (
            import_object(pipeline.model_inspector)(deployment.model) if pipeline.model_inspector else None
        )
        """What the model takes (``Pipeline.model_inspector``: source images, how many), None where the
        pipeline's stages fix that."""
        self.model_label = self.facts.pipeline_class if self.facts is not None else pipeline.name
        """How messages name what is served (the model's diffusers class, or the pipeline)."""
        self.lora_refusal = _lora_refusal(dit.diffusion_args if dit is not None else None, self.model_label)
        """Why requests cannot name a LoRA adapter (None: the image's diffusion runner applies them)."""
        policy = dit.diffusion_args.get("scheduling_policy") if dit is not None else None
        self.dit_priority = policy == "priority"
        """The diffusion stage orders its requests by priority."""
        self.ar_priority = any(
            s.engine_args.get("scheduling_policy") == "priority"
            for s in deployment.stages
            if s.execution_type == "llm_ar"
        )
        """The AR stages' vLLM engines take waiting requests by priority."""
        self.edits_keep_source_size = pipeline.edits_keep_source_size
        self.settings_type = pipeline.settings_type
        sampling = dit.default_sampling_params if dit is not None else {}
        self.settings = {k: v for k, v in sampling.items() if k in pipeline.setting_names}
        """The family's settings the deploy config gives (the diffusion stage's
        ``default_sampling_params``)."""
        ar = next((s for s in deployment.stages if s.execution_type == "llm_ar"), None)
        self.ar_max_model_len: int | None = ar.engine_args.get("max_model_len") if ar is not None else None
        self.token_budget: Any = None
        """``f(prompt, image_sizes, width, height, limit) -> ARTokenCount``: the pipeline's
        ``ar_token_budget`` on this model, when an AR stage's ``max_model_len`` bounds its requests."""
        if ar is not None and pipeline.ar_token_budget:
            self.token_budget = functools.partial(import_object(pipeline.ar_token_budget), deployment.model)

    async def process(self, request: OmniRequest, bounds: RequestBounds | None = None) -> OmniCoreRequest:
        """``request`` complete: its unset fields from the defaults, its size and token counts checked;
        an :class:`InputError` names what the deployment cannot run."""
        bounds = bounds or RequestBounds()
        image = request.modality != "text"
        width, height = self._size(request, bounds) if image else (request.width, request.height)
        num_frames = self._frames(request, bounds) if image else None
        if image and width is not None and height is not None:
            await self._check_ar_tokens(request, width, height)
        defaults = self.defaults
        steps = request.num_inference_steps
        guidance = request.guidance_scale
        priority = self._priority(request)
        return OmniCoreRequest(
            request_id=request.request_id,
            arrival_time=request.arrival_time,
            prompt=request.prompt,
            height=height,
            width=width,
            num_inference_steps=steps if steps is not None else defaults.num_inference_steps,
            guidance_scale=guidance if guidance is not None else defaults.guidance_scale,
            seed=request.seed,
            negative_prompt=request.negative_prompt,
            images=list(request.images),
            sampling_params=dict(request.sampling_params),
            modality=request.modality,
            settings=self._settings(request),
            return_latents=request.return_latents,
            partial_images=request.partial_images,
            lora=request.lora,
            cache=request.cache,
            priority=priority if self.dit_priority else 0,
            ar_priority=priority if self.ar_priority else 0,
            mask=self._mask(request),
            strength=self._strength(request),
            num_frames=num_frames,
            on_event=request.on_event,
        )

    def _frames(self, request: OmniRequest, bounds: RequestBounds) -> int | None:
        """A video request's frames (the model's default where it names none), checked; None for an
        image request. Each kind goes to a model of its kind."""
        step = self.frame_step
        if request.modality != "video":
            if step:
                raise InputError(
                    f"this model ({self.model_label}) makes videos: send the request to /v1/videos", "model"
                )
            return None
        if not step:
            raise InputError(
                f"this model ({self.model_label}) makes images, not videos: send the request to "
                "/v1/images/generations",
                "model",
            )
        frames = request.num_frames if request.num_frames is not None else self.defaults.num_frames
        if frames is None:
            raise InputError(f"this model ({self.model_label}) states no default length: give num_frames")
        if frames < 1 or (frames - 1) % step:
            raise InputError(
                f"num_frames must be {step}k+1 (1, {step + 1}, {2 * step + 1}, ...) for {self.size_label}, "
                f"got {frames}",
                "num_frames",
            )
        if bounds.max_frames is not None and frames > bounds.max_frames and request.num_frames is None:
            raise InputError(
                f"this model's default length, {frames} frames, is over this server's --video-max-frames "
                f"{bounds.max_frames}: give seconds or num_frames",
                "num_frames",
            )
        if bounds.max_frames is not None and frames > bounds.max_frames:
            raise InputError(
                f"num_frames {frames} exceeds this server's --video-max-frames {bounds.max_frames}",
                "num_frames",
            )
        return frames

    def _mask(self, request: OmniRequest) -> Any | None:
        """The request's mask, where its model repaints masked areas (a diffusers model's inpainting
        pipeline: the pipelines without model facts repaint none) and it has the one image it marks."""
        facts = self.facts
        if request.mask is None:
            if facts is not None and facts.needs_mask and request.modality != "text":
                raise InputError(
                    f"this model ({self.model_label}) repaints the masked area of a source image: send "
                    "the image with a mask (transparent where it is repainted)",
                    "mask",
                )
            return None
        if facts is None or not facts.takes_mask:
            raise InputError(
                f"this model ({self.model_label}) cannot repaint a masked area; send the edit without a mask",
                "mask",
            )
        if len(request.images) != 1:
            raise InputError("a mask goes with exactly one source image", "mask")
        return request.mask

    def _strength(self, request: OmniRequest) -> float | None:
        """The request's strength, for a diffusers model (its runner checks that the pipeline running the
        request takes one); the pipelines without model facts (GLM-Image, BAGEL) take none."""
        if request.strength is not None and self.facts is None:
            raise InputError(f"this model ({self.model_label}) takes no strength; leave it unset", "strength")
        return request.strength

    def _priority(self, request: OmniRequest) -> int:
        if request.priority != 0 and not (self.dit_priority or self.ar_priority):
            raise InputError(
                f"priority {request.priority} needs priority scheduling, which this deployment does not "
                "use: send priority 0, or set scheduling_policy: priority on its stages",
                "priority",
            )
        return request.priority

    def _settings(self, request: OmniRequest) -> RequestSettings | None:
        """The family's settings: the request's over the deploy config's over the family's own."""
        if self.settings_type is None:
            return None
        try:
            given = read_settings(self.settings_type, {**self.settings, **request.generation_params})
        except SettingError as exc:
            raise InputError(exc.message, exc.param) from None
        return given.with_defaults(edit=bool(request.images))

    def _size(self, request: OmniRequest, bounds: RequestBounds) -> tuple[int | None, int | None]:
        """(width, height): the request's, an edit's source aspect where it names neither, else the
        defaults (a side it names alone takes the other's default); checked."""
        width, height = request.width, request.height
        if width is None and height is None:
            if request.images:
                source_w, source_h = _source_size(request.images[0])
                width, height = fit_to_grid(source_w, source_h, self.multiple, bounds.max_side)
            else:
                width, height = self.defaults.width, self.defaults.height
        elif width is None or height is None:
            name, side = ("width", width) if height is None else ("height", height)
            self._check_side(name, side, bounds)
            width = width if width is not None else self.defaults.width
            height = height if height is not None else self.defaults.height
        if width is None or height is None:
            return width, height  # the model decides
        self._check_size(
            width, height, bounds, keeps_source=bool(request.images) and self.edits_keep_source_size
        )
        return width, height

    def _check_side(self, name: str, side: int, bounds: RequestBounds) -> None:
        m = self.multiple
        if side < m or side % m:
            raise InputError(f"{name} must be a multiple of {m} and at least {m} pixels, got {side}", name)
        if bounds.max_side is not None and side > bounds.max_side:
            raise InputError(
                f"{name} must be at most {bounds.max_side} pixels on this server, got {side}", name
            )

    def _check_size(self, width: int, height: int, bounds: RequestBounds, *, keeps_source: bool) -> None:
        m, got = self.multiple, f"{width}x{height}"
        if width % m or height % m or width < m or height < m:
            raise InputError(
                f"width and height must be multiples of {m} and at least {m} pixels, got {got}", "size"
            )
        if bounds.max_side is not None and (width > bounds.max_side or height > bounds.max_side):
            raise InputError(
                f"width and height must be at most {bounds.max_side} pixels on this server, got {got}", "size"
            )
        largest = self.max_side
        if largest is not None and not keeps_source and (width > largest or height > largest):
            raise InputError(
                f"width and height must be at most {largest} pixels for {self.size_label}, got {got}", "size"
            )

    async def _check_ar_tokens(self, request: OmniRequest, width: int, height: int) -> None:
        """Refuse a request the AR stage cannot hold: its prompt, source images and generated tokens
        together over ``max_model_len`` (vLLM would fail it only after the work). Counted on the input
        worker (``stage/input_work.py``): it tokenizes."""
        budget, max_len = self.token_budget, self.ar_max_model_len
        if budget is None or not max_len:
            return
        images = request.images
        sizes = [_source_size(img) for img in images]
        try:
            count = await input_work(budget, request.prompt, sizes, width, height, int(max_len))
        except ValueError as exc:  # a source image the pipeline's processor cannot take
            raise InputError(str(exc), "source") from None
        if count.total <= max_len:
            return
        per_image = f" ({', '.join(map(str, count.image_tokens))})" if len(count.image_tokens) > 1 else ""
        numbers = (
            f"prompt {count.prompt_tokens} + source images {sum(count.image_tokens)}{per_image} + "
            f"generated {count.generated_tokens} (a {width}x{height} image) = {count.total}"
        )
        room = int(max_len) - count.prompt_tokens - sum(count.image_tokens)
        held, verb = ("the prompt and source images", "leave") if images else ("the prompt", "leaves")
        left = f"{held} {verb} {room} tokens for the image" if room > 0 else f"{held} alone {verb} no room"
        less_input = (
            "send fewer or smaller source images or a shorter prompt" if images else "send a shorter prompt"
        )
        if count.largest_fit is not None:
            w, h = count.largest_fit
            change, where = f"ask for at most {w}x{h}, or {less_input}", "size"
        else:
            change, where = less_input, "source"
        raise InputError(
            f"this request needs {count.total} AR tokens, more than the AR stage's max_model_len {max_len}: "
            f"{numbers}; {left}. To fit, {change} (or serve with a larger --max-model-len)",
            where,
        )


def _lora_refusal(diffusion_args: dict[str, Any] | None, label: str) -> str | None:
    """Why requests cannot name LoRA adapters (None: the image's diffusion stage runs a runner that
    applies them)."""
    if diffusion_args is None:
        return f"this deployment ({label}) has no diffusion stage to apply a LoRA adapter to"
    try:
        runner = stage_runner_class(diffusion_args)
    except (OSError, ValueError) as exc:  # the stage's start says what is wrong with the model
        return f"this deployment's diffusion runner is unknown ({exc})"
    if not runner.lora:
        return f"this deployment's diffusion runner ({runner.__name__}) takes no LoRA adapters"
    return None


def _model_defaults(diffusion_args: dict[str, Any]) -> ModelDefaults:
    """The model's own defaults and sizes, as its stage's runner reads them from its configs; none where
    the model cannot be read here (its stage's start says why)."""
    try:
        return stage_runner_class(diffusion_args).model_defaults(str(diffusion_args["model"]))
    except (OSError, ValueError, KeyError) as exc:
        logger.info("the model's own request defaults are unknown (%s); the deploy config's apply", exc)
        return ModelDefaults()
