"""BAGEL's generation runner (stage 1) on the tiny BAGEL: validation, batching, seeds, guidance gating,
lazy weight loading, decoding, and the shared model pieces (config reader, transforms, autoencoder)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from vllm_omni_plugin.families.bagel import (
    EDIT_DEFAULTS,
    T2I_DEFAULTS,
    BagelContext,
    BagelGenerationRequest,
    BagelGenerationRunner,
)
from vllm_omni_plugin.families.bagel.transformer import GenerationTransformer
from vllm_omni_plugin.models.bagel import transforms, weights
from vllm_omni_plugin.models.bagel.autoencoder import load_vae_encoder
from vllm_omni_plugin.models.bagel.config import (
    VAE_TRANSFORM_DEFAULT,
    BagelConfigError,
    TransformConfig,
    load_bagel_config,
)

LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 32
STEPS = 8


@pytest.fixture(scope="module")
def runner(tiny_bagel: Path) -> BagelGenerationRunner:
    return BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")


def context(seed: int, length: int, rope: int | None = None) -> BagelContext:
    """A random context cache of ``length`` tokens (the runner treats any K/V alike)."""
    if length == 0:
        return BagelContext.empty()
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((LAYERS, 2, length, KV_HEADS, HEAD_DIM), generator=gen)
    return BagelContext(kv=kv, kv_len=length, rope=length if rope is None else rope)


def t2i(request_id: str, seed: int, prompt_len: int = 12, **sampling: object) -> BagelGenerationRequest:
    cond = context(seed + 100, prompt_len)
    params = msgspec.structs.replace(T2I_DEFAULTS, num_inference_steps=STEPS, **sampling)
    return BagelGenerationRequest(
        request_id=request_id,
        cond=cond,
        cfg_text=BagelContext.empty(),
        cfg_img=cond,
        height=64,
        width=64,
        sampling=params,
        seed=seed,
    )


def edit(
    request_id: str, seed: int, image_len: int = 40, text_len: int = 9, **sampling: object
) -> BagelGenerationRequest:
    """Contexts shaped like an edit's: image blocks (VAE + ViT, two RoPE positions), then the text."""
    image = context(seed + 200, image_len, rope=2)
    full = torch.cat([image.kv, context(seed + 300, text_len).kv], dim=2)
    params = msgspec.structs.replace(EDIT_DEFAULTS, num_inference_steps=STEPS, **sampling)
    return BagelGenerationRequest(
        request_id=request_id,
        cond=BagelContext(kv=full, kv_len=image_len + text_len, rope=2 + text_len),
        cfg_text=image,
        cfg_img=context(seed + 300, text_len),
        height=64,
        width=64,
        sampling=params,
        seed=seed,
    )


def generate(runner: BagelGenerationRunner, batch: list[BagelGenerationRequest]) -> list[np.ndarray]:
    for request in batch:
        runner.validate(request)
    return runner.run(batch, [torch.Generator("cpu").manual_seed(r.seed) for r in batch]).images


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


# --- validation -----------------------------------------------------------------------------------------


def _replace(request: BagelGenerationRequest, **fields: object) -> BagelGenerationRequest:
    sampling = {k: v for k, v in fields.items() if k in T2I_DEFAULTS.__struct_fields__}
    rest = {k: v for k, v in fields.items() if k not in sampling}
    if sampling:
        rest["sampling"] = msgspec.structs.replace(request.sampling, **sampling)
    return msgspec.structs.replace(request, **rest)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"height": 72}, "height 72 is not a multiple of 16"),
        ({"width": 0}, "width must be a positive integer"),
        ({"width": 144}, "width 144 is larger than this model's 128 pixels"),
        ({"num_inference_steps": 1}, "num_inference_steps must be an integer of at least 2"),
        ({"timestep_shift": 0.0}, "timestep_shift must be positive"),
        ({"cfg_text_scale": float("nan")}, "cfg_text_scale must be a finite number"),
        ({"cfg_renorm_type": "tokens"}, "cfg_renorm_type must be one of global, channel, text_channel"),
        ({"cfg_interval": (0.8, 0.2)}, "cfg_interval must satisfy 0 <= lo <= hi <= 1, got (0.8, 0.2)"),
        ({"cfg_interval": (0.0, 1.5)}, "cfg_interval must satisfy 0 <= lo <= hi <= 1"),
        ({"cfg_interval": (0.5,)}, "cfg_interval must be two numbers"),
        ({"cfg_renorm_min": 1.5}, "cfg_renorm_min must lie in [0, 1]"),
        ({"cfg_text": None}, "cfg_text_scale > 1 needs the cfg_text context"),
        ({"cfg_img": None, "cfg_img_scale": 1.5}, "cfg_img_scale > 1 needs the cfg_img context"),
        (
            {"cond": BagelContext(kv=torch.zeros(LAYERS, 2, 5, 2, HEAD_DIM), kv_len=5, rope=5)},
            "cond.kv has shape (2, 2, 5, 2, 32); this model needs [num_layers, 2, kv_len, num_kv_heads, "
            "head_dim] = [2, 2, 5, 1, 32]",
        ),
        (
            {"cond": BagelContext(kv=torch.zeros(3, 2, 5, 1, HEAD_DIM), kv_len=5, rope=5)},
            "cond.kv has shape (3,",
        ),
        ({"cond": BagelContext(kv=torch.zeros(LAYERS, 2, 5, 1, 64), kv_len=5, rope=5)}, "cond.kv has shape"),
        (
            {"cond": BagelContext(kv=torch.zeros(LAYERS, 2, 5, 1, HEAD_DIM), kv_len=6, rope=5)},
            "cond.kv has shape",
        ),
        ({"cond": BagelContext(kv=None, kv_len=4, rope=4)}, "cond has kv_len 4 but no kv tensor"),
        ({"cond": BagelContext(kv=[[0.0]], kv_len=1, rope=1)}, "cond.kv must be a torch.Tensor"),
        (
            {"cfg_text": BagelContext(kv=None, kv_len=0, rope=-1)},
            "cfg_text.rope must be a non-negative integer",
        ),
        (
            {
                "cond": BagelContext(
                    kv=torch.zeros(LAYERS, 2, 5, 1, HEAD_DIM, dtype=torch.int32), kv_len=5, rope=5
                )
            },
            "cond.kv must be a floating-point tensor",
        ),
    ],
)
def test_validate_rejects_with_a_clear_message(
    runner: BagelGenerationRunner, fields: dict, message: str
) -> None:
    request = _replace(t2i("bad", 0), **fields)
    with pytest.raises(ValueError) as excinfo:
        runner.validate(request)
    assert message in str(excinfo.value)


def test_validate_accepts_the_default_sets_and_unneeded_contexts_may_be_missing(
    runner: BagelGenerationRunner,
) -> None:
    runner.validate(t2i("a", 0))
    runner.validate(edit("b", 0))
    # No guidance at all: only cond is needed.
    runner.validate(_replace(t2i("c", 0), cfg_text_scale=1.0, cfg_text=None, cfg_img=None))
    # Text guidance only: cfg_img is not needed.
    runner.validate(_replace(t2i("d", 0), cfg_img_scale=1.0, cfg_img=None))


def test_batch_key_is_size_steps_and_shift(runner: BagelGenerationRunner) -> None:
    base = runner.batch_key(t2i("a", 0))
    assert runner.batch_key(edit("b", 1, cfg_text_scale=7.0, cfg_renorm_type="channel")) == base
    assert runner.batch_key(_replace(t2i("c", 0), height=32)) != base
    assert runner.batch_key(_replace(t2i("d", 0), num_inference_steps=STEPS + 1)) != base
    assert runner.batch_key(_replace(t2i("e", 0), timestep_shift=1.0)) != base
    with pytest.raises(ValueError, match="a batch must share size, steps and shift"):
        runner.run([t2i("a", 0), _replace(t2i("c", 0), height=32)], [torch.Generator(), torch.Generator()])


def test_default_sets_follow_the_authors() -> None:
    assert (T2I_DEFAULTS.cfg_text_scale, T2I_DEFAULTS.cfg_img_scale, T2I_DEFAULTS.cfg_interval) == (
        4.0,
        1.0,
        (0.4, 1.0),
    )
    assert (T2I_DEFAULTS.timestep_shift, T2I_DEFAULTS.num_inference_steps, T2I_DEFAULTS.cfg_renorm_type) == (
        3.0,
        50,
        "global",
    )
    assert (EDIT_DEFAULTS.cfg_text_scale, EDIT_DEFAULTS.cfg_img_scale, EDIT_DEFAULTS.cfg_interval) == (
        4.0,
        2.0,
        (0.0, 1.0),
    )
    assert EDIT_DEFAULTS.cfg_renorm_type == "text_channel"


# --- batching, seeds, guidance -------------------------------------------------------------------------


def test_a_request_batched_with_others_gives_its_image_alone(runner: BagelGenerationRunner) -> None:
    batch = [
        t2i("t2i", 1, prompt_len=12),
        edit("edit", 2, image_len=40, text_len=9),
        t2i("short", 3, prompt_len=3, cfg_text_scale=6.0, cfg_img_scale=1.5, cfg_renorm_type="channel"),
        edit(
            "late",
            4,
            image_len=20,
            text_len=30,
            cfg_interval=(0.3, 0.8),
            cfg_renorm_type="global",
            cfg_renorm_min=0.5,
        ),
        t2i("plain", 5, prompt_len=25, cfg_text_scale=1.0),
    ]
    together = generate(runner, batch)
    for request, image in zip(batch, together, strict=True):
        alone = generate(runner, [request])[0]
        assert image.shape == (64, 64, 3) and image.dtype == np.uint8
        assert max_diff(image, alone) <= 1, request.request_id
    # Distinct requests give distinct images (the comparison above is not vacuous).
    assert len({image.tobytes() for image in together}) == len(batch)


def test_each_request_has_its_own_seed(runner: BagelGenerationRunner) -> None:
    first = generate(runner, [t2i("a", 7), t2i("b", 8)])
    again = generate(runner, [t2i("b", 8), t2i("a", 7)])
    assert np.array_equal(first[0], again[1]) and np.array_equal(first[1], again[0])
    same_context_other_seed = msgspec.structs.replace(t2i("a", 7), seed=9)
    other = generate(runner, [same_context_other_seed])[0]
    assert max_diff(other, first[0]) > 16


def test_images_depend_on_the_context_and_the_scales(runner: BagelGenerationRunner) -> None:
    base = generate(runner, [t2i("a", 7)])[0]
    other_prompt = msgspec.structs.replace(t2i("a", 7), cond=context(999, 12), cfg_img=context(999, 12))
    assert max_diff(generate(runner, [other_prompt])[0], base) > 16
    assert max_diff(generate(runner, [_replace(t2i("a", 7), cfg_text_scale=8.0)])[0], base) > 16


class _RowCounter:
    """Wraps the real forward to record how many rows each step runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        real = GenerationTransformer.velocity

        def counting(model: GenerationTransformer, latents: torch.Tensor, rows: object) -> torch.Tensor:
            self.rows.append(latents.shape[0])
            return real(model, latents, rows)

        monkeypatch.setattr(GenerationTransformer, "velocity", counting)


def _guided_steps(steps: int, shift: float, lo: float, hi: float) -> list[bool]:
    """Written from the spec: t = linspace(1, 0, N) shifted; guided where lo < t <= hi (first N-1 points)."""
    t = np.linspace(1.0, 0.0, steps, dtype=np.float32)
    t = (np.float32(shift) * t / (1 + np.float32(shift - 1) * t)).astype(np.float32)
    return [bool(np.float32(lo) < x <= np.float32(hi)) for x in t[:-1]]


def test_guidance_branches_run_only_inside_the_interval(
    runner: BagelGenerationRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = _RowCounter(monkeypatch)
    gates = _guided_steps(STEPS, 3.0, 0.4, 1.0)
    assert any(gates) and not all(gates)

    generate(runner, [t2i("t2i", 1)])  # cond + cfg_text inside the interval
    assert counter.rows == [2 if g else 1 for g in gates]

    counter.rows.clear()  # text-to-image cfg_img equals cond: one row serves both
    generate(runner, [t2i("t2i", 1, cfg_img_scale=1.5)])
    assert counter.rows == [2 if g else 1 for g in gates]

    counter.rows.clear()
    edit_gates = _guided_steps(STEPS, 3.0, 0.0, 1.0)
    generate(runner, [edit("edit", 2)])
    assert counter.rows == [3 if g else 1 for g in edit_gates]

    counter.rows.clear()  # no text guidance: no image guidance either, whatever its scale
    generate(runner, [edit("edit", 2, cfg_text_scale=1.0)])
    assert counter.rows == [1] * (STEPS - 1)

    counter.rows.clear()  # two requests, different intervals: each one's branches follow its own
    late = _guided_steps(STEPS, 3.0, 0.2, 0.7)
    generate(runner, [t2i("t2i", 1), edit("edit", 2, cfg_interval=(0.2, 0.7))])
    assert counter.rows == [2 + (1 if a else 0) + (2 if b else 0) for a, b in zip(gates, late, strict=True)]


def test_an_interval_that_excludes_every_step_is_no_guidance(runner: BagelGenerationRunner) -> None:
    unguided = generate(runner, [_replace(t2i("a", 3), cfg_text_scale=1.0)])[0]
    empty_interval = generate(runner, [_replace(t2i("a", 3), cfg_interval=(1.0, 1.0))])[0]
    guided = generate(runner, [t2i("a", 3)])[0]
    assert np.array_equal(unguided, empty_interval)
    assert max_diff(guided, unguided) > 16


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
def test_renorm_types_differ_and_renorm_min_one_turns_renorm_off(
    runner: BagelGenerationRunner, renorm: str
) -> None:
    request = edit("e", 5, cfg_text_scale=6.0, cfg_renorm_type=renorm)
    image = generate(runner, [request])[0]
    no_renorm = generate(runner, [_replace(request, cfg_renorm_min=1.0)])[0]
    assert max_diff(image, no_renorm) > 0  # renorm acted on this request


# --- outputs and loading ------------------------------------------------------------------------------


def test_non_square_sizes_decode_to_uint8_hxwx3(runner: BagelGenerationRunner) -> None:
    request = _replace(t2i("wide", 1), height=48, width=80)
    out = runner.run(
        [request, _replace(request, request_id="w2", seed=2)], [torch.Generator().manual_seed(1)] * 2
    )
    assert [image.shape for image in out.images] == [(48, 80, 3), (48, 80, 3)]
    assert all(image.dtype == np.uint8 for image in out.images)
    assert (
        set(out.timings) == {"denoise", "decode", "total"} and out.timings["total"] >= out.timings["decode"]
    )


def test_only_what_generation_uses_is_read(tiny_bagel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spies on the byte ranges the reader reads: whole tensors, and rows of the embedding."""
    whole: list[str] = []
    sliced: list[str] = []
    real_bytes = weights.CheckpointReader._bytes

    def spy(self: weights.CheckpointReader, name: str, start: int, end: int) -> torch.Tensor:
        entry = self.entries[name]
        (whole if (start, end) == (entry.start, entry.end) else sliced).append(name)
        return real_bytes(self, name, start, end)

    monkeypatch.setattr(weights.CheckpointReader, "_bytes", spy)
    runner = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.float32, device="cpu")

    ema = set(weights.read_header(tiny_bagel / "ema.safetensors"))
    ae = set(weights.read_header(tiny_bagel / "ae.safetensors"))
    unused = ("vit_model.", "connector.", "vit_pos_embed.", "language_model.lm_head.")
    wanted_ema = {
        n
        for n in ema
        if not n.startswith(unused)
        and n not in ("language_model.model.norm.weight", "language_model.model.embed_tokens.weight")
    }
    wanted_ae = {n for n in ae if n.startswith("decoder.")}
    assert set(whole) == wanted_ema | wanted_ae
    assert len(whole) == len(set(whole))  # each once
    assert sliced == ["language_model.model.embed_tokens.weight"] * 2  # its two rows, one read each
    assert len(wanted_ema) == 2 * LAYERS * 14 + 1 + 4 + 4 + 1  # both experts' 14 tensors per layer + heads
    assert set(runner.tensors_read["ema.safetensors"]) == wanted_ema | {
        "language_model.model.embed_tokens.weight"
    }
    assert set(runner.tensors_read["ae.safetensors"]) == wanted_ae


def test_loading_a_checkpoint_that_does_not_match_its_config_says_what(
    tiny_bagel: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "bagel"
    shutil.copytree(tiny_bagel, broken)
    cfg = json.loads((broken / "llm_config.json").read_text())
    cfg["intermediate_size"] = 96
    (broken / "llm_config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        BagelConfigError, match=r"mlp.gate_proj.weight has shape \(128, 64\); the config needs \(96, 64\)"
    ):
        BagelGenerationRunner.load(str(broken), dtype=torch.float32, device="cpu")
    with pytest.raises(BagelConfigError, match="no such BAGEL model directory"):
        BagelGenerationRunner.load(str(tmp_path / "missing"), dtype=torch.float32, device="cpu")


# --- shared model pieces ------------------------------------------------------------------------------


def test_config_reader(tiny_bagel: Path) -> None:
    cfg = load_bagel_config(tiny_bagel)
    tok = json.loads((tiny_bagel / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert (cfg.tokens.bos, cfg.tokens.eos) == (ids["<|im_start|>"], ids["<|im_end|>"])
    assert (cfg.tokens.start_of_image, cfg.tokens.end_of_image) == (
        ids["<|vision_start|>"],
        ids["<|vision_end|>"],
    )
    assert (cfg.tokens.vision_pad, cfg.tokens.image_pad) == (ids["<|vision_pad|>"], ids["<|image_pad|>"])
    assert (cfg.llm.num_layers, cfg.llm.num_kv_heads, cfg.llm.head_dim, cfg.vit.num_layers) == (2, 1, 32, 2)
    assert (cfg.latent_downsample, cfg.latent_token_dim, cfg.max_latent_size, cfg.max_image_side) == (
        16,
        64,
        8,
        128,
    )
    assert cfg.vae.ch_mult == (1, 1, 1, 1) and cfg.vae.ch == 32 and cfg.vae.scale_factor == 0.3611
    assert cfg.vae_transform == TransformConfig(max_image_size=128, min_image_size=32, image_stride=16)
    assert cfg.llm.qk_norm and not cfg.llm.tie_word_embeddings


def test_config_reader_prefers_the_weights_table_and_defaults_the_transforms(
    tiny_bagel: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "bagel"
    shutil.copytree(tiny_bagel, copy)
    top = json.loads((copy / "config.json").read_text())
    top["max_latent_size"] = 32  # as the hub's config.json says while its table is larger
    del top["vae_transform"]
    (copy / "config.json").write_text(json.dumps(top))
    cfg = load_bagel_config(copy)
    assert cfg.max_latent_size == 8
    assert cfg.vae_transform == VAE_TRANSFORM_DEFAULT
    top["vae_config"]["downsample"] = 16
    (copy / "config.json").write_text(json.dumps(top))
    with pytest.raises(BagelConfigError, match=r"downsample 16 does not match ch_mult \[1, 1, 1, 1\]"):
        load_bagel_config(copy)
    top["vae_config"]["downsample"] = 8
    (copy / "config.json").write_text(json.dumps(top))
    (copy / "tokenizer.json").unlink()
    (copy / "tokenizer_config.json").write_text("{}")
    with pytest.raises(BagelConfigError, match=re.escape("define no <|im_start|>, <|im_end|>")):
        load_bagel_config(copy)


@pytest.mark.parametrize(
    ("size", "spec", "expected"),
    [
        # Original sizes: a 4:3 photo is brought up to a 512 short edge, multiples of 16.
        ((640, 480), (1024, 512, 16), (688, 512)),
        ((4000, 3000), (1024, 512, 16), (1024, 768)),  # the long edge first; the short edge only raises
        ((2000, 500), (1024, 512, 16), (1024, 256)),  # the long-edge bound wins over the short-edge one
        ((300, 300), (980, 224, 14), (294, 294)),  # 300 / 14 = 21.4 strides
        ((100, 60), (128, 32, 16), (96, 64)),
    ],
)
def test_resize_rules(size: tuple[int, int], spec: tuple[int, int, int], expected: tuple[int, int]) -> None:
    cfg = TransformConfig(max_image_size=spec[0], min_image_size=spec[1], image_stride=spec[2])
    assert transforms.resized_size(*size, cfg) == expected


def test_patchify_round_trip_and_position_ids() -> None:
    image = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    tokens = transforms.patchify(image, 2)
    assert tokens.shape == (6, 12)
    # token (row 0, col 1): the patch's pixels in (p, q, c) order
    assert tokens[1].tolist() == [
        image[c, p, 2 + q].item() for p in range(2) for q in range(2) for c in range(3)
    ]
    assert torch.equal(transforms.unpatchify(tokens[None], 2, 3, 2, 3)[0], image)
    assert transforms.flattened_position_ids(32, 48, 16, 8).tolist() == [0, 1, 2, 8, 9, 10]
    assert transforms.flattened_position_ids(32, 32, 16, 8, interpolate=True).tolist() == [0, 4, 32, 36]


def test_image_transform_normalises_to_minus_one_one() -> None:
    import PIL.Image

    rgba = PIL.Image.new("RGBA", (100, 60), (0, 0, 0, 0))  # fully transparent: white after composition
    out = transforms.ImageTransform(TransformConfig(max_image_size=128, min_image_size=32, image_stride=16))(
        rgba
    )
    assert out.shape == (3, 64, 96)
    assert torch.allclose(out, torch.ones_like(out))


def test_autoencoder_encoder_mean_is_deterministic_and_decoder_inverts_shape(
    tiny_bagel: Path, runner: BagelGenerationRunner
) -> None:
    cfg = load_bagel_config(tiny_bagel)
    encoder = load_vae_encoder(cfg.vae_weights, cfg.vae, dtype=torch.float32, device="cpu")
    image = torch.rand((1, 3, 64, 96), generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = encoder.encode(image)
    assert z.shape == (1, 16, 8, 12)
    assert torch.equal(z, encoder.encode(image))
    sampled = encoder.encode(image, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(sampled, z)
    assert runner.decoder.decode(z).shape == (1, 3, 64, 96)


# --- against the independent reference ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path):
    from vllm_omni_testkit.reference.bagel import BagelReference

    return BagelReference(tiny_bagel, dtype=torch.float32)


def _test_image(seed: int, width: int, height: int):
    import PIL.Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(height // 8, width // 8, 3), dtype=np.uint8)
    return PIL.Image.fromarray(coarse).resize((width, height), PIL.Image.Resampling.BILINEAR)


@pytest.fixture(scope="module")
def reference_contexts(reference) -> dict:
    """T2I and edit contexts as the reference builds them (stage 0's job in serving)."""
    empty = reference.new_context()
    image = reference.add_image(empty, reference.vae_transform.resize(_test_image(0, 64, 64)))
    return {
        "empty": empty,
        "t2i_cond": reference.add_text(empty, "a red fox in the snow"),
        "image": image,
        "edit_cond": reference.add_text(image, "make the sky green"),
        "edit_text_only": reference.add_text(empty, "make the sky green"),
    }


def _handoff(ctx) -> BagelContext:
    return BagelContext(kv=ctx.kv(), kv_len=ctx.kv_len, rope=ctx.rope)


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
def test_runner_reproduces_the_reference(
    runner: BagelGenerationRunner, reference, reference_contexts: dict, renorm: str
) -> None:
    """T2I and edit in one batch, fed the reference's three contexts: the reference's images."""
    c = reference_contexts
    t2i_params = dict(
        num_inference_steps=12,
        timestep_shift=3.0,
        cfg_text_scale=4.0,
        cfg_img_scale=1.5,  # T2I cfg_img is cond: exercises the shared row
        cfg_interval=(0.4, 1.0),
        cfg_renorm_type=renorm,
        cfg_renorm_min=0.0,
    )
    edit_params = dict(t2i_params, cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_min=0.2)
    cases = [
        ("t2i", ("t2i_cond", "empty", "t2i_cond"), t2i_params, 11),
        ("edit", ("edit_cond", "image", "edit_text_only"), edit_params, 12),
    ]
    batch = []
    expected = []
    for name, (cond, cfg_text, cfg_img), params, seed in cases:
        expected.append(
            reference.generate_image(
                c[cond], c[cfg_text], c[cfg_img], height=64, width=64, seed=seed, **params
            )
        )
        batch.append(
            BagelGenerationRequest(
                request_id=name,
                cond=_handoff(c[cond]),
                cfg_text=_handoff(c[cfg_text]),
                cfg_img=_handoff(c[cfg_img]),
                height=64,
                width=64,
                sampling=msgspec.convert(params, type(T2I_DEFAULTS)),
                seed=seed,
            )
        )
    got = generate(runner, batch)
    for (name, *_), mine, theirs in zip(cases, got, expected, strict=True):
        diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
        assert diff.max() <= 2 and diff.mean() <= 0.1, (name, int(diff.max()), float(diff.mean()))
        assert theirs.std() > 10  # a real image, not a flat one


def test_transforms_and_autoencoder_match_the_reference(tiny_bagel: Path, runner, reference) -> None:
    """The pieces stage 0 shares: resize rules, normalisation, encoder mean and decoder."""
    cfg = load_bagel_config(tiny_bagel)
    for width, height in ((64, 64), (100, 60), (37, 250), (640, 480)):
        image = _test_image(width, max(width, 8), max(height, 8)).resize((width, height))
        for ours, theirs in (
            (cfg.vae_transform, reference.vae_transform),
            (cfg.vit_transform, reference.vit_transform),
        ):
            assert transforms.resized_size(width, height, ours) == theirs.target_size(width, height)
            assert torch.equal(transforms.ImageTransform(ours)(image), theirs(image))
    pixels = transforms.ImageTransform(cfg.vae_transform)(_test_image(3, 96, 64))[None]
    encoder = load_vae_encoder(cfg.vae_weights, cfg.vae, dtype=torch.float32, device="cpu")
    z = encoder.encode(pixels)
    assert torch.allclose(z, reference.vae_encode(pixels), atol=1e-5)
    assert torch.allclose(runner.decoder.decode(z), reference.vae_decode(z), atol=1e-5)
    latent_tokens, _, _ = reference.vae_latent_tokens(_test_image(3, 96, 64))
    assert torch.allclose(transforms.patchify(z[0], cfg.latent_patch_size), latent_tokens, atol=1e-5)


def _bf16_close_to_fp32(device: str, tiny_bagel: Path, runner: BagelGenerationRunner) -> None:
    low = BagelGenerationRunner.load(str(tiny_bagel), dtype=torch.bfloat16, device=device)
    batch = [t2i("t2i", 1), edit("edit", 2), t2i("short", 3, prompt_len=3, cfg_renorm_type="channel")]
    for a, b in zip(generate(low, batch), generate(runner, batch), strict=True):
        assert a.shape == b.shape and a.dtype == np.uint8
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() < 3.0


def test_bf16_on_cpu_stays_close_to_fp32(tiny_bagel: Path, runner: BagelGenerationRunner) -> None:
    _bf16_close_to_fp32("cpu", tiny_bagel, runner)


@pytest.mark.cuda
def test_cuda_bf16_stays_close_to_cpu_fp32(tiny_bagel: Path, runner: BagelGenerationRunner) -> None:
    _bf16_close_to_fp32("cuda", tiny_bagel, runner)
