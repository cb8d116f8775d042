"""Where a serving process keeps its IPC endpoints: one runtime directory of its own, gone with it.

vLLM names each ZMQ endpoint ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>`` (seven socket files per AR engine start:
the engine core's, its workers', their message queues') and writes its gloo rendezvous files into the
temp directory; a process that dies before closing them leaves them, and a long-running service would
collect seven more at every restart. So every endpoint of a deployment lives in the runtime directory of
the process that serves it, ``<base>/vllm-omni-<pid>-<start ticks, hex>`` (base: ``$XDG_RUNTIME_DIR``
where set, else the temp directory, ``$TMPDIR``; names stay short, as a unix socket's path may not pass
107 bytes):

- each AR replica's engine starts with ``VLLM_RPC_BASE_PATH`` and ``TMPDIR`` naming a subdirectory of its
  own (:func:`engine_dir`, :func:`engine_env`), emptied before every start (a restart leaves no
  predecessor's endpoints) and removed when the replica stops; torch's compile cache stays where it was
  (``TORCHINDUCTOR_CACHE_DIR``), a cache being meant to outlive the process;
- the diffusion clients' sockets live in the directory itself;
- the directory goes when the process exits, and a start sweeps the directories of serving processes
  that are gone (a SIGKILLed group), never one whose process still runs (another server beside it);
- an engine's directory also lists the ``/dev/shm`` segments its processes mapped once it was ready
  (vLLM's ``psm_*`` message queues, which a SIGKILLed group leaves with nobody to unlink them): the sweep
  removes those that no live process maps, and the multiprocessing semaphores nobody maps
  (:func:`release_orphaned_semaphores`).
"""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import re
import shutil
import tempfile

from vllm_omni_plugin.processes import SHM_DIR, ProcessId, unlink_segment, unmapped

PREFIX = "vllm-omni-"
SEGMENTS_FILE = "segments"
"""In an engine's directory: the shared-memory segments its processes mapped, one name a line."""
SEMAPHORE_PREFIX = "sem.mp-"
"""Python multiprocessing's named semaphores in ``/dev/shm`` (``sem.`` + ``mp-`` + random)."""
_NAME = re.compile(r"^vllm-omni-(\d+)-([0-9a-f]+)$")
_current: str | None = None


SOCKET_PATH_MAX = 107
"""The longest path a unix socket may have (``sun_path`` holds 108 bytes with the final NUL)."""
NESTED_ROOM = len("/vllm-omni-4194304-ffffffff/ar99-99/") + 36
"""What the runtime directory, an engine's directory and vLLM's uuid4 endpoint name add to the base."""


def runtime_base() -> str:
    """``$XDG_RUNTIME_DIR``, else the temp directory; ``/tmp`` where either is too long for the endpoints
    nested in it (vLLM's alone would fit)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    if len(base) + NESTED_ROOM > SOCKET_PATH_MAX and os.path.isdir("/tmp"):
        return "/tmp"
    return base


def runtime_dir() -> str:
    """This process's runtime directory (made on first use, after sweeping dead processes' ones)."""
    global _current
    if _current is None or not os.path.isdir(_current):
        me = ProcessId.of(os.getpid())
        start = me.start if me is not None else 0
        sweep_dead_runtime_dirs()
        path = os.path.join(runtime_base(), f"{PREFIX}{os.getpid()}-{start:x}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        if _current is None:
            atexit.register(remove_runtime_dir)
        _current = path
    return _current


def engine_dir(name: str) -> str:
    """An empty subdirectory ``name`` of the runtime directory for one engine's endpoints (whatever an
    earlier engine of that name left there is stale: its processes are gone before a restart)."""
    path = os.path.join(runtime_dir(), name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    return path


def engine_env(path: str) -> dict[str, str]:
    """What an engine started with its endpoints in ``path`` gets in its environment."""
    env = {"VLLM_RPC_BASE_PATH": path, "TMPDIR": path}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # torch's own default, under the temp directory
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return env


def note_segments(path: str, names: set[str]) -> None:
    """Record the segments the engine whose directory is ``path`` maps, for a sweep after a SIGKILL."""
    with open(os.path.join(path, SEGMENTS_FILE), "w") as f:
        f.write("".join(f"{name}\n" for name in sorted(names)))


def remove_engine_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_runtime_dir() -> None:
    """At exit: this process's runtime directory and everything in it."""
    global _current
    if _current is not None:
        shutil.rmtree(_current, ignore_errors=True)
        _current = None


def sweep_dead_runtime_dirs(base: str | None = None) -> list[str]:
    """Remove the runtime directories under ``base`` whose process is gone; the names removed."""
    base = base or runtime_base()
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None or ProcessId(int(match.group(1)), int(match.group(2), 16)).alive():
            continue
        _release_noted_segments(os.path.join(base, name))
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        removed.append(name)
    if removed:
        release_orphaned_semaphores()
    return removed


def release_orphaned_semaphores() -> list[str]:
    """Unlink this user's multiprocessing semaphores (``/dev/shm/sem.mp-*``) that no live process maps.

    A SIGKILLed group leaves the named semaphores its processes made (queues, locks, events) with nobody
    to unlink them: multiprocessing's resource tracker died with them. Which ones were the dead server's
    cannot be told (a semaphore's name appears in no mapping), but a ``sem.mp-*`` that no process maps is
    garbage whoever made it: its creator holds it mapped for as long as anyone may still open it by name
    (``unmapped`` tells by inode). Run when a dead server's runtime directory was found, so only after a
    death of ours."""
    uid = os.getuid()
    names = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(SEMAPHORE_PREFIX):
            with contextlib.suppress(OSError):
                if os.stat(os.path.join(SHM_DIR, name)).st_uid == uid:
                    names.append(name)
    orphaned = unmapped(names)
    for name in orphaned:
        unlink_segment(name)
    return orphaned


def _release_noted_segments(path: str) -> None:
    """Unlink the segments a dead server's engines noted that no live process maps."""
    noted: list[str] = []
    for engine in os.listdir(path) if os.path.isdir(path) else ():
        try:
            with open(os.path.join(path, engine, SEGMENTS_FILE)) as f:
                noted.extend(line.strip() for line in f if line.strip())
        except OSError:
            continue
    for name in unmapped(noted):
        unlink_segment(name)
