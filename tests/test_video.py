"""Video end to end on the tiny Wan models: what the served model makes equals diffusers' own pipeline for
the same seed, and OpenAI's Videos API over it works with the official ``openai`` client.

Offline (an in-process diffusion stage): two text-to-video requests of different lengths, guidance and
seeds stepping side by side in the step loop (a hold point proves they share a step) each give the frames
``WanPipeline`` gives alone, an image-to-video request those of ``WanImageToVideoPipeline``, and a request
on Wan 2.2's two experts, run as a whole request, those of its ``WanPipeline`` (at most 1/255 apart).
Over HTTP, on one server of the tiny text-to-video Wan with small ``--video-*`` limits: a job made with
``create_and_poll`` downloads as the H.264 MP4 it says (size, frames, fps) whose frames are diffusers'
within the codec's loss; retrieve, paged list and delete work as OpenAI's; a job held at
``dit.step`` shows its progress; hostile requests are 4xx naming their field or limit; a burst of thousands
of creates is refused (429) beyond ``--video-max-active``; the store stays within ``--video-max-jobs`` and
``--video-max-bytes``; and a restarted server still lists and serves the videos it finished, while the one it
was making when it was stopped is failed. Every wait is on the server's state (hold points, polling a
job), never on the machine's speed."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni_plugin.entrypoints.video_codec import decode_mp4, encode_mp4, mp4_facts
from vllm_omni_plugin.stage.core_types import PROGRESS_REPORT_INTERVAL_S
from vllm_omni_plugin.stage.input_processor import OmniRequest
from vllm_omni_testkit.harness import http_client
from vllm_omni_testkit.harness.server import ServerProcess, bin_script, free_port
from vllm_omni_testkit.holds import Hold, HoldPoints
from vllm_omni_testkit.reference.diffusers import load_reference_pipeline

pytestmark = [
    pytest.mark.server,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # the openai client's Sora deprecation
]

WAIT_S = 120.0
"""The longest a test waits for the server to reach a state (a bound, never an expectation)."""
POLL_S = 0.05
MAX_FRAMES, MAX_SIZE, MAX_SECONDS, MAX_JOBS, MAX_ACTIVE = 33, 256, 4, 12, 3
MAX_BYTES = 100_000
"""Less than ``MAX_JOBS`` of the server's small videos (about 12 KB each): the byte bound evicts too."""
SMALL = {"size": "64x48", "num_frames": 5, "num_inference_steps": 2}
"""A cheap job (JSON fields)."""


def wan_reference(
    model: Path,
    *,
    prompt: str,
    seed: int,
    steps: int,
    frames: int,
    width: int = 64,
    height: int = 48,
    guidance: float | None = None,
    image: np.ndarray | None = None,
) -> np.ndarray:
    """diffusers' own Wan pipeline (text or image to video) for one request: uint8 (F, H, W, 3), converted as
    the runner converts (``round(frames * 255)``). ``guidance`` None: the pipeline's default."""
    import torch

    pipe = load_reference_pipeline(str(model))
    kwargs: dict[str, Any] = {}
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    if image is not None:
        kwargs["image"] = Image.fromarray(image)
    video = pipe(
        prompt=prompt,
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        generator=[torch.Generator().manual_seed(seed)],
        output_type="np",
        **kwargs,
    ).frames[0]
    return (np.asarray(video) * 255).round().astype(np.uint8)


def assert_within_one_level(made: np.ndarray, direct: np.ndarray) -> None:
    assert made.dtype == np.uint8 and made.shape == direct.shape, (made.shape, direct.shape)
    diff = np.abs(made.astype(np.int16) - direct.astype(np.int16))
    assert diff.max() <= 1, diff.max()
    assert made.std() > 10  # a video, not a constant (NaNs would come out as one)


# --- offline: the frames diffusers makes -----------------------------------------------------------------


@pytest.fixture
def in_process_holds(monkeypatch: pytest.MonkeyPatch) -> Iterator[HoldPoints]:
    """Hold points for stages running in this process (the test seam reads the environment at each
    point)."""
    holds = HoldPoints()
    for key, value in holds.env.items():
        monkeypatch.setenv(key, value)
    try:
        yield holds
    finally:
        holds.release_all()
        holds.remove()


def offline_engine(model: Path, tmp_path: Path) -> Any:
    """``Omni`` on ``model`` with its diffusion stage in this process (no stage process to start)."""
    from vllm_omni_plugin.entrypoints.omni import Omni

    deploy = tmp_path / "inline.yaml"
    deploy.write_text(
        "pipeline: diffusion\nstages:\n  - stage_id: 0\n    process: false\n    max_batch_size: 4\n"
    )
    return Omni(str(model), deploy_config=str(deploy))


def stage_has(omni: Any, request_id: str) -> bool:
    """Whether the in-process diffusion stage has ``request_id`` (queued or admitted)."""
    inbox = omni._async.pools[0].clients[0]._loop.inbox
    with inbox.lock:
        return request_id in inbox.running or any(r.request_id == request_id for r in inbox.queued)


def wait_for(done: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(POLL_S)


def test_videos_of_different_lengths_stepping_together_equal_diffusers(
    tiny_wan: Path, tmp_path: Path, in_process_holds: HoldPoints
) -> None:
    """A 9-frame request with guidance and a 17-frame one without (its own seed, prompt) share the step
    loop's steps (held after the first's first step until the second is in the stage, the next step runs
    both), and each gets the frames ``WanPipeline`` makes for it alone."""
    asks = [
        OmniRequest(prompt="a red fox running in the snow", height=48, width=64, num_inference_steps=3,
                    guidance_scale=4.0, seed=11, modality="video", num_frames=9),
        OmniRequest(prompt="waves on a beach", height=48, width=64, num_inference_steps=3,
                    guidance_scale=1.0, seed=12, modality="video", num_frames=17),
    ]  # fmt: skip
    first, second = asks
    with offline_engine(tiny_wan, tmp_path) as omni:
        assert omni._async.pools[0].clients[0]._loop.engine.batching == "loop"
        with in_process_holds.arm("dit.step") as hold:
            futures = [omni.submit(first)]
            assert hold.wait(WAIT_S).split() == [first.request_id]
            futures.append(omni.submit(second))
            wait_for(lambda: stage_has(omni, second.request_id), "the second request reached the stage")
            assert sorted(hold.next(WAIT_S).split()) == sorted(r.request_id for r in asks)  # one step, both
        results = [f.result(WAIT_S) for f in futures]
    for ask, result in zip(asks, results, strict=True):
        assert result.ok, result.error
        assert result.output.image.shape == (ask.num_frames, 48, 64, 3)
        direct = wan_reference(
            tiny_wan, prompt=ask.prompt, seed=ask.seed, steps=3, frames=ask.num_frames,
            guidance=ask.guidance_scale,
        )  # fmt: skip
        assert_within_one_level(result.output.image, direct)
    assert not np.array_equal(results[0].output.image[:9], results[1].output.image[:9])


def test_image_to_video_equals_diffusers(tiny_wan_i2v: Path, tmp_path: Path) -> None:
    source = np.random.default_rng(7).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    ask = OmniRequest(
        prompt="the fox turns its head", height=48, width=64, num_inference_steps=2, guidance_scale=3.0,
        seed=21, modality="video", num_frames=9, images=[source],
    )  # fmt: skip
    with offline_engine(tiny_wan_i2v, tmp_path) as omni:
        (result,) = omni.generate([ask])
    assert result.ok, result.error
    direct = wan_reference(
        tiny_wan_i2v, prompt=ask.prompt, seed=21, steps=2, frames=9, guidance=3.0, image=source
    )
    assert_within_one_level(result.output.image, direct)


def test_wan22_two_experts_run_as_a_whole_request_and_equal_diffusers(
    tiny_wan22: Path, tmp_path: Path
) -> None:
    """Wan 2.2's two experts (``transformer`` at timesteps >= ``boundary_ratio`` x 1000, ``transformer_2``
    below): the step loop's pieces do not run it (``WanSteps.runs`` is False), so the stage runs it as a whole
    request through ``WanPipeline`` itself, and its frames are the pipeline's alone, with guidance (the
    request's ``guidance_scale``, which the pipeline uses for both experts when ``guidance_scale_2`` is
    unset) and steps on both sides of the boundary."""
    reference = load_reference_pipeline(str(tiny_wan22))
    assert reference.transformer_2 is not None and reference.config.boundary_ratio == 0.875
    boundary = reference.config.boundary_ratio * reference.scheduler.config.num_train_timesteps
    scheduler = reference.scheduler.from_config(reference.scheduler.config)
    scheduler.set_timesteps(4)
    assert [bool(t >= boundary) for t in scheduler.timesteps] == [True, True, False, False]  # 999 900 750 500
    ask = OmniRequest(
        prompt="a paper boat on a stream", height=48, width=64, num_inference_steps=4, guidance_scale=3.5,
        seed=31, modality="video", num_frames=9,
    )  # fmt: skip
    with offline_engine(tiny_wan22, tmp_path) as omni:
        engine = omni._async.pools[0].clients[0]._loop.engine
        assert engine.batching == "loop" and not engine.step_family.one_expert
        whole: list[Any] = []  # the requests the stage ran as whole pipeline calls
        generate = engine.generate

        def recorded(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            whole.extend(requests)
            return generate(requests, *args, **kwargs)

        engine.generate = recorded
        (result,) = omni.generate([ask])
    assert result.ok, result.error
    assert [r.request_id for r in whole] == [ask.request_id]
    assert whole[0].num_frames == 9 and whole[0].guidance_scale == 3.5
    assert not engine.step_family.runs(whole[0])
    assert result.output.image.shape == (9, 48, 64, 3)
    direct = wan_reference(tiny_wan22, prompt=ask.prompt, seed=31, steps=4, frames=9, guidance=3.5)
    assert_within_one_level(result.output.image, direct)


# --- one server of the tiny text-to-video Wan -------------------------------------------------------------


def wan_server(model: Path, video_dir: Path, log_path: Path) -> ServerProcess:
    port = free_port()
    argv = [bin_script("vllm"), "serve", str(model), "--omni", "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", "tiny-wan", "--video-dir", str(video_dir),
            "--video-max-frames", str(MAX_FRAMES), "--video-max-size", str(MAX_SIZE),
            "--video-max-seconds", str(MAX_SECONDS), "--video-max-jobs", str(MAX_JOBS),
            "--video-max-active", str(MAX_ACTIVE), "--video-max-bytes", str(MAX_BYTES)]  # fmt: skip
    return ServerProcess(argv, port=port, log_path=log_path)


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


@dataclass
class Served:
    model: Path
    video_dir: Path
    logs: Path
    server: ServerProcess
    client: openai.OpenAI

    @property
    def videos_url(self) -> str:
        return self.server.base_url + "/v1/videos"

    def finished(self, video_id: str) -> Any:
        """The job once completed or failed (polled: its own pace)."""
        found: list[Any] = []

        def done() -> bool:
            found[:] = [self.client.videos.retrieve(video_id)]
            return found[0].status in ("completed", "failed")

        wait_for(done, f"video {video_id} finished")
        return found[0]

    def make(self, **fields: Any) -> Any:
        """A job of ``fields`` (JSON), completed."""
        answer = http_client.post(self.videos_url, json={"prompt": "a small video", **fields}, timeout=60)
        assert answer.status_code == 200, answer.text
        video = self.finished(answer.json()["id"])
        assert video.status == "completed", video.error
        return video


@pytest.fixture(scope="module")
def served(tiny_wan: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    video_dir = tmp_path_factory.mktemp("videos")
    logs = tmp_path_factory.mktemp("serve_wan")
    with wan_server(tiny_wan, video_dir, logs / "server.log") as server:
        server.wait_ready(timeout=300)
        yield Served(tiny_wan, video_dir, logs, server, openai_client(server))


def held_with_progress(served: Served, hold: Hold, video_id: str) -> Any:
    """The job once it is held at ``dit.step`` with its progress reported. A stage reports its steps at
    most every ``PROGRESS_REPORT_INTERVAL_S``, so the step it holds after may be reported only with a later
    one: if no progress shows while it is held for twice that long, it is let one step further (the job
    must have steps left after that one), and that step's report is due."""
    hold.wait(WAIT_S, alive=served.server.alive)

    def reported() -> bool:
        return served.client.videos.retrieve(video_id).progress > 0

    since = time.monotonic()
    while not reported():
        if time.monotonic() - since > 2 * PROGRESS_REPORT_INTERVAL_S:
            hold.next(WAIT_S, alive=served.server.alive)
            wait_for(reported, f"video {video_id}'s progress reported")
            break
        time.sleep(POLL_S)
    return served.client.videos.retrieve(video_id)


def test_a_video_made_downloaded_listed_and_deleted_with_the_openai_client(served: Served) -> None:
    """``create_and_poll`` -> an H.264 MP4 of the size, frames and fps the job says, whose frames are
    diffusers' for the same request within the codec's loss; retrieve, list (paged) and delete as OpenAI's;
    a job held at a denoising step shows its progress, and completes once released."""
    client = served.client
    before = [v.id for v in client.videos.list(limit=100)]
    video = client.videos.create_and_poll(
        prompt="a lighthouse at dusk",
        size="64x48",
        seconds="1",
        poll_interval_ms=50,
        extra_body={"seed": 3, "num_inference_steps": 2, "fps": 8},
    )
    assert (video.status, video.progress, video.size, video.error) == ("completed", 100, "64x48", None)
    assert video.model == "tiny-wan" and video.prompt == "a lighthouse at dusk"
    frames = round(float(video.seconds) * 8)
    assert frames == 9  # 1 s at 8 fps: 8 frames, rounded up to Wan's 4k+1
    mp4 = client.videos.download_content(video.id).read()
    facts = mp4_facts(mp4)
    assert (facts.width, facts.height, facts.frames, facts.fps, facts.codec) == (64, 48, frames, 8.0, "h264")
    direct = wan_reference(served.model, prompt="a lighthouse at dusk", seed=3, steps=2, frames=frames)
    # The tiny model's frames are all fine detail, which H.264's 4:2:0 chroma blurs (about 13/255 on
    # average): the served video is diffusers' frames encoded, decoding as they do once encoded alike.
    decoded = decode_mp4(mp4).astype(np.int16)
    encoded = decode_mp4(encode_mp4(direct, 8)).astype(np.int16)
    assert decoded.shape == encoded.shape == direct.shape
    assert np.abs(decoded - encoded).mean() < 1, np.abs(decoded - encoded).mean()
    assert client.videos.retrieve(video.id).model_dump() == video.model_dump()

    with served.server.hold("dit.step") as hold:
        job = client.videos.create(
            prompt="a slow sunrise", size="64x48", extra_body={"num_frames": 5, "num_inference_steps": 4}
        )
        assert job.status in ("queued", "in_progress") and job.progress == 0
        held = held_with_progress(served, hold, job.id)  # after step 1 or 2 of 4
        assert held.status == "in_progress" and 0 < held.progress < 100, held
        with pytest.raises(openai.NotFoundError) as caught:
            client.videos.download_content(job.id)
        assert "is not ready: it is in progress" in str(caught.value)
    done = served.finished(job.id)
    assert (done.status, done.progress) == ("completed", 100)

    ids = [v.id for v in client.videos.list(limit=100)]
    assert ids == [job.id, video.id, *before]  # newest first
    pages = list(client.videos.list(limit=1).iter_pages())
    assert [[v.id for v in page.data] for page in pages] == [[i] for i in ids]
    assert [page.has_more for page in pages] == [True] * (len(ids) - 1) + [False]
    assert [v.id for v in client.videos.list(limit=1, order="asc")] == ids[::-1]  # follows has_more

    deleted = client.videos.delete(job.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (job.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(job.id)
    assert [v.id for v in client.videos.list(limit=100)] == [video.id, *before]
    assert f"{video.id}.mp4" in {p.name for p in served.video_dir.glob("*.mp4")}
    assert f"{job.id}.mp4" not in {p.name for p in served.video_dir.glob("*.mp4")}


def png_bytes(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


HOSTILE: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    # (what, httpx.post's arguments, status, the error's param, what its message says)
    ("frames over the max", {"json": {"prompt": "x", "num_frames": 37}}, 400, "num_frames",
     "num_frames 37 exceeds --video-max-frames 33"),
    ("seconds over the max", {"json": {"prompt": "x", "seconds": 5}}, 400, "seconds",
     "seconds 5 exceeds --video-max-seconds 4"),
    ("seconds whose frames are over the max", {"json": {"prompt": "x", "seconds": 4, "fps": 16}}, 400,
     "seconds", "seconds 4 at 16 fps is 65 frames, over --video-max-frames 33"),
    ("the model's default length over the max", {"json": {"prompt": "x", "size": "64x48"}}, 400,
     "num_frames", "this model's default length, 81 frames, is over this server's --video-max-frames 33"),
    ("frames not 4k+1", {"json": {"prompt": "x", "size": "64x48", "num_frames": 10}}, 400, "num_frames",
     "num_frames must be 4k+1 (1, 5, 9, ...) for WanPipeline, got 10"),
    ("seconds and frames", {"json": {"prompt": "x", "seconds": 1, "num_frames": 5}}, 400, "num_frames",
     "give seconds or num_frames, not both"),
    ("size over the max", {"json": {"prompt": "x", "size": "512x48", "num_frames": 5}}, 400, "size",
     "width 512 exceeds --video-max-size 256"),
    ("size without a height", {"json": {"prompt": "x", "size": "12x"}}, 400, "size", "WIDTHxHEIGHT"),
    ("size of zero", {"json": {"prompt": "x", "size": "0x64"}}, 400, "size", "has a side under 2 pixels"),
    ("odd size", {"json": {"prompt": "x", "size": "63x48"}}, 400, "size",
     "H.264 video needs an even width and height"),
    ("size off the model's grid", {"json": {"prompt": "x", "size": "56x48", "num_frames": 5}}, 400, "size",
     "width and height must be multiples of 16"),
    ("a reference that is no image",
     {"data": {"prompt": "x"}, "files": {"input_reference": ("notes.txt", b"just some text", "text/plain")}},
     400, "input_reference", "cannot decode 'notes.txt'"),
    ("a reference for a text-to-video model",
     {"data": {"prompt": "x", "num_frames": "5"},
      "files": {"input_reference": ("a.png", png_bytes(np.zeros((48, 64, 3), np.uint8)), "image/png")}},
     400, "input_reference", "makes videos from text only; leave input_reference unset"),
    ("a body that is no JSON", {"content": b"{not json", "headers": {"content-type": "application/json"}},
     400, None, "the request body is not valid JSON"),
    ("seconds that are no number", {"json": {"prompt": "x", "seconds": "soon"}}, 400, "seconds", "seconds"),
    ("no frames per second", {"json": {"prompt": "x", "num_frames": 5, "fps": 0}}, 400, "fps", "fps"),
    ("a body that is no object", {"content": b"[1, 2]", "headers": {"content-type": "application/json"}},
     400, None, "the request body must be a JSON object"),
    ("an unknown field", {"json": {"prompt": "x", "num_frames": 5, "bogus": 1}}, 400, "bogus",
     "unknown field 'bogus'"),
    ("no prompt", {"json": {"num_frames": 5}}, 400, "prompt", "prompt"),
]  # fmt: skip


def test_hostile_requests_are_refused_naming_what_is_wrong_and_the_store_stays_bounded(
    served: Served,
) -> None:
    """Each hostile request is a 4xx naming its field or limit, before any job exists, and the server then
    serves a normal one. A burst of 2000 creates while one job is held in progress: only
    ``--video-max-active`` are queued or in progress at once, the rest 429; released, the accepted ones
    complete. Then jobs made one after another, more than ``--video-max-jobs``: the store keeps at most
    that many, and its directory holds only their MP4s, within ``--video-max-bytes``."""
    url = served.videos_url
    before = [v.id for v in served.client.videos.list(limit=100)]
    for what, request, status, param, says in HOSTILE:
        answer = http_client.post(url, timeout=60, **request)
        assert answer.status_code == status, (what, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and says in error["message"], (what, error)
    images = http_client.post(
        served.server.base_url + "/v1/images/generations", json={"prompt": "x"}, timeout=60
    )
    assert images.status_code == 400 and "send the request to /v1/videos" in images.json()["error"]["message"]
    for unknown in ("video_" + "0" * 48, "nope"):
        answer = http_client.get(f"{url}/{unknown}/content", timeout=60)
        assert answer.status_code == 404 and "no video with id" in answer.json()["error"]["message"]
    assert [v.id for v in served.client.videos.list(limit=100)] == before  # no job was made
    served.make(**SMALL, seed=1)  # still serving

    body = {"prompt": "one of thousands", **SMALL}
    with served.server.hold("dit.step") as hold:
        first = http_client.post(url, json=body, timeout=60)
        assert first.status_code == 200, first.text
        first = first.json()
        hold.wait(WAIT_S, alive=served.server.alive)
        answers = burst(url, body, 2000)
        statuses = Counter(status for status, _ in answers)
        assert statuses == {200: MAX_ACTIVE - 1, 429: 2000 - (MAX_ACTIVE - 1)}, statuses  # the held one + 2
        refusal = next(json.loads(text) for status, text in answers if status == 429)["error"]["message"]
        assert f"the most this server runs at once (--video-max-active {MAX_ACTIVE})" in refusal, refusal
        accepted = [json.loads(text)["id"] for status, text in answers if status == 200]
        for video_id in (first["id"], *accepted):
            answer = http_client.get(f"{url}/{video_id}/content", timeout=60)
            assert answer.status_code == 404 and "is not ready" in answer.json()["error"]["message"]
    for video_id in (first["id"], *accepted):
        assert served.finished(video_id).status == "completed"

    made = [served.make(**SMALL, seed=100 + k).id for k in range(MAX_JOBS + 1)]
    kept = list(served.client.videos.list(limit=100))
    assert len(kept) <= MAX_JOBS
    assert made[-1] in {v.id for v in kept}  # the newest stays
    assert all(v.status == "completed" for v in kept)
    files = {p.name: p.stat().st_size for p in served.video_dir.iterdir() if p.suffix == ".mp4"}
    assert set(files) == {f"{v.id}.mp4" for v in kept}  # the evicted jobs' files went with them
    assert sum(files.values()) <= MAX_BYTES
    assert not [p.name for p in served.video_dir.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(openai.NotFoundError):
        served.client.videos.retrieve(first["id"])  # among the oldest: evicted


def burst(url: str, body: dict[str, Any], count: int) -> list[tuple[int, str]]:
    """``count`` creates from 8 threads, each with its own connection: (status, body) of each."""
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def one(_: int) -> tuple[int, str]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=WAIT_S)
            with lock:
                clients.append(client)
        answer = client.post(url, json=body)
        return answer.status_code, answer.text

    try:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(count)))
    finally:
        for client in clients:
            client.close()


# --- last: it stops the module's server -----------------------------------------------------------------


def test_a_restarted_server_keeps_its_videos_and_fails_the_one_it_was_making(served: Served) -> None:
    """A completed job, and one held in a denoising step when the server gets SIGTERM (as ``kill`` or
    systemd stop it): a new server on the same ``--video-dir`` lists the completed one and serves the same
    MP4, and the interrupted one is failed (``server_stopped``: the clean shutdown fails what it stops),
    never left queued or in progress."""
    client, server = served.client, served.server
    finished = served.make(**SMALL, seed=41)
    mp4 = client.videos.download_content(finished.id).read()
    with server.hold("dit.step") as hold:
        held = client.videos.create(prompt="never finished", extra_body={**SMALL, "num_inference_steps": 4})
        hold.wait(WAIT_S, alive=server.alive)
        assert client.videos.retrieve(held.id).status == "in_progress"
        assert server.proc is not None
        # SIGTERM while it is held (ServerProcess.stop would release the hold first, and the job could
        # then finish before the shutdown reaches it): the server stops cleanly, the stage let go.
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(WAIT_S) == 0, server.log_text()[-3000:]
    server.stop()  # what is left of its processes, and its hold points

    with wan_server(served.model, served.video_dir, served.logs / "restarted.log") as again:
        again.wait_ready(timeout=300)
        client = openai_client(again)
        listed = {v.id: v for v in client.videos.list(limit=100)}
        assert listed[finished.id].status == "completed"
        assert client.videos.download_content(finished.id).read() == mp4
        failed = client.videos.retrieve(held.id)
        assert failed.status == "failed" and failed.error is not None, failed
        assert listed[held.id].status == "failed"
        assert failed.error.code == "server_stopped", failed.error
        assert failed.error.message == "the server stopped before this video finished"
        again_served = Served(served.model, served.video_dir, served.logs, again, client)
        assert again_served.make(**SMALL, seed=42).status == "completed"  # it makes videos again
