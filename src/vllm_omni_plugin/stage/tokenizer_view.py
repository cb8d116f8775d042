"""A tokenizer directory vLLM can load without a config error.

Diffusers-layout repositories keep the AR model's processor/tokenizer in their own folder without a
``config.json`` (GLM-Image: ``processor/``). vLLM's tokenizer loader reads the model config from the
tokenizer folder first and, failing, logs an error and retries with back-off: seconds of every engine
start. A *view* — a cache folder of links to the tokenizer files plus the model's ``config.json`` —
gives it what it looks for; the files themselves are the repository's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("VLLM_OMNI_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm_omni_plugin"
    )
    return Path(base) / "tokenizer_views"


def tokenizer_view(tokenizer_dir: str, model_dir: str) -> str:
    """``tokenizer_dir`` itself when it has a ``config.json`` (or is not local), else a view of it."""
    tok, model = Path(tokenizer_dir), Path(model_dir)
    if not tok.is_dir() or (tok / "config.json").exists() or not (model / "config.json").is_file():
        return tokenizer_dir
    files = sorted(p for p in tok.iterdir() if p.is_file())
    stamp = "|".join(f"{p.resolve()}:{p.stat().st_mtime_ns}" for p in [*files, model / "config.json"])
    view = cache_root() / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    if not (view / "config.json").exists():
        tmp = view.with_name(view.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for p in files:
            link = tmp / p.name
            if not link.exists():
                link.symlink_to(p.resolve())
        (tmp / "config.json").symlink_to((model / "config.json").resolve())
        try:
            tmp.rename(view)
        except OSError:  # another process made it first
            for link in tmp.iterdir():
                link.unlink()
            tmp.rmdir()
    return str(view)
