"""The AR stage on stock vLLM: Omni schedulers and workers in real vLLM engines and with vLLM's real
scheduler/runner classes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_plugin.testing.server import cpu_test_env

SCRIPTS = Path(__file__).parent / "engine_scripts"


def run_script(name: str, *args: str, timeout: float = 600) -> dict:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cpu_test_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def resume(tiny_text_model: Path) -> dict:
    return run_script("resume_path.py", str(tiny_text_model))


def test_stock_runner_reproduces_the_seed_keyerror(resume: dict) -> None:
    """The test can fail: vLLM's own runner dies exactly as in the production crash."""
    stock = resume["stock_runner"]
    assert stock["error"] == "KeyError: 'r0'"
    assert "all_token_ids[req_id]" in stock["trace"]


def test_omni_runner_rebuilds_the_resumed_request(resume: dict) -> None:
    omni = resume["omni_runner"]
    assert omni["error"] is None
    assert omni["in_batch"] is True
    assert omni["output_token_ids"] == [201, 202, 203]
    # the correct continuation: the persistent batch holds prompt + the outputs so far
    assert omni["batch_tokens"] == [11, 12, 13, 14, 15, 16, 17, 18, 201, 202, 203]


def test_unrecoverable_request_is_left_out_not_fatal(resume: dict) -> None:
    lost = resume["omni_runner_unrecoverable"]
    assert lost["error"] is None  # no KeyError: the engine goes on
    assert lost["in_batch"] is False  # the request was left out of the step ...
    assert lost["dropped"] == ["r0"]  # ... and the step's output says so, for the scheduler
    assert resume["omni_runner"]["dropped"] == []


@pytest.mark.parametrize("cls", ["OmniARScheduler", "OmniARAsyncScheduler"])
def test_each_scheduler_variant_fills_all_token_ids(resume: dict, cls: str) -> None:
    assert resume[f"fills_{cls}"] is True
    assert resume["fills_Scheduler"] is False  # stock vLLM leaves this case out


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
    result = run_script(
        "greedy_variants.py", str(tiny_text_model), str(64 << 10), "60", "stock,omni_sync,omni_async_variant"
    )
    stock = result["stock"]["tokens"]
    assert all(len(t) == 60 for t in stock)
    assert result["stock"]["preemptions"] > 0
    for name in ("omni_sync", "omni_async_variant"):
        assert result[name]["tokens"] == stock, name
        assert result[name]["preemptions"] > 0
