"""The diffusion runner interface: every registered runner implements it, the wire carries each runner's
request type as a tagged union built from the registry, and no code asks a runner or an engine whether
it has a capability (an AST scan, as ``test_layout.py`` does for imports)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from vllm_omni_plugin.config.pipeline import registered_pipelines
from vllm_omni_plugin.diffusion.diffusers_registry import diffusers_runner_classes, load_pipeline_runner
from vllm_omni_plugin.diffusion.params import DiffusionRequest, RunnerRequest
from vllm_omni_plugin.diffusion.runner import DiffusionRunner, SizeLimits
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.families.bagel.request import T2I_DEFAULTS, BagelContext, BagelGenerationRequest
from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest
from vllm_omni_plugin.stage.core_types import (
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
    ToStageMessage,
    diffusion_request_types,
    to_stage_message_type,
)
from vllm_omni_plugin.stage.diffusion_core_proc import _refusal
from vllm_omni_plugin.stage.serialization import StageMessageCodec

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "vllm_omni_plugin"


def registered_runners() -> list[type]:
    named = [
        import_object(stage.diffusion_runner)
        for pipeline in registered_pipelines().values()
        for stage in pipeline.stages
        if stage.diffusion_runner
    ]
    return [*diffusers_runner_classes(), *named]


def test_every_registered_runner_implements_the_interface() -> None:
    runners = registered_runners()
    names = {runner.__name__ for runner in runners}
    assert {"DiffusersPipelineRunner", "GlmImageRunner", "QwenImageRunner", "BagelGenerationRunner"} <= names
    for runner in runners:
        assert issubclass(runner, DiffusionRunner), runner
        runner.__new__(runner)  # an abstract method left unimplemented raises TypeError here
        assert issubclass(runner.request_type, RunnerRequest), runner


def test_a_runner_missing_a_method_cannot_be_made() -> None:
    class Partial(DiffusionRunner):
        request_type = DiffusionRequest

        def validate(self, request: Any) -> None: ...

    with pytest.raises(TypeError, match="abstract"):
        Partial.__new__(Partial)


def test_the_wire_union_holds_each_runner_family_once() -> None:
    types = diffusion_request_types()
    assert set(types) == {DiffusionRequest, GlmImageRequest, BagelGenerationRequest}
    tags = [msgspec.inspect.type_info(t).tag for t in types]
    assert len(set(tags)) == len(tags) == 3


def wire_requests() -> list[RunnerRequest]:
    return [
        DiffusionRequest(
            request_id="d", prompt="a fox", height=64, width=64, images=[np.zeros((8, 8, 3), np.uint8)]
        ),
        GlmImageRequest(
            request_id="g", prompt="a fox", height=64, width=64, prior_token_ids=torch.arange(16)
        ),
        BagelGenerationRequest(
            request_id="b",
            cond=BagelContext(kv=torch.ones(2, 2, 3, 1, 4), kv_len=3, rope=3),
            cfg_text=BagelContext.empty(),
            height=32,
            width=32,
            sampling=T2I_DEFAULTS,
            seed=7,
        ),
    ]


@pytest.mark.parametrize("request_", wire_requests(), ids=lambda r: type(r).__name__)
def test_the_wire_codec_round_trips_each_request_type(request_: RunnerRequest) -> None:
    codec = StageMessageCodec(to_stage_message_type())
    message = StageDiffusionCoreRequest(request_id=request_.request_id, stage_id=1, diffusion=request_)
    decoded = codec.decode(codec.encode(message))
    assert type(decoded.diffusion) is type(request_)
    assert same(request_, decoded.diffusion)


def same(sent: Any, got: Any) -> bool:
    """Equal values, tensors and arrays compared by content and type, structs field by field."""
    if isinstance(sent, torch.Tensor):
        return isinstance(got, torch.Tensor) and sent.dtype == got.dtype and torch.equal(sent, got)
    if isinstance(sent, np.ndarray):
        return isinstance(got, np.ndarray) and sent.dtype == got.dtype and np.array_equal(sent, got)
    if isinstance(sent, msgspec.Struct):
        return type(sent) is type(got) and all(
            same(getattr(sent, f), getattr(got, f)) for f in sent.__struct_fields__
        )
    if isinstance(sent, list | tuple):
        return len(sent) == len(got) and all(same(a, b) for a, b in zip(sent, got, strict=True))
    return sent == got


def test_an_unknown_request_kind_is_refused_by_name() -> None:
    frame = msgspec.msgpack.encode(
        {
            "type": "diffusion_request",
            "request_id": "r",
            "stage_id": 1,
            "diffusion": {"kind": "nope", "request_id": "r"},
        }
    )
    with pytest.raises(
        msgspec.ValidationError, match=r"Invalid value 'nope' - at `\$\.diffusion\.kind`"
    ) as caught:
        StageMessageCodec(to_stage_message_type()).decode(frame)
    # the stage process answers it (a 400 at the client) instead of leaving it unanswered
    refusal = _refusal(StageMessageCodec(ToStageMessage), frame, caught.value, stage_id=1)
    assert isinstance(refusal, StageDiffusionCoreOutput)
    assert refusal.request_id == "r" and refusal.invalid
    assert "bad diffusion request: Invalid value 'nope'" in (refusal.error or "")


# --- no capability probing --------------------------------------------------------------------------

RUNNER_CAPABILITIES = {
    "request_type",
    "load",
    "label",
    "model_defaults",
    "prepare",
    "validate",
    "batch_key",
    "run",
    "on_step",
    "steps_of",
    "default_num_inference_steps",
    "default_guidance_scale",
    "weight_tensors",
    "activation_bytes",
    "describe_request",
    "on_progress",
    "denoise_steps",
    "pipeline_class",
}
"""What the runner interface and the engine declare: nobody asks whether they are there."""


def capability_probes(source: str) -> list[str]:
    """``getattr``/``hasattr`` calls that ask a runner or an engine for something (by the object's
    name, or by the name of what is asked)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        subject = ast.unparse(node.args[0]).lower()
        asked = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
        if "runner" in subject or "engine" in subject or asked in RUNNER_CAPABILITIES:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_a_probe() -> None:
    assert capability_probes("x = getattr(self.runner, 'anything', None)")
    assert capability_probes("if hasattr(engine, 'on_progress'): pass")
    assert capability_probes("f = getattr(obj, 'activation_bytes', None)")
    assert not capability_probes("s = getattr(pipe, 'default_sample_size', None)")


def test_no_runner_or_engine_capability_is_probed() -> None:
    offenders = []
    for folder in ("diffusion", "stage"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            offenders += [
                f"{path.relative_to(PACKAGE)}:{probe}" for probe in capability_probes(path.read_text())
            ]
    assert offenders == []


def test_the_engine_has_one_path_for_every_request_type() -> None:
    tree = ast.parse((PACKAGE / "diffusion" / "engine.py").read_text())
    branches = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and "Request" in ast.unparse(node.args[1])
    ]
    assert branches == []


# --- what a model's configs say, read without its weights ------------------------------------------


def test_the_generic_runner_reads_its_pipelines_defaults_and_sizes_from_configs(
    tiny_sd3: Path, tiny_flux: Path
) -> None:
    """What ``model_defaults`` reads on the meta device is what the loaded pipeline says."""
    sd3 = load_pipeline_runner(str(tiny_sd3), dtype=torch.float32, device="cpu")
    read = type(sd3).model_defaults(str(tiny_sd3))
    scale, config = sd3.pipe.vae_scale_factor, sd3.pipe.transformer.config
    side = sd3.pipe.default_sample_size * scale
    assert (read.defaults.height, read.defaults.width) == (side, side) == (256, 256)
    assert read.defaults.num_inference_steps == sd3.default_num_inference_steps
    assert read.defaults.guidance_scale == sd3.default_guidance_scale
    largest = config.pos_embed_max_size * config.patch_size * scale
    assert read.limits == SizeLimits(multiple=scale * config.patch_size, max_side=largest)
    assert largest == 1024 and read.label == "StableDiffusion3Pipeline"
    flux = load_pipeline_runner(str(tiny_flux), dtype=torch.float32, device="cpu")
    read = type(flux).model_defaults(str(tiny_flux))
    assert read.limits == SizeLimits(multiple=16, max_side=None)  # 2x2 packed latents, no table
    side = flux.pipe.default_sample_size * flux.pipe.vae_scale_factor
    assert (read.defaults.height, read.defaults.width) == (side, side)


def test_bagels_runner_declares_its_sizes(tiny_bagel: Path) -> None:
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner

    read = BagelGenerationRunner.model_defaults(str(tiny_bagel))
    runner = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")
    assert read.limits == SizeLimits(
        multiple=runner.cfg.latent_downsample, max_side=runner.cfg.max_image_side
    )
    assert read.defaults.height is None and read.defaults.num_inference_steps == 50  # the authors' steps
