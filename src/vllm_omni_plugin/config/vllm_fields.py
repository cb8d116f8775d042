"""What the installed vLLM accepts: its ``EngineArgs`` fields (with their types) and ``SamplingParams``
fields, read from vLLM itself so that a deploy config is checked against the vLLM that will run it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgspec


@functools.cache
def engine_arg_types() -> dict[str, Any]:
    """EngineArgs field -> type hint (or None where vLLM's hint cannot be evaluated)."""
    from vllm_omni_plugin.compat import resolve as compat_resolve

    engine_args = compat_resolve("EngineArgs")
    module = __import__(engine_args.__module__, fromlist=["_"])
    out: dict[str, Any] = {}
    for f in dataclasses.fields(engine_args):
        hint: Any = f.type
        if isinstance(hint, str):  # a forward reference; some of vLLM's do not evaluate outside vLLM
            try:
                hint = eval(hint, vars(module))  # noqa: S307 - vLLM's own annotation text
            except Exception:
                hint = None
        out[f.name] = hint
    return out


def check_engine_value(name: str, value: Any) -> str | None:
    """Why ``value`` is wrong for EngineArgs field ``name``, or None when it is acceptable."""
    hint = engine_arg_types().get(name)
    if hint is None:
        return None
    try:
        msgspec.convert(value, hint, strict=False)
    except msgspec.ValidationError as exc:
        return str(exc).split(" - at ")[0].replace("Expected", "expected")
    except Exception:  # msgspec cannot express this vLLM type; vLLM checks it at start-up
        return None
    return None


@functools.cache
def sampling_param_fields() -> frozenset[str]:
    from vllm_omni_plugin.compat import resolve as compat_resolve

    sampling = compat_resolve("SamplingParams")
    return frozenset(f.name for f in msgspec.structs.fields(sampling))


def check_sampling_params(params: dict[str, Any]) -> str | None:
    """vLLM's own complaint about ``SamplingParams(**params)``, or None when it accepts them."""
    from vllm_omni_plugin.compat import resolve as compat_resolve

    try:
        compat_resolve("SamplingParams")(**params)
    except Exception as exc:  # vLLM's own validation message
        return str(exc)
    return None
