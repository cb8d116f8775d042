"""The Omni worker and model runner for vLLM's CUDA/ROCm platforms."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.compat import resolve
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.runners.omni_model_runner import OmniModelRunnerMixin
from vllm_omni_plugin.runners.worker_mixin import OmniWorkerMixin

GPUWorker = resolve("GPUWorker")
GPUModelRunner = resolve("GPUModelRunner")

logger = get_logger(__name__)


class OmniGPUModelRunner(OmniModelRunnerMixin, GPUModelRunner):
    pass


class OmniGPUWorker(OmniWorkerMixin, GPUWorker):
    """vLLM's GPU worker with the Omni model runner on vLLM's V1 runner; V2 stays stock.

    vLLM 0.32+ builds the runner through ``_make_model_runner``; 0.31 builds it inline in
    ``init_device``, where it is replaced right after, before any model is loaded. On the V2 runner
    (``VLLM_USE_V2_MODEL_RUNNER=1``) the omni behaviour comes from stock seams instead: the model's
    ``get_model_state_cls()`` (planned decode positions) and the context export KV connector.
    """

    def init_device(self, *args: Any, **kwargs: Any) -> None:
        super().init_device(*args, **kwargs)
        if not getattr(self, "use_v2_model_runner", False) and not isinstance(
            self.model_runner, OmniGPUModelRunner
        ):
            self.model_runner = self._make_model_runner()

    def _make_model_runner(self) -> Any:
        if getattr(self, "use_v2_model_runner", False):
            logger.info(
                "AR stage on vLLM's V2 model runner: positions and context exports through the model "
                "state and KV connector seams (the V1 runner hooks are not installed)"
            )
            return resolve("GPUModelRunnerV2")(self.vllm_config, self.device)
        return OmniGPUModelRunner(self.vllm_config, self.device)
