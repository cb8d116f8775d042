"""Wan 2.1's text-to-video and image-to-video as the pieces the step loop takes (``diffusion/step_loop.py``),
from the pipelines' own components: exact against ``WanPipeline`` / ``WanImageToVideoPipeline`` for a request
alone. Each request keeps its own scheduler (UniPC: a multistep history per request), latents and, for
image-to-video, its source frame's condition and image embeddings, so requests of different lengths and
sources step side by side (one forward per shape: frames and size).

Wan 2.2's two-expert pipelines (``boundary_ratio``) and its first-frame timestep masking
(``expand_timesteps``) run as whole requests."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_omni_plugin.diffusion.diffusers_runner import as_pil
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.pipeline_steps import PipelineSteps, fresh_scheduler
from vllm_omni_plugin.diffusion.step_loop import decoded_by_group, runs_in_loop


@dataclass(eq=False)
class WanState:
    latents: torch.Tensor
    """(1, channels, latent frames, h, w), float32 as the pipeline keeps them."""
    scheduler: Any
    timesteps: torch.Tensor
    embeds: torch.Tensor
    """The prompt's embeddings, padded to the encoder length as the pipeline pads them: (1, L, D)."""
    negative: torch.Tensor | None
    """The negative prompt's, with guidance (``guidance > 1``); None without."""
    guidance: float
    height: int
    width: int
    frames: int
    condition: torch.Tensor | None = None
    """Image to video: the first frame's mask and latents, concatenated to the latents' channels."""
    image_embeds: torch.Tensor | None = None
    """Image to video (Wan 2.1): the source frame's CLIP embeddings."""
    index: int = 0


class WanSteps(PipelineSteps):
    """``WanPipeline``'s text to video, one step at a time: the prompts' rows in one forward, the
    negative prompts' (``""`` where a request gives none, as the pipeline) in a second, then the guided
    combination and each request's own scheduler step."""

    default_max_sequence_length = 512

    def steps_of(self, request: DiffusionRequest) -> int:
        return request.num_inference_steps or 50

    def _guidance(self, request: DiffusionRequest) -> float:
        return 5.0 if request.guidance_scale is None else request.guidance_scale

    def rows(self, request: DiffusionRequest) -> int:
        return 2 if self._guidance(request) > 1.0 else 1

    @property
    def one_expert(self) -> bool:
        """Wan 2.1's single transformer and plain timesteps (what these pieces run)."""
        config = self.pipe.config
        return config.get("boundary_ratio") is None and not config.get("expand_timesteps", False)

    def runs(self, request: DiffusionRequest) -> bool:
        return self.one_expert and not request.images and runs_in_loop(request, self.layers)

    def encode(self, requests: list[DiffusionRequest]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return self.with_negatives(requests, lambda r: self._guidance(r) > 1.0, self._encode)

    def _encode(self, texts: list[str]) -> list[torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=texts, do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            device=self.device,
        )  # fmt: skip
        dtype = self.pipe.transformer.dtype
        return [embeds[k : k + 1].to(dtype) for k in range(len(texts))]

    def _size(self, request: DiffusionRequest) -> tuple[int, int, int]:
        return request.height or 480, request.width or 832, request.num_frames or 81

    def _schedule(self, request: DiffusionRequest) -> tuple[Any, torch.Tensor]:
        scheduler = fresh_scheduler(self.pipe)
        scheduler.set_timesteps(self.steps_of(request), device=self.device)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def prepare(self, request: DiffusionRequest, conditioning: tuple[Any, Any]) -> WanState:
        pipe = self.pipe
        height, width, frames = self._size(request)
        embeds, negative = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        scheduler, timesteps = self._schedule(request)
        latents = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels, height, width, frames, torch.float32, self.device,
            generator,
        )  # fmt: skip
        guidance = self._guidance(request)
        return WanState(latents, scheduler, timesteps, embeds, negative, guidance, height, width, frames)

    def steps(self, state: WanState) -> int:
        return len(state.timesteps)

    def shape(self, state: WanState) -> Hashable:
        return tuple(state.latents.shape)

    def _forward(self, states: list[WanState], negative: bool) -> torch.Tensor:
        dtype = self.pipe.transformer.dtype
        hidden = [
            s.latents if s.condition is None else torch.cat([s.latents, s.condition], 1) for s in states
        ]
        inputs: dict[str, Any] = {
            "hidden_states": torch.cat(hidden).to(dtype),
            "timestep": torch.cat([s.timesteps[s.index].expand(1) for s in states]),
            "encoder_hidden_states": torch.cat([s.negative if negative else s.embeds for s in states]),
            "attention_kwargs": None,
        }
        if states[0].image_embeds is not None:
            inputs["encoder_hidden_states_image"] = torch.cat([s.image_embeds for s in states])
        return self.forward(states, **inputs)

    def denoise(self, states: list[WanState]) -> None:
        def combine(s: WanState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
            return uncond + s.guidance * (cond - uncond)

        self.guided_by_second_forward(states, self._forward, combine)

    def decode(self, states: list[WanState]) -> list[np.ndarray]:
        """Each state's frames (uint8 F x H x W x 3), one decoder call per size and length, as the pipeline
        decodes its latents."""

        def decode(size: Any, group: list[WanState]) -> list[np.ndarray]:
            return decode_video(self.pipe, torch.cat([s.latents for s in group]))

        return decoded_by_group(states, lambda s: (s.height, s.width, s.frames), decode)


class WanImageToVideoSteps(WanSteps):
    """``WanImageToVideoPipeline`` (Wan 2.1, its CLIP image encoder) one step at a time: each request's
    source frame resized to its size, encoded once (its condition latents and mask, its image embeddings),
    beside its latents in every forward."""

    def runs(self, request: DiffusionRequest) -> bool:
        return (
            self.one_expert
            and len(request.images or []) == 1
            and self.pipe.transformer.config.image_dim is not None
            and runs_in_loop(request, self.layers, own=("images",))
        )

    def prepare(self, request: DiffusionRequest, conditioning: tuple[Any, Any]) -> WanState:
        pipe = self.pipe
        height, width, frames = self._size(request)
        embeds, negative = conditioning
        generator = torch.Generator("cpu").manual_seed(request.seed if request.seed is not None else 0)
        source = as_pil(request.images[0])
        image_embeds = pipe.encode_image(source, self.device).to(pipe.transformer.dtype)
        scheduler, timesteps = self._schedule(request)
        image = pipe.video_processor.preprocess(source, height=height, width=width)
        latents, condition = pipe.prepare_latents(
            image.to(self.device, dtype=torch.float32), 1, pipe.vae.config.z_dim, height, width, frames,
            torch.float32, self.device, generator,
        )  # fmt: skip
        guidance = self._guidance(request)
        return WanState(
            latents, scheduler, timesteps, embeds, negative, guidance, height, width, frames, condition,
            image_embeds,
        )  # fmt: skip


def decode_video(pipe: Any, latents: torch.Tensor) -> list[np.ndarray]:
    """A Wan pipeline's final latents as uint8 F x H x W x 3 frames: denormalized by the VAE's latent
    statistics, decoded, post-processed as the pipeline does for ``output_type="np"``."""
    vae = pipe.vae
    shape = (1, vae.config.z_dim, 1, 1, 1)
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(video, output_type="np")
    return list((np.asarray(frames) * 255).round().astype(np.uint8))
