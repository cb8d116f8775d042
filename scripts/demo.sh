#!/usr/bin/env bash
# The demo command: installs what is needed (into .venv), builds the tiny GLM-Image offline and shows
# `vllm serve MODEL --omni` through the stock `vllm` console script: its help, then the resolved
# per-stage configuration of the CPU deploy config.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

MODELS="${VLLM_OMNI_TINY_MODEL_CACHE:-$ROOT/.cache/tiny_models}"
echo "== building the tiny GLM-Image (random weights, real layout; offline, cached)"
MODEL="$("$PY" -m vllm_omni_plugin.testing.tiny_models glm-image "$MODELS/glm-image")"

echo "== vllm serve $MODEL --omni --help"
vllm serve "$MODEL" --omni --help

echo "== vllm serve $MODEL --omni --deploy-config deploy/tiny_glm_image_cpu.yaml --print-resolved-config"
vllm serve "$MODEL" --omni --deploy-config deploy/tiny_glm_image_cpu.yaml --print-resolved-config
