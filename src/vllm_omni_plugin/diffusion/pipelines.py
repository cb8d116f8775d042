"""Which diffusers pipelines the diffusion stage runs, and how.

A model directory names its pipeline in ``model_index.json`` (``_class_name``). The registry maps that name
to a runner class that loads the pipeline and runs a batch of compatible requests through one pipeline
call. Adding a diffusers pipeline is one small :class:`DiffusersPipelineRunner` subclass plus one
``register_diffusion_pipeline`` line (or an entry in ``PIPELINE_RUNNERS``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)


class UnknownPipelineError(ValueError):
    """The model's pipeline class has no runner registered."""


class BatchAborted(Exception):
    """Every request of the running batch was aborted: the pipeline call stopped at a step's end."""


StopCheck = Callable[[], bool]
"""Asked after each denoising step: True stops the batch (raises :class:`BatchAborted`)."""


@dataclass(slots=True)
class BatchOutput:
    """What one pipeline call produced, in batch order."""

    images: list[Any]
    """uint8 HxWx3 arrays."""
    latents: list[Any] | None
    timings: dict[str, float]


class DiffusersPipelineRunner:
    """Loads one diffusers pipeline and runs batches of compatible requests through it.

    The engine hands :meth:`run` requests whose defaults are already applied and that share
    :meth:`batch_key` (plus size, steps, guidance and image-to-image-ness), with one seeded
    ``torch.Generator`` per request, and ``should_stop``, asked after every step. Subclasses set
    ``pipeline_class`` and, as needed, override ``load_kwargs``, :meth:`validate`, :meth:`batch_key`
    and :meth:`call_kwargs`.
    """

    pipeline_class: ClassVar[str] = ""
    """The diffusers class name, as in ``model_index.json`` ``_class_name``."""
    load_kwargs: ClassVar[dict[str, Any]] = {}
    """Extra ``from_pretrained`` arguments (e.g. components to skip)."""
    default_num_inference_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float] = 5.0
    default_size: ClassVar[tuple[int, int] | None] = None
    """``(height, width)`` when a request and the engine give none; ``None``: the size is required."""
    supports_negative_prompt: ClassVar[bool] = True
    supports_image_to_image: ClassVar[bool] = False

    def __init__(self, pipe: Any, *, device: Any, dtype: Any) -> None:
        self.pipe = pipe
        self.device = device
        self.dtype = dtype

    @classmethod
    def load(cls, model: str, *, dtype: Any, device: Any) -> DiffusersPipelineRunner:
        """``from_pretrained`` on the model directory (or hub id), moved to ``device``."""
        import diffusers

        pipeline_cls = getattr(diffusers, cls.pipeline_class)
        start = time.perf_counter()
        pipe = pipeline_cls.from_pretrained(model, dtype=dtype, **cls.load_kwargs)
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        logger.info(
            "loaded %s from %s (%s, %s) in %.2f s",
            cls.pipeline_class,
            model,
            dtype,
            device,
            time.perf_counter() - start,
        )
        return cls(pipe, device=device, dtype=dtype)

    # --- per-request hooks -------------------------------------------------------------------------

    def validate(self, request: DiffusionRequest) -> None:
        """Raise ``ValueError`` naming what is wrong; run before batching, so one bad request fails alone."""
        if request.image_to_image and not self.supports_image_to_image:
            raise ValueError(f"{self.pipeline_class} runs text-to-image only; this request has source images")
        if request.negative_prompt and not self.supports_negative_prompt:
            raise ValueError(f"{self.pipeline_class} takes no negative prompt; leave negative_prompt unset")

    def batch_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        """What else (beyond size, steps, guidance, i2i) must match for requests to share a call."""
        return ()

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        """Pipeline arguments beyond prompt, size, steps, guidance, generators and output type."""
        if self.supports_negative_prompt and any(r.negative_prompt for r in batch):
            return {"negative_prompt": [r.negative_prompt or "" for r in batch]}
        return {}

    # --- the call ----------------------------------------------------------------------------------

    def run(
        self, batch: list[DiffusionRequest], generators: list[Any], should_stop: StopCheck | None = None
    ) -> BatchOutput:
        """One pipeline call for the whole batch; images as uint8 HxWx3 arrays, in batch order. Raises
        :class:`BatchAborted` at the end of the first step after which ``should_stop()`` is true."""
        import numpy as np

        first = batch[0]
        latents_box: list[Any] = []
        step_done: list[float] = []

        def on_step_end(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            # The last step's latents are the denoised ones; its time splits denoise from decode.
            latents_box[:] = [kwargs["latents"]]
            step_done[:] = [time.perf_counter()]
            if should_stop is not None and should_stop():
                raise BatchAborted(f"stopped after step {step + 1}")
            return {}

        start = time.perf_counter()
        out = self.pipe(
            prompt=[r.prompt for r in batch],
            height=first.height,
            width=first.width,
            num_inference_steps=first.num_inference_steps,
            guidance_scale=first.guidance_scale,
            generator=generators,
            output_type="np",
            callback_on_step_end=on_step_end,
            callback_on_step_end_tensor_inputs=["latents"],
            **self.call_kwargs(batch),
        )
        end = time.perf_counter()
        denoised = step_done[0] if step_done else end
        # diffusers' own float -> uint8 conversion (numpy_to_pil), so arrays equal its PIL output.
        pixels = (np.asarray(out.images) * 255).round().astype(np.uint8)
        latents = None
        if any(r.return_latents for r in batch) and latents_box:
            latents = [lat.detach().to("cpu").clone() for lat in latents_box[0]]
        timings = {"denoise": denoised - start, "decode": end - denoised, "total": end - start}
        return BatchOutput(list(pixels), latents, timings)


class GlmImageRunner(DiffusersPipelineRunner):
    """GLM-Image's DiT stage: ``GlmImagePipeline`` without its AR encoder, driven by prior tokens.

    Batching is per-request exact in meaning: each request has its own generator, and requests only share
    a call when their glyph-token counts match. diffusers left-pads shorter glyph embeddings with zeros and
    the DiT attends to them unmasked, so mixing lengths would change the shorter prompts' images.
    """

    pipeline_class = "GlmImagePipeline"
    load_kwargs = {"vision_language_encoder": None, "processor": None}
    default_num_inference_steps = 50
    default_guidance_scale = 1.5
    supports_negative_prompt = False  # the pipeline's unconditional pass always uses an empty glyph text
    supports_image_to_image = True
    glyph_max_length: ClassVar[int] = 2048  # the pipeline's max_sequence_length default
    _GLYPH_PATTERNS = (r"'([^']*)'", r"\u201c([^\u201c\u201d]*)\u201d", r'"([^"]*)"', r"「([^「」]*)」")

    @property
    def codebook_size(self) -> int:
        return int(self.pipe.transformer.config.prior_vq_quantizer_codebook_size)

    @property
    def token_pixels(self) -> int:
        """Pixels per DiT token side: VAE scale x patch size (16)."""
        return int(self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size)

    def glyph_length(self, prompt: str) -> int:
        """How many glyph embeddings the pipeline makes for ``prompt`` (mirrors ``_get_glyph_embeds``)."""
        texts = [t for pattern in self._GLYPH_PATTERNS for t in re.findall(pattern, prompt)] or [""]
        ids = self.pipe.tokenizer(texts, max_length=self.glyph_max_length, truncation=True).input_ids
        pad = (len(ids) + 1) % 2  # diffusers pads by the number of texts, not each text's length
        return sum(len(one) + pad for one in ids)

    def validate(self, request: DiffusionRequest) -> None:
        import torch

        super().validate(request)
        height, width = request.height, request.width
        factor = 2 * self.token_pixels  # one AR token per 32x32 pixels
        if height is None or width is None or height % factor or width % factor:
            raise ValueError(
                f"GLM-Image needs height and width that are multiples of {factor}, got {height}x{width}"
            )
        expected = (height // self.token_pixels) * (width // self.token_pixels)
        prior = request.prior_token_ids
        if prior is None:
            raise ValueError("GLM-Image needs prior_token_ids (the AR stage's upsampled prior tokens)")
        prior = torch.as_tensor(prior)
        self._check_ids("prior_token_ids", prior, expected, f"{height}x{width}")
        if not request.image_to_image:
            return
        images = request.images or []
        ids = request.prior_token_image_ids
        grids = request.source_image_grid_thw
        if not images or ids is None or grids is None:
            raise ValueError(
                "image-to-image needs images, prior_token_image_ids and source_image_grid_thw together"
            )
        if not len(images) == len(ids) == len(grids):
            raise ValueError(
                f"image-to-image: {len(images)} images, {len(ids)} prior_token_image_ids and "
                f"{len(grids)} source_image_grid_thw; one of each per source image"
            )
        for i, (image, image_ids, grid) in enumerate(zip(images, ids, grids, strict=True)):
            t, h, w = (int(x) for x in torch.as_tensor(grid).reshape(-1).tolist())
            img_h, img_w = _image_size(image)
            if (img_h // self.token_pixels, img_w // self.token_pixels) != (h, w) or t != 1:
                raise ValueError(
                    f"source image {i} is {img_h}x{img_w} pixels, i.e. a {img_h // self.token_pixels}x"
                    f"{img_w // self.token_pixels} DiT grid, but its source_image_grid_thw is {[t, h, w]}"
                )
            self._check_ids(f"prior_token_image_ids[{i}]", torch.as_tensor(image_ids), h * w, f"{[t, h, w]}")

    def _check_ids(self, name: str, ids: Any, expected: int, what: str) -> None:
        import torch

        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
        if ids.numel() != expected or (ids.dim() > 1 and ids.shape[0] != 1):
            raise ValueError(
                f"{name} has shape {tuple(ids.shape)}; {what} needs {expected} ids "
                f"(the x2-upsampled grid, one id per 16x16 pixels)"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.codebook_size:
            raise ValueError(
                f"{name} holds ids in [{low}, {high}]; the DiT embeds VQ codebook ids "
                f"0..{self.codebook_size - 1} only (image start/end and text ids must not reach it)"
            )

    def batch_key(self, request: DiffusionRequest) -> tuple[Any, ...]:
        import torch

        grids: tuple[tuple[int, ...], ...] = ()
        if request.image_to_image:  # the cached condition K/V of a batch are concatenated: same shapes
            grids = tuple(
                tuple(int(x) for x in torch.as_tensor(g).reshape(-1).tolist())
                for g in request.source_image_grid_thw or []
            )
        return (self.glyph_length(request.prompt), grids)

    def call_kwargs(self, batch: list[DiffusionRequest]) -> dict[str, Any]:
        import torch

        device = self.device
        kwargs: dict[str, Any] = {
            "prior_token_ids": torch.stack(
                [torch.as_tensor(r.prior_token_ids, dtype=torch.long).reshape(-1) for r in batch]
            ).to(device)
        }
        if batch[0].image_to_image:
            kwargs["image"] = [[_as_pil(img) for img in r.images or []] for r in batch]
            kwargs["prior_token_image_ids"] = [
                torch.cat(
                    [torch.as_tensor(i, dtype=torch.long).reshape(-1) for i in r.prior_token_image_ids or []]
                ).to(device)
                for r in batch
            ]
            kwargs["source_image_grid_thw"] = [
                torch.stack(
                    [torch.as_tensor(g, dtype=torch.long).reshape(3) for g in r.source_image_grid_thw or []]
                )
                for r in batch
            ]
        return kwargs


def _image_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a PIL image or an HxWxC array."""
    if hasattr(image, "size") and not hasattr(image, "shape"):
        width, height = image.size
        return int(height), int(width)
    return int(image.shape[0]), int(image.shape[1])


def _as_pil(image: Any) -> Any:
    """Source images reach diffusers as PIL, as in its own pipeline (uint8 arrays are converted)."""
    import numpy as np
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(
            f"source images must be PIL images or uint8 HxWx3 arrays, got {array.dtype} {array.shape}"
        )
    return PIL.Image.fromarray(array)


PIPELINE_RUNNERS: dict[str, type[DiffusersPipelineRunner]] = {
    GlmImageRunner.pipeline_class: GlmImageRunner,
}


def register_diffusion_pipeline(class_name: str, cls: type[DiffusersPipelineRunner]) -> None:
    """Run models whose ``model_index.json`` says ``class_name`` with runner ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, DiffusersPipelineRunner)):
        raise TypeError(f"{cls!r} is not a DiffusersPipelineRunner subclass")
    previous = PIPELINE_RUNNERS.get(class_name)
    if previous is not None and previous is not cls:
        logger.warning(
            "diffusion pipeline %s: runner %s replaces %s", class_name, cls.__name__, previous.__name__
        )
    PIPELINE_RUNNERS[class_name] = cls


def runner_class(class_name: str) -> type[DiffusersPipelineRunner]:
    try:
        return PIPELINE_RUNNERS[class_name]
    except KeyError:
        known = ", ".join(sorted(PIPELINE_RUNNERS)) or "none"
        raise UnknownPipelineError(
            f"no diffusion runner for pipeline class {class_name!r} (known: {known}); "
            "add one with vllm_omni_plugin.diffusion.pipelines.register_diffusion_pipeline"
        ) from None


def pipeline_class_name(model: str | Path) -> str:
    """``_class_name`` from the model's ``model_index.json`` (a local directory or a cached hub id)."""
    path = Path(model)
    if path.is_dir():
        index_file = path / "model_index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{path} has no model_index.json: not a diffusers pipeline directory")
    elif path.is_absolute() or str(model).startswith(".") or str(model).count("/") != 1:
        raise FileNotFoundError(f"{model}: no such model directory (with a model_index.json)")
    else:  # a hub id: its model_index.json from the hub cache (or the hub, when online)
        from huggingface_hub import hf_hub_download

        try:
            index_file = Path(hf_hub_download(str(model), "model_index.json"))
        except Exception as exc:
            raise FileNotFoundError(
                f"{model} is neither a local directory nor a reachable hub model with a "
                f"model_index.json: {exc}"
            ) from exc
    name = json.loads(index_file.read_text()).get("_class_name")
    if not isinstance(name, str):
        raise ValueError(f"{index_file} names no pipeline (_class_name)")
    return name


def load_pipeline_runner(model: str | Path, *, dtype: Any, device: Any) -> DiffusersPipelineRunner:
    """The registered runner for the model's pipeline class, loaded."""
    return runner_class(pipeline_class_name(model)).load(str(model), dtype=dtype, device=device)
