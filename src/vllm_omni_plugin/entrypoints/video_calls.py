"""OpenAI's Videos API over the deployment: ``VideoService`` turns a create request into a job of the store
(``video_jobs.py``) and runs it in the background through the same runtime as every other request (the
input processor completes and checks it, the diffusion stage batches it), reporting the denoising steps as
the job's progress, then encodes the frames as MP4 (``video_codec.py``) beside the event loop.

A job's request runs while the server does: a job deleted while it runs is aborted in its stage; one the
server stops before it finished is failed as it stops (or, after a kill, by the next start: the store's
recovery), with code ``server_stopped``, never left queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.image_codec import decode_data_uri, decode_image
from vllm_omni_plugin.entrypoints.omni_server import OmniServer
from vllm_omni_plugin.entrypoints.video_codec import encode_mp4
from vllm_omni_plugin.entrypoints.video_jobs import STOPPED_CODE, STOPPED_MESSAGE, VideoJob, VideoJobStore
from vllm_omni_plugin.entrypoints.video_protocol import VideoCreateRequest, VideoLimits, check_limits
from vllm_omni_plugin.log import get_logger
from vllm_omni_plugin.stage.input_processor import OmniCoreRequest, OmniRequest, RequestBounds
from vllm_omni_plugin.stage.request_events import DenoiseProgress, RequestEvent

logger = get_logger(__name__)

ENDPOINT = "videos"
PROGRESS_DENOISED = 95
"""The progress a job shows once its frames are denoised (decoding and encoding are the rest)."""


def default_video_dir() -> Path:
    """Where jobs are kept when ``--video-dir`` names no directory: the user's data directory."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "vllm-omni" / "videos"


def frames_for(seconds: float, fps: int, step: int) -> int:
    """The frame count a duration asks for on a model whose counts are ``k * step + 1``: at least
    ``seconds * fps`` frames (the nearest count of the model's form at or above it)."""
    wanted = max(1, math.ceil(seconds * fps - 1e-9))
    return (max(0, wanted - 1) + step - 1) // step * step + 1


class VideoService:
    """The Videos API of one server: its store, its limits and the jobs running now."""

    def __init__(
        self, server: OmniServer, store: VideoJobStore, limits: VideoLimits, *, default_fps: int
    ) -> None:
        self.server = server
        self.store = store
        self.limits = limits
        self.default_fps = default_fps
        self._running: dict[str, asyncio.Task[None]] = {}
        self._stopping = False

    @property
    def frame_step(self) -> int:
        """The served model's frames per latent frame (0: it makes images, not videos)."""
        return self.server.omni.inputs.frame_step

    async def create(
        self, req: VideoCreateRequest, reference: Callable[[], Awaitable[Any]] | None
    ) -> VideoJob:
        """A checked request as a new queued job, its generation started; every refusal (a bad field, a
        limit, a full store) comes before the job exists. ``reference``: reads the uploaded
        ``input_reference`` image."""
        server = self.server
        self.store.check_room()
        model = server.check_model(req.model)
        server.check_prompts(req.prompt, req.negative_prompt)
        server.check_settings(req)  # unknown fields are refused as by the Images API
        for name, value in (("lora", req.lora), ("cache", req.cache)):
            if value is not None:
                raise OmniAPIError(f"{name} is not supported by /v1/videos; leave it unset", param=name)
        server.check_steps(req.num_inference_steps)
        fps = req.fps or self.default_fps
        frames = req.num_frames
        if req.seconds is not None:
            check_limits(self.limits, seconds=req.seconds)
            frames = frames_for(req.seconds, fps, self.frame_step)
            if frames > self.limits.max_frames:
                raise OmniAPIError(
                    f"seconds {req.seconds:g} at {fps} fps is {frames} frames, over --video-max-frames "
                    f"{self.limits.max_frames}: ask for a shorter video or a lower fps",
                    param="seconds",
                )
        size = req.dimensions
        if size is not None:
            check_limits(self.limits, width=size[0], height=size[1])
        if frames is not None:
            check_limits(self.limits, num_frames=frames)
        images = []
        if req.input_reference is not None:
            if reference is not None:
                images.append(await reference())
            else:
                url = getattr(req.input_reference, "image_url", None)
                images.append(
                    await asyncio.to_thread(decode_data_uri, str(url), server.limits, "input_reference")
                )
        self._check_reference(bool(images))
        width, height = size or (None, None)
        request = OmniRequest(
            prompt=req.prompt,
            height=height,
            width=width,
            num_inference_steps=req.num_inference_steps,
            guidance_scale=req.guidance_scale,
            seed=req.seed,
            negative_prompt=req.negative_prompt,
            images=images,
            modality="video",
            num_frames=frames,
            priority=req.priority,
        )
        bounds = RequestBounds(max_side=self.limits.max_side, max_frames=self.limits.max_frames)
        (core,) = await server.prepare([request], {"source": "input_reference"}, bounds)
        assert core.num_frames is not None and core.width is not None and core.height is not None
        seconds = core.num_frames / fps
        check_limits(self.limits, num_frames=core.num_frames, seconds=seconds)
        params = {
            k: v
            for k, v in (
                ("seed", req.seed),
                ("num_inference_steps", core.num_inference_steps),
                ("guidance_scale", core.guidance_scale),
                ("negative_prompt", req.negative_prompt),
                ("num_frames", core.num_frames),
                ("input_reference", bool(images)),
            )
            if v is not None
        }
        job = self.store.create(
            model=model, prompt=req.prompt, width=core.width, height=core.height, seconds=seconds, fps=fps,
            frames=core.num_frames, params=params,
        )  # fmt: skip
        task = asyncio.create_task(self._run(job, core), name=f"video {job.id}")
        self._running[job.id] = task
        task.add_done_callback(lambda _: self._running.pop(job.id, None))
        return job

    async def _run(self, job: VideoJob, core: OmniCoreRequest) -> None:
        """The job's request through the deployment, its progress from the denoising steps, its frames
        encoded and kept; a failure fails the job with the message its client would have got."""
        store = self.store

        def on_event(event: RequestEvent) -> None:
            if isinstance(event, DenoiseProgress) and event.total:
                store.progress(job.id, PROGRESS_DENOISED * event.steps / event.total)

        if store.start(job.id) is None:
            return
        request = dataclasses.replace(core, on_event=on_event)
        try:
            result = await self.server.omni.generate(request)
            if store.progress(job.id, PROGRESS_DENOISED) is False:
                return
            try:
                self.server.finish(ENDPOINT, [result])
            except OmniAPIError as exc:
                store.fail(job.id, "generation_failed", f"{exc.message} (HTTP {exc.status})")
                return
            frames = result.output.image
            fps = job.fps
            mp4 = await asyncio.to_thread(encode_mp4, frames, fps)
            await asyncio.to_thread(store.complete, job.id, mp4)
        except asyncio.CancelledError:
            if self._stopping:
                store.fail(job.id, STOPPED_CODE, STOPPED_MESSAGE)
            raise
        except Exception as exc:  # ours: logged with its traceback, the job failed with its summary
            logger.exception("video %s failed", job.id)
            store.fail(job.id, "internal_error", f"{type(exc).__name__}: {exc}")

    def _check_reference(self, given: bool) -> None:
        """An ``input_reference`` where the model starts from an image, and only there."""
        facts, label = self.server.omni.inputs.facts, self.server.omni.inputs.model_label
        if given and (facts is None or not facts.takes_images):
            raise OmniAPIError(
                f"videos: this model ({label}) makes videos from text only; leave input_reference unset",
                param="input_reference",
            )
        if not given and facts is not None and facts.needs_images:
            raise OmniAPIError(
                f"videos: this model ({label}) makes a video from an image: send it as input_reference",
                param="input_reference",
            )

    def delete(self, video_id: str) -> None:
        """Remove a job and its video; a running one is aborted in every stage."""
        if self.store.delete(video_id):
            task = self._running.get(video_id)
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        """Abort the running jobs (the store fails them) and close the store."""
        self._stopping = True
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.store.close()


def read_reference(server: OmniServer, blob: bytes, name: str | None) -> Any:
    """An uploaded ``input_reference`` as uint8 HxWx3 (the Images API's upload limits)."""
    return decode_image(blob, server.limits, "input_reference", name)
