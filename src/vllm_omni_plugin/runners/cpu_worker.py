"""The Omni worker and model runner for vLLM's CPU platform."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.runners.omni_model_runner import OmniModelRunnerMixin
from vllm_omni_plugin.runners.worker_mixin import OmniWorkerMixin

CPUWorker = resolve("CPUWorker")
CPUModelRunner = resolve("CPUModelRunner")


class OmniCPUModelRunner(OmniModelRunnerMixin, CPUModelRunner):
    pass


class OmniCPUWorker(OmniWorkerMixin, CPUWorker):
    """vLLM's CPU worker with the Omni model runner.

    ``CPUWorker.init_device`` builds its runner inline (there is no factory hook as on GPU), so the
    runner is replaced right after, before any model is loaded. vLLM's CPU V2 runner (which needs
    Triton's CPU backend) is left stock, as on GPU.
    """

    def init_device(self, *args: Any, **kwargs: Any) -> None:
        super().init_device(*args, **kwargs)
        if not getattr(self, "use_v2_model_runner", False):
            self.model_runner = OmniCPUModelRunner(self.vllm_config, self.model_runner.device)
