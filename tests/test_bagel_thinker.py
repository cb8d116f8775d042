"""BAGEL's thinker (``models.bagel_thinker``) in a real vLLM engine against the independent reference.

The engine runs in a child process (this file run as a script) with the Omni worker and scheduler and the
context export KV connector putting into a shared-memory connector; it exports the context of each prompt, reads it back through the
connector and writes everything to one file. The test process compares with
``testing.bagel_reference`` (a single-process PyTorch BAGEL sharing no model code with the stages).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TEXT = "a red fox in the snow"
EDIT = "make the sky blue"
QUESTION = "what is in the picture"
ATOL = 1e-4


def image(seed: int, height: int, width: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# --- the engine side (child process) -------------------------------------------------------------------


def _engine_main(model: str, out_path: str) -> None:
    import msgspec
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.ar_channel import context_export_kv_transfer_config
    from vllm_omni_plugin.connectors.base import HANDLE_KEY, ConnectorHandle, make_connector
    from vllm_omni_plugin.families.bagel.pipeline import BAGEL
    from vllm_omni_plugin.families.bagel.processors import bagel_tokens
    from vllm_omni_plugin.models.bagel.engine_args import thinker_engine_args

    connector = {"name": "ctx", "class": "SharedMemoryConnector", "extra": {}}
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 2},
        worker_cls="vllm_omni_plugin.ar_worker.cpu_worker.OmniCPUWorker",
        scheduler_cls="vllm_omni_plugin.schedulers.omni_ar_scheduler.OmniARScheduler",
        kv_transfer_config=context_export_kv_transfer_config(connector, BAGEL.stage(0).context_position),
        **thinker_engine_args(model),
    )
    reader = make_connector("ctx", "SharedMemoryConnector", {})
    tok = bagel_tokens(model)
    export = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"omni": {"export_context": True}})
    edit_image = image(0, 64, 48)
    big_image = image(1, 128, 96)
    prompts = {
        "t2i": {"prompt_token_ids": tok.segment(TEXT)},
        "edit": {
            "prompt_token_ids": [tok.image_pad, *tok.segment(EDIT)],
            "multi_modal_data": {"image": edit_image},
        },
        "edit_cfg_img": {"prompt_token_ids": tok.segment(EDIT)},
    }
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}

    def collect(name: str, output: Any) -> None:
        ctx = output.kv_transfer_params["omni"]["context"]
        kv = reader.get(msgspec.convert(ctx["kv"][HANDLE_KEY], ConnectorHandle))
        tensors[name] = kv.clone()
        meta[name] = {"kv_len": ctx["kv_len"], "rope": ctx["rope"], "cached": output.num_cached_tokens}

    for name, output in zip(
        prompts, llm.generate(list(prompts.values()), [export] * len(prompts)), strict=True
    ):
        collect(name, output)
    # The same larger edit twice: the second starts from a prefix-cache hit inside its image blocks.
    big = {"prompt_token_ids": [tok.image_pad, *tok.segment(EDIT)], "multi_modal_data": {"image": big_image}}
    collect("big", llm.generate([big], [export])[0])
    collect("big_again", llm.generate([big], [export])[0])
    understand = {
        "prompt_token_ids": [tok.image_pad, *tok.segment(QUESTION), tok.bos],
        "multi_modal_data": {"image": edit_image},
        "mm_processor_kwargs": {"bagel_vae": False},
    }
    answer = llm.generate(
        [understand], [SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[tok.eos])]
    )
    meta["understand"] = {
        "tokens": list(answer[0].outputs[0].token_ids),
        "prompt_len": len(answer[0].prompt_token_ids),
    }
    reader.close()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_path + ".safetensors")
    Path(out_path + ".json").write_text(json.dumps(meta))


# --- the test side ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from helpers import run_output_script

    out = tmp_path_factory.mktemp("thinker") / "contexts"
    meta, tensors = run_output_script(__file__, str(tiny_bagel), out=out)
    return {"kv": tensors, "meta": meta}


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path) -> Any:
    from vllm_omni_testkit.reference.bagel import BagelReference

    return BagelReference(str(tiny_bagel))


def _assert_context(engine: dict[str, Any], name: str, ctx: Any, length: int | None = None) -> None:
    kv = engine["kv"][name]
    meta = engine["meta"][name]
    ref = ctx.kv()
    if length is not None:  # a prefix of the exported context
        kv = kv[:, :, :length]
    else:
        assert meta["kv_len"] == ctx.kv_len and meta["rope"] == ctx.rope
    assert tuple(kv.shape) == tuple(ref.shape)
    diff = (kv - ref).abs().max().item()
    assert diff <= ATOL, f"{name}: K/V differ from the reference by {diff}"


def test_text_context_equals_reference(engine: dict[str, Any], reference: Any) -> None:
    _assert_context(engine, "t2i", reference.add_text(reference.new_context(), TEXT))


def test_edit_contexts_equal_reference(engine: dict[str, Any], reference: Any) -> None:
    """All three contexts of an edit: cond (VAE block, ViT block, text), cfg_text (the image blocks: a
    prefix of cond) and cfg_img (the text alone: a companion request)."""
    resized = reference.vae_transform.resize(image(0, 64, 48))
    with_image = reference.add_image(reference.new_context(), resized)
    _assert_context(engine, "edit", reference.add_text(with_image, EDIT))
    _assert_context(engine, "edit", with_image, length=with_image.kv_len)
    assert with_image.rope == 2  # one position per image block
    _assert_context(engine, "edit_cfg_img", reference.add_text(reference.new_context(), EDIT))


def test_prefix_cache_hit_inside_an_image_block(engine: dict[str, Any], reference: Any) -> None:
    """The second identical edit reuses cached blocks that end inside its ViT block; the rows computed in
    that step still attend to their whole block (cached keys read back from the paged cache)."""
    meta = engine["meta"]
    assert meta["big"]["cached"] == 0 and meta["big_again"]["cached"] > 0
    ctx = reference.add_image(reference.new_context(), reference.vae_transform.resize(image(1, 128, 96)))
    ctx = reference.add_text(ctx, EDIT)
    assert meta["big_again"]["cached"] < ctx.kv_len - 2  # the hit ends before the last image block's end
    _assert_context(engine, "big", ctx)
    _assert_context(engine, "big_again", ctx)


def test_understanding_greedy_tokens_equal_reference(engine: dict[str, Any], reference: Any) -> None:
    ctx = reference.add_image(
        reference.new_context(), reference.vae_transform.resize(image(0, 64, 48)), vae=False
    )
    ctx = reference.add_text(ctx, QUESTION)
    expected = reference.generate_text(ctx, max_new_tokens=16)
    got = engine["meta"]["understand"]["tokens"]
    assert got[: len(expected)] == expected
    assert engine["meta"]["understand"]["prompt_len"] == ctx.kv_len + 1  # ViT block + text + <|im_start|>


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _engine_main(sys.argv[1], sys.argv[2])
