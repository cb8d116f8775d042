"""Where the sources of a vLLM release come from: pip locates the wheel (its configured index, no
dependencies), only the wheel's ``vllm/**.py`` are fetched, and they are cached as a small zip under
``$VLLM_OMNI_COMPAT_CACHE`` or ``$XDG_CACHE_HOME/vllm-omni-plugin/vllm-sources`` (``~/.cache/...``).
The installed vLLM's sources are found here too (read, never imported)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_compat import CheckError, NotReleased
from vllm_compat.remote_zip import NoRangeRequests, RemoteZipFile, member_ranges
from vllm_compat.tree import SourceTree, is_source

CACHE_ENV = "VLLM_OMNI_COMPAT_CACHE"

RESOLVED_TTL_S = 12 * 3600
"""How long ``0.33.*`` -> ``0.33.0`` (pip's answer) is reused before pip is asked again."""

_EXACT = re.compile(r"[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?(\.post[0-9]+)?")

# The wheels are platform wheels; naming the platform lets this run on any machine (macOS included).
_WHEEL_TARGET = [
    *(f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 40)),
    "--implementation=cp",
    f"--python-version={sys.version_info.major}.{sys.version_info.minor}",
    "--only-binary=:all:",
]


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
            error = _pip_error(proc)
            versions = re.search(r"\(from versions: ([^)]*)\)", proc.stderr)
            if "No matching distribution found" in error and versions and versions.group(1) != "none":
                # the index answered with the releases it has, and this is not one of them
                raise NotReleased(f"pip cannot find {requirement}: {error}")
            raise CheckError(f"pip cannot look up {requirement} (is its index reachable?): {error}")
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
    found: str | None = None
    for line in _pip("config", "list").stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith(".cert"):
            found = value.strip().strip("'\"")
    return found if found and os.path.exists(found) else None


def _write_sources(archive: zipfile.ZipFile, dest: Path, wheel: Wheel, how: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name, suffix=".part", dir=dest.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as out:
            for info in archive.infolist():
                if is_source(info.filename):
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
            remote.prefetch(member_ranges(archive, is_source))
            how = (
                f"{remote.fetched / 1e6:.1f} MB of {remote.size / 1e6:.0f} MB "
                f"in {remote.requests} range requests"
            )
            _write_sources(archive, dest, wheel, how)
            return how
        except (NoRangeRequests, OSError, zipfile.BadZipFile, ValueError) as exc:  # OSError: URLError too
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


def _resolutions() -> dict[str, dict]:
    try:
        return json.loads((cache_dir() / "resolved.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def resolved_lately(dist: str, version_spec: str) -> str | None:
    """The release a wildcard (``0.33.*``) resolved to within ``RESOLVED_TTL_S``: "" when there was none,
    None when pip is to be asked."""
    entry = _resolutions().get(f"{dist}=={version_spec}")
    fresh = isinstance(entry, dict) and time.time() - entry.get("at", 0) < RESOLVED_TTL_S
    return entry["version"] if fresh else None


def remember_resolved(dist: str, version_spec: str, version: str) -> None:
    """What pip resolved a wildcard to ("" for no release), for ``resolved_lately``."""
    known = _resolutions()
    known[f"{dist}=={version_spec}"] = {"version": version, "at": time.time()}
    path = cache_dir() / "resolved.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def release_sources(dist: str, version_spec: str) -> SourceTree:
    """The cached sources of ``dist`` at ``version_spec`` (``0.33.0``, or ``0.33.*`` for the newest patch)."""
    exact = _EXACT.fullmatch(version_spec) is not None
    version = version_spec if exact else resolved_lately(dist, version_spec)
    if version:
        cached = cache_dir() / f"{dist}-{version}.zip"
        if cached.exists():
            return SourceTree.from_zip(cached, f"{dist} {version}")
    if version == "":
        raise NotReleased(f"no release matches {dist}=={version_spec} (pip said so lately)")
    try:
        wheel = locate_wheel(f"{dist}=={version_spec}")
    except NotReleased:
        if not exact:
            remember_resolved(dist, version_spec, "")
        raise
    if not exact:
        remember_resolved(dist, version_spec, wheel.version)
    cached = cache_dir() / f"{wheel.dist}-{wheel.version}.zip"
    if not cached.exists():
        how = fetch_sources(wheel, cached)
        print(f"fetched the sources of {wheel.dist} {wheel.version} ({how}) into {cached}")
    return SourceTree.from_zip(cached, f"{wheel.dist} {wheel.version}")


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
