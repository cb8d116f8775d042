"""Writes ``tests/module_seconds.json``, each test module's seconds in a run's JUnit report, which the suite
uses to start its longest modules first (``tests/conftest.py``).

    bash scripts/test.sh --junitxml=junit.xml && .venv/bin/python scripts/module_seconds.py junit.xml

Refresh it when a module's time moves by minutes: only the order depends on it, never a result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def module_seconds(junit: Path) -> dict[str, int]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next((p for p in parts if p.startswith("test_")), None)
        if module is not None:
            seconds[f"tests/{module}.py"] += float(case.get("time") or 0)
    return {name: round(s) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: module_seconds.py JUNIT_XML", file=sys.stderr)
        return 2
    OUT.write_text(json.dumps(module_seconds(Path(argv[0])), indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
