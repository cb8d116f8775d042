"""What ``vllm serve --omni`` makes of a tiny model with its stock CPU deploy file, on this host: the
reference of the modules that serve the same model another way (a Ray cluster, Dynamo's workers, two
hosts, vLLM's V2 model runner) and must give the same pixels. Made once per test run, by the module that
serves that deploy file anyway (``test_api_server.py``'s GLM-Image, ``test_bagel_server.py``'s BAGEL) or
else by a server of its own started by whichever worker asks first; the other workers read it from the
run's shared temp directory."""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.images import chat_image, data_uri, pixels, png
from vllm_omni_testkit.harness.server import ServerProcess, omni_server

if TYPE_CHECKING:
    import pytest

# --- GLM-Image ----------------------------------------------------------------------------------------------

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


def chat_pixels(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    return chat_image(answer.json()["choices"][0]["message"]["content"])


def glm_image_answers(server: ServerProcess) -> dict[str, np.ndarray]:
    """The generation (``"generation"``), the two-image edit (``"edit"``) and the greedy chat requests
    (``"greedy_generation"``, ``"greedy_edit"``)."""
    made = http_client.post(server.base_url + "/v1/images/generations", json=GENERATION, timeout=300)
    assert made.status_code == 200, made.text
    files = [("image", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(EDIT_SOURCES)]
    edited = http_client.post(server.base_url + "/v1/images/edits", data=EDIT, files=files, timeout=300)
    assert edited.status_code == 200, edited.text
    chat = server.base_url + "/v1/chat/completions"
    return {
        "generation": pixels(made.json()["data"][0]["b64_json"]),
        "edit": pixels(edited.json()["data"][0]["b64_json"]),
        **{
            name: chat_pixels(http_client.post(chat, json=body, timeout=300))
            for name, body in (("greedy_generation", GREEDY_GENERATION), ("greedy_edit", GREEDY_EDIT))
        },
    }


# --- BAGEL (its thinker greedy) -----------------------------------------------------------------------------

BAGEL_SETTINGS = {"modalities": ["image"], "height": 64, "width": 64, "num_inference_steps": 4}
BAGEL_EDIT_SOURCE = np.random.default_rng(9).integers(0, 256, (48, 64, 3), dtype=np.uint8)


def bagel_text_to_image(base_url: str) -> np.ndarray:
    body = {"messages": [{"role": "user", "content": "a red fox in the snow"}], **BAGEL_SETTINGS, "seed": 11}
    return chat_pixels(http_client.post(base_url + "/v1/chat/completions", json=body, timeout=600))


def bagel_edit(base_url: str) -> np.ndarray:
    """An edit (it keeps its source's 64x48)."""
    answer = http_client.post(
        base_url + "/v1/images/edits",
        data={"prompt": "make it blue", "seed": "7", "num_inference_steps": "4"},
        files=[("image", ("source.png", png(BAGEL_EDIT_SOURCE), "image/png"))],
        timeout=600,
    )
    assert answer.status_code == 200, answer.text
    return pixels(answer.json()["data"][0]["b64_json"])


def bagel_think(base_url: str) -> tuple[np.ndarray, str]:
    """Think mode: the image and the plan's text."""
    body = {"messages": [{"role": "user", "content": "a red fox"}], **BAGEL_SETTINGS, "seed": 3,
            "think": True, "max_think_tokens": 8}  # fmt: skip
    answer = http_client.post(base_url + "/v1/chat/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["message"]["content"]
    return chat_image(content), content[1]["text"]


def bagel_answers(server: ServerProcess) -> dict[str, np.ndarray]:
    image, plan = bagel_think(server.base_url)
    return {
        "text_to_image": bagel_text_to_image(server.base_url),
        "edit": bagel_edit(server.base_url),
        "think": image,
        "think_text": np.array(plan),
    }


# --- made once per run --------------------------------------------------------------------------------------

RUNNER_LINE = re.compile(r"AR stage on vLLM's (\S+) model runner")
"""The AR worker's start-up line naming the model runner it runs on."""


@dataclass(frozen=True)
class ServedReference:
    """A tiny model's answers from a server of its stock CPU deploy file, plus the model runner its AR
    stage ran on (``"runner"``, e.g. ``V1``)."""

    name: str
    deploy_file: str
    """Its file in the repository's ``deploy/``."""
    answers: Callable[[ServerProcess], dict[str, np.ndarray]]

    def of(self, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
        """Made from ``server`` (a server of the deploy file that a module runs anyway) unless this run
        has it already."""
        return self._made_once(tmp_path_factory, lambda: self._asked(server))

    def served(
        self, model: Path, repo: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> dict[str, np.ndarray]:
        """This run's reference, made by a server of its own when no module made it before."""

        def serve() -> dict[str, np.ndarray]:
            log = tmp_path_factory.mktemp(f"served_{self.name}") / "vllm_serve.log"
            with omni_server(model, repo / "deploy" / self.deploy_file, log, timeout=600) as server:
                return self._asked(server)

        return self._made_once(tmp_path_factory, serve)

    def _asked(self, server: ServerProcess) -> dict[str, np.ndarray]:
        answers = self.answers(server)
        (runner,) = set(RUNNER_LINE.findall(server.log_text()))
        return {**answers, "runner": np.array(runner)}

    def _made_once(
        self, tmp_path_factory: pytest.TempPathFactory, make: Callable[[], dict[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        """``make()``'s arrays, made by the run's first caller while the others wait, and read back by them
        (pytest's parallel workers of one run share their base temp directory's parent)."""
        base = tmp_path_factory.getbasetemp()
        directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"served_{self.name}"
        directory.mkdir(parents=True, exist_ok=True)
        saved = directory / "answers.npz"
        with open(directory / "answers.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if saved.exists():
                with np.load(saved) as loaded:
                    return {name: loaded[name] for name in loaded.files}
            answers = make()
            np.savez(saved, **answers)
            return answers


GLM_IMAGE = ServedReference("glm_image", "tiny_glm_image_cpu.yaml", glm_image_answers)
BAGEL = ServedReference("bagel", "tiny_bagel_cpu.yaml", bagel_answers)
