"""``python -m vllm_omni_plugin.tiny_models KIND OUTDIR``: build a tiny model (the command; the
builders are in :mod:`vllm_omni_plugin.tiny_models.builders`)."""

from __future__ import annotations

import sys

from vllm_omni_plugin.tiny_models.builders import main

if __name__ == "__main__":
    sys.exit(main())
