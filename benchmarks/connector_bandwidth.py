"""Connector bandwidth, put in one process and get in another, against an in-process memcpy.

    python benchmarks/connector_bandwidth.py [--min-size 1K] [--max-size 256M] [--seconds 0.4]

For each size, the parent puts one tensor after another and sends each handle (msgpack, over a pipe) to a
spawned receiver process, which gets it and acknowledges; a rate counts bytes from the first put to
the last acknowledgement. "1 in flight" waits for each acknowledgement before the next put (latency
bound); "2 in flight" lets the next put overlap the previous get (what a stream of stage outputs sees).
Baselines in the same run: ``dst.copy_(src)`` into a warm buffer (the target's reference), and
``src.clone()``, which like ``get`` returns fresh memory and so pays for first-touching its pages.
Every process runs torch with one thread.

A connector is one more entry in ``CONNECTORS`` (its class name and ``extra``, as in a deploy config).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec  # noqa: E402
import torch  # noqa: E402

from vllm_omni_plugin.connectors.base import ConnectorHandle, OmniConnector, make_connector  # noqa: E402

CONNECTORS: dict[str, tuple[str, dict]] = {
    "shm": ("SharedMemoryConnector", {}),
}
"""Row label -> (connector class, extra), built in both processes through ``make_connector``."""

WINDOWS = (1, 2)
"""Transfers in flight at once, one row each."""

_STOP = b"stop"


def _receiver(conn, class_name: str, extra: dict) -> None:
    torch.set_num_threads(1)
    connector = make_connector("bench", class_name, extra)
    decoder = msgspec.msgpack.Decoder(ConnectorHandle)
    while (message := conn.recv_bytes()) != _STOP:
        value = connector.get(decoder.decode(message))
        flat = value.reshape(-1).view(torch.uint8)
        conn.send_bytes(bytes([int(flat[0]), int(flat[-1])]) if flat.numel() else b"")
    connector.close()


@dataclass
class Peer:
    """A connector in this process and a receiver process getting through the same connector class."""

    connector: OmniConnector
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection

    def transfer_rate(self, src: torch.Tensor, window: int, seconds: float) -> float:
        encoder = msgspec.msgpack.Encoder()
        want = bytes([int(src[0]), int(src[-1])])

        def run(minimum: int, seconds: float) -> tuple[int, float]:
            """Put for ``seconds`` (at least ``minimum`` values), keeping ``window`` in flight."""
            sent = acked = 0
            start = time.perf_counter()
            while True:
                while sent - acked < window and (sent < minimum or time.perf_counter() - start < seconds):
                    self.conn.send_bytes(encoder.encode(self.connector.put(src)))
                    sent += 1
                if acked == sent:
                    return sent, time.perf_counter() - start
                if self.conn.recv_bytes() != want:
                    raise RuntimeError("receiver got different bytes than were put")
                acked += 1

        run(2, 0.0)  # warm-up: page tables, allocator caches
        sent, elapsed = run(3, seconds)
        return sent * src.numel() / elapsed / 1e9

    def close(self) -> None:
        self.conn.send_bytes(_STOP)
        self.process.join(timeout=60)
        self.connector.close()


def start_peer(ctx, class_name: str, extra: dict) -> Peer:
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=_receiver, args=(child_end, class_name, extra), daemon=True)
    process.start()
    return Peer(make_connector("bench", class_name, extra), process, parent_end)


def local_rate(op: Callable[[], object], nbytes: int, seconds: float) -> float:
    op()
    count = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        op()
        count += 1
    return count * nbytes / elapsed / 1e9


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def measure(nbytes: int, peers: dict[str, Peer], seconds: float) -> list[tuple[str, float]]:
    """(row label, GB/s) for one size: the baselines first, memcpy being the reference."""
    src = torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
    dst = torch.empty_like(src)
    rows = [
        ("memcpy (copy_)", local_rate(lambda: dst.copy_(src), nbytes, seconds)),
        ("clone (fresh dst)", local_rate(src.clone, nbytes, seconds)),
    ]
    for label, peer in peers.items():
        for window in WINDOWS:
            rows.append((f"{label}, {window} in flight", peer.transfer_rate(src, window, seconds)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-size", default="1K")
    parser.add_argument("--max-size", default="256M")
    parser.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--seconds", type=float, default=0.4, help="measuring time per cell")
    parser.add_argument("--connectors", default=",".join(CONNECTORS), help="comma-separated labels")
    args = parser.parse_args()
    torch.set_num_threads(1)

    sizes = []
    size = parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        sizes.append(size)
        size *= args.step
    ctx = multiprocessing.get_context("spawn")
    peers = {label: start_peer(ctx, *CONNECTORS[label]) for label in args.connectors.split(",")}

    print(f"{'size':>9}  {'transport':<22} {'GB/s':>7}  {'x memcpy':>8}")
    try:
        for nbytes in sizes:
            rows = measure(nbytes, peers, args.seconds)
            memcpy = rows[0][1]
            for i, (name, rate) in enumerate(rows):
                size_text = format_size(nbytes) if i == 0 else ""
                print(f"{size_text:>9}  {name:<22} {rate:7.2f}  {rate / memcpy:8.2f}", flush=True)
    finally:
        for peer in peers.values():
            peer.close()


if __name__ == "__main__":
    main()
