"""A model family's request settings: the fields a request may carry beyond OpenAI's (BAGEL's guidance,
its think mode). Each family declares one :class:`RequestSettings` subclass and names it in its
``Pipeline`` (``settings``, a dotted path); the HTTP layer hands a request's extra fields to it and knows
no family's names. A bad value is a :class:`SettingError` naming its field, worded as the OpenAI-style
validation of the other fields words it (``cfg_text_scale: Input should be greater than or equal to 0``).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal

import msgspec


class SettingError(ValueError):
    """A setting the family's type refuses; ``param`` names the field (``cfg_interval.1``)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of a family's settings: every field optional (``None``: not given)."""

    bounds: ClassVar[dict[str, dict[str, float]]] = {}
    """Per field, its numeric bounds (``ge``, ``gt``, ``le``)."""

    def problems(self) -> Iterator[tuple[str | None, str]]:
        """``(param, message)`` for each value out of its bounds; a family adds checks across fields."""
        for name, limits in self.bounds.items():
            value = getattr(self, name)
            if value is None:
                continue
            problem = _out_of_bounds(value, limits)
            if problem is not None:
                yield name, f"{name}: {problem}"

    def given(self) -> dict[str, Any]:
        """The settings the request gave."""
        return {name: v for name in self.__struct_fields__ if (v := getattr(self, name)) is not None}

    def with_defaults(self, *, edit: bool) -> RequestSettings:
        """These settings with the family's own defaults where none is given (``edit``: the request has
        source images); the input processor asks once per request. As they are unless the family has
        defaults."""
        return self


def _number(x: float) -> str:
    return f"{x:g}"


def _out_of_bounds(value: float, limits: dict[str, float]) -> str | None:
    # In pydantic's order: an upper bound before a lower one (so NaN reports the upper bound).
    if "le" in limits and not value <= limits["le"]:
        return f"Input should be less than or equal to {_number(limits['le'])}"
    if "ge" in limits and not value >= limits["ge"]:
        return f"Input should be greater than or equal to {_number(limits['ge'])}"
    if "gt" in limits and not value > limits["gt"]:
        return f"Input should be greater than {_number(limits['gt'])}"
    return None


def read_settings(settings_type: type[RequestSettings], fields: Mapping[str, Any]) -> RequestSettings:
    """``fields`` as ``settings_type`` (lax: ``"4.5"`` is a number, ``"true"`` a boolean), checked; the first
    problem is raised (with a count of the others). Unknown fields are the caller's to refuse first."""
    problems: list[tuple[str | None, str]] = []
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(settings_type)
    for name, value in fields.items():
        if value is None:
            continue
        infinite = _non_finite_part(name, value, hints[name])
        if infinite is not None:
            problems.append((infinite, f"{infinite}: must be a finite number"))
            continue
        if isinstance(value, bool) and float in typing.get_args(hints[name]):
            value = float(value)  # a number field takes true/false as 1/0, as pydantic's lax mode does
        try:
            values[name] = msgspec.convert(value, hints[name], strict=False)
        except msgspec.ValidationError as exc:
            problems.append(_type_problem(name, value, hints[name], str(exc)))
    settings = settings_type(**values)
    if not problems:
        problems = list(settings.problems())
    if problems:
        param, message = problems[0]
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
        raise SettingError(message, param)
    return settings


def non_finite(value: Any) -> bool:
    """NaN or an infinity, as a number or as the text a lax number field would read as one (``"nan"``,
    ``"-inf"``, ``"1e999"``)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        try:
            return not math.isfinite(float(value))
        except ValueError:
            return False
    return False


def _non_finite_part(name: str, value: Any, hint: Any) -> str | None:
    """The param of a NaN or infinity given to a number field, or to an item of a tuple of numbers
    (``cfg_interval.1``); None if there is none. Unchecked, NaN fails only a bound, misleadingly."""
    for kind in [a for a in typing.get_args(hint) if a is not type(None)] or [hint]:
        if kind in (int, float) and non_finite(value):
            return name
        items = typing.get_args(kind) if typing.get_origin(kind) is tuple else ()
        if items and isinstance(value, list | tuple):
            for i, (item, item_kind) in enumerate(zip(value, items, strict=False)):
                if item_kind in (int, float) and non_finite(item):
                    return f"{name}.{i}"
    return None


def _type_problem(name: str, value: Any, hint: Any, error: str) -> tuple[str, str]:
    """A value of the wrong type, worded as pydantic words it."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = kinds[0]
    if typing.get_origin(kind) is Literal:
        options = [repr(o) for o in typing.get_args(kind)]
        listed = ", ".join(options[:-1]) + f" or {options[-1]}" if len(options) > 1 else options[0]
        return name, f"{name}: Input should be {listed}"
    if kind is bool:
        suffix = ", unable to interpret input" if isinstance(value, str) else ""
        return name, f"{name}: Input should be a valid boolean{suffix}"
    if kind is int:
        if isinstance(value, float):
            suffix = ", got a number with a fractional part"
        elif isinstance(value, str):
            suffix = ", unable to parse string as an integer"
        else:
            suffix = ""
        return name, f"{name}: Input should be a valid integer{suffix}"
    if kind is float:
        suffix = ", unable to parse string as a number" if isinstance(value, str) else ""
        return name, f"{name}: Input should be a valid number{suffix}"
    if typing.get_origin(kind) is tuple:
        size = len(typing.get_args(kind))
        if isinstance(value, list | tuple) and len(value) < size:
            return f"{name}.{len(value)}", f"{name}.{len(value)}: Field required"
        return name, f"{name}: Input should be a valid tuple"
    return name, f"{name}: {error}"
