#!/usr/bin/env bash
# The demo command: installs what is needed (into .venv), builds the tiny GLM-Image offline, serves it
# with `vllm serve MODEL --omni` (the stock `vllm` console script), generates one image with the
# official `openai` client, writes out/demo.png and stops the server.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" scripts/demo.py
