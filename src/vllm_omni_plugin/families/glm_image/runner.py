"""GLM-Image's DiT stage: its request (the AR stage's prior tokens beside the prompt) and its runner.

Generic code names the runner by dotted path only (``diffusion/diffusers_registry.py``, the family's
``pipeline.py``).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from vllm_omni_plugin.diffusion.diffusers_runner import DiffusersPipelineRunner, as_pil, image_size
from vllm_omni_plugin.diffusion.memory import transformer_block_bytes, vae_decode_bytes
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.diffusion.step_batching import RUN_AT_ONCE, UNUSED

if TYPE_CHECKING:
    from vllm_omni_plugin.diffusion.step_batching import ArgumentJoin


class GlmImageRequest(DiffusionRequest, kw_only=True, tag="glm_image"):
    """One GLM-Image image: the prompt (for its glyphs) and the AR stage's prior tokens."""

    prior_token_ids: Any = None
    """The AR's large-grid VQ ids upsampled x2 to the DiT grid, ``(H/16) * (W/16)`` int ids (a 1-D int64
    tensor, a ``(1, N)`` tensor or a list)."""
    prior_token_image_ids: list[Any] | None = None
    """Image-to-image: one 1-D int64 tensor per source image, its VQ ids upsampled x2."""
    source_image_grid_thw: list[Any] | None = None
    """Image-to-image: one ``[t, h, w]`` per source image, the x2-upsampled grid of its ids."""

    @property
    def image_to_image(self) -> bool:
        return (
            bool(self.images)
            or self.prior_token_image_ids is not None
            or self.source_image_grid_thw is not None
        )


class GlmImageRunner(DiffusersPipelineRunner):
    """GLM-Image's DiT stage: ``GlmImagePipeline`` without its AR encoder, driven by prior tokens.

    Batching is per-request exact in meaning: each request has its own generator, and requests only share
    a call when their glyph-token counts match. diffusers left-pads shorter glyph embeddings with zeros and
    the DiT attends to them unmasked, so mixing lengths would change the shorter prompts' images.
    """

    pipeline_class = "GlmImagePipeline"
    request_type = GlmImageRequest
    load_kwargs = {"vision_language_encoder": None, "processor": None}
    default_num_inference_steps = 50
    default_guidance_scale = 1.5
    supports_negative_prompt = False  # the pipeline's unconditional pass always uses an empty glyph text
    supports_image_to_image = True
    max_images = None
    size_required = True  # the AR stage drew its tokens for one size
    batched_guidance = False  # the unconditional pass is a second transformer call
    cfg_parallel = True
    """Its guidance branches are two transformer calls in turn: on a CFG-parallel replica rank 1 computes
    each step's second call while rank 0 computes the first (``diffusion/cfg_parallel.py``:
    ``PairedBranches``)."""
    glyph_max_length: ClassVar[int] = 2048  # the pipeline's max_sequence_length default
    _GLYPH_PATTERNS = (r"'([^']*)'", r"\u201c([^\u201c\u201d]*)\u201d", r'"([^"]*)"', r"「([^「」]*)」")

    @property
    def codebook_size(self) -> int:
        return int(self.pipe.transformer.config.prior_vq_quantizer_codebook_size)

    @property
    def token_pixels(self) -> int:
        """Pixels per DiT token side: VAE scale x patch size (16)."""
        return int(self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size)

    def warmup_requests(self, height: int, width: int, count: int, *, guided: bool) -> list[GlmImageRequest]:
        """Text-to-image requests with all-zero prior tokens (the DiT takes any ids)."""
        import torch

        tokens = (height // self.token_pixels) * (width // self.token_pixels)
        return [
            GlmImageRequest(
                request_id=f"warm-up-{i}",
                prompt="warm-up",
                height=height,
                width=width,
                num_inference_steps=2,
                guidance_scale=None if guided else 1.0,
                prior_token_ids=torch.zeros(tokens, dtype=torch.long),
            )
            for i in range(count)
        ]

    def glyph_length(self, prompt: str) -> int:
        """How many glyph embeddings the pipeline makes for ``prompt`` (mirrors ``_get_glyph_embeds``)."""
        texts = [t for pattern in self._GLYPH_PATTERNS for t in re.findall(pattern, prompt)] or [""]
        ids = self.pipe.tokenizer(texts, max_length=self.glyph_max_length, truncation=True).input_ids
        pad = (len(ids) + 1) % 2  # diffusers pads by the number of texts, not each text's length
        return sum(len(one) + pad for one in ids)

    def validate(self, request: GlmImageRequest) -> None:
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
            img_h, img_w = image_size(image)
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

    def prompt_tokens(self, batch: list[GlmImageRequest]) -> int:
        return max(self.glyph_length(r.prompt) for r in batch)

    def source_pixels(self, request: GlmImageRequest) -> list[int]:
        """Each source's pixels as its grid says (the AR stage's grid of the resized image)."""
        import torch

        return [
            int(torch.as_tensor(g).reshape(-1).prod()) * self.token_pixels**2
            for g in request.source_image_grid_thw or []
        ]

    def activation_phases(self, batch: list[GlmImageRequest]) -> dict[str, int]:
        """As the generic estimate, except that source images do not join the sequence: the pipeline runs
        the transformer over each source once and keeps its K/V of every layer (per request) through the
        denoising loop, where each layer's attention joins them to the batch's own K/V; the cache is
        cleared before the decode."""
        alone = [msgspec.structs.replace(r, images=None, source_image_grid_thw=None) for r in batch]
        phases = super().activation_phases(alone)
        shape = self.memory_shape
        pixels = [self.source_pixels(r) for r in batch]
        source_tokens = [sum(p) // shape.patch_pixels**2 for p in pixels]
        if not any(source_tokens):
            return phases
        layers = int(self.pipe.transformer.config.num_layers)
        kv_token = 2 * shape.hidden * shape.element  # one token's K and V in one layer
        cache = layers * sum(source_tokens) * kv_token
        joined = 2 * sum(source_tokens) * kv_token  # one layer's cache expanded to the batch, and joined
        writing = transformer_block_bytes(1, max(source_tokens), shape.hidden, shape.ff_inner, shape.element)
        largest = max(max(p, default=0) for p in pixels)
        encoding = vae_decode_bytes(1, largest, shape.decoder_channels, shape.vae_element)
        return {
            "encode": cache + max(writing, encoding),
            "denoise": cache + joined + phases["denoise"],
            "decode": phases["decode"],
        }

    def step_joins(self) -> dict[str, ArgumentJoin]:
        return {**super().step_joins(), "kv_caches": SourceImageCacheJoin()}

    def cache_passes(self, kwargs: dict[str, Any]) -> bool:
        """An edit's first call writes its source images' K/V: no step, never cached."""
        caches = kwargs.get("kv_caches")
        return caches is not None and caches[0].mode == "write"

    def call_key(self, request: GlmImageRequest) -> tuple[Any, ...]:
        import torch

        grids: tuple[tuple[int, ...], ...] = ()
        if request.image_to_image:  # the cached condition K/V of a batch are concatenated: same shapes
            grids = tuple(
                tuple(int(x) for x in torch.as_tensor(g).reshape(-1).tolist())
                for g in request.source_image_grid_thw or []
            )
        return (self.glyph_length(request.prompt), grids)

    def call_kwargs(self, batch: list[GlmImageRequest]) -> dict[str, Any]:
        import torch

        device = self.device
        kwargs: dict[str, Any] = {
            "prior_token_ids": torch.stack(
                [torch.as_tensor(r.prior_token_ids, dtype=torch.long).reshape(-1) for r in batch]
            ).to(device)
        }
        if batch[0].image_to_image:
            kwargs["image"] = [[as_pil(img) for img in r.images or []] for r in batch]
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


class SourceImageCacheJoin:
    """Step batching of GLM-Image's denoiser calls: each request's call carries its own K/V cache of its
    source images (``kv_caches``). Text-to-image calls and unconditional passes leave it unused (mode
    ``None`` or ``skip``: they join whatever their caches); calls that read it join into one cache holding
    each row's samples in row order (the attention joins per-sample caches along the batch); the call that
    writes it runs at once, alone."""

    def key(self, value: Any) -> Hashable:
        layer = value[0]
        if layer.mode == "write":
            return RUN_AT_ONCE
        if layer.mode != "read":
            return UNUSED
        return ("read", tuple(tuple(k.shape[1:]) for k in layer.k_caches))

    def join(self, values: list[Any], rows: list[int]) -> Any:
        from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

        if values[0][0].mode != "read":
            return values[0]  # unused by every call of the forward
        joined = GlmImageKVCache(num_layers=values[0].num_layers)
        joined.set_mode("read")
        for layer, cache in enumerate(joined.caches):
            for value, count in zip(values, rows, strict=True):
                own = value[layer]
                repeat = 1 if len(own.k_caches) == count else count  # one sample shared by the call's rows
                cache.k_caches.extend(own.k_caches * repeat)
                cache.v_caches.extend(own.v_caches * repeat)
        return joined
