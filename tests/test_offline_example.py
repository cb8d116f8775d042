"""The offline example of the docs (docs/offline.md), saved to a file and run with ``python`` as a user would,
on a GLM-Image whose AR model is a compressed-tensors W8A8 int8 checkpoint (vLLM reads its quantization
from its ``config.json``: the deploy file names none; ``test_quantized_ar.py`` names it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vllm_omni_plugin.tiny_models.compressed_tensors import quantized_pipeline
from vllm_omni_testkit.harness.leaks import LeakWatch
from vllm_omni_testkit.harness.server import cpu_test_env

REPO = Path(__file__).resolve().parent.parent


def offline_example() -> str:
    """The first Python block of docs/offline.md ("Offline Python API"), verbatim."""
    page = (REPO / "docs" / "offline.md").read_text()
    match = re.search(r"```python\n(.*?)```", page, re.S)
    assert match is not None, "docs/offline.md has no Python block"
    return match.group(1)


def test_offline_example_runs_as_a_script(tiny_glm_image: Path, tmp_path: Path) -> None:
    code = offline_example()
    assert "__main__" not in code  # verbatim: no guard
    (tmp_path / "example.py").write_text(code)
    # the paths the example names, relative to its cwd
    quantized_pipeline(tiny_glm_image, "vision_language_encoder", tmp_path / "glm-image")
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    watch = LeakWatch().start()
    try:
        result = subprocess.run(
            [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, env=cpu_test_env(),
            timeout=600,
        )  # fmt: skip
    finally:
        watch.stop()
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "(64, 64, 3)", result.stdout[-2000:]
    assert "for CompressedTensorsW8A8Int8" in result.stdout + result.stderr  # vLLM's int8 kernels ran
    assert "Traceback" not in result.stderr and "bootstrapping phase" not in result.stderr
    left = watch.leftovers(grace=15)
    assert not left, left.describe()
