"""Requests to and results from the diffusion stage.

Plain structs: tensor and image fields are typed ``Any`` and hold ``torch.Tensor`` / numpy / PIL objects
in process. Whoever sends these over the wire (a connector) encodes those fields itself; msgspec only
handles the scalar fields.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import msgspec

from vllm_omni_plugin.diffusion.lora import LoraSpec
from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

MAX_PARTIAL_IMAGES = 3
"""The most previews a request may ask for (OpenAI's ``partial_images`` bound)."""


class RunnerRequest(msgspec.Struct, kw_only=True, tag_field="kind"):
    """What the engine reads of every runner's request. Each runner's request type is a tagged subclass;
    the stage's wire carries the union of the registered ones (``kind`` says which)."""

    request_id: str
    seed: int | None = None
    """Seeds this request's own ``torch.Generator``; ``None`` draws one (reported in the result)."""
    partial_images: int = 0
    """Previews to report while it denoises (``DiffusionRunner.on_preview``), at steps spread over its
    denoising (:func:`vllm_omni_plugin.diffusion.runner.preview_steps`); 0: none, and no work for them."""
    cache: StepCacheSpec | None = None
    """Step caching settings of this request, over the stage's (``diffusion/step_cache.py``); the engine
    resolves them (every field set) before the runner sees the request."""
    priority: int = 0
    """Lower first (vLLM's convention), with ``scheduling_policy: priority``: its place in the stage's
    queue and, with ``batching: loop``, in each step (a better one preempts it between steps)."""


class DiffusionRequest(RunnerRequest, kw_only=True, tag="diffusion"):
    """One image from a prompt (and source images): what the diffusers runners take. ``None`` sampling
    fields are the pipeline's own (a served request arrives complete: the input processor filled them). A
    family that needs more subclasses it (GLM-Image's prior tokens)."""

    prompt: str
    """The text prompt (GLM-Image only reads its quoted substrings: the AR stage already turned the
    prompt into prior tokens)."""
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    """For pipelines that take one; GLM-Image has none (its unconditional pass uses an empty glyph text)."""
    images: list[Any] | None = None
    """Image-to-image: the source images (PIL images or uint8 HxWx3 arrays)."""
    mask: Any | None = None
    """Inpainting: where the one source image is repainted, a uint8 HxW array of its size (255: repaint,
    0: keep), as diffusers' ``mask_image``."""
    strength: float | None = None
    """How far an image-to-image or inpainting request departs from its source (the pipeline's
    ``strength``: 1.0 ignores it); None: the pipeline's own default."""
    num_frames: int | None = None
    """A video pipeline's frames (None: an image pipeline's request; the input processor gives a video
    request its model's default)."""
    return_latents: bool = False
    """Also return the final (denoised, still normalized) latents."""
    lora: LoraSpec | None = None
    """A LoRA adapter of the denoiser this request runs with (runners with ``lora``)."""

    @property
    def image_to_image(self) -> bool:
        """Any image-to-image field set (a runner rejects a request that sets only some of them)."""
        return bool(self.images)


class DiffusionCounters(msgspec.Struct, kw_only=True):
    """A diffusion replica's running counts since it started (``/metrics``), whatever its batching."""

    denoise_steps: int = 0
    """Denoising steps, counted per request (a step of B requests counts B)."""
    steps: int = 0
    """Timed steps of the running batch (whole-request batching: each step after a batch's first) or
    step boundaries (step batching: the forwards of every group in flight)."""
    step_requests: int = 0
    """Requests in flight, summed over the timed steps (per step: ``step_requests / steps``)."""
    step_seconds: float = 0.0
    started: int = 0
    """Requests taken from the queue."""
    queue_wait_seconds: float = 0.0
    """Time requests waited in the queue, summed (per request: ``queue_wait_seconds / started``)."""
    decodes: int = 0
    """Pipeline calls (a batch, or a group) that decoded their images; with ``batching: loop``, requests
    finished."""
    decode_seconds: float = 0.0
    encode_seconds: float = 0.0
    """Prompt encoding in those calls (with step batching, waiting for another group's encoding too)."""
    call_seconds: float = 0.0
    """Those calls from start to end: encoding, every step (shared ones whole) and decode."""
    computed_blocks: int = 0
    """Denoiser block evaluations its requests ran, counted per request (a forward of B requests' rows
    counts B times its blocks)."""
    cached_blocks: int = 0
    """Block evaluations its requests took from their step caches instead."""
    preemptions: int = 0
    """Steps a request admitted to the step loop (``batching: loop``) was left out of, for requests of
    better priority, counted per request."""
    parked_states: int = 0
    """Preempted step-loop states moved to host memory for the memory budget's room
    (``diffusion/parking.py``)."""

    @classmethod
    def total(cls, counters: Iterable[DiffusionCounters]) -> DiffusionCounters:
        """The field by field sum of several replicas' counts (zeros for none)."""
        return functools.reduce(cls.plus, counters, cls())

    def plus(self, other: DiffusionCounters) -> DiffusionCounters:
        """Field by field sum (the counts of several replicas, or of a replica's earlier processes)."""
        return DiffusionCounters(**{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__})


class DiffusionResult(msgspec.Struct, kw_only=True):
    """The outcome of one request: an image, or an error that names what was wrong."""

    request_id: str
    image: Any = None
    """A uint8 HxWx3 numpy array, a video's FxHxWx3 (``None`` on failure)."""
    latents: Any = None
    """The final latents (a CPU ``torch.Tensor``, C x h x w) when the request asked for them."""
    error: str | None = None
    invalid: bool = False
    """The runner refused the request itself (a bad value), rather than failing to run it."""
    aborted: bool = False
    """The request was aborted before its image was made (``error`` says so; there is no image)."""
    seed: int | None = None
    """The seed the request's generator used, so an unseeded result can be reproduced."""
    batch_size: int = 0
    """How many requests shared the pipeline call that produced this result."""
    timings: dict[str, float] = {}
    """Seconds of the pipeline call: ``denoise`` (prompt encoding, conditioning and all steps),
    ``decode`` (VAE decode and post-processing) and ``total``; ``encode`` (the prompt encoding within
    ``denoise``) where the runner encodes prompts; shared by the batch."""

    @property
    def ok(self) -> bool:
        return self.error is None
