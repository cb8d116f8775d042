"""The VAE decode of previews, traced (TorchScript) once per latent shape.

A preview's decode runs on the preview thread beside the steps (``diffusion/previews.py``). Eager, every
layer of the decoder is a Python call that holds the GIL: where the steps are Python-bound too (small
models, CPU), the two threads take turns and the previews slow the steps down. A traced decoder runs its
graph without the interpreter (the same kernels, so the same pixels bit for bit).

Only stateless ``AutoencoderKL`` decoders are traced (SD3, FLUX, GLM-Image): a graph holds one shape's
control flow, hence one trace per latent shape (a few, least recently used first out), and a VAE that
keeps state between calls (Qwen-Image's causal caches) cannot be traced. Where tracing fails the decoder
stays eager, logged once. Used from the preview thread only (one per process).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

TRACED_SHAPES = 4
"""Traced graphs kept per VAE (by latent shape); a request mix that needs more traces again."""


class PreviewDecoder:
    """``decode(latents)``: the VAE's ``decode(latents, return_dict=False)[0]``, traced where it can be."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.traceable = _traceable(vae)
        self._graphs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def decode(self, latents: Any) -> Any:
        if not self.traceable:
            return self.vae.decode(latents, return_dict=False)[0]
        key = (tuple(latents.shape), latents.dtype, latents.device)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._trace(latents)
            if graph is None:
                return self.vae.decode(latents, return_dict=False)[0]
            self._graphs[key] = graph
            while len(self._graphs) > TRACED_SHAPES:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return graph(latents)

    def _trace(self, latents: Any) -> Any:
        import torch

        class Decode(torch.nn.Module):
            def __init__(self, vae: Any) -> None:
                super().__init__()
                self.vae = vae

            def forward(self, latents: torch.Tensor) -> torch.Tensor:
                return self.vae.decode(latents, return_dict=False)[0]

        try:
            with warnings.catch_warnings():
                # The tracer warns at every shape-dependent branch: one shape per graph is the design.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # torch 2.13 marks torch.jit.trace deprecated (for torch.compile / torch.export, which
                # compile at start-up cost instead); should it go, the except below decodes eagerly.
                warnings.simplefilter("ignore", DeprecationWarning)
                return torch.jit.trace(Decode(self.vae), latents, check_trace=False)
        except Exception as exc:  # eager from here on: a preview must not fail for want of a trace
            self.traceable = False
            logger.info(
                "previews: the VAE's decoder could not be traced (%s: %s); previews decode it eagerly",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return None


def _traceable(vae: Any) -> bool:
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        return False
    return type(vae) is AutoencoderKL
