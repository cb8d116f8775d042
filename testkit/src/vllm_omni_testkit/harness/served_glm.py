"""What ``vllm serve --omni`` makes of the tiny GLM-Image with its CPU deploy file, on this host: the
reference of the modules that serve the same model another way (a Ray cluster, Dynamo's workers, two
hosts, vLLM's V2 model runner) and must give the same pixels. Made once per test run by whichever worker
asks first, and read by the others from the run's shared temp directory: each of those modules used to
start a server of its own for the same images."""

from __future__ import annotations

import fcntl
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.images import chat_image, data_uri, pixels, png
from vllm_omni_testkit.harness.server import omni_server

GENERATION = {"prompt": "a red fox in the snow", "size": "64x64", "seed": 11, "num_inference_steps": 4}
"""The text-to-image request every such module sends (JSON body of ``/v1/images/generations``)."""
EDIT = {"prompt": "make it blue", "seed": "5", "num_inference_steps": "4"}
"""The edit's form fields (``/v1/images/edits``), with ``EDIT_SOURCES`` as its images."""
EDIT_SOURCES = [np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8) for seed in (1, 2)]
GREEDY_SOURCE = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
GREEDY = {
    "modalities": ["image"],
    "height": 64,
    "width": 64,
    "seed": 7,
    "num_inference_steps": 4,
    "temperature": 0.0,
}
"""The settings of the greedy chat requests (``/v1/chat/completions``; temperature 0 for the AR stage):
a model runner that samples otherwise (vLLM's V2) is compared on them."""


def greedy_chat(text: str, source: np.ndarray | None = None) -> dict[str, Any]:
    """A greedy chat request for an image: text to image, or an edit of ``source``."""
    content: Any = text
    if source is not None:
        content = [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_uri(source)}},
        ]
    return {"messages": [{"role": "user", "content": content}], **GREEDY}


GREEDY_GENERATION = greedy_chat("a red fox in the snow")
GREEDY_EDIT = greedy_chat("make it blue", GREEDY_SOURCE)
RUNNER_LINE = re.compile(r"AR stage on vLLM's (\S+) model runner")
"""The AR worker's start-up line naming the model runner it runs on."""


def chat_pixels(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    return chat_image(answer.json()["choices"][0]["message"]["content"])


def serve_reference(model: Path, deploy: Path, log_dir: Path) -> dict[str, np.ndarray]:
    """One local ``vllm serve --omni`` run of ``deploy``: the generation (``"generation"``), the two-image
    edit (``"edit"``), the greedy chat requests (``"greedy_generation"``, ``"greedy_edit"``) and the model
    runner its AR stage ran on (``"runner"``, e.g. ``V1``)."""
    with omni_server(model, deploy, log_dir / "vllm_serve.log", timeout=600) as server:
        made = http_client.post(server.base_url + "/v1/images/generations", json=GENERATION, timeout=300)
        assert made.status_code == 200, made.text
        files = [("image", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(EDIT_SOURCES)]
        edited = http_client.post(server.base_url + "/v1/images/edits", data=EDIT, files=files, timeout=300)
        assert edited.status_code == 200, edited.text
        chat = server.base_url + "/v1/chat/completions"
        greedy = {
            name: chat_pixels(http_client.post(chat, json=body, timeout=300))
            for name, body in (("greedy_generation", GREEDY_GENERATION), ("greedy_edit", GREEDY_EDIT))
        }
        (runner,) = set(RUNNER_LINE.findall(server.log_text()))
        return {
            "generation": pixels(made.json()["data"][0]["b64_json"]),
            "edit": pixels(edited.json()["data"][0]["b64_json"]),
            **greedy,
            "runner": np.array(runner),
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
