"""GLM-Image's AR model natively in vLLM (``vllm_omni_plugin.models.glm_image_ar``) against transformers.

The vLLM side runs in one engine, in a child process (this file run as a script), so the engine's CPU
thread binding and global state stay out of the pytest process; the transformers side runs here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from helpers import run_result_script, source_image
from vllm_omni_plugin.families.glm_image.processors import upsample_prior

ARCH = "GlmImageForConditionalGeneration"
MODEL_CLASS = "vllm_omni_plugin.models.glm_image_ar:GlmImageForConditionalGeneration"
WORKER_CLS = "vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker"
CODEBOOK_SIZE = 16384
PROMPT = "A photo of a cat"
EDIT_PROMPT = "Make it blue"

# name -> (source image side or None, target height, target width)
CASES: dict[str, tuple[int | None, int, int]] = {
    "t2i_64": (None, 64, 64),
    "t2i_128": (None, 128, 128),
    "i2i_64_to_64": (64, 64, 64),
}
# Positions only (no generation): more shapes, including a non-square grid and a 3x3 source grid.
POSITION_CASES: dict[str, tuple[int | None, int, int]] = {
    **CASES,
    "t2i_96x64": (None, 96, 64),
    "i2i_64_to_128": (64, 128, 128),
    "i2i_100_to_64": (100, 64, 64),
}


def source_pil(side: int) -> Any:
    from PIL import Image

    return Image.fromarray(source_image(side))


def collapse_image_runs(ids: list[int], image_token_id: int) -> list[int]:
    out: list[int] = []
    for token in ids:
        if token == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(token)
    return out


# --- transformers reference (pytest process) ----------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_glm_image: Path) -> SimpleNamespace:
    import torch
    from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

    processor = GlmImageProcessor.from_pretrained(tiny_glm_image / "processor")
    model = GlmImageForConditionalGeneration.from_pretrained(
        tiny_glm_image / "vision_language_encoder", dtype=torch.float32
    ).eval()
    return SimpleNamespace(processor=processor, model=model, dir=tiny_glm_image)


def hf_inputs(hf: SimpleNamespace, case: tuple[int | None, int, int]) -> Any:
    side, height, width = case
    content: list[dict[str, Any]] = []
    if side is not None:
        content.append({"type": "image", "image": source_pil(side)})
    content.append({"type": "text", "text": EDIT_PROMPT if side is not None else PROMPT})
    return hf.processor.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=True,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )


def hf_positions(hf: SimpleNamespace, inputs: Any) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """transformers' prompt positions [3, L], decode plan [3, D] and source grids for one prompt."""
    model = hf.model.model
    position_ids, deltas = model.get_rope_index(
        inputs["input_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        images_per_sample=inputs["images_per_sample"],
        attention_mask=inputs["attention_mask"],
    )
    assert deltas.abs().sum() == 0
    decode = model._cached_decode_position_ids[0].numpy()
    n_src = int(inputs["images_per_sample"][0]) - (1 if "pixel_values" in inputs else 2)
    sources = [(int(h), int(w)) for _, h, w in inputs["image_grid_thw"][:n_src].tolist()]
    return position_ids[:, 0].numpy(), decode, sources


@pytest.fixture(scope="module")
def hf_greedy(hf: SimpleNamespace) -> dict[str, dict[str, Any]]:
    import torch

    from vllm_omni_plugin.families.glm_image.processors import glm_image_max_new_tokens

    out = {}
    for name, case in CASES.items():
        side, height, width = case
        inputs = hf_inputs(hf, case)
        max_new = glm_image_max_new_tokens(height, width, image_to_image=side is not None)
        with torch.no_grad():
            generated = hf.model.generate(**inputs, do_sample=False, max_new_tokens=max_new)
        prompt = inputs["input_ids"][0].tolist()
        out[name] = {"prompt": prompt, "tokens": generated[0][len(prompt) :].tolist(), "max_tokens": max_new}
    return out


# --- the vLLM engine (child process) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(hf: SimpleNamespace, hf_greedy: dict[str, dict[str, Any]], tmp_path_factory) -> dict[str, Any]:
    image_token_id = hf.model.config.image_token_id
    requests = []
    for name, case in CASES.items():
        ref = hf_greedy[name]
        requests.append(
            {"name": name, "prompt": ref["prompt"], "image": case[0], "max_tokens": ref["max_tokens"]}
        )
        if case[0] is not None:  # one <|image|> per source image: vLLM expands it
            collapsed = collapse_image_runs(ref["prompt"], image_token_id)
            requests.append({**requests[-1], "name": f"{name}_collapsed", "prompt": collapsed})
    # what get_mrope_input_positions returns inside the engine, for prompt / prompt + generated tokens
    positions = []
    for name, case in POSITION_CASES.items():
        inputs = hf_inputs(hf, case)
        prompt = inputs["input_ids"][0].tolist()
        _, _, sources = hf_positions(hf, inputs)
        generated = hf_greedy[name]["tokens"] if name in hf_greedy else []
        for k in sorted({0, 1, len(generated) // 2, len(generated)}):
            if k <= len(generated):
                positions.append(
                    {"name": f"{name}+{k}", "tokens": prompt + generated[:k], "sources": sources}
                )
    spec = tmp_path_factory.mktemp("glm_image_ar") / "requests.json"
    spec.write_text(json.dumps({"requests": requests, "positions": positions}))
    out = run_result_script(__file__, str(hf.dir), str(spec), timeout=900)
    print(f"\nGLM-Image AR in vLLM: {json.dumps(out['metrics'])}")
    return out


# --- 1. greedy tokens: vLLM == transformers -----------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers(name: str, hf_greedy: dict, engine: dict) -> None:
    ref = hf_greedy[name]
    got = engine["outputs"][name]
    assert len(ref["tokens"]) == ref["max_tokens"]
    assert all(t < CODEBOOK_SIZE for t in ref["tokens"])  # the restriction below changes nothing for HF
    assert got["prompt_token_ids"] == ref["prompt"]
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[0] is not None])
def test_collapsed_image_placeholder_is_expanded_like_transformers(
    name: str, hf_greedy: dict, engine: dict
) -> None:
    got = engine["outputs"][f"{name}_collapsed"]
    assert got["prompt_token_ids"] == hf_greedy[name]["prompt"]
    assert got["tokens"] == hf_greedy[name]["tokens"]


def test_batched_requests_give_the_same_tokens(hf_greedy: dict, engine: dict) -> None:
    """All requests in one ``generate`` call (mixed prefill/decode steps) still match one by one."""
    for name in CASES:
        assert engine["batched"][name] == hf_greedy[name]["tokens"], name


def test_source_image_vq_ids_equal_transformers(hf: SimpleNamespace, engine: dict) -> None:
    import torch

    inputs = hf_inputs(hf, CASES["i2i_64_to_64"])
    grids = inputs["image_grid_thw"][:-1]
    with torch.no_grad():
        features = hf.model.get_image_features(inputs["pixel_values"], grids).pooler_output
        ids = hf.model.get_image_tokens(features)
    (h, w) = grids[0, 1:].tolist()
    prior = engine["prior"]
    assert prior["ids"] == [ids.long().view(-1).tolist()]
    assert prior["grids"] == [[1, h, w]]
    # the family's processor brings them to the DiT's grid as the reference pipeline does
    upsampled = torch.nn.functional.interpolate(ids.view(1, 1, h, w).float(), scale_factor=2, mode="nearest")
    assert upsample_prior(prior["ids"][0], h, w).tolist() == upsampled.long().view(-1).tolist()


# --- 2. positions: get_mrope_input_positions == transformers' get_rope_index + decode plan -------------


def _expected(hf: SimpleNamespace, case: tuple[int | None, int, int]) -> np.ndarray:
    prompt_pos, decode_pos, _ = hf_positions(hf, hf_inputs(hf, case))
    return np.concatenate([prompt_pos, decode_pos], axis=1)


@pytest.mark.parametrize("name", list(POSITION_CASES))
def test_position_plan_equals_transformers(name: str, hf: SimpleNamespace) -> None:
    from vllm_omni_plugin.families.glm_image.processors import glm_image_max_new_tokens
    from vllm_omni_plugin.models.glm_image_ar import glm_image_mrope_positions

    case = POSITION_CASES[name]
    inputs = hf_inputs(hf, case)
    prompt = inputs["input_ids"][0].tolist()
    prompt_pos, decode_pos, sources = hf_positions(hf, inputs)
    tokenizer = hf.processor.tokenizer
    kwargs = {
        "grid_bos_token_id": tokenizer.convert_tokens_to_ids("<sop>"),
        "grid_eos_token_id": tokenizer.convert_tokens_to_ids("<eop>"),
        "image_start_token_id": hf.model.config.image_start_token_id,
        "image_end_token_id": hf.model.config.image_end_token_id,
        "decode": tokenizer.decode,
    }
    expected = np.concatenate([prompt_pos, decode_pos], axis=1)
    side, height, width = case
    assert decode_pos.shape[1] == glm_image_max_new_tokens(height, width, image_to_image=side is not None)
    got = glm_image_mrope_positions(prompt, sources, **kwargs)
    np.testing.assert_array_equal(got, expected)
    # resumed after preemption: prompt + generated tokens (image start/end ids included) -> the same plan
    for k in (1, decode_pos.shape[1] // 2, decode_pos.shape[1]):
        generated = ([5, 16384, 16385] * k)[:k]
        np.testing.assert_array_equal(
            glm_image_mrope_positions(prompt + generated, sources, **kwargs), expected
        )
    # past the plan: what vLLM gives generated tokens for mrope_position_delta 0 (their index)
    longer = glm_image_mrope_positions(prompt + [7] * (decode_pos.shape[1] + 3), sources, **kwargs)
    n = expected.shape[1]
    np.testing.assert_array_equal(longer[:, :n], expected)
    np.testing.assert_array_equal(longer[:, n:], np.broadcast_to(np.arange(n, n + 3), (3, 3)))


def test_model_positions_in_the_engine_equal_transformers(hf: SimpleNamespace, engine: dict) -> None:
    """``GlmImageForConditionalGeneration.get_mrope_input_positions`` inside the engine (its tokenizer,
    its config), for prompts and prompts + generated tokens: prompt positions then the decode plan."""
    seen = set()
    for key, (positions, delta) in engine["positions"].items():
        name = key.rsplit("+", 1)[0]
        expected = _expected(hf, POSITION_CASES[name])
        assert delta == 0, key
        np.testing.assert_array_equal(np.asarray(positions), expected, err_msg=key)
        seen.add(name)
    assert seen == set(POSITION_CASES)


def test_t2i_plan_is_preview_then_large_grid_then_end(hf: SimpleNamespace) -> None:
    inputs = hf_inputs(hf, CASES["t2i_64"])
    prompt_pos, decode_pos, _ = hf_positions(hf, inputs)
    base = prompt_pos.max() + 1
    assert decode_pos.shape == (3, 16 * 16 + 2 * 2 + 1)
    assert (
        (decode_pos[:, 0] == base).all()
        and decode_pos[1, 255] == base + 15
        and decode_pos[2, 255] == base + 15
    )
    assert (decode_pos[:, 256] == base + 16).all()  # the large grid starts after max(16, 16)
    assert (decode_pos[:, -1] == base + 16 + 2).all()  # end marker


def test_malformed_grid_scaffold_is_rejected(hf: SimpleNamespace) -> None:
    from vllm_omni_plugin.models.glm_image_ar import parse_grid_scaffolds

    tokenizer = hf.processor.tokenizer
    ids = tokenizer("a cat<sop>16<eop>", add_special_tokens=False).input_ids
    bos, eos = tokenizer.convert_tokens_to_ids("<sop>"), tokenizer.convert_tokens_to_ids("<eop>")
    with pytest.raises(ValueError, match="<sop>H W<eop>"):
        parse_grid_scaffolds(ids, bos, eos, tokenizer.decode)


# --- engine script --------------------------------------------------------------------------------------


def _fake_feature(offset: int, h: int, w: int) -> Any:
    import torch

    grid = SimpleNamespace(data=torch.tensor([1, h, w]))
    return SimpleNamespace(
        modality="image", mm_position=SimpleNamespace(offset=offset), data={"image_grid_thw": grid}
    )


def run_engine(model_dir: str, spec_path: str) -> dict[str, Any]:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, ModelRegistry, SamplingParams

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)
    start = time.perf_counter()
    llm = LLM(
        model=f"{model_dir}/vision_language_encoder",
        tokenizer=f"{model_dir}/processor",
        worker_cls=WORKER_CLS,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=1024,
        distributed_executor_backend="uni",
        seed=0,
    )
    engine_start_s = time.perf_counter() - start

    def request(r: dict[str, Any]) -> tuple[dict[str, Any], SamplingParams]:
        prompt: dict[str, Any] = {"prompt_token_ids": r["prompt"]}
        if r["image"] is not None:
            prompt["multi_modal_data"] = {"image": source_pil(r["image"])}
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=r["max_tokens"],
            allowed_token_ids=list(range(CODEBOOK_SIZE)),
        )
        return prompt, params

    outputs, speed = {}, {}
    for r in spec["requests"]:
        prompt, params = request(r)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        outputs[r["name"]] = {"tokens": tokens, "prompt_token_ids": list(out.prompt_token_ids)}
        speed[r["name"]] = round(len(tokens) / elapsed, 1)
    plain = [r for r in spec["requests"] if not r["name"].endswith("_collapsed")]
    batch = [request(r) for r in plain]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    batched_elapsed = time.perf_counter() - t0
    batched = {r["name"]: list(o.outputs[0].token_ids) for r, o in zip(plain, outs, strict=True)}

    def model_positions(model: Any) -> dict[str, Any]:
        result = {}
        for item in spec["positions"]:
            tokens = item["tokens"]
            features, start = [], 0
            for h, w in item["sources"]:  # source placeholders are the runs of <|image|> in the prompt
                start = tokens.index(model.config.image_token_id, start)
                features.append(_fake_feature(start, h, w))
                start += h * w
            positions, delta = model.get_mrope_input_positions(tokens, features)
            result[item["name"]] = [positions.tolist(), delta]
        return result

    def prior(model: Any) -> dict[str, Any]:
        import torch
        from transformers import GlmImageProcessor

        image_processor = GlmImageProcessor.from_pretrained(f"{model_dir}/processor").image_processor
        data = image_processor(images=[source_pil(64)], return_tensors="pt")
        with torch.no_grad():
            ids = model.image_token_ids(data["pixel_values"].float(), data["image_grid_thw"])
        return {"ids": [t.view(-1).tolist() for t in ids], "grids": data["image_grid_thw"].tolist()}

    positions = llm.apply_model(model_positions)[0]
    prior_ids = llm.apply_model(prior)[0]
    total = sum(len(t) for t in batched.values())
    metrics = {
        "engine_start_s": round(engine_start_s, 2),
        "tokens_per_s": speed,
        "batched_tokens_per_s": round(total / batched_elapsed, 1),
    }
    llm.llm_engine.engine_core.shutdown()
    return {
        "outputs": outputs,
        "batched": batched,
        "positions": positions,
        "prior": prior_ids,
        "metrics": metrics,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run_engine(sys.argv[1], sys.argv[2])))
