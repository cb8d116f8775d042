"""The Omni worker and model runner for vLLM's CUDA/ROCm platforms."""

from __future__ import annotations

from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.runners.omni_model_runner import OmniModelRunnerMixin

GPUWorker = resolve("GPUWorker")
GPUModelRunner = resolve("GPUModelRunner")


class OmniGPUModelRunner(OmniModelRunnerMixin, GPUModelRunner):
    pass


class OmniGPUWorker(GPUWorker):
    def _make_model_runner(self) -> OmniGPUModelRunner:
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError(
                "the Omni AR stage needs vLLM's V1 model runner (unset VLLM_USE_V2_MODEL_RUNNER)"
            )
        return OmniGPUModelRunner(self.vllm_config, self.device)
