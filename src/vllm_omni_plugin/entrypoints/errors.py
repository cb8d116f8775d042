"""Client mistakes as OpenAI's error JSON, for every front end.

Every client mistake becomes an :class:`OmniAPIError`, which the server turns into OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``, with vLLM's ``type`` names and the HTTP status as
``code``); the readers of a request body (JSON text, a pydantic request type) raise it naming the field.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OmniAPIError(Exception):
    """A request the server answers with an error JSON instead of a result."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    err_type = ERROR_TYPES.get(status)
    if err_type is None:
        try:
            err_type = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:
            err_type = "Error"
    return msgspec.json.encode(ErrorResponse(ErrorInfo(message, err_type, param, status)))


MAX_JSON_DEPTH = 64
"""How deeply a request's JSON may nest (a chat request with image parts nests 5 levels). Deeper JSON is
refused before anything walks it: a body of 100,000 ``[`` would otherwise exhaust the recursion limit."""


# float_hook: a number out of float range (1e999) reads as inf, which the request types refuse naming
# its field, instead of failing the whole body as "Number out of range".
_JSON_DECODER = msgspec.json.Decoder(float_hook=float)


_TOO_DEEP = object()


def decode_json(data: bytes | str, what: str = "the request body", param: str | None = None) -> Any:
    """JSON text -> Python values; malformed or nested deeper than :data:`MAX_JSON_DEPTH` -> 400."""
    try:
        value = _JSON_DECODER.decode(data)
    except RecursionError:
        value = _TOO_DEEP
    except msgspec.DecodeError as exc:
        raise OmniAPIError(f"{what} is not valid JSON ({exc})", param=param) from None
    if value is _TOO_DEEP or _nested_deeper_than(value, MAX_JSON_DEPTH):
        raise OmniAPIError(
            f"{what} is JSON nested too deeply (this server reads at most {MAX_JSON_DEPTH} levels of "
            "arrays and objects)",
            param=param,
        )
    return value


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s lists and dicts nest more than ``limit`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(cls: type[RequestT], data: Any) -> RequestT:
    """Validate ``data`` against ``cls``; the first problem becomes one 400 with its field as ``param``."""
    if not isinstance(data, dict):
        raise OmniAPIError("the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = ".".join(loc) or None
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {param!r}"
        else:
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            if param:
                message = f"{param}: {message}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise OmniAPIError(message, param=param) from None
