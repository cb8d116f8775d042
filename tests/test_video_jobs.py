"""The Videos API's storage and encoding half: the MP4 codec (real PyAV), the request parser and wire types
(checked against the installed openai client), and the job store (real SQLite in a temporary directory),
including a restart on the same directory and its bounds."""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import msgspec
import numpy as np
import openai
import pytest
from openai.pagination import SyncConversationCursorPage
from openai.types import Video as OpenAIVideo
from openai.types import VideoDeleteResponse

from vllm_omni_plugin.entrypoints.errors import OmniAPIError, error_body, parse_request
from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.entrypoints.video_codec import VideoFacts, decode_mp4, encode_mp4, mp4_facts
from vllm_omni_plugin.entrypoints.video_jobs import (
    DB_NAME,
    STOPPED_CODE,
    STOPPED_MESSAGE,
    VideoJobStore,
    VideoNotFoundError,
    VideoNotReadyError,
    VideoStoreFullError,
)
from vllm_omni_plugin.entrypoints.video_protocol import (
    VideoCreateRequest,
    VideoDeleted,
    VideoLimits,
    check_limits,
    format_seconds,
)

# --- the codec -------------------------------------------------------------------------------------


def moving_square(count: int = 9, height: int = 48, width: int = 64) -> np.ndarray:
    """A gradient background with a bright square moving across it: smooth areas and sharp edges."""
    frames = np.zeros((count, height, width, 3), np.uint8)
    frames[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, None, :]
    frames[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[None, :, None]
    frames[..., 2] = 96
    for index in range(count):
        x = 4 + index * 4
        frames[index, 12:28, x : x + 16] = (250, 250, 40)
    return frames


@pytest.fixture(scope="module")
def clip() -> tuple[np.ndarray, bytes]:
    frames = moving_square()
    return frames, encode_mp4(frames, fps=8)


def test_encode_gives_an_h264_mp4_of_the_frames(clip: tuple[np.ndarray, bytes]) -> None:
    _, data = clip
    assert mp4_facts(data) == VideoFacts(width=64, height=48, frames=9, fps=8.0, codec="h264")
    assert data[4:8] == b"ftyp"
    assert 0 < data.find(b"moov") < data.find(b"mdat"), "+faststart puts the index before the media"


def test_decoded_frames_are_close_to_the_input(clip: tuple[np.ndarray, bytes]) -> None:
    frames, data = clip
    decoded = decode_mp4(data)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(np.int16) - frames.astype(np.int16)).mean() < 4.0


def test_other_frame_rates_read_back() -> None:
    data = encode_mp4(moving_square(count=3, height=32, width=32), fps=24)
    facts = mp4_facts(data)
    assert (facts.frames, facts.fps, facts.width, facts.height) == (3, 24.0, 32, 32)


@pytest.mark.parametrize(
    ("frames", "fps", "message"),
    [
        (np.zeros((2, 33, 64, 3), np.uint8), 8, "even width and height"),
        (np.zeros((2, 32, 63, 3), np.uint8), 8, "even width and height"),
        (np.zeros((2, 32, 64, 3), np.float32), 8, "uint8"),
        (np.zeros((32, 64, 3), np.uint8), 8, r"\(frames, height, width, 3\)"),
        (np.zeros((2, 32, 64, 4), np.uint8), 8, r"\(frames, height, width, 3\)"),
        (np.zeros((0, 32, 64, 3), np.uint8), 8, "at least one frame"),
        (np.zeros((2, 32, 64, 3), np.uint8), 0, "fps"),
        (np.zeros((2, 32, 64, 3), np.uint8), 2.5, "fps"),
    ],
)
def test_codec_refuses_bad_frames(frames: np.ndarray, fps: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_mp4(frames, fps)


def test_reading_what_is_no_video_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a readable video"):
        mp4_facts(b"not a video at all")


# --- the request and the wire types -----------------------------------------------------------------


def parse(**fields: Any) -> VideoCreateRequest:
    return parse_request(VideoCreateRequest, fields)


def refusal(**fields: Any) -> OmniAPIError:
    with pytest.raises(OmniAPIError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


def test_json_and_form_values_parse_alike() -> None:
    as_json = parse(
        prompt="a cat", model="m", seconds=4, size="64x48", seed=3, num_inference_steps=20,
        guidance_scale=7.5, negative_prompt="blur", fps=8,
    )  # fmt: skip
    as_form = parse(
        prompt="a cat", model="m", seconds="4", size="64x48", seed="3", num_inference_steps="20",
        guidance_scale="7.5", negative_prompt="blur", fps="8",
    )  # fmt: skip
    assert as_json == as_form
    assert (as_json.seconds, as_json.dimensions, as_json.seed, as_json.fps) == (4.0, (64, 48), 3, 8)
    assert parse(prompt="p", num_frames="33").num_frames == 33
    assert parse(prompt="p", size=" 1280 X 720 ").size == "1280x720"
    assert parse(prompt="p").dimensions is None


@pytest.mark.parametrize("size", ["12x", "0x64", "64x64x2", "64", "x64", "63x64", "wide"])
def test_bad_sizes_are_refused_naming_the_field(size: str) -> None:
    err = refusal(prompt="p", size=size)
    assert err.param == "size" and err.message.startswith("size: ") and "\n" not in err.message


@pytest.mark.parametrize("seconds", ["abc", "0", "-1", 0, "nan", "inf", True])
def test_bad_seconds_are_refused_naming_the_field(seconds: Any) -> None:
    err = refusal(prompt="p", seconds=seconds)
    assert err.param == "seconds" and err.message.startswith("seconds: ")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "p", "num_inference_steps": "0"}, "num_inference_steps"),
        ({"prompt": "p", "guidance_scale": "-1"}, "guidance_scale"),
        ({"prompt": "p", "fps": "0"}, "fps"),
        ({"prompt": "p", "fps": "7.5"}, "fps"),
        ({"prompt": "p", "num_frames": "many"}, "num_frames"),
        ({"prompt": "p", "seed": "-3"}, "seed"),
        ({"prompt": "p", "seconds": "4", "num_frames": "9"}, "num_frames"),
        ({"prompt": "p", "input_reference": {"file_id": "file_1"}}, "input_reference"),
        ({"prompt": "p", "input_reference": {"image_url": "data:,", "extra": 1}}, "input_reference"),
        ({"prompt": "p", "input_reference": 5}, "input_reference"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    err = refusal(**fields)
    assert err.param == param and param in err.message


def test_input_reference_is_file_bytes_or_an_image_url() -> None:
    assert parse(prompt="p", input_reference=b"\x89PNG").input_reference == b"\x89PNG"
    by_object = parse(prompt="p", input_reference={"image_url": "data:image/png;base64,AAAA"})
    by_text = parse(prompt="p", input_reference="data:image/png;base64,AAAA")
    assert by_object.input_reference == by_text.input_reference
    assert getattr(by_text.input_reference, "image_url", None) == "data:image/png;base64,AAAA"


def test_unknown_fields_are_refused_as_the_image_api_does() -> None:
    """Kept aside by the parser (a family setting may read them), refused by the server's settings check."""
    req = parse(prompt="p", bogus="1")
    assert req.family_fields == {"bogus": "1"}
    server = SimpleNamespace(settings=SimpleNamespace(settings_type=None, other_settings={}, pipeline="x"))
    with pytest.raises(OmniAPIError, match="unknown field 'bogus'") as info:
        OmniServer.check_settings(cast(OmniServer, server), req)
    assert (info.value.status, info.value.param) == (400, "bogus")


def test_limits_name_the_field_and_the_flag() -> None:
    limits = VideoLimits()
    check_limits(limits, width=1920, height=1080, num_frames=241, seconds=20)
    for kwargs, param, text in [
        ({"num_frames": 500}, "num_frames", "num_frames 500 exceeds --video-max-frames 241"),
        ({"width": 4096, "height": 64}, "size", "width 4096 exceeds --video-max-size 1920"),
        ({"width": 64, "height": 2000}, "size", "height 2000 exceeds --video-max-size 1920"),
        ({"seconds": 20.5}, "seconds", "seconds 20.5 exceeds --video-max-seconds 20"),
    ]:
        with pytest.raises(OmniAPIError, match=text) as info:
            check_limits(limits, **kwargs)
        assert (info.value.status, info.value.param) == (400, param)


def test_seconds_are_spelled_as_openai_does() -> None:
    assert [format_seconds(s) for s in (4, 4.0, 2.5, 1 / 3)] == ["4", "4", "2.5", "0.333"]


# --- the store -------------------------------------------------------------------------------------


def new_job(store: VideoJobStore, width: int = 64, height: int = 48, **kwargs: Any) -> str:
    kwargs = {"model": "tiny-video", "prompt": "a cat", "seconds": 1.125, "fps": 8, "frames": 9} | kwargs
    return store.create(width=width, height=height, **kwargs).id


@pytest.fixture
def store(tmp_path: Path) -> Iterator[VideoJobStore]:
    with VideoJobStore(tmp_path / "videos", VideoLimits()) as opened:
        yield opened


def mp4_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".mp4"))


def test_a_job_goes_queued_in_progress_completed(
    store: VideoJobStore, clip: tuple[np.ndarray, bytes]
) -> None:
    _, data = clip
    job = store.create(
        model="tiny-video", prompt="a cat", width=64, height=48, seconds=1.125, fps=8, frames=9,
        params={"seed": 3, "num_inference_steps": 4},
    )  # fmt: skip
    assert job.id.startswith("video_") and len(job.id) == len("video_") + 48
    assert (job.status, job.progress, job.size, job.seconds, job.params) == (
        "queued", 0, "64x48", "1.125", {"seed": 3, "num_inference_steps": 4},
    )  # fmt: skip
    started = store.start(job.id)
    assert started is not None and started.status == "in_progress"
    assert store.progress(job.id, 37.9)
    assert store.get(job.id).progress == 37
    assert store.list().data[0].progress == 37
    with pytest.raises(VideoNotReadyError, match="not ready: it is in progress \\(37%\\)") as info:
        store.content_path(job.id)
    assert info.value.status == 404
    done = store.complete(job.id, data)
    assert done is not None
    assert (done.status, done.progress, done.bytes) == ("completed", 100, len(data))
    assert done.completed_at is not None and done.completed_at >= done.created_at
    path = store.content_path(job.id)
    assert path.read_bytes() == data and mp4_facts(path.read_bytes()).frames == 9
    assert store.bytes_on_disk == len(data) and store.active_count == 0
    assert not store.progress(job.id, 50), "a finished job takes no more progress"


def test_a_failed_job_says_why(store: VideoJobStore) -> None:
    video_id = new_job(store)
    store.start(video_id)
    store.progress(video_id, 20)
    failed = store.fail(video_id, "generation_failed", "CUDA out of memory\n  at step 3")
    assert failed is not None and failed.status == "failed" and failed.progress == 20
    video = failed.video()
    assert video.error is not None
    assert (video.error.code, video.error.message) == ("generation_failed", "CUDA out of memory at step 3")
    with pytest.raises(VideoNotReadyError, match="it failed: CUDA out of memory"):
        store.content_path(video_id)
    assert store.fail(video_id, "again", "x") is None and store.complete(video_id, b"x") is None


def test_a_restarted_store_keeps_finished_videos_and_fails_unfinished_ones(
    tmp_path: Path, clip: tuple[np.ndarray, bytes]
) -> None:
    _, data = clip
    directory = tmp_path / "videos"
    first = VideoJobStore(directory, VideoLimits())
    done, running, queued = new_job(first), new_job(first), new_job(first)
    first.start(done)
    first.complete(done, data)
    first.start(running)
    first.progress(running, 60)
    with pytest.raises(RuntimeError, match="another server keeps its videos in"):
        VideoJobStore(directory, VideoLimits())
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.get(done)

    with VideoJobStore(directory, VideoLimits()) as second:
        assert [v.id for v in second.list(order="asc").data] == [done, running, queued]
        assert second.content_path(done).read_bytes() == data
        assert second.bytes_on_disk == len(data) and second.active_count == 0
        for video_id in (running, queued):
            job = second.get(video_id)
            assert (job.status, job.error_code, job.error_message) == (
                "failed",
                STOPPED_CODE,
                STOPPED_MESSAGE,
            )
            assert job.video().error is not None and job.completed_at is not None
        assert second.start(running) is None and not second.progress(queued, 5)


def test_opening_cleans_up_what_a_previous_process_left(tmp_path: Path) -> None:
    directory = tmp_path / "videos"
    with VideoJobStore(directory, VideoLimits()) as first:
        kept, lost = new_job(first), new_job(first)
        for video_id in (kept, lost):
            first.complete(video_id, b"m" * 100)
    orphan = directory / f"video_{'ab' * 24}.mp4"
    temp = directory / f".video_{'cd' * 24}.mp4.0123abcd.tmp"
    unrelated = directory / "notes.txt"
    for path in (orphan, temp, unrelated):
        path.write_bytes(b"x" * 10)
    (directory / f"{lost}.mp4").unlink()
    (directory / f"{kept}.mp4").write_bytes(b"m" * 150)  # changed behind the store's back: recounted

    with VideoJobStore(directory, VideoLimits()) as second:
        assert not orphan.exists() and not temp.exists() and unrelated.exists()
        assert mp4_files(directory) == [f"{kept}.mp4"]
        assert second.get(kept).bytes == 150 and second.bytes_on_disk == 150
        gone = second.get(lost)
        assert gone.status == "failed" and gone.error_message is not None and "missing" in gone.error_message
        with pytest.raises(VideoNotReadyError):
            second.content_path(lost)
        (directory / f"{kept}.mp4").unlink()  # gone while the server runs
        with pytest.raises(VideoNotReadyError, match="gone"):
            second.content_path(kept)
        assert second.get(kept).status == "failed" and second.bytes_on_disk == 0


def test_thousands_of_jobs_stay_bounded(tmp_path: Path) -> None:
    directory = tmp_path / "videos"
    with VideoJobStore(directory, VideoLimits(max_jobs=50, max_active=8)) as store:
        ids = []
        for index in range(2000):
            video_id = new_job(store)
            ids.append(video_id)
            if index % 10 == 0:
                store.complete(video_id, b"v" * 64)
            else:
                store.fail(video_id, "generation_failed", "no")
        assert store.count() == 50
        assert len(mp4_files(directory)) <= 50
        assert store.bytes_on_disk == 64 * len(mp4_files(directory))
        assert [v.id for v in store.list(limit=100, order="asc").data] == ids[-50:]
        with pytest.raises(VideoNotFoundError):
            store.get(ids[0])
    assert (directory / DB_NAME).stat().st_size < 1024 * 1024


def test_the_store_refuses_jobs_when_full(tmp_path: Path) -> None:
    with VideoJobStore(tmp_path / "a", VideoLimits(max_jobs=3, max_active=10)) as store:
        running = [new_job(store) for _ in range(3)]
        with pytest.raises(
            VideoStoreFullError, match="keeps at most 3 videos \\(--video-max-jobs\\)"
        ) as info:
            new_job(store)
        assert info.value.status == 429
        store.fail(running[0], "x", "y")
        new_job(store)  # the finished one makes room
        with pytest.raises(OmniAPIError):
            store.get(running[0])
    with VideoJobStore(tmp_path / "b", VideoLimits(max_active=2)) as store:
        first = new_job(store)
        store.start(new_job(store))
        with pytest.raises(VideoStoreFullError, match="--video-max-active 2") as info:
            new_job(store)
        assert info.value.status == 429
        store.complete(first, b"v")
        new_job(store)


def test_bytes_on_disk_stay_bounded(tmp_path: Path) -> None:
    directory = tmp_path / "videos"
    with VideoJobStore(directory, VideoLimits(max_bytes=2500)) as store:
        ids = [new_job(store) for _ in range(5)]
        for video_id in ids:
            store.complete(video_id, b"v" * 1000)
            assert store.bytes_on_disk <= 2500
        assert mp4_files(directory) == sorted(f"{video_id}.mp4" for video_id in ids[-2:])
        for video_id in ids[:3]:
            with pytest.raises(VideoNotFoundError):
                store.get(video_id)
        huge = new_job(store)
        failed = store.complete(huge, b"v" * 3000)
        assert failed is not None and failed.status == "failed" and failed.error_code == "video_too_large"
        assert failed.error_message is not None and "--video-max-bytes 2500" in failed.error_message
        assert len(mp4_files(directory)) == 2 and store.bytes_on_disk == 2000
    with VideoJobStore(directory, VideoLimits(max_bytes=1500)) as smaller:  # a lower bound on restart
        assert smaller.bytes_on_disk == 1000 and mp4_files(directory) == [f"{ids[-1]}.mp4"]


def test_list_pages_as_openai_does(store: VideoJobStore) -> None:
    empty = store.list()
    assert (empty.data, empty.first_id, empty.last_id, empty.has_more) == ([], None, None, False)
    ids = [new_job(store) for _ in range(7)]

    def pages(order: Literal["asc", "desc"], limit: int) -> list[list[str]]:
        out, after = [], None
        while True:
            page = store.list(after=after, limit=limit, order=order)
            out.append([v.id for v in page.data])
            assert (page.first_id, page.last_id) == (out[-1][0], out[-1][-1])
            if not page.has_more:
                return out
            after = page.last_id

    assert pages("asc", 3) == [ids[0:3], ids[3:6], ids[6:7]]
    assert pages("desc", 3) == [ids[6:3:-1], ids[3:0:-1], ids[0:1]]
    assert pages("asc", 7) == [ids]
    assert [v.id for v in store.list().data] == ids[::-1], "newest first by default"
    store.delete(ids[2])  # the cursor a client holds may be deleted: the next page still follows it
    assert [v.id for v in store.list(after=ids[2], limit=2, order="asc").data] == ids[3:5]
    assert store.list(after=ids[-1], order="asc").data == []
    for kwargs, param in [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "video_nope"}, "after"),
    ]:
        with pytest.raises(OmniAPIError) as info:
            store.list(**kwargs)
        assert (info.value.status, info.value.param) == (400, param)


def test_delete_removes_the_row_and_the_file(store: VideoJobStore) -> None:
    done = new_job(store)
    store.complete(done, b"v" * 100)
    path = store.content_path(done)
    assert store.delete(done) is False
    assert not path.exists() and store.bytes_on_disk == 0 and store.count() == 0
    for call in (store.get, store.content_path, store.delete, store.start):
        with pytest.raises(VideoNotFoundError, match="no video with id") as info:
            call(done)
        assert info.value.status == 404


def test_deleting_a_running_job_tells_the_caller_to_cancel_it(store: VideoJobStore) -> None:
    running = new_job(store)
    store.start(running)
    assert store.delete(running) is True
    assert store.active_count == 0
    assert store.progress(running, 50) is False
    assert store.complete(running, b"v" * 100) is None, "its worker's result is dropped"
    assert mp4_files(store.directory) == [] and store.count() == 0
    with pytest.raises(VideoNotFoundError):
        store.get(running)
    with pytest.raises(VideoNotFoundError):  # once its worker reported, the job is forgotten
        store.complete(running, b"v")


def test_workers_and_the_loop_share_the_store(store: VideoJobStore) -> None:
    ids = [new_job(store) for _ in range(8)]
    errors: list[BaseException] = []

    def work(video_id: str) -> None:
        try:
            store.start(video_id)
            for step in range(20):
                store.progress(video_id, step * 5)
                store.list(limit=5)
            store.complete(video_id, b"v" * 10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(video_id,)) for video_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert {store.get(video_id).status for video_id in ids} == {"completed"}


# --- what the openai client makes of it ------------------------------------------------------------


def test_video_json_validates_as_openai_types(store: VideoJobStore) -> None:
    video_id = new_job(store, width=1280, height=720)  # one of OpenAI's sizes: strict validation passes
    store.start(video_id)
    store.fail(video_id, "generation_failed", "boom")
    parsed = OpenAIVideo.model_validate_json(msgspec.json.encode(store.get(video_id).video()))
    assert (parsed.id, parsed.object, parsed.status, parsed.size, parsed.seconds) == (
        video_id, "video", "failed", "1280x720", "1.125",
    )  # fmt: skip
    assert parsed.error is not None and parsed.error.message == "boom" and parsed.prompt == "a cat"
    deleted = VideoDeleteResponse.model_validate_json(msgspec.json.encode(VideoDeleted(id=video_id)))
    assert deleted.deleted and deleted.object == "video.deleted"
    page = SyncConversationCursorPage[OpenAIVideo].model_validate_json(msgspec.json.encode(store.list()))
    assert [v.id for v in page.data] == [video_id]


def client_on(store: VideoJobStore) -> openai.OpenAI:
    """The openai client, its HTTP transport answered from the store as the routes will."""
    http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])

    def answer(request: Any) -> Any:
        parts = request.url.path.removeprefix("/v1/videos").strip("/").split("/")
        try:
            if request.method == "GET" and parts == [""]:
                query = request.url.params
                body = store.list(
                    after=query.get("after"),
                    limit=int(query.get("limit", 20)),
                    order=query.get("order", "desc"),
                )
            elif request.method == "GET" and len(parts) == 2 and parts[1] == "content":
                return http.Response(200, content=store.content_path(parts[0]).read_bytes())
            elif request.method == "GET":
                body = store.get(parts[0]).video()
            else:
                store.delete(parts[0])
                body = VideoDeleted(id=parts[0])
        except OmniAPIError as exc:
            return http.Response(exc.status, content=error_body(exc.message, exc.status, exc.param))
        return http.Response(200, content=msgspec.json.encode(body))

    transport: Callable[..., Any] = http.MockTransport(answer)
    return openai.OpenAI(
        api_key="none", base_url="http://omni/v1", http_client=openai.DefaultHttpxClient(transport=transport),
        max_retries=0,
    )  # fmt: skip


def test_the_openai_client_reads_the_store(store: VideoJobStore, clip: tuple[np.ndarray, bytes]) -> None:
    _, data = clip
    ids = [new_job(store) for _ in range(5)]  # 64x48: not one of OpenAI's sizes, and the client reads it
    store.complete(ids[1], data)
    client = client_on(store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the client marks Sora's API deprecated
        assert [v.id for v in client.videos.list(limit=2, order="asc")] == ids  # follows has_more/last_id
        video = client.videos.retrieve(ids[1])
        assert (video.status, video.size, video.progress) == ("completed", "64x48", 100)
        assert client.videos.download_content(ids[1]).content == data
        with pytest.raises(openai.NotFoundError, match="not ready"):
            client.videos.download_content(ids[0])
        assert client.videos.delete(ids[0]).deleted
        with pytest.raises(openai.NotFoundError, match="no video with id"):
            client.videos.retrieve(ids[0])
