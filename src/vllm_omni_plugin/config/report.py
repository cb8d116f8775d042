"""The reporter every part of resolution receives: where each stage field was set, the errors that name
the file, line and field of a mistake, and the notes about what resolution changed or ignored."""

from __future__ import annotations

from vllm_omni_plugin.config.errors import ConfigError, Path
from vllm_omni_plugin.config.loader import LoadedConfig


class Reporter:
    """One per resolution; the only state its parts share, handed to each of them."""

    def __init__(self, loaded: LoadedConfig) -> None:
        self.loaded = loaded
        self.source = loaded.source
        self.where: dict[tuple[int, str], str] = dict(loaded.lines)
        """(stage_id, field) -> where the field was last set ("file:line", "--stage-overrides", ...)."""
        self.notes: list[str] = list(loaded.notes)

    def set_at(self, stage_id: int, field: str, where: str) -> None:
        """A higher layer set ``field`` of stage ``stage_id``: errors and notes about it name ``where``."""
        self.where[(stage_id, field)] = where

    def located(self, stage_id: int, field: str) -> str:
        """Where a stage field was set, else the document."""
        return self.where.get((stage_id, field), self.source)

    def error(self, message: str, stage_id: int | None = None, field: str | None = None) -> ConfigError:
        """An error about a stage (and one of its fields), naming the file and line that set it."""
        where = self.where.get((stage_id, field)) if stage_id is not None and field else None
        source, line = self.source, None
        if where and ":" in where and where.rsplit(":", 1)[1].isdigit():
            source, line_text = where.rsplit(":", 1)
            line = int(line_text)
        elif where:
            source = where
        path: tuple[str | int, ...] = ()
        if stage_id is not None:
            path = (f"stages[stage_id={stage_id}]",) + ((field,) if field else ())
        return ConfigError(message, source=source, line=line, path=path)

    def doc_error(self, message: str, path: Path) -> ConfigError:
        """An error about a top-level document path (connectors, edges, platforms, ...)."""
        return ConfigError(message, source=self.source, line=self.loaded.locate(path), path=path)

    def note(self, text: str, at: str | None = None) -> None:
        """A note about the document (or about what ``at`` names)."""
        self.notes.append(f"{at or self.source}: {text}")

    def note_at(self, stage_id: int, field: str, text: str) -> None:
        """A note about a stage field, naming where it was set."""
        self.notes.append(f"{self.located(stage_id, field)}: stage {stage_id} {field}: {text}")
