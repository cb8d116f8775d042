#!/usr/bin/env bash
# The demo command: installs what is needed (into .venv), builds a tiny model offline and shows
# `vllm serve MODEL --omni` through the stock `vllm` console script.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

MODELS="${VLLM_OMNI_TINY_MODEL_CACHE:-$ROOT/.cache/tiny_models}"
echo "== building the tiny text model (offline, cached)"
TEXT_MODEL="$("$PY" -m vllm_omni_plugin.testing.tiny_models text "$MODELS/text")"

echo "== vllm serve $TEXT_MODEL --omni --help"
vllm serve "$TEXT_MODEL" --omni --help
