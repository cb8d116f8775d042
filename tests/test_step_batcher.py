"""The step batcher alone, on a small torch denoiser (no pipeline, no model): which calls share a forward,
how they are joined and split, when a step boundary fires, and what a failure or a close does; and which
groups the loop starts within the memory budget. The pipelines themselves run through it in
``test_step_batching.py``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_plugin.diffusion.step_batching import RUN_AT_ONCE, RowAborted, SameValue, StepBatcher
from vllm_omni_plugin.stage.diffusion_loop import GroupBudget

WAIT_S = 30.0


class Denoiser(torch.nn.Module):
    """Per row: ``hidden_states * timestep + the sum of the shared ids``; fails on a negative timestep."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: Any = None,
        return_dict: bool = True,
    ) -> tuple[torch.Tensor]:
        if bool((timestep < 0).any()):
            raise RuntimeError("negative timestep")
        self.batches.append(hidden_states.shape[0])
        shift = img_ids.sum() if img_ids is not None else 0
        return (hidden_states * timestep[:, None] + shift,)


@pytest.fixture
def denoiser() -> Denoiser:
    return Denoiser()


@pytest.fixture
def batcher(denoiser: Denoiser) -> Iterator[StepBatcher]:
    steps = StepBatcher(denoiser, max_rows=8, joins={"img_ids": SameValue()})
    yield steps
    steps.close()


def call_in_thread(batcher: StepBatcher, row: str, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = batcher.proxy(row)(**kwargs)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_waiting(batcher: StepBatcher, *rows: str) -> None:
    with batcher._lock:
        assert batcher._lock.wait_for(lambda: set(rows) <= batcher._waiting.keys(), WAIT_S)


def test_calls_waiting_at_one_boundary_share_a_forward_and_get_their_own_rows(
    batcher: StepBatcher, denoiser: Denoiser
) -> None:
    ids = torch.ones(2, 3)  # shared: its first dimension equals the first call's rows by chance
    a_in, b_in = torch.arange(4.0).reshape(2, 2), torch.arange(6.0).reshape(3, 2)
    a_t, b_t = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    holder, _ = call_in_thread(batcher, "holder", hidden_states=torch.zeros(1, 2), timestep=torch.ones(1))
    holder.join(WAIT_S)  # the holder ran alone and now denoises: the next boundary waits for it
    assert denoiser.batches == [1]
    a, a_out = call_in_thread(batcher, "a", hidden_states=a_in, timestep=a_t, img_ids=ids, return_dict=False)
    b, b_out = call_in_thread(batcher, "b", hidden_states=b_in, timestep=b_t, img_ids=ids, return_dict=False)
    wait_waiting(batcher, "a", "b")
    assert denoiser.batches == [1]  # both wait for the holder's next call
    batcher.leave("holder")
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert denoiser.batches == [1, 5]  # one forward of both calls' rows
    torch.testing.assert_close(a_out["result"][0], a_in * a_t[:, None] + 6)
    torch.testing.assert_close(b_out["result"][0], b_in * b_t[:, None] + 6)


def test_calls_that_differ_in_a_shared_value_or_a_row_shape_run_apart(
    batcher: StepBatcher, denoiser: Denoiser
) -> None:
    calls = [
        ("a", torch.zeros(1, 2), torch.ones(2, 3)),
        ("b", torch.zeros(1, 2), torch.zeros(2, 3)),  # other ids
        ("c", torch.zeros(1, 4), torch.ones(2, 3)),  # other row shape
        ("d", torch.zeros(2, 2), torch.ones(2, 3)),  # joins a
    ]
    holder, _ = call_in_thread(batcher, "holder", hidden_states=torch.zeros(1, 2), timestep=torch.ones(1))
    holder.join(WAIT_S)
    threads = [
        call_in_thread(batcher, row, hidden_states=h, timestep=torch.ones(h.shape[0]), img_ids=i)[0]
        for row, h, i in calls
    ]
    wait_waiting(batcher, "a", "b", "c", "d")
    batcher.leave("holder")
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(denoiser.batches[1:]) == [1, 1, 3]


def test_a_call_whose_join_says_run_at_once_runs_alone_on_its_thread(denoiser: Denoiser) -> None:
    class Writer:
        def key(self, value: Any) -> Any:
            return RUN_AT_ONCE if value == "write" else "read"

        def join(self, values: list[Any], rows: list[int]) -> Any:
            return values[0]

    steps = StepBatcher(
        lambda **kw: denoiser(**{k: v for k, v in kw.items() if k != "mode"}),
        max_rows=8,
        joins={"mode": Writer()},
    )
    try:
        holder, _ = call_in_thread(
            steps, "holder", hidden_states=torch.zeros(1, 2), timestep=torch.ones(1), mode="read"
        )
        holder.join(WAIT_S)
        # the holder denoises and has not called again, yet a write runs at once
        out = steps.proxy("w")(hidden_states=torch.ones(1, 2), timestep=torch.ones(1), mode="write")
        torch.testing.assert_close(out[0], torch.ones(1, 2))
        assert steps.in_flight == 1  # the writer did not join the step boundaries
    finally:
        steps.close()


def test_a_failing_forward_fails_its_calls_only_and_the_steps_go_on(
    batcher: StepBatcher, denoiser: Denoiser
) -> None:
    bad = batcher.proxy("bad")
    with pytest.raises(RuntimeError, match="negative timestep"):
        bad(hidden_states=torch.zeros(1, 2), timestep=-torch.ones(1))
    batcher.leave("bad")
    out = batcher.proxy("good")(hidden_states=torch.ones(1, 2), timestep=2 * torch.ones(1))
    torch.testing.assert_close(out[0], 2 * torch.ones(1, 2))


def test_positional_arguments_are_joined_by_name(batcher: StepBatcher) -> None:
    out = batcher.proxy("unet")(torch.ones(1, 2), 3 * torch.ones(1), return_dict=False)
    torch.testing.assert_close(out[0], 3 * torch.ones(1, 2))


def test_close_fails_the_waiting_calls(denoiser: Denoiser) -> None:
    steps = StepBatcher(denoiser, max_rows=8)
    holder, _ = call_in_thread(steps, "holder", hidden_states=torch.zeros(1, 2), timestep=torch.ones(1))
    holder.join(WAIT_S)
    waiting, out = call_in_thread(steps, "w", hidden_states=torch.zeros(1, 2), timestep=torch.ones(1))
    wait_waiting(steps, "w")
    steps.close()
    waiting.join(WAIT_S)
    assert isinstance(out["error"], RowAborted)
    with pytest.raises(RowAborted):
        steps.proxy("late")(hidden_states=torch.zeros(1, 2), timestep=torch.ones(1))


def test_groups_in_flight_keep_to_the_memory_budget_together() -> None:
    """Each row needs 10 bytes; the budget is 30: groups start in order while the sum fits, the first
    waiting one always on an idle stage, and a finished group makes room."""
    budget = GroupBudget((30, lambda group: 10 * len(group)))
    key = "".join
    budget.admit([["a", "b"], ["c"], ["d", "e"]])
    assert budget.start(key) == [["a", "b"], ["c"]]
    assert budget.waiting == [["d", "e"]] and budget.waiting_rows == 2
    assert budget.start(key) == []  # 30 in flight: 20 more would not fit
    budget.done("c")
    assert budget.start(key) == []  # 20 in flight: still no room for 20 beside it
    budget.done("ab")
    assert budget.start(key) == [["d", "e"]]
    budget.done("de")
    budget.admit([["f", "g", "h", "i"]])  # more than the budget: admitted alone, it starts on an idle stage
    assert budget.start(key) == [["f", "g", "h", "i"]]
    unbounded = GroupBudget((None, lambda group: 10**9))
    unbounded.admit([["a"], ["b"]])
    assert unbounded.start(key) == [["a"], ["b"]]


def test_groups_in_flight_keep_to_every_budget_at_once() -> None:
    """Memory (10 per row, limit 40) and step tokens (a row's own count, limit 5): a group starts only
    when both sums fit."""
    tokens = {"a": 1, "b": 1, "c": 4, "d": 1}
    budget = GroupBudget(
        (40, lambda group: 10 * len(group)), (5, lambda group: sum(tokens[r] for r in group))
    )
    key = "".join
    budget.admit([["a", "b"], ["c"], ["d"]])
    assert budget.start(key) == [["a", "b"]]  # memory 20 + 10 fits, tokens 2 + 4 do not
    budget.done("ab")
    assert budget.start(key) == [["c"], ["d"]]  # tokens 4 + 1, memory 20
    assert budget.in_flight == {"c": [10, 4], "d": [10, 1]}


@pytest.mark.parametrize("guided", [False, True])
def test_an_aborted_request_s_rows_leave_its_group_s_forwards(
    batcher: StepBatcher, denoiser: Denoiser, guided: bool
) -> None:
    """A group of three requests (two rows each with batched guidance: ``cat([negative, positive])``)
    whose middle one is aborted: the forward runs the other rows only, they get their own results, and
    the aborted rows get zeros."""
    alive = [True, True, True]
    batcher.track("g", lambda: list(alive))
    rows = 6 if guided else 3
    hidden = torch.arange(1.0, rows + 1)[:, None].repeat(1, 2)
    timestep = torch.full((rows,), 2.0)
    proxy = batcher.proxy("g", 3)
    (full,) = proxy(hidden_states=hidden, timestep=timestep, img_ids=torch.ones(3))
    assert denoiser.batches == [rows] and torch.equal(full, hidden * 2 + 3)
    alive[1] = False
    (out,) = proxy(hidden_states=hidden, timestep=timestep, img_ids=torch.ones(3))
    dead = [1, 4] if guided else [1]
    live = [i for i in range(rows) if i not in dead]
    assert denoiser.batches[-1] == len(live)
    assert torch.equal(out[live], (hidden * 2 + 3)[live]) and not out[dead].any()
    alive[0] = alive[2] = False  # every request aborted: the call runs whole (the group stops at its end)
    proxy(hidden_states=hidden, timestep=timestep, img_ids=torch.ones(3))
    assert denoiser.batches[-1] == rows
    batcher.leave("g")
