"""AR stages on quantized checkpoints: the tiny BAGEL with its thinker written as a compressed-tensors W8A8
int8 checkpoint (``tiny_models/compressed_tensors.py``) serves end to end, the AR stage running vLLM's
int8 kernels (the deploy file's ``quantization: compressed-tensors``), and its DiT stage reads the same
checkpoint, the int8 weights dequantized as it loads them. GLM-Image on such a checkpoint is the offline
example's model (``test_offline_example.py``: vLLM reads the method from the checkpoint's config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from vllm_omni_plugin.tiny_models.compressed_tensors import write_w8a8_int8

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

DEPLOY_DIR = Path(__file__).resolve().parent.parent / "src" / "vllm_omni_plugin" / "deploy"
INT8_KERNEL = "for CompressedTensorsW8A8Int8"
"""vLLM's log line naming the int8 kernel it picked for the scheme (``Selected <kernel> for ...``)."""


def quantized_deploy(name: str, folder: Path) -> Path:
    deploy = yaml.safe_load((DEPLOY_DIR / name).read_text())
    deploy["stages"][0]["quantization"] = "compressed-tensors"
    path = folder / name
    path.write_text(yaml.safe_dump(deploy))
    return path


def serve_one(model: Path, deploy: Path, **request: Any) -> Any:
    from vllm_omni_plugin.entrypoints.omni import Omni
    from vllm_omni_plugin.stage.orchestrator import OmniRequest

    with Omni(str(model), deploy_config=str(deploy)) as omni:
        assert omni.deployment.stage(0).engine_args["quantization"] == "compressed-tensors"
        (result,) = omni.generate([OmniRequest(prompt="a red fox", seed=1, height=64, width=64, **request)])
    return result


def test_bagel_serves_with_an_int8_thinker_and_its_dit_reads_the_same_checkpoint(
    tiny_bagel: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from vllm_omni_plugin.models.bagel.weights import CheckpointReader

    model = write_w8a8_int8(tiny_bagel, tmp_path / "bagel")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    with (
        CheckpointReader(tiny_bagel / "ema.safetensors") as plain,
        CheckpointReader(model / "ema.safetensors") as q,
    ):
        original, read = plain.tensor(name, dtype=torch.float32), q.tensor(name, dtype=torch.float32)
        scale = q.tensor(f"{name}_scale", dtype=torch.float32)
        assert q.entries[name].dtype == "I8"
        assert torch.all((read - original).abs() <= scale / 2 + 1e-6)  # int8 * scale, a rounding away
        gen = name.replace("q_proj", "q_proj_moe_gen")
        assert q.entries[gen].dtype == plain.entries[gen].dtype  # the generation expert stays as it was
    result = serve_one(model, quantized_deploy("tiny_bagel_cpu.yaml", tmp_path))
    assert result.ok, result.error
    assert result.output.image.shape == (64, 64, 3) and np.asarray(result.output.image).std() > 0
    assert INT8_KERNEL in "".join(capfd.readouterr())
