"""Serving under Dynamo without Dynamo: how the requests Dynamo's frontend sends map onto our request
types and our answers onto what it reads (``vllm_omni_plugin.dynamo.request_fields``), that the Dynamo worker's
handler gives every request what our HTTP server gives the same request (one runtime of fake replicas
behind both), and that nothing imports Dynamo until a role is started (without the extra: one line)."""

from __future__ import annotations

import ast
import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from helpers import FakePlacement, app_client, fake_deployment, source_image
from vllm_omni_plugin.dynamo import request_fields
from vllm_omni_plugin.entrypoints.chat_protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    ChatUsage,
)
from vllm_omni_plugin.entrypoints.errors import OmniAPIError, parse_request
from vllm_omni_plugin.entrypoints.image_protocol import ImageGenerationRequest, ImageObject, ImagesResponse
from vllm_omni_testkit.harness.images import data_uri, pixels, png

MODEL = "fake-image"


# --- the mapping ------------------------------------------------------------------------------------


def test_each_api_is_told_apart_by_its_fields() -> None:
    assert request_fields.endpoint_of({"model": "m", "messages": []}) == request_fields.CHAT
    assert request_fields.endpoint_of({"prompt": "a", "input_reference": "data:..."}) == request_fields.EDITS
    assert request_fields.endpoint_of({"prompt": "a"}) == request_fields.GENERATIONS
    for bad in ([1, 2], {"model": "m"}):
        with pytest.raises(OmniAPIError) as caught:
            request_fields.endpoint_of(bad)
        assert caught.value.status == 400


def test_nvext_and_passthrough_fields_reach_the_request_types() -> None:
    request = {
        "prompt": "a fox",
        "model": MODEL,
        "size": "64x64",
        "n": 2,
        "nvext": {"seed": 7, "num_inference_steps": 3, "guidance_scale": 1.5, "negative_prompt": "blur",
                  "annotations": ["dynamo's own"]},
        "extra_args": {"media_passthrough": {"cfg_text_scale": 4.0, "seed": 7}},
    }  # fmt: skip
    fields = request_fields.image_fields(request)
    assert "nvext" not in fields and "extra_args" not in fields and "annotations" not in fields
    req = parse_request(ImageGenerationRequest, fields)
    assert (req.seed, req.num_inference_steps, req.guidance_scale) == (7, 3, 1.5)
    assert req.negative_prompt == "blur" and req.n == 2 and req.size == "64x64"
    assert req.family_fields == {"cfg_text_scale": 4.0}  # the pipeline's settings type reads these


def test_images_are_not_streamed_through_the_frontend() -> None:
    """It forwards ``stream`` and ``partial_images`` but answers with one JSON body: refused, not ignored."""
    for extra in (
        {"stream": True},
        {"partial_images": 2},
        {"extra_args": {"media_passthrough": {"stream": True}}},
    ):
        with pytest.raises(OmniAPIError, match="not streamed through it") as caught:
            request_fields.image_fields({"prompt": "a", **extra})
        assert caught.value.param in ("stream", "partial_images")
    assert "stream" not in request_fields.image_fields({"prompt": "a", "stream": False, "partial_images": 0})


def test_a_field_given_twice_with_different_values_is_refused() -> None:
    request = {"prompt": "a", "nvext": {"seed": 1}, "extra_args": {"media_passthrough": {"seed": 2}}}
    with pytest.raises(OmniAPIError, match="seed is given twice") as caught:
        request_fields.image_fields(request)
    assert caught.value.param == "seed"
    for bad in ({"prompt": "a", "nvext": [1]}, {"prompt": "a", "extra_args": {"media_passthrough": "x"}}):
        with pytest.raises(OmniAPIError, match="must be an object"):
            request_fields.image_fields(bad)


def test_an_edit_takes_input_reference_then_images() -> None:
    one, two, three = (data_uri(source_image(16, seed)) for seed in range(3))
    request = {
        "prompt": "edit",
        "input_reference": one,
        "extra_args": {
            "media_passthrough": {"images": [two, {"image_url": three}, {"image_url": {"url": one}}]}
        },
    }
    fields, sources = request_fields.edit_fields(request, max_images=4)
    assert "input_reference" not in fields and "images" not in fields
    assert sources == [("input_reference", one), ("images[0]", two), ("images[1]", three), ("images[2]", one)]
    with pytest.raises(OmniAPIError, match="at most 3 per request .* got 4"):
        request_fields.edit_fields(request, max_images=3)
    with pytest.raises(OmniAPIError, match=r"images\[0\] must be an image as a data URI"):
        request_fields.edit_fields(
            {"prompt": "e", "input_reference": one, "extra_args": {"media_passthrough": {"images": [3]}}}, 4
        )
    with pytest.raises(OmniAPIError, match="images must be a list"):
        request_fields.edit_fields(
            {"prompt": "e", "input_reference": one, "extra_args": {"media_passthrough": {"images": one}}}, 4
        )


def test_chat_asks_for_an_image_unless_it_says_text() -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a fox"}],
        "stream": True,
        "seed": 3,
        "chat_template_args": {"num_inference_steps": 2, "size": "64x64"},
    }
    fields = request_fields.chat_fields(request)
    assert fields["modalities"] == ["image"] and "stream" not in fields and "chat_template_args" not in fields
    assert (fields["seed"], fields["num_inference_steps"], fields["size"]) == (3, 2, "64x64")
    assert request_fields.chat_fields({**request, "modalities": ["text"]})["modalities"] == ["text"]
    assert request_fields.chat_fields({**request, "chat_template_kwargs": {"modalities": ["text"]}})[
        "modalities"
    ] == ["text"]
    with pytest.raises(OmniAPIError, match="seed is given twice"):
        request_fields.chat_fields({**request, "chat_template_args": {"seed": 4}})


def test_answers_are_plain_dicts_the_frontend_reads() -> None:
    images = request_fields.images_reply(
        ImagesResponse(created=5, data=[ImageObject(b64_json="QQ==")], size="64x64")
    )
    assert images == {"created": 5, "data": [{"b64_json": "QQ=="}], "size": "64x64"}  # no nulls
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ=="}}]
    body = ChatCompletionResponse(
        id="chatcmpl-1",
        created=6,
        model=MODEL,
        choices=[ChatChoice(index=0, message=ChatMessage(role="assistant", content=parts))],
        usage=ChatUsage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    )
    (chunk,) = request_fields.chat_chunks(body)
    assert (
        chunk["object"] == "chat.completion.chunk" and chunk["created"] == 6 and chunk["id"] == "chatcmpl-1"
    )
    assert chunk["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": parts},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert chunk["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    msgspec.json.encode(chunk)  # what Dynamo carries: JSON values only


@pytest.mark.parametrize(
    ("status", "name"),
    [(400, "InvalidArgument"), (404, "InvalidArgument"), (413, "InvalidArgument"), (415, "InvalidArgument"),
     (499, "Cancelled"), (500, "Unknown"), (503, "Disconnected")],
)  # fmt: skip
def test_failures_become_exceptions_the_frontend_carries(status: int, name: str) -> None:
    assert request_fields.dynamo_error(status) == name


# --- the worker's handler against the HTTP routes ------------------------------------------------------


class Stopped:
    """Dynamo's request context, as the handler uses it: never stopped here."""

    def id(self) -> str:
        return "request-1"

    async def async_killed_or_stopped(self) -> bool:
        await asyncio.Event().wait()
        return True


Case = tuple[str, dict[str, Any], dict[str, Any]]
"""(endpoint, the JSON our HTTP server takes, the dict Dynamo's frontend sends for the same call)."""

CASES: list[Case] = [
    ("images/generations",
     {"prompt": "a fox", "size": "96x64", "seed": 3, "num_inference_steps": 2},
     {"prompt": "a fox", "size": "96x64", "nvext": {"seed": 3, "num_inference_steps": 2}}),
    ("images/generations", {"prompt": "a fox", "size": "65x64"}, {"prompt": "a fox", "size": "65x64"}),
    ("images/generations", {"prompt": "a fox", "n": 0}, {"prompt": "a fox", "n": 0}),
    ("images/generations", {"prompt": "a fox", "num_inference_steps": 5000},
     {"prompt": "a fox", "extra_args": {"media_passthrough": {"num_inference_steps": 5000}}}),
    ("images/generations", {"prompt": "a fox", "wobble": 1},
     {"prompt": "a fox", "extra_args": {"media_passthrough": {"wobble": 1}}}),
    ("images/generations", {"prompt": "a fox", "cfg_text_scale": 2.0},
     {"prompt": "a fox", "extra_args": {"media_passthrough": {"cfg_text_scale": 2.0}}}),
    ("images/generations", {"prompt": "x" * 70}, {"prompt": "x" * 70}),
    ("images/generations", {"prompt": "a fox", "model": "other"}, {"prompt": "a fox", "model": "other"}),
    ("chat/completions",
     {"messages": [{"role": "user", "content": "a fox"}], "modalities": ["image"], "size": "64x96", "seed": 1},
     {"messages": [{"role": "user", "content": "a fox"}], "seed": 1, "chat_template_args": {"size": "64x96"}}),
    ("chat/completions",
     {"messages": [{"role": "user", "content": "a fox"}]},
     {"messages": [{"role": "user", "content": "a fox"}], "modalities": ["text"]}),
    ("chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                                 {"type": "text", "text": "edit"}]}], "modalities": ["image"]},
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                                 {"type": "text", "text": "edit"}]}]}),
]  # fmt: skip


def test_the_dynamo_handler_answers_as_the_http_routes_do(tmp_path: Path) -> None:
    """One runtime behind both: each call's image (or its status and message) is the same."""
    from vllm_omni_plugin.dynamo.roles import ModelEndpoint

    async def main() -> None:
        flags = ("--served-model-name", MODEL, "--image-max-prompt-chars", "64")
        async with app_client(fake_deployment(tmp_path), FakePlacement(), *flags) as (client, server):
            dynamo = ModelEndpoint(server, asyncio.get_running_loop())
            for endpoint, body, request in CASES:
                http = await client.post(f"/v1/{endpoint}", json={"model": MODEL, **body})
                try:
                    replies = await dynamo.answer({"model": MODEL, **request}, Stopped())
                except OmniAPIError as exc:
                    assert http.status_code == exc.status, (body, http.text, exc.message)
                    assert http.json()["error"]["message"] == exc.message
                    continue
                assert http.status_code == 200, (body, http.text)
                if endpoint == "chat/completions":
                    (chunk,) = replies
                    got = chunk["choices"][0]["delta"]["content"][0]["image_url"]["url"]
                    want = http.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
                    np.testing.assert_array_equal(pixels(got.split(",", 1)[1]), pixels(want.split(",", 1)[1]))
                else:
                    (reply,) = replies
                    assert reply["size"] == http.json()["size"]
                    np.testing.assert_array_equal(
                        pixels(reply["data"][0]["b64_json"]), pixels(http.json()["data"][0]["b64_json"])
                    )

    asyncio.run(main())


def test_an_edit_through_dynamo_is_the_multipart_edit(tmp_path: Path) -> None:
    from vllm_omni_plugin.dynamo.roles import ModelEndpoint

    source = source_image(64)

    async def main() -> None:
        async with app_client(fake_deployment(tmp_path), FakePlacement(), "--served-model-name", MODEL) as (
            client,
            server,
        ):
            dynamo = ModelEndpoint(server, asyncio.get_running_loop())
            form = {"prompt": "make it blue", "seed": "4", "model": MODEL}
            files = [
                ("image", ("a.png", png(source), "image/png")),
                ("image", ("b.png", png(source), "image/png")),
            ]
            http = await client.post("/v1/images/edits", data=form, files=files)
            assert http.status_code == 200, http.text
            request = {"prompt": "make it blue", "model": MODEL, "input_reference": data_uri(source),
                       "nvext": {"seed": 4}, "extra_args": {"media_passthrough": {"images": [data_uri(source)]}}}  # fmt: skip
            (reply,) = await dynamo.answer(request, Stopped())
            np.testing.assert_array_equal(
                pixels(reply["data"][0]["b64_json"]), pixels(http.json()["data"][0]["b64_json"])
            )
            with pytest.raises(OmniAPIError, match="does not fetch URLs") as caught:
                await dynamo.answer({**request, "input_reference": "https://example.com/a.png"}, Stopped())
            assert caught.value.param == "input_reference"

    asyncio.run(main())


# --- without Dynamo --------------------------------------------------------------------------------


def test_nothing_imports_dynamo_until_a_role_starts() -> None:
    """No module of ours imports Dynamo at its top: only functions a role runs do."""
    package = Path(importlib.import_module("vllm_omni_plugin").__file__).parent
    modules = list((package / "dynamo").glob("*.py"))
    assert len(modules) >= 10
    offenders = []
    for path in modules:
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n == "dynamo" or n.startswith("dynamo.")]
    assert offenders == []


def test_without_the_extra_the_worker_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_omni_plugin.dynamo import cli, frontend

    monkeypatch.setitem(sys.modules, "dynamo", None)
    monkeypatch.setitem(sys.modules, "dynamo.runtime", None)
    for main in (lambda: cli.main(["/models/x", "--omni-router"]), lambda: frontend.main([])):
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
        assert "pip install 'vllm-omni-plugin[dynamo]'" in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--headless"], "--headless and --head start a worker for a `vllm serve --omni` head"),
        (["--omni-router", "--stage-id", "1"], "two roles"),
        (["--image-media-dir", "/tmp/media"], "not served under Dynamo"),
        (["--endpoint", "dyn://only.two"], "expected dyn://NAMESPACE.COMPONENT.ENDPOINT"),
        (["--omni-router", "--worker-backend", "ray"], "the stages are Dynamo stage workers"),
        (["--deploy-config", "/nonexistent.yaml"], "--deploy-config /nonexistent.yaml: no such file"),
    ],
)
def test_a_command_line_mistake_is_one_error_line_and_exit_2(
    flags: list[str], words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_omni_plugin.dynamo import cli, runtime

    monkeypatch.setattr(runtime, "require_dynamo", lambda: None)  # whether or not Dynamo is installed here
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what the command line sets, undone after
    with pytest.raises(SystemExit) as exited:
        cli.main(["/models/x", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_the_worker_takes_dynamo_flags_from_dyn_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_omni_plugin.dynamo import cli

    for key, value in {
        "DYN_NAMESPACE": "prod",
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_REQUEST_PLANE": "tcp",
    }.items():
        monkeypatch.setenv(key, value)
    settings = cli.dynamo_settings(cli.parse_args(["/models/x", "--stage-id", "1"]))
    assert (settings.namespace, settings.discovery_backend) == ("prod", "file")
    assert (
        settings.model_path == "prod.backend.generate"
        and settings.stage_path(1) == "prod.backend-stage1.generate"
    )
    given = cli.dynamo_settings(
        cli.parse_args(["/models/x", "--endpoint", "dyn://a.b.c", "--discovery-backend", "etcd"])
    )
    assert (given.model_path, given.stage_path(0), given.discovery_backend) == (
        "a.b.c",
        "a.b-stage0.c",
        "etcd",
    )
