"""Parking a step-loop state (``diffusion/parking.py``) between two CPU storages, as it parks a state from an
accelerator in host memory: every tensor the state alone reaches moves, views stay views of one moved
storage, what another state shares stays, objects below the state are copied rather than changed, what was
in host memory before stays there on resume, and the values come back exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from vllm_omni_plugin.diffusion.parking import StateParking, state_tensors, storage_bytes, storage_key


class Context(msgspec.Struct):
    kv: Any


class Bank:
    def __init__(self, buffer: torch.Tensor, model: torch.nn.Module) -> None:
        self.buffer = buffer
        self.rows = buffer[1:]  # a view, as a bank's cached attention rows
        self.model = model


@dataclass(eq=False)
class State:
    latents: torch.Tensor
    embeds: tuple[torch.Tensor, torch.Tensor]
    bank: Bank
    contexts: list[Context]
    scheduler: Any
    height: int = 64


def test_a_parked_state_moves_alone_what_it_holds_and_comes_back_exact() -> None:
    shared = torch.randn(4, 8)  # a cached negative prompt's embeddings, another state's too
    model = torch.nn.Linear(2, 2)
    bank = Bank(torch.randn(3, 5), model)
    context = Context(kv=torch.randn(2, 3))
    scheduler = type("Scheduler", (), {})()
    scheduler.sigmas = torch.linspace(1, 0, 5)
    scheduler.config = {"shift": 3.0}
    state = State(torch.randn(1, 4, 8, 8), (shared, torch.randn(4, 8)), bank, [context], scheduler)
    other = State(torch.randn(1, 4, 8, 8), (shared, torch.randn(4, 8)), Bank(torch.randn(3, 5), model), [],
                  None)  # fmt: skip
    before = [t.clone() for t in state_tensors(state)]
    originals = state_tensors(state)  # kept alive: no moved storage can take an original's address
    keys = [storage_key(t) for t in originals]
    weights = [p.data_ptr() for p in model.parameters()]

    parking = StateParking(torch.device("cpu"), room=0, need=lambda r: 0)
    assert parking.resident_bytes([state, other]) == storage_bytes(
        [*state_tensors(state), *state_tensors(other)], torch.device("cpu")
    )
    parked = parking.park(state, kept=[other])
    after = state_tensors(state)
    assert [torch.equal(a, b) for a, b in zip(after, before, strict=True)] == [True] * len(before)
    moved = {storage_key(t) for t in after} - {storage_key(shared)}
    assert parked.storages == moved and not moved & set(keys)  # every one but the shared one, moved
    assert state.embeds[0] is shared and storage_key(other.embeds[0]) == storage_key(shared)
    assert parked.bytes == storage_bytes([t for t in after if t is not shared], torch.device("cpu"))
    # the view still views its buffer; the objects it sits in are copies, the originals untouched
    assert storage_key(state.bank.rows) == storage_key(state.bank.buffer)
    assert state.bank.rows.data_ptr() == state.bank.buffer[1:].data_ptr()
    assert state.bank is not bank and storage_key(bank.buffer) == keys[3] and state.bank.model is model
    assert state.contexts[0] is not context and storage_key(context.kv) in keys
    assert state.scheduler is not scheduler and state.scheduler.config is scheduler.config
    assert [p.data_ptr() for p in model.parameters()] == weights  # weights are never a state's

    host_before = {storage_key(t) for t in state_tensors(state)}
    stays = torch.randn(3)  # in host memory before the state was resumed: it stays where it is
    state.contexts.append(Context(kv=stays))
    assert parking.resume(state, parked) == parked.bytes
    back = state_tensors(state)  # latents, embeddings (2), bank (buffer, rows), contexts (2), sigmas
    assert [torch.equal(a, b) for a, b in zip(back, [*before[:6], stays, before[6]], strict=True)] == [
        True
    ] * len(back)
    assert not {storage_key(t) for t in back if t is not shared and t is not stays} & host_before
    assert state.contexts[-1].kv is stays and state.embeds[0] is shared
    assert storage_key(state.bank.rows) == storage_key(state.bank.buffer)
