"""Wire types of OpenAI's Videos API (``/v1/videos``): the operator's bounds (``VideoLimits``), the create
request (``VideoCreateRequest``), and the ``Video`` object, list page and delete answer as the openai client
parses them (``openai.types.Video``, ``SyncConversationCursorPage``, ``VideoDeleteResponse``).

The openai client sends create as ``multipart/form-data`` always (with or without an ``input_reference``
file), so every field can arrive as text: the request type reads ``"4"``, ``"42"`` and ``"7.5"`` as the
numbers they spell. As in the Images API, the request is a pydantic model and a client mistake an
``errors.OmniAPIError`` naming its field; fields it does not know are kept aside (``family_fields``) for the
routes to check against the model family's settings, which refuse unknown ones
(``OmniServer.check_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_protocol import ImageParams, parse_size

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
ACTIVE_STATUSES: tuple[VideoStatus, ...] = ("queued", "in_progress")
FINISHED_STATUSES: tuple[VideoStatus, ...] = ("completed", "failed")


@dataclass(frozen=True)
class VideoLimits:
    """The operator's bounds on videos: what one request may ask for, and what the job store keeps. Each
    is named in refusals by its command-line flag (``FLAGS``), so the client knows what to ask for."""

    max_frames: int = 241
    """The most frames one video may have (``--video-max-frames``)."""
    max_side: int = 1920
    """The largest width or height (``--video-max-size``)."""
    max_seconds: float = 20.0
    """The longest video in seconds (``--video-max-seconds``)."""
    max_jobs: int = 1000
    """The most videos the store keeps, finished or not (``--video-max-jobs``): the oldest finished go."""
    max_bytes: int = 10 * 1024**3
    """The most MP4 bytes the store keeps on disk (``--video-max-bytes``): the oldest finished go."""
    max_active: int = 64
    """The most videos queued or in progress at once (``--video-max-active``); more are refused (429)."""


FLAGS: dict[str, str] = {
    "max_frames": "--video-max-frames",
    "max_side": "--video-max-size",
    "max_seconds": "--video-max-seconds",
    "max_jobs": "--video-max-jobs",
    "max_bytes": "--video-max-bytes",
    "max_active": "--video-max-active",
}


def format_seconds(seconds: float) -> str:
    """A duration as ``Video.seconds`` spells it: ``"4"``, not ``"4.0"``; ``"2.5"``."""
    if float(seconds).is_integer():
        return str(int(seconds))
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def check_limits(
    limits: VideoLimits,
    *,
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
    seconds: float | None = None,
) -> None:
    """Refuse (400) a video over the operator's bounds, naming the field and the limit's flag. The routes
    call it with what they will generate (after defaults), so a derived frame count is checked too."""
    for side, value in (("width", width), ("height", height)):
        if value is not None and value > limits.max_side:
            raise OmniAPIError(
                f"size {width}x{height}: {side} {value} exceeds {FLAGS['max_side']} {limits.max_side}",
                param="size",
            )
    if num_frames is not None and num_frames > limits.max_frames:
        raise OmniAPIError(
            f"num_frames {num_frames} exceeds {FLAGS['max_frames']} {limits.max_frames}", param="num_frames"
        )
    if seconds is not None and seconds > limits.max_seconds:
        raise OmniAPIError(
            f"seconds {format_seconds(seconds)} exceeds {FLAGS['max_seconds']} "
            f"{format_seconds(limits.max_seconds)}",
            param="seconds",
        )


class ImageReference(BaseModel):
    """``input_reference`` sent as JSON (OpenAI's ``ImageInputReferenceParam``): an image as a data URI
    (``image_codec.decode_data_uri`` reads it). A ``file_id`` names OpenAI's Files API, which this server
    does not have."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = None
    file_id: str | None = None

    @model_validator(mode="after")
    def _one_image(self) -> ImageReference:
        if self.file_id is not None:
            raise ValueError(
                "file_id is not supported (this server has no Files API): upload the image as a file, "
                "or send image_url as a data URI"
            )
        if not self.image_url:
            raise ValueError("give image_url (a data URI), or upload the image as a file")
        return self


class VideoCreateRequest(ImageParams):
    """``POST /v1/videos``: OpenAI's fields (``prompt``, ``model``, ``seconds``, ``size``,
    ``input_reference``) and the diffusion knobs every endpoint shares (``ImageParams``: ``seed``,
    ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ...), plus ``fps`` and ``num_frames``
    (an alternative to ``seconds``)."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: float | None = Field(default=None, gt=0)
    """The duration; a number or its text (the openai client sends ``"4"``). ``None``: the routes' default."""
    size: str | None = None
    """``"WIDTHxHEIGHT"``, read back as ``dimensions``; normalized to ``"1280x720"``."""
    input_reference: bytes | ImageReference | None = None
    """An image to start from: a multipart file's bytes (the routes put them here), or JSON's
    ``{"image_url": "data:..."}`` (a bare string is read as that URL). The routes decode it."""
    fps: int | None = Field(default=None, ge=1)
    num_frames: int | None = Field(default=None, ge=1)

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError(f"must be WIDTHxHEIGHT text (e.g. 1280x720), got {value!r}")
        try:
            dims = parse_size(value)
        except OmniAPIError as exc:
            raise ValueError(exc.message.removeprefix("size ")) from None
        if dims is None:  # "auto": the routes' default
            return None
        width, height = dims
        if width < 2 or height < 2:
            raise ValueError(f"{value!r} has a side under 2 pixels")
        if width % 2 or height % 2:
            raise ValueError(f"{width}x{height}: H.264 video needs an even width and height")
        return f"{width}x{height}"

    @field_validator("input_reference", mode="before")
    @classmethod
    def _reference(cls, value: Any) -> Any:
        """One message for what is wrong, not one per member of the union."""
        if value is None or isinstance(value, bytes | ImageReference):
            return value
        if isinstance(value, bytearray | memoryview):
            return bytes(value)
        if isinstance(value, str):
            value = {"image_url": value}
        if not isinstance(value, dict):
            raise ValueError('must be an uploaded image file or {"image_url": "data:image/...;base64,..."}')
        try:
            return ImageReference.model_validate(value)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            if first.get("type") == "extra_forbidden":
                raise ValueError(f"unknown field {where!r}") from None
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"must be a number of seconds, got {value!r}")
        return value

    @model_validator(mode="after")
    def _frames_or_seconds(self) -> VideoCreateRequest:
        if self.seconds is not None and self.num_frames is not None:
            # An OmniAPIError passes through pydantic (it is no ValueError), naming the field.
            raise OmniAPIError("num_frames: give seconds or num_frames, not both", param="num_frames")
        return self

    @property
    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` from ``size``; ``None``: the routes' default."""
        if self.size is None:
            return None
        width, _, height = self.size.partition("x")
        return int(width), int(height)


# --- answers ----------------------------------------------------------------------------------------


class VideoError(msgspec.Struct):
    """Why a video failed (``Video.error``)."""

    code: str
    message: str


class Video(msgspec.Struct):
    """A video job as OpenAI answers it (``openai.types.Video``); nulls are sent, as OpenAI does.

    ``size`` is ours to choose, while the openai types spell OpenAI's four sizes as a ``Literal``: the client
    parses responses leniently (it builds the model without validating), so any ``"WxH"`` reads back;
    ``Video.model_validate`` would refuse other sizes."""

    id: str
    created_at: int
    status: VideoStatus
    model: str
    progress: int
    seconds: str
    size: str
    object: Literal["video"] = "video"
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    prompt: str | None = None
    remixed_from_video_id: str | None = None


class VideoList(msgspec.Struct):
    """``GET /v1/videos``: one page, newest first unless ``order=asc`` (the client's
    ``SyncConversationCursorPage``, which asks for the next page ``after=last_id`` while ``has_more``)."""

    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class VideoDeleted(msgspec.Struct):
    """``DELETE /v1/videos/{id}`` (``openai.types.VideoDeleteResponse``)."""

    id: str
    deleted: bool = True
    object: Literal["video.deleted"] = "video.deleted"
