"""``scripts/gpu_check.sh`` on a machine without a GPU, and its serving driver run on the CPU: the same
path (server through the stock ``vllm`` script, requests, CPU references, the table) that a CUDA host
runs, so a device run is not the first time it executes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_omni_testkit.harness.forks import run_to_end
from vllm_omni_testkit.harness.server import cpu_test_env

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_the_script_says_in_one_line_that_it_needs_cuda() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "needs a CUDA GPU" in result.stderr


def test_the_driver_serves_and_compares_on_cpu(tmp_path: Path) -> None:
    """The tiny GLM-Image served with the plugin's runner choice: text to image and an edit, each equal
    to the CPU reference, and the table says so."""
    # a fork of the session's fork server (vLLM, torch and diffusers imported), as python -m runs it
    result = run_to_end(
        [sys.executable, "-m", "vllm_omni_testkit.harness.gpu_check", "--device", "cpu", "--runners", "choice",
         "--models", "glm-image", "--out", str(tmp_path)],
        cpu_test_env(), timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("|") for line in (tmp_path / "summary.txt").read_text().splitlines()[1:]]
    cells = [[cell.strip() for cell in row] for row in rows]
    assert [(c[0], c[1], c[2], c[3], c[6]) for c in cells] == [
        ("glm-image", "choice", "start", "ready", "pass"),
        ("glm-image", "choice", "t2i", "200", "pass"),
        ("glm-image", "choice", "edit", "200", "pass"),
    ]
    assert cells[0][7] == "V1 runner; no CUDA graphs"
    assert "every row passed" in result.stdout
