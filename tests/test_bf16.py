"""bf16 end to end on CPU: the tiny GLM-Image and the tiny BAGEL served through the stock ``vllm`` script
with the deploy's top-level ``dtype: bfloat16`` (every stage: AR / thinker with its vision encoders, DiT,
VAE), as ``deploy/glm_image.yaml`` and ``deploy/bagel.yaml`` run the real models, one server per model, and
their images compared with bf16 runs of the independent references.

What bf16 lets a test compare, measured on these models (64x64 images, differences in 1/255):

- bf16 keeps 8 significant bits. Two code paths that round at different points differ by about one bf16
  step (2^-8 relative) in most activations, and the denoising loop and the decoder carry that to the
  pixels: about one level on average. Two such paths differ as much from each other as either does from
  fp32, so only a path that shares the reference's arithmetic op for op can be held to a tight tolerance:
  GLM-Image's DiT is diffusers' pipeline on both sides (bit-equal in bf16, where an fp32 DiT given the same
  tokens is 0.6-0.7 levels off on average, 5-7 at most); BAGEL's thinker and DiT are implementations of
  their own, held within the bf16 noise of the reference and above a floor that only a DiT computing in
  bf16 clears.
- Greedy decoding in bf16 meets ties. The tiny GLM-Image's AR logits sit near 15, where bf16 steps are
  1/16, and about one token in ten has its runner-up within one step (some tie exactly). A text-to-image
  prior is 261 tokens (preview grid, large grid, end); the served AR leaves the reference's greedy path
  within its first hundred tokens, each time for the runner-up one bf16 step below, on every prompt tried.
  Text-to-image therefore compares the DiT given the same prior tokens, while an edit (5 tokens) is
  compared whole, AR tokens included, for a prompt whose 5 greedy choices lead by three bf16 steps or more.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from helpers import our_segments_left, source_image
from vllm_omni_testkit.harness.images import DATA_URI_PREFIX, pixels
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port

pytestmark = pytest.mark.server

DATA = Path(__file__).resolve().parent / "data"
SIZE = 64
SEED = 7
PROMPT = "a red fox in the snow"

GLM_DEPLOY = DATA / "tiny_glm_image_bf16.yaml"
GLM_MODEL = "tiny-glm-image-bf16"
GLM_STEPS = 4
GLM_GUIDANCE = 1.5
"""``tiny_glm_image_cpu.yaml``'s guidance scale, which the server applies."""
GLM_MAX_DIFF, GLM_MEAN_DIFF = 2, 0.1
"""GLM-Image against its bf16 reference: the same diffusers DiT given the same tokens rounds identically
(measured: equal); this leaves room for a few pixels that one rounding flips, and is far below what an fp32
DiT given the same tokens makes (measured: 0.6-0.7 on average, 5-7 at most; asserted below)."""
EDIT_PROMPTS = (
    "make it blue",
    "make it red",
    "add snow",
    "make it brighter",
    "a watercolour painting of it",
    "make it darker",
    "turn it into gold",
    "more contrast",
    "at night",
    "in autumn",
    "as a pencil sketch",
    "make it green",
)
MARGIN_STEPS = 3
"""bf16 steps by which each greedy token of the chosen edit leads its runner-up in the reference: vLLM's
kernels and the reference's round the logits differently by about one step (the t2i divergences were all
one step), so three keep the greedy choice the same on any machine."""

BAGEL_DEPLOY = DATA / "tiny_bagel_bf16.yaml"
BAGEL_MODEL = "tiny-bagel-bf16"
BAGEL_STEPS = 6
T2I = {"cfg_text_scale": 4.0, "cfg_img_scale": 1.0, "cfg_interval": (0.4, 1.0), "cfg_renorm_type": "global"}
EDIT = {
    "cfg_text_scale": 4.0,
    "cfg_img_scale": 2.0,
    "cfg_interval": (0.0, 1.0),
    "cfg_renorm_type": "text_channel",
}
"""BAGEL's authors' settings, which the server applies to text-to-image and to edits."""
BAGEL_MEAN_DIFF, BAGEL_P99_DIFF, BAGEL_MAX_DIFF = 2.5, 10, 20
"""BAGEL against its bf16 reference: two bf16 implementations differ by their rounding noise (measured over
three prompts and three edits: mean 0.64-1.35, 99th percentile 3-5, max 4-9), twice that here. A context read
from the wrong place or in the wrong dtype, or a different image, is tens of levels off."""
BAGEL_BF16_FLOOR = 0.35
"""The least mean difference between an image whose DiT computed in bf16 and the fp32 DiT given the same bf16
contexts: a bf16 DiT carries its rounding noise (measured 0.54-0.97), an fp32 DiT carries only the contexts'
differences, which it does not amplify (measured 0.06-0.17 with the served DiT in fp32). The thinker's
precision does not show: a bf16 DiT's own noise covers its contexts' (an fp32 thinker measured as bf16)."""


def serve(model: Path, deploy: Path, name: str, log_dir: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        [
            bin_script("vllm"), "serve", str(model), "--omni", "--deploy-config", str(deploy),
            "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name,
        ],
        port=port,
        log_path=log_dir / "server.log",
    )  # fmt: skip


@pytest.fixture(scope="module")
def servers(
    tiny_glm_image: Path, tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """Both models' servers, started together so that their start-ups overlap (on an AMX CPU the bf16
    thinker's KV cache is in the amx kernels' packed layout, which the handoff reads); stopped at the end of
    the module, leaving nothing in /dev/shm."""
    started: dict[str, ServerProcess] = {}
    watches: list[LeakWatch] = []

    def watched(server: ServerProcess) -> ServerProcess:
        server.start()
        assert server.proc is not None
        watches.append(LeakWatch(root=server.proc.pid).start())
        return server

    try:
        started["glm"] = watched(
            serve(tiny_glm_image, GLM_DEPLOY, GLM_MODEL, tmp_path_factory.mktemp("glm_bf16"))
        )
        logs = tmp_path_factory.mktemp("bagel_bf16")
        started["bagel"] = watched(serve(tiny_bagel, BAGEL_DEPLOY, BAGEL_MODEL, logs))
        yield started
    finally:
        for server in started.values():
            server.stop()
    assert [name for watch in watches for name in our_segments_left(watch)] == []


def client(servers: dict[str, ServerProcess], name: str) -> openai.OpenAI:
    """A client of the ``name`` server once it is ready."""
    server = servers[name]
    server.wait_ready(timeout=300)
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def differences(ours: np.ndarray, reference: np.ndarray) -> tuple[int, float, float]:
    """Max, mean and 99th percentile of the per-pixel difference, in 1/255."""
    assert ours.shape == reference.shape and ours.dtype == reference.dtype == np.uint8
    diff = np.abs(ours.astype(np.int16) - reference.astype(np.int16))
    return int(diff.max()), float(diff.mean()), float(np.percentile(diff, 99))


def glm_close(ours: np.ndarray, reference: np.ndarray) -> bool:
    top, mean, _ = differences(ours, reference)
    return top <= GLM_MAX_DIFF and mean <= GLM_MEAN_DIFF


# --- GLM-Image ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm_client(servers: dict[str, ServerProcess]) -> openai.OpenAI:
    return client(servers, "glm")


def bf16_step(value: Any) -> Any:
    """bf16's spacing at ``value`` (a tensor): 8 significant bits."""
    import torch

    return torch.exp2(torch.floor(torch.log2(value.abs())) - 7)


def clear_edit(model: Path, source: Image.Image) -> tuple[str, dict[str, Any]]:
    """The first of ``EDIT_PROMPTS`` whose greedy tokens (bf16 reference) each lead their runner-up by
    ``MARGIN_STEPS`` bf16 steps, and its reference prior."""
    from vllm_omni_testkit.reference.glm_image import glm_image_reference_prior_tokens

    for prompt in EDIT_PROMPTS:
        prior = glm_image_reference_prior_tokens(
            model, prompt, SIZE, SIZE, images=[source], seed=SEED, dtype="bfloat16"
        )
        top = prior["top_logits"]
        if bool((top[:, 0] - top[:, 1] >= MARGIN_STEPS * bf16_step(top[:, 0])).all()):
            return prompt, prior
    pytest.fail(f"no edit prompt's greedy tokens lead by {MARGIN_STEPS} bf16 steps: add prompts")


def test_glm_image_edit_equals_the_bf16_reference(glm_client: openai.OpenAI, tiny_glm_image: Path) -> None:
    """An edit through ``/v1/images/edits``: the AR (vision encoder, VQ, 5 greedy tokens) and the DiT in
    bf16, against transformers' AR and diffusers' DiT in bf16 (``GLM_MAX_DIFF``, ``GLM_MEAN_DIFF``).

    The source image's VQ ids come from bf16 distances, which tie often; both sides run the same torch ops on
    the same features and so break ties alike, as the equal images show."""
    from vllm_omni_testkit.reference.glm_image import glm_image_reference_image

    source = Image.fromarray(source_image(SIZE, seed=3))
    prompt, prior = clear_edit(tiny_glm_image, source)
    result = glm_client.images.edit(
        model=GLM_MODEL,
        image=("source.png", png(source), "image/png"),
        prompt=prompt,
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": SEED, "num_inference_steps": GLM_STEPS},
    )
    served = pixels(result.data[0].b64_json)
    common = {"images": [source], "seed": SEED, "num_inference_steps": GLM_STEPS, "prior": prior}
    expected = glm_image_reference_image(
        tiny_glm_image, prompt, SIZE, SIZE, guidance_scale=GLM_GUIDANCE, dtype="bfloat16", **common
    )
    assert glm_close(served, expected), (prompt, differences(served, expected))
    fp32_dit = glm_image_reference_image(
        tiny_glm_image, prompt, SIZE, SIZE, guidance_scale=GLM_GUIDANCE, dtype="float32", **common
    )
    # the tolerance tells a bf16 DiT from an fp32 one given the same tokens
    assert not glm_close(fp32_dit, expected), differences(fp32_dit, expected)


def test_glm_image_text_to_image_dit_equals_the_bf16_reference_given_its_prior(
    glm_client: openai.OpenAI, tiny_glm_image: Path
) -> None:
    """Text to image through ``/v1/images/generations`` in bf16, and the DiT stage's engine in bf16 given the
    reference's greedy prior, against diffusers' DiT in bf16 (``GLM_MAX_DIFF``, ``GLM_MEAN_DIFF``).

    The served image cannot be compared: its 261 AR tokens leave the reference's greedy path at a tie (module
    docstring), and then every later token and the image differ."""
    import torch

    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest
    from vllm_omni_testkit.reference.glm_image import (
        glm_image_reference_image,
        glm_image_reference_prior_tokens,
    )

    result = glm_client.images.generate(
        model=GLM_MODEL,
        prompt=PROMPT,
        size=f"{SIZE}x{SIZE}",
        extra_body={"seed": SEED, "num_inference_steps": GLM_STEPS},
    )
    served = pixels(result.data[0].b64_json)
    assert served.shape == (SIZE, SIZE, 3) and served.std() > 10  # an image, not a flat or broken one

    prior = glm_image_reference_prior_tokens(tiny_glm_image, PROMPT, SIZE, SIZE, seed=SEED, dtype="bfloat16")
    engine = DiffusionEngine(tiny_glm_image, DiffusionEngineConfig(dtype="bfloat16"))
    assert engine.dtype == torch.bfloat16
    [ours] = engine.generate(
        [
            GlmImageRequest(
                request_id="t2i", prompt=PROMPT, height=SIZE, width=SIZE, seed=SEED,
                num_inference_steps=GLM_STEPS, guidance_scale=GLM_GUIDANCE,
                prior_token_ids=prior["prior_token_ids"],
            )
        ]
    )  # fmt: skip
    assert ours.ok, ours.error
    common = {"seed": SEED, "num_inference_steps": GLM_STEPS, "guidance_scale": GLM_GUIDANCE, "prior": prior}
    expected = glm_image_reference_image(tiny_glm_image, PROMPT, SIZE, SIZE, dtype="bfloat16", **common)
    assert glm_close(ours.image, expected), differences(ours.image, expected)
    fp32_dit = glm_image_reference_image(tiny_glm_image, PROMPT, SIZE, SIZE, dtype="float32", **common)
    assert not glm_close(fp32_dit, expected), differences(fp32_dit, expected)


# --- BAGEL ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bagel_client(servers: dict[str, ServerProcess]) -> openai.OpenAI:
    return client(servers, "bagel")


@pytest.fixture(scope="module")
def bagel_references(tiny_bagel: Path) -> tuple[Any, Any]:
    """The independent BAGEL in bf16 and in fp32."""
    import torch

    from vllm_omni_testkit.reference.bagel import BagelReference

    return BagelReference(tiny_bagel, dtype=torch.bfloat16), BagelReference(tiny_bagel, dtype=torch.float32)


def check_bagel(served: np.ndarray, inputs: list[Any], settings: dict[str, Any], references: tuple) -> None:
    """``served`` within bf16 noise of the bf16 reference (``BAGEL_*_DIFF``), and at least
    ``BAGEL_BF16_FLOOR`` from the fp32 reference DiT given the bf16 reference's contexts, as the bf16
    reference itself is (else the reference would not be computing in bf16 either)."""
    bf16, fp32 = references
    expected = bf16.interleave(inputs, seed=SEED, num_inference_steps=BAGEL_STEPS, **settings)
    contexts = [
        fp32.context_from_kv(c.kv(), c.rope) for c in (expected.cond, expected.cfg_text, expected.cfg_img)
    ]
    guidance = {k: v for k, v in settings.items() if k not in ("height", "width")}
    fp32_dit = fp32.generate_image(
        *contexts, height=expected.height, width=expected.width, seed=SEED, num_inference_steps=BAGEL_STEPS,
        **guidance,
    )  # fmt: skip
    top, mean, p99 = differences(served, expected.image)
    assert mean <= BAGEL_MEAN_DIFF and p99 <= BAGEL_P99_DIFF and top <= BAGEL_MAX_DIFF, (top, mean, p99)
    assert differences(served, fp32_dit)[1] >= BAGEL_BF16_FLOOR, differences(served, fp32_dit)
    assert differences(expected.image, fp32_dit)[1] >= BAGEL_BF16_FLOOR, differences(expected.image, fp32_dit)


def test_bagel_text_to_image_in_bf16(bagel_client: openai.OpenAI, bagel_references: tuple) -> None:
    """Text to image through the chat endpoint: the thinker's context KV cache (bf16) handed to the DiT."""
    response = bagel_client.chat.completions.create(
        model=BAGEL_MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={
            "modalities": ["image"], "height": SIZE, "width": SIZE, "seed": SEED,
            "num_inference_steps": BAGEL_STEPS,
        },
    )  # fmt: skip
    url = response.choices[0].message.content[0]["image_url"]["url"]
    served = pixels(url.removeprefix(DATA_URI_PREFIX))
    check_bagel(served, [PROMPT], {"height": SIZE, "width": SIZE, **T2I}, bagel_references)


def test_bagel_edit_in_bf16(bagel_client: openai.OpenAI, bagel_references: tuple) -> None:
    """An edit through ``/v1/images/edits``: the source image's VAE and ViT blocks (bf16) in the thinker's
    contexts, the text-only companion context, the DiT's three-branch guidance in bf16."""
    source = Image.fromarray(np.random.default_rng(9).integers(0, 256, (48, SIZE, 3), dtype=np.uint8))
    result = bagel_client.images.edit(
        model=BAGEL_MODEL,
        image=("source.png", png(source), "image/png"),
        prompt="make it blue",
        extra_body={"seed": SEED, "num_inference_steps": BAGEL_STEPS},
    )
    served = pixels(result.data[0].b64_json)
    check_bagel(served, [source, "make it blue"], EDIT, bagel_references)
