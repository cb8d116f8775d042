"""LoRA adapters per request on the diffusion stage: a request with an adapter gives the image diffusers
gives with that adapter loaded (PEFT) and set to its scale; a batch of requests with different adapters
and none gives each row the image it gets alone; the adapters a replica holds are bounded (least recently
used out); an adapter that is no LoRA of the model is refused naming why. Then served: start-up adapters,
loading, listing, using, unloading and using after unloading through HTTP, and a bad adapter at start-up.

Adapters are tiny random ones in diffusers' format, built here (``tiny_models/lora.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from helpers import serve_model
from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner
from vllm_omni_plugin.diffusion.lora import LoadedAdapters, LoraError, LoraSpec, check_lora, read_lora
from vllm_omni_plugin.diffusion.params import DiffusionRequest
from vllm_omni_plugin.tiny_models.lora import FILE, build_lora
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.forks import VllmForks
from vllm_omni_testkit.harness.server import ServerProcess, cpu_test_env, free_port

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

SIZE, STEPS, GUIDANCE = 64, 4, 2.0
FAMILIES = ("sd3", "flux", "qwen_image")


def generation(request_id: str, seed: int, lora: LoraSpec | None = None) -> DiffusionRequest:
    return DiffusionRequest(request_id=request_id, prompt=f"a lantern {seed}", height=SIZE, width=SIZE, seed=seed,
                            num_inference_steps=STEPS, guidance_scale=GUIDANCE, lora=lora)  # fmt: skip


def run(runner: Any, *requests: DiffusionRequest) -> list[np.ndarray]:
    import torch

    for r in requests:  # as the engine does before it runs a batch
        runner.validate(r)
    return runner.run(list(requests), [torch.Generator().manual_seed(r.seed or 0) for r in requests]).images


def assert_within_one_level(a: np.ndarray, b: np.ndarray) -> None:
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= 1, diff.max()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two adapters per tiny model, built once."""
    built: dict[tuple[str, str], Path] = {}

    def get(model: Path, name: str) -> Path:
        if (str(model), name) not in built:
            folder = tmp_path_factory.mktemp(f"lora_{name}")
            built[str(model), name] = build_lora(model, folder, seed=1 if name == "a" else 2)
        return built[str(model), name]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_gives_the_image_diffusers_gives_with_it_loaded(
    request: pytest.FixtureRequest, adapters: Any, family: str
) -> None:
    import torch

    from vllm_omni_testkit.reference.diffusers import reference_image

    model = request.getfixturevalue(f"tiny_{family}")
    runner = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu")
    a, b = adapters(model, "a"), adapters(model, "b")
    spec_a, spec_b = LoraSpec(name="a", path=str(a), scale=0.8), LoraSpec(name="b", path=str(b), scale=1.0)
    reference = {"prompt": "a lantern 0", "seed": 0, "height": SIZE, "width": SIZE, "steps": STEPS,
                 "guidance": GUIDANCE}  # fmt: skip
    (with_a,) = run(runner, generation("a", 0, spec_a))
    expected = reference_image(model, **reference, lora=("a", str(a), 0.8))
    np.testing.assert_array_equal(with_a, expected)
    (plain,) = run(runner, generation("plain", 0))
    np.testing.assert_array_equal(plain, reference_image(model, **reference))
    assert np.abs(plain.astype(np.int16) - with_a.astype(np.int16)).mean() > 1  # the adapter acts

    # one batch of A, B and none: each row its own adapter, the image it gets alone
    alone = [
        run(runner, r)[0]
        for r in (generation("x", 1, spec_a), generation("y", 2, spec_b), generation("z", 3))
    ]
    mixed = run(runner, generation("x", 1, spec_a), generation("y", 2, spec_b), generation("z", 3))
    for got, want in zip(mixed, alone, strict=True):
        assert_within_one_level(got, want)


def test_glm_image_dit_applies_adapters_per_row(tiny_glm_image: Path, adapters: Any) -> None:
    """GLM-Image's pipeline has no LoRA loader in diffusers: its reference is the adapter merged into the
    DiT's weights (W + scale B A), which a row with the adapter must match."""
    import msgspec
    import torch

    from test_step_batching import ask

    runner = load_pipeline_runner(str(tiny_glm_image), dtype=torch.float32, device="cpu")
    a = adapters(tiny_glm_image, "a")
    spec = LoraSpec(name="a", path=str(a), scale=0.7)
    first, second = ask("g1", 1, family="glm_image"), ask("g2", 2, family="glm_image")
    with_a = msgspec.structs.replace(first, lora=spec)
    got = run(runner, with_a, second)
    (plain_second,) = run(runner, second)
    assert_within_one_level(got[1], plain_second)
    weights = read_lora("a", str(a))
    modules = dict(runner.pipe.transformer.named_modules())
    saved = {m: modules[m].weight.detach().clone() for m in weights.layers}
    try:
        with torch.no_grad():
            for m, layer in weights.layers.items():
                modules[m].weight += (layer.up @ layer.down) * layer.scaling * 0.7
        (merged,) = run(runner, first)
    finally:
        with torch.no_grad():
            for m, weight in saved.items():
                modules[m].weight.copy_(weight)
    assert_within_one_level(got[0], merged)


def test_the_adapters_a_replica_holds_are_bounded(tiny_sd3: Path, adapters: Any) -> None:
    import torch

    runner = load_pipeline_runner(str(tiny_sd3), dtype=torch.float32, device="cpu")
    held = LoadedAdapters(runner.pipe.transformer, capacity=1)
    a = LoraSpec(name="a", path=str(adapters(tiny_sd3, "a")))
    b = LoraSpec(name="b", path=str(adapters(tiny_sd3, "b")))
    first = held.get(a)
    assert held.names == ["a"] and held.get(a) is first
    held.get(b)
    assert held.names == ["b"]  # a left
    assert held.get(a) is not first and held.names == ["a"]  # loaded again when asked


def test_files_that_are_no_lora_of_the_model_are_refused_naming_why(
    tiny_sd3: Path, tiny_flux: Path, adapters: Any, tmp_path: Path
) -> None:
    import torch

    from vllm_omni_plugin.diffusion.lora import denoiser_skeleton

    good = adapters(tiny_sd3, "a")
    tensors = load_file(str(good / FILE))
    skeleton = denoiser_skeleton(str(tiny_sd3))

    def refused(name: str, changed: dict[str, Any] | None = None, raw: bytes | None = None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        if raw is not None:
            (folder / FILE).write_bytes(raw)
        else:
            save_file(changed, str(folder / FILE))
        with pytest.raises(LoraError) as caught:
            check_lora(read_lora(name, str(folder)), skeleton)
        return str(caught.value)

    assert "not a safetensors file" in refused("text", raw=b"this is no adapter")
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    assert "ranks differ" in refused("rank", {**tensors, key: torch.zeros(8, tensors[key].shape[1])})
    module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
    down = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    assert f"{module} maps" in refused("shape", {**tensors, key: down})
    moved = {k.replace("transformer_blocks.0.", "transformer_blocks.99."): v for k, v in tensors.items()}
    assert "is no layer of this model's SD3Transformer2DModel" in refused("target", moved)
    text = {k.replace("transformer.", "text_encoder.", 1): v for k, v in tensors.items()}
    assert "text-encoder LoRAs are not served" in refused("text_encoder", text)
    with pytest.raises(LoraError, match="no such LoRA file"):
        read_lora("gone", str(tmp_path / "missing"))
    # FLUX's adapter on SD3: layers of another shape or name
    flux = adapters(tiny_flux, "a")
    with pytest.raises(LoraError, match="maps|no layer"):
        check_lora(read_lora("flux", str(flux)), skeleton)


# --- served ------------------------------------------------------------------------------------------

DEPLOY = """
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 4
    num_inference_steps: 4
    max_loras: 2
"""


@pytest.fixture(scope="module")
def served(
    tiny_sd3: Path, adapters: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("lora_served")
    (directory / "deploy.yaml").write_text(DEPLOY)
    extra = ("--served-model-name", "sd3", "--lora-modules", f"ink={adapters(tiny_sd3, 'a')}")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    yield from serve_model(tiny_sd3, directory / "deploy.yaml", directory, *extra, env=env)


def image_of(response: httpx.Response) -> np.ndarray:
    import base64
    import io

    from PIL import Image

    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.server
def test_adapters_served_loaded_listed_used_and_unloaded(
    served: ServerProcess, tiny_sd3: Path, adapters: Any
) -> None:
    from vllm_omni_testkit.reference.diffusers import reference_image

    url = served.base_url
    body = {"prompt": "a lantern 0", "size": "64x64", "seed": 0, "num_inference_steps": STEPS,
            "guidance_scale": GUIDANCE}  # fmt: skip
    ink = adapters(tiny_sd3, "a")
    reference = {"prompt": "a lantern 0", "seed": 0, "height": SIZE, "width": SIZE, "steps": STEPS,
                 "guidance": GUIDANCE}  # fmt: skip
    by_field = image_of(
        http_client.post(url + "/v1/images/generations", json={**body, "lora": "ink"}, timeout=300)
    )
    np.testing.assert_array_equal(
        by_field, reference_image(tiny_sd3, **reference, lora=("ink", str(ink), 1.0))
    )
    by_model = image_of(
        http_client.post(url + "/v1/images/generations", json={**body, "model": "ink"}, timeout=300)
    )
    np.testing.assert_array_equal(by_model, by_field)

    wash = adapters(tiny_sd3, "b")
    loaded = http_client.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "wash", "lora_path": str(wash)}, timeout=60
    )
    assert loaded.status_code == 200 and "wash" in loaded.text
    models = {m["id"]: m for m in http_client.get(url + "/v1/models", timeout=30).json()["data"]}
    assert set(models) == {"sd3", "ink", "wash"} and models["wash"]["parent"] == "sd3"
    scaled = {**body, "lora": {"name": "wash", "scale": 0.5}}
    np.testing.assert_array_equal(
        image_of(http_client.post(url + "/v1/images/generations", json=scaled, timeout=300)),
        reference_image(tiny_sd3, **reference, lora=("wash", str(wash), 0.5)),
    )
    again = http_client.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "wash", "lora_path": str(wash)}, timeout=60
    )
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = ink.parent / "not_a_lora.safetensors"
    bad.write_bytes(b"nothing")
    refused = http_client.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, timeout=60
    )
    assert refused.status_code == 400 and "not a safetensors file" in refused.json()["error"]["message"]

    # one batch of ink, wash and none (held behind a blocker until all three wait): each its image alone
    asks = [{**body, "seed": 3, "lora": "ink"}, {**body, "seed": 4, "lora": {"name": "wash", "scale": 0.5}},
            {**body, "seed": 5}]  # fmt: skip
    alone = [image_of(http_client.post(url + "/v1/images/generations", json=a, timeout=300)) for a in asks]
    batched = asyncio.run(one_batch(served, asks))
    for got, want in zip(batched, alone, strict=True):
        assert_within_one_level(got, want)

    gone = http_client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "wash"}, timeout=60)
    assert gone.status_code == 200
    after = http_client.post(url + "/v1/images/generations", json=scaled, timeout=300)
    assert (
        after.status_code == 400
        and "no LoRA adapter named 'wash' (loaded: ink)" in after.json()["error"]["message"]
    )
    unknown = http_client.post(url + "/v1/unload_lora_adapter", json={"lora_name": "wash"}, timeout=60)
    assert unknown.status_code == 404
    assert (
        http_client.post(
            url + "/v1/images/generations", json={**body, "model": "wash"}, timeout=60
        ).status_code
        == 404
    )


async def one_batch(server: ServerProcess, asks: list[dict[str, Any]]) -> list[np.ndarray]:
    """``asks`` run as one batch: queued while a blocker holds the stage, released together."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        with server.hold("dit.step") as hold:
            blocker = asyncio.ensure_future(
                client.post("/v1/images/generations", json={"prompt": "hold", "size": "64x64"})
            )
            await asyncio.to_thread(hold.wait, alive=server.alive)
            work = [asyncio.ensure_future(client.post("/v1/images/generations", json=a)) for a in asks]
            while server.metric("omni_stage_queue_depth", stage="0", name="diffusion") < len(asks) + 1:
                await asyncio.sleep(0.05)
        (await blocker).raise_for_status()
        return [image_of(response) for response in await asyncio.gather(*work)]


@pytest.mark.server
def test_a_bad_start_up_adapter_is_one_line_and_exit_2(
    tiny_sd3: Path, tmp_path: Path, vllm_cli: VllmForks
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nothing")
    argv = ["serve", str(tiny_sd3), "--omni", "--port", str(free_port()), "--lora-modules", f"bad={bad}"]
    done = vllm_cli.run(*argv, env=cpu_test_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: --lora-modules: LoRA 'bad': {bad} is not a safetensors file" in done.stderr
    assert "Traceback" not in done.stderr
