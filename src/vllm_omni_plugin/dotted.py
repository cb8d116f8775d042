"""Import what a configuration names by dotted path (``pkg.module.attr`` or ``pkg.module:attr``)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module_name), attr)
