"""The Omni worker and model runner for vLLM's CUDA/ROCm platforms."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.runners.omni_model_runner import OmniModelRunnerMixin
from vllm_omni_plugin.runners.worker_mixin import OmniWorkerMixin

GPUWorker = resolve("GPUWorker")
GPUModelRunner = resolve("GPUModelRunner")


class OmniGPUModelRunner(OmniModelRunnerMixin, GPUModelRunner):
    pass


class OmniGPUWorker(OmniWorkerMixin, GPUWorker):
    """vLLM's GPU worker with the Omni model runner.

    vLLM 0.32+ builds the runner through ``_make_model_runner``; 0.31 builds it inline in
    ``init_device``, where it is replaced right after, before any model is loaded.
    """

    def init_device(self, *args: Any, **kwargs: Any) -> None:
        super().init_device(*args, **kwargs)
        if not isinstance(self.model_runner, OmniGPUModelRunner):
            self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> OmniGPUModelRunner:
        if getattr(self, "use_v2_model_runner", False):
            # vLLM picks the V2 runner by default where Triton is available
            raise RuntimeError(
                "the Omni AR stage needs vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        return OmniGPUModelRunner(self.vllm_config, self.device)
