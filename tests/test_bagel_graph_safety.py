"""BAGEL's thinker can be captured in a CUDA graph: its decode steps never synchronise with the host.

vLLM's default ``cudagraph_mode`` (FULL_AND_PIECEWISE) captures the whole forward of uniform decode batches;
a host synchronisation there (``.item()``, ``bool()``, ``.cpu()``, ``nonzero``, boolean indexing) aborts
the capture. This machine has no GPU, so :class:`~vllm_omni_testkit.harness.host_sync.HostSyncGuard` records
those synchronisations on CPU. The child process (this file run as a script) serves the tiny BAGEL in a
real in-process vLLM engine (V1 runner, scheduler, CPU attention) and wraps the thinker's forward: every
decode step, and a dummy decode run like the ones vLLM captures, runs under the guard with its inputs and
attention metadata marked as device tensors, then once more on the eager image path for comparison; the
hidden states of a prefill step with an image are kept and compared with the independent reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_omni_testkit.harness.host_sync import HostSyncGuard

EDIT = "make the sky blue"
QUESTION = "what is in the picture"
ATOL = 1e-4
DECODE_TOKENS = 6


def image(seed: int, height: int, width: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# --- the guard itself ----------------------------------------------------------------------------------


def test_guard_records_every_kind_of_host_sync() -> None:
    guard = HostSyncGuard()
    x = guard.device(torch.arange(6.0))
    mask = guard.device(torch.tensor([True, False] * 3))
    with guard:
        bool(mask.any())
        x[0].item()
        x.cpu()
        x.numpy()
        x.tolist()
        x.nonzero()
        x.masked_select(mask)
        x[mask]
        y = x.clone()
        y[mask] = 0.0
    kinds = [(v.kind, v.op) for v in guard.violations]
    assert kinds == [
        ("host read", "Tensor.__bool__"),
        ("host read", "Tensor.item"),
        ("host read", "Tensor.cpu"),
        ("host read", "Tensor.numpy"),
        ("host read", "Tensor.tolist"),
        ("data-dependent shape", "aten.nonzero.default"),
        ("data-dependent shape", "aten.masked_select.default"),
        ("boolean index", "aten.index.Tensor"),
        ("boolean index", "aten.index_put_.default"),
    ]
    assert all(__file__ in v.where for v in guard.violations)


def test_guard_lets_sync_free_ops_through() -> None:
    guard = HostSyncGuard()
    x = guard.device(torch.arange(6.0))
    index = guard.device(torch.tensor([0, 2]))
    with guard:
        y = torch.where(x > 2, x, 0.0)[index] + x[1:3]
        out = torch.empty(2).index_copy_(0, guard.device(torch.tensor([1, 0])), y)
    assert guard.violations == []
    assert torch.equal(guard.host(out), torch.tensor([2.0, 1.0]))


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "FULL"])
def test_cudagraph_modes_that_would_replay_image_steps_are_refused(mode: str) -> None:
    from vllm.config import CompilationConfig, CUDAGraphMode

    from vllm_omni_plugin.models.bagel_thinker import check_cudagraph_mode

    config = CompilationConfig(cudagraph_mode=CUDAGraphMode[mode])
    if mode == "FULL":
        with pytest.raises(ValueError, match="cudagraph_mode FULL"):
            check_cudagraph_mode(config)
    else:
        check_cudagraph_mode(config)


# --- the engine side (child process) -------------------------------------------------------------------


class _Probe:
    """Wraps one thinker's forward (an attribute of that instance; the class is untouched).

    Decode steps (every request one token) and dummy runs run under a :class:`HostSyncGuard`, their inputs
    and attention metadata marked as device tensors, then again on the eager image path (the way every step
    ran before decode steps went sync-free) for comparison. Prefill steps run as they are; their hidden
    states are kept.
    """

    def __init__(self, model: Any) -> None:
        from vllm_omni_plugin.compat import resolve

        self.model = model
        self.forward = model.forward
        self.context = resolve("get_attention_context")
        self.layer = model.language_model.model.layers[0].self_attn.attn.layer_name
        self.label = ""
        self.steps: list[dict[str, Any]] = []
        self.prefills: list[tuple[torch.Tensor, torch.Tensor]] = []
        model.forward = self

    def __call__(self, **inputs: Any) -> torch.Tensor:
        metadata = self.context(self.layer)[0]
        if metadata is not None and metadata.max_query_len > 1:
            out = self.forward(**inputs)
            rows = metadata.num_actual_tokens
            self.prefills.append((inputs["input_ids"][:rows].clone(), out[:rows].clone()))
            self.steps.append({"kind": "prefill", "rows": rows, "label": self.label})
            return out
        guard = HostSyncGuard()
        marked = {k: guard.device(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with contextlib.ExitStack() as stack:
            if metadata is not None:
                stack.enter_context(guard.device_attributes(metadata))
            with guard:
                out = guard.host(self.forward(**marked))
        noted = self.model.step_has_images
        self.model.step_has_images = True  # the eager image path, on the same inputs
        eager = self.forward(**inputs)
        self.model.step_has_images = noted
        ids = inputs["input_ids"][: out.shape[0]]
        self.steps.append(
            {
                "kind": "decode" if metadata is not None else "dummy",
                "rows": int(out.shape[0]),
                "label": self.label,
                "violations": [str(v) for v in guard.violations],
                "eager_diff": float((eager - out).abs().max()),
                "vision_pad_ids": int((ids == self.model.bagel.tokens.vision_pad).sum()),
            }
        )
        return out


def _engine_main(model: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.families.bagel.processors import bagel_tokens
    from vllm_omni_plugin.models.bagel.engine_args import thinker_engine_args

    llm = LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 1},
        **thinker_engine_args(model),
    )
    probe: _Probe = llm.apply_model(_Probe)[0]
    tok = bagel_tokens(model)
    edit = {
        "prompt_token_ids": [tok.image_pad, *tok.segment(EDIT)],
        "multi_modal_data": {"image": image(0, 64, 48)},
    }
    understand = {
        "prompt_token_ids": [tok.image_pad, *tok.segment(QUESTION), tok.bos],
        "multi_modal_data": {"image": image(1, 48, 64)},
        "mm_processor_kwargs": {"bagel_vae": False},
    }
    text = {"prompt_token_ids": [*tok.segment(EDIT), tok.bos]}
    greedy = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)

    probe.label = "edit alone"  # one prefill step: VAE block, ViT block, text
    llm.generate([edit], [SamplingParams(max_tokens=1, temperature=0.0)])
    probe.label = "batch"  # an image prefill step, then decode steps of three requests
    outputs = llm.generate([edit, understand, text], [greedy] * 3)
    probe.label = "dummy decode run"  # what the runner captures: no embed_input_ids before it
    llm.collective_rpc(
        lambda worker: worker.model_runner._dummy_run(4, force_attention=True, uniform_decode=True)
    )
    probe.label = "dummy run"
    llm.collective_rpc(lambda worker: worker.model_runner._dummy_run(4))

    ids, hidden = probe.prefills[0]
    save_file({"ids": ids.contiguous(), "hidden": hidden.contiguous()}, out_path + ".safetensors")
    meta = {
        "steps": probe.steps,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "vision_pad": probe.model.bagel.tokens.vision_pad,
    }
    Path(out_path + ".json").write_text(json.dumps(meta))


# --- the test side ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from helpers import run_output_script

    out = tmp_path_factory.mktemp("graph_safety") / "run"
    meta, tensors = run_output_script(__file__, str(tiny_bagel), out=out)
    return {**meta, **tensors}


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path) -> Any:
    from vllm_omni_testkit.reference.bagel import BagelReference

    return BagelReference(str(tiny_bagel))


def _guarded(engine: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in engine["steps"] if s["kind"] != "prefill"]


def test_decode_steps_do_not_synchronise_with_the_host(engine: dict[str, Any]) -> None:
    steps = _guarded(engine)
    batch = [s for s in steps if s["label"] == "batch"]
    assert len(batch) == DECODE_TOKENS - 1 and all(s["kind"] == "decode" and s["rows"] == 3 for s in batch)
    assert {s["label"] for s in steps} == {"batch", "dummy decode run", "dummy run"}
    found = {f"{s['label']} ({s['kind']}, {s['rows']} rows): {v}" for s in steps for v in s["violations"]}
    assert not found, "host synchronisation in a forward vLLM captures:\n" + "\n".join(sorted(found))


def test_sync_free_decode_equals_the_eager_path(engine: dict[str, Any]) -> None:
    """Real decode steps give what the eager path gives. (Dummy runs read whatever the runner's buffers
    hold, ``<|vision_pad|>`` ids included, which the eager path would route to the generation expert.)"""
    decode = [s for s in _guarded(engine) if s["label"] == "batch"]
    assert decode and all(s["vision_pad_ids"] == 0 for s in decode)
    for step in decode:
        assert step["eager_diff"] <= 1e-6, step


def test_image_prefill_steps_take_the_image_path(engine: dict[str, Any]) -> None:
    prefills = [s for s in engine["steps"] if s["kind"] == "prefill"]
    assert [s["label"] for s in prefills] == ["edit alone", "batch"]


def test_image_prefill_hidden_states_equal_reference(engine: dict[str, Any], reference: Any) -> None:
    """The eager image path: VAE rows through the generation expert, full attention inside each block.
    Every row of the edit's prompt but the VAE latents (which the reference normalises with the generation
    expert's final norm, a weight the thinker does not load) equals the reference's hidden state."""
    ref = reference
    resized = ref.vae_transform.resize(image(0, 64, 48))
    ctx = ref.new_context()
    vae, gen = ref.vae_block_embeddings(resized)
    vit = ref.vit_block_embeddings(resized)
    text = ref._embed(ref.text_ids(EDIT))
    with torch.no_grad():
        vae_hidden = ref._llm(ctx, vae, ref._positions(0, vae.shape[0], shared=True), gen, causal=False)[0]
        ctx = ref._add_block(ctx, vae, gen, "vae")
        vit_hidden = ref._llm(ctx, vit, ref._positions(1, vit.shape[0], shared=True), None, causal=False)[0]
        ctx = ref._add_block(ctx, vit, None, "vit")
        text_hidden = ref._llm(ctx, text, ref._positions(2, text.shape[0], shared=False), None, causal=True)[
            0
        ]
    expected = torch.cat([vae_hidden, vit_hidden, text_hidden]).float()
    ids, hidden = engine["ids"], engine["hidden"]
    assert hidden.shape == expected.shape
    latent = ids == engine["vision_pad"]
    assert int(latent.sum()) == int(gen.sum()) > 0
    diff = (hidden[~latent] - expected[~latent]).abs().max().item()
    assert diff <= ATOL, f"prefill hidden states differ from the reference by {diff}"


def test_batched_understanding_tokens_equal_reference(engine: dict[str, Any], reference: Any) -> None:
    """Decode steps of a batch that started with image blocks give BAGEL's greedy tokens."""
    ctx = reference.add_image(
        reference.new_context(), reference.vae_transform.resize(image(1, 48, 64)), vae=False
    )
    ctx = reference.add_text(ctx, QUESTION)
    out: list[int] = []
    token = reference.bos_id
    for _ in range(DECODE_TOKENS):
        logits, ctx = reference.next_token_logits(ctx, token)
        token = int(torch.argmax(logits))
        out.append(token)
    assert engine["tokens"][1] == out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _engine_main(sys.argv[1], sys.argv[2])
