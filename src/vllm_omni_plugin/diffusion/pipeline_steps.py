"""What the step-loop pieces of diffusers pipelines share (``diffusion/step_loop.py``): the pipeline, its
encoder length, its execution device, the encoded texts, the one seam of its forwards (through the
family's layers), the scheduler step the layers see, and grouped decoding. A family's pieces (under
``families/``) subclass :class:`PipelineSteps`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_omni_plugin.diffusion.diffusers_runner import as_pil, decode_latents
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.step_loop import (
    ConditioningCache,
    LoopLayer,
    decoded_by_group,
    denoiser_through,
    runs_in_loop,
    through_layers,
)


@dataclass(eq=False)
class Inpainting:
    """What a masked edit's steps keep beside its latents (:meth:`PipelineSteps.inpainting`)."""

    source: torch.Tensor
    """The source image's latents."""
    noise: torch.Tensor
    """The noise its first latents were drawn with, which noises the source to each step."""
    mask: torch.Tensor
    """1 where the edit repaints, 0 where the source stays, at the latents' size."""


def fresh_scheduler(pipe: Any) -> Any:
    """A scheduler of the pipeline's kind and configuration with no state yet: each request steps its own
    (made from the configuration: a deepcopy of the pipeline's costs about 2 ms)."""
    return type(pipe.scheduler).from_config(pipe.scheduler.config)


class PipelineSteps:
    """What every family's pieces share: the pipeline, its encoder length, its execution device (a
    property that walks every module: read once), the encoded texts, and which requests run step-wise."""

    default_max_sequence_length: ClassVar[int] = 256

    def __init__(
        self, pipe: Any, max_sequence_length: int | None = None, layers: list[LoopLayer] | None = None
    ) -> None:
        self.pipe = pipe
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length
        self.device = pipe._execution_device
        self.texts = ConditioningCache()
        self.layers: list[LoopLayer] = list(layers or [])

    image_to_image: ClassVar[bool] = False
    """The family runs image-to-image requests as its family's image-to-image pipeline runs them (one
    source image, no mask: :meth:`first_step`, :meth:`noised_source`)."""
    masks: ClassVar[bool] = False
    """The family runs masked edits as its family's inpainting pipeline runs them (one source image and
    its mask: :meth:`inpainting`, :meth:`advance` keeps what the mask keeps)."""
    mask_scale: ClassVar[int] = 1
    """The inpainting pipeline's mask processor's scale factor, in VAE scale factors (FLUX's packs 2x2)."""

    def runs(self, request: DiffusionRequest) -> bool:
        if not request.images:
            return runs_in_loop(request, self.layers)
        if request.mask is not None:
            masked = self.masks
            own: tuple[str, ...] = ("images", "mask")
        else:
            masked, own = self.image_to_image, ("images",)
        return (
            masked
            and runs_in_loop(request, self.layers, own=own)
            and len(request.images) == 1
            and self.first_step(request) < self.steps_of(request)
        )

    def steps_of(self, request: DiffusionRequest) -> int:
        return request.num_inference_steps or 28

    def default_strength(self, task: str) -> float:
        """The own default strength of the family's pipeline for ``task`` (``images``: image to image,
        ``mask``: inpainting; its call's parameters are read once per class)."""
        from vllm_omni_plugin.diffusion.diffusers_registry import call_parameters, companion_class

        return call_parameters(companion_class(type(self.pipe), task))["strength"].default

    def first_step(self, request: DiffusionRequest) -> int:
        """The steps an edit's strength skips (the pipeline's ``get_timesteps``)."""
        steps = self.steps_of(request)
        task = "images" if request.mask is None else "mask"
        strength = self.default_strength(task) if request.strength is None else request.strength
        return int(max(steps - min(steps * strength, steps), 0))

    def strength_timesteps(
        self, request: DiffusionRequest, scheduler: Any, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The timesteps an image-to-image request runs: those after the steps its strength skips, its
        scheduler begun there (the pipeline's ``get_timesteps``)."""
        begin = self.first_step(request) * scheduler.order
        scheduler.set_begin_index(begin)
        return timesteps[begin:]

    def noised_source(
        self, request: DiffusionRequest, scheduler: Any, first: torch.Tensor, height: int, width: int,
        dtype: torch.dtype, generator: torch.Generator,
    ) -> torch.Tensor:  # fmt: skip
        """The image-to-image pipeline's initial latents (unpacked), with the request's own scheduler: its
        source image at the request's size encoded (a draw of its generator), normalized, and noised to
        the first step its strength leaves."""
        return self.source_draws(request, scheduler, first, height, width, dtype, generator)[0]

    def source_draws(
        self, request: DiffusionRequest, scheduler: Any, first: torch.Tensor, height: int, width: int,
        dtype: torch.dtype, generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(noised latents, the source's latents, the noise drawn): :meth:`noised_source` with what an
        inpainting step needs again."""
        from diffusers.utils.torch_utils import randn_tensor

        image = self.pipe.image_processor.preprocess(as_pil(request.images[0]), height=height, width=width)
        encoded = self.encoded_source(image.to(device=self.device, dtype=dtype), generator)
        noise = randn_tensor(encoded.shape, generator=generator, device=self.device, dtype=dtype)
        noised = scheduler.scale_noise(encoded, first, noise).to(device=self.device, dtype=dtype)
        return noised, encoded, noise

    def inpainting(
        self, request: DiffusionRequest, encoded: torch.Tensor, noise: torch.Tensor, height: int, width: int
    ) -> Inpainting:
        """A masked edit's mask at the latents' size, as the family's inpainting pipeline prepares it
        (binarized, resized), with its source latents and noise. The pipeline's encode of the masked image
        is left out: only an inpainting denoiser (more input channels) reads it, and it is the last draw
        of the request's generator."""
        import PIL.Image

        mask_image = PIL.Image.fromarray(np.asarray(request.mask))
        condition = self.mask_processor.preprocess(mask_image, height=height, width=width)
        mask = torch.nn.functional.interpolate(condition, size=encoded.shape[-2:])
        # contiguous, as the pipeline's repeat of the source leaves it: the last step's latents are the
        # source where the mask keeps it, and their layout decides the decoder's kernels (1/255 apart)
        return Inpainting(encoded.contiguous(), noise, mask.to(device=self.device, dtype=encoded.dtype))

    @functools.cached_property
    def mask_processor(self) -> Any:
        """The family's inpainting pipeline's mask processor: grayscale, binarized, not normalized."""
        from diffusers.image_processor import VaeImageProcessor

        pipe = self.pipe
        return VaeImageProcessor(
            vae_scale_factor=pipe.vae_scale_factor * self.mask_scale,
            vae_latent_channels=pipe.vae.config.get("latent_channels") or pipe.vae.config.get("z_dim"),
            do_normalize=False, do_binarize=True, do_convert_grayscale=True,
        )  # fmt: skip

    def encoded_source(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A preprocessed source image as its image-to-image pipeline's latents: a draw of the encoder's
        distribution, shifted and scaled by the autoencoder's configuration."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import (
            retrieve_latents,
        )

        vae = self.pipe.vae
        encoded = retrieve_latents(vae.encode(image), generator=generator)
        return (encoded - vae.config.shift_factor) * vae.config.scaling_factor

    negative_default: ClassVar[str] = ""
    """The negative prompt a guided request that gives none is encoded with (:meth:`with_negatives`)."""

    def with_negatives(
        self,
        requests: list[DiffusionRequest],
        guided: Callable[[DiffusionRequest], bool],
        encode: Callable[[list[str]], list[Any]],
    ) -> list[tuple[Any, Any | None]]:
        """Each request's prompt embeddings and, where ``guided``, its negative prompt's (else None): the
        prompts in one encoder call, the negative prompts not cached yet in a second, as a pipeline whose
        guidance is a second forward encodes them (Qwen-Image's true CFG, Wan's)."""
        prompts = self.texts.get([r.prompt for r in requests], encode)
        texts = [r.negative_prompt or self.negative_default for r in requests if guided(r)]
        negatives = iter(self.texts.get(texts, encode))
        return [(p, next(negatives) if guided(r) else None) for r, p in zip(requests, prompts, strict=True)]

    def advance(self, state: Any, output: torch.Tensor) -> None:
        """The state's scheduler step with its (guided) model output, shown to every layer (previews); a
        masked edit then takes back what its mask keeps, the source noised to the next step."""
        sample = state.latents
        state.latents = state.scheduler.step(output, state.timesteps[state.index], sample, return_dict=False)[
            0
        ]
        inpaint = getattr(state, "inpaint", None)
        if inpaint is not None:
            kept = inpaint.source
            if state.index < len(state.timesteps) - 1:
                following = torch.tensor([state.timesteps[state.index + 1]])
                kept = state.scheduler.scale_noise(kept, following, inpaint.noise)
            state.latents = (1 - inpaint.mask) * kept + inpaint.mask * state.latents
        for layer in self.layers:
            layer.stepped(state, sample, output)
        state.index += 1

    def shifted(self, state: Any) -> bool:
        """Whether the state's latents decode with the VAE's shift factor (:func:`decode_latents`)."""
        return True

    def decode(self, states: list[Any]) -> list[np.ndarray]:
        """The states' images (their ``height`` and ``width``), one decoder call per size (and
        :meth:`shifted`), as the pipeline decodes its latents (:func:`decode_latents`)."""

        def decode(key: Any, group: list[Any]) -> list[np.ndarray]:
            height, width, shifted = key
            latents = torch.cat([s.latents for s in group])
            return decode_latents(self.pipe, latents, height, width, shifted=shifted)

        return decoded_by_group(states, lambda s: (s.height, s.width, self.shifted(s)), decode)

    def estimate(self, state: Any, sample: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """Flow matching's clean latents as a whole call's previews take them: ``sample - sigma * output``."""
        sigma = state.scheduler.sigmas[(state.scheduler.begin_index or 0) + state.index]  # image to image
        return (sample.float() - sigma * output.float()).to(sample.dtype)

    def guided_by_second_forward(
        self,
        states: list[Any],
        forward: Callable[[list[Any], bool], torch.Tensor],
        combine: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """One step where guidance is a second forward (Qwen-Image's true CFG, GLM-Image's): ``forward``
        over every state's prompt rows (``False``), then over the guided states' negative rows (``True``:
        states with a ``negative``); each guided state's ``combine(state, cond, uncond)``, then its
        scheduler step."""
        cond = forward(states, False)
        guided = [k for k, s in enumerate(states) if s.negative is not None]
        uncond = forward([states[k] for k in guided], True) if guided else cond
        row_of = {k: row for row, k in enumerate(guided)}
        for k, s in enumerate(states):
            noise = cond[k : k + 1]
            if k in row_of:
                noise = combine(s, noise, uncond[row_of[k] : row_of[k] + 1])
            self.advance(s, noise)

    def forward(self, owners: list[Any], **inputs: Any) -> torch.Tensor:
        """The denoiser's output for one forward (``owners``: the state each row belongs to), through every
        layer: the one seam where a feature acting on rows attaches."""
        return through_layers(self.layers, self._denoiser)(owners, inputs)

    def _denoiser(self, owners: list[Any], inputs: dict[str, Any]) -> torch.Tensor:
        denoiser = denoiser_through(self.layers, self.pipe.transformer)
        return denoiser(**inputs, return_dict=False)[0]
