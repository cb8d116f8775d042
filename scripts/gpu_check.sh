#!/usr/bin/env bash
# The CUDA check, one command for a host with an NVIDIA GPU (under 8 minutes on one H200 once installed):
#   1. installs .[cuda,test] into .venv-cuda (VLLM_OMNI_CUDA_VENV picks another; pip's own PIP_FIND_LINKS /
#      PIP_NO_INDEX serve an offline host);
#   2. runs the tests marked `cuda` (skipped everywhere else; among them a step-cached, a compiled and, on
#      a host with two devices, a CFG-parallel tiny SD3 deployment: tests/test_dit_acceleration_cuda.py);
#   3. serves the tiny GLM-Image and the tiny BAGEL with vLLM's defaults (CUDA graphs and async scheduling
#      on), once with the model runner the plugin chooses and once with VLLM_USE_V2_MODEL_RUNNER=1, and
#      compares every image with a reference computed on this host's CPU (vllm_omni_plugin.testing.harness.gpu_check);
#   4. prints one summary table (also in gpu_check_out/summary.txt, with the servers' logs).
# Exit status: 0 when everything passed, 1 when something failed, 2 on a host without a CUDA GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: scripts/gpu_check.sh needs a CUDA GPU and finds none here (nvidia-smi); on a CPU machine run bash scripts/test.sh" >&2
    exit 2
fi

VENV="${VLLM_OMNI_CUDA_VENV:-$ROOT/.venv-cuda}"
PY="$VENV/bin/python"
OUT="${GPU_CHECK_OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"

if [ ! -x "$PY" ]; then
    echo "== creating virtual environment $VENV"
    python3 -m venv "$VENV" || exit 1
fi
STAMP="$VENV/.vllm-omni-plugin-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "== installing vllm-omni-plugin[cuda,test] (vLLM's CUDA build, diffusers, ...)"
    "$PY" -m pip install -q -e "$ROOT[cuda,test]" || exit 1
    echo "$WANT" > "$STAMP"
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: nvidia-smi sees a GPU but this environment's torch cannot use it (a CPU build of torch in $VENV?)" >&2
    exit 2
fi

export VLLM_TARGET_DEVICE=cuda HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
unset VLLM_USE_V2_MODEL_RUNNER
export PATH="$VENV/bin:$PATH"
cd "$ROOT"

echo "== $(nvidia-smi -L | head -1); $("$PY" -c 'import torch, vllm; print(f"torch {torch.__version__}, vllm {vllm.__version__}")')"
echo "== tests marked cuda"
"$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
tests_line="$(tail -1 "$OUT/cuda_tests.log")"

echo "== serving the tiny models (vLLM defaults: CUDA graphs on)"
"$PY" -m vllm_omni_plugin.testing.harness.gpu_check --device cuda --runners choice,v2 --out "$OUT"
serve_rc=$?

echo
echo "== summary"
echo "cuda-marked tests: $tests_line"
cat "$OUT/summary.txt" 2>/dev/null
if [ "$tests_rc" -eq 0 ] && [ "$serve_rc" -eq 0 ]; then
    echo "gpu_check: PASSED"
    exit 0
fi
echo "gpu_check: FAILED (logs in $OUT)"
exit 1
