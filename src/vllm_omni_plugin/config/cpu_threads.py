"""The CPU threads policy: how many OpenMP threads each stage process runs, and on which cores.

An OpenMP thread that runs out of work spins on its core for a while before it sleeps, so two processes
whose threads share cores slow each other down far beyond their share of the work: vLLM's AR worker
binds its threads to every core of its NUMA node by default, and the DiT's threads spin on the same
ones. On the CPU platform with every stage on this host (backend ``local``, no headless stage),
resolution therefore splits the N cores this process may use (its affinity) between the stages:

- no AR stage (a diffusers pipeline): the diffusion replicas share all N cores, ``N // replicas``
  threads each (at least one);
- AR and diffusion stages: the AR replicas take the first ``max(1, N // 2)`` cores, split evenly between
  them (vLLM binds each worker's threads there: ``VLLM_CPU_OMP_THREADS_BIND`` in the replica's
  environment), and the diffusion replicas the rest (at least one core; with one core both share it),
  each bound to them (``cpu_cores``) with its share of them as threads (``num_threads``).

What steps aside. ``OMP_NUM_THREADS`` in the environment (the user's choice) turns the whole policy
off: the DiT takes that many threads and vLLM binds its worker as by default. A diffusion stage's
``num_threads``: that many threads, no binding. vLLM binds an AR stage as by default where
``VLLM_CPU_OMP_THREADS_BIND`` is set in its ``env:`` or the environment and where it runs more than one
worker (tensor, pipeline or data parallel), the DiT keeping off the AR cores all the same, and where
there is no diffusion stage. A diffusion stage with ``process: false`` runs in the API server's
process, which it must not bind: it gets its thread count only. The ``ray`` backend and headless stages
place stages on hosts resolution does not know: nothing is split there (the DiT runs ``num_threads``,
else ``OMP_NUM_THREADS``, else one thread per core of its process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_plugin.config.pipeline import PipelineStage
from vllm_omni_plugin.config.platform import PlatformInfo
from vllm_omni_plugin.config.report import Reporter
from vllm_omni_plugin.config.schema import StageDeployConfig
from vllm_omni_plugin.processes import usable_cores

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's CPU build: the cores its worker binds its OpenMP threads to (``auto``, ``nobind`` or a list)."""
OMP_THREADS_ENV = "OMP_NUM_THREADS"
VLLM_SET_OMP_ENV = "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"
"""vLLM's mark on an ``OMP_NUM_THREADS`` it chose itself (for its GPU workers): no user's choice."""


@dataclass(frozen=True)
class StageThreads:
    """What the policy reads of one stage."""

    stage_id: int
    ar: bool
    replicas: int = 1
    workers: int = 1
    """Worker processes per AR replica (tensor x pipeline x data parallel): vLLM binds more than one."""
    process: bool = True
    """A diffusion stage in processes of its own (``process: false``: in the API server's)."""
    headless: bool = False
    user_bind: bool = False
    """``VLLM_CPU_OMP_THREADS_BIND`` set for this AR stage (its ``env:`` or the environment)."""
    num_threads: int | None = None
    """A diffusion stage's ``num_threads``."""


@dataclass(frozen=True)
class DiffusionThreads:
    """A diffusion replica's threads and the cores it binds itself to (None: it does not bind)."""

    num_threads: int
    cpu_cores: tuple[int, ...] | None = None

    def worker_args(self) -> dict[str, Any]:
        """The diffusion worker's arguments (``CPUDiffusionWorker``), as ``diffusion_args`` carry them."""
        args: dict[str, Any] = {"num_threads": self.num_threads}
        if self.cpu_cores is not None:
            args["cpu_cores"] = list(self.cpu_cores)
        return args


@dataclass(frozen=True)
class ThreadPlan:
    """The policy's decision; empty where it steps aside."""

    ar_binds: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """AR stage id -> ``VLLM_CPU_OMP_THREADS_BIND`` of each of its replicas."""
    diffusion: dict[int, DiffusionThreads] = field(default_factory=dict)
    """Diffusion stage id -> what each of its replicas runs."""

    def ar_env(self, stage_id: int, replica_id: int) -> dict[str, str]:
        """What the policy adds to an AR replica's environment."""
        binds = self.ar_binds.get(stage_id)
        return {THREADS_BIND_ENV: binds[replica_id]} if binds else {}

    def diffusion_args(self, stage_id: int) -> dict[str, Any]:
        """What the policy adds to a diffusion stage's worker arguments."""
        threads = self.diffusion.get(stage_id)
        return threads.worker_args() if threads is not None else {}


def user_omp_threads(environ: Mapping[str, str]) -> str | None:
    """``OMP_NUM_THREADS`` when the user set it (vLLM marks the value it sets itself)."""
    value = environ.get(OMP_THREADS_ENV)
    if value is None or environ.get(VLLM_SET_OMP_ENV) == "1":
        return None
    return value


def cpu_list(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``: vLLM's spelling of a core list."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _parts(cores: Sequence[int], n: int) -> list[list[int]]:
    """``cores`` in ``n`` contiguous parts as even as they come, each at least one core (more parts than
    cores share them)."""
    size = len(cores)
    parts = []
    for i in range(n):
        lo, hi = i * size // n, (i + 1) * size // n
        parts.append(list(cores[lo:hi]) or [cores[min(lo, size - 1)]])
    return parts


def split_cores(
    cores: Sequence[int], stages: Sequence[StageThreads], *, omp_num_threads: str | None = None
) -> ThreadPlan:
    """The policy over ``cores`` (this process's) for stages that all run on this host; with
    ``omp_num_threads`` (the user's ``OMP_NUM_THREADS``) only the diffusion stages' ``num_threads``."""
    if omp_num_threads is not None or not cores:
        return ThreadPlan(diffusion=_pinned(stages))
    cores = sorted(cores)
    ar = [s for s in stages if s.ar]
    dit = [s for s in stages if not s.ar]
    ar_count = max(1, len(cores) // 2) if ar and dit else 0  # an AR stage alone: vLLM's own binding
    ar_cores, dit_cores = cores[:ar_count], cores[ar_count:] or cores[:1]
    bound = [s for s in ar if s.workers == 1 and not s.user_bind] if ar_count else []
    binds: dict[int, tuple[str, ...]] = {}
    if bound:
        parts = iter(_parts(ar_cores, sum(s.replicas for s in bound)))
        for s in bound:
            binds[s.stage_id] = tuple(cpu_list(next(parts)) for _ in range(s.replicas))
    diffusion = _pinned(stages)
    shared = sum(s.replicas for s in dit if s.num_threads is None)
    for s in dit:
        if s.num_threads is None:
            threads = max(1, len(dit_cores) // shared)
            diffusion[s.stage_id] = DiffusionThreads(threads, tuple(dit_cores) if s.process else None)
    return ThreadPlan(ar_binds=binds, diffusion=diffusion)


def _pinned(stages: Sequence[StageThreads]) -> dict[int, DiffusionThreads]:
    """The diffusion stages' own ``num_threads`` (no binding): these hold wherever the policy does not."""
    return {
        s.stage_id: DiffusionThreads(s.num_threads) for s in stages if not s.ar and s.num_threads is not None
    }


def _engine_int(stage: StageDeployConfig, name: str) -> int:
    value = (stage.engine_extras or {}).get(name)
    return value if isinstance(value, int) and value > 0 else 1


def stage_threads(
    stage: StageDeployConfig, fixed: PipelineStage, environ: Mapping[str, str] = os.environ
) -> StageThreads:
    """What the policy reads of a stage's merged deploy config."""
    ar = fixed.execution_type == "llm_ar"
    workers = (stage.tensor_parallel_size or 1) * _engine_int(stage, "pipeline_parallel_size")
    workers *= _engine_int(stage, "data_parallel_size")
    return StageThreads(
        stage_id=fixed.stage_id,
        ar=ar,
        replicas=stage.num_replicas or 1,
        workers=workers if ar else 1,
        process=True if stage.process is None else stage.process,
        headless=bool(stage.headless),
        user_bind=ar and (THREADS_BIND_ENV in (stage.env or {}) or THREADS_BIND_ENV in environ),
        num_threads=None if ar else stage.num_threads,
    )


def thread_plan(
    stages: Sequence[StageThreads],
    *,
    platform: str,
    backend: str,
    environ: Mapping[str, str] = os.environ,
    cores: Sequence[int] | None = None,
) -> ThreadPlan:
    """The policy where it applies: the CPU platform, every stage on this host (backend ``local``, none
    headless; ``cores``: default this process's). Elsewhere on CPU only the diffusion stages'
    ``num_threads`` are handed on; on other platforms nothing (their diffusion worker takes no threads)."""
    if platform != "cpu":
        return ThreadPlan()
    if backend != "local" or any(s.headless for s in stages):
        return ThreadPlan(diffusion=_pinned(stages))
    return split_cores(
        usable_cores() if cores is None else cores, stages, omp_num_threads=user_omp_threads(environ)
    )


def diffusion_thread_args(
    stage: StageDeployConfig, plan: ThreadPlan, platform: PlatformInfo, report: Reporter
) -> dict[str, Any]:
    """What a diffusion stage's worker arguments get from the plan (``num_threads``, ``cpu_cores``); a
    ``num_threads`` off the CPU platform is noted as ignored."""
    if stage.num_threads is not None and platform.name != "cpu":
        report.note_at(stage.stage_id, "num_threads", f"applies on cpu only; ignored on {platform.name}")
    return plan.diffusion_args(stage.stage_id)
