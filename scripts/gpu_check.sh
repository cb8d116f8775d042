#!/usr/bin/env bash
# The CUDA check, one command for a host with an NVIDIA GPU (under 8 minutes on one H200 once installed):
#   1. installs .[cuda,quant,test] and the test kit (testkit/, both editable) into .venv-cuda (VLLM_OMNI_CUDA_VENV
#      picks another; VLLM_OMNI_CUDA_PYTHON=PY installs into that interpreter instead, one that already holds
#      a CUDA build of torch; pip's own PIP_FIND_LINKS / PIP_NO_INDEX serve an offline host);
#   2. runs the tests marked `cuda` (skipped everywhere else; among them a step-cached, a compiled and, on
#      a host with two devices, CFG- and sequence-parallel tiny SD3 and a CFG-parallel tiny BAGEL, and the
#      step loop decoding on a CUDA stream of its own and parking a preempted state in pinned host memory:
#      tests/test_dit_acceleration_cuda.py; a tiny FLUX stage
#      quantized to float8 and int8 on the GPU: tests/test_quantization.py);
#   3. serves the tiny GLM-Image and the tiny BAGEL with vLLM's defaults (CUDA graphs and async scheduling
#      on, the V2 model runner, on 0.34 its extensible KV cache and the KV connector made after warm-up):
#      text to image and an edit each, every image compared with a reference computed on this host's CPU
#      (vllm_omni_testkit.harness.gpu_check); the table says which runner each AR stage reported;
#   4. prints one summary table (also in gpu_check_out/summary.txt, with the servers' logs).
# Where vLLM's CUDA build cannot be installed (an offline host without its wheel), the checks that need no
# vLLM still run (the project from src/, the diffusion stage's tests marked `cuda`) and step 3 is reported
# as not run.
# Exit status: 0 when everything passed, 1 when something failed, 2 on a host without a CUDA GPU, 3 when
# what ran passed but vLLM was missing (serving not checked).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: scripts/gpu_check.sh needs a CUDA GPU and finds none here (nvidia-smi); on a CPU machine run bash scripts/test.sh" >&2
    exit 2
fi

OUT="${GPU_CHECK_OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"

if [ -n "${VLLM_OMNI_CUDA_PYTHON:-}" ]; then
    PY="$VLLM_OMNI_CUDA_PYTHON"
    STAMP="$OUT/.vllm-omni-plugin-installed"
else
    VENV="${VLLM_OMNI_CUDA_VENV:-$ROOT/.venv-cuda}"
    PY="$VENV/bin/python"
    if [ ! -x "$PY" ]; then
        echo "== creating virtual environment $VENV"
        python3 -m venv "$VENV" || exit 1
    fi
    STAMP="$VENV/.vllm-omni-plugin-installed"
    export PATH="$VENV/bin:$PATH"
fi
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/testkit/pyproject.toml" | sha256sum | cut -d' ' -f1)"
HAVE_VLLM=1
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "== installing vllm-omni-plugin[cuda,quant,test] (vLLM's CUDA build, diffusers, ...) and its test kit"
    if "$PY" -m pip install -q -e "$ROOT[cuda,quant,test]" -e "$ROOT/testkit"; then
        echo "$WANT" > "$STAMP"
    elif "$PY" -c "import torch, diffusers, transformers, msgspec, zmq, yaml, safetensors, PIL, pytest" 2>/dev/null; then
        echo "== vLLM's CUDA build could not be installed here: checking what runs without it (the project from src/ and testkit/src/)"
        HAVE_VLLM=0
        export PYTHONPATH="$ROOT/src:$ROOT/testkit/src${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "error: neither vLLM's CUDA build nor the diffusion stage's packages (diffusers, transformers, msgspec, pyzmq, pyyaml, safetensors, pillow, pytest) could be installed with $PY" >&2
        exit 1
    fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: nvidia-smi sees a GPU but this environment's torch cannot use it (a CPU build of torch in $PY's environment?)" >&2
    exit 2
fi

export VLLM_TARGET_DEVICE=cuda HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
unset VLLM_USE_V2_MODEL_RUNNER
cd "$ROOT"

if [ "$HAVE_VLLM" = 1 ]; then
    versions="$("$PY" -c 'import torch, vllm; print(f"torch {torch.__version__}, vllm {vllm.__version__}")')"
    test_paths=(tests)
else
    versions="$("$PY" -c 'import torch; print(f"torch {torch.__version__}, vllm not installed")')"
    # only the files that hold tests marked cuda: the others import the serving side's packages
    mapfile -t test_paths < <(grep -l "pytest.mark.cuda" tests/test_*.py)
fi
echo "== $(nvidia-smi -L | head -1); $versions"
echo "== tests marked cuda"
"$PY" -m pytest -m cuda -q -p no:cacheprovider "${test_paths[@]}" 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
tests_line="$(tail -1 "$OUT/cuda_tests.log")"

serve_rc=0
if [ "$HAVE_VLLM" = 1 ]; then
    echo "== serving the tiny models (vLLM defaults: CUDA graphs on)"
    "$PY" -m vllm_omni_testkit.harness.gpu_check --device cuda --runners choice --out "$OUT"
    serve_rc=$?
else
    echo "serving the tiny GLM-Image and BAGEL on vLLM: NOT RUN (vLLM's CUDA build is not installed here)" \
        > "$OUT/summary.txt"
fi

echo
echo "== summary"
echo "cuda-marked tests: $tests_line"
cat "$OUT/summary.txt" 2>/dev/null
if [ "$tests_rc" -ne 0 ] || [ "$serve_rc" -ne 0 ]; then
    echo "gpu_check: FAILED (logs in $OUT)"
    exit 1
fi
if [ "$HAVE_VLLM" = 0 ]; then
    echo "gpu_check: PASSED what ran without vLLM; serving NOT CHECKED (install vLLM's CUDA build and run again)"
    exit 3
fi
echo "gpu_check: PASSED"
exit 0
