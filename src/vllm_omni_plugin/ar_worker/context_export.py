"""Context export: a request's whole K/V, handed to the next stage through vLLM's KV-connector seam.

A KV-handoff pipeline (BAGEL) builds its context in the AR stage and hands that context, not tokens,
to the next stage. A request asks for it with ``SamplingParams.extra_args["omni"]["export_context"]``.
:class:`ContextExportConnector` is an out-of-tree vLLM KV connector (``kv_transfer_config`` with
``kv_connector_module_path`` = this module, set by configuration resolution), so it works the same on
vLLM's V1 and V2 model runners and with CUDA graphs:

- **Scheduler side** (the EngineCore process): in the step that computes the last token of a flagged
  request's prompt, ``build_connector_meta`` sends the worker the request's block ids, prompt length and
  next position; ``request_finished`` keeps those blocks allocated until the worker reports the copy
  done (``finished_sending``), so a request that finishes in that very step (BAGEL's ``max_tokens=1``)
  cannot have its blocks reused before they are read.
- **Worker side**: ``wait_for_save`` (run after every forward, also when a full CUDA graph replays)
  copies every layer's keys and values of each such request out of the paged cache into one contiguous
  ``[num_layers, 2, prompt_len, kv_heads, head_dim]`` tensor, puts it into the connector of the AR
  stage's output edge (shared memory or NIXL) and reports the handle back in the step's worker
  metadata::

      {"context": {"kv": {HANDLE_KEY: handle}, "kv_len": prompt_len, "rope": next_position,
                   "export_s": seconds the copy and the put took}}

  A failed export becomes ``{"context_error": "..."}``: the request's consumer fails it with that message.
- The same worker metadata carries the model's other outputs for the next stage (``stage_outbox.py``:
  GLM-Image's source-image prior tokens, recorded by V2's model state), which is why resolution gives this
  connector, without a context connector, to a V2 stage whose model has such outputs.
- The Omni scheduler attaches those stage outputs to the request's final output
  (``kv_transfer_params["omni"]``); vLLM calls ``request_finished`` before it reads the step's worker
  metadata, so the connector itself cannot return them there.

``rope`` is the position the next token would take (M-RoPE models: prompt length plus the request's
position delta), computed on the scheduler side by the pipeline's function named in
``kv_connector_extra_config["omni"]["next_position"]`` (``f(vllm_config, request) -> int``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from vllm_omni_plugin.ar_channel import (
    CONTEXT_CONNECTOR_KEY,
    EXPORT_CONTEXT,
    NEXT_POSITION_KEY,
    OMNI_KEY,
    omni_extra_args,
)
from vllm_omni_plugin.ar_worker.paged_kv import check_kv_caches, layer_cpu_isa, read_tokens
from vllm_omni_plugin.ar_worker.stage_outbox import STAGE_OUTBOX
from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.log import get_logger

if TYPE_CHECKING:
    from vllm_omni_plugin.connectors.base import OmniConnector

logger = get_logger(__name__)

KVConnectorBase_V1 = resolve("KVConnectorBase_V1")
KVConnectorMetadata = resolve("KVConnectorMetadata")
KVConnectorWorkerMetadata = resolve("KVConnectorWorkerMetadata")
KVConnectorRole = resolve("KVConnectorRole")


def wants_export(sampling_params: Any) -> bool:
    return bool(omni_extra_args(sampling_params).get(EXPORT_CONTEXT))


@dataclass
class ContextExport:
    """One request whose context is copied out in this step."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    next_position: int


@dataclass
class ContextExportMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: the requests whose prompt this step completes."""

    exports: list[ContextExport] = field(default_factory=list)


@dataclass
class ContextExportWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: each exported request's stage outputs."""

    stage_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: Any) -> ContextExportWorkerMetadata:
        merged = dict(self.stage_outputs)
        merged.update(getattr(other, "stage_outputs", {}) or {})
        return ContextExportWorkerMetadata(stage_outputs=merged)


class ContextExportConnector(KVConnectorBase_V1):
    """vLLM KV connector (producer) that exports whole request contexts; see the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get(OMNI_KEY) or {}
        self.connector_spec: dict[str, Any] | None = extra.get(CONTEXT_CONNECTOR_KEY)
        self._next_position = None
        if role == KVConnectorRole.SCHEDULER and extra.get(NEXT_POSITION_KEY):
            from vllm_omni_plugin.dotted import import_object

            self._next_position = import_object(extra[NEXT_POSITION_KEY])
        # scheduler side
        self._requests: dict[str, Any] = {}
        """Flagged requests not yet finished, by id."""
        self._held: set[str] = set()
        """Requests whose export was scheduled: their blocks stay until the worker reports the copy."""
        self._stage_outputs: dict[str, dict[str, Any]] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[torch.Tensor, Any, int, str | None]] | None = None
        self._connector: OmniConnector | None = None
        self._copied: set[str] = set()
        """Exported requests the scheduler has not yet been told are copied (reported once finished)."""
        self._step_outputs: dict[str, dict[str, Any]] = {}

    # --- scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if wants_export(request.sampling_params):
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> ContextExportMetadata:
        exports: list[ContextExport] = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._held:
                continue
            before = request.num_computed_tokens  # advanced only after this call
            prompt = request.num_prompt_tokens
            if not before < prompt <= before + scheduled:
                continue
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
            exports.append(ContextExport(req_id, block_ids, prompt, self._position(request)))
            self._held.add(req_id)
        return ContextExportMetadata(exports=exports)

    def _position(self, request: Any) -> int:
        if self._next_position is None:
            return request.num_prompt_tokens
        return int(self._next_position(self._vllm_config, request))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return request.request_id in self._held, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ContextExportWorkerMetadata):
            self._stage_outputs.update(meta.stage_outputs)
        for req_id in connector_output.finished_sending or ():
            self._held.discard(req_id)

    def take_stage_outputs(self) -> dict[str, dict[str, Any]]:
        """The stage outputs the workers reported since the last call (the Omni scheduler's)."""
        outputs, self._stage_outputs = self._stage_outputs, {}
        return outputs

    # --- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """At start-up: a cache the export cannot read back as keys and values (quantised, an unknown
        backend's layout, blocks that do not split evenly) stops the worker here, in one line (a stage
        whose connector only carries stage outputs exports nothing and reads no cache)."""
        if self.connector_spec:
            layers = self._vllm_config.compilation_config.static_forward_context
            check_kv_caches(kv_caches, layers, self._manager_block_size())
        self._kv_caches = dict(kv_caches)
        self._layers = None

    def _manager_block_size(self) -> int:
        """The block size the scheduler's block ids count in (kernels may split each block further)."""
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None)
        if groups:
            return int(groups[0].kv_cache_spec.block_size)
        return int(self._vllm_config.cache_config.block_size)

    def _attention_layers(self) -> list[tuple[torch.Tensor, Any, int, str | None]]:
        """``(kv cache, attention backend, head size, CPU kernels)`` of each decoder attention layer, in
        layer order."""
        if self._layers is None:
            extract_layer_index = resolve("extract_layer_index")
            forward_context = self._vllm_config.compilation_config.static_forward_context
            layers = []
            for name, cache in self._kv_caches.items():
                layer = forward_context[name]
                reader = (cache, layer.attn_backend, layer.head_size, layer_cpu_isa(layer, cache))
                layers.append((extract_layer_index(name), reader))
            self._layers = [reader for _, reader in sorted(layers, key=_first)]
        return self._layers

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        for export in getattr(metadata, "exports", ()):
            self._step_outputs[export.req_id] = self._export(export)
            self._copied.add(export.req_id)

    def request_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_layers, 2, num_tokens, kv_heads, head_dim]`` of one request (a contiguous copy)."""
        block_size = self._manager_block_size()
        per_layer = []
        for cache, backend, head_size, isa in self._attention_layers():
            keys, values = read_tokens(
                cache, backend, head_size, block_ids, num_tokens, block_size=block_size, cpu_isa=isa
            )
            per_layer.append(torch.stack((keys, values)))
        return torch.stack(per_layer)

    def _export(self, export: ContextExport) -> dict[str, Any]:
        from vllm_omni_plugin.connectors.base import HANDLE_KEY

        start = time.perf_counter()
        try:
            handle = self.connector().put(self.request_kv(export.block_ids, export.num_tokens))
        except Exception as exc:  # the request fails with this message; the engine keeps serving
            logger.error(
                "context export of request %s failed: %s: %s", export.req_id, type(exc).__name__, exc
            )
            return {"context_error": f"context export failed: {type(exc).__name__}: {exc}"}
        return {
            "context": {
                "kv": {HANDLE_KEY: msgspec.to_builtins(handle)},
                "kv_len": export.num_tokens,
                "rope": export.next_position,
                "export_s": time.perf_counter() - start,
            }
        }

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._copied & set(finished_req_ids)
        self._copied -= done
        return (done or None), None

    def build_connector_worker_meta(self) -> ContextExportWorkerMetadata | None:
        outputs = STAGE_OUTBOX.take()  # the model's outputs for the next stage (V2's only way out)
        for req_id, exported in self._step_outputs.items():
            outputs.setdefault(req_id, {}).update(exported)
        self._step_outputs = {}
        return ContextExportWorkerMetadata(stage_outputs=outputs) if outputs else None

    def connector(self) -> OmniConnector:
        if self._connector is None:
            if not self.connector_spec:
                raise RuntimeError(
                    "this AR stage was asked to export a context but its KV connector names no context "
                    "connector (configuration resolution sets it for pipelines with a KV handoff)"
                )
            from vllm_omni_plugin.connectors.base import make_connector

            spec = self.connector_spec
            self._connector = make_connector(spec["name"], spec["class"], dict(spec.get("extra") or {}))
        return self._connector

    def health(self) -> Any:
        """The context connector's counters in this (worker) process, or None before the first export."""
        return self._connector.health() if self._connector is not None else None

    def shutdown(self) -> None:
        if self._connector is not None:
            connector, self._connector = self._connector, None
            connector.close()


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]
