"""A zip on an HTTP server, read with range requests: a wheel's central directory and the members we want,
not the whole file (see the package docstring for why this is kept)."""

from __future__ import annotations

import bisect
import io
import re
import ssl
import urllib.request
import zipfile
from collections.abc import Callable, Iterable


class NoRangeRequests(Exception):
    """The server answered a range request with something other than 206."""


class RemoteZipFile(io.RawIOBase):
    """A wheel on an HTTP server as a read-only file whose bytes are fetched with range requests.

    ``zipfile`` reads the central directory (a few hundred KiB at the end), then the members we ask for;
    ``prefetch`` fetches the members' byte ranges in a few merged requests first. It implements only what
    ``zipfile`` calls: ``seekable``, ``seek``, ``tell`` and ``read``.
    """

    TAIL = 1 << 16
    MIN_READ = 1 << 18
    MERGE_GAP = 1 << 18

    def __init__(self, url: str, context: ssl.SSLContext | None = None) -> None:
        super().__init__()
        self.url = url
        self.context = context
        self.pos = 0
        self.fetched = 0
        self.requests = 0
        self._starts: list[int] = []
        self._blocks: list[bytes] = []
        data, content_range = self._get(f"bytes=-{self.TAIL}")
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range or "")
        if match is None:
            raise NoRangeRequests(f"no usable Content-Range ({content_range!r})")
        self.size = int(match.group(3))
        self._add(int(match.group(1)), data)

    def _get(self, byte_range: str) -> tuple[bytes, str | None]:
        request = urllib.request.Request(
            self.url, headers={"Range": byte_range, "Accept-Encoding": "identity"}
        )
        with urllib.request.urlopen(request, timeout=120, context=self.context) as response:
            if response.status != 206:
                raise NoRangeRequests(f"HTTP {response.status} to a range request")
            data = response.read()
            self.requests += 1
            self.fetched += len(data)
            return data, response.headers.get("Content-Range")

    def _add(self, start: int, data: bytes) -> None:
        index = bisect.bisect_left(self._starts, start)
        self._starts.insert(index, start)
        self._blocks.insert(index, data)

    def _cached(self, start: int, length: int) -> bytes | None:
        index = bisect.bisect_right(self._starts, start) - 1
        while index >= 0:
            block_start, block = self._starts[index], self._blocks[index]
            if block_start <= start and start + length <= block_start + len(block):
                return block[start - block_start : start - block_start + length]
            index -= 1
        return None

    def fetch(self, start: int, end: int) -> None:
        end = min(end, self.size)
        if start < end and self._cached(start, end - start) is None:
            data, _ = self._get(f"bytes={start}-{end - 1}")
            self._add(start, data)

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, end in sorted(ranges):
            if merged and start - merged[-1][1] <= self.MERGE_GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            self.fetch(start, end)

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.size - self.pos
        size = max(0, min(size, self.size - self.pos))
        data = self._cached(self.pos, size)
        if data is None:
            self.fetch(self.pos, self.pos + max(size, self.MIN_READ))
            data = self._cached(self.pos, size)
            assert data is not None
        self.pos += len(data)
        return data


def member_ranges(archive: zipfile.ZipFile, wanted: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Byte ranges of the ``wanted`` members: from a member's local header to the next member's."""
    infos = archive.infolist()
    offsets = sorted(info.header_offset for info in infos)
    end_of_members = archive.start_dir
    out = []
    for info in infos:
        if wanted(info.filename):
            index = bisect.bisect_right(offsets, info.header_offset)
            out.append((info.header_offset, offsets[index] if index < len(offsets) else end_of_members))
    return out
