"""Every shipped GPU deploy file fits the GPU its ``# GPU:`` comment names, computed here without a GPU.

The real configs of BAGEL-7B-MoT and GLM-Image (``tests/data/real_models/``) build the stages' models on
the meta device; per stage:

- weights: the AR stages' from our vLLM model classes (``engine_scripts/real_layouts.py``: their
  parameters), the diffusion stages' from the runners the stage loads (GLM-Image: diffusers'
  ``GlmImagePipeline`` of the real components; BAGEL: our generation transformer and decoder);
- AR KV cache: ``max_num_seqs`` sequences of ``max_model_len`` tokens (in 16-token blocks), from the
  layer and KV-head sizes of the real config: what the stage needs to run its whole batch unpreempted;
- AR activations: vLLM measures its profiling peak at start; approximated here by one decoder layer over
  ``max_num_batched_tokens`` tokens (5 hidden-wide and 3 intermediate-wide live tensors a token), the
  sampler's fp32 logits of ``max_num_seqs`` rows, or the multimodal encoders over their largest image,
  whichever is larger; plus what vLLM counts as non-torch memory (``AR_NON_TORCH``);
- diffusion activations: the runner's own estimate, the one the stage admits batches by
  (``activation_bytes``), for its largest request alone (the largest size the server accepts, and for
  BAGEL three contexts of the thinker's ``max_model_len``) and for a full batch (``max_batch_size``) of
  the stage's default request.

Per device, the budgets of the stages placed on it sum to at most 1.0 with room left for each process's
CUDA context and each graph-capturing AR engine's CUDA graphs (vLLM sizes its KV cache before capturing
them), and each stage's needs fit its budget. Raising a batch size or a ``max_model_len`` past what the
GPU holds fails here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ENGINE_SCRIPTS, run_result_script
from test_real_layouts import AE, BAGEL_LISTINGS, DATA, EMA, GLM_LISTINGS, bagel_dir  # noqa: F401 (fixture)
from vllm_omni_plugin.config import PLATFORMS, packaged_deploy_configs, resolve_deployment
from vllm_omni_plugin.config.resolved import ResolvedDeployment, ResolvedStage
from vllm_omni_plugin.diffusion.memory import (
    MemoryBudget,
    gib,
    tensor_bytes,
    vae_decode_bytes,
)
from vllm_omni_plugin.diffusion.quantization import QuantizationSpec, estimated_bytes

pytestmark = pytest.mark.slow

GIB = 1 << 30
GPU_MEMORY = {
    "24GB": int(22.0 * GIB),
    "48GB": int(44.0 * GIB),
    "80GB": int(79.0 * GIB),
    "H200": int(139.0 * GIB),
}
"""What CUDA reports as each named GPU's memory, rounded down: an L4 or A10G 22.0-22.5 GiB (an RTX 4090
23.6), an L40S 44.4 (an RTX A6000 47.5), A100 80GB and H100 80GB 79.2-79.3 GiB, an H200 139.8 GiB."""
CUDA_CONTEXT = 768 << 20
"""A process's CUDA context, kernels and library handles: outside the allocator, outside every budget."""
CUDA_GRAPHS = 1 << 30
"""An AR engine's captured CUDA graphs (vLLM's default capture sizes, a 7-9B model): vLLM sizes its KV
cache before capturing them, so they come on top of its budget."""
AR_NON_TORCH = 512 << 20
"""What vLLM counts inside its budget besides weights, KV cache and the profiled peak."""
BLOCK_TOKENS = 16
TYPICAL_PROMPT_TOKENS = 256
"""The context of a BAGEL text-to-image request (system prompt and a long prompt), for a full batch."""
GLM_PROMPT = 'a shop sign that says "' + "OPEN EVERY DAY " * 12 + '" above the door'
"""A GLM-Image prompt with 180 characters of glyph text (its glyph tokens join the DiT's sequence)."""
MAX_SIDE = 2048
"""The largest side the server accepts by default (``--image-max-size``). A file for a smaller GPU may
name a smaller one (``# Largest side: N``): larger images are then refused by its DiT's budget (400),
which the test checks too."""
GPU_FILES = {
    "glm_image.yaml": "glm_image",
    "glm_image_1gpu.yaml": "glm_image",
    "glm_image_nixl.yaml": "glm_image",
    "glm_image_ray.yaml": "glm_image",
    "bagel.yaml": "bagel",
    "bagel_think.yaml": "bagel",
    "bagel_h200.yaml": "bagel",
    "glm_image_48gb.yaml": "glm_image",
    "flux_dev_24gb.yaml": "flux_dev",
    "qwen_image_48gb.yaml": "qwen_image",
}
NOT_FOR_A_GPU = {"tiny_glm_image_cpu.yaml", "tiny_bagel_cpu.yaml", "diffusion.yaml"}
"""CPU files of the tiny models, and the template for any diffusers model (no model to size)."""


def test_every_packaged_deploy_file_is_sized_here_or_not_for_a_gpu() -> None:
    names = {p.name for p in packaged_deploy_configs()}
    assert names == set(GPU_FILES) | NOT_FOR_A_GPU, "size a new GPU deploy file in GPU_FILES"


def gpu_of(path: Path) -> tuple[str, int]:
    """The GPU a deploy file's ``# GPU: NAME (...)`` comment names, and its memory."""
    found = re.search(r"^# GPU: (\S+) \(", path.read_text(), re.MULTILINE)
    assert found, f"{path.name} names no GPU (a '# GPU: NAME (...)' comment)"
    assert found.group(1) in GPU_MEMORY, f"{path.name}: unknown GPU {found.group(1)!r}"
    return found.group(1), GPU_MEMORY[found.group(1)]


def largest_side(path: Path) -> int:
    """The largest image side a deploy file serves: its ``# Largest side: N`` comment, else ``MAX_SIDE``."""
    found = re.search(r"^# Largest side: (\d+)", path.read_text(), re.MULTILINE)
    return int(found.group(1)) if found else MAX_SIDE


# --- the models, on the meta device ---------------------------------------------------------------------


@dataclass(frozen=True)
class LlmShape:
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    sampled_vocab: int
    encoder_bytes: int
    """The multimodal encoders over their largest image (vLLM profiles them too)."""

    @property
    def kv_token_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # bfloat16

    def profile_peak(self, batched_tokens: int, seqs: int) -> int:
        decoder = batched_tokens * (5 * self.hidden + 3 * self.intermediate) * 2
        sampler = seqs * self.sampled_vocab * 4 * 3  # fp32 logits, probabilities, sorted for top-p/k
        return max(decoder + sampler, self.encoder_bytes)


@dataclass
class Models:
    ar_weights: dict[str, int] = field(default_factory=dict)
    llm: dict[str, LlmShape] = field(default_factory=dict)
    dit: dict[str, Any] = field(default_factory=dict)
    """The diffusion stage's runner of each pipeline, on the meta device."""
    model_dir: dict[str, str] = field(default_factory=dict)


def our_ar_weights(kind: str, model_dir: Path, listing: Path) -> int:
    """Bytes (bfloat16) of our vLLM model class built with the real config."""
    (load,) = run_result_script(
        ENGINE_SCRIPTS / "real_layouts.py", kind, str(model_dir), str(listing), timeout=900
    )
    assert load["error"] is None and load["missing"] == []
    return int(load["param_elements"]) * 2


def glm_image_models(models: Models) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline
    from transformers import ByT5Tokenizer

    from vllm_omni_plugin.families.glm_image.runner import GlmImageRunner

    encoder = DATA / "glm_image" / "vision_language_encoder"
    models.ar_weights["glm_image"] = our_ar_weights(
        "glm_image", encoder, GLM_LISTINGS / "vision_language_encoder.json"
    )
    config = json.loads((encoder / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    vision_peak = patches * (5 * vision["hidden_size"] + 3 * vision["intermediate_size"]) * 2
    models.llm["glm_image"] = LlmShape(
        layers=text["num_hidden_layers"], kv_heads=text["num_key_value_heads"],
        head_dim=text["hidden_size"] // text["num_attention_heads"], hidden=text["hidden_size"],
        intermediate=text["intermediate_size"], sampled_vocab=text["vision_vocab_size"], encoder_bytes=vision_peak,
    )  # fmt: skip

    import sys

    sys.path.insert(0, str(DATA))
    try:
        from generate_glm_image_weights import component_modules
    finally:
        sys.path.remove(str(DATA))
    parts = {
        k: v.to(torch.bfloat16) for k, v in component_modules().items() if k != "vision_language_encoder"
    }
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(), processor=None, text_encoder=parts["text_encoder"], vision_language_encoder=None,
        vae=parts["vae"], transformer=parts["transformer"], scheduler=FlowMatchEulerDiscreteScheduler(),
    )  # fmt: skip
    models.dit["glm_image"] = GlmImageRunner(pipe, device=torch.device("meta"), dtype=torch.bfloat16)
    models.model_dir["glm_image"] = str(DATA / "glm_image")


def real_config(model: str, component: str) -> dict[str, Any]:
    return json.loads((DATA / model / component / "config.json").read_text())


def bf16(parts: dict[str, Any]) -> dict[str, Any]:
    return {name: module.to(torch.bfloat16) for name, module in parts.items()}


def add_diffusers_pipeline(models: Models, name: str, pipe: Any) -> None:
    """The diffusion stage's runner of a diffusers pipeline built on the meta device."""
    from vllm_omni_plugin.diffusion.diffusers_registry import runner_class

    runner = runner_class(type(pipe).__name__)(pipe, device=torch.device("meta"), dtype=torch.bfloat16)
    models.dit[name] = runner
    models.model_dir[name] = str(DATA / name)


def flux_dev_models(models: Models) -> None:
    """FLUX.1-dev's pipeline from its real configs (``real_models/flux_dev``), on the meta device."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    def config(component: str) -> dict[str, Any]:
        return real_config("flux_dev", component)

    with torch.device("meta"):
        parts = {
            "text_encoder": CLIPTextModel(CLIPTextConfig(**config("text_encoder"))),
            "text_encoder_2": T5EncoderModel(T5Config(**config("text_encoder_2"))),
            "transformer": FluxTransformer2DModel.from_config(config("transformer")),
            "vae": AutoencoderKL.from_config(config("vae")),
        }
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=None, tokenizer_2=None, **bf16(parts)
    )
    add_diffusers_pipeline(models, "flux_dev", pipe)


def qwen_image_models(models: Models, tokenizer_dir: Path) -> None:
    """Qwen-Image's pipeline from its real configs (``real_models/qwen_image``), on the meta device. Its
    runner counts prompt tokens with a tokenizer (the tiny model's, of the same class): the requests
    sized here carry the longest prompt served (``prompt_token_limit``), whatever the vocabulary."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    def config(component: str) -> dict[str, Any]:
        return real_config("qwen_image", component)

    with torch.device("meta"):
        parts = {
            "text_encoder": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config("text_encoder"))),
            "transformer": QwenImageTransformer2DModel.from_config(config("transformer")),
            "vae": AutoencoderKLQwenImage.from_config(config("vae")),
        }
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer, **bf16(parts))
    add_diffusers_pipeline(models, "qwen_image", pipe)


def bagel_models(models: Models, folder: Path) -> None:
    from vllm_omni_plugin.families.bagel.runner import BagelGenerationRunner
    from vllm_omni_plugin.families.bagel.transformer import GenerationTransformer
    from vllm_omni_plugin.models.bagel.autoencoder import load_vae_decoder
    from vllm_omni_plugin.models.bagel.config import load_bagel_config
    from vllm_omni_plugin.models.bagel.weights import CheckpointReader

    models.ar_weights["bagel"] = our_ar_weights("bagel", folder, BAGEL_LISTINGS / f"{EMA}.json")
    cfg = load_bagel_config(folder)
    llm, vit = cfg.llm, cfg.vit
    vit_tokens = (cfg.vit_max_num_patch_per_side) ** 2
    vit_peak = vit_tokens * (5 * vit.hidden_size + 3 * vit.intermediate_size) * 2
    vae_encoder = vae_decode_bytes(1, cfg.max_image_side**2, cfg.vae.ch * cfg.vae.ch_mult[0], 2)
    models.llm["bagel"] = LlmShape(
        layers=llm.num_layers, kv_heads=llm.num_kv_heads, head_dim=llm.head_dim, hidden=llm.hidden_size,
        intermediate=llm.intermediate_size, sampled_vocab=llm.vocab_size, encoder_bytes=max(vit_peak, vae_encoder),
    )  # fmt: skip
    meta = torch.device("meta")
    with CheckpointReader(cfg.llm_weights) as reader:
        transformer = GenerationTransformer.load(cfg, reader, dtype=torch.bfloat16, device=meta)
    with CheckpointReader(cfg.vae_weights) as reader:
        decoder = load_vae_decoder(reader, cfg.vae, dtype=torch.bfloat16, device=meta)
    models.dit["bagel"] = BagelGenerationRunner(cfg, transformer, decoder, tensors_read={})
    models.model_dir["bagel"] = str(folder)


@pytest.fixture(scope="module")
def models(bagel_dir: Path, tiny_qwen_image: Path) -> Models:  # noqa: F811 (the fixture imported above)
    found = Models()
    glm_image_models(found)
    bagel_models(found, bagel_dir)
    flux_dev_models(found)
    qwen_image_models(found, tiny_qwen_image / "tokenizer")
    return found


def test_the_real_models_weigh_what_their_checkpoints_hold(models: Models) -> None:
    """The weights this file sizes with are the released models' (bfloat16): GLM-Image's AR 10.1 B
    parameters, its DiT stage 6.9 B + the glyph encoder + the VAE; BAGEL's thinker 14.6 B less the DiT's
    heads, its DiT both experts of every layer and the decoder (24.5 GiB)."""
    assert round(models.ar_weights["glm_image"] / GIB, 1) == 18.8
    assert round(tensor_bytes(models.dit["glm_image"].weight_tensors()) / GIB, 1) == 13.5
    assert round(models.ar_weights["bagel"] / GIB, 1) == 27.2
    assert round(tensor_bytes(models.dit["bagel"].weight_tensors()) / GIB, 1) == 24.5
    flux = models.dit["flux_dev"].pipe
    # FLUX.1-dev: its DiT 11.9 B parameters, T5-XXL's encoder 4.76 B, CLIP-L's text model 123 M
    assert round(sum(p.numel() for p in flux.transformer.parameters()) / 1e9, 1) == 11.9
    assert round(sum(p.numel() for p in flux.text_encoder_2.parameters()) / 1e9, 2) == 4.76
    assert round(sum(p.numel() for p in flux.text_encoder.parameters()) / 1e6) == 123
    qwen = models.dit["qwen_image"].pipe
    # Qwen-Image: its DiT 20.4 B parameters, its text encoder (Qwen2.5-VL-7B, vision tower and head) 8.29 B
    assert round(sum(p.numel() for p in qwen.transformer.parameters()) / 1e9, 1) == 20.4
    assert round(sum(p.numel() for p in qwen.text_encoder.parameters()) / 1e9, 2) == 8.29


# --- the requests a diffusion stage must hold ------------------------------------------------------------


def glm_requests(stage: ResolvedStage, side: int = MAX_SIDE) -> tuple[list[Any], list[list[Any]]]:
    """(the largest requests, each alone; a full batch of the stage's default request)."""
    from vllm_omni_plugin.families.glm_image.runner import GlmImageRequest

    args = stage.diffusion_args

    def request(size: int, *, source: int = 0) -> GlmImageRequest:
        grid = [[1, source // 16, source // 16]] if source else None
        return GlmImageRequest(request_id="r", prompt=GLM_PROMPT, height=size, width=size,
                                guidance_scale=args.get("guidance_scale", 1.5), source_image_grid_thw=grid)  # fmt: skip

    default = request(args.get("height", 1024))
    return [request(side), request(side, source=side)], [[default] * args["max_batch_size"]]


def diffusers_requests(
    stage: ResolvedStage, runner: Any, side: int = MAX_SIDE
) -> tuple[list[Any], list[list[Any]]]:
    """A text-to-image model's: the largest image alone, a full batch of the stage's default size; each
    with the longest prompt the runner takes where it counts them (else ``GLM_PROMPT``)."""
    from vllm_omni_plugin.diffusion.params import DiffusionRequest

    args = stage.diffusion_args

    def request(size: int, prompt: str = GLM_PROMPT) -> DiffusionRequest:
        return DiffusionRequest(request_id="r", prompt=prompt, height=size, width=size,
                                guidance_scale=args.get("guidance_scale", 3.5))  # fmt: skip

    limit = runner.prompt_token_limit
    if limit is not None and hasattr(runner, "prompt_length"):
        words = GLM_PROMPT
        while runner.prompt_length(request(side, words + " " + GLM_PROMPT)) <= limit:
            words += " " + GLM_PROMPT
        return [request(side, words)], [[request(args.get("height", 1024), words)] * args["max_batch_size"]]

    return [request(side)], [[request(args.get("height", 1024))] * args["max_batch_size"]]


def bagel_requests(
    stage: ResolvedStage, thinker: ResolvedStage, runner: Any
) -> tuple[list[Any], list[list[Any]]]:
    from vllm_omni_plugin.families.bagel.request import (
        EDIT_DEFAULTS,
        T2I_DEFAULTS,
        BagelContext,
        BagelGenerationRequest,
    )

    side, longest = runner.cfg.max_image_side, thinker.engine_args["max_model_len"]

    def context(length: int, **kw: Any) -> BagelContext:
        return BagelContext(kv_len=length, rope=length, **kw)

    edit = BagelGenerationRequest(request_id="edit", cond=context(longest), cfg_text=context(longest - 1),
                                  cfg_img=context(longest - 2), height=side, width=side, sampling=EDIT_DEFAULTS)  # fmt: skip
    t2i_long = BagelGenerationRequest(request_id="t2i", cond=context(longest), cfg_text=context(0),
                                      cfg_img=context(longest, prefix_of="cond"), height=side, width=side,
                                      sampling=T2I_DEFAULTS)  # fmt: skip
    t2i = BagelGenerationRequest(request_id="t2i", cond=context(TYPICAL_PROMPT_TOKENS), cfg_text=context(0),
                                 cfg_img=context(TYPICAL_PROMPT_TOKENS, prefix_of="cond"), height=side, width=side,
                                 sampling=T2I_DEFAULTS)  # fmt: skip
    return [edit, t2i_long], [[t2i] * stage.diffusion_args["max_batch_size"]]


# --- placing and sizing the stages ----------------------------------------------------------------------


@dataclass
class Need:
    stage: str
    fraction: float
    needs: int
    """Bytes the stage needs within its budget."""
    outside: int
    """Bytes it needs on its device outside its budget."""
    detail: str
    refused: bool = True
    """A DiT stage's budget refuses (400) a request of the default largest side (``MAX_SIDE``) alone."""


def device_keys(resolved: ResolvedDeployment, stage: ResolvedStage) -> list[str]:
    """The GPU each replica of the stage uses: its host (the head, a headless worker, its own Ray node)
    and device."""
    keys = []
    for replica in stage.replicas:
        if resolved.backend == "ray":
            keys.append(f"ray node of stage {stage.stage_id} replica {replica.replica_id}: GPU 0")
        else:
            host = "worker" if stage.headless else "head"
            keys.append(f"{host}: GPU {(replica.devices or '0').split(',')[0]}")
    return keys


def ar_need(stage: ResolvedStage, shape: LlmShape, weights: int, gpu: int) -> Need:
    args = stage.engine_args
    seqs, length = args["max_num_seqs"], args["max_model_len"]
    batched = args.get("max_num_batched_tokens", 16384)  # vLLM's largest default on these GPUs
    kv = seqs * math.ceil(length / BLOCK_TOKENS) * BLOCK_TOKENS * shape.kv_token_bytes
    peak = shape.profile_peak(batched, seqs)
    fraction = args.get("gpu_memory_utilization", 0.9)
    left = int(fraction * gpu) - weights - peak - AR_NON_TORCH
    detail = (
        f"{stage.name}: {fraction:g} of the GPU = {gib(fraction * gpu)}: weights {gib(weights)}, profiling peak "
        f"{gib(peak)} ({batched} tokens), KV cache {gib(left)} for {seqs} x {length} tokens needing {gib(kv)}"
    )
    outside = CUDA_CONTEXT + (0 if args["enforce_eager"] else CUDA_GRAPHS)
    return Need(stage.name, fraction, weights + peak + AR_NON_TORCH + kv, outside, detail)


def dit_need(
    stage: ResolvedStage,
    runner: Any,
    largest: list[Any],
    batches: list[list[Any]],
    gpu: int,
    beyond: list[Any] | None = None,
) -> Need:
    """``beyond``: requests of ``MAX_SIDE`` where the file serves smaller ones (its budget must refuse
    them)."""
    fraction = stage.diffusion_args.get("gpu_memory_utilization", 1.0 - CUDA_CONTEXT / gpu)
    spec = QuantizationSpec.of(stage.diffusion_args.get("quantization"))
    if spec is not None:  # its weights as torchao holds them
        weights = estimated_bytes(dict(runner.pipe.components), spec, 2)
    else:
        weights = tensor_bytes(runner.weight_tensors())
    budget = MemoryBudget(fraction, "cuda", gpu, weights)
    if runner.tiles_decode:  # as the engine sets them: decodes image by image or in tiles where they must
        runner.context.vae_tiling = stage.diffusion_args.get("vae_tiling", "auto")
        runner.context.decode_budget = budget.activation_bytes
    worst_alone = max(runner.activation_bytes([r]) for r in largest)
    full = max(runner.activation_bytes(b) for b in batches)
    detail = (
        f"{stage.name}: {budget.describe()}; the largest request alone needs {gib(worst_alone)}, "
        f"a batch of {len(batches[0])} default requests {gib(full)}"
    )
    needs = budget.weight_bytes + budget.reserve_bytes + max(worst_alone, full)
    refused = max(runner.activation_bytes([r]) for r in beyond) > budget.activation_bytes if beyond else True
    return Need(stage.name, fraction, needs, CUDA_CONTEXT, detail, refused)


def sized(name: str, models: Models) -> tuple[int, dict[str, list[Need]]]:
    path = next(p for p in packaged_deploy_configs() if p.name == name)
    _, gpu = gpu_of(path)
    side = largest_side(path)
    pipeline = GPU_FILES[name]
    resolved = resolve_deployment(
        models.model_dir[pipeline], deploy_config=str(path), platform=PLATFORMS["cuda"]
    )
    devices: dict[str, list[Need]] = {}
    ar = next((s for s in resolved.stages if s.execution_type == "llm_ar"), None)
    for stage in resolved.stages:
        if stage.execution_type == "llm_ar":
            need = ar_need(stage, models.llm[pipeline], models.ar_weights[pipeline], gpu)
        else:
            runner = models.dit[pipeline]
            beyond = None
            if pipeline == "glm_image":
                largest, batches = glm_requests(stage, side)
                beyond = glm_requests(stage)[0] if side < MAX_SIDE else None
            elif pipeline == "bagel":
                largest, batches = bagel_requests(stage, ar, runner)
            else:
                largest, batches = diffusers_requests(stage, runner, side)
                beyond = diffusers_requests(stage, runner)[0] if side < MAX_SIDE else None
            need = dit_need(stage, runner, largest, batches, gpu, beyond)
        for key in device_keys(resolved, stage):
            devices.setdefault(key, []).append(need)
    return gpu, devices


@pytest.mark.parametrize("name", sorted(GPU_FILES))
def test_every_gpu_deploy_file_fits_the_gpu_it_names(name: str, models: Models) -> None:
    gpu, devices = sized(name, models)
    for device, needs in devices.items():
        report = f"{name}, {device} ({gib(gpu)}):\n  " + "\n  ".join(n.detail for n in needs)
        print(report)
        shares = sum(n.fraction for n in needs)
        assert shares <= 1.0, report
        outside = sum(n.outside for n in needs)
        assert shares * gpu + outside <= gpu, f"no room for CUDA contexts and graphs: {report}"
        for need in needs:
            assert need.needs <= need.fraction * gpu, f"{need.stage} does not fit its budget: {report}"
            assert need.refused, (
                f"{need.stage} would run a {MAX_SIDE}x{MAX_SIDE} image it cannot hold: {report}"
            )


def test_raising_a_batch_size_or_max_model_len_past_the_gpu_fails(models: Models) -> None:
    """The check can fail: the 80 GB BAGEL file with twice the DiT's batch, or twice the thinker's
    context length, no longer fits its budgets."""
    path = next(p for p in packaged_deploy_configs() if p.name == "bagel.yaml")
    gpu, runner = GPU_MEMORY["80GB"], models.dit["bagel"]

    def fits(overrides: dict[str, Any] | None) -> bool:
        resolved = resolve_deployment(models.model_dir["bagel"], deploy_config=str(path), platform=PLATFORMS["cuda"],
                                      stage_overrides=overrides)  # fmt: skip
        thinker, dit = resolved.stage(0), resolved.stage(1)
        needs = [
            ar_need(thinker, models.llm["bagel"], models.ar_weights["bagel"], gpu),
            dit_need(dit, runner, *bagel_requests(dit, thinker, runner), gpu),
        ]
        return all(n.needs <= n.fraction * gpu for n in needs)

    assert fits(None)
    assert not fits({"1": {"max_batch_size": 4}})
    assert not fits({"0": {"max_model_len": 32768}})
