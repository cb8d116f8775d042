"""GLM-Image's DiT (text to image from the AR stage's prior tokens) as the pieces the step loop takes
(``diffusion/step_loop.py``), from ``GlmImagePipeline``'s own components: exact against its ``__call__``
for a request alone.

Guidance is two forwards, as the pipeline runs it: the prompts' glyph embeddings with their prior tokens,
then the empty glyph text with the prior tokens dropped. Each prompt's glyph embeddings are its own (the
pipeline encodes prompts one by one and left-pads shorter ones beside longer, unmasked): requests share a
forward only with equal glyph lengths.

Edits as the pipeline runs them: each source image is VAE-encoded (its latent's mode) and written into
the request's own K/V cache by a forward of its own before the request's first step (through the
family's layers, as the pipeline's call is); each step's prompt forward reads the caches (joined per row
across the requests sharing it: edits of equal source grids), the guidance forward skips them."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_omni_plugin.diffusion.diffusers_runner import as_pil
from vllm_omni_plugin.diffusion.pipeline_steps import (
    PipelineSteps,
    fresh_scheduler,
)
from vllm_omni_plugin.diffusion.step_loop import runs_in_loop
from vllm_omni_plugin.families.glm_image.runner import SourceImageCacheJoin


@dataclass(eq=False)
class GlmImageState:
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    """The prompt's glyph embeddings (1, L, D)."""
    negative: torch.Tensor | None
    """The empty glyph text's, with guidance (``guidance > 1``); None without."""
    prior: torch.Tensor
    """The AR stage's prior token ids (1, N)."""
    target_size: torch.Tensor
    crop: torch.Tensor
    guidance: float
    height: int
    width: int
    index: int = 0
    sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    """An edit's source images not yet written: each one's normalized latent, prior ids and size."""
    grids: tuple[tuple[int, ...], ...] = ()
    """An edit's source grids (edits share a forward with equal ones)."""
    kv: Any = None
    """An edit's K/V cache of its source images, once written."""


class GlmImageSteps(PipelineSteps):
    """``GlmImagePipeline``'s denoising from prior tokens, one step at a time."""

    default_max_sequence_length = 2048
    default_guidance = 1.5
    default_steps = 50

    def _guidance(self, request: Any) -> float:
        return self.default_guidance if request.guidance_scale is None else request.guidance_scale

    def runs(self, request: Any) -> bool:
        return runs_in_loop(request, self.layers, own=("images",))

    def rows(self, request: Any) -> int:
        return 2 if self._guidance(request) > 1.0 else 1

    def encode(self, requests: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        prompts = self.texts.get([r.prompt for r in requests], self._encode)
        guided = [r for r in requests if self._guidance(r) > 1.0]
        negatives = iter(self.texts.get([""] * len(guided), self._encode))
        return [
            (p, next(negatives) if self._guidance(r) > 1.0 else None)
            for r, p in zip(requests, prompts, strict=True)
        ]

    def _encode(self, texts: list[str]) -> list[torch.Tensor]:
        pipe = self.pipe
        return [
            pipe._get_glyph_embeds([text], self.max_sequence_length, self.device, pipe.dtype)
            for text in texts
        ]

    def prepare(self, request: Any, conditioning: tuple[torch.Tensor, torch.Tensor | None]) -> GlmImageState:
        from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps

        pipe = self.pipe
        height, width = int(request.height), int(request.width)  # the AR stage drew its tokens for one size
        embeds, negative = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        latents = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels, height, width, embeds.dtype, self.device, generator
        )
        steps = request.num_inference_steps or self.default_steps
        config = pipe.scheduler.config
        image_tokens = (height // pipe.vae_scale_factor) * (width // pipe.vae_scale_factor)
        image_tokens //= pipe.transformer.config.patch_size**2
        train = config.num_train_timesteps
        timesteps = np.linspace(train, 1.0, steps + 1)[:-1].astype(np.int64).astype(np.float32)
        mu = calculate_shift(
            image_tokens, config.get("base_image_seq_len", 256), config.get("base_shift", 0.25),
            config.get("max_shift", 0.75),
        )  # fmt: skip
        scheduler = fresh_scheduler(pipe)
        schedule, _ = retrieve_timesteps(scheduler, steps, self.device, timesteps, timesteps / train, mu=mu)
        prior = torch.as_tensor(request.prior_token_ids, dtype=torch.long).reshape(1, -1).to(self.device)
        target_size = torch.tensor([[height, width]], dtype=embeds.dtype, device=self.device)
        crop = torch.zeros((1, 2), dtype=embeds.dtype, device=self.device)
        state = GlmImageState(
            latents, scheduler, schedule, embeds, negative, prior, target_size, crop, self._guidance(request),
            height, width,
        )  # fmt: skip
        if request.image_to_image:
            state.sources, state.grids = self._sources(request, embeds.dtype, generator)
        return state

    def _sources(
        self, request: Any, dtype: torch.dtype, generator: torch.Generator
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], tuple[tuple[int, ...], ...]]:
        """An edit's source images as the pipeline prepares them: cut to whole DiT patches, preprocessed,
        VAE-encoded (the latent's mode), normalized by the VAE's latent statistics; with each one's prior
        ids and grid."""
        from diffusers.pipelines.glm_image.pipeline_glm_image import retrieve_latents

        pipe, vae = self.pipe, self.pipe.vae
        shape = (1, vae.config.latent_channels, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(self.device, dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(self.device, dtype)
        grids = [torch.as_tensor(g, dtype=torch.long).reshape(3) for g in request.source_image_grid_thw]
        ids = torch.cat(
            [torch.as_tensor(i, dtype=torch.long).reshape(-1) for i in request.prior_token_image_ids]
        )
        per_image = torch.split(ids.to(self.device), [int(g.prod()) for g in grids])
        multiple = pipe.vae_scale_factor * pipe.transformer.config.patch_size
        sources = []
        for image, image_ids in zip(request.images, per_image, strict=True):
            pil = as_pil(image)
            height, width = (pil.size[1] // multiple) * multiple, (pil.size[0] // multiple) * multiple
            pixels = pipe.image_processor.preprocess(pil, height=height, width=width).to(self.device, dtype)
            latent = retrieve_latents(vae.encode(pixels), generator=generator, sample_mode="argmax")
            size = torch.tensor([pixels.shape[-2:]], device=self.device)
            sources.append(((latent - mean) / std, image_ids, size))
        return sources, tuple(tuple(int(x) for x in g.tolist()) for g in grids)

    def _write_sources(self, state: GlmImageState) -> None:
        """The edit's source images into its own K/V cache: one forward each, as the pipeline's."""
        from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

        kv = GlmImageKVCache(num_layers=self.pipe.transformer.config.num_layers)
        kv.set_mode("write")
        for latent, ids, size in state.sources or []:
            self.forward(
                [state], hidden_states=latent,
                encoder_hidden_states=torch.zeros_like(state.embeds)[:1, :0, ...], prior_token_id=ids,
                prior_token_drop=torch.full_like(ids, False, dtype=torch.bool),
                timestep=torch.zeros((1,), device=self.device), target_size=size,
                crop_coords=torch.zeros((1, 2), device=self.device), attention_kwargs=None, kv_caches=kv,
            )  # fmt: skip
        kv.next_sample()
        state.kv, state.sources = kv, None

    def steps(self, state: GlmImageState) -> int:
        return len(state.timesteps)

    def shape(self, state: GlmImageState) -> Hashable:
        return tuple(state.latents.shape), state.embeds.shape[1], state.grids

    def _forward(self, states: list[GlmImageState], embeds: list[torch.Tensor], drop: bool) -> torch.Tensor:
        kv = None
        if states[0].kv is not None:  # edits: the prompt forward reads their source images, guidance skips
            for s in states:
                s.kv.set_mode("skip" if drop else "read")
            kv = (
                states[0].kv
                if len(states) == 1
                else SourceImageCacheJoin().join([s.kv for s in states], [1] * len(states))
            )
        prior = torch.cat([s.prior for s in states])
        timestep = torch.cat([s.timesteps[s.index].expand(1) - 1 for s in states])
        return self.forward(
            states, hidden_states=torch.cat([s.latents for s in states]).to(self.pipe.transformer.dtype),
            encoder_hidden_states=torch.cat(embeds), prior_token_id=prior,
            prior_token_drop=torch.full_like(prior, drop, dtype=torch.bool), timestep=timestep,
            target_size=torch.cat([s.target_size for s in states]),
            crop_coords=torch.cat([s.crop for s in states]), attention_kwargs=None, kv_caches=kv,
        ).float()  # fmt: skip

    def denoise(self, states: list[GlmImageState]) -> None:
        for s in states:
            if s.sources is not None:
                self._write_sources(s)
        self.guided_by_second_forward(
            states,
            lambda chosen, drop: self._forward(
                chosen, [s.negative if drop else s.embeds for s in chosen], drop
            ),
            lambda s, noise, negative: negative + s.guidance * (noise - negative),
        )
