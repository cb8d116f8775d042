"""The Qwen-Image family's runners (text-to-image, edit, edit-plus): their guidance is ``true_cfg_scale``
and their edit pipelines take images their own way; and the runner of diffusers' video pipelines. Generic
code names them by dotted path only (``diffusion/diffusers_registry.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from vllm_omni_plugin.diffusion.diffusers_runner import DiffusersPipelineRunner, as_pil, image_size
from vllm_omni_plugin.diffusion.memory import transformer_block_bytes
from vllm_omni_plugin.diffusion.params import DiffusionRequest


class QwenImageRunner(DiffusersPipelineRunner):
    """Qwen-Image: classifier-free guidance is ``true_cfg_scale``, and diffusers applies it only when a
    negative prompt is given. A request's ``guidance_scale`` goes there, and above 1 a request without a
    negative prompt gets ``" "`` (the model card's), so guidance always does what it says; at 1 or
    below no negative prompt is passed (no unconditional pass)."""

    pipeline_class = "QwenImagePipeline"
    guidance_argument = "true_cfg_scale"
    prompt_token_limit = 1024
    """The Qwen-Image pipelines encode a prompt whole, padded to the batch's longest (no truncation), and
    refuse a ``max_sequence_length`` over 1024 (their ``tokenizer_max_length``); their transformer's text
    positions end a few thousand tokens on (a 60k-token prompt failed there after its whole encode)."""
    batched_guidance = False  # true CFG: the negative prompt's pass is a second transformer call
    default_negative_prompt: ClassVar[str] = " "
    caches_sources: ClassVar[bool] = False
    """Its pipeline encodes each source by its latent distribution's mode (the edit pipelines): the
    sources' latents are kept (``steps.cached_source_encoding``), so an image edited again is not
    encoded again."""

    def __init__(self, pipe: Any, *, device: Any, dtype: Any) -> None:
        super().__init__(pipe, device=device, dtype=dtype)
        if self.caches_sources:
            from vllm_omni_plugin.families.diffusers.steps import cached_source_encoding

            cached_source_encoding(pipe)

    def call_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        # Every negative prompt of a guided batch is a string, so requests with and without one mix.
        return tuple(image_size(i) for i in request.images or [])

    def prompt_tokens(self, batch: list[DiffusionRequest]) -> int:
        """The pipeline pads a call's prompts to its longest (its chat template around each), not to a
        fixed length: one long prompt makes every row of its batch that long."""
        return max(self.prompt_length(r) for r in batch)

    def prompt_length(self, request: DiffusionRequest) -> int:
        """Tokens of the request's longer prompt (its negative one's counts too) as the transformer sees
        them: the template's system part dropped, as the pipeline does."""
        texts = (request.prompt, request.negative_prompt or self.default_negative_prompt)
        lengths: dict[tuple[str, str], int] = self.__dict__.setdefault("_lengths", {})
        if texts not in lengths:  # a batch's estimates ask about the same requests again and again
            if len(lengths) >= 256:
                lengths.clear()
            pipe = self.pipe
            template, dropped = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
            counts = [len(pipe.tokenizer(template.format(t))["input_ids"]) for t in texts]
            lengths[texts] = max(counts) - dropped
        return lengths[texts]

    def activation_phases(self, batch: list[DiffusionRequest]) -> dict[str, int]:
        """With the prompt encode: its vision-language model keeps every layer's hidden states
        (``output_hidden_states``) for the batch's padded prompts, besides one layer's activations."""
        phases = super().activation_phases(batch)
        config = self.pipe.text_encoder.config
        text = getattr(config, "text_config", config)
        hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
        rows, tokens = len(batch), self.prompt_tokens(batch)
        element = next(self.pipe.text_encoder.parameters()).element_size()
        phases["encode_prompt"] = rows * tokens * hidden * (layers + 1) * element + transformer_block_bytes(
            rows, tokens, hidden, int(text.intermediate_size), element
        )
        return phases

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        kwargs = super().call_kwargs(batch)
        kwargs.pop("negative_prompt", None)
        if (batch[0].guidance_scale or 0.0) > 1.0:
            kwargs["negative_prompt"] = [r.negative_prompt or self.default_negative_prompt for r in batch]
        return kwargs


class QwenImageEditRunner(QwenImageRunner):
    """Qwen-Image-Edit: one source image per request, ``image=[one per prompt]``.

    The pipeline resizes a single image to about a megapixel (its aspect kept) for both the VAE and the
    vision-language encoder, but passes a *list* of images to the encoder as they are, so a batch would
    see other pixels than the same request alone. The runner resizes each image the way the pipeline
    does for a single one first; a batch also shares the source size (``batch_key``), since the pipeline
    sizes everything from the first image.
    """

    pipeline_class = "QwenImageEditPipeline"
    needs_images = True
    caches_sources = True

    def source_pixels(self, request: DiffusionRequest) -> list[int]:
        return [1024 * 1024 for _ in request.images or []]  # resized to about a megapixel (call_kwargs)

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        kwargs = super().call_kwargs(batch)
        images = kwargs[self.image_argument]
        width, height, _ = calculate_dimensions(1024 * 1024, images[0].size[0] / images[0].size[1])
        kwargs[self.image_argument] = [self.pipe.image_processor.resize(i, height, width) for i in images]
        return kwargs

    @classmethod
    def task_pipeline(cls, pipeline_cls: type, task: str) -> type | None:
        """No masks yet: diffusers' QwenImageEditInpaintPipeline sizes its output from the source image
        (about a megapixel) where the edit pipeline takes the requested size, so the runner's resizing
        would have to follow it there too."""
        return None if task == "mask" else super().task_pipeline(pipeline_cls, task)

    @classmethod
    def load_overrides(cls, model: str) -> dict[str, Any]:
        return _with_qwen2vl_processor(super().load_overrides(model), model)

    def preview_size(self, batch: list[DiffusionRequest]) -> tuple[int, int] | None:
        """Unless asked, the size the pipeline takes from its source: about a megapixel, its aspect kept."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        size = super().preview_size(batch)
        if size is not None or not batch[0].images:
            return size
        height, width = image_size(batch[0].images[0])
        width, height, _ = calculate_dimensions(1024 * 1024, width / height)
        return int(height), int(width)


class QwenImageEditPlusRunner(QwenImageRunner):
    """Qwen-Image-Edit-2509 and later: ``image`` is the list of a request's source images, and every
    prompt of a call sees all of them. Requests with their own images cannot share a call, so each runs
    alone."""

    pipeline_class = "QwenImageEditPlusPipeline"
    needs_images = True
    max_images = 3
    caches_sources = True

    def source_pixels(self, request: DiffusionRequest) -> list[int]:
        return [1024 * 1024 for _ in request.images or []]  # the pipeline resizes each to about 1 MP

    @classmethod
    def load_overrides(cls, model: str) -> dict[str, Any]:
        return _with_qwen2vl_processor(super().load_overrides(model), model)

    def call_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        return (request.request_id,)

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        kwargs = super().call_kwargs(batch)
        kwargs[self.image_argument] = [as_pil(image) for image in batch[0].images or []]
        return kwargs


def _with_qwen2vl_processor(overrides: dict[str, Any], model: str) -> dict[str, Any]:
    """The edit pipelines' processor, loadable without torchvision (see ``qwen2vl_processor``)."""
    from vllm_omni_plugin.families.diffusers.qwen2vl_processor import load_qwen2vl_processor

    if (Path(model) / "processor").is_dir():
        overrides["processor"] = load_qwen2vl_processor(Path(model) / "processor")
    return overrides


class DiffusersVideoRunner(DiffusersPipelineRunner):
    """Diffusers' video pipelines (Wan 2.x, and any whose ``__call__`` takes ``num_frames`` and returns
    ``frames``): the generic runner with a request's ``num_frames``, its output the frames. Guidance is a
    second transformer call (Wan's). What has not been run on a video denoiser here is refused with a
    reason where it is configured: LoRA adapters, step caching, compiled blocks, CFG and sequence
    parallelism, quantization."""

    batched_guidance = False
    lora = False
    cfg_parallel = False
    sequence_parallel = False
    compiles_blocks = False
    quantizes = False
    previews = False

    def __init__(self, pipe: Any, *, device: Any, dtype: Any) -> None:
        super().__init__(pipe, device=device, dtype=dtype)
        self.step_cache = False
