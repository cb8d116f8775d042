"""Context export: a request's whole K/V, copied out of the paged cache when its prompt is computed.

A KV-handoff pipeline (BAGEL) builds its context in the AR stage and hands that context, not tokens,
to the next stage. A request asks for it with ``SamplingParams.extra_args["omni"]["export_context"]``.
In the step that computes the last token of its prompt, after the forward pass wrote the prompt's
K/V into the paged cache, the runner copies every layer's keys and values of the request into one
contiguous tensor ``[num_layers, 2, prompt_len, kv_heads, head_dim]``, puts it into the connector of
the AR stage's output edge (shared memory or NIXL; configuration resolution names it in
``additional_config["omni"]["context_connector"]``) and returns the handle as a stage output::

    {"context": {"kv": {HANDLE_KEY: handle}, "kv_len": prompt_len, "rope": next_position,
                 "export_s": seconds the copy and the put took}}

``rope`` is the position the next token would take (M-RoPE models: prompt length plus the request's
position delta). The request itself is sampled with ``max_tokens=1`` by its processor, so it finishes
in that same step and the scheduler frees its blocks right after the copy. A failed export becomes
``{"context_error": "..."}``: the request's consumer fails it with that message.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from vllm_omni_plugin.ar_channel import CONTEXT_CONNECTOR_KEY, EXPORT_CONTEXT, OMNI_KEY, omni_extra_args
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.runners.paged_kv import gather_tokens, key_value_blocks

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector

logger = get_logger(__name__)


def wants_export(sampling_params: Any) -> bool:
    return bool(omni_extra_args(sampling_params).get(EXPORT_CONTEXT))


class ContextExporter:
    """Per model runner: which requests finish their prompt this step, and their export."""

    def __init__(self, vllm_config: Any) -> None:
        additional = getattr(vllm_config, "additional_config", None) or {}
        omni = additional.get(OMNI_KEY) if isinstance(additional, dict) else None
        self.connector_spec: dict[str, Any] | None = (omni or {}).get(CONTEXT_CONNECTOR_KEY)
        self._connector: OmniConnector | None = None
        self._due: list[str] = []
        self._layers: list[Any] | None = None

    # --- which requests -----------------------------------------------------------------------

    def note_scheduled(self, requests: dict[str, Any], scheduler_output: Any) -> None:
        """Remember the flagged requests whose prompt is completed by this step's tokens."""
        self._due.clear()
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None or not wants_export(state.sampling_params):
                continue
            before = state.num_computed_tokens
            if before < state.num_prompt_tokens <= before + scheduled:
                self._due.append(req_id)

    @property
    def due(self) -> list[str]:
        return self._due

    # --- the copy -----------------------------------------------------------------------------

    def _attention_layers(self, static_forward_context: dict[str, Any]) -> list[Any]:
        """The model's decoder attention layers, in layer order."""
        if self._layers is None:
            from vllm_omni_plugin.compat import resolve

            extract_layer_index = resolve("extract_layer_index")
            attention = resolve("Attention")
            layers = [
                (extract_layer_index(name), layer)
                for name, layer in static_forward_context.items()
                if isinstance(layer, attention) and layer.kv_cache is not None and layer.kv_cache.numel()
            ]
            self._layers = [layer for _, layer in sorted(layers, key=lambda item: item[0])]
        return self._layers

    def request_kv(self, state: Any, static_forward_context: dict[str, Any]) -> torch.Tensor:
        """``[num_layers, 2, prompt_len, kv_heads, head_dim]`` of one request (a contiguous copy)."""
        n = state.num_prompt_tokens
        per_layer = []
        for layer in self._attention_layers(static_forward_context):
            keys, values = key_value_blocks(layer.kv_cache, layer.attn_backend.get_name(), layer.head_size)
            k, v = gather_tokens(keys, values, state.block_ids[0], n)
            per_layer.append(torch.stack((k, v)))
        return torch.stack(per_layer)

    def connector(self) -> OmniConnector:
        if self._connector is None:
            if not self.connector_spec:
                raise RuntimeError(
                    "this AR stage was asked to export a context but has no context connector "
                    "(additional_config.omni.context_connector; configuration resolution sets it for "
                    "pipelines with a KV handoff)"
                )
            from vllm_omni_plugin.connectors.base import make_connector

            spec = self.connector_spec
            self._connector = make_connector(spec["name"], spec["class"], dict(spec.get("extra") or {}))
        return self._connector

    def export_due(self, requests: dict[str, Any], static_forward_context: dict[str, Any]) -> dict[str, dict]:
        """Export every request noted this step: ``{req_id: stage outputs}``."""
        from vllm_omni_plugin.connectors.base import HANDLE_KEY

        out: dict[str, dict] = {}
        for req_id in self._due:
            state = requests.get(req_id)
            if state is None:
                continue
            start = time.perf_counter()
            try:
                kv = self.request_kv(state, static_forward_context)
                handle = self.connector().put(kv)
            except Exception as exc:  # the request fails with this message; the engine keeps serving
                logger.error("context export of request %s failed: %s: %s", req_id, type(exc).__name__, exc)
                out[req_id] = {"context_error": f"context export failed: {type(exc).__name__}: {exc}"}
                continue
            delta = state.mrope_position_delta or 0
            out[req_id] = {
                "context": {
                    "kv": {HANDLE_KEY: msgspec.to_builtins(handle)},
                    "kv_len": state.num_prompt_tokens,
                    "rope": state.num_prompt_tokens + delta,
                    "export_s": time.perf_counter() - start,
                }
            }
        self._due.clear()
        return out

    def health(self) -> Any:
        """The connector's counters in this (worker) process, or None before the first export."""
        return self._connector.health() if self._connector is not None else None

    def close(self) -> None:
        if self._connector is not None:
            connector, self._connector = self._connector, None
            connector.close()
