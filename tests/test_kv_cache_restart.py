"""A restarted AR replica gets the KV cache its first start measured, not what profiling a busy device
would give it now (a DiT sharing the GPU has grown meanwhile).

On CPU, vLLM takes the KV size from ``VLLM_CPU_KVCACHE_SPACE`` (the first start here), else from the
memory it finds free (``gpu_memory_utilization`` of the machine minus what the process holds). The
restart runs without the variable, as a GPU restart runs on a device that changed: an engine that sized
its cache again would get another block count (or fail to start), one that reuses the measured size gets
the same.

Its last test checks that an AR engine scheduling by priority takes the priority our client passes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_omni_plugin.schedulers import OMNI_AR_SCHEDULER
from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.core_types import StageLLMCoreRequest
from vllm_omni_plugin.stage.errors import StageDeadError
from vllm_omni_plugin.stage.llm_core_client import StageLLMCoreClient
from vllm_omni_testkit.holds import HoldPoints

GIB = 1 << 30
TOKEN_BYTES = 2 * 2 * 1 * 32 * 4
"""The tiny text model's KV per token: 2 layers x K and V x 1 KV head x head size 32 x float32."""


def engine_args(model: Path, **extra: Any) -> dict[str, Any]:
    # gpu_memory_utilization 0.05: an engine that sized its cache again (no VLLM_CPU_KVCACHE_SPACE) asks
    # for little memory, and gets a size other than 1 GiB or fails to start; either fails the test.
    return {"model": str(model), "dtype": "float32", "enforce_eager": True, "max_model_len": 256,
            "max_num_seqs": 2, "gpu_memory_utilization": 0.05, **extra}  # fmt: skip


def request(request_id: str, priority: int = 0, tokens: int = 4) -> StageLLMCoreRequest:
    return StageLLMCoreRequest(
        request_id=request_id,
        stage_id=0,
        prompt_token_ids=[5, 6, 7, 8],
        sampling_params={"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        priority=priority,
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


FIXED_KV_BYTES = 8 << 20


@dataclass
class FixedEngine:
    """One engine for the module's last tests: its KV cache fixed by the engine arguments, one sequence at
    a time, scheduling by priority, its hold points armed by ``holds``; ``run`` runs a coroutine on the
    event loop the client lives on (a thread of its own)."""

    client: StageLLMCoreClient
    holds: HoldPoints
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


@pytest.fixture(scope="module")
def fixed_engine(tiny_text_model: Path) -> Iterator[FixedEngine]:
    holds = HoldPoints()
    args = engine_args(
        tiny_text_model, kv_cache_memory_bytes=FIXED_KV_BYTES, max_num_seqs=1, scheduling_policy="priority",
        scheduler_cls=OMNI_AR_SCHEDULER,
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fixed-engine-loop", daemon=True)
    thread.start()
    engine = FixedEngine(StageLLMCoreClient(0, 0, args, env=holds.env), holds, loop)
    try:
        engine.run(engine.client.start())
        yield engine
    finally:
        holds.release_all()
        engine.run(engine.client.shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        holds.remove()


def test_a_kv_cache_size_the_deploy_file_fixed_is_left_as_it_is(fixed_engine: FixedEngine) -> None:
    """``kv_cache_memory_bytes`` in the engine arguments: the user's size, nothing measured on top."""
    client = fixed_engine.client
    assert client.kv_cache_args == {}
    assert client.launch_args()["kv_cache_memory_bytes"] == FIXED_KV_BYTES
    block_bytes = client.engine.vllm_config.cache_config.block_size * TOKEN_BYTES
    assert client.kv_cache_blocks == FIXED_KV_BYTES // block_bytes


def test_an_engine_scheduling_by_priority_takes_the_better_of_its_waiting_requests_first(
    fixed_engine: FixedEngine,
) -> None:
    """``scheduling_policy: priority`` on an AR stage is vLLM's: the priority our client passes decides
    which waiting request the engine takes next. One sequence at a time; a request runs, held in the
    engine after its first step, while a worse one and then a better one arrive; once the engine's own
    stats count both waiting, the running one goes on: the better one runs next, though it came last."""
    client = fixed_engine.client
    finished: list[str] = []

    async def run(name: str, priority: int, tokens: int) -> None:
        await client.generate(request(name, priority, tokens))
        finished.append(name)

    async def main() -> None:
        with fixed_engine.holds.arm("ar.step") as hold:
            tasks = [asyncio.ensure_future(run("first", 0, 64))]
            await asyncio.to_thread(hold.wait)
            for name, priority in (("worse", 5), ("better", -5)):
                tasks.append(asyncio.ensure_future(run(name, priority, 4)))
                while name not in client.inflight:
                    await asyncio.sleep(0.01)
            steps = 1
            while client.health().get("waiting") != 2:
                assert steps < 60, "the engine never counted both requests waiting"
                await asyncio.to_thread(hold.next)
                await asyncio.sleep(0.05)  # the step's stats reach the client's output handler
                steps += 1
            assert finished == []
        await asyncio.gather(*tasks)
        assert finished == ["first", "better", "worse"]

    fixed_engine.run(main())
