"""The AR stage on stock vLLM: Omni schedulers and workers in real vLLM engines and with vLLM's real
scheduler/runner classes."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ENGINE_SCRIPTS, run_result_script


@pytest.fixture(scope="module")
def resume(tiny_text_model: Path) -> dict:
    return run_result_script(ENGINE_SCRIPTS / "resume_path.py", str(tiny_text_model))


def test_stock_runner_reproduces_the_seed_keyerror(resume: dict) -> None:
    """The test can fail: vLLM's own runner dies exactly as in the production crash."""
    stock = resume["stock_runner"]
    assert stock["error"] == "KeyError: 'r0'"
    assert "all_token_ids[req_id]" in stock["trace"]


@pytest.fixture(scope="module")
def async_resume(tiny_text_model: Path) -> dict:
    return run_result_script(ENGINE_SCRIPTS / "async_resume.py", str(tiny_text_model))


def test_the_cpu_runner_reproduces_the_gpu_async_state(async_resume: dict) -> None:
    """Async scheduling on: sampled tokens are -1 placeholders in the runner, as on a GPU."""
    assert async_resume["async"] is True
    assert async_resume["placeholders"] == {
        "output_token_ids": [-1],
        "token_ids_cpu": -1,
        "is_token_id": True,
    }


def test_a_placeholder_is_never_taken_for_a_token(async_resume: dict) -> None:
    assert async_resume["placeholder_row"] is None


def test_a_request_back_with_the_scheduler_entry_continues_exactly(async_resume: dict) -> None:
    """What the Omni scheduler sends: the request resumes with the token an uninterrupted run gets."""
    ref = async_resume["reference"]
    back = async_resume["filled"]
    assert back["error"] is None and back["dropped"] == []
    assert back["sampled"] == {"a_filled": [ref["a_ref"][1]], "b_filled": [ref["b_ref"][2]]}


def test_a_request_back_without_the_entry_is_left_out_not_fatal(async_resume: dict) -> None:
    """The seed's state through execute_model: the request is left out of the step, the step's output
    says so for the scheduler, and the request beside it gets its reference token, now and next step."""
    ref = async_resume["reference"]
    seed = async_resume["seed"]
    assert seed["error"] is None
    assert seed["dropped"] == ["a_seed"]
    assert seed["sampled"] == {"b_seed": [ref["b_ref"][2]]}
    assert async_resume["seed_after"]["error"] is None and list(async_resume["seed_after"]["sampled"]) == [
        "b_seed"
    ]


def test_a_step_whose_only_request_is_left_out_does_not_reach_the_forward(async_resume: dict) -> None:
    alone = async_resume["all_dropped"]
    assert alone["error"] is None, alone.get("trace")
    assert alone["dropped"] == ["a_alone"] and alone["sampled"] == {}


@pytest.mark.parametrize("cls", ["OmniARScheduler", "OmniARAsyncScheduler"])
def test_each_scheduler_variant_fills_all_token_ids(resume: dict, cls: str) -> None:
    assert resume[f"fills_{cls}"] is True
    assert resume["fills_Scheduler"] is False  # stock vLLM leaves this case out


@pytest.mark.parametrize("cls", ["OmniARScheduler", "OmniARAsyncScheduler"])
def test_with_the_v2_runner_nothing_is_added(resume: dict, cls: str) -> None:
    """vLLM's V2 model runner never reads all_token_ids (a resumed request comes back whole)."""
    assert resume[f"v2_fills_{cls}"] is False


def test_the_override_takes_the_arguments_of_vllm_034(resume: dict) -> None:
    """vLLM 0.34's ``_make_cached_request_data`` has no ``resumed_reqs`` (a TypeError for an override of
    0.33's five parameters): ours passes whatever the base takes and reads the requests by name."""
    assert resume["on_034_fills"] == [True, True]


@pytest.mark.parametrize("cls", ["OmniARScheduler", "OmniARAsyncScheduler"])
def test_left_out_request_fails_alone_with_an_error(resume: dict, cls: str) -> None:
    outputs = resume[f"dropped_{cls}"]
    assert outputs["a"][0] == [] and outputs["a"][1] == "error" and "could not rebuild" in outputs["a"][2]
    assert outputs["b"][0] == [42] and outputs["b"][1] == "None"
    assert resume[f"still_serving_{cls}"] == ["b"]


def test_hooks_and_stage_outputs(resume: dict) -> None:
    assert resume["hook_events"] == [["prefill_finished", "h"], ["trigger", "h", 77]]
    # held until the request finishes, then delivered with its final output
    assert resume["stage_output_params_first"] is None
    assert resume["stage_output_params_final"] == [{"omni": {"source_prior_token_ids": [1, 2, 3]}}, "length"]


def test_scheduler_variants_match_stock_vllm_under_preemption(tiny_text_model: Path) -> None:
    """Greedy tokens of a real engine: stock vLLM vs our scheduler + worker (both variants), with a KV
    cache small enough to force preemptions."""
    result = run_result_script(
        ENGINE_SCRIPTS / "greedy_variants.py",
        str(tiny_text_model),
        str(64 << 10),
        "60",
        "stock,omni_sync,omni_async_variant",
    )
    stock = result["stock"]["tokens"]
    assert all(len(t) == 60 for t in stock)
    assert result["stock"]["preemptions"] > 0
    for name in ("omni_sync", "omni_async_variant"):
        assert result[name]["tokens"] == stock, name
        assert result[name]["preemptions"] > 0


def test_context_export_connector_holds_blocks_until_the_copy_is_reported(tiny_text_model: Path) -> None:
    """The scheduler side of the context export KV connector in vLLM's real (Omni) scheduler: the
    request whose prompt ends this step is sent to the worker with its blocks; it finishes in that step
    (max_tokens=1) and still gets its handle; its blocks stay allocated until the worker reports the copy,
    then are freed; nothing is exported twice or left behind."""
    r = run_result_script(ENGINE_SCRIPTS / "context_export_blocks.py", str(tiny_text_model))
    assert r["connector"] == "ContextExportConnector"
    assert r["exports"] == [["ctx", r["ctx_blocks"], 20, 20]] and len(r["ctx_blocks"]) == 2
    assert r["ctx_finished"] == "length"
    assert r["ctx_params"]["omni"]["context"]["kv"] == {"handle": "h"}
    assert r["plain_params"] is None
    assert r["held_after_finish"] is True
    assert r["free_while_held"] == r["free_before"] - 2 - r["plain_blocks"]
    assert r["finished_sent_to_worker"] == ["ctx"] and r["no_second_export"] is True
    assert r["held_after_copy"] is False
    assert r["free_after_copy"] == r["free_before"] - r["plain_blocks"]
    assert r["stage_outputs_left"] == 0
