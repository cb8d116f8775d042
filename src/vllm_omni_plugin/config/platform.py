"""The one platform table: what each platform runs an omni stage with.

Resolution reads it twice: the AR stage gets the platform's Omni worker (``EngineArgs.worker_cls``)
and async scheduling only where the platform supports it; a diffusion stage gets the platform's
diffusion worker. ``device_env`` is how a replica's devices are selected (``devices:`` in a deploy
config); ``None`` means they cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

OMNI_GPU_WORKER = "vllm_omni_plugin.ar_worker.gpu_worker.OmniGPUWorker"
OMNI_CPU_WORKER = "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker"
CPU_DIFFUSION_WORKER = "vllm_omni_plugin.diffusion.worker.CPUDiffusionWorker"
CUDA_DIFFUSION_WORKER = "vllm_omni_plugin.diffusion.worker.CUDADiffusionWorker"

OMNI_WORKER_PREFIXES = ("vllm_omni.worker.", "vllm_omni_plugin.ar_worker.")
"""Module prefixes of the Omni AR worker family: ours, and vllm-omni's in legacy files."""


@dataclass(frozen=True)
class PlatformInfo:
    name: str
    supports_async_scheduling: bool
    device_env: str | None
    """Environment variable that selects a process's devices (None: devices are not selectable)."""
    ar_worker_cls: str | None
    """Dotted path of the Omni AR worker (None: the AR stage cannot run here)."""
    diffusion_worker_cls: str | None = None
    """Dotted path of the diffusion worker (None: diffusion stages cannot run here)."""
    v2_runner_default: bool = False
    """vLLM picks its V2 model runner here unless ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise (CUDA and
    ROCm, vLLM 0.31+, wherever Triton imports); on CPU it runs V1 (its V2 needs Triton's CPU backend)."""


PLATFORMS: dict[str, PlatformInfo] = {
    "cuda": PlatformInfo("cuda", True, "CUDA_VISIBLE_DEVICES", OMNI_GPU_WORKER, CUDA_DIFFUSION_WORKER, True),
    "rocm": PlatformInfo("rocm", True, "HIP_VISIBLE_DEVICES", OMNI_GPU_WORKER, CUDA_DIFFUSION_WORKER, True),
    "cpu": PlatformInfo("cpu", False, None, OMNI_CPU_WORKER, CPU_DIFFUSION_WORKER),
}
PLATFORM_SECTIONS = ("cuda", "rocm", "cpu", "xpu", "npu", "tpu")
"""Keys a deploy config's ``platforms:`` section may use (sections for platforms we do not run on are
accepted, so one file can serve every platform)."""


def current_platform() -> PlatformInfo:
    """The platform vLLM detected in this process."""
    from vllm_omni_plugin.compat import resolve as compat_resolve

    platform = compat_resolve("current_platform")
    if platform.is_cpu():
        return PLATFORMS["cpu"]
    if platform.is_rocm():
        return PLATFORMS["rocm"]
    if platform.is_cuda():
        return PLATFORMS["cuda"]
    name = str(getattr(platform, "device_type", "unknown"))
    return PlatformInfo(name, False, None, None)


def is_omni_worker(path: str) -> bool:
    """True for the Omni AR worker family (ours, or vllm-omni's), in either dotted spelling."""
    return path.replace(":", ".").startswith(OMNI_WORKER_PREFIXES)
