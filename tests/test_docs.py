"""The documentation: the README stays a short quick start, the site in docs/ builds with ``mkdocs build
--strict`` (mkdocs.yml), every page is in its nav, and every relative link of the README and the pages
resolves, ``#anchor`` included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README_MAX_LINES = 250
FENCED_CODE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def without_code(text: str) -> str:
    """The text less its fenced code blocks and inline code spans (a `#` or `[x](y)` there is no heading
    or link)."""
    return re.sub(r"`[^`\n]*`", "", FENCED_CODE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than ``-`` and ``_`` removed, spaces to
    ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED_CODE.sub("", path.read_text(encoding="utf-8"))  # inline code stays: it is in the slug
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = without_code(path.read_text(encoding="utf-8"))
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{link}: no heading with that anchor in {file.relative_to(REPO)}")
    return broken


@pytest.mark.processes
def test_the_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("path", [REPO / "README.md", *pages()], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs" and config["theme"]["name"] == "material"

    def files(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [f for value in nav.values() for f in files(value)]
        if isinstance(nav, list):
            return [f for item in nav for f in files(item)]
        return []

    in_nav = files(config["nav"])
    assert len(in_nav) == len(set(in_nav))
    assert sorted(in_nav) == sorted(str(p.relative_to(DOCS)) for p in pages())


def test_no_machine_paths_in_the_docs() -> None:
    """What a reader sees names no folder of the machine the docs were written on."""
    for path in [REPO / "README.md", *pages()]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w.$])/(work|tmp|root)/|\.\./shared", text), path


def test_slugs_follow_github() -> None:
    assert slug("Turning it on and off") == "turning-it-on-and-off"
    assert slug("What `diffusion/` owns") == "what-diffusion-owns"
    assert slug("3.1 BAGEL: the KV handoff") == "31-bagel-the-kv-handoff"
    assert slug("BAGEL's context export") == "bagels-context-export"
