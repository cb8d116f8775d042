"""Diffusion workers: the per-platform part of running a :class:`DiffusionEngine` (device, threads, dtype).

The engine itself is device-agnostic; a worker picks the device and the defaults that suit the platform
(float32 on CPU, where bfloat16 matmuls are slow on most CPUs; bfloat16 on GPUs). Which worker a
platform uses is configuration's platform table (``vllm_omni_plugin.config.platform``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from vllm_omni_plugin.diffusion.engine import DiffusionEngine
from vllm_omni_plugin.diffusion.engine_config import DiffusionEngineConfig
from vllm_omni_plugin.diffusion.params import DiffusionRequest, DiffusionResult
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.processes import usable_cores

logger = get_logger(__name__)

WORKER_ARGS = ("num_threads", "cpu_cores")
"""Keys of a stage's ``diffusion_args`` that build its worker (``CPUDiffusionWorker``'s arguments), not
its engine: what the CPU threads policy decided (``config/cpu_threads.py``)."""


class DiffusionWorker:
    """Sets up one device, loads one engine on it and runs requests through it."""

    default_dtype: ClassVar[str] = "float32"

    def __init__(self, *, local_rank: int = 0) -> None:
        self.local_rank = local_rank
        self.device: Any = None
        self.engine: DiffusionEngine | None = None

    def init_device(self) -> Any:
        raise NotImplementedError

    def load_model(self, model: str | Path, **engine_args: Any) -> DiffusionEngine:
        """An engine on this worker's device; ``dtype`` unset or ``"auto"``: the platform default. With
        ``gpu_memory_utilization`` the device is capped first (where the platform can), so loading too
        stays within the stage's share."""
        if self.device is None:
            self.init_device()
        if engine_args.get("dtype") in (None, "auto"):
            engine_args["dtype"] = self.default_dtype
        engine_args.pop("device", None)
        config = DiffusionEngineConfig.from_args(engine_args)
        if config.gpu_memory_utilization is not None:
            self.limit_memory(config.gpu_memory_utilization)
        self.engine = DiffusionEngine(model, config, device=self.device)
        return self.engine

    def limit_memory(self, fraction: float) -> None:
        """Cap this process's allocations on the device at ``fraction`` of its memory (a no-op where
        nothing can cap them: the engine still admits batches by their estimates)."""

    def execute(self, requests: Iterable[DiffusionRequest]) -> list[DiffusionResult]:
        if self.engine is None:
            raise RuntimeError("load_model() first")
        return self.engine.generate(list(requests))


class CPUDiffusionWorker(DiffusionWorker):
    """CPU: float32, and a fixed intra-op thread count so that concurrent stages on one machine do not
    oversubscribe it: ``num_threads``, else one per core of ``cpu_cores``, else ``OMP_NUM_THREADS``, else
    one per core this process may use. With ``cpu_cores`` (the CPU threads policy's share of the cores,
    ``config/cpu_threads.py``) the process binds itself to them first, so its OpenMP threads never spin
    on the cores of the AR stage's worker."""

    default_dtype = "float32"

    def __init__(
        self,
        *,
        local_rank: int = 0,
        num_threads: int | None = None,
        cpu_cores: Sequence[int] | None = None,
    ) -> None:
        super().__init__(local_rank=local_rank)
        self.num_threads = num_threads
        self.cpu_cores = sorted(cpu_cores) if cpu_cores else None

    def init_device(self) -> Any:
        import torch

        if self.cpu_cores and hasattr(os, "sched_setaffinity"):
            # Before torch starts its OpenMP threads: they inherit the binding of the thread starting them.
            os.sched_setaffinity(0, self.cpu_cores)
        threads = (
            self.num_threads
            or len(self.cpu_cores or ())
            or int(os.environ.get("OMP_NUM_THREADS") or 0)
            or len(usable_cores())
        )
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.device = torch.device("cpu")
        where = f" on cores {self.cpu_cores}" if self.cpu_cores else ""
        logger.info("diffusion worker: cpu, %d threads%s", threads, where)
        return self.device


class CUDADiffusionWorker(DiffusionWorker):
    """CUDA (and ROCm, which torch exposes as ``cuda``): bfloat16 on ``cuda:<local_rank>``; the visible
    devices are chosen by the launcher (``CUDA_VISIBLE_DEVICES``)."""

    default_dtype = "bfloat16"

    def init_device(self) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDADiffusionWorker: torch sees no CUDA device")
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        logger.info("diffusion worker: %s (%s)", self.device, torch.cuda.get_device_name(self.device))
        return self.device

    def limit_memory(self, fraction: float) -> None:
        """The caching allocator refuses (out of memory) past ``fraction`` of the GPU: the stage cannot
        take what another stage on the same GPU was promised."""
        import torch

        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        logger.info("diffusion worker: %s capped at %g of its memory", self.device, fraction)
