"""The report: every need checked against every release, as one table with a row per need, a column per
release and a footnote per distinct reason; failures count in every enforced column (each release named
on the command line, each of the default run's)."""

from __future__ import annotations

from vllm_compat.needs import Cell, Checker, MethodNeed, Need
from vllm_compat.releases import Column
from vllm_compat.tree import SourceTree

KIND_TITLES = {
    "hook": "the --omni hook",
    "compat": "compat.LOCATIONS: which location has each name (N: the Nth, newest first)",
    "import": "direct imports",
    "method": "methods we override or call through super()",
    "engine-arg": "EngineArgs fields we set",
    "call": "calls of vLLM callables",
    "attribute": "attributes of vLLM classes we read",
    "read": "attributes and fields of vLLM objects we read (compat.VLLM_READS; ?: we do without it)",
    "runner": "a user's V1 runner choice: refused by resolution exactly where vLLM lacks V1",
}


def run_checks(
    needs: list[Need],
    columns: list[Column],
    locations: dict[str, tuple[str, ...]],
    reference: SourceTree | None = None,
    optional: dict[str, frozenset[str]] | None = None,
) -> list[tuple[Need, list[Cell]]]:
    """Each need against each column. A method of ours that overrides nothing in any checked release,
    nor in the installed vLLM (``reference``), and calls no ``super()`` is our own method: no row.
    ``optional``: the names of compat classes the plugin does without (``compat.VLLM_READS``)."""
    checkers = [Checker(c.tree, locations, optional) for c in columns]
    reference_checker = Checker(reference, locations, optional) if reference is not None else None
    out = []
    for need in needs:
        if isinstance(need, MethodNeed) and not need.super_calls:
            trees = [*checkers, *([reference_checker] if reference_checker else [])]
            if not any(isinstance(need.base_method(checker), tuple) for checker in trees):
                continue
        out.append((need, [need.cell(checker) for checker in checkers]))
    return out


def render(results: list[tuple[Need, list[Cell]]], columns: list[Column]) -> tuple[str, int]:
    """The table, and how many cells of enforced columns failed."""
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
                if cell.failed and column.enforced:
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
