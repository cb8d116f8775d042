"""What ``vllm serve --omni`` makes of the tiny GLM-Image with its CPU deploy file, on this host: the
reference of the modules that serve the same model another way (a Ray cluster, Dynamo's workers, two
hosts) and must give the same pixels. Made once per test run by whichever worker asks first, and read by
the others from the run's shared temp directory: each of those modules used to start a server of its own
for the same image."""

from __future__ import annotations

import base64
import fcntl
import io
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from vllm_omni_testkit.harness.server import ServerProcess, bin_script, cpu_test_env, free_port

GENERATION = {"prompt": "a red fox in the snow", "size": "64x64", "seed": 11, "num_inference_steps": 4}
"""The text-to-image request every such module sends (JSON body of ``/v1/images/generations``)."""
EDIT = {"prompt": "make it blue", "seed": "5", "num_inference_steps": "4"}
"""The edit's form fields (``/v1/images/edits``), with ``EDIT_SOURCES`` as its images."""
EDIT_SOURCES = [np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8) for seed in (1, 2)]


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def serve_reference(model: Path, deploy: Path, log_dir: Path) -> dict[str, np.ndarray]:
    """One local ``vllm serve --omni`` run of ``deploy``: the generation (``"generation"``) and the
    two-image edit (``"edit"``)."""
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=log_dir / "vllm_serve.log", env=cpu_test_env()) as server:
        server.wait_ready(timeout=600)
        made = httpx.post(server.base_url + "/v1/images/generations", json=GENERATION, timeout=300)
        assert made.status_code == 200, made.text
        files = [("image", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(EDIT_SOURCES)]
        edited = httpx.post(server.base_url + "/v1/images/edits", data=EDIT, files=files, timeout=300)
        assert edited.status_code == 200, edited.text
        return {
            "generation": pixels(made.json()["data"][0]["b64_json"]),
            "edit": pixels(edited.json()["data"][0]["b64_json"]),
        }


def made_once(directory: Path, make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``make()``'s images, made by the first caller with this ``directory`` (pytest workers of one run
    share it) while the others wait, and read back by them."""
    directory.mkdir(parents=True, exist_ok=True)
    saved = directory / "images.npz"
    with open(directory / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if saved.exists():
            with np.load(saved) as loaded:
                return {name: loaded[name] for name in loaded.files}
        images = make()
        np.savez(saved, **images)
        return images
