"""The CI-sized barrage of hostile request bodies against real ``vllm serve --omni`` servers of three model
kinds: the tiny SD3 (text-to-image, and edits on its image-to-image pipeline), the tiny Qwen-Image-Edit (edits only) and the tiny BAGEL (text-to-image,
edits, chat in text). Each kind gets about a thousand bodies generated from the tables below (wrong
types, boundary and out-of-range values, unknown and other pipelines' fields, bodies that are no JSON
object, broken multipart forms, hostile images and chat messages, streamed requests), most refused in
milliseconds, sent 8 at a time while a few good requests run beside them. A bad body must get OpenAI's error JSON with a 4xx status, never a 5xx, a traceback or a
stall; the good ones must get their images (or text); no stage may die, and /health answers 200 at the
end.

Every server is started and stopped by the module fixture, one at a time: the whole barrage runs there
(its outcomes kept per kind), and each body is then its own test item, so a failure names its body, its
answer and the server's log lines of that moment."""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import pytest
from PIL import Image

from helpers import png_header
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.server import ServerProcess, omni_server

pytestmark = pytest.mark.server

REPO_ROOT = Path(__file__).resolve().parent.parent
STALL_S = 120.0
"""The most one answer may take (the client's timeout): generous, so only a stall fails it."""
GROUP = 8
"""Bad bodies in flight at once."""
STEPS = 2
PROMPT_CHARS = 32_000
"""The servers' ``--image-max-prompt-chars`` (the default)."""
API_MAX_SIDE = 2048
"""The servers' ``--image-max-size`` (the default)."""
MAX_STEPS = 1000
"""The servers' ``--image-max-inference-steps`` (the default)."""
MAX_PARTIAL_IMAGES = 3
"""The most previews a streamed image request may ask for (OpenAI's 0-3)."""
BOUNDARY = "barrage-7d3f0c"
FORM_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
JSON_TYPE = "application/json"
PATHS = {"generations": "/v1/images/generations", "edits": "/v1/images/edits", "chat": "/v1/chat/completions"}

Expect = Literal["refused", "lax", "either", "served"]
"""refused: a 4xx with error JSON; lax: that or 200 with what was asked for (a value a lenient parser takes,
an ignored field: sent only where the model's images are cheap); either: the same for a hostile value the
model must survive (odd text, images, forms); served: 200 (the good requests)."""
Route = Literal["generations", "edits", "chat"]
Answer = Literal["image", "text"]

DIFFUSION_DEPLOY = f"""
pipeline: diffusion
stages:
  - stage_id: 0
    max_batch_size: 8
    num_inference_steps: {STEPS}
    height: 64
    width: 64
"""
"""A diffusers model as one stage: 64x64 and 2 steps unless a request asks for more."""


@dataclass(frozen=True)
class Kind:
    """A model kind served here and the facts its bodies' expectations follow from."""

    name: str
    fixture: str
    """Its tiny model's session fixture (tests/conftest.py)."""
    deploy: str
    generations: bool
    edits: bool
    chat_text: bool
    """It answers chat in text (BAGEL's thinker)."""
    takes_images: bool
    needs_images: bool
    max_images: int
    max_side: int | None
    """The largest side the model makes (None: only the server's bound)."""
    token_limit: bool
    """Its prompt tokens are bounded (the Qwen-Image encoder's 1024, BAGEL's thinker's max_model_len 1024):
    a prompt of 2000 words under the character limit is refused; others truncate it."""
    settings: bool
    """It takes BAGEL's settings (cfg_text_scale, ...); the others refuse them as another pipeline's."""
    costly: bool = False
    """Each image takes seconds here (Qwen-Image-Edit resizes every source to about a megapixel): the lax
    bodies, which it would serve, are left out."""


KINDS: dict[str, Kind] = {
    "sd3": Kind(
        "sd3", "tiny_sd3", DIFFUSION_DEPLOY, generations=True, edits=True, chat_text=False,
        takes_images=True, needs_images=False, max_images=1, max_side=1024, token_limit=False, settings=False,
    ),
    "qwen_image_edit": Kind(
        "qwen_image_edit", "tiny_qwen_image_edit", DIFFUSION_DEPLOY, generations=False, edits=True,
        chat_text=False, takes_images=True, needs_images=True, max_images=1, max_side=None, token_limit=True,
        settings=False, costly=True,
    ),
    "bagel": Kind(
        "bagel", "tiny_bagel", (REPO_ROOT / "deploy" / "tiny_bagel_cpu.yaml").read_text(), generations=True,
        edits=True, chat_text=True, takes_images=True, needs_images=False, max_images=4, max_side=128,
        token_limit=True, settings=True,
    ),
}  # fmt: skip
"""SD3: 16-pixel grid, pos_embed_max_size 64 x patch 2 x VAE 8 = 1024. BAGEL: 16-pixel grid, max_latent_size
8 x 16 = 128; its edits keep the source's size."""


@dataclass(frozen=True)
class Body:
    """One request: what is sent and what answer it may get."""

    name: str
    route: Route
    content: bytes
    content_type: str | None
    expect: Expect
    answer: Answer = "image"
    size: tuple[int, int] | None = None
    """The image size a good request must get (width, height)."""

    def describe(self) -> str:
        head = self.content[:400]
        more = f" ... ({len(self.content)} bytes)" if len(self.content) > 400 else ""
        return f"POST {PATHS[self.route]} Content-Type: {self.content_type!r}\n  body: {head!r}{more}"


# --- images and encodings ---------------------------------------------------------------------------


def image_bytes(width: int = 64, height: int = 64, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A colour gradient in ``mode``, encoded as ``fmt``: an image, and a small one to send hundreds of times."""
    y, x = np.indices((height, width))
    pixels = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    image = Image.fromarray(pixels.astype(np.uint8)).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


SOURCE = image_bytes()
"""The good source image: 64x64, so an edit's output is 64x64."""


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode()


Part = tuple[str, str | bytes, str | None]
"""A form part: (name, value, filename: None for a field)."""


def form(*parts: Part, end: bool = True, newline: bytes = b"\r\n") -> bytes:
    """A multipart/form-data body, built by hand so that it can be what no HTTP client would send."""
    out = b""
    for name, value, filename in parts:
        disposition = f'Content-Disposition: form-data; name="{name}"'
        head = disposition + (f'; filename="{filename}"' if filename is not None else "")
        kind = newline + b"Content-Type: application/octet-stream" if filename is not None else b""
        data = value.encode() if isinstance(value, str) else value
        out += f"--{BOUNDARY}".encode() + newline + head.encode() + kind + newline + newline + data + newline
    return out + (f"--{BOUNDARY}--".encode() + newline if end else b"")


def source_part(data: bytes = SOURCE, name: str = "image", filename: str = "source.png") -> Part:
    return name, data, filename


# --- values ------------------------------------------------------------------------------------------

LONG_CHARS = "x" * (PROMPT_CHARS + 1)
MANY_WORDS = " ".join(["painted"] * 2000)
"""2000 words, 16,000 characters: under the character limit, over 1024 tokens."""
NESTED_65 = "[" * 65 + "]" * 65
NESTED_DEEP = "[" * 100_000 + "]" * 100_000

WRONG_TYPES: dict[str, Any] = {
    "string": "seven",
    "number": 7,
    "fraction": 2.5,
    "bool": True,
    "null": None,
    "list": [1, 2],
    "object": {"a": 1},
}
FieldType = Literal["text", "int", "float", "choice", "size", "model", "flag", "pair"]
NATIVE: dict[str, set[str]] = {
    "text": {"string"}, "int": {"number"}, "float": {"number", "fraction"}, "choice": {"string"},
    "size": {"string"}, "model": {"string"}, "flag": {"bool"}, "pair": {"list"},
}  # fmt: skip
"""The wrong-type values that are of a field's own type (its boundary cases cover those)."""


@dataclass(frozen=True)
class Field:
    """A request field: its type, whether null is its default, and values it must refuse or may take."""

    type: FieldType
    nullable: bool = True
    bad: tuple[tuple[str, Any], ...] = ()
    fine: tuple[tuple[str, Any], ...] = ()
    odd: tuple[tuple[str, Any], ...] = ()
    """Values it takes that the model must survive."""


def wrong_type_expect(spec: Field, label: str) -> Expect:
    """A value of another type is refused, but for null where null means "unset", and true/false where a
    number is asked (pydantic's lax mode reads them as 1/0)."""
    if label == "null" and spec.nullable:
        return "lax"
    if label == "bool" and spec.type in ("int", "float"):
        return "lax"
    return "refused"


IMAGE_FIELDS: dict[str, Field] = {
    "negative_prompt": Field(
        "text",
        bad=(("over-limit", LONG_CHARS),),
        fine=(("empty", ""),),
        odd=(("unicode", "狐狸 🦊 ñ"), ("controls", "a\x00b\x1b[31mc\x7f")),
    ),
    "n": Field("int", nullable=False, bad=(("zero", 0), ("negative", -1), ("eleven", 11), ("huge", 10**30),
                                           ("nan-string", "NaN"), ("float-huge", 1e300))),
    "seed": Field("int", bad=(("negative", -1), ("two-to-63", 2**63), ("huge", 10**30), ("inf-string", "inf"),
                              ("float-huge", 1e300)),
                  fine=(("zero", 0), ("largest", 2**63 - 1))),
    "num_inference_steps": Field("int", bad=(("zero", 0), ("negative", -1), ("over-limit", MAX_STEPS + 1),
                                             ("huge", 10**30), ("nan-string", "nan")),
                                 fine=(("one", 1),)),
    "guidance_scale": Field("float", bad=(("negative", -1), ("over", 100.5), ("huge", 1e308), ("nan", "NaN"),
                                          ("inf", "inf"), ("minus-inf", "-Infinity")),
                            fine=(("zero", 0), ("largest", 100))),
    "output_format": Field("choice", bad=(("gif", "gif"), ("upper", "PNG"), ("empty", ""), ("path", "../png")),
                           fine=(("jpeg", "jpeg"), ("webp", "webp"))),
    "model": Field("model", bad=(("unknown", "no-such-model"), ("empty", ""), ("traversal", "../../etc/passwd"))),
}  # fmt: skip
"""Fields every image route takes."""

GENERATION_FIELDS: dict[str, Field] = {
    **IMAGE_FIELDS,
    "response_format": Field(
        "choice",
        bad=(("url-without-media-dir", "url"), ("upper", "B64_JSON"), ("empty", ""), ("png", "png")),
        fine=(("b64-json", "b64_json"),),
    ),
    "output_compression": Field(
        "int", bad=(("negative", -1), ("over", 101), ("huge", 10**30)), fine=(("zero", 0), ("largest", 100))
    ),
    "background": Field("choice", bad=(("transparent", "transparent"),), fine=(("auto", "auto"),)),
    "stream": Field("flag", fine=(("false", False), ("yes", "yes")), odd=(("true", True),)),
    "partial_images": Field(
        "int",
        nullable=False,
        bad=(("negative", -1), ("over", MAX_PARTIAL_IMAGES + 1), ("huge", 10**30)),
        fine=(("zero", 0), ("most-without-stream", MAX_PARTIAL_IMAGES)),
    ),
}
"""Fields of /v1/images/generations and /v1/images/edits."""

CHAT_FIELDS: dict[str, Field] = {
    **IMAGE_FIELDS,
    "height": Field("int", bad=(("zero", 0), ("negative", -16), ("off-grid", 40), ("huge", 10**30),
                                ("over-server", API_MAX_SIDE + 16)), fine=(("sixty-four", 64),)),
    "width": Field("int", bad=(("zero", 0), ("negative", -16), ("off-grid", 40), ("huge", 10**30),
                               ("over-server", API_MAX_SIDE + 16)), fine=(("sixty-four", 64),)),
    "temperature": Field("float", bad=(("negative", -1), ("inf", "inf")), fine=(("zero", 0), ("huge", 1e308))),
    "top_p": Field("float", bad=(("zero", 0), ("over", 1.5)), fine=(("one", 1),)),
    "top_k": Field("int", fine=(("negative", -5), ("zero", 0), ("huge", 10**30))),
    "max_tokens": Field("int", bad=(("zero", 0), ("negative", -1)), fine=(("huge", 10**30),)),
    "max_completion_tokens": Field("int", bad=(("zero", 0),), fine=(("huge", 10**30),)),
    "stream": Field("flag", fine=(("false", False), ("yes", "yes")), odd=(("true", True),)),
}  # fmt: skip
"""Fields of /v1/chat/completions (image and text answers)."""

BAGEL_SETTINGS: dict[str, Field] = {
    "cfg_text_scale": Field("float", bad=(("negative", -1), ("over", 101), ("nan", "nan")), fine=(("four", 4),)),
    "cfg_img_scale": Field("float", bad=(("over", 100.5), ("inf", "inf")), fine=(("zero", 0),)),
    "cfg_interval": Field("pair", bad=(("reversed", [0.9, 0.1]), ("three", [0.1, 0.5, 1.0]), ("one", [0.4]),
                                       ("strings", ["a", "b"]), ("over-one", [0.5, 2]), ("nested", [[0.1], [1]])),
                          fine=(("full", [0.0, 1.0]),)),
    "cfg_renorm_type": Field("choice", bad=(("bogus", "bogus"), ("empty", "")), fine=(("channel", "channel"),)),
    "cfg_renorm_min": Field("float", bad=(("over", 2), ("negative", -0.5)), fine=(("half", 0.5),)),
    "timestep_shift": Field("float", bad=(("zero", 0), ("negative", -3), ("huge", 1e300)), fine=(("three", 3),)),
    "think": Field("flag", bad=(("word", "maybe"),), fine=(("false", False),)),
    "max_think_tokens": Field("int", bad=(("one", 1), ("huge", 10**30), ("over", 32769)), fine=(("eight", 8),)),
}  # fmt: skip
"""BAGEL's settings (``families/bagel/settings.py``): its own values for BAGEL, another pipeline's fields
for the others, refused whatever their value (but null, which is unset)."""

FORM_STRINGS: dict[str, str] = {
    "word": "seven",
    "json-list": "[1, 2]",
    "json-object": '{"a": 1}',
    "nan": "NaN",
    "inf": "inf",
    "huge": "1" + "0" * 30,
    "hex": "0x10",
}
"""Form values a number field must refuse (a form carries only text)."""
NUMBER_FORM_FIELDS = (
    "n",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "output_compression",
    "partial_images",
)
CHOICE_FORM_FIELDS = ("response_format", "output_format", "background")

SIZES: tuple[tuple[str, str, str], ...] = (
    ("zero", "0x0", "malformed"),
    ("no-height", "64x", "malformed"),
    ("no-width", "x64", "malformed"),
    ("three-sides", "64x64x64", "malformed"),
    ("negative", "-64x64", "malformed"),
    ("decimal", "64.0x64", "malformed"),
    ("exponent", "1e2x64", "malformed"),
    ("words", "big", "malformed"),
    ("empty", "", "malformed"),
    ("seven-digits", "1000000x64", "malformed"),
    ("off-grid", "72x64", "malformed"),
    ("odd", "65x65", "malformed"),
    ("under-grid", "8x8", "malformed"),
    ("huge", "99999x99999", "malformed"),
    ("over-server", f"{API_MAX_SIDE + 16}x{API_MAX_SIDE + 16}", "malformed"),
    ("over-model", "", "over-model"),
    ("over-model-wide", "", "over-model"),
    ("auto", "auto", "fine"),
    ("spaced-upper", " 64X64 ", "fine"),
    ("times-sign", "64\u00d764", "fine"),
)
"""Sizes and what they are: malformed or off every grid (refused), past the model's largest side (refused
where the model makes the size asked for), fine (the default or 64x64 written oddly)."""


def size_cases(kind: Kind, keeps_source: bool) -> Iterator[tuple[str, str, Expect]]:
    for label, size, what in SIZES:
        if what == "over-model":
            if kind.max_side is None or keeps_source:
                continue  # no largest side but the server's, or the source's size is made
            side = kind.max_side + 16 if label == "over-model" else 2 * kind.max_side
            size = f"{side}x64" if label == "over-model-wide" else f"{side}x{side}"
        yield label, size, "refused" if what != "fine" else "lax"


def field_cases(fields: dict[str, Field]) -> Iterator[tuple[str, str, Any, Expect]]:
    """(field, label, value, expectation) for every field: wrong types, bad values, fine boundaries."""
    for name, spec in fields.items():
        for label, value in WRONG_TYPES.items():
            if label not in NATIVE[spec.type]:
                yield name, f"type-{label}", value, wrong_type_expect(spec, label)
        for label, value in spec.bad:
            yield name, label, value, "refused"
        for label, value in spec.fine:
            yield name, label, value, "lax"
        for label, value in spec.odd:
            yield name, label, value, "either"


def settings_cases(kind: Kind) -> Iterator[tuple[str, str, Any, Expect]]:
    """BAGEL's settings: for BAGEL by their values; elsewhere refused (another pipeline's), null aside."""
    for name, label, value, expect in field_cases(BAGEL_SETTINGS):
        if not kind.settings:
            expect = "lax" if value is None else "refused"
        yield name, label, value, expect


SIDES = ("height", "width")
UNKNOWN_FIELDS: tuple[tuple[str, dict[str, Any], Expect], ...] = (
    ("unknown", {"foo": 1}, "refused"),
    ("unknown-null", {"foo": None}, "refused"),
    ("proto", {"__proto__": {"admin": True}}, "refused"),
    ("spaced-name", {"prompt ": "a fox"}, "refused"),
    ("empty-name", {"": 1}, "refused"),
    ("mask", {"mask": "x"}, "refused"),
    ("frame-count", {"frame_count": 2}, "refused"),
    ("ignored-quality", {"quality": "hd"}, "lax"),
    ("ignored-user", {"user": "someone"}, "lax"),
    ("many-unknown", {f"field_{i}": i for i in range(500)}, "refused"),
)
"""Fields no route knows (refused), OpenAI's that it cannot honour (refused), and OpenAI's it ignores."""


# --- JSON routes --------------------------------------------------------------------------------------


def generation_base() -> dict[str, Any]:
    return {"prompt": "a red fox in the snow", "size": "64x64", "num_inference_steps": STEPS, "seed": 1}


def user_content(kind: Kind, text: str | list[Any]) -> Any:
    """A user message's content for ``kind``: with the source image where the model needs one."""
    if not kind.needs_images:
        return text
    parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
    return [*parts, {"type": "image_url", "image_url": {"url": data_uri(SOURCE)}}]


def chat_base(kind: Kind, text: str = "a red fox in the snow") -> dict[str, Any]:
    """An image answer: 64x64 (the source's size where the model needs one), 2 steps."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": user_content(kind, text)}],
        "modalities": ["image"],
        "num_inference_steps": STEPS,
        "seed": 1,
        "max_tokens": 4,
    }
    if not kind.needs_images:
        body["size"] = "64x64"
    return body


def text_base() -> dict[str, Any]:
    """A text answer of at most 4 tokens."""
    return {"messages": [{"role": "user", "content": "what does a fox eat?"}], "max_tokens": 4, "seed": 1}


def raw_json_cases(base: dict[str, Any]) -> Iterator[tuple[str, bytes, str | None, Expect]]:
    """Bodies that are no JSON object, malformed, nested too deeply or sent as another type."""
    good = encode(base)
    yield from (
        (label, content, JSON_TYPE, "refused")
        for label, content in (
            ("array-empty", b"[]"),
            ("array-of-body", b"[" + good + b"]"),
            ("string", b'"a red fox"'),
            ("number", b"42"),
            ("true", b"true"),
            ("null", b"null"),
            ("empty", b""),
            ("whitespace", b" \n\t "),
            ("empty-object", b"{}"),
            ("unclosed", good[:-1]),
            ("cut-in-string", good[:12]),
            ("missing-value", b'{"prompt": }'),
            ("trailing-comma", good[:-1] + b", }"),
            ("trailing-garbage", good + b" x"),
            ("two-objects", good + good),
            ("single-quotes", good.replace(b'"', b"'")),
            ("nan-literal", good[:-1] + b', "guidance_scale": NaN}'),
            ("overflow-literal", good[:-1] + b', "guidance_scale": 1e999}'),
            ("invalid-utf8", good[:-1] + b', "negative_prompt": "\xff\xfe"}'),
            ("utf16", json.dumps(base).encode("utf-16")),
            ("nul-bytes", b"\x00" * 64),
            ("nested-65", NESTED_65.encode()),
            ("nested-100000", NESTED_DEEP.encode()),
            ("nested-in-field", good[:-1] + b', "seed": ' + NESTED_DEEP.encode() + b"}"),
            ("deep-objects", b'{"a": ' * 5000 + b"1" + b"}" * 5000),
            ("nested-in-known-field", good[:-1] + b', "negative_prompt": ' + NESTED_65.encode() + b"}"),
        )
    )
    yield "lone-surrogate", good[:-1] + b', "negative_prompt": "\\ud800 fox"}', JSON_TYPE, "either"
    yield "escaped-nul", good[:-1] + b', "negative_prompt": "a\\u0000b"}', JSON_TYPE, "either"
    yield "bom", b"\xef\xbb\xbf" + good, JSON_TYPE, "either"
    yield "duplicate-key", good[:-1] + b', "seed": 2}', JSON_TYPE, "lax"
    for label, content_type, expect in (
        ("type-form-urlencoded", "application/x-www-form-urlencoded", "refused"),
        ("type-multipart", FORM_TYPE, "refused"),
        ("type-none", None, "either"),
        ("type-text-plain", "text/plain", "lax"),
        ("type-xml", "application/xml", "lax"),
        ("type-garbage", 'foo/bar; x="y"; ;;', "lax"),
    ):
        yield label, good, content_type, expect
    yield "form-body-as-json", b"prompt=a+fox&size=64x64", JSON_TYPE, "refused"
    yield "form-body-as-form", b"prompt=a+fox&size=64x64", "application/x-www-form-urlencoded", "refused"


def json_bodies(
    kind: Kind, route: Route, base: dict[str, Any], fields: dict[str, Field], answer: Answer, prefix: str
) -> Iterator[Body]:
    """``base`` with each field's cases, unknown and other pipelines' fields, sizes and raw bodies."""

    def body(name: str, changes: dict[str, Any], expect: Expect, drop: tuple[str, ...] = ()) -> Body:
        content = {k: v for k, v in base.items() if k not in drop} | changes
        return Body(f"{prefix}-{name}", route, encode(content), JSON_TYPE, expect, answer)

    for name, label, value, expect in field_cases(fields):
        # a size given wins over height and width (routes._chat_size): theirs are sent without one
        yield body(f"{name}-{label}", {name: value}, expect, drop=("size",) if name in SIDES else ())
    for name, label, value, expect in settings_cases(kind):
        yield body(f"{name}-{label}", {name: value}, expect)
    for label, extra, expect in UNKNOWN_FIELDS:
        yield body(label, extra, expect)
    for label, size, expect in size_cases(kind, keeps_source=False):
        yield body(f"size-{label}", {"size": size}, expect)
    many: Expect = "refused" if kind.token_limit else "either"
    yield body("negative_prompt-many-words", {"negative_prompt": MANY_WORDS}, many)
    yield body("stream-two-images", {"stream": True, "n": 2}, "refused")
    if route == "generations":
        yield body("stream-previews", {"stream": True, "partial_images": MAX_PARTIAL_IMAGES}, "either")
        yield body(
            "stream-previews-over", {"stream": True, "partial_images": MAX_PARTIAL_IMAGES + 1}, "refused"
        )
    yield body("size-null", {"size": None}, "lax")
    for label, content, content_type, expect in raw_json_cases(base):
        yield Body(f"{prefix}-raw-{label}", route, content, content_type, expect, answer)


def generation_bodies(kind: Kind) -> Iterator[Body]:
    base = generation_base()
    yield from json_bodies(kind, "generations", base, GENERATION_FIELDS, "image", "gen")
    prompts: tuple[tuple[str, Any, Expect], ...] = (
        *((f"type-{label}", value, "refused") for label, value in WRONG_TYPES.items() if label != "string"),
        ("empty", "", "refused"),
        ("over-limit", LONG_CHARS, "refused"),
        ("many-words", MANY_WORDS, "refused" if kind.token_limit else "either"),
        ("whitespace", "   ", "either"),
        ("newlines", "\n\t\n", "either"),
        ("unicode", "狐狸 🦊 Ünïcödé ✓", "either"),
        ("controls", "a\x00b\x01c\x1b[31m\x7f", "either"),
        ("bidi", "\u202efox\u202c", "either"),
        ("zero-width", "\u200b\u200d\ufeff", "either"),
        ("combining", "e" + "\u0301" * 500, "either"),
    )
    for label, value, expect in prompts:
        yield Body(f"gen-prompt-{label}", "generations", encode(base | {"prompt": value}), JSON_TYPE, expect)
    missing = {k: v for k, v in base.items() if k != "prompt"}
    yield Body("gen-prompt-missing", "generations", encode(missing), JSON_TYPE, "refused")
    yield Body(
        "gen-image-field", "generations", encode(base | {"image": data_uri(SOURCE)}), JSON_TYPE, "refused"
    )


def chat_bodies(kind: Kind) -> Iterator[Body]:
    base = chat_base(kind)
    yield from json_bodies(kind, "chat", base, CHAT_FIELDS, "image", "chat")

    def body(
        name: str,
        changes: dict[str, Any],
        expect: Expect,
        drop: tuple[str, ...] = (),
        answer: Answer = "image",
    ) -> Body:
        content = {k: v for k, v in base.items() if k not in drop} | changes
        return Body(f"chat-{name}", "chat", encode(content), JSON_TYPE, expect, answer)

    def messages(name: str, value: Any, expect: Expect) -> Body:
        return body(f"messages-{name}", {"messages": value}, expect)

    user = base["messages"][0]
    yield body("messages-missing", {}, "refused", drop=("messages",))
    for label, value in (
        ("empty", []), ("string", "a fox"), ("object", user), ("number-item", [1]), ("empty-item", [{}]),
        ("system-only", [{"role": "system", "content": "a fox"}]),
        ("assistant-only", [{"role": "assistant", "content": "a fox"}]),
        ("role-number", [{"role": 1, "content": "a fox"}]),
        ("no-content", [{"role": "user"}]),
        ("content-null", [{"role": "user", "content": None}]),
        ("content-number", [{"role": "user", "content": 42}]),
        ("content-object", [{"role": "user", "content": {"type": "text", "text": "a fox"}}]),
        ("content-empty-list", [{"role": "user", "content": []}]),
        ("content-empty", [{"role": "user", "content": ""}]),
        ("content-whitespace", [{"role": "user", "content": " \n "}]),
        ("part-number", [{"role": "user", "content": [42]}]),
        ("part-null", [{"role": "user", "content": [None]}]),
        ("part-unknown-type", [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]),
        ("part-no-type", [{"role": "user", "content": [{"text": "a fox"}]}]),
        ("part-type-number", [{"role": "user", "content": [{"type": 1, "text": "a fox"}]}]),
        ("part-text-missing", [{"role": "user", "content": [{"type": "text"}]}]),
        ("part-text-empty", [{"role": "user", "content": [{"type": "text", "text": ""}]}]),
        ("last-user-empty", [user, {"role": "assistant", "content": "ok"}, {"role": "user", "content": ""}]),
        ("over-limit", [{"role": "user", "content": LONG_CHARS}]),
        ("over-limit-in-parts", [{"role": "user", "content": [{"type": "text", "text": "x" * 20_000}] * 2}]),
    ):  # fmt: skip
        yield messages(label, value, "refused")
    for label, content in (
        ("part-string", ["a red fox"]),
        ("part-text-number", [{"type": "text", "text": 42}]),
        ("parts-many", [{"type": "text", "text": "fox"}] * 200),
    ):
        yield messages(label, [{"role": "user", "content": user_content(kind, content)}], "either")
    many = [{"role": "user" if i % 2 else "assistant", "content": "a fox"} for i in range(999)]
    yield messages("thousand", [*many, user], "either")
    yield messages("user-then-system", [user, {"role": "system", "content": "be brief"}], "lax")
    words = [{"role": "user", "content": user_content(kind, MANY_WORDS)}]
    yield messages("many-words", words, "refused" if kind.token_limit else "either")

    def image(label: str, url: Any, expect: Expect = "refused", wrap: bool = True) -> Body:
        part = {"type": "image_url", "image_url": {"url": url} if wrap else url}
        content = [{"type": "text", "text": "make it blue"}, part]
        return messages(f"image-{label}", [{"role": "user", "content": content}], expect)

    for label, url in (
        ("http", "http://127.0.0.1:9/a.png"),
        ("https", "https://example.com/a.png"),
        ("file", "file:///etc/passwd"),
        ("ftp", "ftp://example.com/a.png"),
        ("javascript", "javascript:alert(1)"),
        ("relative", "a.png"),
        ("empty", ""),
        ("bad-base64", "data:image/png;base64,!!!not base64!!!"),
        ("empty-data", "data:image/png;base64,"),
        ("not-base64", "data:image/png," + "A" * 100),
        ("text-data", data_uri(b"just some text", "text/plain")),
        ("text-as-png", data_uri(b"just some text")),
        ("declares-20000", data_uri(png_header(20000, 20000))),
        ("thin-4000x1", data_uri(image_bytes(4000, 1))),
        ("truncated-png", data_uri(SOURCE[: len(SOURCE) // 2])),
        ("header-only", data_uri(png_header(64, 64))),
        ("url-number", 42),
        ("url-null", None),
        ("url-list", [data_uri(SOURCE)]),
    ):
        yield image(label, url)
    yield image("bare-http", "http://127.0.0.1:9/a.png", wrap=False)
    yield image("bare-null", None, wrap=False)
    # one source image: what the model takes (or refuses); five: over every server's limit
    yield image("valid", data_uri(SOURCE), "lax" if kind.takes_images else "refused")
    yield image("valid-upper", data_uri(SOURCE).replace("data:image/png;base64", "DATA:IMAGE/PNG;BASE64"),
                "either" if kind.takes_images else "refused")  # fmt: skip
    only = [{"type": "image_url", "image_url": {"url": data_uri(SOURCE)}}]
    yield messages("image-without-text", [{"role": "user", "content": only}], "refused")
    five = [{"type": "text", "text": "merge them"}, *only * 5]
    yield messages("image-five", [{"role": "user", "content": five}], "refused")
    two = [{"type": "text", "text": "merge them"}, *only * 2]
    two_ok = kind.takes_images and kind.max_images >= 2
    yield messages("image-two", [{"role": "user", "content": two}], "either" if two_ok else "refused")

    text_ok: Expect = "either" if kind.chat_text else "refused"
    for label, value, expect, answer in (
        ("string", "image", "refused", "image"),
        ("number-item", [1], "refused", "image"),
        ("null-item", [None], "refused", "image"),
        ("object", {"image": True}, "refused", "image"),
        ("video", ["video"], text_ok, "text"),
        ("empty", [], text_ok, "text"),
        ("null", None, text_ok, "text"),
        ("image-and-text", ["image", "text"], "lax", "image"),
        ("image-twice", ["image", "image"], "lax", "image"),
    ):
        yield body(f"modalities-{label}", {"modalities": value}, expect, answer=answer)
    for label, value, expect in (
        ("string", "seed=3", "refused"),
        ("list", [1], "refused"),
        ("number", 3, "refused"),
        ("guidance-inf", {"guidance_scale": "inf"}, "refused"),
        ("guidance-negative", {"guidance_scale": -1}, "refused"),
        ("n-zero", {"n": 0}, "refused"),
        ("unknown", {"foo": 1}, "refused"),
        ("nested", {"extra_body": {"seed": 3}}, "refused"),
        ("null", None, "lax"),
        ("seed-also-at-top", {"seed": 3}, "lax"),
    ):
        yield body(f"extra-body-{label}", {"extra_body": value}, expect)


def text_bodies(kind: Kind) -> Iterator[Body]:
    """Chat answered in text (BAGEL's thinker); refused by the models that only make images."""
    base = text_base()
    ok: Expect = "either" if kind.chat_text else "refused"

    def body(name: str, changes: dict[str, Any], expect: Expect) -> Body:
        return Body(f"text-{name}", "chat", encode(base | changes), JSON_TYPE, expect, "text")

    for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed"):
        spec = CHAT_FIELDS[name]
        for _, label, value, expect in field_cases({name: spec}):
            yield body(f"{name}-{label}", {name: value}, expect if ok == "either" else "refused")
    yield body("max-tokens-over-model-len", {"max_tokens": 5000}, ok)
    yield body("over-limit", {"messages": [{"role": "user", "content": LONG_CHARS}]}, "refused")
    many = "refused" if kind.token_limit or not kind.chat_text else "either"
    yield body("many-words", {"messages": [{"role": "user", "content": MANY_WORDS}]}, many)
    for label, url in (("http", "http://127.0.0.1:9/a.png"), ("bad-data", "data:image/png;base64,@@")):
        content = [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        yield body(f"image-{label}", {"messages": [{"role": "user", "content": content}]}, "refused")
    seen = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": data_uri(SOURCE)}},
    ]
    yield body("image-valid", {"messages": [{"role": "user", "content": seen}]}, ok)
    yield body("stream", {"stream": True}, ok)
    yield body("no-user", {"messages": [{"role": "system", "content": "hello"}]}, "refused")
    for name, label, value, expect in settings_cases(kind):
        if name in ("think", "max_think_tokens", "cfg_text_scale"):
            yield body(f"{name}-{label}", {name: value}, expect if ok == "either" else "refused")


# --- the edit form ------------------------------------------------------------------------------------

EDIT_FIELDS: tuple[Part, ...] = (("prompt", "make it blue", None), ("num_inference_steps", str(STEPS), None),
                                 ("seed", "1", None))  # fmt: skip


def edit_bodies(kind: Kind) -> Iterator[Body]:
    """Multipart edits: every field's values as text, broken forms and hostile images."""

    def body(name: str, content: bytes, expect: Expect, content_type: str | None = FORM_TYPE) -> Body:
        return Body(f"edit-{name}", "edits", content, content_type, expect)

    def fields(**changes: str | None) -> list[Part]:
        kept = [(n, v, f) for n, v, f in EDIT_FIELDS if n not in changes]
        return kept + [(n, v, None) for n, v in changes.items() if v is not None]

    def edit(name: str, expect: Expect, *parts: Part, **changes: str | None) -> Body:
        return body(name, form(source_part(), *parts, *fields(**changes)), expect)

    for name in NUMBER_FORM_FIELDS:
        for label, value in FORM_STRINGS.items():
            yield edit(f"{name}-{label}", "refused", **{name: value})
        yield edit(f"{name}-negative", "refused", **{name: "-1"})
        yield edit(f"{name}-fraction", "lax" if name == "guidance_scale" else "refused", **{name: "2.5"})
        yield edit(f"{name}-empty", "lax", **{name: ""})
        yield edit(f"{name}-spaces", "lax", **{name: " 1 "})
    yield edit("n-eleven", "refused", n="11")
    yield edit("partial_images-over", "refused", stream="true", partial_images=str(MAX_PARTIAL_IMAGES + 1))
    yield edit("stream-word", "refused", stream="seven")
    yield edit("stream-two-images", "refused", stream="true", n="2")
    yield edit("stream-previews", "either", stream="true", partial_images="1")
    yield edit("num_inference_steps-over-limit", "refused", num_inference_steps=str(MAX_STEPS + 1))
    for name in CHOICE_FORM_FIELDS:
        for label, value in (("word", "seven"), ("upper", "PNG"), ("json", '["png"]')):
            yield edit(f"{name}-{label}", "refused", **{name: value})
        yield edit(f"{name}-empty", "lax", **{name: ""})
    yield edit("response_format-url", "refused", response_format="url")
    for label, value in (("unknown", "no-such-model"), ("traversal", "../../etc/passwd")):
        yield edit(f"model-{label}", "refused", model=value)
    for label, value, expect in (
        ("empty", "", "refused"),
        ("over-limit", LONG_CHARS, "refused"),
        ("many-words", MANY_WORDS, "refused" if kind.token_limit else "either"),
        ("whitespace", "   ", "either"),
        ("unicode", "狐狸 🦊 ñ", "either"),
        ("controls", "a\x00b\x1b[31mc", "either"),
        ("json-looking", '{"prompt": "x"}', "either"),
    ):
        yield edit(f"prompt-{label}", expect, prompt=value)
    yield edit("prompt-missing", "refused", prompt=None)
    yield edit("negative_prompt-over-limit", "refused", negative_prompt=LONG_CHARS)
    yield edit(
        "negative_prompt-many-words", "refused" if kind.token_limit else "either", negative_prompt=MANY_WORDS
    )
    for label, size, expect in size_cases(kind, keeps_source=kind.name == "bagel"):
        yield edit(f"size-{label}", expect, size=size)
    for name, label, value, expect in settings_cases(kind):
        if value is None:
            continue  # a form has no null
        text = value if isinstance(value, str) else json.dumps(value)
        yield edit(f"{name}-{label}", expect, **{name: text})
    for label, value in FORM_STRINGS.items():
        yield edit(f"cfg_text_scale-form-{label}", "refused", cfg_text_scale=value)
    yield edit("cfg_interval-unclosed", "refused", cfg_interval="[0.4, 1.0")
    yield edit("cfg_interval-nested-deep", "refused", cfg_interval=NESTED_DEEP)
    yield edit("unknown-field", "refused", foo="1")
    yield edit("unknown-json-field", "refused", foo='{"a": 1}')
    yield edit("unknown-nested-deep", "refused", foo=NESTED_DEEP)
    yield edit("ignored-quality", "lax", quality="hd")

    # images
    for label, data, expect in (
        ("empty-file", b"", "refused"),
        ("text-as-png", b"just some text, not an image", "refused"),
        ("svg-as-png", b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"/>', "refused"),
        ("declares-20000", png_header(20000, 20000), "refused"),
        ("declares-64-holds-none", png_header(64, 64), "refused"),
        ("truncated-png", SOURCE[: len(SOURCE) // 2], "refused"),
        ("thin-4000x1", image_bytes(4000, 1), "refused"),
        ("tall-1x4000", image_bytes(1, 4000), "refused"),
        ("one-pixel", image_bytes(1, 1), "either"),
        ("jpeg", image_bytes(fmt="JPEG"), "lax"),
        ("webp", image_bytes(fmt="WEBP"), "lax"),
        ("gif", image_bytes(mode="P", fmt="GIF"), "either"),
        ("rgba", image_bytes(mode="RGBA"), "lax"),
        ("grayscale", image_bytes(mode="L"), "lax"),
        ("sixteen-bit", image_bytes(mode="I;16"), "either"),
        ("cmyk-jpeg", image_bytes(mode="CMYK", fmt="JPEG"), "either"),
    ):
        yield body(f"image-{label}", form(source_part(data), *EDIT_FIELDS), expect)
    yield body("image-as-field", form(("image", "source.png", None), *EDIT_FIELDS), "refused")
    yield body("image-missing", form(*EDIT_FIELDS), "refused")
    two = "either" if kind.max_images >= 2 else "refused"
    yield body("image-two", form(source_part(), source_part(), *EDIT_FIELDS), two)
    yield body(
        "image-list-two", form(source_part(name="image[]"), source_part(name="image[]"), *EDIT_FIELDS), two
    )
    yield body("image-five", form(*[source_part()] * 5, *EDIT_FIELDS), "refused")
    yield body("image-and-mask", form(source_part(), source_part(name="mask"), *EDIT_FIELDS), "refused")
    yield body("image-under-other-name", form(source_part(name="photo"), *EDIT_FIELDS), "refused")
    yield body(
        "image-filename-traversal", form(source_part(filename="../../etc/x.png"), *EDIT_FIELDS), "either"
    )
    yield body("image-filename-long", form(source_part(filename="a" * 5000 + ".png"), *EDIT_FIELDS), "either")
    yield body("image-filename-empty", form(source_part(filename=""), *EDIT_FIELDS), "either")

    # the form itself
    good = form(source_part(), *EDIT_FIELDS)
    yield body("form-truncated", good[: len(good) - 30], "refused")
    yield body("form-cut-in-image", good[: good.index(SOURCE) + len(SOURCE) // 2], "refused")
    yield body("form-no-end", form(source_part(), *EDIT_FIELDS, end=False), "refused")
    yield body("form-empty", b"", "refused")
    yield body("form-garbage", b"\x00\xff" * 500, "refused")
    yield body("form-lf-only", form(source_part(), *EDIT_FIELDS, newline=b"\n"), "refused")
    yield body(
        "form-repeated-prompt", form(source_part(), *EDIT_FIELDS, ("prompt", "make it red", None)), "refused"
    )
    yield body("form-seventy-fields", form(source_part(), *EDIT_FIELDS, *[(f"f{i}", "1", None) for i in range(70)]),
               "refused")  # fmt: skip
    yield body("form-field-over-1mib", form(source_part(), *fields(prompt="x" * (1 << 20) + "x")), "refused")
    yield body("form-no-name", good.replace(b'name="prompt"', b"", 1), "refused")
    yield body("form-invalid-utf8", form(source_part(), *fields(prompt="x"))[:-len(BOUNDARY) - 6]
               + b"\xff\xfe\r\n--" + BOUNDARY.encode() + b"--\r\n", "either")  # fmt: skip
    yield body("form-preamble", b"preamble text\r\n" + good, "lax")
    yield body("form-epilogue", good + b"epilogue text\r\n", "lax")
    yield body("type-no-boundary", good, "refused", "multipart/form-data")
    yield body("type-wrong-boundary", good, "refused", "multipart/form-data; boundary=another-one")
    yield body("type-quoted-boundary", good, "lax", f'multipart/form-data; boundary="{BOUNDARY}"')
    yield body("type-json", encode({"prompt": "make it blue"}), "refused", JSON_TYPE)
    yield body("type-urlencoded", b"prompt=make+it+blue", "refused", "application/x-www-form-urlencoded")
    yield body("type-none", good, "refused", None)
    yield body("type-text-plain", good, "refused", "text/plain")
    yield body("type-image-png", SOURCE, "refused", "image/png")


# --- good requests ------------------------------------------------------------------------------------


def good_bodies(kind: Kind) -> list[Body]:
    """A handful per kind: 64x64 (or the 64x64 source's size), 2 steps."""
    out: list[Body] = []

    def good(
        name: str, route: Route, content: bytes, content_type: str = JSON_TYPE, answer: Answer = "image"
    ) -> None:
        size = (64, 64) if answer == "image" else None
        out.append(Body(f"good-{name}", route, content, content_type, "served", answer, size))

    if kind.generations:
        good("generation", "generations", encode(generation_base()))
        good(
            "generation-two-jpeg",
            "generations",
            encode(generation_base() | {"n": 2, "output_format": "jpeg"}),
        )
    if kind.edits:
        good("edit", "edits", form(source_part(), *EDIT_FIELDS), FORM_TYPE)
        good("edit-list-webp", "edits", form(source_part(name="image[]"), *EDIT_FIELDS, ("output_format", "webp", None)),
             FORM_TYPE)  # fmt: skip
    good("chat-image", "chat", encode(chat_base(kind, "a lighthouse at dusk")))
    if kind.generations:
        good(
            "generation-streamed",
            "generations",
            encode(generation_base() | {"stream": True, "partial_images": 1}),
        )
    else:
        good("edit-streamed", "edits", form(source_part(), *EDIT_FIELDS, ("stream", "true", None)), FORM_TYPE)
    if kind.chat_text:
        good("chat-text", "chat", encode(text_base()), answer="text")
        good("chat-text-streamed", "chat", encode(text_base() | {"stream": True}), answer="text")
    if kind.generations:
        good("generation-guided", "generations",
             encode(generation_base() | {"negative_prompt": "blurry", "guidance_scale": 4.0, "seed": 5}))  # fmt: skip
    return out


def served_route(kind: Kind, body: Body) -> bool:
    if body.route == "generations":
        return kind.generations
    if body.route == "edits":
        return kind.edits
    return kind.chat_text if body.answer == "text" else True


def bodies_of(kind: Kind) -> list[Body]:
    """Every body of ``kind``, good ones spread through the bad ones; a route the model does not serve
    refuses even the bodies another model would take."""
    bad = [*generation_bodies(kind), *edit_bodies(kind), *chat_bodies(kind), *text_bodies(kind)]
    bad = [b if served_route(kind, b) else replace(b, expect="refused") for b in bad]
    bad = [b for b in bad if not (kind.costly and b.expect == "lax")]
    goods = good_bodies(kind)
    out: list[Body] = []
    step = max(1, len(bad) // (len(goods) + 1))
    for i, b in enumerate(bad):
        if i % step == step // 2 and goods:
            out.append(goods.pop(0))
        out.append(b)
    out.extend(goods)
    names = collections.Counter(b.name for b in out)
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
    return out


BODIES: dict[str, list[Body]] = {name: bodies_of(kind) for name, kind in KINDS.items()}


# --- answers ------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    body: Body
    status: int | None = None
    seconds: float = 0.0
    text: str = ""
    problem: str | None = None
    log: str = ""
    """The server's log lines written while the body was in flight (access lines left out)."""


def error_problem(response: httpx.Response) -> str | None:
    """Why a 4xx answer is not OpenAI's error JSON naming the problem (None: it is)."""
    try:
        body = response.json()
    except ValueError:
        return "the answer is not JSON"
    return error_json_problem(body, response.status_code)


def error_json_problem(body: Any, status: int | None) -> str | None:
    """Why ``body`` is not OpenAI's error JSON (with ``status`` as its code, when given)."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "the answer is not {'error': {...}}"
    error = body["error"]
    if set(error) != {"message", "type", "param", "code"}:
        return f"the error has the fields {sorted(error)}, not message, type, param, code"
    message = error["message"]
    if not isinstance(message, str) or not message.strip():
        return "the error message is empty"
    if "Traceback" in message or re.search(r'File ".*", line \d+', message):
        return "the error message holds a Python traceback"
    if not isinstance(error["code"], int) or (status is not None and error["code"] != status):
        return f"the error's code {error['code']!r} is not the status {status}"
    if not isinstance(error["type"], str) or not error["type"]:
        return "the error has no type"
    return None


def image_of(url_or_b64: str) -> Image.Image:
    data = url_or_b64.split(",", 1)[1] if url_or_b64.startswith("data:") else url_or_b64
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def success_problem(body: Body, response: httpx.Response) -> str | None:
    """Why a 200 answer does not carry what was asked for (None: it does)."""
    try:
        answer = response.json()
        if body.route == "chat" and body.answer == "text":
            choice = answer["choices"][0]
            if not isinstance(choice["message"]["content"], str):
                return "the text answer's content is not a string"
            if answer["usage"]["completion_tokens"] < 1:
                return "the text answer has no completion token"
            return None
        if body.route == "chat":
            urls = [c["message"]["content"][0]["image_url"]["url"] for c in answer["choices"]]
        else:
            urls = [item["b64_json"] for item in answer["data"]]
        images = [image_of(url) for url in urls]
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        return f"the answer holds no image: {type(exc).__name__}: {exc}"
    if not images:
        return "the answer holds no image"
    if body.size is not None and any(image.size != body.size for image in images):
        return f"the images are {[image.size for image in images]}, not {body.size}"
    return None


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event; comments and blank lines skipped."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").removeprefix(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events


def stream_problem(body: Body, response: httpx.Response) -> str | None:
    """Why a streamed answer is not what was asked for: an error event must be OpenAI's error JSON with a
    4xx code (a refusal that came once the stream had started); otherwise the image (each preview
    decoded too) or the text, and chat's closing ``[DONE]``."""
    events = sse_events(response.text)
    if not events:
        return "the stream holds no event"
    images: list[Image.Image] = []
    try:
        for name, data in events:
            if data == "[DONE]":
                continue
            value = json.loads(data)
            if name == "error" or (isinstance(value, dict) and "error" in value):
                problem = error_json_problem(value, None)
                if problem is not None:
                    return f"a streamed error: {problem}"
                code = value["error"]["code"]
                if code >= 500:
                    return f"a server error in the stream ({code}): {value['error']['message']}"
                return f"a good request's stream failed ({code})" if body.expect == "served" else None
            if body.route != "chat" and "b64_json" in value:
                image = image_of(value["b64_json"])
                if (name or "").endswith("completed"):
                    images.append(image)
            elif body.route == "chat":
                for choice in value["choices"]:
                    content = choice["delta"].get("content")
                    if isinstance(content, list):
                        images += [
                            image_of(p["image_url"]["url"]) for p in content if p["type"] == "image_url"
                        ]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, OSError) as exc:
        return f"a streamed event is not what OpenAI's format says: {type(exc).__name__}: {exc}"
    if body.route == "chat" and events[-1][1] != "[DONE]":
        return "the chat stream does not end with [DONE]"
    if body.answer == "image" and not images:
        return "the stream holds no image"
    if body.size is not None and any(image.size != body.size for image in images):
        return f"the images are {[image.size for image in images]}, not {body.size}"
    return None


def judge(outcome: Outcome, response: httpx.Response) -> None:
    body, status = outcome.body, response.status_code
    outcome.status, outcome.text = status, response.text[:1500]
    if status >= 500:
        outcome.problem = f"a server error ({status})"
    elif 400 <= status < 500:
        outcome.problem = error_problem(response)
        if outcome.problem is None and body.expect == "served":
            outcome.problem = f"a good request was refused ({status})"
    elif status == 200:
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        outcome.problem = (stream_problem if streamed else success_problem)(body, response)
        if outcome.problem is None and body.expect == "refused":
            outcome.problem = "a bad body was served (200), not refused"
    else:
        outcome.problem = f"an unexpected status {status}"


ACCESS_LINE = re.compile(r'"(GET|POST|PUT|DELETE|HEAD|OPTIONS) \S+ HTTP/1\.[01]" \d{3}')


def log_between(server: ServerProcess, start: int, end: int) -> str:
    """The log's lines between two byte offsets, without uvicorn's access lines."""
    try:
        with open(server.log_path, "rb") as log:
            log.seek(start)
            text = log.read(max(0, end - start)).decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if not ACCESS_LINE.search(line)]
    return "\n".join(lines[-80:])


def log_size(server: ServerProcess) -> int:
    try:
        return server.log_path.stat().st_size
    except OSError:
        return 0


async def send(client: httpx.AsyncClient, server: ServerProcess, body: Body) -> Outcome:
    outcome = Outcome(body)
    headers = {"content-type": body.content_type} if body.content_type is not None else {}
    start_log, start = log_size(server), time.perf_counter()
    try:
        async with asyncio.timeout(STALL_S):  # the whole answer, not each read
            response = await client.post(PATHS[body.route], content=body.content, headers=headers)
    except (httpx.TimeoutException, TimeoutError):
        outcome.problem = f"no answer within {STALL_S:.0f} s: the request stalled"
    except httpx.HTTPError as exc:
        outcome.problem = f"no answer: {type(exc).__name__}: {exc}"
    else:
        judge(outcome, response)
    outcome.seconds = time.perf_counter() - start
    if outcome.problem is not None:
        await asyncio.sleep(0.5)  # the server logs a failure after it answers
        outcome.log = log_between(server, start_log, log_size(server))
    return outcome


async def barrage(server: ServerProcess, bodies: list[Body]) -> list[Outcome]:
    """Bad bodies in groups of :data:`GROUP`; each good one starts where it stands in the list and runs on
    beside the groups that follow."""
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=GROUP + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=STALL_S, limits=limits) as client:
        goods: list[asyncio.Task[Outcome]] = []
        group: list[Body] = []

        async def flush() -> None:
            outcomes.extend(await asyncio.gather(*(send(client, server, b) for b in group)))
            group.clear()

        for body in bodies:
            if body.expect == "served":
                goods.append(asyncio.ensure_future(send(client, server, body)))
                continue
            group.append(body)
            if len(group) == GROUP:
                await flush()
        await flush()
        outcomes.extend(await asyncio.gather(*goods))
    return outcomes


def death_counts(server: ServerProcess) -> dict[str, float]:
    """``omni_stage_replica_deaths_total`` per stage (none when /metrics does not answer)."""
    try:
        text = http_client.get(server.base_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("omni_stage_replica_deaths_total{")
    }


@dataclass
class Barrage:
    kind: Kind
    outcomes: dict[str, Outcome]
    deaths_before: dict[str, float]
    deaths_after: dict[str, float]
    health: tuple[int, str]
    seconds: float
    """The barrage's wall time."""
    total_s: float = 0.0
    """The kind's wall time: start, barrage and stop."""
    log_tail: str = ""
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)

    def summary(self) -> str:
        slowest = max(self.outcomes.values(), key=lambda o: o.seconds)
        served = [o for o in self.outcomes.values() if o.body.expect == "served"]
        codes = ", ".join(f"{code}: {count}" for code, count in sorted(self.statuses.items()))
        return (
            f"[{self.kind.name}] {len(self.outcomes)} bodies ({len(served)} good) in {self.seconds:.1f} s "
            f"({self.total_s:.0f} s with the server's start and stop); "
            f"statuses {codes}; slowest {slowest.body.name} {slowest.seconds:.2f} s ({slowest.status}); "
            f"problems {sum(o.problem is not None for o in self.outcomes.values())}"
        )


_BARRAGES: dict[str, Barrage] = {}
"""Each kind's barrage, run once per session (pytest may set a module fixture up again for its last
items, which must not start the server again)."""


def run_barrage(kind: Kind, model: Path, directory: Path) -> Barrage:
    deploy = directory / "deploy.yaml"
    deploy.write_text(kind.deploy)
    begun = time.perf_counter()
    with omni_server(model, deploy, directory / "server.log") as server:
        before = death_counts(server)
        start = time.perf_counter()
        outcomes = asyncio.run(barrage(server, BODIES[kind.name]))
        seconds = time.perf_counter() - start
        try:
            answer = http_client.get(server.base_url + "/health", timeout=30)
            health = (answer.status_code, answer.text[:2000])
        except httpx.HTTPError as exc:
            health = (0, f"/health did not answer: {exc!r}")
        after = death_counts(server)
    result = Barrage(
        kind,
        {o.body.name: o for o in outcomes},
        before,
        after,
        health,
        seconds,
        total_s=time.perf_counter() - begun,
        log_tail="\n".join(server.log_text().splitlines()[-60:]),
    )
    result.statuses.update(str(o.status) if o.status is not None else "no answer" for o in outcomes)
    with open(directory / "outcomes.jsonl", "w") as out:  # beside the server's log, for a closer look
        for o in outcomes:
            row = {"name": o.body.name, "expect": o.body.expect, "status": o.status, "seconds": o.seconds}
            out.write(json.dumps(row | {"problem": o.problem, "answer": o.text[:300]}) + "\n")
    print("\n" + result.summary())
    return result


@pytest.fixture(scope="module", params=sorted(KINDS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Barrage:
    """One kind's server, started, barraged and stopped here; its outcomes."""
    kind = KINDS[request.param]
    if kind.name not in _BARRAGES:
        model = request.getfixturevalue(kind.fixture)
        _BARRAGES[kind.name] = run_barrage(kind, model, tmp_path_factory.mktemp(f"barrage_{kind.name}"))
    return _BARRAGES[kind.name]


def report(outcome: Outcome) -> str:
    return (
        f"{outcome.body.name}: {outcome.problem}\n{outcome.body.describe()}\n"
        f"  expected: {outcome.body.expect}; status: {outcome.status}; {outcome.seconds:.2f} s\n"
        f"  answer: {outcome.text[: 600 if outcome.status != 200 else 300]}\n  server log:\n{outcome.log}"
    )


CASES = [
    pytest.param(
        kind,
        body.name,
        id=f"{kind}-{body.name}",
    )
    for kind, bodies in BODIES.items()
    for body in bodies
]


@pytest.mark.parametrize(("served", "name"), CASES, indirect=["served"])
def test_body_is_answered_as_it_deserves(served: Barrage, name: str) -> None:
    """Bad: 4xx with error JSON naming the problem (or, for a lax value, what it asked for); good: its
    image or text; none a 5xx, a traceback or a stall."""
    outcome = served.outcomes[name]
    if outcome.problem is not None:
        pytest.fail(report(outcome), pytrace=False)


@pytest.mark.parametrize("served", sorted(KINDS), indirect=True)
def test_no_stage_died_and_health_answers(served: Barrage) -> None:
    """A barrage of bad bodies kills no stage replica and leaves the server healthy."""
    assert served.deaths_before, "no omni_stage_replica_deaths_total sample before the barrage"
    assert served.deaths_after == served.deaths_before, (
        f"replica deaths before {served.deaths_before}, after {served.deaths_after}; log tail:\n{served.log_tail}"
    )
    status, text = served.health
    assert status == 200, text
