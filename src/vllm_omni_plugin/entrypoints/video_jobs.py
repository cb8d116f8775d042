"""The Videos API's jobs and their MP4s, kept on disk so that a restarted server still lists and serves the
videos it finished.

``VideoJobStore`` keeps one row per job in an SQLite index (``videos.sqlite3``) and each finished video as
``<id>.mp4`` beside it, both under the operator's directory, bounded by ``VideoLimits`` (jobs kept, bytes
on disk, jobs running at once). The routes create a job, run its generation in the background (``start``,
``progress``, then ``complete`` with the MP4 or ``fail``), and answer GET, list, content and DELETE from the
store. Its errors are ``OmniAPIError``\\ s, so the routes' handler answers them as OpenAI's error JSON.

It is called from the event loop and from worker threads: one connection and one lock; every query is
indexed and small, so it is cheap enough for the loop, except ``complete``, which writes the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import msgspec

from vllm_omni_plugin.entrypoints.errors import OmniAPIError
from vllm_omni_plugin.entrypoints.video_protocol import (
    FLAGS,
    Video,
    VideoError,
    VideoLimits,
    VideoList,
    VideoStatus,
    format_seconds,
)

DB_NAME = "videos.sqlite3"
LOCK_NAME = "videos.lock"
SCHEMA_VERSION = 1
STOPPED_CODE = "server_stopped"
STOPPED_MESSAGE = "the server stopped before this video finished"
MISSING_CODE = "file_missing"
TOO_LARGE_CODE = "video_too_large"
STORAGE_CODE = "storage_error"
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
MAX_ERROR_CHARS = 2000

_ID = re.compile(r"^video_([0-9a-f]{16})[0-9a-f]{32}$")
"""``video_`` + the creation time in nanoseconds (16 hex digits) + 128 random bits: ids sort as the jobs
were created (as OpenAI's, which start with their time), and a list cursor needs no lookup."""
_FILE = re.compile(r"^(video_[0-9a-f]{48})\.mp4$")
_TEMP = re.compile(r"^\.video_[0-9a-f]{48}\.mp4\.[0-9a-f]{8}\.tmp$")

_COLUMNS = (
    "id, created_at, status, progress, model, prompt, size, seconds, fps, frames, params, error_code, "
    "error_message, completed_at, bytes, file"
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    fps INTEGER NOT NULL,
    frames INTEGER NOT NULL,
    params TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    completed_at INTEGER,
    bytes INTEGER NOT NULL DEFAULT 0,
    file TEXT
);
CREATE INDEX IF NOT EXISTS videos_by_time ON videos (created_at, id);
CREATE INDEX IF NOT EXISTS videos_by_status ON videos (status, created_at, id);
"""


# --- errors ------------------------------------------------------------------------------------------


class VideoJobError(OmniAPIError):
    """A store refusal, answered as OpenAI's error JSON with ``http_status`` (the routes' handler for
    ``OmniAPIError`` does it)."""

    http_status: ClassVar[int] = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, status=self.http_status, param=param)


class VideoNotFoundError(VideoJobError):
    """No video with that id (never made, deleted, or evicted): 404."""

    http_status = 404


class VideoNotReadyError(VideoJobError):
    """The content of a video that is not completed (queued, in progress or failed): 404, as OpenAI
    answers ``GET /v1/videos/{id}/content`` before the video is ready; told apart from an unknown id by its
    class and message, not its status."""

    http_status = 404


class VideoStoreFullError(VideoJobError):
    """No room for another job: ``--video-max-active`` jobs run, or ``--video-max-jobs`` are kept and none
    has finished (429: retry later)."""

    http_status = 429


# --- records -----------------------------------------------------------------------------------------


class VideoJob(msgspec.Struct, frozen=True):
    """One job as the store keeps it (a row of ``videos.sqlite3``)."""

    id: str
    created_at: int
    status: VideoStatus
    progress: int
    model: str
    prompt: str
    size: str
    """``"WxH"``."""
    seconds: str
    """As ``Video.seconds`` spells it (``"4"``, ``"2.5"``)."""
    fps: int
    frames: int
    params: dict[str, Any] = {}
    """The request's generation extras (seed, steps, ...), as given to ``create``."""
    error_code: str | None = None
    error_message: str | None = None
    completed_at: int | None = None
    """When it completed or failed."""
    bytes: int = 0
    file: str | None = None
    """The MP4's name in the store's directory (completed jobs only)."""

    @property
    def active(self) -> bool:
        return self.status in ("queued", "in_progress")

    def video(self) -> Video:
        """The job as OpenAI's ``Video`` object."""
        error = None
        if self.status == "failed":
            error = VideoError(code=self.error_code or "failed", message=self.error_message or "failed")
        return Video(
            id=self.id,
            created_at=self.created_at,
            status=self.status,
            model=self.model,
            progress=self.progress,
            seconds=self.seconds,
            size=self.size,
            completed_at=self.completed_at,
            error=error,
            prompt=self.prompt,
        )


def _job(row: tuple[Any, ...], progress: int | None = None) -> VideoJob:
    values = list(row)
    values[10] = msgspec.json.decode(values[10]) if values[10] else {}
    if progress is not None:
        values[3] = progress
    return VideoJob(*values)


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


# --- the store ---------------------------------------------------------------------------------------


class VideoJobStore:
    """Video jobs and their MP4s under ``directory``, indexed in SQLite, bounded by ``limits``.

    One process at a time keeps a directory (an exclusive lock on ``videos.lock``). On open, what a
    previous process left is made consistent: jobs it had not finished are failed (``STOPPED_MESSAGE``),
    completed jobs whose MP4 is gone are failed, MP4s and temporary files without a row are removed, the
    bytes on disk are recounted, and the limits are enforced.

    Lifecycle calls (``start``, ``progress``, ``complete``, ``fail``) answer ``None`` (``False`` for
    ``progress``) once a job is no longer running, because a client deleted it or it finished: the worker
    stops its work. ``delete`` says whether the job was still running, so the routes cancel it.
    """

    def __init__(self, directory: Path, limits: VideoLimits) -> None:
        self.directory = Path(directory)
        self.limits = limits
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._closed = False
        self._live: dict[str, int] = {}
        """Queued and in-progress jobs of this process -> their progress (kept here only: cheap)."""
        self._cancelled: set[str] = set()
        """Running jobs a client deleted, until their worker reports their end."""
        self._bytes = 0
        self._last_ns = 0
        self._lock_fd = self._take_directory()
        try:
            self._db = sqlite3.connect(
                self.directory / DB_NAME, check_same_thread=False, isolation_level=None
            )
            try:
                self._open_schema()
                self._recover()
            except BaseException:
                self._db.close()
                raise
        except BaseException:
            os.close(self._lock_fd)
            raise

    # --- opening ---

    def _take_directory(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"another server keeps its videos in {self.directory}: give each server its own directory"
            ) from None
        return fd

    def _open_schema(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses at most the last commits
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.directory / DB_NAME} was written by a newer version of this server "
                f"(schema {version}; this one reads {SCHEMA_VERSION})"
            )
        with self._transaction():
            for statement in filter(str.strip, _SCHEMA.split(";")):
                self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _recover(self) -> None:
        """Make the directory what the index says, after a previous process (or none) used it."""
        now = int(time.time())
        with self._transaction():
            self._db.execute(
                "UPDATE videos SET status='failed', error_code=?, error_message=?, completed_at=? "
                "WHERE status IN ('queued', 'in_progress')",
                (STOPPED_CODE, STOPPED_MESSAGE, now),
            )
            kept: set[str] = set()
            total = 0
            rows = self._db.execute("SELECT id, file, bytes FROM videos WHERE status='completed'").fetchall()
            for video_id, name, size in rows:
                try:
                    actual = (self.directory / name).stat().st_size if name else None
                except OSError:
                    actual = None
                if actual is None:
                    self._mark_missing(video_id, "its MP4 file was missing when the server started")
                    continue
                if actual != size:
                    self._db.execute("UPDATE videos SET bytes=? WHERE id=?", (actual, video_id))
                kept.add(name)
                total += actual
        for entry in os.scandir(self.directory):
            if (_FILE.match(entry.name) and entry.name not in kept) or _TEMP.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        self._bytes = total
        with self._transaction():
            count = self._db.execute("SELECT COUNT(*) FROM videos").fetchone()[0]
            if count > self.limits.max_jobs:
                self._evict_finished(count - self.limits.max_jobs)
            self._enforce_bytes(keep=None)

    # --- helpers ---

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the video store is closed")

    def _row(self, video_id: str) -> tuple[Any, ...] | None:
        return self._db.execute(f"SELECT {_COLUMNS} FROM videos WHERE id=?", (video_id,)).fetchone()

    def _find(self, video_id: str) -> VideoJob:
        row = self._row(video_id)
        if row is None:
            raise VideoNotFoundError(f"no video with id {video_id!r}")
        return _job(row, self._live.get(video_id))

    def _new_id(self) -> tuple[str, int]:
        ns = max(time.time_ns(), self._last_ns + 1)
        self._last_ns = ns
        return f"video_{ns:016x}{secrets.token_hex(16)}", ns // 1_000_000_000

    def _remove(self, video_id: str, name: str | None, size: int) -> None:
        """A finished job's row and file (in the caller's transaction)."""
        self._db.execute("DELETE FROM videos WHERE id=?", (video_id,))
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
            self._bytes -= size

    def _mark_missing(self, video_id: str, message: str) -> None:
        """A completed job whose MP4 is gone fails (in the caller's transaction)."""
        self._db.execute(
            "UPDATE videos SET status='failed', error_code=?, error_message=?, bytes=0, file=NULL WHERE id=?",
            (MISSING_CODE, message, video_id),
        )

    def _evict_finished(self, count: int) -> int:
        """Removes up to ``count`` of the oldest finished jobs; how many it removed."""
        rows = self._db.execute(
            "SELECT id, file, bytes FROM videos WHERE status IN ('completed', 'failed') "
            "ORDER BY created_at, id LIMIT ?",
            (count,),
        ).fetchall()
        for video_id, name, size in rows:
            self._remove(video_id, name, size)
        return len(rows)

    def _enforce_bytes(self, keep: str | None) -> None:
        """Removes the oldest completed jobs until the MP4s fit ``max_bytes``, never ``keep``."""
        if self._bytes <= self.limits.max_bytes:
            return
        rows = self._db.execute(
            "SELECT id, file, bytes FROM videos WHERE status='completed' AND bytes > 0 AND id != ? "
            "ORDER BY created_at, id",
            (keep or "",),
        ).fetchall()
        for video_id, name, size in rows:
            if self._bytes <= self.limits.max_bytes:
                break
            self._remove(video_id, name, size)

    def _running(self, video_id: str) -> bool:
        """Whether a lifecycle call applies: the job is queued or in progress here. A deleted or finished
        job -> False (a deleted one is forgotten once its worker reports); an unknown id -> 404."""
        if video_id in self._live:
            return True
        if video_id in self._cancelled:
            return False
        if self._row(video_id) is None:
            raise VideoNotFoundError(f"no video with id {video_id!r}")
        return False

    # --- the jobs' lifecycle ---

    def create(
        self,
        *,
        model: str,
        prompt: str,
        width: int,
        height: int,
        seconds: float,
        fps: int,
        frames: int,
        params: Mapping[str, Any] | None = None,
    ) -> VideoJob:
        """A new queued job. Refused (429) when ``max_active`` jobs are queued or in progress, or when the
        store keeps ``max_jobs`` and none of them has finished; otherwise the oldest finished jobs make room.
        ``params``: the request's extras, JSON-able."""
        encoded = msgspec.json.encode(dict(params or {}))
        with self._lock:
            self._check_open()
            limits = self.limits
            self.check_room()
            video_id, created_at = self._new_id()
            with self._transaction():
                count = self._db.execute("SELECT COUNT(*) FROM videos").fetchone()[0]
                excess = count + 1 - limits.max_jobs
                if excess > 0 and self._evict_finished(excess) < excess:
                    raise VideoStoreFullError(
                        f"the server keeps at most {limits.max_jobs} videos ({FLAGS['max_jobs']}) and none "
                        "of them has finished; retry when one finishes, or delete one"
                    )
                self._db.execute(
                    f"INSERT INTO videos ({_COLUMNS}) VALUES (?, ?, 'queued', 0, ?, ?, ?, ?, ?, ?, ?, "
                    "NULL, NULL, NULL, 0, NULL)",
                    (
                        video_id,
                        created_at,
                        model,
                        prompt,
                        f"{width}x{height}",
                        format_seconds(seconds),
                        fps,
                        frames,
                        encoded.decode(),
                    ),
                )
            self._live[video_id] = 0
            return self._find(video_id)

    def check_room(self) -> None:
        """Refuse (429) a new job while ``max_active`` are queued or in progress: asked before a request's
        work (its checks, its image's decode), so a flood of creates costs little; :meth:`create` asks
        again, under the same lock as its insert."""
        with self._lock:
            active = len(self._live)
            if active >= self.limits.max_active:
                raise VideoStoreFullError(
                    f"{active} videos are queued or in progress, the most this server runs at once "
                    f"({FLAGS['max_active']} {self.limits.max_active}); retry when one finishes"
                )

    def start(self, video_id: str) -> VideoJob | None:
        """Queued -> in progress; ``None``: the job is no longer running (deleted or finished)."""
        with self._lock:
            self._check_open()
            if not self._running(video_id):
                return None
            with self._transaction():
                self._db.execute(
                    "UPDATE videos SET status='in_progress', progress=? WHERE id=?",
                    (self._live[video_id], video_id),
                )
            return self._find(video_id)

    def progress(self, video_id: str, percent: float) -> bool:
        """The job's progress, 0-100 (clamped), kept in memory (SQLite gets it with the next state change):
        cheap enough to call at every step. ``False``: the job is no longer running, stop its work."""
        with self._lock:
            if video_id not in self._live:
                return False
            if not math.isnan(percent):
                self._live[video_id] = max(0, min(100, int(percent)))
            return True

    def complete(self, video_id: str, mp4: bytes) -> VideoJob | None:
        """The job's MP4, written atomically (a temporary file renamed), then its row completed; the oldest
        completed jobs then go until the MP4s fit ``max_bytes``. An MP4 that alone exceeds it fails the job
        instead. Writes the file in the calling thread (call it off the event loop). ``None``: the job is no
        longer running (deleted, also while its file was written, which is then removed)."""
        size = len(mp4)
        with self._lock:
            self._check_open()
            if not self._running(video_id):
                self._cancelled.discard(video_id)
                return None
            if size > self.limits.max_bytes:
                return self.fail(
                    video_id,
                    TOO_LARGE_CODE,
                    f"the video is {size} bytes, more than this server keeps "
                    f"({FLAGS['max_bytes']} {self.limits.max_bytes})",
                )
        name = f"{video_id}.mp4"
        path = self.directory / name
        temp = self.directory / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(mp4)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return self.fail(video_id, STORAGE_CODE, f"the server could not store the video: {exc}")
        with self._lock:
            if self._closed or video_id not in self._live:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                self._cancelled.discard(video_id)
                return None
            with self._transaction():
                self._db.execute(
                    "UPDATE videos SET status='completed', progress=100, completed_at=?, bytes=?, file=? "
                    "WHERE id=?",
                    (int(time.time()), size, name, video_id),
                )
                del self._live[video_id]
                self._bytes += size
                self._enforce_bytes(keep=video_id)
            return self._find(video_id)

    def fail(self, video_id: str, code: str, message: str) -> VideoJob | None:
        """The job failed: ``code`` (machine-readable, e.g. ``"generation_failed"``) and ``message`` (made
        one line) are its ``Video.error``. ``None``: the job is no longer running."""
        with self._lock:
            self._check_open()
            if not self._running(video_id):
                self._cancelled.discard(video_id)
                return None
            with self._transaction():
                self._db.execute(
                    "UPDATE videos SET status='failed', progress=?, error_code=?, error_message=?, "
                    "completed_at=? WHERE id=?",
                    (self._live[video_id], code, _one_line(message), int(time.time()), video_id),
                )
            del self._live[video_id]
            return self._find(video_id)

    # --- reading and deleting ---

    def get(self, video_id: str) -> VideoJob:
        """The job, with its newest progress; an unknown id -> 404."""
        with self._lock:
            self._check_open()
            return self._find(video_id)

    def list(
        self,
        after: str | None = None,
        limit: int = DEFAULT_LIST_LIMIT,
        order: Literal["asc", "desc"] = "desc",
    ) -> VideoList:
        """One page of jobs by creation (``created_at``, then id), newest first unless ``order="asc"``;
        ``after``: the id the previous page ended with (it may have been deleted since: ids carry their
        creation time, so the cursor needs no row)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise OmniAPIError(f"limit must be from 1 to {MAX_LIST_LIMIT}, got {limit!r}", param="limit")
        if order not in ("asc", "desc"):
            raise OmniAPIError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        where, args = "", []
        if after is not None:
            match = _ID.match(after)
            if match is None:
                raise OmniAPIError(f"after: {after!r} is not a video id", param="after")
            created_at = int(match.group(1), 16) // 1_000_000_000
            where = f"WHERE (created_at, id) {'>' if order == 'asc' else '<'} (?, ?)"
            args = [created_at, after]
        direction = "ASC" if order == "asc" else "DESC"
        with self._lock:
            self._check_open()
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM videos {where} ORDER BY created_at {direction}, id {direction} "
                "LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
            jobs = [_job(row, self._live.get(row[0])) for row in rows[:limit]]
        data = [job.video() for job in jobs]
        return VideoList(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=len(rows) > limit,
        )

    def content_path(self, video_id: str) -> Path:
        """The MP4 of a completed job. An unknown id -> ``VideoNotFoundError``; a job that is not completed
        -> ``VideoNotReadyError``: both 404, as OpenAI answers content that is not ready. A completed job
        whose file is gone is failed, and not ready."""
        with self._lock:
            self._check_open()
            job = self._find(video_id)
            if job.status != "completed" or not job.file:
                detail = f"it is {job.status.replace('_', ' ')}"
                if job.status == "failed":
                    detail = f"it failed: {job.error_message}"
                elif job.active:
                    detail += f" ({job.progress}%)"
                raise VideoNotReadyError(f"video {video_id!r} is not ready: {detail}")
            path = self.directory / job.file
            if not path.is_file():
                message = "its MP4 file is gone from the server's video directory"
                with self._transaction():
                    self._mark_missing(video_id, message)
                    self._bytes -= job.bytes
                raise VideoNotReadyError(f"video {video_id!r} is not ready: it failed: {message}")
            return path

    def delete(self, video_id: str) -> bool:
        """Removes the job's row and MP4 (an unknown id -> 404). Returns whether it was still queued or in
        progress: then the caller cancels its generation, and the store ignores what its worker reports
        (the lifecycle calls answer ``None``/``False``)."""
        with self._lock:
            self._check_open()
            row = self._db.execute("SELECT file, bytes FROM videos WHERE id=?", (video_id,)).fetchone()
            if row is None:
                raise VideoNotFoundError(f"no video with id {video_id!r}")
            with self._transaction():
                self._remove(video_id, row[0], row[1])
            running = self._live.pop(video_id, None) is not None
            if running:
                self._cancelled.add(video_id)
            return running

    # --- the store ---

    @property
    def bytes_on_disk(self) -> int:
        """The completed jobs' MP4 bytes."""
        return self._bytes

    @property
    def active_count(self) -> int:
        """Jobs queued or in progress."""
        return len(self._live)

    def count(self) -> int:
        """Jobs kept, finished or not."""
        with self._lock:
            self._check_open()
            return self._db.execute("SELECT COUNT(*) FROM videos").fetchone()[0]

    def close(self) -> None:
        """Closes the index and frees the directory; jobs still running are failed at the next open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._db.close()
            finally:
                os.close(self._lock_fd)

    def __enter__(self) -> VideoJobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
