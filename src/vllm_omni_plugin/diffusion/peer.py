"""A denoiser group's peer process (``python -m vllm_omni_plugin.diffusion.peer SPEC RANK PORT SIZE``, as
``DenoiserGroup`` starts it): loads the denoiser, joins the group, and answers rank 0's calls until told to
stop. Its own module, apart from ``peer_group.py``, because it runs sequence parallelism's part of a call
(``sequence_parallel.py``), which itself stands on the group."""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from collections.abc import Hashable
from typing import Any

from vllm_omni_plugin.diffusion.peer_group import PEER_START_TIMEOUT_S, PeerKept, PeerSpec, gloo_group
from vllm_omni_plugin.diffusion.peer_wire import (
    Call,
    Failure,
    Link,
    Message,
    Reply,
    WireError,
    encode,
    resolve_class,
)
from vllm_omni_plugin.diffusion.sequence_parallel import SequencePlan, sequence_call, sequence_plan
from vllm_omni_plugin.processes import end_process

logger = logging.getLogger(__name__)


def _exit_with_parent() -> None:
    """A peer outlives no rank 0: a SIGKILLed replica leaves no peer holding a device."""
    import os
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="dit-cfg-parent", daemon=True).start()


def _load(spec: PeerSpec) -> tuple[Any, Any]:
    """The denoiser ``spec`` names, on its device, and that device."""
    import importlib

    import torch

    cls: Any = importlib.import_module(spec.module)
    for part in spec.qualname.split("."):
        cls = getattr(cls, part)
    dtype = getattr(torch, spec.dtype.removeprefix("torch."))
    device = torch.device(spec.device)
    if hasattr(cls, "load_peer"):  # a denoiser of ours (BAGEL's velocity), not a diffusers model
        return cls.load_peer(spec.model, dtype=dtype, device=device), device
    from vllm_omni_plugin.diffusion.quantization import QuantizationSpec, load_denoiser

    quantization = QuantizationSpec.of(spec.quantization)
    module = load_denoiser(cls, spec.model, spec.subfolder, dtype, quantization)
    return module.to(device).eval(), device


def serve(spec: PeerSpec, rank: int, port: int, size: int) -> None:
    """A peer process: load the denoiser, join the group, answer calls until told to stop."""
    import os

    import torch
    import torch.distributed as dist

    _exit_with_parent()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    module, device = _load(spec)
    store = dist.TCPStore(
        "127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=PEER_START_TIMEOUT_S)
    )
    group = gloo_group(store, rank, size, datetime.timedelta(seconds=PEER_START_TIMEOUT_S))
    group.set_timeout(datetime.timedelta(days=365))  # idle between requests for as long as the replica is
    link = Link(group, 0)
    plan: SequencePlan | None = None
    held: dict[Hashable, PeerKept] = {}
    """The kept values the last call named (:class:`PeerKept`)."""
    while True:
        try:
            message = link.take(device)
        except RuntimeError:  # rank 0 is gone
            return
        if not isinstance(message, Call):  # Stop
            return
        mode, kwargs = message.mode, dict(message.kwargs)
        try:
            now = {}
            for name, kept in message.kept.items():
                now[kept.key] = (
                    held[kept.key]
                    if kept.cls is None
                    else _kept_class(kept.cls).from_wire(kept.state, device)
                )
                kwargs[name] = now[kept.key]
            held = now
            with torch.no_grad():
                if mode == "sequence":
                    plan = plan or sequence_plan(module)
                    sequence_call(module, plan, kwargs, group, rank, size)
                    reply: Message = Reply(None)
                else:
                    reply = Reply(module(**kwargs))
        except Exception as exc:
            if mode == "sequence":
                # Rank 0 may wait in a collective this rank will not reach: leaving closes the group's
                # connections, which ends that wait with an error, and rank 0 goes on alone.
                logger.error("sequence-parallel rank %d: %s: %s; leaving", rank, type(exc).__name__, exc)
                os._exit(1)
            reply = Failure(f"{type(exc).__name__}: {exc}")
        try:
            link.send(_encoded(reply))
        except RuntimeError:
            return


def _kept_class(path: str) -> type[PeerKept]:
    """The :class:`PeerKept` class a call names for a kept argument."""
    cls = resolve_class(path)
    if not issubclass(cls, PeerKept):
        raise TypeError(f"{path} is no PeerKept")
    return cls


def _encoded(reply: Message) -> Any:
    """``reply`` encoded; a failure naming what the wire cannot carry where its output holds that."""
    try:
        return encode(reply)
    except WireError as exc:
        return encode(Failure(f"WireError: {exc}"))


def main(argv: list[str]) -> None:
    """``SPEC RANK PORT SIZE``: the :class:`PeerSpec` as JSON, this rank, the group store's port, the
    ranks."""
    serve(PeerSpec(**json.loads(argv[0])), int(argv[1]), int(argv[2]), int(argv[3]))


if __name__ == "__main__":
    main(sys.argv[1:])
    end_process(0)  # the group told it to leave: nothing of the interpreter's teardown is needed
