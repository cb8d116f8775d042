"""Quantized diffusion stages: a denoiser quantized by torchao (int8 and float8 weight-only, int8 dynamic)
or read from a GGUF file gives exactly the image diffusers' own quantized pipeline gives, within a stated
distance of the unquantized image, with its weights reported at their real size; per-request LoRA
adapters mixed in one batch on a quantized denoiser each give the image they give alone; step caching,
CFG parallelism and compiled blocks run on it; schemes the device or the runner cannot run are refused
in one line at configuration.

Distances on these tiny random-weight models (4 steps, 64x64, measured): int8 weight-only at most 8/255
from the unquantized image (mean under 1.1), int8 dynamic 14/255 (mean 1.9), float8 (e4m3, three
mantissa bits) weight-only 30/255 (mean 3.5), GGUF Q8_0 7/255 (mean 0.7). The bounds below leave some
room over those.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_omni_plugin.config.errors import ConfigError
from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, DiffusionRequest
from vllm_omni_plugin.diffusion.lora import LoraSpec
from vllm_omni_plugin.diffusion.quantization import QuantizationSpec, estimated_bytes
from vllm_omni_plugin.log import ROOT as ROOT_LOGGER
from vllm_omni_plugin.tiny_models.gguf_file import write_denoiser_gguf
from vllm_omni_plugin.tiny_models.lora import build_lora
from vllm_omni_testkit.reference.diffusers import reference_image

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.slow]

SIZE, STEPS, GUIDANCE = 64, 4, 2.0
DISTANCE = {"int8_weight_only": (12, 1.5), "int8_dynamic": (20, 2.5), "float8_weight_only": (40, 5.0),
            "gguf": (12, 1.5)}  # fmt: skip
"""(max, mean) distance in 1/255 levels from the unquantized image."""


def ask(request_id: str, seed: int, **kw: Any) -> DiffusionRequest:
    return DiffusionRequest(request_id=request_id, prompt=f"a lantern on a pier {seed}", height=SIZE,
                            width=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE, seed=seed, **kw)  # fmt: skip


def run(engine: DiffusionEngine, *requests: DiffusionRequest) -> list[np.ndarray]:
    results = engine.generate(list(requests))
    for r in results:
        assert r.error is None, r.error
    return [r.image for r in results]


def distance(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(diff.max()), float(diff.mean())


def engine(model: Path, quantization: Any = None, **config: Any) -> DiffusionEngine:
    spec = QuantizationSpec.of(quantization)
    return DiffusionEngine(model, DiffusionEngineConfig(max_batch_size=4, quantization=spec, **config))


@pytest.fixture(scope="module")
def gguf_flux(tiny_flux: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_denoiser_gguf(tiny_flux, tmp_path_factory.mktemp("gguf") / "flux-Q8_0.gguf")


@pytest.mark.parametrize(
    ("family", "scheme"),
    [
        ("sd3", "int8_weight_only"),
        ("flux", "int8_weight_only"),
        ("flux", "gguf"),
        ("qwen_image", "float8_weight_only"),
        ("sd3", "int8_dynamic"),
    ],  # fmt: skip
)
def test_a_quantized_denoiser_gives_diffusers_quantized_image_and_reports_its_bytes(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture, family: str, scheme: str
) -> None:
    model = request.getfixturevalue(f"tiny_{family}")
    if scheme == "gguf":
        gguf = request.getfixturevalue("gguf_flux")
        quantization: Any = {"denoiser": "gguf", "gguf_file": str(gguf)}
        quantized = f"gguf:{gguf}"
    else:
        quantization = quantized = scheme
    with caplog.at_level(logging.INFO, logger=ROOT_LOGGER):
        eng = engine(model, quantization)
    try:
        (got,) = run(eng, ask("q", 3))
        call = {"prompt": "a lantern on a pier 3", "seed": 3, "height": SIZE, "width": SIZE, "steps": STEPS,
                "guidance": GUIDANCE}  # fmt: skip
        np.testing.assert_array_equal(got, reference_image(model, **call, quantized=quantized))
        worst, mean = distance(got, reference_image(model, **call))
        bound = DISTANCE[scheme]
        assert 0 < worst <= bound[0] and mean <= bound[1], (worst, mean)

        # the stage counts the weights as they are held: each linear weight in a quarter of its bytes
        # (int8, float8, Q8_0's 34 bytes per 32 values) and its scales
        (denoiser,) = [w for w in eng.weights if w.name == "transformer"]
        linear = linear_weight_bytes(eng.runner.pipe.transformer)
        assert denoiser.quantized > 0
        assert denoiser.unquantized_bytes - denoiser.bytes >= 0.7 * linear
        if family in ("flux", "qwen_image"):  # denoisers of linears mostly, as the real ones are
            assert denoiser.bytes <= 0.55 * denoiser.unquantized_bytes
        assert eng.weight_bytes == sum(w.bytes for w in eng.weights)
        if scheme != "gguf":  # the estimate the GPU memory fit sizes deploy files with, from shapes alone
            import torch

            from vllm_omni_plugin.diffusion.diffusers_registry import load_pipeline_runner

            plain = load_pipeline_runner(str(model), dtype=torch.float32, device="cpu").pipe.transformer
            estimate = estimated_bytes({"transformer": plain}, QuantizationSpec.of(scheme), 4)
            assert estimate == denoiser.bytes
        logged = [r.getMessage() for r in caplog.records if "weights" in r.getMessage()]
        assert any(f"transformer {denoiser.bytes / (1 << 20):.1f} MiB ({denoiser.quantized} tensors quantized"
                   in line for line in logged), logged  # fmt: skip
    finally:
        eng.close()


def test_a_gguf_denoiser_written_here_serves_from_a_deploy_file(
    tiny_flux: Path, gguf_flux: Path, tmp_path: Path
) -> None:
    """The deploy file's ``quantization`` through the stage's own process: its image is diffusers' with the
    same GGUF denoiser."""
    import yaml

    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    deploy = tmp_path / "gguf.yaml"
    stage = {"stage_id": 0, "quantization": {"denoiser": "gguf", "gguf_file": str(gguf_flux)}}
    deploy.write_text(yaml.safe_dump({"pipeline": "diffusion", "stages": [stage]}))
    with Omni(str(tiny_flux), deploy_config=str(deploy)) as omni:
        (result,) = omni.generate([OmniRequest(prompt="a lantern on a pier 3", height=SIZE, width=SIZE, seed=3,
                                               num_inference_steps=STEPS, guidance_scale=GUIDANCE)])  # fmt: skip
    assert result.ok, result.error
    call = {"prompt": "a lantern on a pier 3", "seed": 3, "height": SIZE, "width": SIZE, "steps": STEPS,
            "guidance": GUIDANCE}  # fmt: skip
    np.testing.assert_array_equal(
        result.output.image, reference_image(tiny_flux, **call, quantized=f"gguf:{gguf_flux}")
    )


def linear_weight_bytes(module: Any) -> int:
    """What the denoiser's linear weights take in float32 (as the skeleton has them)."""
    import torch

    return sum(4 * m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_glm_image_dit_quantized_within_distance(tiny_glm_image: Path) -> None:
    """GLM-Image's DiT (its prior tokens from the AR stage, here the test's own) quantized int8: within the
    stated distance of the same request on the unquantized DiT."""
    from test_step_batching import ask as glm_ask

    plain, quantized = engine(tiny_glm_image), engine(tiny_glm_image, "int8_weight_only")
    try:
        request = glm_ask("g", 5, family="glm_image")
        (want,) = run(plain, request)
        (got,) = run(quantized, request)
        worst, mean = distance(got, want)
        assert 0 < worst <= DISTANCE["int8_weight_only"][0] and mean <= DISTANCE["int8_weight_only"][1]
        (denoiser,) = [w for w in quantized.weights if w.name == "transformer"]
        assert denoiser.unquantized_bytes - denoiser.bytes >= 0.7 * linear_weight_bytes(
            quantized.runner.pipe.transformer
        )
    finally:
        plain.close()
        quantized.close()


def test_lora_adapters_mixed_in_one_batch_on_a_quantized_denoiser(
    tiny_flux: Path, gguf_flux: Path, tmp_path: Path
) -> None:
    """Adapters A, B and none in one batch, on an int8 and on a GGUF denoiser: each row the image it gets
    alone on the same quantized model, and the adapter acts."""
    a = LoraSpec(name="a", path=str(build_lora(tiny_flux, tmp_path / "a", seed=1)), scale=0.8)
    b = LoraSpec(name="b", path=str(build_lora(tiny_flux, tmp_path / "b", seed=2)), scale=1.0)
    for quantization in ("int8_weight_only", {"denoiser": "gguf", "gguf_file": str(gguf_flux)}):
        eng = engine(tiny_flux, quantization, batching="request")
        try:
            rows = [ask("x", 1, lora=a), ask("y", 2, lora=b), ask("z", 3)]
            alone = [run(eng, r)[0] for r in rows]
            mixed = run(eng, *rows)
            assert all(r.batch_size == 3 for r in eng.generate(rows))
            for got, want in zip(mixed, alone, strict=True):
                assert distance(got, want)[0] <= 1
            (plain,) = run(eng, ask("x", 1))
            assert distance(plain, alone[0])[1] > 1  # the adapter acts
        finally:
            eng.close()


def test_step_cache_compile_parallelism_and_step_batching_run_on_a_quantized_denoiser(
    tiny_sd3: Path,
) -> None:
    """The stage's other features on an int8 denoiser: step caching skips blocks; compiled blocks, CFG-
    and sequence-parallel pairs of processes (the peer loads the denoiser quantized as rank 0's) and step
    batching each give the image of the plain quantized stage (the step loop's)."""
    from vllm_omni_plugin.diffusion.blocks import CompileSpec
    from vllm_omni_plugin.diffusion.step_cache import StepCacheSpec

    base = engine(tiny_sd3, "int8_weight_only")
    try:
        (want,) = run(base, ask("w", 4))
    finally:
        base.close()
    # cached steps skip the same blocks on the int8 denoiser as on the plain one, and the image stays
    # within the quantization's distance of the plain denoiser's cached image
    cache = StepCacheSpec(policy="fixed", compute_every=2, warmup_steps=1)
    images, counts = [], []
    for quantization in (None, "int8_weight_only"):
        cached = engine(tiny_sd3, quantization, cache=cache)
        try:
            images.append(run(cached, ask("w", 4))[0])
            counts.append(cached.counters().cached_blocks)
        finally:
            cached.close()
    assert counts[0] == counts[1] > 0
    worst, mean = distance(*images)
    assert worst <= DISTANCE["int8_weight_only"][0] and mean <= DISTANCE["int8_weight_only"][1]
    for config in (
        {"compile": CompileSpec(blocks=True, shapes="static", warmup_sizes=[])},
        {"cfg_parallel_size": 2, "batching": "request"},
        {"sequence_parallel_size": 2, "batching": "request"},
        {"batching": "step"},
    ):
        eng = engine(tiny_sd3, "int8_weight_only", **config)
        try:
            (got,) = run(eng, ask("w", 4))
            assert distance(got, want)[0] <= 1, config
        finally:
            eng.close()


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ("int3_weight_only", "Invalid enum value 'int3_weight_only'"),
        ("float8_dynamic", "float8_dynamic runs on CUDA GPUs of compute capability 8.9 or later, not on cpu"),
        ("int4_weight_only", "int4_weight_only runs on CUDA GPUs of compute capability 8.0 or later"),
        ({"denoiser": "gguf"}, "denoiser: gguf needs gguf_file"),
        (
            {"denoiser": "gguf", "gguf_file": "/nonexistent/flux.gguf"},
            "gguf_file /nonexistent/flux.gguf: no such file",
        ),
        ({"text_encoders": "gguf"}, "Invalid enum value 'gguf'"),
    ],  # fmt: skip
)
def test_schemes_this_stage_cannot_run_are_one_line_at_configuration(
    tiny_sd3: Path, tmp_path: Path, quantization: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        resolve(tiny_sd3, tmp_path, "diffusion", {"stage_id": 0, "quantization": quantization})
    text = str(raised.value)
    assert message in text and "quantization" in text and "Traceback" not in text, text


def test_runners_that_load_no_quantized_weights_say_so(tiny_bagel: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quantization is not available for bagel's diffusion runner"):
        resolve(tiny_bagel, tmp_path, "bagel", {"stage_id": 1, "quantization": "int8_weight_only"})
    with pytest.raises(ConfigError, match="an AR stage's quantization is vLLM's method name"):
        resolve(
            tiny_bagel, tmp_path, "bagel", {"stage_id": 0, "quantization": {"denoiser": "int8_weight_only"}}
        )
    # an AR stage's method is vLLM's engine argument; a diffusion stage's scheme its engine's
    ar = resolve(tiny_bagel, tmp_path, "bagel", {"stage_id": 0, "quantization": "fp8"}).stage(0)
    assert ar.engine_args["quantization"] == "fp8"


def test_a_diffusion_stage_hands_its_scheme_to_its_engine(tiny_sd3: Path, tmp_path: Path) -> None:
    stage = resolve(
        tiny_sd3, tmp_path, "diffusion", {"stage_id": 0, "quantization": "int8_weight_only"}
    ).stage(0)
    assert stage.diffusion_args["quantization"] == {"denoiser": "int8_weight_only"}
    config = DiffusionEngineConfig.from_args(
        {k: v for k, v in stage.diffusion_args.items() if k not in ("model", "worker_cls")}
    )
    assert config.quantization == QuantizationSpec(denoiser="int8_weight_only")


def resolve(model: Path, tmp_path: Path, pipeline: str, stage: dict[str, Any]) -> Any:
    import yaml

    from vllm_omni_plugin.config import PLATFORMS, resolve_deployment

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"pipeline": pipeline, "stages": [stage]}))
    return resolve_deployment(str(model), deploy_config=str(path), platform=PLATFORMS["cpu"])


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["float8_weight_only", "float8_dynamic", "int8_weight_only"])
def test_a_quantized_tiny_flux_stage_on_cuda(tiny_flux: Path, scheme: str) -> None:
    """``scripts/gpu_check.sh`` runs it: the stage's engine on the GPU in bfloat16, its denoiser quantized
    (float8 matmuls for ``float8_dynamic`` where the GPU has them, compute capability 8.9+): the image
    within the stated distance of the unquantized one on the same GPU, the denoiser's weights at most
    0.55x of its bfloat16 bytes. The numbers are printed for the check's log."""
    import torch

    if scheme == "float8_dynamic" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_dynamic needs compute capability 8.9+")
    config = {"dtype": "bfloat16", "max_batch_size": 4}
    plain = DiffusionEngine(tiny_flux, DiffusionEngineConfig(**config), device="cuda")
    try:
        want = run(plain, ask("c", 6), ask("d", 7))
    finally:
        plain.close()
    quantized = DiffusionEngine(
        tiny_flux, DiffusionEngineConfig(**config, quantization=QuantizationSpec.of(scheme)), device="cuda"
    )
    try:
        got = run(quantized, ask("c", 6), ask("d", 7))
        (denoiser,) = [w for w in quantized.weights if w.name == "transformer"]
    finally:
        quantized.close()
    bound = DISTANCE["float8_weight_only" if scheme.startswith("float8") else scheme]
    for a, b in zip(got, want, strict=True):
        worst, mean = distance(a, b)
        print(f"{scheme} on {torch.cuda.get_device_name()}: max {worst}, mean {mean:.2f}; "
              f"denoiser {denoiser.bytes} of {denoiser.unquantized_bytes} bytes")  # fmt: skip
        assert worst <= bound[0] and mean <= bound[1], (worst, mean)
    assert denoiser.quantized > 0 and denoiser.bytes <= 0.55 * denoiser.unquantized_bytes
