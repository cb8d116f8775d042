"""The Omni model runner on vLLM's V1 ``GPUModelRunner`` (vLLM <= 0.33, where resolution picks V1).

Imported only by ``OmniGPUWorker`` when its engine runs V1: vLLM 0.34 deleted the V1 runner, and no
module that every AR stage imports may name it.
"""

from __future__ import annotations

from vllm_omni_plugin.ar_worker.omni_model_runner import OmniModelRunnerMixin
from vllm_omni_plugin.compat import resolve

V1_ONLY = True
"""Read by the release check: what this module needs from vLLM exists only where V1 does."""

GPUModelRunner = resolve("GPUModelRunner")


class OmniGPUModelRunner(OmniModelRunnerMixin, GPUModelRunner):
    pass
