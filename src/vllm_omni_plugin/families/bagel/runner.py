"""BAGEL's generation stage: rectified flow with three-branch guidance over received contexts, then decode.

Diffusers has no BAGEL pipeline; this is ours, following BAGEL's ``generate_image`` / ``_forward_flow``:
``t = linspace(1, 0, N)`` shifted by ``s * t / (1 + (s - 1) * t)``, ``x <- x - v(x, t_i) * (t_i - t_{i+1})``
for the first ``N - 1`` points; at a step inside a request's ``cfg_interval`` (and with
``cfg_text_scale > 1``) its velocity is guided by the ``cfg_text`` (and, with ``cfg_img_scale > 1``, the
``cfg_img``) context.

A batch shares size, step count and shift (so one schedule); everything else is per request. Each step is one
forward over every (request, active branch) row; a branch whose context equals the request's ``cond`` (e.g.
text-to-image ``cfg_img``) reuses the ``cond`` row instead of computing it again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from vllm_omni_plugin.diffusion.memory import element_bytes, vae_decode_bytes
from vllm_omni_plugin.diffusion.runner import (
    BatchAborted,
    BatchOutput,
    DiffusionDefaults,
    DiffusionRunner,
    ModelDefaults,
    SizeLimits,
    StepCallback,
    StopCheck,
)
from vllm_omni_plugin.diffusion.step_loop import run_whole
from vllm_omni_plugin.families.bagel.request import (
    RENORM_TYPES,
    T2I_DEFAULTS,
    BagelContext,
    BagelGenerationRequest,
    BagelSampling,
)
from vllm_omni_plugin.families.bagel.transformer import AttentionRows, ContextBank, GenerationTransformer
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.models.bagel.autoencoder import VaeDecoder, load_vae_decoder
from vllm_omni_plugin.models.bagel.config import BagelConfig, cached_bagel_config, load_bagel_config
from vllm_omni_plugin.models.bagel.transforms import unpatchify
from vllm_omni_plugin.models.bagel.weights import CheckpointReader

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.peer_group import PeerSpec
    from vllm_omni_plugin.diffusion.step_batching import ArgumentJoin, StepBatcher

logger = get_logger(__name__)

COND, CFG_TEXT, CFG_IMG = 0, 1, 2
DECODE_PIXELS_PER_CALL = 4 * 1024 * 1024
"""Images decode together up to this many pixels per decoder call (bounds the decoder's activations)."""
LAYER_HIDDEN_WIDTHS = 6
"""Live ``[tokens, hidden]`` tensors of a row at a layer's peak (residual, normed input, attention
output, and the fp32 per-head Q norm, rotation and its result, counted in hidden-size halves)."""
LAYER_FF_WIDTHS = 4
"""Live ``[tokens, intermediate]`` tensors at the MLP's peak: gate and up (one fused projection of
two), the gate's activation and its product with up."""


def flow_schedule(num_steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted times ``t_i`` of the steps that run, and their ``dt_i`` (fp32, CPU), as BAGEL computes them."""
    t = torch.linspace(1, 0, num_steps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


def guidance_active(t: torch.Tensor, interval: tuple[float, float]) -> bool:
    """BAGEL's gate ``lo < t <= hi``, compared as it does (an fp32 ``t`` against Python floats)."""
    return bool(t > interval[0]) and bool(t <= interval[1])


class BagelGenerationRunner(DiffusionRunner):
    """Loads BAGEL's generation weights and the autoencoder's decoder; runs batches of requests.

    Use: ``runner = BagelGenerationRunner.load(model_dir, dtype=..., device=...)``; for each request
    ``runner.validate(r)`` (``ValueError`` naming the problem); batch requests with equal
    ``runner.batch_key(r)``; ``runner.run(batch, generators)`` with one CPU ``torch.Generator`` per request.
    A request that arrived from the thinker stage first goes through ``prepare`` (shared contexts); its
    sampling settings arrive complete.
    """

    request_type = BagelGenerationRequest

    def __init__(
        self,
        cfg: BagelConfig,
        transformer: GenerationTransformer,
        decoder: VaeDecoder,
        *,
        tensors_read: dict[str, list[str]],
    ) -> None:
        self.cfg = cfg
        self.transformer = transformer
        self.decoder = decoder
        self.dtype = transformer.dtype
        self.device = transformer.device
        self.tensors_read = tensors_read
        """Per weights file, the names of the tensors loading read (nothing else was read)."""

    @classmethod
    def load(cls, model_dir: str, *, dtype: Any, device: Any) -> BagelGenerationRunner:
        start = time.perf_counter()
        dtype = _as_dtype(dtype)
        device = torch.device(device)
        cfg = load_bagel_config(model_dir)
        with CheckpointReader(cfg.llm_weights) as reader:
            transformer = GenerationTransformer.load(cfg, reader, dtype=dtype, device=device)
            llm_read = list(reader.read)
        with CheckpointReader(cfg.vae_weights) as reader:
            decoder = load_vae_decoder(reader, cfg.vae, dtype=dtype, device=device)
            vae_read = list(reader.read)
        logger.info(
            "loaded BAGEL generation (%d layers, %d + %d tensors) from %s (%s, %s) in %.2f s",
            cfg.llm.num_layers,
            len(llm_read),
            len(vae_read),
            model_dir,
            dtype,
            device,
            time.perf_counter() - start,
        )
        return cls(
            cfg,
            transformer,
            decoder,
            tensors_read={cfg.llm_weights.name: llm_read, cfg.vae_weights.name: vae_read},
        )

    # --- memory ------------------------------------------------------------------------------------

    def weight_tensors(self) -> list[Any]:
        """Every tensor generation holds (its weights, counted where no allocator counts them)."""
        model = self.transformer
        tensors: list[Any] = [self.decoder]
        for layer in model.layers:
            for expert in (layer.und, layer.gen):
                tensors.extend(getattr(expert, name) for name in expert.__slots__)
        tensors.extend([model.markers, model.norm_gen, model.latent_pos_embed])
        tensors.extend([*model.time_mlp, *(model.vae2llm or ()), *(model.llm2vae or ())])
        return [t for t in tensors if t is not None]

    def activation_bytes(self, batch: list[BagelGenerationRequest]) -> int:
        """Estimated peak of running ``batch`` (one batch key) as one call: the larger of its phases (the
        context bank is freed before the decode)."""
        return max(self.activation_phases(batch).values())

    def activation_phases(self, batch: list[BagelGenerationRequest]) -> dict[str, int]:
        """Estimated peak of ``denoise`` and of ``decode``, each with a preview's decode beside it where
        a row asks for previews.

        Denoising holds the context bank (every row's context K/V of every layer, padded to the longest,
        with the image block in front: ``rows x (block + longest context)`` tokens), at steps where only
        some rows are guided a copy of the cond rows' part of it, one context on its way into the bank,
        and one layer's activations over every row's block."""
        cfg, llm = self.cfg, self.cfg.llm
        first = batch[0]
        block = (first.height // cfg.latent_downsample) * (first.width // cfg.latent_downsample) + 2
        element = element_bytes(self.dtype)
        kv_token = llm.num_layers * 2 * llm.num_kv_heads * llm.head_dim * element
        lengths = [self._context_lengths(r) for r in batch]
        rows = sum(len(ls) for ls in lengths)
        longest = max(max(ls) for ls in lengths)
        bank = rows * (block + longest) * kv_token
        if any(self._guidance_toggles(r) for r in batch):
            bank += len(batch) * (block + max(ls[0] for ls in lengths)) * kv_token
        layer = (
            rows * block * (LAYER_HIDDEN_WIDTHS * llm.hidden_size + LAYER_FF_WIDTHS * llm.intermediate_size)
        )
        denoise = bank + longest * kv_token + layer * element
        per_call = max(1, min(len(batch), DECODE_PIXELS_PER_CALL // (first.height * first.width)))
        channels = cfg.vae.ch * cfg.vae.ch_mult[min(1, len(cfg.vae.ch_mult) - 1)]
        decode = vae_decode_bytes(per_call, first.height * first.width, channels, element)
        # Previews are decoded beside the steps and the call's own decode (diffusion/previews.py).
        previewing = min(sum(1 for r in batch if r.partial_images), per_call)
        preview = vae_decode_bytes(previewing, first.height * first.width, channels, element)
        return {"denoise": denoise + preview, "decode": decode + preview}

    def step_tokens(self, request: BagelGenerationRequest) -> int:
        """Its image block's tokens once per row it adds (cond, and the guidance branches that run)."""
        stride = self.cfg.latent_downsample
        block = (request.height // stride) * (request.width // stride)
        return block * len(self._context_lengths(request))

    @staticmethod
    def _context_lengths(request: BagelGenerationRequest) -> list[int]:
        """``kv_len`` of each row the request adds to a batch, cond first (a branch whose context is
        cond's, or that never runs, adds none)."""
        s, cond = request.sampling, request.cond
        lengths = [cond.kv_len]
        guided = s.cfg_text_scale > 1.0
        for ctx, runs in ((request.cfg_text, guided), (request.cfg_img, guided and s.cfg_img_scale > 1.0)):
            if not runs or ctx is None or ctx is cond:
                continue
            if ctx.prefix_of == "cond" and ctx.kv_len == cond.kv_len:
                continue
            lengths.append(ctx.kv_len)
        return lengths

    @staticmethod
    def _guidance_toggles(request: BagelGenerationRequest) -> bool:
        """Guidance is on at some steps and off at others (the bank's active rows change)."""
        s = request.sampling
        if s.cfg_text_scale <= 1.0:
            return False
        timesteps, _ = flow_schedule(s.num_inference_steps, s.timestep_shift)
        active = {guidance_active(t, (s.cfg_interval[0], s.cfg_interval[1])) for t in timesteps}
        return len(active) > 1

    @classmethod
    def model_defaults(cls, model: str) -> ModelDefaults:
        """The sizes its latent grid and position table allow (the model's config); its step count is the
        authors' (the same for text-to-image and edits); its guidance is the family's settings'."""
        cfg = cached_bagel_config(model)
        return ModelDefaults(
            defaults=DiffusionDefaults(num_inference_steps=T2I_DEFAULTS.num_inference_steps),
            limits=SizeLimits(multiple=cfg.latent_downsample, max_side=cfg.max_image_side),
            label=cls.__name__,
        )

    def steps_of(self, request: BagelGenerationRequest) -> int:
        return request.sampling.num_inference_steps - 1  # the flow runs between the schedule's points

    def describe_request(self, request: BagelGenerationRequest) -> str:
        lengths = [c.kv_len for c in (request.cond, request.cfg_text, request.cfg_img) if c is not None]
        return (
            f"a {request.height}x{request.width} image over contexts of {', '.join(map(str, lengths))} tokens"
        )

    # --- per-request hooks -------------------------------------------------------------------------

    def prepare(self, request: BagelGenerationRequest) -> BagelGenerationRequest:
        """Shared contexts joined (:meth:`shared_contexts`)."""
        return self.shared_contexts(request)

    @staticmethod
    def shared_contexts(request: BagelGenerationRequest) -> BagelGenerationRequest:
        """Contexts sent as a prefix of ``cond`` (``prefix_of``) become views of its tensor."""
        shared = {
            name: ctx
            for name in ("cfg_text", "cfg_img")
            if (ctx := getattr(request, name)) is not None and ctx.prefix_of is not None
        }
        if not shared:
            return request
        changes = {}
        for name, ctx in shared.items():
            if ctx.prefix_of != "cond":
                raise ValueError(f"{name} is a prefix of {ctx.prefix_of!r}; only cond can be shared")
            cond = request.cond
            if ctx.kv_len > cond.kv_len:
                raise ValueError(f"{name} keeps {ctx.kv_len} tokens of cond, which has {cond.kv_len}")
            kv = None if cond.kv is None or ctx.kv_len == 0 else cond.kv[:, :, : ctx.kv_len]
            changes[name] = BagelContext(kv=kv, kv_len=ctx.kv_len, rope=ctx.rope)
        return msgspec.structs.replace(request, **changes)

    def validate(self, request: BagelGenerationRequest) -> None:
        """Raise ``ValueError`` naming what is wrong; run before batching, so one bad request fails alone."""
        cfg = self.cfg
        stride, largest = cfg.latent_downsample, cfg.max_image_side
        for name in ("height", "width"):
            value = getattr(request, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value % stride:
                raise ValueError(
                    f"{name} {value} is not a multiple of {stride} (BAGEL's latent patch in pixels)"
                )
            if value > largest:
                raise ValueError(f"{name} {value} is larger than this model's {largest} pixels")
        s = request.sampling
        if not isinstance(s, BagelSampling):
            raise ValueError(f"sampling must be a BagelSampling, got {type(s).__name__}")
        steps = s.num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
            raise ValueError(f"num_inference_steps must be an integer of at least 2, got {steps!r}")
        for name in ("timestep_shift", "cfg_text_scale", "cfg_img_scale", "cfg_renorm_min"):
            if not _finite(getattr(s, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(s, name)!r}")
        if s.timestep_shift <= 0:
            raise ValueError(f"timestep_shift must be positive, got {s.timestep_shift}")
        if not 0.0 <= s.cfg_renorm_min <= 1.0:
            raise ValueError(f"cfg_renorm_min must lie in [0, 1], got {s.cfg_renorm_min}")
        if s.cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(
                f"cfg_renorm_type must be one of {', '.join(RENORM_TYPES)}; got {s.cfg_renorm_type!r}"
            )
        interval = s.cfg_interval
        if not (isinstance(interval, tuple | list) and len(interval) == 2 and all(map(_finite, interval))):
            raise ValueError(f"cfg_interval must be two numbers (lo, hi), got {interval!r}")
        if not 0.0 <= interval[0] <= interval[1] <= 1.0:
            raise ValueError(f"cfg_interval must satisfy 0 <= lo <= hi <= 1, got {tuple(interval)}")
        self._check_context("cond", request.cond)
        wants_text = s.cfg_text_scale > 1.0
        if request.cfg_text is not None or wants_text:
            if request.cfg_text is None:
                raise ValueError(
                    "cfg_text_scale > 1 needs the cfg_text context (the context without the text)"
                )
            self._check_context("cfg_text", request.cfg_text)
        if request.cfg_img is not None or (wants_text and s.cfg_img_scale > 1.0):
            if request.cfg_img is None:
                raise ValueError(
                    "cfg_img_scale > 1 needs the cfg_img context (the context without the image)"
                )
            self._check_context("cfg_img", request.cfg_img)

    def _check_context(self, name: str, ctx: Any) -> None:
        llm = self.cfg.llm
        if not isinstance(ctx, BagelContext):
            raise ValueError(f"{name} must be a BagelContext, got {type(ctx).__name__}")
        for field in ("kv_len", "rope"):
            value = getattr(ctx, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}.{field} must be a non-negative integer, got {value!r}")
        want = (llm.num_layers, 2, ctx.kv_len, llm.num_kv_heads, llm.head_dim)
        if ctx.kv is None:
            if ctx.kv_len:
                raise ValueError(f"{name} has kv_len {ctx.kv_len} but no kv tensor")
            return
        if not isinstance(ctx.kv, torch.Tensor):
            raise ValueError(f"{name}.kv must be a torch.Tensor, got {type(ctx.kv).__name__}")
        if tuple(ctx.kv.shape) != want:
            raise ValueError(
                f"{name}.kv has shape {tuple(ctx.kv.shape)}; this model needs [num_layers, 2, kv_len, "
                f"num_kv_heads, head_dim] = {list(want)}"
            )
        if not ctx.kv.dtype.is_floating_point:
            raise ValueError(f"{name}.kv must be a floating-point tensor, got {ctx.kv.dtype}")

    def batch_key(self, request: BagelGenerationRequest) -> tuple[Any, ...]:
        """Requests share a batch when this matches: they then share the latent grid and the schedule."""
        s = request.sampling
        return (request.height, request.width, s.num_inference_steps, float(s.timestep_shift))

    # --- the batch ---------------------------------------------------------------------------------

    def run(
        self, batch: list[BagelGenerationRequest], generators: list[Any], should_stop: StopCheck | None = None
    ) -> BatchOutput:
        """Denoise and decode ``batch`` (one ``batch_key``); uint8 HxWx3 arrays in batch order. Raises
        :class:`BatchAborted` after the first step at whose end ``should_stop()`` is true."""
        if not batch:
            return BatchOutput([], None, {"denoise": 0.0, "decode": 0.0, "total": 0.0})
        if len(generators) != len(batch):
            raise ValueError(f"{len(batch)} requests but {len(generators)} generators")
        keys = {self.batch_key(r) for r in batch}
        if len(keys) != 1:
            raise ValueError(f"a batch must share size, steps and shift; got {sorted(keys)}")
        return self._run_whole(batch, generators, should_stop, self.context.on_step)

    @torch.no_grad()  # as the step thread runs (inference tensors could not be written in place there)
    def _run_whole(
        self,
        batch: list[BagelGenerationRequest],
        generators: list[Any],
        should_stop: StopCheck | None,
        on_step: StepCallback | None,
        stand_in: Any = None,
        on_denoised: Callable[[], None] | None = None,
    ) -> BatchOutput:
        """The batch as its step pieces run whole (``step_loop.run_whole``): each step one velocity forward
        over every request's rows, the noise drawn from ``generators``; the forwards through ``stand_in``
        where one is given (a step batcher's proxy)."""

        def stepped(step: int) -> None:
            if on_step is not None:
                on_step(step)
            if should_stop is not None and should_stop():
                raise BatchAborted(f"stopped after step {step + 1}")

        family = self.step_family(stand_in, {id(r): g for r, g in zip(batch, generators, strict=True)})
        images, timings = run_whole(family, batch, stepped, on_denoised)
        return BatchOutput(images, None, timings)

    def step_family(self, stand_in: Any = None, generators: dict[int, Any] | None = None) -> Any:
        """Its step-loop pieces (``families/bagel/steps.py``), with a CFG-parallel replica's group (or the
        given stand-in of its denoiser), previews and step caching (of the guided velocity) as their
        layers; ``generators`` by request object: the noise a whole call's requests draw."""
        from vllm_omni_plugin.diffusion.cfg_parallel import ParallelDenoiserLayer
        from vllm_omni_plugin.diffusion.previews import PreviewLayer
        from vllm_omni_plugin.diffusion.step_cache import GuidedStepCacheLayer
        from vllm_omni_plugin.families.bagel.steps import BagelSteps

        family = BagelSteps(self, generators=generators)
        family.layers += [
            ParallelDenoiserLayer(lambda: self.context.parallel_denoiser if stand_in is None else stand_in),
            PreviewLayer(family.decode, family.steps, family.estimate, lambda: self.context.on_preview),
            GuidedStepCacheLayer(
                family.steps, self.transformer.num_layers, lambda: self.context.on_cache_counts
            ),
        ]
        return family

    step_batching = True
    previews = True
    step_cache = True
    cfg_parallel = True
    """Rows (a request's guidance branches) split over the ranks; each peer keeps its rows' contexts for
    the batch (``diffusion/cfg_parallel.py``, ``diffusion/peer_group.py``'s ``PeerKept``)."""

    def peer_spec(self, model: str, device: str, num_threads: int | None) -> PeerSpec:
        from vllm_omni_plugin.diffusion.peer_group import PeerSpec

        return PeerSpec(
            model=model,
            subfolder="",
            module=BagelVelocity.__module__,
            qualname=BagelVelocity.__qualname__,
            dtype=str(self.dtype),
            device=device,
            num_threads=num_threads,
        )

    def denoiser(self) -> Any:
        return BagelVelocity(self.transformer)

    def step_joins(self) -> dict[str, ArgumentJoin]:
        return {"rows": AttentionRowsJoin()}

    def run_rows(
        self,
        batch: list[BagelGenerationRequest],
        generators: list[Any],
        should_stop: StopCheck | None,
        batcher: StepBatcher,
        group: str,
        on_step: StepCallback,
    ) -> BatchOutput:
        """:meth:`run`, its velocity forwards shared through ``batcher`` with the other groups in flight."""
        proxy = batcher.proxy(group, len(batch))
        try:
            return self._run_whole(
                batch, generators, should_stop, on_step, proxy, lambda: batcher.leave(group)
            )
        finally:
            batcher.leave(group)

    def _decode(self, latents: torch.Tensor, height: int, width: int) -> list[Any]:
        cfg = self.cfg
        p, z = cfg.latent_patch_size, cfg.latent_channels
        grid = unpatchify(latents, height // cfg.latent_downsample, width // cfg.latent_downsample, p, z)
        # CPU convolutions run slower per image on a batch than one image at a time (the batch's
        # activations leave the cache: 8 tiny 64x64 decodes took 243 ms batched, 145 ms one by one).
        per_call = 1 if self.device.type == "cpu" else max(1, DECODE_PIXELS_PER_CALL // (height * width))
        images = []
        for chunk in grid.split(per_call):
            pixels = self.decoder.decode(chunk).float()
            pixels = ((pixels * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8)  # truncation, as BAGEL
            images.extend(pixels.permute(0, 2, 3, 1).cpu().numpy())
        return images


class _RowPlan:
    """A batch's rows (one per distinct context of each request) and which of them run at each step."""

    def __init__(self, batch: list[BagelGenerationRequest], timesteps: torch.Tensor) -> None:
        self.contexts: list[BagelContext] = []
        self.row_request: list[int] = []
        self.branch_row: list[list[int]] = []
        """Per request, the rows of its cond, cfg_text and cfg_img velocities (a branch whose context
        equals an earlier branch's, or that never runs, shares that row)."""
        steps = len(timesteps)
        self.guided = torch.zeros((steps, len(batch)), dtype=torch.bool)
        self.image_guided = torch.zeros((steps, len(batch)), dtype=torch.bool)
        for r, request in enumerate(batch):
            s = request.sampling
            if s.cfg_text_scale > 1.0:
                interval = (s.cfg_interval[0], s.cfg_interval[1])
                self.guided[:, r] = torch.tensor([guidance_active(t, interval) for t in timesteps])
                if s.cfg_img_scale > 1.0:
                    self.image_guided[:, r] = self.guided[:, r]
            branches = [request.cond]
            if self.guided[:, r].any():
                branches.append(request.cfg_text)
                if self.image_guided[:, r].any():
                    branches.append(request.cfg_img)
            rows: list[int] = []
            for ctx in branches:
                row = next((row for row in rows if _same_context(self.contexts[row], ctx)), None)
                if row is None:
                    row = len(self.contexts)
                    self.contexts.append(ctx)
                    self.row_request.append(r)
                rows.append(row)
            self.branch_row.append(rows + [rows[0]] * (3 - len(rows)))
        self._steps: dict[tuple[bool, ...], _StepRows] = {}

    def at(self, step: int, bank: ContextBank, device: torch.device) -> _StepRows:
        key = tuple(self.guided[step].tolist() + self.image_guided[step].tolist())
        if key not in self._steps:
            self._steps[key] = _StepRows(self, step, bank, device)
        return self._steps[key]


class _StepRows:
    """The rows that run at a step (in bank-slot order, as the forward returns them) and, per request, the
    positions of its three velocities among them."""

    def __init__(self, plan: _RowPlan, step: int, bank: ContextBank, device: torch.device) -> None:
        guided, image_guided = plan.guided[step], plan.image_guided[step]
        active = set()
        for r, (cond, text, img) in enumerate(plan.branch_row):
            active.add(cond)
            if guided[r]:
                active.add(text)
            if image_guided[r]:
                active.add(img)
        by_slot = sorted(active, key=lambda row: bank.slot_of[row])
        self.slots = tuple(bank.slot_of[row] for row in by_slot)
        position = {row: i for i, row in enumerate(by_slot)}
        self.request_of_row = torch.tensor([plan.row_request[row] for row in by_slot], device=device)
        branch = torch.tensor(
            [[position.get(row, position[rows[0]]) for row in rows] for rows in plan.branch_row]
        )
        self.cond, self.text, self.img = (branch[:, b].to(device) for b in (COND, CFG_TEXT, CFG_IMG))
        self.guided = guided.to(device)
        self.image_guided = image_guided.to(device)


class _Guidance:
    """Per-request guidance settings as tensors, and BAGEL's combination of the three velocities."""

    def __init__(self, batch: list[BagelGenerationRequest], device: torch.device) -> None:
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None, None]

        sampling = [r.sampling for r in batch]
        self.text_scale = column([s.cfg_text_scale for s in sampling])
        self.img_scale = column([s.cfg_img_scale for s in sampling])
        self.renorm_min = column([s.cfg_renorm_min for s in sampling])
        kinds = [RENORM_TYPES.index(s.cfg_renorm_type) for s in sampling]
        self.is_global = torch.tensor([k == 0 for k in kinds], device=device)[:, None, None]
        self.is_text_channel = torch.tensor([k == 2 for k in kinds], device=device)[:, None, None]

    def _clamp(self, ratio: torch.Tensor) -> torch.Tensor:
        return torch.maximum(ratio, self.renorm_min).clamp(max=1.0)

    def combine(
        self,
        v: torch.Tensor,
        v_text: torch.Tensor,
        v_img: torch.Tensor,
        guided: torch.Tensor,
        image_guided: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, tokens, C]`` cond / no-text / no-image velocities -> each request's guided velocity
        (its cond velocity where it is not guided at this step)."""
        image_guided = image_guided[:, None, None]
        text_guided = v_text + self.text_scale * (v - v_text)
        token_norm = v.norm(dim=-1, keepdim=True)
        # text_channel: per-token renorm of the text-guided velocity, then image guidance as is
        renormed = text_guided * self._clamp(token_norm / (text_guided.norm(dim=-1, keepdim=True) + 1e-8))
        by_text_channel = torch.where(image_guided, v_img + self.img_scale * (renormed - v_img), renormed)
        # global / channel: image guidance, then renorm over the whole image or per token
        both = torch.where(image_guided, v_img + self.img_scale * (text_guided - v_img), text_guided)
        global_ratio = v.flatten(1).norm(dim=1) / (both.flatten(1).norm(dim=1) + 1e-8)
        token_ratio = token_norm / (both.norm(dim=-1, keepdim=True) + 1e-8)
        ratio = torch.where(self.is_global, global_ratio[:, None, None], token_ratio)
        out = torch.where(self.is_text_channel, by_text_channel, both * self._clamp(ratio))
        return torch.where(guided[:, None, None], out, v)


class BagelVelocity:
    """The generation expert's velocity forward as the module a step batcher or a denoiser group calls
    (by keyword)."""

    def __init__(self, model: GenerationTransformer) -> None:
        self.model = model

    @classmethod
    def load_peer(cls, model_dir: str, *, dtype: torch.dtype, device: torch.device) -> BagelVelocity:
        """A CFG-parallel peer's: the generation weights alone (no autoencoder)."""
        cfg = load_bagel_config(model_dir)
        with CheckpointReader(cfg.llm_weights) as reader:
            return cls(GenerationTransformer.load(cfg, reader, dtype=dtype, device=device))

    def forward(self, latents: torch.Tensor, rows: AttentionRows) -> torch.Tensor:
        return self.model.velocity(latents, rows)

    __call__ = forward


class AttentionRowsJoin:
    """Step batching of BAGEL's velocity forwards: each group's rows attend to their own contexts (an
    ``AttentionRows`` view of its bank). Groups join into one: their K/V buffers side by side along the
    rows (padded to the longest context), lengths and RoPE in row order. Joined again only when the
    groups of a forward change (their views are cached between steps while their active rows stay)."""

    def __init__(self) -> None:
        self._cached: tuple[list[AttentionRows], AttentionRows] | None = None

    def take(self, value: AttentionRows, rows: range) -> AttentionRows:
        """A CFG-parallel rank's rows (``diffusion/cfg_parallel.py``'s ``SplittableJoin``)."""
        return value.take(rows.start, rows.stop)

    def key(self, value: AttentionRows) -> Hashable:
        layers, _, _, kv_heads, _, head_dim = value.buffer.shape
        return (layers, kv_heads, head_dim, value.block, str(value.buffer.dtype), str(value.buffer.device))

    def join(self, values: list[AttentionRows], rows: list[int]) -> AttentionRows:
        cached = self._cached
        if (
            cached is not None
            and len(cached[0]) == len(values)
            and all(a is b for a, b in zip(cached[0], values, strict=True))
        ):
            return cached[1]
        block = values[0].block
        width = block + max(max(v.lengths) for v in values)
        buffers = [torch.nn.functional.pad(v.buffer, (0, 0, 0, width - v.buffer.shape[4])) for v in values]
        joined = AttentionRows(
            torch.cat(buffers, dim=2),
            [length for v in values for length in v.lengths],
            block,
            torch.cat([v.cos for v in values]),
            torch.cat([v.sin for v in values]),
            values[0].kv_heads,
        )
        self._cached = (list(values), joined)
        return joined


def _same_context(a: BagelContext, b: BagelContext) -> bool:
    """Equal contexts give equal velocities: one row serves both."""
    if a.kv_len != b.kv_len or a.rope != b.rope:
        return False
    if a.kv_len == 0 or a.kv is b.kv:
        return True
    return a.kv.dtype == b.kv.dtype and a.kv.device == b.kv.device and torch.equal(a.kv, b.kv)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating-point dtype")
    return value
