"""MP4 bytes for the Videos API: generated frames -> H.264 (``libx264``, ``yuv420p``) in an MP4 that streams
(its index first, ``+faststart``), and the facts and frames read back from one, with PyAV (whose wheels
bundle FFmpeg with libx264).

FFmpeg's ``+faststart`` moves the index by re-reading the finished file, so encoding goes through a file in
a temporary directory, not an in-memory buffer (it fails there).
"""

from __future__ import annotations

import io
import os
import tempfile
from fractions import Fraction

import av
import msgspec
import numpy as np

DEFAULT_CRF = 12
"""libx264's constant-rate factor: 0 is lossless, 23 its default; 12 is visually lossless, so a video
differs from its frames by little more than the RGB -> YUV 4:2:0 conversion."""


class VideoFacts(msgspec.Struct, frozen=True):
    """What an MP4 holds, read back by decoding it (tests and the routes' checks trust no header)."""

    width: int
    height: int
    frames: int
    fps: float
    codec: str


def check_frames(frames: np.ndarray, fps: int) -> None:
    """Refuse what H.264 in 4:2:0 cannot hold, before any encoding: one clear line each."""
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be a numpy array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 RGB, got dtype {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be shaped (frames, height, width, 3), got {frames.shape}")
    count, height, width = frames.shape[:3]
    if count == 0:
        raise ValueError("frames is empty: a video needs at least one frame")
    if height == 0 or width == 0:
        raise ValueError(f"frames are {width}x{height}: both sides must be at least 2 pixels")
    if height % 2 or width % 2:
        raise ValueError(f"frames are {width}x{height}: H.264 in yuv420p needs an even width and height")
    if isinstance(fps, bool) or not isinstance(fps, int | np.integer) or fps < 1:
        raise ValueError(f"fps must be a whole number of at least 1, got {fps!r}")


def encode_mp4(frames: np.ndarray, fps: int, *, crf: int = DEFAULT_CRF) -> bytes:
    """uint8 ``(F, H, W, 3)`` RGB frames at ``fps`` -> the bytes of an H.264 MP4 that starts playing before
    it is all downloaded (``+faststart``)."""
    check_frames(frames, fps)
    count, height, width = frames.shape[:3]
    rate = Fraction(int(fps), 1)
    with tempfile.TemporaryDirectory(prefix="omni-video-") as workdir:
        path = os.path.join(workdir, "video.mp4")
        with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=rate, options={"crf": str(crf), "preset": "medium"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for index in range(count):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frames[index]), format="rgb24")
                frame.pts, frame.time_base = index, 1 / rate
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))
        with open(path, "rb") as f:
            return f.read()


def _open(data: bytes) -> av.container.InputContainer:
    try:
        container = av.open(io.BytesIO(data), "r")
    except (av.FFmpegError, ValueError) as exc:
        raise ValueError(f"not a readable video ({exc})") from None
    if not container.streams.video:
        container.close()
        raise ValueError("the file has no video stream")
    return container


def mp4_facts(data: bytes) -> VideoFacts:
    """An MP4's size, frame count (by decoding every frame), frame rate (the stream's average) and codec."""
    with _open(data) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        rate = stream.average_rate or stream.guessed_rate or 0
        return VideoFacts(
            width=stream.codec_context.width,
            height=stream.codec_context.height,
            frames=frames,
            fps=float(rate),
            codec=stream.codec_context.name,
        )


def decode_mp4(data: bytes) -> np.ndarray:
    """An MP4 -> its frames, uint8 ``(F, H, W, 3)`` RGB."""
    with _open(data) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError("the video has no frames")
    return np.stack(frames)
