"""The layout and state protocol of a pooled shared-memory segment (``SharedMemoryConnector``'s pool).

A pooled segment is a tmpfs file: a one-page header, then the data (page aligned, so every dtype is
aligned). The header holds native 8-byte words, each written with one store, so a reader in another
process never sees half of one::

    offset  0  magic     b"vomnipl1": this is a pooled segment
    offset  8  state     the state word: generation << 2 | FREE, PUT or HELD
    offset 16  reader    pid of the process holding the value (state HELD)
    offset 24  nbytes    size of the value in it
    offset 32  capacity  data bytes after the header

The generation counts the values put into the segment; a handle's key carries it, so a handle never
reaches a later value in the same segment. Who may change the state word:

* FREE -> PUT: the owner only (:func:`publish`); nobody else writes a free segment;
* PUT -> HELD: a receiver's claim (:func:`claim`), under ``flock``;
* PUT -> FREE: the owner ending a lease, or ``cleanup`` (:func:`locked_transition`), under ``flock``;
* HELD -> FREE: the holder once its view is gone (:func:`release_held`), or the owner once the holder's
  pid is gone (:func:`reclaim`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct

MAGIC = int.from_bytes(b"vomnipl1", "little")
HEADER_BYTES = 4096
FREE, PUT, HELD = 0, 1, 2

_WORD = struct.Struct("Q")
"""Native byte order and size: struct copies native words with one store, so a reader never sees half."""
_OFF_MAGIC, _OFF_STATE, _OFF_READER, _OFF_NBYTES, _OFF_CAPACITY = 0, 8, 16, 24, 32
_STATE_BITS = 2
_STATE_MASK = (1 << _STATE_BITS) - 1


# --- the state word -------------------------------------------------------------------------------------


def state_word(generation: int, state: int) -> int:
    return generation << _STATE_BITS | state


def state_of(word: int) -> int:
    return word & _STATE_MASK


def generation_of(word: int) -> int:
    return word >> _STATE_BITS


def freed(word: int) -> int:
    """The same generation, FREE."""
    return state_word(generation_of(word), FREE)


# --- header words ---------------------------------------------------------------------------------------


def _word(buf: mmap.mmap, offset: int) -> int:
    return _WORD.unpack_from(buf, offset)[0]


def _set_word(buf: mmap.mmap, offset: int, value: int) -> None:
    _WORD.pack_into(buf, offset, value)


def read_state(mm: mmap.mmap) -> int:
    return _word(mm, _OFF_STATE)


def read_reader(mm: mmap.mmap) -> int:
    return _word(mm, _OFF_READER)


def read_nbytes(mm: mmap.mmap) -> int:
    return _word(mm, _OFF_NBYTES)


def init_header(mm: mmap.mmap, capacity: int) -> None:
    """A new segment: its capacity, FREE (generation 0), and the magic last."""
    _set_word(mm, _OFF_CAPACITY, capacity)
    _set_word(mm, _OFF_STATE, state_word(0, FREE))
    _set_word(mm, _OFF_MAGIC, MAGIC)


def header_problem(mm: mmap.mmap, size: int) -> str | None:
    """Why a mapped file of ``size`` bytes is not a pooled segment, or None when it is one."""
    if size <= HEADER_BYTES:
        return f"is {size} bytes, too short for a pooled segment"
    if _word(mm, _OFF_MAGIC) != MAGIC or _word(mm, _OFF_CAPACITY) != size - HEADER_BYTES:
        return "is not a pooled segment (bad header)"
    return None


# --- transitions ----------------------------------------------------------------------------------------


def publish(mm: mmap.mmap, generation: int, nbytes: int) -> None:
    """FREE -> PUT by the owner, once the value is written: the state word goes last."""
    _set_word(mm, _OFF_NBYTES, nbytes)
    _set_word(mm, _OFF_READER, 0)
    _set_word(mm, _OFF_STATE, state_word(generation, PUT))


def claim(mm: mmap.mmap, generation: int, nbytes: int, reader: int, *, linked: bool) -> tuple[int, int]:
    """PUT -> HELD by ``reader`` if the segment holds that generation's value of ``nbytes``; the caller
    holds the segment's ``flock``. ``linked``: the file still exists (a removed segment holds nothing,
    whatever its header says). Returns the state word and the stored size as found."""
    state = read_state(mm) if linked else state_word(0, FREE)
    stored = read_nbytes(mm)
    if state == state_word(generation, PUT) and stored == nbytes:
        _set_word(mm, _OFF_READER, reader)
        _set_word(mm, _OFF_STATE, state_word(generation, HELD))
    return state, stored


def release_held(mm: mmap.mmap, held: int) -> None:
    """HELD -> FREE by the holder, if the segment still holds its claim ``held``."""
    if read_state(mm) == held:
        _set_word(mm, _OFF_STATE, freed(held))


def reclaim(mm: mmap.mmap, held: int) -> None:
    """HELD -> FREE by the owner, whose reader exited holding the value (nobody else writes it now)."""
    _set_word(mm, _OFF_STATE, freed(held))


def locked_transition(path: str, expect: int, new: int) -> bool | None:
    """Change a segment's state word from ``expect`` to ``new`` under ``flock``.

    Returns whether it changed, or None if the file is gone. Uses its own file descriptor (its own
    lock), so it excludes a receiver's claim in any process, this one included.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _WORD.unpack(os.pread(fd, _WORD.size, _OFF_STATE).ljust(_WORD.size, b"\0"))[0] != expect:
            return False
        os.pwrite(fd, _WORD.pack(new), _OFF_STATE)
        return True
    finally:
        os.close(fd)  # also drops the lock


def create_segment(path: str, capacity: int) -> mmap.mmap:
    """A new segment file of ``capacity`` data bytes, mapped and FREE. Its space is reserved first: a
    write to a mapped tmpfs file that is out of space would kill us with SIGBUS, so ``fallocate`` must
    fail here instead."""
    size = HEADER_BYTES + capacity
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    init_header(mm, capacity)
    return mm
