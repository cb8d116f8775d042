"""What the Omni AR worker, the Omni scheduler and the AR stage client hand each other, through vLLM's
own per-request channels (no side channel, nothing patched):

- in: ``SamplingParams.extra_args[OMNI_KEY]`` (e.g. ``trigger_token_ids`` for the scheduler's hooks);
- runner -> scheduler: an :class:`OmniRunnerOutput` on the step's ``ModelRunnerOutput`` (attribute
  ``omni``), with the per-request stage outputs the runner recorded and the requests it had to leave
  out of the step;
- scheduler -> client: the stage outputs under ``EngineCoreOutput.kv_transfer_params[OMNI_KEY]`` of the
  request's final output, vLLM's per-request dict that reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OMNI_KEY = "omni"
EXPORT_CONTEXT = "export_context"
"""``extra_args[OMNI_KEY][EXPORT_CONTEXT] = True``: export the request's whole K/V once its prompt is
computed (KV-handoff pipelines; see ``ar_worker/context_export.py``)."""
CONTEXT_CONNECTOR_KEY = "context_connector"
"""``kv_transfer_config.kv_connector_extra_config[OMNI_KEY][CONTEXT_CONNECTOR_KEY]``: ``{"name", "class",
"extra"}`` of the connector an AR stage exports contexts through (set by resolution)."""
NEXT_POSITION_KEY = "next_position"
"""``kv_transfer_config.kv_connector_extra_config[OMNI_KEY][NEXT_POSITION_KEY]``: dotted path of the
pipeline's ``f(vllm_config, request) -> int``, the position after a request's prompt (M-RoPE models)."""
CONTEXT_EXPORT_CONNECTOR = ("vllm_omni_plugin.ar_worker.context_export", "ContextExportConnector")
"""Module and class of the context export KV connector (``kv_transfer_config`` of such a stage)."""
RUNNER_OUTPUT_ATTR = "omni"
"""The attribute of a ``ModelRunnerOutput`` that holds its :class:`OmniRunnerOutput`."""
RUNNER_DROPPED_MESSAGE = "the AR stage could not rebuild this request after preemption"


@dataclass
class OmniRunnerOutput:
    """What the Omni model runner adds to one step's ``ModelRunnerOutput``."""

    stage_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Request id -> outputs for the next stage (msgpack-serialisable), as the runner computed them."""
    dropped_req_ids: list[str] = field(default_factory=list)
    """Requests the runner left out of this step because it could not rebuild them: the scheduler
    finishes them with an error (``RUNNER_DROPPED_MESSAGE``)."""


def runner_extras(model_runner_output: Any) -> OmniRunnerOutput | None:
    """The :class:`OmniRunnerOutput` of a step, if the runner attached one (stock vLLM outputs have none)."""
    extras = getattr(model_runner_output, RUNNER_OUTPUT_ATTR, None)
    return extras if isinstance(extras, OmniRunnerOutput) else None


def omni_extra_args(sampling_params: Any) -> dict[str, Any]:
    """``sampling_params.extra_args[OMNI_KEY]`` (empty when absent or not a mapping)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(OMNI_KEY) or {}
    return value if isinstance(value, dict) else {}


def context_export_kv_transfer_config(
    context_connector: dict[str, Any] | None, next_position: str | None
) -> dict[str, Any]:
    """The ``kv_transfer_config`` engine argument of an AR stage with the plugin's KV connector: vLLM
    loads it from its module and hands it ``kv_connector_extra_config`` (``context_connector`` None: the
    stage exports no context, the connector only carries stage outputs)."""
    omni: dict[str, Any] = {}
    if context_connector is not None:
        omni[CONTEXT_CONNECTOR_KEY] = context_connector
    if next_position:
        omni[NEXT_POSITION_KEY] = next_position
    module, cls = CONTEXT_EXPORT_CONNECTOR
    return {
        "kv_connector": cls,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {OMNI_KEY: omni},
    }


def stage_outputs_of(kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The stage outputs a final request output carries (empty when it carries none)."""
    return dict((kv_transfer_params or {}).get(OMNI_KEY) or {})
