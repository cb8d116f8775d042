"""The connectors whose receivers pull (NixlConnector: real NIXL agents, UCX over DRAM;
MooncakeTransferEngineConnector: real Mooncake transfer engines over TCP) between real processes, no
mocks; every test runs for each class that is installed.

One spawned "stage" child with its own connector is shared by the module (NIXL agent creation and a
spawn cost seconds); the test process holds the other side. Handles cross the process boundary the
way stages send them: ``msgspec.to_builtins(handle)``, msgpack, then ``msgspec.convert``. Values are
regenerated from a seed on each side instead of being pickled, so a comparison checks what NIXL moved
and nothing else.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import hashlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import torch

from helpers import unwire, wire
from vllm_omni_plugin.connectors.base import (
    ConnectorError,
    ConnectorHandle,
    ConnectorHealth,
    ConnectorTimeoutError,
    OmniConnector,
    make_connector,
)
from vllm_omni_plugin.connectors.mooncake import (
    MooncakeTransferEngineConnector,
    host_address,
    mooncake_missing,
)
from vllm_omni_plugin.connectors.nixl import NixlConnector, load_nixl_api

try:
    load_nixl_api()
    NIXL_MISSING = None
except ImportError as exc:  # the [nixl] extra is optional
    NIXL_MISSING = f"NIXL is not installed: {exc}"

T = TypeVar("T")
Spec = tuple[str, str | None, tuple[int, ...] | int, int]
"""("tensor" | "transposed", dtype, shape, seed) or ("bytes", None, nbytes, seed)."""
ANSWER_LIMIT_S = 120.0
"""Hang guard for a child's answer; generous because a loaded 2-core CI machine is slow."""
BIG = 64 << 20
MAIN_POOL = 16 << 20
"""The test process's receive pool: small enough that a BIG value takes the one-off buffer path."""
CLASSES = ["NixlConnector", "MooncakeTransferEngineConnector"]
BASE_EXTRA: dict[str, dict[str, Any]] = {
    "NixlConnector": {},
    # TCP on loopback, a free side-channel port each: the test's processes share one host.
    "MooncakeTransferEngineConnector": {"protocol": "tcp", "host": "127.0.0.1", "zmq_port": 0},
}
POOL_KEY = {"NixlConnector": "recv_pool_bytes", "MooncakeTransferEngineConnector": "memory_pool_size"}


def connect(cls: str, name: str, extra: dict[str, Any] | None = None) -> OmniConnector:
    """A connector of class ``cls`` as a deploy config builds it, with the test host's base settings."""
    return make_connector(name, cls, {**BASE_EXTRA[cls], **(extra or {})})


VALUES: list[Spec] = [
    ("tensor", "float32", (3, 5), 1),
    ("tensor", "bfloat16", (7,), 2),
    ("tensor", "int64", (2, 3, 4), 3),
    ("tensor", "uint8", (1,), 4),  # a single byte
    ("tensor", "bool", (5, 5), 5),
    ("tensor", "float32", (), 6),  # 0-d
    ("tensor", "float32", (0, 3), 7),  # empty
    ("transposed", "float32", (4, 6), 8),  # non-contiguous: put stores a contiguous copy
    ("bytes", None, 1, 9),
    ("bytes", None, 1000, 10),
    ("bytes", None, 0, 11),
    ("tensor", "uint8", (BIG,), 12),
]


# --- values, handles and the child stage (module level: the spawned child imports them) ---------------


def make_value(spec: Spec) -> torch.Tensor | bytes:
    """The value a spec names, identical in every process."""
    kind, dtype_name, shape, seed = spec
    if kind == "bytes":
        return _random_bytes(int(shape), seed).numpy().tobytes()
    dtype = getattr(torch, dtype_name)
    dims = tuple(shape)
    if kind == "transposed":
        dims = dims[::-1]
    numel = 1
    for d in dims:
        numel *= d
    raw = _random_bytes(numel * torch.empty((), dtype=dtype).element_size(), seed)
    if dtype == torch.bool:
        raw = raw & 1  # only 0 and 1 are valid bools
    tensor = raw.view(dtype).reshape(dims)
    return tensor.t() if kind == "transposed" else tensor


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**63), 2**63 - 1, ((nbytes + 7) // 8,), dtype=torch.int64, generator=generator)
    return words.view(torch.uint8)[:nbytes].clone()


def raw_bytes(value: torch.Tensor | bytes) -> torch.Tensor:
    """The value's bytes as a flat uint8 tensor (C order), for byte-for-byte comparison."""
    if isinstance(value, bytes):
        return (
            torch.frombuffer(bytearray(value), dtype=torch.uint8)
            if value
            else torch.empty(0, dtype=torch.uint8)
        )
    return value.contiguous().reshape(-1).view(torch.uint8)


def describe(value: torch.Tensor | bytes) -> tuple[Any, ...]:
    """Type, dtype, shape and a digest of the bytes: what a child reports about a value it got."""
    digest = hashlib.sha256(raw_bytes(value).numpy()).hexdigest()
    if isinstance(value, bytes):
        return ("bytes", len(value), digest)
    return ("tensor", str(value.dtype), tuple(value.shape), digest)


def _attempt(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except Exception as exc:  # reported to the parent, which asserts on type and message
        return ("error", (type(exc).__name__, str(exc)))


def _command(connectors: dict[str, OmniConnector], op: str, target: str, arg: Any) -> Any:
    """One command of the parent, run in the child stage."""
    if op == "open":
        cls, extra = arg
        connectors[target] = connect(cls, target, extra)
        return None
    connector = connectors[target]
    if op == "put":
        return [wire(connector.put(make_value(spec))) for spec in arg]
    if op == "get":  # per handle, so that one failure does not hide the others
        return [_attempt(functools.partial(_get_and_describe, connector, h)) for h in arg]
    if op == "cleanup":
        for h in arg:
            connector.cleanup(unwire(h))
        return None
    if op == "health":
        return msgspec.to_builtins(connector.health())
    if op == "close":
        return connector.close()
    raise ValueError(f"unknown command {op!r}")


def _get_and_describe(connector: OmniConnector, wired: bytes) -> tuple[Any, ...]:
    return describe(connector.get(unwire(wired)))


def _stage_main(conn: Any, cls: str, name: str, extra: dict[str, Any]) -> None:
    """A stage process: connectors built like a deploy config builds them, driven over a pipe."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks if we hang
    connectors: dict[str, OmniConnector] = {name: connect(cls, name, extra)}
    conn.send(("ok", os.getpid()))
    try:
        while True:
            try:
                op, target, arg = conn.recv()
            except EOFError:
                break
            if op == "exit":
                break
            conn.send(_attempt(functools.partial(_command, connectors, op, target, arg)))
    finally:
        for connector in connectors.values():
            connector.close()
        with suppress(OSError):
            conn.send(("ok", None))


class StageError(AssertionError):
    """A command failed inside the child stage."""


class Stage:
    """The parent's end of a child stage process."""

    def __init__(
        self, context: multiprocessing.context.SpawnContext, cls: str, name: str, extra: dict[str, Any]
    ):
        self.name = name
        self.cls = cls
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_stage_main, args=(child_end, cls, name, extra), daemon=True)
        self.process.start()
        child_end.close()
        try:
            self.pid = self._answer("start")
        except BaseException:
            self.kill()
            raise

    def call(self, op: str, arg: Any = None, *, target: str | None = None) -> Any:
        self.conn.send((op, target or self.name, arg))
        return self._answer(op)

    def _answer(self, op: str) -> Any:
        if not self.conn.poll(ANSWER_LIMIT_S):
            with suppress(OSError):
                os.kill(self.process.pid, signal.SIGUSR1)
                time.sleep(1)
            self.kill()  # later commands fail at once instead of waiting for a hung child again
            raise AssertionError(f"stage {self.name}: no answer to {op!r} within {ANSWER_LIMIT_S} s (hung?)")
        status, value = self.conn.recv()
        if status != "ok":
            raise StageError(f"stage {self.name}: {op} failed: {value[0]}: {value[1]}")
        return value

    def put(self, specs: list[Spec], *, target: str | None = None) -> list[ConnectorHandle]:
        return [unwire(w) for w in self.call("put", specs, target=target)]

    def get(self, handles: list[ConnectorHandle], *, target: str | None = None) -> list[tuple[str, Any]]:
        """Per handle ``("ok", describe(value))`` or ``("error", (exception type, message))``."""
        return self.call("get", [wire(h) for h in handles], target=target)

    def health(self, target: str | None = None) -> ConnectorHealth:
        return msgspec.convert(self.call("health", target=target), ConnectorHealth)

    def stop(self) -> None:
        """Ask the child to close its connectors and exit; kill it if it does not."""
        if self.process.is_alive():
            with suppress(Exception):
                self.conn.send(("exit", None, None))
                self.conn.poll(10)
            self.process.join(10)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()


# --- helpers ------------------------------------------------------------------------------------------


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], what: str, limit: float = 60.0) -> T:
    """Poll until ``done``; the limit only keeps a broken release from hanging the suite."""
    deadline = time.monotonic() + limit
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached; last seen {value}")
        time.sleep(0.01)


def delta(before: ConnectorHealth, after: ConnectorHealth) -> dict[str, int]:
    """Counter changes, without the fields that did not change (outstanding is a level, not a count)."""
    old, new = msgspec.structs.asdict(before), msgspec.structs.asdict(after)
    return {k: new[k] - old[k] for k in new if k != "outstanding" and new[k] != old[k]}


def nbytes_of(spec: Spec) -> int:
    value = make_value(spec)
    return len(value) if isinstance(value, bytes) else value.numel() * value.element_size()


def assert_same(got: torch.Tensor | bytes, expected: torch.Tensor | bytes) -> None:
    assert isinstance(got, bytes) == isinstance(expected, bytes)
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert torch.equal(raw_bytes(got), raw_bytes(expected))


def run_guarded(call: Callable[[], T], limit: float) -> T:
    """Run ``call`` in a thread so a hang fails the test instead of blocking the suite."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"call still running after {limit} s: hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=CLASSES)
def kind(request: pytest.FixtureRequest) -> str:
    """The connector class under test."""
    missing = NIXL_MISSING if request.param == "NixlConnector" else mooncake_missing()
    if missing:
        pytest.skip(missing)
    return request.param


@pytest.fixture(scope="module")
def stage(spawn: multiprocessing.context.SpawnContext, kind: str) -> Iterator[Stage]:
    """The shared child stage (default settings, so its receive pool holds a BIG value)."""
    child = Stage(spawn, kind, "stage", {})
    try:
        yield child
    finally:
        child.stop()


@pytest.fixture(scope="module")
def main(kind: str) -> Iterator[OmniConnector]:
    """The test process's connector, built through the deploy-config factory."""
    connector = connect(kind, "main", {POOL_KEY[kind]: MAIN_POOL, "transfer_timeout_s": 60})
    assert type(connector) is {"NixlConnector": NixlConnector}.get(kind, MooncakeTransferEngineConnector)
    try:
        yield connector
    finally:
        connector.close()


@contextmanager
def temporary_stage(spawn: multiprocessing.context.SpawnContext, cls: str, name: str, extra: dict[str, Any]):
    child = Stage(spawn, cls, name, extra)
    try:
        yield child
    finally:
        child.kill()


# --- 1. values cross processes byte for byte ------------------------------------------------------------


def test_child_puts_parent_gets_every_kind_byte_for_byte(stage: Stage, main: OmniConnector) -> None:
    """Dtypes, shapes (0-d, empty, 1 byte .. 64 MiB), bytes: what the reader gets is what was put."""
    handles = stage.put(VALUES)
    for spec, handle in zip(VALUES, handles, strict=True):
        assert handle.remote is not None and handle.owner_pid == stage.pid
        got = main.get(handle)
        expected = make_value(spec)
        assert_same(got, expected.contiguous() if isinstance(expected, torch.Tensor) else expected)
        del got
    wait_for(stage.health, lambda h: h.outstanding == 0, "owner released every read value")


def test_parent_puts_child_gets_every_kind_byte_for_byte(stage: Stage, main: OmniConnector) -> None:
    """The other direction; here the BIG value lands in the child's receive pool."""
    handles = [main.put(make_value(spec)) for spec in VALUES]
    results = stage.get(handles)
    for spec, (status, got) in zip(VALUES, results, strict=True):
        assert status == "ok", (spec, got)
        expected = make_value(spec)
        assert got == describe(expected.contiguous() if isinstance(expected, torch.Tensor) else expected), (
            spec
        )
    wait_for(main.health, lambda h: h.outstanding == 0, "owner released every read value")


# --- 2. acknowledgements and counters ------------------------------------------------------------------


SMALL: list[Spec] = [
    ("tensor", "float32", (64,), 21),
    ("bytes", None, 3000, 22),
    ("tensor", "int64", (5, 5), 23),
]


def test_reads_are_acknowledged_and_counted_on_both_sides(stage: Stage, main: OmniConnector) -> None:
    """The owner learns of each READ from its ack notification and releases the value then."""
    total = sum(nbytes_of(spec) for spec in SMALL)
    owner_before, reader_before = stage.health(), main.health()
    handles = stage.put(SMALL)
    assert stage.health().outstanding == owner_before.outstanding + len(SMALL)
    for handle in handles:
        main.get(handle)
    owner_after = wait_for(stage.health, lambda h: h.outstanding == 0, "owner saw every ack")
    assert delta(owner_before, owner_after) == {
        "puts": len(SMALL),
        "bytes_put": total,
        "acks": len(SMALL),
        "bytes_acked": total,
    }
    assert delta(reader_before, main.health()) == {"gets": len(SMALL), "bytes_got": total}

    # and the other way round
    owner_before, reader_before = main.health(), stage.health()
    handles = [main.put(make_value(spec)) for spec in SMALL]
    assert main.health().outstanding == owner_before.outstanding + len(SMALL)
    assert [status for status, _ in stage.get(handles)] == ["ok"] * len(SMALL)
    owner_after = wait_for(main.health, lambda h: h.outstanding == 0, "owner saw every ack")
    assert delta(owner_before, owner_after) == {
        "puts": len(SMALL),
        "bytes_put": total,
        "acks": len(SMALL),
        "bytes_acked": total,
    }
    assert delta(reader_before, stage.health()) == {"gets": len(SMALL), "bytes_got": total}


def test_empty_values_need_no_read_and_are_never_outstanding(stage: Stage, main: OmniConnector) -> None:
    """Nothing is registered for an empty value, so nothing waits for an ack or a lease."""
    specs: list[Spec] = [("bytes", None, 0, 31), ("tensor", "bfloat16", (0,), 32)]
    before = stage.health()
    handles = stage.put(specs)
    assert stage.health().outstanding == 0
    assert main.get(handles[0]) == b""
    empty = main.get(handles[1])
    assert isinstance(empty, torch.Tensor) and (empty.dtype, empty.shape) == (torch.bfloat16, (0,))
    assert delta(before, stage.health()) == {"puts": 2}


def test_same_tensor_put_twice_is_read_twice_and_released_once_both_are_read(
    stage: Stage, main: OmniConnector
) -> None:
    """Both puts share one registration; it must survive the first ack and go with the second."""
    value = torch.arange(1000, dtype=torch.int32)
    first, second = main.put(value), main.put(value)
    assert main.health().outstanding == 2
    assert stage.get([first]) == [("ok", describe(value))]
    wait_for(main.health, lambda h: h.outstanding == 1, "first value acked")
    assert stage.get([second]) == [("ok", describe(value))]
    wait_for(main.health, lambda h: h.outstanding == 0, "second value acked")


# --- 3. lease ---------------------------------------------------------------------------------------------


def test_uncollected_value_is_released_when_its_lease_runs_out(stage: Stage, main: OmniConnector) -> None:
    """Nobody collects the value: the owner frees it on its own, and a late reader is told so, by key."""
    stage.call("open", (stage.cls, {"lease_timeout_s": 0.5}), target="short")
    try:
        (handle,) = stage.put([("tensor", "float32", (256,), 41)], target="short")
        assert handle.connector == "short" and handle.lease_timeout_s == 0.5
        owner = wait_for(
            lambda: stage.health("short"), lambda h: h.outstanding == 0, "owner released the expired value"
        )
        assert (owner.timeouts, owner.acks, owner.puts) == (1, 0, 1)
        before = main.health()
        with pytest.raises(ConnectorTimeoutError, match=handle.key) as caught:
            main.get(handle)
        assert "lease" in str(caught.value)
        assert delta(before, main.health()) == {"timeouts": 1}
    finally:
        stage.call("close", target="short")


# --- 4. cleanup by the receiver -------------------------------------------------------------------------


def test_cleanup_in_the_receiving_process_releases_the_owners_value(
    stage: Stage, main: OmniConnector
) -> None:
    """A release notification frees the value without a READ; a get afterwards fails instead of
    reading memory the owner no longer holds."""
    before = stage.health()
    handles = stage.put([("tensor", "float32", (128,), 51), ("bytes", None, 77, 52)])
    for handle in handles:
        main.cleanup(handle)
    after = wait_for(stage.health, lambda h: h.outstanding == 0, "owner released cleaned-up values")
    assert delta(before, after) == {"puts": 2, "bytes_put": 128 * 4 + 77}  # released, not acked
    with pytest.raises(ConnectorError, match=handles[0].key):
        main.get(handles[0])

    # the other way round
    handles = [main.put(torch.ones(10)), main.put(b"abc")]
    stage.call("cleanup", [wire(h) for h in handles])
    wait_for(main.health, lambda h: h.outstanding == 0, "owner released cleaned-up values")


def test_cleanup_by_the_owner_frees_an_unread_value_and_leaves_a_read_one_alone(
    stage: Stage, main: OmniConnector
) -> None:
    """The head frees what it sent a replica that died: at once where the value is unread; where the
    reader's ack came first, there is nothing left to do and nothing to tell anyone."""
    before = main.health()
    unread = main.put(torch.ones(32))
    main.cleanup(unread)
    assert delta(before, main.health()) == {"puts": 1, "bytes_put": 32 * 4}

    read = main.put(torch.ones(16))
    assert [status for status, _ in stage.get([read])] == ["ok"]
    acked = wait_for(main.health, lambda h: h.outstanding == 0, "owner saw the ack")
    main.cleanup(read)
    assert main.health() == acked


def test_second_get_of_a_handle_fails_instead_of_rereading_released_memory(
    stage: Stage, main: OmniConnector
) -> None:
    """Values are read at most once; shared-memory transports would re-read freed memory silently."""
    (handle,) = stage.put([("tensor", "int64", (16,), 55)])
    main.get(handle)
    wait_for(stage.health, lambda h: h.outstanding == 0, "owner released the read value")
    with pytest.raises(ConnectorError, match=f"{handle.key}.*already collected"):
        main.get(handle)


# --- 5. the owner dies before the get --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_get_from_an_owner_that_is_gone_fails_clearly(
    spawn: multiprocessing.context.SpawnContext, stage: Stage, main: OmniConnector, how: str
) -> None:
    """A dead owner is an error naming the value, not a hang or a crash, for a reader that had talked
    to it before and for one that never had; the reader stays usable."""
    with temporary_stage(spawn, stage.cls, "doomed", {"lease_timeout_s": 0}) as doomed:
        first, second, third = doomed.put([("tensor", "float32", (32,), 61 + i) for i in range(3)])
        assert_same(main.get(first), make_value(("tensor", "float32", (32,), 61)))  # connected now
        if how == "sigkill":
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.process.join(30)
        else:
            doomed.stop()
        assert doomed.process.exitcode is not None

    fresh = connect(stage.cls, "fresh", {"transfer_timeout_s": 2})
    try:
        for reader, handle in ((main, second), (fresh, third)):
            before = reader.health()
            with pytest.raises(ConnectorError, match=handle.key) as caught:
                run_guarded(lambda r=reader, h=handle: r.get(h, timeout=2), limit=60)
            assert "doomed" in str(caught.value)  # names the owner
            assert sum(delta(before, reader.health()).values()) == 1  # one error or timeout, no get
        # both readers still work with a live owner
        (handle,) = stage.put([("tensor", "uint8", (100,), 64)])
        assert_same(fresh.get(handle), make_value(("tensor", "uint8", (100,), 64)))
    finally:
        fresh.close()


# --- 6. bad input -----------------------------------------------------------------------------------------


def test_handle_of_another_connector_is_refused(main: OmniConnector, kind: str) -> None:
    """A SharedMemoryConnector-style handle has no remote location to read from."""
    foreign = msgspec.convert(
        {
            "connector": "shm",
            "key": "shm-key-1",
            "kind": "tensor",
            "nbytes": 4,
            "dtype": "float32",
            "shape": [1],
        },
        ConnectorHandle,
    )
    before = main.health()
    with pytest.raises(ConnectorError, match=f"shm-key-1.*not made by a {kind}"):
        main.get(foreign)
    assert delta(before, main.health()) == {"errors": 1}
    main.cleanup(foreign)  # nothing to release: a no-op, not an error


def test_put_of_something_else_is_a_type_error(main: OmniConnector) -> None:
    before = main.health()
    for value in ([1, 2, 3], "text", 3.0, None):
        with pytest.raises(TypeError, match=type(value).__name__):
            main.put(value)
    assert delta(before, main.health()) == {"errors": 4}
    assert main.health().outstanding == 0


def test_bytes_like_values_come_back_as_bytes(stage: Stage, main: OmniConnector) -> None:
    """bytearray and memoryview are accepted; the reader gets bytes."""
    data = bytes(range(256)) * 3
    handles = [main.put(bytearray(data)), main.put(memoryview(data))]
    assert stage.get(handles) == [("ok", describe(data))] * 2
    wait_for(main.health, lambda h: h.outstanding == 0, "owner released both values")


@pytest.mark.parametrize(
    ("cls", "extra", "named"),
    [
        ("NixlConnector", {"lease_timeout": 5}, "lease_timeout"),
        ("NixlConnector", {"transfer_timeout_s": "soon"}, "transfer_timeout_s"),
        ("NixlConnector", {"lease_timeout_s": -1}, "lease_timeout_s"),
        ("NixlConnector", {"recv_pool_bytes": True}, "recv_pool_bytes"),
        ("NixlConnector", {"backends": "UCX"}, "backends"),
        ("MooncakeTransferEngineConnector", {"protocol": "udp"}, "protocol"),
        ("MooncakeTransferEngineConnector", {"zmq_port": 70000}, "zmq_port"),
        ("MooncakeTransferEngineConnector", {"memory_pool_size": "4G"}, "memory_pool_size"),
        ("MooncakeTransferEngineConnector", {"memory_pool_device": "cuda"}, "memory_pool_device"),
        ("MooncakeTransferEngineConnector", {"sender_host": "a"}, "sender_host"),
    ],
)
def test_bad_extra_is_a_value_error_naming_the_key(cls: str, extra: dict[str, Any], named: str) -> None:
    """Raised before any agent or engine exists, with the connector's deploy-config name."""
    with pytest.raises(ValueError, match=f"'cfg'.*{named}"):
        make_connector("cfg", cls, extra)


def test_bad_extra_surfaces_from_a_stage_process(stage: Stage) -> None:
    """What a stage reports when its deploy config has a typo."""
    with pytest.raises(StageError, match=f"ValueError.*unknown {stage.cls} extra key.*'lease_timout_s'"):
        stage.call("open", (stage.cls, {"lease_timout_s": 5}), target="typo")


def test_unknown_backend_is_a_connector_error() -> None:
    with pytest.raises(ConnectorError, match="NOSUCHBACKEND"):
        make_connector("cfg", "NixlConnector", {"backends": ["NOSUCHBACKEND"]})


# --- 7. the receive pool -------------------------------------------------------------------------------


def test_receive_pool_reuses_dropped_buffers_and_never_overwrites_live_ones(
    stage: Stage, main: OmniConnector
) -> None:
    """A buffer comes back when the tensor read into it is dropped; one still in use is not lent."""
    specs: list[Spec] = [("tensor", "float32", (3 << 18,), 71 + i) for i in range(3)]  # 3 MiB each
    first, second, third = stage.put(specs)

    got = main.get(first)
    address = got.data_ptr()
    del got
    gc.collect()
    kept = main.get(second)
    assert kept.data_ptr() == address  # the same registered buffer, reused

    other = main.get(third)  # `kept` is alive, so this one needs another buffer
    assert other.data_ptr() != address
    assert_same(kept, make_value(specs[1]))
    assert_same(other, make_value(specs[2]))
    wait_for(stage.health, lambda h: h.outstanding == 0, "owner released all three")


def test_value_larger_than_the_receive_pool_is_read_into_its_own_buffer(
    stage: Stage, main: OmniConnector
) -> None:
    """Values beyond ``recv_pool_bytes`` still arrive; their one-off buffer is the returned tensor."""
    spec: Spec = ("tensor", "uint8", (MAIN_POOL + 1,), 75)
    (handle,) = stage.put([spec])
    got = main.get(handle)
    assert_same(got, make_value(spec))
    wait_for(stage.health, lambda h: h.outstanding == 0, "owner released the value")


# --- 8. same process --------------------------------------------------------------------------------------


def test_put_and_get_in_one_process_hand_the_value_over(main: OmniConnector) -> None:
    """No READ of one's own memory: the object comes back, and it is released without an ack."""
    before = main.health()
    tensor = torch.randn(4, 4)
    scalar = torch.tensor(7, dtype=torch.int64)
    handles = [
        main.put(tensor),
        main.put(b"payload"),
        main.put(scalar),
        main.put(b""),
        main.put(torch.empty(0, 2)),
    ]
    assert main.health().outstanding == 3
    got = [main.get(unwire(wire(h))) for h in handles]
    assert torch.equal(got[0], tensor)
    assert got[1] == b"payload"
    assert torch.equal(got[2], scalar) and got[2].shape == ()
    assert got[3] == b""
    assert got[4].shape == (0, 2)
    after = main.health()
    assert after.outstanding == 0
    assert delta(before, after) == {"puts": 5, "gets": 5, "bytes_put": 64 + 7 + 8, "bytes_got": 64 + 7 + 8}
    with pytest.raises(ConnectorError, match=handles[0].key):
        main.get(handles[0])


# --- 9. close -------------------------------------------------------------------------------------------


def test_close_releases_everything_and_refuses_new_puts(kind: str) -> None:
    connector = connect(kind, "closing")
    try:
        for i in range(3):
            connector.put(torch.full((100,), i))
        connector.put(b"bytes too")
        assert connector.health().outstanding == 4
    finally:
        connector.close()
    assert connector.health().outstanding == 0
    with pytest.raises(ConnectorError, match="closed"):
        connector.put(torch.ones(1))
    connector.close()  # idempotent


# --- 10. threads ------------------------------------------------------------------------------------------


def test_threads_get_concurrently_through_one_connector(stage: Stage, main: OmniConnector) -> None:
    """The orchestrator reads from several threads; every thread gets its own values intact."""
    specs: list[Spec] = [
        ("tensor", dtype, (1000 + 37 * i,), 100 + i)
        for i, dtype in enumerate(["float32", "bfloat16", "int64", "uint8"] * 4)
    ]
    handles = stage.put(specs)
    before = main.health()

    def read(index: int) -> list[int]:
        bad = []
        for i in range(index, len(specs), 4):
            if not torch.equal(raw_bytes(main.get(handles[i])), raw_bytes(make_value(specs[i]))):
                bad.append(i)
        return bad

    with ThreadPoolExecutor(4) as pool:
        assert [bad for bad in pool.map(read, range(4))] == [[]] * 4
    changes = delta(before, main.health())
    assert changes == {"gets": len(specs), "bytes_got": sum(nbytes_of(s) for s in specs)}
    wait_for(stage.health, lambda h: h.outstanding == 0, "owner released every value")


# --- 11. Mooncake's own settings ------------------------------------------------------------------------


@pytest.fixture
def mooncake() -> str:
    if missing := mooncake_missing():
        pytest.skip(missing)
    return "MooncakeTransferEngineConnector"


def test_mooncake_rdma_on_a_host_without_rdma_devices_says_to_use_tcp(mooncake: str) -> None:
    """Mooncake itself starts an RDMA engine without devices and fails only at the first READ."""
    devices = Path("/sys/class/infiniband")
    if devices.is_dir() and any(devices.iterdir()):
        pytest.skip("this host has RDMA devices")
    with pytest.raises(ConnectorError, match="'cfg'.*no RDMA device.*protocol: tcp"):
        make_connector("cfg", mooncake, {"protocol": "rdma", "host": "127.0.0.1"})


def test_mooncake_side_channel_takes_the_next_free_port_and_says_when_none_is_left(mooncake: str) -> None:
    """Several stage processes of one host share a deploy file, hence its zmq_port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if port + 1 > 65535:
            pytest.skip("the free port is the last one")
        connector = connect(mooncake, "cfg", {"zmq_port": port})
        try:
            handle = connector.put(torch.ones(4))
            assert handle.remote is not None
            assert handle.remote.metadata.decode().rsplit(":", 1)[1] != str(port)
        finally:
            connector.close()
    with socket.socket() as last:
        try:
            last.bind(("127.0.0.1", 65535))
        except OSError:
            pytest.skip("port 65535 is taken here")
        last.listen()
        with pytest.raises(ConnectorError, match="'cfg'.*every port from zmq_port 65535 to 65535.*in use"):
            connect(mooncake, "cfg", {"zmq_port": 65535})


def test_mooncake_host_auto_is_an_address_of_this_host(mooncake: str) -> None:
    """``host: auto`` (the seed's value) finds an IPv4 address a socket of this host can bind."""
    address = host_address()
    with socket.socket() as probe:
        probe.bind((address, 0))
    connector = make_connector("auto", mooncake, {"protocol": "tcp", "zmq_port": 0})
    try:
        assert connector.endpoint.startswith(f"{address}:")
    finally:
        connector.close()


def test_mooncake_missing_package_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a host without Mooncake's package says (its import blocked the way Python blocks one)."""
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    message = mooncake_missing()
    assert message is not None and "vllm-omni-plugin[mooncake]" in message and "\n" not in message
    with pytest.raises(ImportError, match=r"vllm-omni-plugin\[mooncake\]"):
        make_connector("cfg", "MooncakeTransferEngineConnector", {"protocol": "tcp"})
