"""YAML documents that remember where each value came from, so errors can name the line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

import yaml

from vllm_omni_plugin.config.errors import ConfigError, Path


@dataclass
class Document:
    """A parsed YAML document plus the line of every mapping key and sequence item."""

    data: Any
    source: str
    lines: dict[Path, int] = field(default_factory=dict)

    def line_of(self, path: Path) -> int | None:
        """The line of ``path``, or of its nearest ancestor that has one."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def error(self, path: Path, message: str) -> ConfigError:
        return ConfigError(message, source=self.source, line=self.line_of(path), path=path)


def _record_lines(node: yaml.Node, path: Path, lines: dict[Path, int], source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"duplicate key {key!r}", source=source, line=line, path=(*path, key))
            seen.add(key)
            lines[(*path, key)] = line
            _record_lines(value_node, (*path, key), lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            _record_lines(item, (*path, index), lines, source)


def parse_yaml(text: str, source: str) -> Document:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(f"not valid YAML: {exc.problem or exc}", source=source, line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", source=source) from None
    lines: dict[Path, int] = {}
    if node is not None:
        lines[()] = node.start_mark.line + 1
        _record_lines(node, (), lines, source)
    return Document(data=data, source=source, lines=lines)


def load_yaml_file(path: str | FsPath, display: Callable[[FsPath], str] | None = None) -> Document:
    fs_path = FsPath(path)
    source = display(fs_path) if display else str(path)
    try:
        text = fs_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such file", source=source) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, expected a YAML file", source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", source=source) from None
    return parse_yaml(text, source)
