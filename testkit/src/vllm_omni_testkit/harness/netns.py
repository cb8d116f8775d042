"""Two "hosts" on one machine: network namespaces joined by a veth pair (tests of headless stages).

Each namespace has its own loopback and one end of the veth pair with its own address, so processes
started in them (``ip netns exec NS ...``) can only reach each other over the veth, as two hosts would.
``NamespaceHTTP`` issues HTTP requests from threads that entered a namespace (``setns`` on a thread
changes only that thread), so a test can talk to a server that listens inside one.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_omni_testkit.harness import http_client

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class NamespacePair:
    """Namespaces ``a`` and ``b`` with addresses ``a_addr`` / ``b_addr`` on a veth pair."""

    a: str
    b: str
    a_dev: str
    b_dev: str
    a_addr: str
    b_addr: str
    created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls) -> NamespacePair:
        """Make the pair; raises ``OSError`` with the reason when this machine does not allow it."""
        if shutil.which("ip") is None:
            raise OSError("the `ip` command (iproute2) is not installed")
        tag = secrets.token_hex(3)
        subnet = 16 + int(tag[:2], 16) % 200
        pair = cls(
            a=f"omni-a-{tag}",
            b=f"omni-b-{tag}",
            a_dev=f"oa{tag}",
            b_dev=f"ob{tag}",
            a_addr=f"10.231.{subnet}.1",
            b_addr=f"10.231.{subnet}.2",
        )
        try:
            for name in (pair.a, pair.b):
                _ip("netns", "add", name)
                pair.created.append(name)
            _ip("link", "add", pair.a_dev, "type", "veth", "peer", "name", pair.b_dev)
            for ns, dev, addr in ((pair.a, pair.a_dev, pair.a_addr), (pair.b, pair.b_dev, pair.b_addr)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            pair.close()
            raise OSError(f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or '').strip()}") from None
        return pair

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        """Delete the namespaces (their veth ends go with them); processes in them must be gone."""
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()


def _enter(namespace: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
    finally:
        os.close(fd)


class NamespaceHTTP:
    """``get``/``post`` like httpx, run on threads inside ``namespace`` (a socket belongs to the network
    namespace of the thread that opens it), through one client (``http_client``'s reasons)."""

    def __init__(self, namespace: str, threads: int = 4) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"http-{namespace}",
                                        initializer=_enter, initargs=(namespace,))  # fmt: skip
        self._client = http_client.new_client()

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self._pool.submit(self._client.request, method, url, **kwargs).result()

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()
