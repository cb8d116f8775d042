"""The one error type of configuration: it names the file, the line, the field path and the problem."""

from __future__ import annotations

from collections.abc import Sequence

PathPart = str | int
Path = tuple[PathPart, ...]


def format_path(path: Sequence[PathPart]) -> str:
    """``("stages", 1, "max_num_seqs")`` -> ``stages[1].max_num_seqs``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


class ConfigError(ValueError):
    """A problem with a deploy config, a legacy stage_args file, or an override.

    ``str()`` gives ``file:line: path: message`` (parts that are unknown are left out), which the CLI
    prints as one line before exiting with code 2.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        path: Sequence[PathPart] = (),
    ) -> None:
        self.message = message
        self.source = source
        self.line = line
        self.path = tuple(path)
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.source:
            where = f"{self.source}:{self.line}: " if self.line else f"{self.source}: "
        field = f"{format_path(self.path)}: " if self.path else ""
        return f"{where}{field}{self.message}"
