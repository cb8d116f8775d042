"""The denoiser group's wire (``diffusion/peer_wire.py``): a message's header is msgpack, never a pickle;
what a denoiser call carries comes back as it went (tensors of every dtype and layout, tuples as tuples,
dicts, a diffusers output), and anything else is refused at the sender, naming its type and place."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_omni_plugin.diffusion.peer_wire import (
    ALIGN,
    Call,
    Failure,
    Kept,
    Reply,
    Stop,
    WireError,
    decode,
    encode,
)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    else:
        assert a == b


def test_a_call_comes_back_as_it_went() -> None:
    kwargs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 5, 16, dtype=torch.bfloat16),
        "timestep": torch.tensor(0.5).expand(2),  # stride 0
        "mask": torch.tensor([[True, False, True]]),
        "ids": torch.arange(6, dtype=torch.int64).reshape(3, 2).t(),  # not contiguous
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "img_shapes": [[(1, 4, 4)], [(1, 4, 4)]],
        "txt_seq_lens": [5, 3],
        "attention_kwargs": {"scale": 0.5, "names": ("a", "b"), "nothing": None},
        "return_dict": False,
        "guidance": None,
        "big": 2**63,
        "negative": -(2**63),
        "nan": float("inf"),
    }
    kept = {
        "rows": Kept(7, "some.module:Rows", {"contexts": torch.ones(2, 3), "lengths": [1, 2], "block": 4})
    }
    message = decode(encode(Call("rows", kwargs, kept)))
    assert isinstance(message, Call) and message.mode == "rows"
    _same(message.kwargs, kwargs)
    assert message.kept["rows"].key == 7 and message.kept["rows"].cls == "some.module:Rows"
    _same(message.kept["rows"].state, kept["rows"].state)
    again = decode(encode(Call("sequence", {"x": torch.ones(1)}, {"rows": Kept((3, "a"))})))
    assert isinstance(again, Call) and again.kept["rows"] == Kept((3, "a"))


def test_tensors_are_views_of_the_message_aligned_or_moved_to_a_device() -> None:
    buffer = encode(Reply((torch.ones(3, dtype=torch.uint8), torch.full((5,), 2.0, dtype=torch.float64))))
    message = decode(buffer)
    assert isinstance(message, Reply)
    small, wide = message.output
    assert wide.data_ptr() % ALIGN == 0 and small.untyped_storage().data_ptr() == buffer.data_ptr()
    on_cpu = decode(buffer, torch.device("cpu"))
    assert isinstance(on_cpu, Reply) and torch.equal(on_cpu.output[1], wide)


def test_a_diffusers_output_travels_as_its_class_and_fields() -> None:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    sample = torch.randn(1, 4, 2, 2)
    message = decode(encode(Reply(Transformer2DModelOutput(sample=sample))))
    assert isinstance(message, Reply) and type(message.output) is Transformer2DModelOutput
    assert torch.equal(message.output.sample, sample)


def test_replies_failures_and_stops() -> None:
    assert decode(encode(Reply(None))) == Reply(None)
    assert decode(encode(Failure("ValueError: no"))) == Failure("ValueError: no")
    assert decode(encode(Stop())) == Stop()


class _Cache:
    pass


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"kv_caches": _Cache()}, r"test_peer_wire\._Cache \(argument kv_caches\)"),
        (
            {"attention_kwargs": {"x": [1, object()]}},
            r"builtins\.object \(argument attention_kwargs\['x'\]\[1\]\)",
        ),
        ({"a": {1: 2}}, r"a dict keyed by int \(argument a\)"),
        ({"a": 2**64}, r"the int 18446744073709551616 \(argument a\)"),
        ({"a": torch.float32}, r"torch\.dtype \(argument a\)"),
    ],
)
def test_what_the_wire_cannot_carry_is_refused_at_the_sender(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(WireError, match=named):
        encode(Call("rows", kwargs))


def test_a_reply_that_cannot_travel_names_the_output() -> None:
    with pytest.raises(WireError, match=r"\(the output\[0\]\)"):
        encode(Reply((_Cache(),)))


def test_the_header_is_msgpack() -> None:
    import msgspec

    buffer = encode(Call("rows", {"x": torch.ones(2), "n": 3}))
    size = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    header = msgspec.msgpack.decode(buffer[8 : 8 + size].numpy().tobytes())
    assert header["type"] == "call" and header["kwargs"]["n"] == 3
    assert header["kwargs"]["x"] == {
        "type": "tensor",
        "offset": 0,
        "nbytes": 8,
        "shape": [2],
        "dtype": "float32",
    }
