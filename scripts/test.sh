#!/usr/bin/env bash
# The test command: installs what is needed (into .venv) and runs lint and the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_cli.py -k help`;
# `bash scripts/test.sh --fast` runs the fast tier (no engine, no process, no tiny model: tests/fast_tier.py).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# One OpenMP thread per process in every test (the CPU threads policy steps aside): the suite runs many
# engines and servers side by side on a few cores (tests/conftest.py and the servers it starts set it too).
export OMP_NUM_THREADS=1

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .

echo "== pytest"
# Test modules run on TEST_WORKERS parallel workers (default 2: CI's cores), each module wholly on one
# worker so that its shared servers and engines start once; TEST_WORKERS=0 runs them in this process.
rc=0
"$PY" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
fi
exit "$rc"
