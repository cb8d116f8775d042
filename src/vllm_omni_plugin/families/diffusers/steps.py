"""Stable Diffusion 3, FLUX, Qwen-Image and Qwen-Image-Edit as the pieces the step loop takes
(``diffusion/step_loop.py``), from the pipelines' own components: exact against the pipeline's
``__call__`` for a request alone.

Prompts are encoded through a :class:`~vllm_omni_plugin.diffusion.step_loop.ConditioningCache`: the
negative prompt most requests share (``""``) and repeated prompts are encoded once, with the same
encoder calls the pipeline makes, so their embeddings are the pipeline's."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from vllm_omni_plugin.diffusion.diffusers_runner import as_pil
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.pipeline_steps import Inpainting, PipelineSteps, fresh_scheduler
from vllm_omni_plugin.diffusion.step_loop import ConditioningCache, runs_in_loop


@dataclass(eq=False)
class SD3State:
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    """The rows' prompt embeddings: [negative, positive] with guidance, [positive] without."""
    pooled: torch.Tensor
    guidance: float
    height: int
    width: int
    index: int = 0
    inpaint: Inpainting | None = None
    """A masked edit's mask, source latents and noise."""


class SD3Steps(PipelineSteps):
    """``StableDiffusion3Pipeline``'s text to image, image to image as its family's
    ``StableDiffusion3Img2ImgPipeline`` runs it (the source image encoded and noised to the first step its
    strength leaves) and masked edits as ``StableDiffusion3InpaintPipeline`` runs them (after each step,
    what the mask keeps is the source noised to the next step), one step at a time."""

    image_to_image = True
    masks = True

    def _guided(self, request: DiffusionRequest) -> bool:
        return self._guidance(request) > 1.0

    def _guidance(self, request: DiffusionRequest) -> float:
        return 7.0 if request.guidance_scale is None else request.guidance_scale

    def rows(self, request: DiffusionRequest) -> int:
        return 2 if self._guided(request) else 1

    def encode(self, requests: list[DiffusionRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Prompts in one encoder call, the negative prompts not cached yet in a second (as the pipeline
        encodes them: apart from the prompts)."""
        prompts = self.texts.get([r.prompt for r in requests], self._encode)
        guided = [r for r in requests if self._guided(r)]
        negatives = self.texts.get([r.negative_prompt or "" for r in guided], self._encode)
        out, negative = [], iter(negatives)
        for r, (embeds, pooled) in zip(requests, prompts, strict=True):
            if self._guided(r):
                uncond, uncond_pooled = next(negative)
                out.append((torch.cat([uncond, embeds]), torch.cat([uncond_pooled, pooled])))
            else:
                out.append((embeds, pooled))
        return out

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return [(embeds[k : k + 1], pooled[k : k + 1]) for k in range(len(texts))]

    def prepare(self, request: DiffusionRequest, conditioning: tuple[torch.Tensor, torch.Tensor]) -> SD3State:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        pipe = self.pipe
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        embeds, pooled = conditioning
        scheduler = fresh_scheduler(pipe)
        timesteps, _ = retrieve_timesteps(scheduler, self.steps_of(request), self.device)
        inpaint = None
        if request.images:
            timesteps = self.strength_timesteps(request, scheduler, timesteps)
            latents, encoded, noise = self.source_draws(
                request, scheduler, timesteps[:1], height, width, embeds.dtype, generator
            )
            if request.mask is not None:
                inpaint = self.inpainting(request, encoded, noise, height, width)
        else:
            channels = pipe.transformer.config.in_channels
            latents = pipe.prepare_latents(
                1, channels, height, width, embeds.dtype, self.device, generator, None
            )
        guidance = self._guidance(request)
        return SD3State(
            latents, scheduler, timesteps, embeds, pooled, guidance, height, width, inpaint=inpaint
        )

    def steps(self, state: SD3State) -> int:
        return len(state.timesteps)

    def shape(self, state: SD3State) -> Hashable:
        return tuple(state.latents.shape)

    def shifted(self, state: SD3State) -> bool:
        """A masked edit's latents decode as ``StableDiffusion3InpaintPipeline`` decodes them: scaled back
        without the VAE's shift factor, which its encode subtracted."""
        return state.inpaint is None

    def denoise(self, states: list[SD3State]) -> None:
        hidden = torch.cat([s.latents.expand(s.embeds.shape[0], -1, -1, -1) for s in states])
        timestep = torch.cat([s.timesteps[s.index].expand(s.embeds.shape[0]) for s in states])
        embeds, pooled = torch.cat([s.embeds for s in states]), torch.cat([s.pooled for s in states])
        owners = [s for s in states for _ in range(s.embeds.shape[0])]
        out = self.forward(
            owners, hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds,
            pooled_projections=pooled,
        )  # fmt: skip
        row = 0
        for s in states:
            n = s.embeds.shape[0]
            if n == 2:
                uncond, cond = out[row : row + 1], out[row + 1 : row + 2]
                noise = uncond + s.guidance * (cond - uncond)
            else:
                noise = out[row : row + 1]
            row += n
            self.advance(s, noise)


def shifted_schedule(
    pieces: PipelineSteps, request: DiffusionRequest, height: int, width: int, sigmas: Any,
    strength: bool = True,
) -> tuple[Any, torch.Tensor]:  # fmt: skip
    """FLUX's and Qwen-Image's schedule as their pipelines make it (shifted by the image's token count),
    an image-to-image request's first steps skipped by its strength (``strength``: the family's source
    images are noised; an edit's condition the denoiser instead): its own scheduler and the timesteps
    it runs."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    pipe = pieces.pipe
    config = pipe.scheduler.config
    mu = calculate_shift(
        (height // pipe.vae_scale_factor // 2) * (width // pipe.vae_scale_factor // 2),
        config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5), config.get("max_shift", 1.15),
    )  # fmt: skip
    scheduler = fresh_scheduler(pipe)
    timesteps, _ = retrieve_timesteps(
        scheduler, pieces.steps_of(request), pieces.device, sigmas=sigmas, mu=mu
    )
    if request.images and strength:
        return scheduler, pieces.strength_timesteps(request, scheduler, timesteps)
    scheduler.set_begin_index(0)
    return scheduler, timesteps


def packed_source(
    pieces: PipelineSteps, request: DiffusionRequest, scheduler: Any, timesteps: torch.Tensor, height: int,
    width: int, dtype: torch.dtype, generator: torch.Generator,
) -> tuple[torch.Tensor | None, Inpainting | None]:  # fmt: skip
    """An edit's noised source latents packed into tokens as FLUX's and Qwen-Image's pipelines pack them
    (None for a text-to-image request: the pipeline draws its latents), and a masked edit's
    :class:`Inpainting` packed alike, as their inpainting pipelines pack it (the mask repeated over the
    latents' channels)."""
    if not request.images:
        return None, None
    noised, encoded, noise = pieces.source_draws(
        request, scheduler, timesteps[:1], height, width, dtype, generator
    )
    channels = pieces.pipe.transformer.config.in_channels // 4

    def pack(latents: torch.Tensor) -> torch.Tensor:
        return pieces.pipe._pack_latents(latents, 1, channels, latents.shape[-2], latents.shape[-1])

    if request.mask is None:
        return pack(noised), None
    unpacked = pieces.inpainting(request, encoded, noise, height, width)
    mask = pack(unpacked.mask.repeat(1, channels, 1, 1))
    return pack(noised), Inpainting(pack(unpacked.source), pack(noise), mask)


@dataclass(eq=False)
class FluxState:
    latents: torch.Tensor
    """Packed: (1, tokens, channels)."""
    image_ids: torch.Tensor
    text_ids: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    pooled: torch.Tensor
    guidance: float
    height: int
    width: int
    index: int = 0
    inpaint: Inpainting | None = None
    """A masked edit's mask (one per channel), source latents and noise, packed as the latents."""


class FluxSteps(PipelineSteps):
    """``FluxPipeline``'s text to image (guidance distilled, no true CFG), image to image as
    ``FluxImg2ImgPipeline`` runs it and masked edits as ``FluxInpaintPipeline`` runs them (in packed
    tokens: the mask repeated over the latents' channels), one step at a time."""

    image_to_image = True
    masks = True
    mask_scale = 2

    default_max_sequence_length = 512

    def rows(self, request: DiffusionRequest) -> int:
        return 1

    def encode(
        self, requests: list[DiffusionRequest]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.texts.get([r.prompt for r in requests], self._encode)

    def _encode(self, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return [(embeds[k : k + 1], pooled[k : k + 1], text_ids) for k in range(len(texts))]

    def prepare(self, request: DiffusionRequest, conditioning: tuple[torch.Tensor, ...]) -> FluxState:
        pipe = self.pipe
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        embeds, pooled, text_ids = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        steps = self.steps_of(request)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False) and not request.images:
            sigmas = None  # the text-to-image pipeline's rule (its image-to-image one has none)
        scheduler, timesteps = shifted_schedule(self, request, height, width, sigmas)
        channels = pipe.transformer.config.in_channels // 4
        packed, inpaint = packed_source(
            self, request, scheduler, timesteps, height, width, embeds.dtype, generator
        )
        latents, image_ids = pipe.prepare_latents(
            1, channels, height, width, embeds.dtype, self.device, generator, packed
        )  # packed given: its image ids only
        guidance = 3.5 if request.guidance_scale is None else request.guidance_scale
        return FluxState(
            latents, image_ids, text_ids, scheduler, timesteps, embeds, pooled, guidance, height, width,
            inpaint=inpaint,
        )  # fmt: skip

    def steps(self, state: FluxState) -> int:
        return len(state.timesteps)

    def shape(self, state: FluxState) -> Hashable:
        return tuple(state.latents.shape), tuple(state.text_ids.shape)

    def denoise(self, states: list[FluxState]) -> None:
        hidden = torch.cat([s.latents for s in states])
        timestep = torch.cat([s.timesteps[s.index].expand(1).to(s.latents.dtype) for s in states])
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.tensor([s.guidance for s in states], dtype=torch.float32)
        out = self.forward(
            states, hidden_states=hidden, timestep=timestep / 1000, guidance=guidance,
            pooled_projections=torch.cat([s.pooled for s in states]),
            encoder_hidden_states=torch.cat([s.embeds for s in states]),
            txt_ids=states[0].text_ids, img_ids=states[0].image_ids,
        )  # fmt: skip
        for k, s in enumerate(states):
            self.advance(s, out[k : k + 1])


@dataclass(eq=False)
class QwenImageState:
    latents: torch.Tensor
    """Packed: (1, tokens, channels)."""
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    """The prompt's embeddings, its own length (1, L, D)."""
    negative: torch.Tensor | None
    """The negative prompt's, with true CFG (``guidance > 1``); None without."""
    guidance: float
    height: int
    width: int
    index: int = 0
    inpaint: Inpainting | None = None
    """A masked edit's mask (one per channel), source latents and noise, packed as the latents."""


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(1, L_i, D) rows as one (N, max L, D) batch and its mask (None where every row is as long)."""
    longest = max(r.shape[1] for r in rows)
    if all(r.shape[1] == longest for r in rows):
        return torch.cat(rows), None
    batch = rows[0].new_zeros(len(rows), longest, rows[0].shape[2])
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=rows[0].device)
    for k, r in enumerate(rows):
        batch[k, : r.shape[1]] = r[0]
        mask[k, : r.shape[1]] = 1
    return batch, mask


class QwenImageSteps(PipelineSteps):
    """``QwenImagePipeline``'s text to image, image to image as ``QwenImageImg2ImgPipeline`` runs it and
    masked edits as ``QwenImageInpaintPipeline`` runs them, one step at a time: true CFG as the pipeline
    runs it (the prompts' rows in one forward, the negative prompts' in a second, then the norm-kept
    combination), a guided request's negative prompt ``" "`` where it gives none (the served runner's
    rule)."""

    negative_default = " "
    default_max_sequence_length = 512
    image_to_image = True
    masks = True
    mask_scale = 2

    def steps_of(self, request: DiffusionRequest) -> int:
        return request.num_inference_steps or 50

    def encoded_source(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Its video autoencoder's latents of the image as one frame, normalized by the latents' mean and
        deviation: (1, 1, channels, h, w), as ``QwenImageImg2ImgPipeline`` noises them."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents

        vae = self.pipe.vae
        encoded = retrieve_latents(vae.encode(image.unsqueeze(2)), generator=generator)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(encoded.device, encoded.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(encoded.device, encoded.dtype)
        return ((encoded - mean) * inverse_std).transpose(1, 2)

    def _guidance(self, request: DiffusionRequest) -> float:
        return 4.0 if request.guidance_scale is None else request.guidance_scale

    def rows(self, request: DiffusionRequest) -> int:
        return 2 if self._guidance(request) > 1.0 else 1

    def encode(self, requests: list[DiffusionRequest]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return self.with_negatives(requests, lambda r: self._guidance(r) > 1.0, self._encode)

    def _encode(self, texts: list[str]) -> list[torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=texts, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        lengths = [embeds.shape[1]] * len(texts) if mask is None else [int(m.sum()) for m in mask]
        return [embeds[k : k + 1, : lengths[k]] for k in range(len(texts))]

    def prepare(self, request: DiffusionRequest, conditioning: tuple[Any, Any]) -> QwenImageState:
        pipe = self.pipe
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        embeds, negative = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        steps = self.steps_of(request)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler, timesteps = shifted_schedule(self, request, height, width, sigmas)
        channels = pipe.transformer.config.in_channels // 4
        packed, inpaint = packed_source(
            self, request, scheduler, timesteps, height, width, embeds.dtype, generator
        )
        latents = pipe.prepare_latents(
            1, channels, height, width, embeds.dtype, self.device, generator, packed
        )  # packed given: as it is
        guidance = self._guidance(request)
        return QwenImageState(
            latents, scheduler, timesteps, embeds, negative, guidance, height, width, inpaint=inpaint
        )

    def steps(self, state: QwenImageState) -> int:
        return len(state.timesteps)

    def shape(self, state: QwenImageState) -> Hashable:
        return tuple(state.latents.shape), state.height, state.width

    def _forward(self, states: list[QwenImageState], rows: list[torch.Tensor]) -> torch.Tensor:
        pipe = self.pipe
        embeds, mask = padded(rows)
        first = states[0]
        shape = (1, first.height // pipe.vae_scale_factor // 2, first.width // pipe.vae_scale_factor // 2)
        timestep = torch.cat([s.timesteps[s.index].expand(1).to(s.latents.dtype) for s in states])
        return self.forward(
            states, hidden_states=torch.cat([s.latents for s in states]), timestep=timestep / 1000,
            guidance=None, encoder_hidden_states_mask=mask, encoder_hidden_states=embeds,
            img_shapes=[[shape]] * len(states), attention_kwargs={},
        )  # fmt: skip

    def denoise(self, states: list[QwenImageState]) -> None:
        def forward(chosen: list[QwenImageState], negative: bool) -> torch.Tensor:
            return self._forward(chosen, [s.negative if negative else s.embeds for s in chosen])

        def combine(s: QwenImageState, noise: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
            combined = negative + s.guidance * (noise - negative)
            return combined * (
                torch.norm(noise, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
            )

        self.guided_by_second_forward(states, forward, combine)


def cached_source_encoding(pipe: Any) -> ConditioningCache:
    """The Qwen-Image-Edit pipelines' source encoding (``_encode_vae_image``) through a cache of each
    source's latents by its pixels' digest, installed on ``pipe`` once: an image edited again (another
    prompt or seed, a request's ``n`` variations) is not encoded again, in the loop or in a whole call.
    Exact: the pipelines encode a source by its latent distribution's mode, which draws nothing from the
    generator, and with a list of generators they encode and normalize row by row."""
    cache = pipe.__dict__.get("source_latents")
    if isinstance(cache, ConditioningCache):
        return cache
    cache = ConditioningCache()
    encode = pipe._encode_vae_image
    lock = threading.Lock()  # step-batched groups call from threads of their own

    def by_row(image: torch.Tensor, generator: Any) -> torch.Tensor:
        if not isinstance(generator, list) and image.shape[0] != 1:
            return encode(image=image, generator=generator)  # one batched encode: as it is
        rows = []
        for i in range(image.shape[0]):
            row = image[i : i + 1]
            digest = hashlib.blake2b(row.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
                                     digest_size=16)  # fmt: skip
            digest.update(f"{tuple(row.shape)} {row.dtype}".encode())
            own = [generator[i] if isinstance(generator, list) else generator]
            with lock:
                ((latents,),) = cache.get(
                    [digest.hexdigest()], lambda _, row=row, own=own: [(encode(image=row, generator=own),)]
                )
            rows.append(latents)
        return torch.cat(rows)

    pipe.__dict__["_encode_vae_image"] = by_row  # this pipeline's own, not its class's
    pipe.__dict__["source_latents"] = cache
    return cache


@dataclass(eq=False)
class QwenImageEditState(QwenImageState):
    image_latents: torch.Tensor | None = None
    """The source image's packed latents, beside the latents in every forward: (1, tokens, channels)."""
    source_size: tuple[int, int] = (0, 0)
    """The source as the pipeline resizes it (about a megapixel): (height, width)."""


class QwenImageEditSteps(QwenImageSteps):
    """``QwenImageEditPipeline`` one step at a time, one source image per request as the served runner
    sends it (``QwenImageEditRunner``: resized to about a megapixel, its aspect kept, as the pipeline
    resizes a single image): the prompt and negative prompt encoded with the image by the
    vision-language encoder, the source's latents joined to each row's tokens, the output's own tokens
    taken back. Prompts are not cached by text: their embeddings depend on the image."""

    image_to_image = False
    masks = False  # the runner refuses them (no inpainting pipeline of the edit family is served)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sources = cached_source_encoding(self.pipe)
        """The sources' encoded latents (shared with the runner's whole calls)."""

    def runs(self, request: DiffusionRequest) -> bool:
        return len(request.images or []) == 1 and runs_in_loop(request, self.layers, own=("images",))

    def source(self, request: DiffusionRequest) -> tuple[Any, int, int]:
        """The request's source image as the pipeline conditions on it, and its (height, width)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        image = as_pil(request.images[0])
        width, height, _ = calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
        return self.pipe.image_processor.resize(image, height, width), height, width

    def encode(self, requests: list[DiffusionRequest]) -> list[tuple[Any, ...]]:
        encoded = []
        for request in requests:
            image, height, width = self.source(request)

            def embeds(text: str, image: Any = image) -> torch.Tensor:
                return self.pipe.encode_prompt(prompt=[text], image=[image], device=self.device)[0]

            negative = None
            if self._guidance(request) > 1.0:
                negative = embeds(request.negative_prompt or self.negative_default)
            encoded.append((embeds(request.prompt), negative, (image, height, width)))
        return encoded

    def prepare(self, request: DiffusionRequest, conditioning: tuple[Any, ...]) -> QwenImageEditState:
        pipe = self.pipe
        embeds, negative, (image, source_height, source_width) = conditioning
        multiple = pipe.vae_scale_factor * 2
        height = (request.height or source_height) // multiple * multiple
        width = (request.width or source_width) // multiple * multiple
        pixels = pipe.image_processor.preprocess(image, source_height, source_width).unsqueeze(2)
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        channels = pipe.transformer.config.in_channels // 4
        latents, image_latents = pipe.prepare_latents(
            pixels, 1, channels, height, width, embeds.dtype, self.device, generator
        )
        steps = self.steps_of(request)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler, timesteps = shifted_schedule(self, request, height, width, sigmas, strength=False)
        return QwenImageEditState(
            latents, scheduler, timesteps, embeds, negative, self._guidance(request), height, width,
            image_latents=image_latents, source_size=(source_height, source_width),
        )  # fmt: skip

    def shape(self, state: QwenImageState) -> Hashable:
        edit = cast(QwenImageEditState, state)  # the states this family prepares
        return tuple(edit.latents.shape), edit.height, edit.width, edit.source_size

    def _forward(self, states: list[QwenImageState], rows: list[torch.Tensor]) -> torch.Tensor:
        pipe = self.pipe
        embeds, mask = padded(rows)
        first = cast(QwenImageEditState, states[0])
        scale = pipe.vae_scale_factor * 2
        shapes = [(1, first.height // scale, first.width // scale)]
        shapes.append((1, first.source_size[0] // scale, first.source_size[1] // scale))
        timestep = torch.cat([s.timesteps[s.index].expand(1).to(s.latents.dtype) for s in states])
        tokens = torch.cat(
            [torch.cat([s.latents, cast(QwenImageEditState, s).image_latents], dim=1) for s in states]
        )
        out = self.forward(
            states, hidden_states=tokens, timestep=timestep / 1000, guidance=None,
            encoder_hidden_states_mask=mask, encoder_hidden_states=embeds, img_shapes=[shapes] * len(states),
            attention_kwargs={},
        )  # fmt: skip
        return out[:, : first.latents.shape[1]]
