"""Shared fixtures: the CPU test environment, tiny models built once per session, and the guard that fails
a run which leaves processes or shared-memory segments behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from fast_tier import forbid_processes
from fast_tier import select as select_fast_tier
from vllm_omni_testkit.harness.forks import VllmForks
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import CPU_TEST_ENV, cpu_test_env, freeze_test_environment

if TYPE_CHECKING:
    import numpy as np

for _key, _value in CPU_TEST_ENV.items():
    os.environ.setdefault(_key, _value)

# vLLM's engines make their ZMQ socket files in VLLM_RPC_BASE_PATH and their gloo rendezvous files
# (vllm_dist_*) in the temp dir, and a process a test kills, or a server stopped before it closes them,
# leaves them there: the processes the run starts get a temp directory of its own, which it removes at its
# end. Set before any engine or server starts (they inherit it); this process keeps its own temp dir.
RUN_DIR = (
    None if "VLLM_RPC_BASE_PATH" in os.environ else tempfile.mkdtemp(prefix="vo-tests-")
)  # short: socket paths
if RUN_DIR is not None:
    os.environ["VLLM_RPC_BASE_PATH"] = RUN_DIR
    os.environ["TMPDIR"] = RUN_DIR
freeze_test_environment()  # the processes tests start get this, whatever in-process engines set later

REPO_ROOT = Path(__file__).resolve().parent.parent
LEAK_GRACE_S = 20.0
"""How long the guard waits, at the end of the run, for processes and segments to go."""


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[LeakWatch]:
    """Fails the run, naming them, when processes it started or ``/dev/shm`` segments they made are still
    there at its end (then removes them, so that the next run starts clean)."""
    watch = LeakWatch(interval=1.0).start()  # a safety net: the tests' own watches look closer
    yield watch
    gc.collect()  # objects nobody references release what they hold now, not at exit
    watch.stop()
    left = watch.leftovers(grace=LEAK_GRACE_S)
    if left:
        watch.clean(left)
        pytest.fail("the test run left this behind (now removed):\n" + left.describe(), pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run's temp directory goes at its end, also when it ran no test (no session fixture runs
    then)."""
    if RUN_DIR is not None:
        shutil.rmtree(RUN_DIR, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast", action="store_true", dest="fast_tier", help="run only the fast tier (tests/fast_tier.py)"
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "fast: set by conftest on every test of the fast tier (no process, no tiny model); see --fast",
        "processes: starts processes (a script, a child, Ray) but no vLLM server; not in the fast tier",
        "slow: computes for seconds (builds pipelines, scans vLLM sources, Hypothesis); not in the fast tier",
    ):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, saying so, where there is no CUDA device (scripts/gpu_check.sh runs
    them on a GPU host); the fast tier is chosen."""
    import torch

    select_fast_tier(config, items)
    run_heaviest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def module_weight(items: list[pytest.Item]) -> int:
    """How heavy a module is, by its marks: servers, then other processes and tiny models, then the rest."""
    if any(item.get_closest_marker("server") is not None for item in items):
        return 0
    if any(item.get_closest_marker("fast") is None for item in items):
        return 1
    return 2


def run_heaviest_modules_first(items: list[pytest.Item]) -> None:
    """Orders modules heaviest first, each module's tests kept in their order: the test command runs
    modules on parallel workers (``--dist loadfile --no-loadscope-reorder``), which take them in this
    order, so the run ends with short modules rather than with one worker alone on a long one."""
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for group in sorted(by_module.values(), key=module_weight) for item in group]


@pytest.fixture(autouse=True)
def fast_tier_starts_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test of the fast tier that starts a process fails, in every run, so the tier stays what it is."""
    if request.node.get_closest_marker("fast") is not None:
        forbid_processes(monkeypatch, request.node.nodeid)


def tiny_model_cache() -> Path:
    """Tiny models are cached across runs (they are rebuilt when their config hash changes)."""
    return Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", REPO_ROOT / ".cache" / "tiny_models"))


@pytest.fixture(scope="session", autouse=True)
def vllm_forks() -> Iterator[VllmForks]:
    """The session's fork server: ``vllm`` command lines (servers included), ``python -m`` modules (Dynamo's
    frontend and workers) and ``python`` scripts (the engine scripts) start as forks of one process per
    worker that imported vLLM, torch and diffusers once (about seven seconds of CPU saved on each start;
    ``vllm_omni_testkit.harness.forks`` says which run fresh). Started at its first use."""
    forks = VllmForks(cpu_test_env(drop=("VLLM_PLUGINS",))).activate()
    try:
        yield forks
    finally:
        forks.close()


@pytest.fixture(scope="session")
def vllm_cli(vllm_forks: VllmForks) -> VllmForks:
    """``vllm`` command lines that end before any engine starts (help, refusals, start-up errors,
    ``--print-resolved-config``), run to their end through the fork server (``run``)."""
    return vllm_forks


@pytest.fixture(scope="session")
def tiny_text_model() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("text", tiny_model_cache() / "text")


@pytest.fixture(scope="session")
def tiny_glm_image() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("glm-image", tiny_model_cache() / "glm-image")


@pytest.fixture(scope="session")
def glm_image_served(tiny_glm_image: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """What ``vllm serve --omni`` makes of the tiny GLM-Image with its CPU deploy file, made once per run
    (``vllm_omni_testkit.harness.served_reference``; ``test_api_server.py``'s server makes it when it
    runs first)."""
    from vllm_omni_testkit.harness.served_reference import GLM_IMAGE

    return GLM_IMAGE.served(tiny_glm_image, REPO_ROOT, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_bagel() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("bagel", tiny_model_cache() / "bagel")


@pytest.fixture(scope="session")
def bagel_served(tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """What ``vllm serve --omni`` makes of the tiny BAGEL with its CPU deploy file, made once per run
    (``test_bagel_server.py``'s server makes it when it runs first)."""
    from vllm_omni_testkit.harness.served_reference import BAGEL

    return BAGEL.served(tiny_bagel, REPO_ROOT, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_sd3() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("sd3", tiny_model_cache() / "sd3")


@pytest.fixture(scope="session")
def tiny_flux() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("flux", tiny_model_cache() / "flux")


@pytest.fixture(scope="session")
def tiny_flux_fill() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("flux-fill", tiny_model_cache() / "flux-fill")


@pytest.fixture(scope="session")
def tiny_qwen_image() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("qwen-image", tiny_model_cache() / "qwen-image")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("qwen-image-edit", tiny_model_cache() / "qwen-image-edit")


@pytest.fixture(scope="session")
def tiny_wan() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("wan", tiny_model_cache() / "wan")


@pytest.fixture(scope="session")
def tiny_wan_i2v() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("wan-i2v", tiny_model_cache() / "wan-i2v")


@pytest.fixture(scope="session")
def tiny_wan22() -> Path:
    from vllm_omni_plugin.tiny_models import build

    return build("wan2.2", tiny_model_cache() / "wan2.2")


@pytest.fixture(scope="module")
def spawn() -> multiprocessing.context.SpawnContext:
    """Child processes started fresh (no fork of a process holding engines, sockets and segments)."""
    return multiprocessing.get_context("spawn")
