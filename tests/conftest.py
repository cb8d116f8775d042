"""Shared fixtures: the CPU test environment and tiny models built once per session."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from vllm_omni_plugin.testing.server import CPU_TEST_ENV

for _key, _value in CPU_TEST_ENV.items():
    os.environ.setdefault(_key, _value)

REPO_ROOT = Path(__file__).resolve().parent.parent


def tiny_model_cache() -> Path:
    """Tiny models are cached across runs (they are rebuilt when their config hash changes)."""
    return Path(os.environ.get("VLLM_OMNI_TINY_MODEL_CACHE", REPO_ROOT / ".cache" / "tiny_models"))


@pytest.fixture(scope="session")
def tiny_text_model() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("text", tiny_model_cache() / "text")


@pytest.fixture(scope="session")
def tiny_glm_image() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("glm-image", tiny_model_cache() / "glm-image")


@pytest.fixture(scope="session")
def tiny_bagel() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("bagel", tiny_model_cache() / "bagel")


@pytest.fixture(scope="session")
def tiny_sd3() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("sd3", tiny_model_cache() / "sd3")


@pytest.fixture(scope="session")
def tiny_flux() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("flux", tiny_model_cache() / "flux")


@pytest.fixture(scope="session")
def tiny_qwen_image() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("qwen-image", tiny_model_cache() / "qwen-image")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit() -> Path:
    from vllm_omni_plugin.testing.tiny_models import build

    return build("qwen-image-edit", tiny_model_cache() / "qwen-image-edit")


@pytest.fixture(scope="module")
def spawn() -> multiprocessing.context.SpawnContext:
    """Child processes started fresh (no fork of a process holding engines, sockets and segments)."""
    return multiprocessing.get_context("spawn")
