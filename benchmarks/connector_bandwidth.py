"""Connector bandwidth, put in one process and get in another, against an in-process memcpy and bare
transfers of each pulling transport (NIXL, Mooncake's transfer engine over TCP).

    python benchmarks/connector_bandwidth.py [--min-size 1K] [--max-size 256M] [--seconds 0.15]
                                             [--repeats 5] [--connectors shm,nixl,mooncake]

For each size, the parent puts one tensor after another and sends each handle (msgpack, over a pipe) to a
spawned receiver process, which gets it, checks two bytes, drops it and acknowledges; a rate counts bytes
from the first put to the last acknowledgement, and a cell shows the best of ``--repeats`` rates (single
rates are noisy on small machines). "1 in flight" waits for each acknowledgement before the next put
(latency bound); "2 in flight" lets the next put overlap the previous get (what a stream of stage outputs
sees).

Baselines in the same run: ``dst.copy_(src)`` into a warm buffer (the shared-memory connector's
reference); ``src.clone()``, which returns fresh memory and so pays for first-touching its pages; and, when
a NIXL connector row is asked for, "bare nixl" (its reference): two NIXL agents (UCX; see
``bare_nixl_agent``) in this process and a spawned one, each with one DRAM buffer of the largest size,
registered and touched up front, metadata exchanged once. Per transfer the parent sends the size over the
pipe and the child READs that many bytes (``initialize_xfer`` / ``transfer`` / poll ``check_xfer_state``
/ ``release_xfer_handle``) and acknowledges: same windows, same clock as the connector rows. Likewise
"bare mooncake" for the Mooncake row: two ``TransferEngine``s (TCP, P2P handshake), each with one
registered buffer of the largest size, the child ``transfer_sync_read``-ing each size.

Every row shows its ratio to memcpy; NIXL and Mooncake rows also to their bare transport (same window);
a summary gives the worst ratio against each target. Rows whose connector class or NIXL cannot be loaded
are skipped with the reason. Every process runs torch with one thread. A NIXL agent's progress thread,
where it runs, keeps a core busy, so rows are measured in phases, each with only its own processes alive
(memcpy and clone; bare nixl; shared memory; each NIXL connector; bare mooncake with the Mooncake
connector, whose idle engines cost nothing), and the table comes at the end. Within a phase the rows take
their ``--repeats`` rates in turn.

A connector is one more entry in ``CONNECTORS`` (its class name and ``extra``, as in a deploy config).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs each agent's start to stdout otherwise

import msgspec  # noqa: E402
import torch  # noqa: E402

from vllm_omni_plugin.connectors import CONNECTOR_CLASSES  # noqa: E402
from vllm_omni_plugin.connectors.base import ConnectorHandle, OmniConnector, make_connector  # noqa: E402
from vllm_omni_plugin.dotted import import_object  # noqa: E402

CONNECTORS: dict[str, tuple[str, dict]] = {
    # Room for two 256 MiB values in flight; the default pool (256 MiB) holds one such value, and a
    # second one in flight takes the slower one-off path.
    "shm": ("SharedMemoryConnector", {"pool_bytes": 512 << 20}),
    "nixl": ("NixlConnector", {}),
    # TCP on loopback (no RDMA device here); a receive pool with room for two 256 MiB values in flight.
    "mooncake": (
        "MooncakeTransferEngineConnector",
        {"protocol": "tcp", "host": "127.0.0.1", "zmq_port": 0, "memory_pool_size": 512 << 20},
    ),
}
"""Row label -> (connector class, extra), built in both processes through ``make_connector``."""

BARE = {"NixlConnector": "bare nixl", "MooncakeTransferEngineConnector": "bare mooncake"}
"""Connector rows of these classes are compared with their bare transport too."""

IDLE_WHEN_UNUSED = {"MooncakeTransferEngineConnector"}
"""Transports whose idle engines take no CPU (Mooncake's TCP engine blocks on its sockets): the bare
baseline and the connector are measured in one phase, their rates taken in turn, so that a drift of the
machine's speed (the rates on a shared 2-core VM swing by a fifth from one minute to the next) falls on
both alike. NIXL's progress thread spins, so its bare baseline keeps a phase of its own."""

WINDOWS = (1, 2)
"""Transfers in flight at once, one row each."""

TARGETS = {
    "shm": ("memcpy", 0.5, 1 << 20),
    "nixl": ("bare nixl", 0.8, 0),
    "mooncake": ("bare mooncake", 0.8, 4 << 20),
}
"""Row label -> (reference, minimum ratio, from this size on), for the summary."""

_STOP = b"stop"


def _receiver(conn, class_name: str, extra: dict) -> None:
    torch.set_num_threads(1)
    connector = make_connector("bench", class_name, extra)
    decoder = msgspec.msgpack.Decoder(ConnectorHandle)
    while (message := conn.recv_bytes()) != _STOP:
        value = connector.get(decoder.decode(message))
        flat = value.reshape(-1).view(torch.uint8)
        reply = bytes([int(flat[0]), int(flat[-1])]) if flat.numel() else b""
        del value, flat  # done with it: pooled connectors may reuse its memory
        conn.send_bytes(reply)
    connector.close()


def load_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)``, from the ``nixl`` meta package or the CUDA 12 build."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def bare_nixl_agent(name: str, progress_thread: bool) -> Any:
    """A UCX agent (strict thread sync, as NixlConnector's) for the bare baseline, set up the fastest way
    we found: the owner runs NIXL's progress thread, so that it serves READs at once (between processes
    UCX emulates them with active messages, which need the owner's progress; without any progress
    thread they hang) while its main thread sleeps on the pipe; the receiver runs none and drives its
    READ by polling, like NixlConnector's receiver. (On a 2-core VM, progress threads on both sides read
    at 60-70% of that rate.)"""
    nixl_agent, nixl_agent_config = load_nixl()
    sync = getattr(sys.modules[nixl_agent.__module__], "nixl_thread_sync_t", None)
    options = {"sync_mode": sync.NIXL_THREAD_SYNC_STRICT} if sync is not None else {}
    return nixl_agent(
        name, nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread, **options)
    )


def _touched_buffer(nbytes: int) -> torch.Tensor:
    """The benchmark's byte pattern (``i % 251``), in memory whose pages are all touched."""
    return torch.arange(251, dtype=torch.uint8).repeat(-(-nbytes // 251))[:nbytes]


def _bare_nixl_receiver(conn, max_bytes: int) -> None:
    torch.set_num_threads(1)
    agent = bare_nixl_agent(f"bench-bare-rx-{os.getpid()}", progress_thread=False)
    buffer = torch.zeros(max_bytes, dtype=torch.uint8).fill_(1)
    agent.register_memory(buffer)
    metadata, remote_addr = conn.recv()
    remote = agent.add_remote_agent(metadata)
    conn.send(agent.get_agent_metadata())
    while (message := conn.recv_bytes()) != _STOP:
        nbytes = int.from_bytes(message, "little")
        local = agent.get_xfer_descs([(buffer.data_ptr(), nbytes, 0)], "DRAM")
        remote_descs = agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
        xfer = agent.initialize_xfer("READ", local, remote_descs, remote, b"")
        state = agent.transfer(xfer)
        while state == "PROC":
            state = agent.check_xfer_state(xfer)
        agent.release_xfer_handle(xfer)
        if state != "DONE":
            raise RuntimeError(f"bare nixl READ of {nbytes} bytes ended in state {state}")
        conn.send_bytes(bytes([int(buffer[0]), int(buffer[nbytes - 1])]))


def _bare_mooncake_engine(max_bytes: int) -> tuple[Any, torch.Tensor]:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake's transfer engine did not start")
    buffer = _touched_buffer(max_bytes)
    if engine.register_memory(buffer.data_ptr(), max_bytes) != 0:
        raise RuntimeError("Mooncake could not register the buffer")
    return engine, buffer


def _bare_mooncake_receiver(conn, max_bytes: int) -> None:
    torch.set_num_threads(1)
    engine, buffer = _bare_mooncake_engine(max_bytes)
    buffer.fill_(1)
    session, remote_addr = conn.recv()
    conn.send(b"ready")
    while (message := conn.recv_bytes()) != _STOP:
        nbytes = int.from_bytes(message, "little")
        if engine.transfer_sync_read(session, buffer.data_ptr(), remote_addr, nbytes) != 0:
            raise RuntimeError(f"bare mooncake READ of {nbytes} bytes failed")
        conn.send_bytes(bytes([int(buffer[0]), int(buffer[nbytes - 1])]))


@dataclass
class Peer:
    """A receiver process, and how this side hands it one value (returns the message to send)."""

    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    send: Callable[[torch.Tensor], bytes]
    keep: list[Any] = field(default_factory=list)
    """This side's objects that must live as long as the peer (agent, registered buffer)."""
    connector: OmniConnector | None = None

    def transfer_rate(self, src: torch.Tensor, window: int, seconds: float, repeats: int) -> float:
        want = bytes([int(src[0]), int(src[-1])])

        def run(minimum: int, seconds: float) -> tuple[int, float]:
            """Put for ``seconds`` (at least ``minimum`` values), keeping ``window`` in flight."""
            sent = acked = 0
            start = time.perf_counter()
            while True:
                while sent - acked < window and (sent < minimum or time.perf_counter() - start < seconds):
                    self.conn.send_bytes(self.send(src))
                    sent += 1
                if acked == sent:
                    return sent, time.perf_counter() - start
                if self.conn.recv_bytes() != want:
                    raise RuntimeError("receiver got different bytes than were put")
                acked += 1

        run(2, 0.0)  # warm-up: page tables, allocator caches, pools
        rates = []
        for _ in range(repeats):
            sent, elapsed = run(3, seconds)
            rates.append(sent * src.numel() / elapsed / 1e9)
        return max(rates)

    def close(self) -> None:
        self.conn.send_bytes(_STOP)
        self.process.join(timeout=60)
        if self.connector is not None:
            self.connector.close()


def start_connector_peer(ctx, class_name: str, extra: dict) -> Peer:
    import_object(CONNECTOR_CLASSES[class_name])  # raises ImportError before a process is started
    connector = make_connector("bench", class_name, extra)
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=_receiver, args=(child_end, class_name, extra), daemon=True)
    process.start()
    encoder = msgspec.msgpack.Encoder()
    return Peer(process, parent_end, lambda src: encoder.encode(connector.put(src)), connector=connector)


def start_bare_nixl_peer(ctx, max_bytes: int) -> Peer:
    agent = bare_nixl_agent(f"bench-bare-tx-{os.getpid()}", progress_thread=True)
    buffer = _touched_buffer(max_bytes)
    agent.register_memory(buffer)
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=_bare_nixl_receiver, args=(child_end, max_bytes), daemon=True)
    process.start()
    parent_end.send((agent.get_agent_metadata(), buffer.data_ptr()))
    agent.add_remote_agent(parent_end.recv())
    return Peer(process, parent_end, lambda src: src.numel().to_bytes(8, "little"), keep=[agent, buffer])


def start_bare_mooncake_peer(ctx, max_bytes: int) -> Peer:
    engine, buffer = _bare_mooncake_engine(max_bytes)
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=_bare_mooncake_receiver, args=(child_end, max_bytes), daemon=True)
    process.start()
    parent_end.send((f"127.0.0.1:{engine.get_rpc_port()}", buffer.data_ptr()))
    parent_end.recv()
    return Peer(process, parent_end, lambda src: src.numel().to_bytes(8, "little"), keep=[engine, buffer])


BARE_STARTERS: dict[str, Callable[[Any, int], Peer]] = {
    "NixlConnector": start_bare_nixl_peer,
    "MooncakeTransferEngineConnector": start_bare_mooncake_peer,
}


def local_rate(op: Callable[[], object], nbytes: int, seconds: float, repeats: int) -> float:
    op()
    rates = []
    for _ in range(repeats):
        count = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or count < 3:
            op()
            count += 1
        rates.append(count * nbytes / elapsed / 1e9)
    return max(rates)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@dataclass
class Row:
    label: str
    """``CONNECTORS`` key, or a baseline's name."""
    window: int
    rate: float
    vs_memcpy: float = 0.0
    vs_bare: float | None = None

    @property
    def name(self) -> str:
        return f"{self.label}, {self.window} in flight" if self.window else self.label


def measure_phase(
    starters: dict[str, Callable[[], Peer]],
    sizes: list[int],
    seconds: float,
    repeats: int,
    table: dict[int, list[Row]],
) -> None:
    """Start some peers, measure every size through them, and stop them again.

    A NIXL progress thread keeps a core busy, so agents (and engines) are alive only in their own phase.
    """
    peers: dict[str, Peer] = {}
    try:
        for label, start in starters.items():
            try:
                peers[label] = start()
            except Exception as exc:  # noqa: BLE001 - any failure only skips the row
                reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
                print(f"skipped {label}: {type(exc).__name__}: {reason}", flush=True)
        if peers:
            print(f"measuring {', '.join(peers)} ...", file=sys.stderr, flush=True)
        for nbytes in sizes if peers else []:
            src = _touched_buffer(nbytes)
            for window in WINDOWS:
                best = dict.fromkeys(peers, 0.0)
                for _ in range(repeats):  # the peers take turns: a slower minute costs each alike
                    for label, peer in peers.items():
                        best[label] = max(best[label], peer.transfer_rate(src, window, seconds, 1))
                table[nbytes] += [Row(label, window, rate) for label, rate in best.items()]
    finally:
        for peer in peers.values():
            peer.close()
        peers.clear()
        gc.collect()  # the agents' progress threads stop with them


def measure_local(sizes: list[int], seconds: float, repeats: int, table: dict[int, list[Row]]) -> None:
    for nbytes in sizes:
        src = _touched_buffer(nbytes)
        dst = torch.empty_like(src).fill_(0)
        table[nbytes] += [
            Row("memcpy (copy_)", 0, local_rate(partial(dst.copy_, src), nbytes, seconds, repeats)),
            Row("clone (fresh dst)", 0, local_rate(src.clone, nbytes, seconds, repeats)),
        ]


def add_ratios(rows: list[Row]) -> None:
    memcpy = rows[0].rate
    bare = {(row.label, row.window): row.rate for row in rows if row.label in BARE.values()}
    for row in rows:
        row.vs_memcpy = row.rate / memcpy
        reference = BARE.get(CONNECTORS[row.label][0]) if row.label in CONNECTORS else None
        if (reference, row.window) in bare:
            row.vs_bare = row.rate / bare[reference, row.window]


def summarize(table: dict[int, list[Row]]) -> list[str]:
    lines = []
    for label, (reference, target, min_size) in TARGETS.items():
        cells = [
            (row.vs_bare if reference in BARE.values() else row.vs_memcpy, nbytes, row)
            for nbytes, rows in table.items()
            if nbytes >= min_size
            for row in rows
            if row.label == label
        ]
        cells = [cell for cell in cells if cell[0] is not None]
        if not cells:
            continue
        worst, nbytes, row = min(cells, key=lambda cell: cell[0])
        verdict = "met" if worst >= target else "NOT met"
        lines.append(
            f"{label} >= {target}x {reference}"
            + (f" at >= {format_size(min_size)}" if min_size else "")
            + f": {verdict}, worst {worst:.2f}x ({row.name}, {format_size(nbytes)})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-size", default="1K")
    parser.add_argument("--max-size", default="256M")
    parser.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--seconds", type=float, default=0.15, help="measuring time per rate")
    parser.add_argument("--repeats", type=int, default=5, help="rates per cell; the best is shown")
    parser.add_argument("--connectors", default=",".join(CONNECTORS), help="comma-separated labels")
    args = parser.parse_args()
    torch.set_num_threads(1)

    sizes = []
    size = parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        sizes.append(size)
        size *= args.step
    ctx = multiprocessing.get_context("spawn")
    labels = [label for label in args.connectors.split(",") if label]
    unknown = [label for label in labels if label not in CONNECTORS]
    if unknown:
        parser.error(f"unknown connector label(s) {unknown}; known: {', '.join(CONNECTORS)}")
    alone = [label for label in labels if CONNECTORS[label][0] in BARE]

    def connector(label: str) -> Callable[[], Peer]:
        return lambda: start_connector_peer(ctx, *CONNECTORS[label])

    table: dict[int, list[Row]] = {nbytes: [] for nbytes in sizes}
    timing = (args.seconds, args.repeats)
    measure_local(sizes, *timing, table)
    for cls in dict.fromkeys(
        CONNECTORS[label][0] for label in alone if CONNECTORS[label][0] not in IDLE_WHEN_UNUSED
    ):
        start = partial(BARE_STARTERS[cls], ctx, sizes[-1])
        measure_phase({BARE[cls]: start}, sizes, *timing, table)
    measure_phase({label: connector(label) for label in labels if label not in alone}, sizes, *timing, table)
    for label in alone:
        cls = CONNECTORS[label][0]
        phase = {label: connector(label)}
        if cls in IDLE_WHEN_UNUSED:
            phase = {BARE[cls]: partial(BARE_STARTERS[cls], ctx, sizes[-1]), **phase}
        measure_phase(phase, sizes, *timing, table)

    print(f"{'size':>9}  {'transport':<26} {'GB/s':>7}  {'x memcpy':>8}  {'x bare':>7}")
    for nbytes, rows in table.items():
        add_ratios(rows)
        for i, row in enumerate(rows):
            size_text = format_size(nbytes) if i == 0 else ""
            bare_text = f"{row.vs_bare:7.2f}" if row.vs_bare is not None else ""
            print(
                f"{size_text:>9}  {row.name:<26} {row.rate:7.2f}  {row.vs_memcpy:8.2f}  {bare_text}".rstrip()
            )
    for line in summarize(table):
        print(line)


if __name__ == "__main__":
    main()
