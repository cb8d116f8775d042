"""A restarted AR replica gets the KV cache its first start measured, not what profiling a busy device
would give it now (a DiT sharing the GPU has grown meanwhile).

On CPU, vLLM takes the KV size from ``VLLM_CPU_KVCACHE_SPACE`` (the first start here), else from the
memory it finds free (``gpu_memory_utilization`` of the machine minus what the process holds). The
restart runs without the variable, as a GPU restart runs on a device that changed: an engine that sized
its cache again would get another block count (or fail to start), one that reuses the measured size gets
the same.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.core_types import StageLLMCoreRequest
from vllm_omni_plugin.stage.errors import StageDeadError
from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient

GIB = 1 << 30
TOKEN_BYTES = 2 * 2 * 1 * 32 * 4
"""The tiny text model's KV per token: 2 layers x K and V x 1 KV head x head size 32 x float32."""


def engine_args(model: Path, **extra: Any) -> dict[str, Any]:
    # gpu_memory_utilization 0.05: an engine that sized its cache again (no VLLM_CPU_KVCACHE_SPACE) asks
    # for little memory, and gets a size other than 1 GiB or fails to start; either fails the test.
    return {"model": str(model), "dtype": "float32", "enforce_eager": True, "max_model_len": 256,
            "max_num_seqs": 2, "gpu_memory_utilization": 0.05, **extra}  # fmt: skip


def request(request_id: str) -> StageLLMCoreRequest:
    return StageLLMCoreRequest(
        request_id=request_id,
        stage_id=0,
        prompt_token_ids=[5, 6, 7, 8],
        sampling_params={"max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    )


async def wait_ready(client: StageLLMCoreClient, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while client.state != StageState.READY:
        assert client.state != StageState.DEAD, "the replica could not be restarted (see the log)"
        assert time.monotonic() < deadline, f"no restart within {timeout} s"
        await asyncio.sleep(0.05)


def test_a_restarted_engine_core_comes_back_with_the_kv_cache_its_first_start_measured(
    tiny_text_model: Path,
) -> None:
    async def main() -> None:
        client = StageLLMCoreClient(0, 0, engine_args(tiny_text_model), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            await client.start()
            blocks = client.kv_cache_blocks
            assert blocks and client.health()["kv_cache_blocks"] == blocks
            measured = client.kv_cache_args
            assert measured["num_gpu_blocks_override"] == blocks
            # vLLM made as many blocks of 1 GiB as fit: our bytes per block are its own
            block_bytes = client.engine.vllm_config.cache_config.block_size * TOKEN_BYTES
            assert measured["kv_cache_memory_bytes"] == blocks * block_bytes
            assert GIB - block_bytes < measured["kv_cache_memory_bytes"] <= GIB
            assert (await client.generate(request("before"))).token_ids

            client.env.pop("VLLM_CPU_KVCACHE_SPACE")  # the device is not what it was at the first start
            killed = client.pid
            assert killed is not None
            os.kill(killed, signal.SIGKILL)
            with pytest.raises(StageDeadError):
                await client.generate(request("in flight"))
            await wait_ready(client)

            assert client.restarts == 1 and client.pid != killed
            assert client.kv_cache_blocks == blocks
            assert client.launch_args()["kv_cache_memory_bytes"] == measured["kv_cache_memory_bytes"]
            restarted = client.engine.vllm_config.cache_config
            assert restarted.kv_cache_memory_bytes == measured["kv_cache_memory_bytes"]
            assert restarted.num_gpu_blocks == blocks
            assert (await client.generate(request("after"))).token_ids
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_a_kv_cache_size_the_deploy_file_fixed_is_left_as_it_is(tiny_text_model: Path) -> None:
    """``kv_cache_memory_bytes`` in the engine arguments: the user's size, nothing measured on top."""

    async def main() -> None:
        fixed = 8 << 20
        client = StageLLMCoreClient(0, 0, engine_args(tiny_text_model, kv_cache_memory_bytes=fixed))
        try:
            await client.start()
            assert client.kv_cache_args == {}
            assert client.launch_args()["kv_cache_memory_bytes"] == fixed
            block_bytes = client.engine.vllm_config.cache_config.block_size * TOKEN_BYTES
            assert client.kv_cache_blocks == fixed // block_bytes
        finally:
            await client.shutdown()

    asyncio.run(main())
