"""Which ``vllm`` command lines the session's fork server starts as forks (the others start fresh)."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_omni_testkit.harness.forks import VllmForks
from vllm_omni_testkit.harness.server import bin_script, cpu_test_env

SERVE = [bin_script("vllm"), "serve", "/models/any", "--omni"]


def test_only_the_stock_vllm_under_the_fork_servers_environment_forks() -> None:
    env = cpu_test_env()
    forks = VllmForks(env)
    # the test seam's variables and those read only when used may differ
    assert forks.can_fork(SERVE, {**env, "VLLM_OMNI_HOLD_DIR": "/tmp/h", "RAY_ADDRESS": "127.0.0.1:1"})
    # anything imported could read these: a fresh process
    assert not forks.can_fork(SERVE, {**env, "VLLM_PLUGINS": ""})
    assert not forks.can_fork(SERVE, {**env, "PYTHONPATH": "/site"})
    assert not forks.can_fork(SERVE, {**env, "OMP_NUM_THREADS": "2"})
    assert not forks.can_fork(SERVE, {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"})
    # another program, or another environment's vllm
    assert not forks.can_fork([sys.executable, "-m", "vllm_omni_plugin"], env)
    assert not forks.can_fork([str(Path("/elsewhere/bin/vllm")), "serve"], env)
    assert not forks.can_fork([], env)
