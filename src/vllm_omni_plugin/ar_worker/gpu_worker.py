"""The Omni worker for vLLM's CUDA/ROCm platforms."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.ar_worker.worker_mixin import OmniWorkerMixin, log_model_runner
from vllm_omni_plugin.compat import resolve, uses_v2_model_runner

GPUWorker = resolve("GPUWorker")


class OmniGPUWorker(OmniWorkerMixin, GPUWorker):
    """vLLM's GPU worker with the Omni model runner on vLLM's V1 runner; V2 stays stock.

    vLLM 0.32+ builds the runner through ``_make_model_runner``; 0.31 builds it inline in
    ``init_device``, where it is replaced right after, before any model is loaded. On the V2 runner (the
    only one from vLLM 0.34) the omni behaviour comes from stock seams instead: the model's
    ``get_model_state_cls()`` (planned decode positions) and the context export KV connector. The V1
    runner's module is imported only when V1 runs.
    """

    def init_device(self, *args: Any, **kwargs: Any) -> None:
        super().init_device(*args, **kwargs)
        if not uses_v2_model_runner(self.vllm_config):
            from vllm_omni_plugin.ar_worker.v1_gpu_runner import OmniGPUModelRunner

            if not isinstance(self.model_runner, OmniGPUModelRunner):
                self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> Any:
        v2 = uses_v2_model_runner(self.vllm_config)
        log_model_runner(v2)
        if not v2:
            from vllm_omni_plugin.ar_worker.v1_gpu_runner import OmniGPUModelRunner

            return OmniGPUModelRunner(self.vllm_config, self.device)
        if hasattr(GPUWorker, "_make_model_runner"):  # vLLM's own choice (0.32+)
            return super()._make_model_runner()
        return resolve("GPUModelRunnerV2")(self.vllm_config, self.device)
