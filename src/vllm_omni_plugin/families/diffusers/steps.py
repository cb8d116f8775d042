"""Stable Diffusion 3 as the pieces the step loop takes (``diffusion/step_loop.py``), from the pipeline's own
components: exact against the pipeline's ``__call__`` for a request alone (issue 40; on this branch)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_omni_plugin.diffusion.params import DiffusionRequest


def fresh_scheduler(pipe: Any) -> Any:
    """A scheduler of the pipeline's kind and configuration with no state yet: each request steps its own
    (made from the configuration: a deepcopy of the pipeline's costs about 2 ms)."""
    return type(pipe.scheduler).from_config(pipe.scheduler.config)


@dataclass(eq=False)
class SD3State:
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    """The rows' prompt embeddings: [negative, positive] with guidance, [positive] without."""
    pooled: torch.Tensor
    guidance: float
    index: int = 0


class SD3Steps:
    """``StableDiffusion3Pipeline``'s text to image, one step at a time."""

    def __init__(self, pipe: Any, max_sequence_length: int = 256) -> None:
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length

    def _guided(self, request: DiffusionRequest) -> bool:
        return self._guidance(request) > 1.0

    def _guidance(self, request: DiffusionRequest) -> float:
        return 7.0 if request.guidance_scale is None else request.guidance_scale

    def rows(self, request: DiffusionRequest) -> int:
        return 2 if self._guided(request) else 1

    def encode(self, requests: list[DiffusionRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pe, npe, ppe, nppe = self.pipe.encode_prompt(
            prompt=[r.prompt for r in requests], prompt_2=None, prompt_3=None,
            negative_prompt=[r.negative_prompt or "" for r in requests],
            do_classifier_free_guidance=any(self._guided(r) for r in requests), device=self.pipe.device,
            num_images_per_prompt=1, max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        out = []
        for k, r in enumerate(requests):
            if self._guided(r):
                out.append(
                    (torch.cat([npe[k : k + 1], pe[k : k + 1]]), torch.cat([nppe[k : k + 1], ppe[k : k + 1]]))
                )
            else:
                out.append((pe[k : k + 1], ppe[k : k + 1]))
        return out

    def prepare(self, request: DiffusionRequest, conditioning: tuple[torch.Tensor, torch.Tensor]) -> SD3State:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        pipe = self.pipe
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        embeds, pooled = conditioning
        latents = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels, height, width, embeds.dtype, pipe.device, generator, None
        )
        scheduler = fresh_scheduler(pipe)
        timesteps, _ = retrieve_timesteps(scheduler, request.num_inference_steps or 28, pipe.device)
        return SD3State(latents, scheduler, timesteps, embeds, pooled, self._guidance(request))

    def steps(self, state: SD3State) -> int:
        return len(state.timesteps)

    def shape(self, state: SD3State) -> Hashable:
        return tuple(state.latents.shape)

    def denoise(self, states: list[SD3State]) -> None:
        hidden = torch.cat([s.latents.expand(s.embeds.shape[0], -1, -1, -1) for s in states])
        timestep = torch.cat([s.timesteps[s.index].expand(s.embeds.shape[0]) for s in states])
        embeds, pooled = torch.cat([s.embeds for s in states]), torch.cat([s.pooled for s in states])
        out = self.pipe.transformer(
            hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds, pooled_projections=pooled,
            return_dict=False,
        )[0]  # fmt: skip
        row = 0
        for s in states:
            n = s.embeds.shape[0]
            if n == 2:
                uncond, cond = out[row : row + 1], out[row + 1 : row + 2]
                noise = uncond + s.guidance * (cond - uncond)
            else:
                noise = out[row : row + 1]
            row += n
            s.latents = s.scheduler.step(noise, s.timesteps[s.index], s.latents, return_dict=False)[0]
            s.index += 1

    def decode(self, states: list[SD3State]) -> list[np.ndarray]:
        """One decoder call per image size."""
        vae = self.pipe.vae
        images: dict[int, np.ndarray] = {}
        groups: dict[Hashable, list[int]] = {}
        for k, s in enumerate(states):
            groups.setdefault(self.shape(s), []).append(k)
        for members in groups.values():
            latents = torch.cat([states[k].latents for k in members])
            latents = latents / vae.config.scaling_factor + vae.config.shift_factor
            decoded = self.pipe.image_processor.postprocess(
                vae.decode(latents, return_dict=False)[0], output_type="np"
            )
            for k, image in zip(members, decoded, strict=True):
                images[k] = (image * 255).round().astype(np.uint8)
        return [images[k] for k in range(len(states))]


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


class FluxSteps:
    """``FluxPipeline``'s text to image (guidance distilled, no true CFG), one step at a time."""

    def __init__(self, pipe: Any, max_sequence_length: int = 512) -> None:
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length

    def rows(self, request: DiffusionRequest) -> int:
        return 1

    def encode(
        self, requests: list[DiffusionRequest]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=[r.prompt for r in requests], prompt_2=None, device=self.pipe.device,
            num_images_per_prompt=1, max_sequence_length=self.max_sequence_length,
        )  # fmt: skip
        return [(embeds[k : k + 1], pooled[k : k + 1], text_ids) for k in range(len(requests))]

    def prepare(self, request: DiffusionRequest, conditioning: tuple[torch.Tensor, ...]) -> FluxState:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe = self.pipe
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        embeds, pooled, text_ids = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        latents, image_ids = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels // 4, height, width, embeds.dtype, pipe.device, generator
        )
        steps = request.num_inference_steps or 28
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        config = pipe.scheduler.config
        mu = calculate_shift(
            latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )  # fmt: skip
        scheduler = fresh_scheduler(pipe)
        timesteps, _ = retrieve_timesteps(scheduler, steps, pipe.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        guidance = 3.5 if request.guidance_scale is None else request.guidance_scale
        return FluxState(
            latents, image_ids, text_ids, scheduler, timesteps, embeds, pooled, guidance, height, width
        )

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
        out = self.pipe.transformer(
            hidden_states=hidden, timestep=timestep / 1000, guidance=guidance,
            pooled_projections=torch.cat([s.pooled for s in states]),
            encoder_hidden_states=torch.cat([s.embeds for s in states]),
            txt_ids=states[0].text_ids, img_ids=states[0].image_ids, return_dict=False,
        )[0]  # fmt: skip
        for k, s in enumerate(states):
            s.latents = s.scheduler.step(out[k : k + 1], s.timesteps[s.index], s.latents, return_dict=False)[
                0
            ]
            s.index += 1

    def decode(self, states: list[FluxState]) -> list[np.ndarray]:
        """One decoder call per image size."""
        pipe, vae = self.pipe, self.pipe.vae
        images: dict[int, np.ndarray] = {}
        groups: dict[Hashable, list[int]] = {}
        for k, s in enumerate(states):
            groups.setdefault((s.height, s.width), []).append(k)
        for (height, width), members in groups.items():
            latents = pipe._unpack_latents(
                torch.cat([states[k].latents for k in members]), height, width, pipe.vae_scale_factor
            )
            latents = latents / vae.config.scaling_factor + vae.config.shift_factor
            decoded = pipe.image_processor.postprocess(
                vae.decode(latents, return_dict=False)[0], output_type="np"
            )
            for k, image in zip(members, decoded, strict=True):
                images[k] = (image * 255).round().astype(np.uint8)
        return [images[k] for k in range(len(states))]
