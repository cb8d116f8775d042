"""Every error path of the HTTP layer answers OpenAI's error JSON (``{"error": {"message", "type", "param",
"code"}}``) naming the problem, and leaves the connection usable: hostile JSON, wrong content types,
broken multipart bodies, oversized bodies and images, non-finite numbers, sizes off the grid, FastAPI's
own routing errors. The app is the real one (vLLM's ``build_app`` with our routes) over the real runtime
on fake replicas (``helpers.FakePlacement``); the connection tests serve it with uvicorn in this process
and speak HTTP/1.1 over one socket."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h11
import httpx
import msgspec
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from PIL import Image
from pydantic import BaseModel

from helpers import FAKE_PIPELINE, FakePlacement, app_client, fake_deployment, png_header
from vllm_omni_plugin.config import register_pipeline
from vllm_omni_plugin.entrypoints import api_calls, routes
from vllm_omni_plugin.entrypoints.api_server import build_api_app
from vllm_omni_plugin.entrypoints.cli import build_parser
from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_codec import decode_image
from vllm_omni_plugin.entrypoints.image_protocol import ImageLimits
from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.stage.input_processor import OmniCoreRequest

MODEL = "fake-image"
DEEP = 100_000
UPLOAD_LIMIT = 4096
"""``--image-max-upload-bytes`` of the servers here: small, so bodies over the limits stay small."""

BAGEL_SETTINGS_PIPELINE = msgspec.structs.replace(
    FAKE_PIPELINE,
    name="fake_two_stage_bagel_settings",
    settings="vllm_omni_plugin.families.bagel.settings.BagelSettings",
)
"""The fake stages with BAGEL's request settings (``cfg_interval``, ``cfg_text_scale``, ...)."""
register_pipeline(BAGEL_SETTINGS_PIPELINE)


def running(
    tmp_path: Path, *flags: str, pipeline: str = FAKE_PIPELINE.name
) -> contextlib.AbstractAsyncContextManager[tuple[httpx.AsyncClient, OmniServer]]:
    flags = ("--served-model-name", MODEL, "--image-max-upload-bytes", str(UPLOAD_LIMIT), *flags)
    return app_client(fake_deployment(tmp_path, pipeline=pipeline), FakePlacement(), *flags)


def error_of(response: httpx.Response | tuple[int, bytes], status: int, param: str | None = None) -> str:
    """The message of OpenAI's error JSON with ``status`` (and ``param`` when given)."""
    code, text = (
        (response.status_code, response.content) if isinstance(response, httpx.Response) else response
    )
    assert code == status, (code, text[:500])
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["code"] == status and error["type"].endswith("Error") and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def png(side: int = 64) -> bytes:
    """A flat grey PNG: a few hundred bytes, well under the servers' upload limit."""
    out = io.BytesIO()
    Image.fromarray(np.full((side, side, 3), 127, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def png_rgba(side: int = 64) -> bytes:
    """A mask as OpenAI's edits take it: a PNG whose transparent pixels are the area to repaint."""
    pixels = np.full((side, side, 4), 255, dtype=np.uint8)
    pixels[: side // 2, :, 3] = 0
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


BOUNDARY = "omni-test-boundary"
FORM_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def multipart(*parts: tuple[str, str | bytes, str | None], end: bool = True) -> bytes:
    """A multipart/form-data body of ``(name, value, filename)`` parts, built by hand so that a test can
    send what no HTTP client would (a missing end, repeated fields)."""
    out = b""
    for name, value, filename in parts:
        file = f'; filename="{filename}"' if filename is not None else ""
        kind = "Content-Type: application/octet-stream\r\n" if filename is not None else ""
        data = value.encode() if isinstance(value, str) else value
        out += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"{file}\r\n{kind}\r\n'.encode()
        out += data + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if end else b"")


def image_part(
    data: bytes | None = None, name: str = "image", filename: str = "a.png"
) -> tuple[str, bytes, str]:
    return name, png() if data is None else data, filename


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


def chat(content: Any = "a cat", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "modalities": ["image"], **extra}


# --- one connection through every error -----------------------------------------------------------------


class Connection:
    """One HTTP/1.1 connection, request after request (h11 checks both sides speak HTTP)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.http = h11.Connection(h11.CLIENT)

    async def request(
        self, method: str, target: str, body: bytes = b"", content_type: str | None = None
    ) -> tuple[int, bytes]:
        headers = [("Host", "omni.test"), ("Content-Length", str(len(body)))]
        if content_type is not None:
            headers.append(("Content-Type", content_type))
        out = self.http.send(h11.Request(method=method, target=target, headers=headers))
        out += self.http.send(h11.Data(data=body)) if body else b""
        self.writer.write(out + self.http.send(h11.EndOfMessage()))
        await self.writer.drain()
        status, chunks = 0, []
        while True:
            event = self.http.next_event()
            if event is h11.NEED_DATA:
                self.http.receive_data(await self.reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError(f"the server closed the connection during {method} {target}")
        self.http.start_next_cycle()  # refuses when the server said it closes the connection
        return status, b"".join(chunks)


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[Connection]:
    """``app`` served by uvicorn (as vLLM's serve_http serves it) on a loopback socket in this process, and
    one connection to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=600)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not serving.done(), serving.exception()
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            yield Connection(reader, writer)
        finally:
            writer.close()
    finally:
        server.should_exit = True
        await serving
        sock.close()


def test_one_connection_survives_every_kind_of_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON nested 100,000 deep (a RecursionError in the decoder, which used to escape, and the server
    then dropped the connection), bodies refused unread, routing errors and a bug in a route: each is
    answered with error JSON and the next request on the same connection is served."""
    args = build_parser().parse_args(
        ["serve", "/models/fake", "--omni", "--served-model-name", MODEL, "--image-max-upload-bytes", "4096"]
    )

    async def main() -> None:
        async with running(tmp_path) as (_, server), served(build_api_app(args, server)) as conn:
            deep = nested(DEEP)
            cases: list[tuple[str, str, bytes, str | None, int, str]] = [
                ("POST", "/v1/images/generations", deep.encode(), "application/json", 400, "nested too deeply"),
                ("POST", "/v1/chat/completions", json.dumps(chat())[:-1].encode() + b', "x": ' + deep.encode() + b"}",
                 "application/json", 400, "nested too deeply"),
                ("POST", "/v1/chat/completions",
                 b'{"modalities": ["image"], "messages": [{"role": "user", "content": ' + deep.encode() + b"}]}",
                 None, 400, "nested too deeply"),
                ("POST", "/v1/images/generations", b'{"prompt": "a cat", "seed": ' + deep.encode() + b"}",
                 "text/plain", 400, "nested too deeply"),
                ("POST", "/v1/images/edits", multipart(image_part(), ("prompt", "a cat", None),
                 ("cfg_interval", deep, None)), FORM_TYPE, 400, "nested too deeply"),
                ("POST", "/v1/images/edits", b'{"prompt": "a cat"}', "application/json", 415, "multipart/form-data"),
                ("POST", "/v1/images/generations", b"prompt=a+cat", "application/x-www-form-urlencoded", 415,
                 "application/json"),
                ("POST", "/v1/images/generations", b'{"prompt": "' + b"x" * 1_200_000 + b'"}', "application/json",
                 413, "at most"),
                ("GET", "/v1/images/generations", b"", None, 405, "use POST"),
                ("POST", "/v1/completions", b"{}", "application/json", 404, "/v1/completions"),
            ]  # fmt: skip
            for method, target, body, content_type, status, words in cases:
                message = error_of(await conn.request(method, target, body, content_type), status)
                assert words in message, (target, message)
                assert (await conn.request("GET", "/v1/models"))[0] == 200, (target, status)

            with monkeypatch.context() as patch:  # a bug in a route: a RuntimeError nobody expected
                patch.setattr(api_calls, "parse_size", _raise(RuntimeError("a bug in parse_size")))
                reply = await conn.request("POST", "/v1/images/generations", b'{"prompt": "a cat"}', None)
                assert error_of(reply, 500) == "RuntimeError: a bug in parse_size"
            ok = await conn.request(
                "POST", "/v1/images/generations", b'{"prompt": "a cat", "size": "32x32"}', None
            )
            assert ok[0] == 200 and json.loads(ok[1])["size"] == "32x32"

    asyncio.run(main())


def _raise(exc: Exception) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


# --- content types ------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/images/generations", "/v1/chat/completions"])
def test_json_routes_refuse_form_bodies_with_415_but_read_json_sent_without_a_type(
    tmp_path: Path, route: str
) -> None:
    """A form is refused naming the type to use; JSON with no Content-Type or ``text/plain`` (curl's
    ``-d`` without ``-H``) is read as JSON, as before."""
    body = {"prompt": "a cat", "size": "32x32"} if route.endswith("generations") else chat(size="32x32")

    async def main() -> None:
        async with running(tmp_path) as (client, _):
            as_form = await client.post(route, data={"prompt": "a cat"})
            assert "application/json" in error_of(as_form, 415)
            multi = await client.post(route, data={"prompt": "a cat"}, files={"image": ("a.png", png())})
            assert "Content-Type: application/json, not multipart/form-data" in error_of(multi, 415)
            for headers in ({}, {"content-type": "text/plain"}):
                ok = await client.post(route, content=json.dumps(body).encode(), headers=headers)
                assert ok.status_code == 200, ok.text

    asyncio.run(main())


def test_edits_refuse_json_with_415(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (client, _):
            sent = await client.post("/v1/images/edits", json={"prompt": "a cat"})
            assert "takes a multipart/form-data body" in error_of(sent, 415)
            assert "not application/json" in error_of(sent, 415)

    asyncio.run(main())


# --- multipart ----------------------------------------------------------------------------------------

PROMPT = ("prompt", "make it blue", None)
EDIT = multipart(image_part(), PROMPT)

MULTIPART_CASES: list[tuple[str, bytes, dict[str, str], int, str | None, str]] = [
    ("no boundary", multipart(image_part(), PROMPT), {"content-type": "multipart/form-data"}, 400, None,
     "has no boundary parameter"),
    ("truncated", multipart(image_part(), PROMPT, end=False)[:-20], {}, 400, None, "truncated"),
    ("content-length too long", EDIT, {"content-length": str(len(EDIT) + 1000)}, 400, None,
     f"ended after {len(EDIT)} bytes; its Content-Length says {len(EDIT) + 1000} bytes"),
    ("content-length too short", EDIT, {"content-length": "100"}, 400, None,
     "longer than its Content-Length (100 bytes)"),
    ("content-length not a number", EDIT, {"content-length": "lots"}, 400, None,
     "Content-Length header 'lots' is not a number"),
    ("five files", multipart(*[image_part()] * 5, PROMPT), {}, 400, "image", "at most 4 images"),
    ("seven files", multipart(*[image_part()] * 7, PROMPT), {}, 400, "image", "at most 4 images"),
    ("too many fields", multipart(image_part(), *[(f"f{i}", "1", None) for i in range(70)]), {}, 400, None,
     "too many form fields"),
    ("a field of 3 MB", multipart(image_part(), ("prompt", "x" * 3_000_000, None)), {}, 413, "prompt",
     "over 1048576 bytes"),
    ("empty file", multipart(image_part(b""), PROMPT), {}, 400, "image", "'a.png' is empty"),
    ("not an image", multipart(image_part(b"just some text"), PROMPT), {}, 400, "image", "cannot decode 'a.png'"),
    ("image as text", multipart(("image", "a.png", None), PROMPT), {}, 400, "image", "must be an uploaded file"),
    ("two prompts", multipart(image_part(), PROMPT, ("prompt", "make it red", None)), {}, 400, "prompt",
     "prompt is repeated"),
    ("unknown file field", multipart(image_part(), image_part(name="photo"), PROMPT), {}, 400, "photo",
     "photo: file uploads other than image and mask are not supported"),
    # a pipeline without model facts (as GLM-Image and BAGEL) repaints no mask and takes no strength
    ("a mask", multipart(image_part(), image_part(png_rgba(), name="mask"), PROMPT), {}, 400, "mask",
     "cannot repaint a masked area"),
    ("a strength", multipart(image_part(), PROMPT, ("strength", "0.5", None)), {}, 400, "strength",
     "takes no strength"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "headers", "status", "param", "words"),
    [case[1:] for case in MULTIPART_CASES],
    ids=[case[0] for case in MULTIPART_CASES],
)
def test_broken_multipart_bodies_are_refused_naming_the_problem(
    tmp_path: Path, body: bytes, headers: dict[str, str], status: int, param: str | None, words: str
) -> None:
    async def main() -> httpx.Response:
        # uploads of up to 1 MiB: a body of several MB is within the body's limit, a field of them is not
        async with running(tmp_path, "--image-max-upload-bytes", str(1 << 20)) as (client, _):
            return await client.post(
                "/v1/images/edits", content=body, headers={"content-type": FORM_TYPE, **headers}
            )

    assert words in error_of(asyncio.run(main()), status, param)


# --- sizes --------------------------------------------------------------------------------------------


def test_too_many_bytes_or_pixels_are_413_with_the_size_and_the_limit(tmp_path: Path) -> None:
    json_limit = routes._json_limit(ImageLimits(max_upload_bytes=UPLOAD_LIMIT))

    async def chunked(
        data: bytes,
    ) -> AsyncIterator[bytes]:  # no Content-Length: the limit binds as it arrives
        for i in range(0, len(data), 65536):
            yield data[i : i + 65536]

    async def main() -> None:
        async with running(tmp_path, "--image-max-size", "64") as (client, _):
            edit = "/v1/images/edits"
            bomb = await client.post(
                edit, data={"prompt": "x"}, files={"image": ("bomb.png", png_header(20000, 20000))}
            )
            message = error_of(bomb, 413, "image")
            assert "too large: 400000000 pixels" in message and f"at most {256 * 256} pixels" in message
            big = await client.post(
                edit, data={"prompt": "x"}, files={"image": ("big.png", png_header(300, 300))}
            )
            assert "300x300 is 90000 pixels; this server accepts at most 65536 pixels" in error_of(
                big, 413, "image"
            )
            heavy = await client.post(
                edit, data={"prompt": "x"}, files={"image": ("heavy.png", b"\0" * 5000)}
            )
            assert "'heavy.png' is 5000 bytes" in error_of(heavy, 413, "image")
            assert f"at most {UPLOAD_LIMIT} bytes per image" in error_of(heavy, 413, "image")
            form_body = multipart(image_part(b"\0" * (5 * UPLOAD_LIMIT)), ("n", "1" * 1_100_000, None))
            huge_form = await client.post(edit, content=form_body, headers={"content-type": FORM_TYPE})
            assert f"the request body is {len(form_body)} bytes; this server accepts at most" in error_of(
                huge_form, 413
            )

            body = json.dumps({"prompt": "x" * json_limit}).encode()
            huge = await client.post("/v1/images/generations", content=body)
            assert (
                f"the request body is {len(body)} bytes; this server accepts at most {json_limit} bytes"
                in (error_of(huge, 413))
            )
            streamed = await client.post("/v1/images/generations", content=chunked(body))
            assert f"over {json_limit} bytes" in error_of(streamed, 413)
            uri = "data:image/png;base64," + base64.b64encode(b"\0" * (2 * UPLOAD_LIMIT)).decode()
            as_uri = await client.post(
                "/v1/chat/completions", json=chat([{"type": "image_url", "image_url": uri}])
            )
            assert f"at most {UPLOAD_LIMIT} bytes per image" in error_of(as_uri, 413)

    asyncio.run(main())


def test_decompression_bomb_header_is_413_naming_its_pixels() -> None:
    """PIL refuses the header in Image.open, before our own pixel check sees the size."""
    with pytest.raises(OmniAPIError) as info:
        decode_image(png_header(20000, 20000), ImageLimits())
    assert info.value.status == 413 and "400000000 pixels" in info.value.message


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"height": 0}, "height"),
        ({"width": 0}, "width"),
        ({"height": -32}, "height"),
        ({"width": 40}, "width"),
    ],
)
def test_chat_height_or_width_off_the_grid_is_400_naming_it(
    tmp_path: Path, extra: dict[str, int], param: str
) -> None:
    """0 is no "default": only an absent height or width is (a 64x64 source used to come back at the
    default size when asked for height 0)."""
    uri = "data:image/png;base64," + base64.b64encode(png()).decode()
    content = [{"type": "text", "text": "make it blue"}, {"type": "image_url", "image_url": {"url": uri}}]

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with running(tmp_path) as (client, _):
            bad = await client.post("/v1/chat/completions", json=chat(content, **extra))
            sourced = await client.post("/v1/chat/completions", json=chat(content))
            half = await client.post("/v1/chat/completions", json=chat(content, width=32, height=None))
            return bad, sourced, half

    bad, sourced, half = asyncio.run(main())
    message = error_of(bad, 400, param)
    assert (
        message.startswith(f"{param} must be a multiple of 16")
        and f"got {next(iter(extra.values()))}" in message
    )
    assert sourced.status_code == 200 and image_size(sourced) == (64, 64)  # the source's size
    assert half.status_code == 200 and image_size(half) == (32, 64)  # absent height: the default


def image_size(response: httpx.Response) -> tuple[int, int]:
    url = response.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size


# --- values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("generations", {"guidance_scale": "NaN"}, "guidance_scale"),
        ("generations", b'{"prompt": "a cat", "guidance_scale": 1e999}', "guidance_scale"),
        ("generations", {"seed": "inf"}, "seed"),
        ("generations", {"num_inference_steps": "-Infinity"}, "num_inference_steps"),
        ("generations", {"output_compression": "nan"}, "output_compression"),
        ("edits", {"guidance_scale": "nan"}, "guidance_scale"),
        ("edits", {"seed": "inf"}, "seed"),
        ("edits", {"num_inference_steps": "nan"}, "num_inference_steps"),
        ("edits", {"output_compression": "-inf"}, "output_compression"),
        ("chat", {"guidance_scale": "nan"}, "guidance_scale"),
        ("chat", {"extra_body": {"seed": "inf"}}, "seed"),
        ("chat", {"temperature": "inf"}, "temperature"),
        ("bagel generations", {"cfg_text_scale": "nan"}, "cfg_text_scale"),
        ("bagel generations", b'{"prompt": "a cat", "cfg_img_scale": -1e999}', "cfg_img_scale"),
        ("bagel edits", {"cfg_text_scale": "inf"}, "cfg_text_scale"),
        ("bagel edits", {"timestep_shift": "NaN"}, "timestep_shift"),
        ("bagel edits", {"cfg_interval": "[0.4, 1e999]"}, "cfg_interval.1"),
    ],
)
def test_nan_and_infinities_are_400_naming_the_field(
    tmp_path: Path, route: str, body: dict[str, Any] | bytes, param: str
) -> None:
    pipeline = BAGEL_SETTINGS_PIPELINE.name if route.startswith("bagel") else FAKE_PIPELINE.name

    async def main() -> httpx.Response:
        async with running(tmp_path, pipeline=pipeline) as (client, _):
            if route.endswith("edits"):
                assert isinstance(body, dict)
                return await client.post(
                    "/v1/images/edits", data={"prompt": "a cat", **body}, files={"image": ("a.png", png())}
                )
            if route.endswith("chat"):
                assert isinstance(body, dict)
                return await client.post("/v1/chat/completions", json=chat(**body))
            content = body if isinstance(body, bytes) else json.dumps({"prompt": "a cat", **body}).encode()
            return await client.post("/v1/images/generations", content=content)

    assert error_of(asyncio.run(main()), 400, param) == f"{param}: must be a finite number"


def test_data_uris_are_matched_case_insensitively(tmp_path: Path) -> None:
    """RFC 2397: the scheme, the media type and ``base64`` are case-insensitive."""
    encoded = base64.b64encode(png(32)).decode()

    async def main() -> list[httpx.Response]:
        async with running(tmp_path) as (client, _):
            return [
                await client.post(
                    "/v1/chat/completions",
                    json=chat(
                        [{"type": "text", "text": "blue"}, {"type": "image_url", "image_url": {"url": uri}}]
                    ),
                )
                for uri in (f"DATA:image/png;BASE64,{encoded}", f"Data:Image/PNG;Base64,{encoded}")
            ]

    for response in asyncio.run(main()):
        assert response.status_code == 200, response.text
        assert image_size(response) == (32, 32)


def test_form_fields_holding_json_arrays_reach_the_family_settings(tmp_path: Path) -> None:
    """A form carries text only: BAGEL's ``cfg_interval`` (a pair) goes as a JSON array, read as one."""
    seen: list[OmniCoreRequest] = []

    async def main() -> tuple[httpx.Response, ...]:
        async with running(tmp_path, pipeline=BAGEL_SETTINGS_PIPELINE.name) as (client, server):
            generate = server.omni.generate

            def recording(request: OmniCoreRequest) -> Any:
                seen.append(request)
                return generate(request)

            setattr(server.omni, "generate", recording)  # noqa: B010 - the instance's, not the class's

            async def edit(**fields: str) -> httpx.Response:
                data = {"prompt": "make it blue", **fields}
                return await client.post("/v1/images/edits", data=data, files={"image": ("a.png", png())})

            return (
                await edit(cfg_interval="[0.4, 1.0]", cfg_text_scale="4"),
                await edit(cfg_interval=" [0.9, 0.1]"),
                await edit(cfg_interval="[0.4, 1.0"),
                await edit(cfg_interval=nested(DEEP, "0.4")),
            )

    ok, reversed_pair, malformed, deep = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    assert [(r.settings.cfg_interval, r.settings.cfg_text_scale) for r in seen] == [((0.4, 1.0), 4.0)]
    assert "cfg_interval must be [lo, hi] with 0 <= lo <= hi <= 1, got [0.9, 0.1]" in error_of(
        reversed_pair, 400
    )
    assert error_of(malformed, 400, "cfg_interval").startswith("cfg_interval is not valid JSON")
    assert "nested too deeply" in error_of(deep, 400, "cfg_interval")


# --- FastAPI's own errors -----------------------------------------------------------------------------


def test_routing_errors_on_our_paths_are_error_json_and_vllms_own_stay_as_they_were(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (client, _):
            get = await client.get("/v1/images/generations")
            assert error_of(get, 405) == "GET is not allowed on /v1/images/generations; use POST"
            assert get.headers["allow"] == "POST"
            post = await client.post("/media/0123.png")
            assert "POST is not allowed on /media/0123.png" in error_of(post, 405)
            missing = await client.post("/v1/completions", json={"prompt": "hi"})
            message = error_of(missing, 404)
            assert message.startswith("POST /v1/completions: this server has no such route")
            assert "POST /v1/images/generations" in message and "GET /v1/models" in message
            # vLLM's routes and paths outside ours answer as in `vllm serve`
            assert (await client.post("/version")).json() == {"detail": "Method Not Allowed"}
            assert (await client.get("/nothing/here")).json() == {"detail": "Not Found"}

    asyncio.run(main())


class Item(BaseModel):
    n: int


def test_request_validation_errors_are_error_json_where_fastapi_would_answer_detail() -> None:
    """vLLM 0.32's app answers validation errors itself (our routes, which read the raw request, raise
    none); where an app left FastAPI's default, the handler answers error JSON on our paths."""
    app = FastAPI()

    @app.post("/v1/thing")
    async def thing(item: Item) -> dict[str, int]:
        return {"n": item.n}

    @app.post("/theirs")
    async def theirs(item: Item) -> dict[str, int]:
        return {"n": item.n}

    app.add_exception_handler(
        RequestValidationError, routes.framework_error_handler(request_validation_exception_handler)
    )

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/thing", json={"n": "x"}), await client.post(
                "/theirs", json={"n": "x"}
            )

    ours, theirs_ = asyncio.run(main())
    assert error_of(ours, 400, "body.n").startswith("body.n: Input should be a valid integer")
    assert theirs_.status_code == 422 and "detail" in theirs_.json()


def test_json_nested_deeper_than_the_limit_is_refused_without_recursion() -> None:
    """The limit is ours and fixed (64 levels), not the interpreter's recursion depth at the call."""
    from vllm_omni_plugin.entrypoints.errors import MAX_JSON_DEPTH, decode_json

    assert decode_json(nested(MAX_JSON_DEPTH).encode()) is not None
    for depth in (MAX_JSON_DEPTH + 1, 500, DEEP):
        with pytest.raises(OmniAPIError, match="nested too deeply"):
            decode_json(nested(depth).encode())
    assert decode_json(b'{"a": ' + nested(MAX_JSON_DEPTH - 1).encode() + b"}") == {
        "a": _nest(MAX_JSON_DEPTH - 1)
    }
    assert np.isinf(decode_json(b"[1e999]")[0])


def _nest(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value
