"""Our vLLM models built with a real checkpoint's config on the meta device, loaded with the real tensor
names and shapes (meta tensors): what is missing, what failed, how many elements went in.

``python real_layouts.py KIND MODEL_DIR LISTING.json[,LISTING.json...] [...]``: KIND is ``bagel`` (BAGEL's
thinker) or ``glm_image`` (GLM-Image's AR model); each further argument is one load (a fresh model) fed the
tensors of the comma-separated listings (``{"dtype": ..., "tensors": {name: shape}}``), in file order as
vLLM's iterator would. Prints one JSON line ``RESULT [...]``, one entry per load; tests/test_real_layouts.py
asserts on it. Run as a script: it initialises vLLM's distributed state for one CPU process, and the
engine arguments are the ones configuration resolution gives the stage.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from typing import Any

from one_process import engine_config, one_process


def main() -> None:
    kind, model_dir, *loads = sys.argv[1:]
    import torch

    import vllm_omni_plugin

    vllm_omni_plugin.register()
    if kind == "bagel":
        from vllm_omni_plugin.models.bagel.engine_args import thinker_engine_args
        from vllm_omni_plugin.models.bagel_thinker import OmniBagelForConditionalGeneration as model_class

        stage_args: dict[str, Any] = thinker_engine_args(model_dir)
    elif kind == "glm_image":
        from vllm_omni_plugin.models.glm_image_ar import GlmImageForConditionalGeneration as model_class
        from vllm_omni_plugin.models.glm_image_config import sampling_vocab_overrides

        stage_args = sampling_vocab_overrides(model_dir)
    else:
        raise SystemExit(f"unknown kind {kind!r}")

    config = engine_config(
        model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=4096,
        **stage_args,
    )  # fmt: skip
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    results: list[dict[str, Any]] = []
    with one_process(config):
        for load in loads:
            listings = [json.loads(open(path, encoding="utf-8").read()) for path in load.split(",")]
            config.compilation_config.static_forward_context.clear()  # attention layers of the last load
            with torch.device("meta"):
                model = model_class(vllm_config=config)
            params = {name: tuple(p.shape) for name, p in model.named_parameters()}
            weights = (
                (name, torch.empty(shape, dtype=dtypes[listing["dtype"]], device="meta"))
                for listing in listings
                for name, shape in listing["tensors"].items()
            )
            error = None
            loaded: set[str] = set()
            try:
                loaded = set(model.load_weights(weights))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                error = "".join(traceback.format_exception_only(exc)).strip()
            results.append(
                {
                    "error": error,
                    "params": len(params),
                    "param_elements": sum(math.prod(s) for s in params.values()),
                    "missing": sorted(set(params) - loaded),
                    "not_params": sorted(loaded - set(params)),
                }
            )
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
