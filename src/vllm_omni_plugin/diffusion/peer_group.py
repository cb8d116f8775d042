"""A denoiser group: a diffusion replica that spans ``cfg_parallel_size`` or ``sequence_parallel_size``
devices, one process each.

The replica's own process (rank 0) runs the engine and the pipelines as before; each other rank is a peer
process (``peer.py``) that holds only the denoiser, loaded from the same model directory onto its own
device. Rank 0 hands the peers calls over a gloo process group, one :class:`~.peer_wire.Link` per peer
(the messages: ``peer_wire.py``), computes its own part meanwhile and takes their outputs. What the calls
are is its users': CFG parallelism cuts a forward's rows over the ranks (``cfg_parallel.py``), sequence
parallelism its image tokens (``sequence_parallel.py``). Both reach the group through a
:class:`DenoiserStandIn` in the denoiser's place.

The transport is gloo on every device type, tensors staged through host memory (a step's latents and
text states: a few MiB for a 1024x1024 image), so the code that runs on a GPU host is the code tested on
CPU. Once a peer has failed (it died, an exchange timed out, its forward raised) the group is given up:
logged once, the peers stopped, and the replica computes every call whole itself, so no request is lost.

An argument a peer keeps between calls is a :class:`PeerKept` (BAGEL's rows' contexts): sent once, then
named by its key while consecutive calls name it (a batch's contexts are fixed across its steps; sent
every step they would be most of the traffic).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from vllm_omni_plugin.diffusion.peer_wire import (
    Call,
    Failure,
    Kept,
    Link,
    Reply,
    Stop,
    WireError,
    class_path,
    encode,
)

logger = logging.getLogger(__name__)

PEER_START_TIMEOUT_S = 600.0
"""How long rank 0 waits for its peers to load their denoisers and join the group."""
FORWARD_TIMEOUT_S = 600.0
"""The group's timeout for one exchange: a peer that neither answers nor dies within it has failed."""
PEER_MODULE = "vllm_omni_plugin.diffusion.peer"
"""The module a peer process runs (``python -m``)."""


@dataclass(frozen=True)
class PeerSpec:
    """What a peer process loads: the denoiser's class and where its weights are."""

    model: str
    subfolder: str
    module: str
    qualname: str
    dtype: str
    device: str
    num_threads: int | None
    trust_remote_code: bool = False
    quantization: dict[str, Any] | None = None
    """The stage's ``QuantizationSpec`` (as JSON builtins): a peer's denoiser is quantized as rank 0's."""


class PeerKept:
    """An argument a peer keeps between forwards: sent whole the first time a call names it, named by
    :attr:`wire_key` after that while consecutive calls to that peer keep naming it (a peer holds exactly
    the kept values of its last call)."""

    wire_key: Hashable
    """Equal for one value for as long as it lives (never reused by another)."""

    def wire_state(self) -> Any:
        """The value as the wire carries it (``peer_wire.py``): tensors, numbers and strings in tuples,
        lists and dicts."""
        raise NotImplementedError

    @classmethod
    def from_wire(cls, state: Any, device: Any) -> PeerKept:
        """The value again, on the peer (``state``'s tensors are on ``device`` already)."""
        raise NotImplementedError


class PeerError(Exception):
    """A peer's forward raised: its message, as the peer sent it."""


class DenoiserGroup:
    """Rank 0's side: starts the peers, hands each its call, takes their outputs, and stops them."""

    def __init__(
        self, size: int, spec_of_rank: list[PeerSpec], *, timeout_s: float = FORWARD_TIMEOUT_S
    ) -> None:
        import torch.distributed as dist

        if size < 2 or len(spec_of_rank) != size - 1:
            raise ValueError(
                f"a denoiser group of {size} needs {size - 1} peer specs, got {len(spec_of_rank)}"
            )
        self.size = size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.failed: str | None = None
        """Why the peers are no longer used (None: they are)."""
        self._held: list[set[Hashable]] = [set() for _ in range(size)]
        """Per rank, the :class:`PeerKept` values it holds (those its last call named)."""
        self.lock = threading.Lock()
        """Held for each exchange (the group's messages are matched in order); a user whose local calls
        must not run beside an exchange (sequence parallelism's hooks) holds it for those too."""
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=PEER_START_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
        # A fresh interpreter per peer (not multiprocessing's spawn, which re-imports the parent's main
        # module), with this process's environment: its output goes where the replica's goes.
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    PEER_MODULE,
                    json.dumps(asdict(spec)),
                    str(rank),
                    str(self._store.port),
                    str(size),
                ]  # fmt: skip
            )
            for rank, spec in enumerate(spec_of_rank, start=1)
        ]
        self.process_group = self._join()
        """The gloo process group of the ranks (sequence parallelism's exchanges run on it too)."""
        self.process_group.set_timeout(self.timeout)
        self._links = {rank: Link(self.process_group, rank) for rank in range(1, size)}

    def _join(self) -> Any:
        """The group, once every peer has loaded its denoiser and joined; a peer that exits first (it
        could not load) stops the wait at once."""
        joined: list[Any] = []
        failed: list[BaseException] = []

        def connect() -> None:
            try:
                joined.append(
                    gloo_group(self._store, 0, self.size, datetime.timedelta(seconds=PEER_START_TIMEOUT_S))
                )
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=connect, name="dit-cfg-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            dead = [
                (rank, p.poll()) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None
            ]
            if dead and thread.is_alive():
                self.failed = "start-up"
                self._stop_peers()
                codes = ", ".join(f"rank {rank} exited with code {code}" for rank, code in dead)
                raise RuntimeError(
                    f"the denoiser group's peers did not start: {codes} (the log above says why)"
                )
        if failed or not joined:
            self.failed = "start-up"
            self._stop_peers()
            raise RuntimeError(
                f"the denoiser group's peers did not join: {failed[0] if failed else 'no group'}"
            )
        return joined[0]

    def exchange(
        self, mode: Literal["rows", "sequence"], calls: Mapping[int, dict[str, Any]], own: Callable[[], Any]
    ) -> tuple[Any, list[Any]] | None:
        """Rank ``r`` computes the call ``calls[r]`` (``mode``: ``"rows"``, a forward of its own;
        ``"sequence"``, its part of a sequence-parallel one) while this rank runs ``own()``: what ``own()``
        returned and the peers' outputs, in the order of ``calls``. None where the group has failed, before
        or now (logged; the caller computes the call whole). An argument the wire cannot carry raises
        :class:`~.peer_wire.WireError` before anything is sent (the group stays as it was)."""
        with self.lock:
            if self.failed is not None:
                return None
            messages = self._messages(mode, calls)
            try:
                for rank, message in messages.items():
                    self._links[rank].send(message)
                result = own()
                return result, [self._reply(rank) for rank in calls]
            except PeerError as exc:
                self._fail(str(exc))
            except Exception as exc:  # gloo (a closed connection, a timeout), or this rank's part
                # The peers' outputs are not taken (or they wait inside a collective of a sequence-parallel
                # forward): they cannot be used again.
                self._fail(f"the exchange with its peers failed: {type(exc).__name__}: {exc}")
        return None

    def send_call(self, kwargs: dict[str, Any]) -> bool:
        """Hand rank 1 a whole call to compute; the group's other exchanges wait until :meth:`take_call`
        takes its output. False: not sent (the group has failed, or failed now; or an argument the wire
        cannot carry, found before anything is sent), and nothing to take."""
        self.lock.acquire()
        try:
            if self.failed is None:
                message = self._messages("rows", {1: kwargs})[1]
                self._links[1].send(message)
                return True
        except RuntimeError as exc:  # gloo: a closed connection, a timeout
            self._fail(f"the exchange with its peers failed: {exc}")
        except WireError as exc:
            logger.warning("denoiser group: rank 1 is not sent the call: %s", exc)
        self.lock.release()
        return False

    def take_call(self, device: Any = None) -> Any | None:
        """The output of the call :meth:`send_call` handed over (on ``device``); None if rank 1 failed."""
        try:
            return self._reply(1, device)
        except PeerError as exc:
            self._fail(str(exc))
        except RuntimeError as exc:
            self._fail(f"the exchange with its peers failed: {exc}")
        finally:
            self.lock.release()
        return None

    def _reply(self, rank: int, device: Any = None) -> Any:
        """Rank ``rank``'s answer to the call it was sent (:class:`PeerError` where its forward raised)."""
        reply = self._links[rank].take(device)
        if isinstance(reply, Failure):
            raise PeerError(f"rank {rank}'s forward failed: {reply.message}")
        if not isinstance(reply, Reply):
            raise PeerError(f"rank {rank} answered a call with {type(reply).__name__}")
        return reply.output

    def _messages(
        self, mode: Literal["rows", "sequence"], calls: Mapping[int, dict[str, Any]]
    ) -> dict[int, Any]:
        """Each rank's call as it is sent (encoded, every one before any is sent): its :class:`PeerKept`
        values by key alone where the rank holds them."""
        messages, named = {}, {}
        for rank, kwargs in calls.items():
            held, named[rank] = self._held[rank], set()
            plain: dict[str, Any] = {}
            kept: dict[str, Kept] = {}
            for name, value in kwargs.items():
                if not isinstance(value, PeerKept):
                    plain[name] = value
                    continue
                key = value.wire_key
                named[rank].add(key)
                kept[name] = (
                    Kept(key) if key in held else Kept(key, class_path(type(value)), value.wire_state())
                )
            messages[rank] = encode(Call(mode, plain, kept))
        for rank, keys in named.items():
            self._held[rank] = keys
        return messages

    def _fail(self, why: str) -> None:
        self.failed = why
        logger.error("denoiser group: %s; this replica computes every forward whole from now on", why)
        self._stop_peers()

    def _stop_peers(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def close(self) -> None:
        """Stops the peers (a stop message, then a kill for any that did not leave)."""
        if self.failed is None and getattr(self, "_links", None) is not None:
            with contextlib.suppress(Exception), self.lock:
                for rank in range(1, self.size):
                    self._links[rank].send(encode(Stop()))
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
        self.failed = self.failed or "closed"
        self._stop_peers()

    @property
    def alive(self) -> bool:
        return self.failed is None and all(p.poll() is None for p in self.processes)


class DenoiserStandIn:
    """What stands in for a denoiser in a pipeline (its other attributes are the denoiser's): the calls
    go over a denoiser group (CFG parallelism's row splitting, sequence parallelism's token splitting)."""

    def __init__(self, module: Any, group: DenoiserGroup) -> None:
        self._module = module
        self._group = group
        modules = getattr(module, "modules", None)  # BAGEL's velocity is no torch module
        self._inner = [m for m in modules() if m is not module] if modules is not None else []

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self._module.forward)

    def _hooked(self) -> bool:
        """A hook inside the denoiser (a LoRA adapter's, a cache's): the peers hold neither."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self._inner)

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        """diffusers' ``CacheMixin.cache_context`` (Qwen-Image's pipelines enter it around each branch)."""
        with self._module.cache_context(name):
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """Rank ``rank``'s gloo process group of ``size`` ranks, met through ``store``."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)
