"""The interface every diffusion runner implements, and the only one the diffusion engine uses.

A runner loads one model and runs batches of its own request type. Requests arrive complete (the input
processor, ``stage/input_processor.py``, filled every default from :meth:`DiffusionRunner.model_defaults`
and the deploy config at start-up): the engine joins a request's received parts
(:meth:`DiffusionRunner.prepare`), validates it, groups requests by :meth:`DiffusionRunner.batch_key`,
bounds batches by :meth:`DiffusionRunner.activation_bytes` and runs them with :meth:`DiffusionRunner.run`;
nothing else of a runner is read, so a runner declares here what it can do instead of the engine asking
whether it has an attribute.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from vllm_omni_plugin.diffusion.blocks import CompileSpec
from vllm_omni_plugin.diffusion.lora import MAX_LORAS
from vllm_omni_plugin.diffusion.params import RunnerRequest

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.memory import VaeTiling
    from vllm_omni_plugin.diffusion.peer_group import PeerSpec
    from vllm_omni_plugin.diffusion.quantization import QuantizationSpec
    from vllm_omni_plugin.diffusion.step_batching import ArgumentJoin, DecodeCalls, StepBatcher


class BatchAborted(Exception):
    """Every request of the running batch was aborted: the call stopped at a step's end."""


StopCheck = Callable[[], bool]
"""Asked after each denoising step: True stops the batch (raises :class:`BatchAborted`)."""

StepCallback = Callable[[int], None]
"""Called after each denoising step of a batch with the step's index (the engine's progress)."""

PreviewCallback = Callable[[str, int, Any], None]
"""Called with (request id, preview index, uint8 HxWx3 image) when a preview of a request is decoded; from
the preview thread (``diffusion/previews.py``), before the request's call returns."""

MAX_BATCH_SIZE = 64
"""The most requests of a batch (or in flight, ``batching: step``) when the stage pins no
``max_batch_size``: ``max_step_tokens`` bounds them first at any size but the tiniest."""


def preview_steps(partial_images: int, steps: int) -> list[int]:
    """The 0-based steps after which a request of ``steps`` steps reports its ``partial_images`` previews:
    spread evenly over the denoising, none at its last step (the final image follows it), as many as
    there are earlier steps."""
    wanted = min(max(0, partial_images), max(0, steps - 1))
    return [(k + 1) * steps // (wanted + 1) - 1 for k in range(wanted)]  # distinct: steps > wanted


@dataclass
class RunnerContext:
    """What the engine gives its runner, in one object handed once (:meth:`DiffusionRunner.attach`): where
    the runner reports to the engine, and the stage's settings its calls follow. The engine fills what
    starts after the runner (``decode_batcher``, ``parallel_denoiser``) in this same object, so no
    attribute of a runner is written from outside it."""

    on_step: StepCallback | None = None
    """Called after each denoising step of :meth:`DiffusionRunner.run` (the engine's progress)."""
    on_preview: PreviewCallback | None = None
    """Called with each preview a request asked for (None: previews are not reported)."""
    on_cache_counts: Callable[[int, int], None] | None = None
    """Called with the block evaluations a call's requests computed and took from their step caches."""
    max_loras: int = MAX_LORAS
    """LoRA adapters kept loaded at once."""
    vae_tiling: VaeTiling = "auto"
    """When the VAE decodes image by image (sliced) or tile by tile (tiled): ``memory.VaeTiling``."""
    decode_budget: int | None = None
    """What one decode's activations may take (a stage with a memory budget; None: no bound)."""
    decode_batcher: StepBatcher | None = None
    """``batching: step``, a runner whose :meth:`DiffusionRunner.decode_calls` gives some: its groups
    decode through it, so decodes of groups that finish together run as one call."""
    parallel_denoiser: Any = None
    """A CFG- or sequence-parallel replica's denoiser as its pipelines call it
    (``diffusion/cfg_parallel.py``'s ``RowParallelDenoiser``, ``diffusion/sequence_parallel.py``'s
    ``SequenceParallelDenoiser``); None: the runner's own."""


@dataclass(slots=True)
class BatchOutput:
    """What one call produced, in batch order."""

    images: list[Any]
    """uint8 HxWx3 arrays (a video pipeline's: FxHxWx3, its frames)."""
    latents: list[Any] | None
    """Per row, its final latents where its request asked for them (``None`` elsewhere, or for all)."""
    timings: dict[str, float]


class DiffusionDefaults(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a request that leaves these fields unset gets (``None``: nothing given at this level). A
    pipeline declares its own (``Pipeline.diffusion_defaults``), the deploy config may set them, and a
    runner reads its model's (:meth:`DiffusionRunner.model_defaults`); the input processor applies them."""

    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    num_frames: int | None = None
    """A video pipeline's frames (None for image pipelines)."""


class SizeLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The image sizes a runner's model can make."""

    multiple: int = 1
    """Height and width must be multiples of this (pixels)."""
    max_side: int | None = None
    """The largest height or width (``None``: no limit the model states)."""
    frame_step: int = 0
    """A video pipeline's frame counts are ``k * frame_step + 1`` (its VAE's temporal compression; 0: the
    model makes images)."""


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's own configuration says of its requests, read without its weights: the defaults its
    pipeline applies to unset fields and the sizes it can make."""

    defaults: DiffusionDefaults = DiffusionDefaults()
    limits: SizeLimits = SizeLimits()
    label: str = ""
    """What states them (the runner's pipeline class), for messages."""


class DiffusionRunner(abc.ABC):
    """One loaded model and how to run batches of its requests (subclasses: the diffusers runners in
    ``families/diffusers/`` and the model families' own, e.g. BAGEL's)."""

    request_type: ClassVar[type[RunnerRequest]]
    """What this runner takes; the wire's union of request types is built from the registered runners'."""
    _context: RunnerContext | None = None
    step_batching: ClassVar[bool] = False
    """It implements :meth:`run_rows` and :meth:`denoiser`: its requests can share forwards step by step
    (``batching: step``)."""

    def step_family(self) -> Any:
        """The pieces ``batching: loop`` runs this pipeline as (``diffusion/step_loop.py``); None: it has
        none (the stage batches whole requests)."""
        return None

    previews: ClassVar[bool] = False
    """It reports the previews its requests ask for (``partial_images``) through its context's
    ``on_preview``."""
    lora: ClassVar[bool] = False
    """Its requests may name a LoRA adapter of its denoiser (``DiffusionRequest.lora``), each row its own."""
    cfg_parallel: ClassVar[bool] = False
    """Its denoiser can run over a CFG-parallel group of processes (:meth:`peer_spec`,
    ``cfg_parallel_size``)."""
    sequence_parallel: ClassVar[bool] = False
    """Its denoiser can run over a sequence-parallel group of processes (:meth:`peer_spec`,
    ``sequence_parallel_size``), where it has a sequence plan (``diffusion/sequence_parallel.py``)."""
    quantizes: ClassVar[bool] = False
    """Its :meth:`load` takes ``quantization`` (``diffusion/quantization.py``: the denoiser's and text
    encoders' weights quantized as they load)."""
    quantization: QuantizationSpec | None = None
    """What it was loaded with (None: nothing quantized)."""
    compiles_blocks: ClassVar[bool] = False
    """It compiles its denoiser's repeated blocks (:meth:`compile_blocks`, a stage's ``compile`` block)."""
    step_cache: bool = False
    """Its requests may skip denoiser forwards by step caching (``RunnerRequest.cache``), each its own."""

    @property
    def context(self) -> RunnerContext:
        """The engine's :class:`RunnerContext` (a default one until an engine attaches its own)."""
        if self._context is None:
            self._context = RunnerContext()
        return self._context

    def attach(self, context: RunnerContext) -> None:
        """Take the engine's context for every call from now on (once, before the first call and before
        :meth:`step_family`)."""
        self._context = context

    @classmethod
    @abc.abstractmethod
    def load(cls, model: str, *, dtype: Any, device: Any) -> DiffusionRunner:
        """The runner with its model loaded from ``model`` (a directory or hub id)."""

    @classmethod
    def model_defaults(cls, model: str) -> ModelDefaults:
        """What ``model``'s own configuration gives requests and the sizes it can make, read at start-up
        without loading weights (none, unless the runner knows better); raises ``OSError`` or
        ``ValueError`` when the model cannot be read."""
        return ModelDefaults(label=cls.__name__)

    @property
    def label(self) -> str:
        """What it runs, for logs."""
        return type(self).__name__

    def prepare(self, request: Any) -> Any:
        """The request as :meth:`run` takes it: its received parts joined (the engine has drawn its seed;
        every other field came complete). As is unless the runner's request has parts to join."""
        return request

    @abc.abstractmethod
    def validate(self, request: Any) -> None:
        """Raise ``ValueError`` naming what is wrong; run before batching, so one bad request fails alone."""

    @abc.abstractmethod
    def batch_key(self, request: Any) -> tuple[Any, ...]:
        """Requests with equal keys can share one :meth:`run`."""

    @abc.abstractmethod
    def run(
        self, batch: list[Any], generators: list[Any], should_stop: StopCheck | None = None
    ) -> BatchOutput:
        """One call for ``batch`` (one key; one CPU ``torch.Generator`` per request), calling the
        context's ``on_step`` after each step; raises :class:`BatchAborted` at the end of the first step
        after which ``should_stop()`` is true."""

    @abc.abstractmethod
    def weight_tensors(self) -> list[Any]:
        """The tensors (or modules) its weights are, counted where no allocator counts them."""

    @property
    def tiles_decode(self) -> bool:
        """Its decoder can decode image by image and tile by tile (a stage's ``vae_tiling``)."""
        return False

    def weight_components(self) -> dict[str, list[Any]]:
        """:meth:`weight_tensors` by the part of the model they are (the start-up log's weights line)."""
        return {"weights": self.weight_tensors()}

    @abc.abstractmethod
    def activation_bytes(self, batch: list[Any]) -> int:
        """Estimated peak activations of ``batch`` (one key) run as one call."""

    @abc.abstractmethod
    def step_tokens(self, request: Any) -> int:
        """Latent tokens a denoising step of the request carries: its image's tokens
        times the denoiser rows a step runs for it (two with classifier-free guidance). Batches and the
        requests in flight are bounded by their sum (``max_step_tokens``)."""

    def denoiser(self) -> Any:
        """The module whose calls a :class:`StepBatcher` joins (runners with ``step_batching``)."""
        raise NotImplementedError(f"{type(self).__name__} does not batch step by step")

    def step_joins(self) -> dict[str, ArgumentJoin]:
        """How denoiser arguments that are neither shared nor plain per-row values join (none)."""
        return {}

    def decode_calls(self) -> DecodeCalls | None:
        """The decode a :class:`StepBatcher` joins across groups (None: each group decodes its own rows,
        where joining does not pay)."""
        return None

    def run_rows(
        self,
        batch: list[Any],
        generators: list[Any],
        should_stop: StopCheck | None,
        batcher: StepBatcher,
        group: str,
        on_step: StepCallback,
    ) -> BatchOutput:
        """:meth:`run`, but with the denoiser calls going through ``batcher`` as group ``group`` (which
        leaves it after its last step), so they share forwards with other groups running at once, and
        ``on_step`` called after each step instead of the context's (runners with ``step_batching``)."""
        raise NotImplementedError(f"{type(self).__name__} does not batch step by step")

    def compile_blocks(self, spec: CompileSpec) -> int:
        """Compile its denoiser's repeated blocks as ``spec`` says; how many (runners with
        :attr:`compiles_blocks`)."""
        raise NotImplementedError(f"{type(self).__name__} does not compile its denoiser's blocks")

    def peer_spec(self, model: str, device: str, num_threads: int | None) -> PeerSpec:
        """What a CFG-parallel peer on ``device`` loads: this runner's denoiser alone (runners with
        :attr:`cfg_parallel`)."""
        raise NotImplementedError(f"{type(self).__name__} has no CFG-parallel denoiser")

    def warmup_requests(self, height: int, width: int, count: int, *, guided: bool) -> list[Any]:
        """``count`` requests of this size, two steps each, with guidance or without (a denoiser batch of
        one): what a start-up warm-up runs."""
        raise NotImplementedError(f"{type(self).__name__} has no warm-up requests")

    def steps_of(self, request: Any) -> int | None:
        """How many denoising steps the request runs (for progress logs; None: not known before)."""
        return None

    def describe_request(self, request: Any) -> str:
        """The request in a few words, for a message that it does not fit the memory budget."""
        return f"request {request.request_id}"
