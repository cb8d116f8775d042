"""Connectors: round trips in and across processes, segment lifetime (get, lease, close, crash), the
shared-memory pool (views, reuse, reclaim, fallback), counters."""

from __future__ import annotations

import gc
import io
import os
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from helpers import our_segments, unwire, wire
from vllm_omni_plugin.connectors import CONNECTOR_CLASSES
from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorHealth,
    ConnectorTimeoutError,
    InProcessConnector,
    OmniConnector,
    make_connector,
)
from vllm_omni_plugin.connectors.shared_memory import (
    DEFAULT_POOL_BYTES,
    SEGMENT_PREFIX,
    SharedMemoryConnector,
    sweep_orphaned_segments,
)

SHM = Path("/dev/shm")


def sample_values() -> list[torch.Tensor | bytes]:
    """The same values in every process (seeded), covering dtypes, shapes and bytes."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, 3, 4, generator=gen),
        torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (6,), generator=gen, dtype=torch.int64),
        torch.randint(0, 256, (3, 1, 5), generator=gen, dtype=torch.uint8),
        torch.tensor(2.5),
        torch.empty(0, 3),
        torch.randn(64, 1024, generator=gen),  # 256 KiB
        b"stage output bytes",
        b"",
    ]


def assert_same(got: torch.Tensor | bytes, want: torch.Tensor | bytes) -> None:
    if isinstance(want, bytes):
        assert isinstance(got, bytes) and got == want
    else:
        assert isinstance(got, torch.Tensor)
        assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def through_wire(handle: ConnectorHandle) -> ConnectorHandle:
    """A handle as the receiving stage sees it: through a control message."""
    return unwire(wire(handle))


def to_wire(value: torch.Tensor | bytes) -> tuple[str, bytes]:
    """Serialise for a pipe without torch's shared-memory pickling (which dies with the sender)."""
    if isinstance(value, bytes):
        return "bytes", value
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return "tensor", buffer.getvalue()


def from_wire(tagged: tuple[str, bytes]) -> torch.Tensor | bytes:
    kind, raw = tagged
    return raw if kind == "bytes" else torch.load(io.BytesIO(raw))


def segments_of(pid: int) -> list[str]:
    return our_segments({pid})


def segment_of(handle: ConnectorHandle) -> str:
    """The file behind a handle: a pooled value's key is its segment's name plus ``@generation``."""
    return handle.key.partition("@")[0]


def pooled(handle: ConnectorHandle) -> bool:
    return "@" in handle.key


POOL_MODES = {"pooled": DEFAULT_POOL_BYTES, "one-off": 0}


@pytest.fixture(params=list(POOL_MODES))
def shm(request) -> SharedMemoryConnector:
    with SharedMemoryConnector("shm_test", {"pool_bytes": POOL_MODES[request.param]}) as connector:
        yield connector
    assert segments_of(os.getpid()) == []


# --- handles -------------------------------------------------------------------------------------------


def test_handle_msgpack_round_trip(shm: SharedMemoryConnector) -> None:
    handle = shm.put(torch.ones(2, 3, dtype=torch.bfloat16))
    decoded = through_wire(handle)
    assert decoded == handle and decoded.shape == (2, 3) and decoded.dtype == "bfloat16"
    assert decoded.owner_pid == os.getpid() and decoded.key.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")
    assert through_wire(shm.put(b"xyz")).shape is None
    shm.close()


# --- shared memory, one process --------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(sample_values())))
def test_round_trip_and_segment_freed(shm: SharedMemoryConnector, index: int) -> None:
    value = sample_values()[index]
    handle = through_wire(shm.put(value))
    path = SHM / segment_of(handle)
    assert pooled(handle) == (shm.pool_bytes > 0 and handle.nbytes > 0)
    assert path.exists() and path.stat().st_size >= handle.nbytes
    assert shm.health().outstanding == 1
    assert_same(shm.get(handle), value)  # a pooled tensor is a view, dropped right here
    assert shm.health().outstanding == 0
    if pooled(handle):
        again = shm.put(value)
        assert segment_of(again) == segment_of(handle) and again.key != handle.key  # reused, new generation
        assert_same(shm.get(again), value)
    else:
        assert not path.exists()


def test_bytes_like_and_noncontiguous_inputs(shm: SharedMemoryConnector) -> None:
    assert shm.get(shm.put(bytearray(b"abc"))) == b"abc"
    assert shm.get(shm.put(memoryview(b"abcdef")[::2])) == b"ace"
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert_same(shm.get(shm.put(base.t())), base.t().contiguous())
    assert_same(shm.get(shm.put(torch.ones(3, requires_grad=True))), torch.ones(3))
    assert_same(shm.get(shm.put(base[1:])), base[1:].clone())  # a view with a storage offset
    complex_values = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    assert_same(shm.get(shm.put(complex_values.conj())), complex_values.conj().resolve_conj())
    assert_same(shm.get(shm.put(torch._neg_view(base))), -base)


def test_get_twice_and_cleanup_fail_clearly(shm: SharedMemoryConnector) -> None:
    handle = shm.put(b"once")
    assert shm.get(handle) == b"once"
    with pytest.raises(ConnectorError, match=handle.key):
        shm.get(handle)
    dropped = shm.put(torch.zeros(4))
    shm.cleanup(dropped)
    shm.cleanup(dropped)  # idempotent
    assert shm.health().outstanding == 0
    if not pooled(dropped):
        assert not (SHM / dropped.key).exists()
    with pytest.raises(ConnectorError, match="already collected"):
        shm.get(dropped)


def test_foreign_keys_are_rejected_without_touching_files(shm: SharedMemoryConnector, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    bad = ConnectorHandle(connector="x", key=f"../../{victim}", kind="bytes", nbytes=7)
    with pytest.raises(ConnectorError, match="not a shared-memory segment name"):
        shm.get(bad)
    with pytest.raises(ConnectorError):
        shm.cleanup(bad)
    assert victim.read_text() == "keep me"


def test_counters(shm: SharedMemoryConnector) -> None:
    handles = [shm.put(torch.zeros(10, dtype=torch.int64)), shm.put(b"12345")]
    assert shm.health() == ConnectorHealth(puts=2, bytes_put=85, outstanding=2)
    shm.get(handles[0])
    shm.cleanup(handles[1])
    with pytest.raises(ConnectorError):
        shm.get(handles[1])
    assert shm.health() == ConnectorHealth(
        puts=2, gets=1, bytes_put=85, bytes_got=80, errors=1, outstanding=0
    )


@pytest.mark.parametrize("pool_bytes", POOL_MODES.values(), ids=POOL_MODES.keys())
def test_lease_timeout_frees_and_get_fails_clearly(pool_bytes: int) -> None:
    with SharedMemoryConnector("leased", {"lease_timeout_s": 0.2, "pool_bytes": pool_bytes}) as sender:
        receiver = SharedMemoryConnector("leased", {})
        kept = sender.put(torch.ones(4))
        collected = sender.put(torch.ones(4))
        assert pooled(kept) == (pool_bytes > 0)
        assert_same(receiver.get(through_wire(collected)), torch.ones(4))
        deadline = time.monotonic() + 10
        while sender._outstanding() and time.monotonic() < deadline:
            time.sleep(0.02)  # the background reaper frees it (health() would reap by itself)
        assert sender._outstanding() == 0
        assert (SHM / segment_of(kept)).exists() == pooled(kept)  # a pool keeps its segment for reuse
        health = sender.health()
        assert (health.timeouts, health.outstanding, health.puts) == (1, 0, 2)
        with pytest.raises(ConnectorTimeoutError, match=rf"{kept.key}.*lease of 0.2 s") as info:
            receiver.get(through_wire(kept))
        assert isinstance(info.value, TimeoutError)
        assert receiver.health().timeouts == 1
        receiver.close()


def test_close_frees_everything_and_refuses_new_puts() -> None:
    connector = SharedMemoryConnector("closing", {"pool_bytes": 1 << 20})
    handles = [connector.put(torch.zeros(100)) for _ in range(3)] + [connector.put(b"x")]
    handles.append(connector.put(torch.zeros((1 << 20) // 4 + 1)))  # too big for the pool
    assert [pooled(h) for h in handles] == [True, True, True, True, False]
    assert all((SHM / segment_of(h)).exists() for h in handles)
    connector.close()
    assert not any((SHM / segment_of(h)).exists() for h in handles)
    assert segments_of(os.getpid()) == []
    assert connector.health().outstanding == 0
    with pytest.raises(ConnectorError, match="closed"):
        connector.put(b"late")
    connector.close()  # idempotent


def test_garbage_collected_connector_frees_its_segments() -> None:
    connector = SharedMemoryConnector("dropped", {})
    keys = [segment_of(connector.put(b"orphan")), segment_of(connector.put(torch.zeros(100)))]
    del connector
    assert not any((SHM / key).exists() for key in keys)


def test_threads_share_one_connector(shm: SharedMemoryConnector) -> None:
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(40):
                value = torch.full((seed + 1, i + 1), float(seed * 100 + i))
                assert_same(shm.get(shm.put(value)), value)
        except BaseException as exc:  # reported below, from the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    health = shm.health()
    assert (health.puts, health.gets, health.outstanding, health.errors) == (160, 160, 0, 0)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="lease_timeout_s"):
        SharedMemoryConnector("x", {"lease_timeout_s": -1})
    for bad in (-1, "256M", 1.5, True):
        with pytest.raises(ValueError, match="pool_bytes"):
            SharedMemoryConnector("x", {"pool_bytes": bad})
    with pytest.raises(ValueError, match="does not exist"):
        SharedMemoryConnector("x", {"shm_dir": "/nonexistent/shm"})


# --- shared memory, two processes ----------------------------------------------------------------------


def _child_put(conn, lease_timeout_s: float) -> None:
    connector = SharedMemoryConnector("xproc", {"lease_timeout_s": lease_timeout_s})
    conn.send([msgspec.msgpack.encode(connector.put(v)) for v in sample_values()])
    conn.recv()  # parent has collected (or is about to kill us)
    conn.send(msgspec.to_builtins(connector.health()))
    connector.close()


def _child_get(conn) -> None:
    connector = SharedMemoryConnector("xproc", {})
    handles = [msgspec.msgpack.decode(raw, type=ConnectorHandle) for raw in conn.recv()]
    conn.send([to_wire(connector.get(h)) for h in handles])
    connector.close()


def test_put_in_child_get_in_parent(spawn) -> None:
    parent_end, child_end = spawn.Pipe()
    child = spawn.Process(target=_child_put, args=(child_end, 300.0))
    child.start()
    try:
        handles = [msgspec.msgpack.decode(raw, type=ConnectorHandle) for raw in parent_end.recv()]
        assert {h.owner_pid for h in handles} == {child.pid}
        with SharedMemoryConnector("xproc", {}) as receiver:
            for handle, want in zip(handles, sample_values(), strict=True):
                assert_same(receiver.get(handle), want)
            assert not any((SHM / h.key).exists() for h in handles if not pooled(h))  # one-off: freed
            assert receiver.health().gets == len(handles)
        parent_end.send("done")
        sender_health = parent_end.recv()
        assert sender_health["puts"] == len(handles) and sender_health["outstanding"] == 0
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert segments_of(child.pid) == []  # its pool went with close()


def test_put_in_parent_get_in_child(spawn, shm: SharedMemoryConnector) -> None:
    parent_end, child_end = spawn.Pipe()
    child = spawn.Process(target=_child_get, args=(child_end,))
    child.start()
    try:
        handles = [shm.put(v) for v in sample_values()]
        parent_end.send([msgspec.msgpack.encode(h) for h in handles])
        for got, want in zip(parent_end.recv(), sample_values(), strict=True):
            assert_same(from_wire(got), want)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert shm.health().outstanding == 0  # the sender noticed the receiver collected them
    pool = segments_of(os.getpid())
    assert pool == sorted({segment_of(h) for h in handles if pooled(h)})  # one-off segments: freed
    if pool:  # the child dropped its views, so the same values fit in the same segments again
        again = [shm.put(v) for v in sample_values()]
        assert {segment_of(h) for h in again if pooled(h)} <= set(pool)
        for handle in again:
            shm.cleanup(handle)
        assert segments_of(os.getpid()) == pool


def test_sweep_removes_segments_of_a_killed_sender(spawn) -> None:
    parent_end, child_end = spawn.Pipe()
    child = spawn.Process(target=_child_put, args=(child_end, 0.0))
    child.start()
    try:
        handles = [msgspec.msgpack.decode(raw, type=ConnectorHandle) for raw in parent_end.recv()]
        assert segments_of(child.pid) == sorted({segment_of(h) for h in handles})
        assert any(pooled(h) for h in handles) and not all(pooled(h) for h in handles)
        sweep_orphaned_segments()  # a live owner's segments are never swept
        assert segments_of(child.pid) == sorted({segment_of(h) for h in handles})
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL
    removed = sweep_orphaned_segments()
    assert set(removed) >= {segment_of(h) for h in handles}
    assert segments_of(child.pid) == []
    with SharedMemoryConnector("xproc", {}) as receiver, pytest.raises(ConnectorError, match="exited"):
        receiver.get(handles[0])


# --- shared memory: the pool ----------------------------------------------------------------------------


def _child_hold(conn) -> None:
    """A receiver that keeps what it gets (zero-copy views) until told to drop it."""
    connector = SharedMemoryConnector("xproc", {})
    held: dict[str, torch.Tensor | bytes] = {}
    while (message := conn.recv())[0] != "exit":
        command, payload = message
        if command == "get":
            handle = msgspec.msgpack.decode(payload, type=ConnectorHandle)
            held[handle.key] = connector.get(handle)
            conn.send(handle.key)
        elif command == "show":
            conn.send({key: to_wire(value.clone()) for key, value in held.items()})
        elif command == "drop":
            del held[payload]
            gc.collect()
            conn.send("dropped")
    connector.close()


def _start_holder(spawn):
    parent_end, child_end = spawn.Pipe()
    child = spawn.Process(target=_child_hold, args=(child_end,))
    child.start()
    return child, parent_end


def _hand_over(conn, handle: ConnectorHandle) -> None:
    conn.send(("get", msgspec.msgpack.encode(handle)))
    assert conn.recv() == handle.key


def test_pooled_value_lives_until_the_view_is_dropped_then_its_segment_is_reused(spawn) -> None:
    value = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    with SharedMemoryConnector("xproc", {}) as sender:
        child, conn = _start_holder(spawn)
        try:
            first = sender.put(value)
            _hand_over(conn, first)
            assert sender.health().outstanding == 0  # collected, though its view is still held
            second = sender.put(value * 2)
            assert pooled(first) and pooled(second) and segment_of(second) != segment_of(first)
            conn.send(("show", None))
            assert_same(from_wire(conn.recv()[first.key]), value)  # not overwritten by the next put
            conn.send(("drop", first.key))
            assert conn.recv() == "dropped"
            third = sender.put(value * 3)
            assert segment_of(third) == segment_of(first)  # freed by the view's finalizer, reused
            assert_same(sender.get(third), value * 3)
            assert_same(sender.get(second), value * 2)
            conn.send(("exit", None))
        finally:
            child.join(timeout=60)
        assert child.exitcode == 0
        assert sender.health() == ConnectorHealth(
            puts=3, gets=2, bytes_put=3 << 20, bytes_got=2 << 20, outstanding=0
        )


def test_segment_held_by_a_killed_reader_is_reclaimed_and_a_full_pool_falls_back(spawn) -> None:
    value = torch.arange(1 << 16, dtype=torch.int32)  # 256 KiB: the pool has room for one segment
    with SharedMemoryConnector("xproc", {"pool_bytes": 256 << 10}) as sender:
        child, conn = _start_holder(spawn)
        try:
            first = sender.put(value)
            _hand_over(conn, first)
            fallback = sender.put(value + 1)
            assert pooled(first) and not pooled(fallback)  # the one segment is held by a live reader
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=60)
        assert child.exitcode == -signal.SIGKILL
        reclaimed = sender.put(value + 2)
        assert segment_of(reclaimed) == segment_of(first)
        assert_same(sender.get(reclaimed), value + 2)
        assert_same(sender.get(fallback), value + 1)
        assert sender.health().outstanding == 0


def test_pool_limits_fallback_and_eviction() -> None:
    small = torch.arange(1000, dtype=torch.float32)  # 64 KiB size class
    with SharedMemoryConnector("small_pool", {"pool_bytes": 128 << 10}) as connector:
        a, b, c = (connector.put(small + i) for i in range(3))
        big = connector.put(torch.zeros(40 << 10, dtype=torch.float32))  # 160 KiB: over the cap
        assert [pooled(h) for h in (a, b, c, big)] == [True, True, False, False]
        for i, handle in enumerate((a, b, c)):
            assert_same(connector.get(handle), small + i)
        assert_same(connector.get(big), torch.zeros(40 << 10))
        two = segments_of(os.getpid())
        assert two == sorted({segment_of(a), segment_of(b)})
        mid = connector.put(torch.ones(25 << 10, dtype=torch.float32))  # 100 KiB: evicts both free ones
        assert pooled(mid) and segments_of(os.getpid()) == [segment_of(mid)] and segment_of(mid) not in two
        assert_same(connector.get(mid), torch.ones(25 << 10))
        assert connector.health().outstanding == 0


def test_garbage_pooled_handles_fail_clearly_without_consuming_the_value() -> None:
    with SharedMemoryConnector("garbage", {}) as connector:
        handle = connector.put(torch.ones(8))
        name, _, gen = handle.key.partition("@")
        replace = msgspec.structs.replace
        with pytest.raises(ConnectorError, match="already collected"):
            connector.get(replace(handle, key=f"{name}@{int(gen) + 1}"))
        with pytest.raises(ConnectorError, match="holds 32 bytes, its handle says 64"):
            connector.get(replace(handle, nbytes=64, shape=(16,)))
        with pytest.raises(ConnectorError, match="cannot hold"):
            connector.get(replace(handle, shape=(3,)))
        with pytest.raises(ConnectorError, match="unknown dtype"):
            connector.get(replace(handle, dtype="os"))
        with pytest.raises(ConnectorError, match="not a shared-memory segment name"):
            connector.get(replace(handle, key=f"{name}@x"))
        missing = f"{SEGMENT_PREFIX}{os.getpid()}_pool_{'0' * 16}@1"
        with pytest.raises(ConnectorError, match="does not exist"):
            connector.get(replace(handle, key=missing))
        junk = SHM / f"{SEGMENT_PREFIX}{os.getpid()}_pool_{'f' * 16}"
        junk.write_bytes(b"\xff" * 8192)
        try:
            with pytest.raises(ConnectorError, match="not a pooled segment"):
                connector.get(replace(handle, key=f"{junk.name}@1"))
            connector.cleanup(replace(handle, key=f"{junk.name}@1"))
            assert junk.read_bytes() == b"\xff" * 8192
        finally:
            junk.unlink()
        assert_same(connector.get(handle), torch.ones(8))  # none of the above consumed it
        assert connector.health().errors == 7


def test_values_of_a_closed_sender_are_gone_even_for_a_receiver_that_maps_them() -> None:
    sender = SharedMemoryConnector("closing", {})
    with SharedMemoryConnector("closing", {}) as receiver:
        assert_same(receiver.get(sender.put(torch.ones(4))), torch.ones(4))  # the receiver maps it now
        kept = receiver.get(sender.put(torch.full((4,), 7.0)))
        late = sender.put(torch.zeros(4))
        sender.close()
        with pytest.raises(ConnectorError, match="does not exist"):
            receiver.get(late)
        assert_same(kept, torch.full((4,), 7.0))  # a view outlives its segment's file
    assert segments_of(os.getpid()) == []


# --- in-process connector and factory -----------------------------------------------------------------------


def test_in_process_connector_passes_objects() -> None:
    with InProcessConnector("local", {}) as connector:
        tensor = torch.randn(3, 3).to(torch.bfloat16)
        handle = through_wire(connector.put(tensor))
        assert (handle.kind, handle.dtype, handle.shape, handle.nbytes) == ("tensor", "bfloat16", (3, 3), 18)
        assert connector.get(handle) is tensor
        assert connector.get(connector.put(bytearray(b"ab"))) == b"ab"
        dropped = connector.put(b"never read")
        assert connector.health().outstanding == 1
        connector.cleanup(dropped)
        with pytest.raises(ConnectorError, match="no value"):
            connector.get(dropped)
        assert connector.health() == ConnectorHealth(
            puts=3, gets=2, bytes_put=30, bytes_got=20, errors=1, outstanding=0
        )
    with pytest.raises(ConnectorError, match="closed"):
        connector.put(b"late")


def test_factory_builds_known_classes_and_rejects_unknown() -> None:
    assert CONNECTOR_CLASSES["InProcessConnector"].endswith(":InProcessConnector")
    with make_connector("ar_to_dit", "SharedMemoryConnector", {"lease_timeout_s": 5}) as connector:
        assert isinstance(connector, SharedMemoryConnector) and isinstance(connector, OmniConnector)
        assert connector.name == "ar_to_dit" and connector.lease_timeout_s == 5
    assert isinstance(make_connector("local", "InProcessConnector", {}), InProcessConnector)
    with pytest.raises(
        ValueError, match=r"unknown connector class 'Mooncake'.*known: .*SharedMemoryConnector"
    ):
        make_connector("edge", "Mooncake", {})


def test_a_collected_output_image_frees_its_pool_slot_at_once() -> None:
    """The API process copies an output's image out of its segment: the slot is free for the next image
    while the collected one is still referenced (a view would keep it until the output was collected by
    the garbage collector, where a traceback holds it)."""
    import numpy as np

    from vllm_omni_plugin.stage.core_types import StageDiffusionCoreOutput
    from vllm_omni_plugin.stage.payload import collect_output

    image = torch.full((128, 128, 3), 7, dtype=torch.uint8)  # 48 KiB: the pool holds one such segment
    with SharedMemoryConnector("images", {"pool_bytes": 64 << 10}) as connector:
        first = connector.put(image)
        output = StageDiffusionCoreOutput(request_id="r", stage_id=1, image_handle=msgspec.to_builtins(first))
        collect_output(output, connector)
        second = connector.put(image + 1)
        assert pooled(first) and pooled(second) and segment_of(second) == segment_of(first)
        assert isinstance(output.image, np.ndarray) and int(output.image.max()) == 7  # still its own pixels
        assert_same(connector.get(second), image + 1)
        assert connector.health().outstanding == 0
