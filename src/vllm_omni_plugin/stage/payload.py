"""Large tensors in stage messages travel through a connector; the message carries only handles.

``externalize`` replaces every tensor of at least ``min_bytes`` inside a request (struct fields, lists,
dicts) by the handle of a ``connector.put``; ``internalize`` (in the receiving process, with a connector
of the same class) fetches them back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from vllm_omni_plugin.connectors.base import HANDLE_KEY, ConnectorHandle, OmniConnector
from vllm_omni_plugin.log import best_effort
from vllm_omni_plugin.stage.core_types import (
    StageCoreOutput,
    StageDiffusionCoreOutput,
    StageDiffusionCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageDeadError


def externalize(value: Any, connector: OmniConnector, min_bytes: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() >= min_bytes:
            tensor = value.detach()
            if not connector.device_memory:  # it can only store host memory
                tensor = tensor.cpu()
            return {HANDLE_KEY: msgspec.to_builtins(connector.put(tensor.contiguous()))}
        return value
    if isinstance(value, msgspec.Struct):
        changes = {f: externalize(getattr(value, f), connector, min_bytes) for f in value.__struct_fields__}
        return msgspec.structs.replace(value, **changes)
    if isinstance(value, list | tuple):
        return type(value)(externalize(v, connector, min_bytes) for v in value)
    if isinstance(value, dict):
        return {k: externalize(v, connector, min_bytes) for k, v in value.items()}
    return value


def internalize(value: Any, connector: OmniConnector, timeout: float | None = None) -> Any:
    if isinstance(value, dict):
        if HANDLE_KEY in value and len(value) == 1:
            return connector.get(msgspec.convert(value[HANDLE_KEY], ConnectorHandle), timeout=timeout)
        return {k: internalize(v, connector, timeout) for k, v in value.items()}
    if isinstance(value, msgspec.Struct):
        changes = {f: internalize(getattr(value, f), connector, timeout) for f in value.__struct_fields__}
        return msgspec.structs.replace(value, **changes)
    if isinstance(value, list | tuple):
        return type(value)(internalize(v, connector, timeout) for v in value)
    return value


def handles_in(value: Any) -> Iterator[Any]:
    """The connector handles inside a message (struct fields, lists, dicts), in order, as they travel
    (the fields of a ``ConnectorHandle``)."""
    if isinstance(value, dict):
        if HANDLE_KEY in value and len(value) == 1:
            yield value[HANDLE_KEY]
            return
        for v in value.values():
            yield from handles_in(v)
    elif isinstance(value, msgspec.Struct):
        for f in value.__struct_fields__:
            yield from handles_in(getattr(value, f))
    elif isinstance(value, list | tuple):
        for v in value:
            yield from handles_in(v)


def carries_handles(value: Any) -> bool:
    """Whether a message holds connector handles (values that are read once, by one receiver)."""
    return next(handles_in(value), None) is not None


def release(value: Any, connector: OmniConnector) -> None:
    """Free the handles inside a message that will never be read (its request was aborted)."""
    for handle in handles_in(value):
        connector.cleanup(msgspec.convert(handle, ConnectorHandle))


def send_request_through(request: Any, connector: OmniConnector | None) -> tuple[Any, float]:
    """A diffusion stage request with its tensors put through ``connector``; (request, seconds)."""
    if connector is None or not isinstance(request, StageDiffusionCoreRequest):
        return request, 0.0
    t0 = time.perf_counter()
    request = msgspec.structs.replace(request, diffusion=externalize(request.diffusion, connector))
    return request, time.perf_counter() - t0


@contextlib.contextmanager
def released_if_replica_dies(request: Any, connector: OmniConnector | None) -> Iterator[None]:
    """Free a sent request's inputs when its replica dies with it: nobody reads them any more (a retry
    puts them anew), and a value read just before the death may never have been acknowledged, so only
    its lease would free it otherwise."""
    try:
        yield
    except StageDeadError:
        if connector is not None and isinstance(request, StageDiffusionCoreRequest):
            with best_effort("freeing the inputs of a request whose replica died", warn=True):
                release(request.diffusion, connector)
        raise


def collect_output(output: StageCoreOutput, connector: OmniConnector | None) -> None:
    """Fetch an output's image from ``connector`` when it travelled as a handle (times it). The image is
    copied out at once: a zero-copy view would keep its pool slot until the last reference to the
    output goes, which an exception's traceback can delay until a garbage collection; the copy costs
    less than the PNG encoding that follows."""
    if connector is None or not isinstance(output, StageDiffusionCoreOutput) or output.image_handle is None:
        return
    t0 = time.perf_counter()
    image = connector.get(msgspec.convert(output.image_handle, ConnectorHandle))
    output.image = image.numpy().copy()
    del image  # the view's slot is free again
    output.image_handle = None
    output.timings["transfer_out"] = time.perf_counter() - t0


def discard_output(output: StageCoreOutput | None, connector: OmniConnector | None) -> None:
    """Free the image behind an output nobody waits for any more (its request was aborted)."""
    if connector is None or not isinstance(output, StageDiffusionCoreOutput) or output.image_handle is None:
        return
    with best_effort("freeing the image of an output nobody waits for (its lease frees it otherwise)"):
        connector.cleanup(msgspec.convert(output.image_handle, ConnectorHandle))
