"""The tiny-model builder: offline, deterministic, cached by config hash, loadable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_plugin import tiny_models as tiny
from vllm_omni_plugin.tiny_models.text import text_config
from vllm_omni_testkit.harness.server import cpu_test_env

pytestmark = pytest.mark.slow


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_text_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = tiny.build("text", tmp_path / "a")
    b = tiny.build("text", tmp_path / "b")
    assert _files(a) == _files(b)
    stamp = json.loads((a / tiny.STAMP_FILE).read_text())
    assert stamp["hash"] == tiny.config_hash("text", text_config())
    weights = a / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.build("text", a) == a  # cache hit: nothing rewritten
    assert weights.stat().st_mtime_ns == mtime


def test_stale_stamp_triggers_rebuild(tmp_path: Path) -> None:
    out = tiny.build("text", tmp_path / "m")
    stamp = out / tiny.STAMP_FILE
    stamp.write_text(json.dumps({"hash": "stale"}))
    tiny.build("text", out)
    assert json.loads(stamp.read_text())["hash"] != "stale"


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        tiny.build("text", tmp_path / "x")
    assert (tmp_path / "x" / "precious.txt").read_text() == "keep me"


def test_text_model_is_a_real_qwen2_with_a_chat_template(tiny_text_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_text_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_text_model)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    config = model.config
    assert config.hidden_size // config.num_attention_heads in (32, 64, 80, 96, 112, 128)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("the quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 or tok.eos_token_id in out[0].tolist()


def test_cli_builds_and_reports_errors(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "vllm_omni_plugin.tiny_models"]
    ok = subprocess.run(
        [*cmd, "text", str(tmp_path / "m")], capture_output=True, text=True, env=cpu_test_env()
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(tmp_path / "m")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    bad = subprocess.run(
        [*cmd, "text", str(tmp_path / "busy")], capture_output=True, text=True, env=cpu_test_env()
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error:") and "Traceback" not in bad.stderr
