"""The API server in-process on vLLM's ``build_app``, over the real runtime (``AsyncOmni``, orchestrator,
replica pools) whose replicas are ``FakeStageClient``s: clients that implement ``StageCoreClientBase``
and nothing more. What needs no real stages: response_format=url and the media route, ``--api-key``,
how a failure maps to a status, health, metrics, and the whole serve-until-SIGINT lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from helpers import FakePlacement, app_client, fake_deployment, our_segments
from vllm_omni_plugin import compat
from vllm_omni_plugin.entrypoints.api_server import bind_socket, build_api_app, serve
from vllm_omni_plugin.entrypoints.cli import build_parser
from vllm_omni_plugin.entrypoints.omni_server import OmniServer, settings_from_args
from vllm_omni_plugin.stage.async_omni import AsyncOmni
from vllm_omni_plugin.stage.core_client import StageState
from vllm_omni_plugin.stage.errors import StageDeadError, StageError, StageRequestError
from vllm_omni_testkit.harness.server import free_port

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "fake-image"


def parse(*flags: str) -> Any:
    return build_parser().parse_args(
        ["serve", "/models/fake", "--omni", "--served-model-name", MODEL, *flags]
    )


def running(
    tmp_path: Path, placement: FakePlacement | None = None, media_dir: Path | None = None
) -> contextlib.AbstractAsyncContextManager[tuple[httpx.AsyncClient, OmniServer]]:
    """The app over a started runtime of fake replicas, and an HTTP client of it."""
    media = ["--image-media-dir", str(media_dir)] if media_dir else []
    flags = ("--served-model-name", MODEL, "--api-key", KEY, *media)
    return app_client(fake_deployment(tmp_path), placement or FakePlacement(), *flags)


def test_response_format_url_serves_the_image_from_the_media_dir(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()  # run_server makes it

    async def main() -> None:
        async with running(tmp_path, media_dir=media) as (client, _):
            body = {"prompt": "a cat", "size": "96x64", "response_format": "url", "n": 2}
            response = await client.post("/v1/images/generations", json=body, headers=AUTH)
            assert response.status_code == 200, response.text
            urls = [item["url"] for item in response.json()["data"]]
            assert len(urls) == 2 and all(u.startswith("http://omni.test/media/") for u in urls)
            image = await client.get(
                urls[0].removeprefix("http://omni.test")
            )  # no key: the name is the secret
            assert image.status_code == 200 and image.headers["content-type"] == "image/png"
            assert Image.open(io.BytesIO(image.content)).size == (96, 64)
            assert (await client.get("/media/../etc.png")).status_code == 404

    asyncio.run(main())
    assert len(list(media.iterdir())) == 2


def test_api_key_guards_v1_but_not_health(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (client, _):
            assert (await client.post("/v1/images/generations", json={"prompt": "a cat"})).status_code == 401
            assert (await client.get("/v1/models")).status_code == 401
            assert (await client.get("/v1/models", headers=AUTH)).json()["data"][0]["id"] == MODEL
            assert (await client.get("/health")).status_code == 200

    asyncio.run(main())


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (StageDeadError("stage 1 (dit) has no healthy replica", stage_id=1, where="unsent"), 503),
        (StageDeadError("stage 1 (dit) replica 0 died", stage_id=1), 500),
        (StageError("the DiT ran out of memory", stage_id=1), 500),
        (StageRequestError("the DiT cannot draw 16x16", stage_id=1), 400),
        (RuntimeError("a processor bug"), 500),
        (ValueError("the prompt is too long for max_model_len"), 400),
    ],
)
def test_failures_map_to_statuses_by_type_without_tracebacks(
    tmp_path: Path, exc: Exception, status: int
) -> None:
    def fail(request: Any) -> Any:
        raise exc

    async def main() -> httpx.Response:
        async with running(tmp_path, FakePlacement({1: fail})) as (client, _):
            return await client.post("/v1/images/generations", json={"prompt": "a cat"}, headers=AUTH)

    response = asyncio.run(main())
    assert response.status_code == status
    error = response.json()["error"]
    shown = str(exc) if isinstance(exc, StageError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, StageDeadError) and exc.where == "unsent":  # run again once (max_retries 1)
        shown = f"stage replicas died 2 time(s) while serving this request, more than its max_retries (1) allows; last: {exc}"
    elif isinstance(exc, StageDeadError):  # run again once, alone, and failed as the culprit
        shown = (
            "stage 1's process died while running this request alone, after the batch it ran in had died "
            "too (2 deaths, max_retries 1); it is not run again, so that it cannot take other requests "
            "down (the server log names it)"
        )
    assert error["code"] == status and error["message"] == shown and "Traceback" not in response.text


def test_health_is_503_with_the_stage_states_while_a_stage_is_down(tmp_path: Path) -> None:
    placement = FakePlacement()

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with running(tmp_path, placement) as (client, _):
            healthy = await client.get("/health")
            placement.clients[1][0].state = StageState.RESTARTING
            return healthy, await client.get("/health")

    healthy, down = asyncio.run(main())
    assert healthy.status_code == 200 and healthy.json()["status"] == "ok"
    assert healthy.json()["stages"]["1"]["replicas"][0]["pid"] == 10_010  # the fake replica's process
    assert down.status_code == 503
    body = down.json()
    assert body["status"] == "unavailable"
    assert body["stages"]["0"]["healthy"] is True and body["stages"]["1"]["healthy"] is False
    assert body["stages"]["1"]["replicas"][0]["state"] == "restarting"


def test_vllm_routes_needing_a_text_engine_are_gone(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (client, _):
            assert (await client.get("/version")).status_code == 200

    asyncio.run(main())
    deployment, args = fake_deployment(tmp_path), parse()
    app = build_api_app(args, OmniServer(AsyncOmni(deployment), settings_from_args(args, deployment)))
    paths = {getattr(r, "path", None) for r in app.router.routes}
    assert {"/tokenize", "/detokenize", "/load", "/ping", "/invocations"}.isdisjoint(paths)
    assert {
        "/metrics",
        "/version",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/chat/completions",
    } <= paths


def test_serve_health_metrics_and_shutdown_with_fake_replicas(tmp_path: Path) -> None:
    """``serve`` end to end in this process: stages start, requests and scrapes are answered, SIGINT
    drains and stops every replica and connector. The replicas implement only ``StageCoreClientBase``."""
    deployment = fake_deployment(tmp_path)
    placement = FakePlacement()
    port = free_port()
    args = parse("--host", "127.0.0.1", "--port", str(port))
    address, sock = bind_socket(args)
    # inherited by every connection: a response goes out at once, not after the client's delayed ACK
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    seen: dict[str, Any] = {}

    async def client_side() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            seen["health"] = (await http.get("/health")).json()
            image = await http.post("/v1/images/generations", json={"prompt": "a fox", "size": "32x32"})
            seen["image"] = image.status_code
            seen["metrics"] = (await http.get("/metrics")).text
            seen["restart_before"] = [c.restart_on_death for cs in placement.clients.values() for c in cs]
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does; serve's handlers take it

    async def main() -> None:
        clients = asyncio.ensure_future(client_side())
        await serve(args, deployment, sock, address, placement=placement)
        await clients

    asyncio.run(main())
    assert seen["image"] == 200
    assert seen["health"]["status"] == "ok"
    assert [r["pid"] for r in seen["health"]["stages"]["0"]["replicas"]] == [10_000]
    metrics = seen["metrics"]
    assert 'omni_stage_healthy_replicas{name="dit",stage="1"} 1.0' in metrics
    assert 'omni_stage_latency_seconds_count{name="dit",stage="1"} 1.0' in metrics
    assert 'omni_images_generated_total{endpoint="images/generations"} 1.0' in metrics
    assert 'omni_diffusion_denoise_steps_total{name="dit",stage="1"} 0.0' in metrics  # fakes run no steps
    assert 'omni_diffusion_denoise_steps_total{name="ar"' not in metrics
    assert 'omni_connector_bytes_total{connector="shared_memory",direction="put"}' in metrics
    stopped = [c for cs in placement.clients.values() for c in cs]
    assert seen["restart_before"] == [True, True]
    assert all(c.state == StageState.STOPPED and c.shutdowns == 1 for c in stopped)
    assert not any(c.restart_on_death for c in stopped)  # a replica dying during shutdown stays down
    assert our_segments({os.getpid()}) == []
    registry = compat.resolve("get_prometheus_registry")()
    assert "omni_stage_healthy_replicas" not in {m.name for m in registry.collect()}  # unregistered
