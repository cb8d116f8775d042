"""Which runner drives a diffusers model: the registry of diffusers pipeline classes -> runners.

A model directory names its pipeline in ``model_index.json`` (``_class_name``). The registry maps that name
to a runner class by dotted path (imported when a model of that class is served); a class nobody registered
runs on the generic diffusers runner (``GENERIC_RUNNER``), which reads what the pipeline's ``__call__``
takes from its signature. A class no runner can drive is refused before anything loads
(:func:`inspect_model`), naming what its ``__call__`` lacks. Generic code (the engine, the wire's union of
request types) needs this table, so it lives here; the runners themselves live in their families
(``families/``), named by string only.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vllm_omni_plugin.diffusion.runner import DiffusionRunner
from vllm_omni_plugin.dotted import import_object
from vllm_omni_plugin.log import get_logger

logger = get_logger(__name__)

GENERIC_RUNNER = "vllm_omni_plugin.diffusion.diffusers_runner:DiffusersPipelineRunner"
"""The runner of every diffusers image class no other runner is registered for."""
VIDEO_RUNNER = "vllm_omni_plugin.families.diffusers.runner:DiffusersVideoRunner"
"""The runner of every diffusers video class (its ``__call__`` takes ``num_frames``) no other runner is
registered for."""

STEP_FAMILIES: Mapping[str, str] = {
    "StableDiffusion3Pipeline": "vllm_omni_plugin.families.diffusers.steps:SD3Steps",
    "FluxPipeline": "vllm_omni_plugin.families.diffusers.steps:FluxSteps",
    "QwenImagePipeline": "vllm_omni_plugin.families.diffusers.steps:QwenImageSteps",
    "QwenImageEditPipeline": "vllm_omni_plugin.families.diffusers.steps:QwenImageEditSteps",
    "GlmImagePipeline": "vllm_omni_plugin.families.glm_image.steps:GlmImageSteps",
    "WanPipeline": "vllm_omni_plugin.families.diffusers.video_steps:WanSteps",
    "WanImageToVideoPipeline": "vllm_omni_plugin.families.diffusers.video_steps:WanImageToVideoSteps",
}
"""Pipeline classes the step loop runs (``batching: loop``) -> their pieces (``diffusion/step_loop.py``),
by dotted path."""

CALL_ARGUMENTS = ("prompt", "height", "width", "num_inference_steps", "generator", "output_type")
"""What a pipeline's ``__call__`` must take for a runner to drive it."""


class UnknownPipelineError(ValueError):
    """The model names a pipeline class that neither diffusers nor the registry has."""


class UnservablePipelineError(ValueError):
    """A diffusers pipeline class whose ``__call__`` lacks what a runner needs."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model's pipeline takes, known from its class without loading any weights."""

    pipeline_class: str
    takes_images: bool
    """It turns source images into the output (edits, image-to-image)."""
    needs_images: bool
    """It cannot run without a source image (an edit pipeline)."""
    max_images: int | None = 1
    """Source images a request may have (None: any number)."""
    prompt_token_limit: int | None = None
    """The most prompt tokens it encodes (None: its pipeline truncates longer prompts itself)."""
    prompt_tokenizer: str = "tokenizer"
    """The model folder's tokenizer that counts them."""
    takes_mask: bool = False
    """It repaints the masked area of a source image (inpainting: its own pipeline or diffusers'
    inpainting pipeline of its family)."""
    needs_mask: bool = False
    """It only repaints masked areas (FLUX.1 Fill): every request has an image and a mask."""


@functools.cache
def call_parameters(pipeline_cls: type) -> Mapping[str, inspect.Parameter]:
    """The named parameters of the class's own ``__call__`` (none when it has no ``__call__``); read once
    per class (runners ask per request and per call), read-only."""
    call = next((vars(k)["__call__"] for k in pipeline_cls.__mro__[:-1] if "__call__" in vars(k)), None)
    if call is None:
        return MappingProxyType({})
    params = inspect.signature(call).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return MappingProxyType({name: p for name, p in params.items() if p.kind in kinds and name != "self"})


TASKS = ("text", "images", "mask")
"""What a request asks of a diffusers model: an image from text, from source images (image-to-image,
an edit, a variation), or the masked area of a source image repainted (inpainting)."""


def companion_class(pipeline_cls: type, task: str) -> type | None:
    """diffusers' own pipeline of ``pipeline_cls``'s model family for ``task`` (``images``: its
    image-to-image pipeline, ``mask``: its inpainting one), which a runner builds from the loaded
    pipeline's components (``from_pipe``: no second copy of the weights); None where diffusers has none.
    Read from diffusers' AutoPipeline tables, which pair each family's text-to-image, image-to-image and
    inpainting classes."""
    from diffusers.pipelines import auto_pipeline as auto

    tables = {"images": auto.AUTO_IMAGE2IMAGE_PIPELINES_MAPPING, "mask": auto.AUTO_INPAINT_PIPELINES_MAPPING}
    target = tables.get(task)
    if target is None:
        return None
    every = (auto.AUTO_TEXT2IMAGE_PIPELINES_MAPPING, *tables.values())
    family = next(
        (name for table in every for name, cls in table.items() if cls.__name__ == pipeline_cls.__name__),
        None,
    )
    return target.get(family) if family is not None else None


def generic_runner() -> type[Any]:
    """The generic diffusers runner class (imported by its dotted path)."""
    return import_object(GENERIC_RUNNER)


PIPELINE_RUNNERS: dict[str, str | type[DiffusionRunner]] = {
    "GlmImagePipeline": "vllm_omni_plugin.families.glm_image.runner:GlmImageRunner",
    "QwenImagePipeline": "vllm_omni_plugin.families.diffusers.runner:QwenImageRunner",
    "QwenImageEditPipeline": "vllm_omni_plugin.families.diffusers.runner:QwenImageEditRunner",
    "QwenImageEditPlusPipeline": "vllm_omni_plugin.families.diffusers.runner:QwenImageEditPlusRunner",
}
"""Runners of the families the generic runner cannot drive as they are, by diffusers class name: a
dotted path (imported when a model of that class is served) or the class."""


def register_diffusion_pipeline(class_name: str, cls: str | type[DiffusionRunner]) -> None:
    """Run models whose ``model_index.json`` says ``class_name`` with runner ``cls`` (a
    ``DiffusersPipelineRunner`` subclass, or its dotted path)."""
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, generic_runner())):
        raise TypeError(f"{cls!r} is not a DiffusersPipelineRunner subclass")
    previous = PIPELINE_RUNNERS.get(class_name)
    if previous is not None and previous is not cls:
        logger.warning(
            "diffusion pipeline %s: runner %s replaces %s", class_name, _name(cls), _name(previous)
        )
    PIPELINE_RUNNERS[class_name] = cls


def _name(runner: str | type) -> str:
    return runner if isinstance(runner, str) else runner.__name__


def registered_runner(class_name: str) -> type[Any] | None:
    """The runner registered for ``class_name`` (imported), or None."""
    runner = PIPELINE_RUNNERS.get(class_name)
    if isinstance(runner, str):
        runner = import_object(runner)
        if not (isinstance(runner, type) and issubclass(runner, generic_runner())):
            raise TypeError(f"{PIPELINE_RUNNERS[class_name]} is not a DiffusersPipelineRunner subclass")
    return runner


def diffusers_runner_classes() -> list[type[Any]]:
    """The generic runner and every registered one (imported): what a diffusion stage may run."""
    runners: list[type[Any]] = [generic_runner(), import_object(VIDEO_RUNNER)]
    for class_name in PIPELINE_RUNNERS:
        runner = registered_runner(class_name)
        if runner is not None and runner not in runners:
            runners.append(runner)
    return runners


def runner_class(class_name: str) -> type[Any]:
    """The registered runner of ``class_name``, else the generic runner (for a class diffusers has): its
    video runner where the class makes videos."""
    runner = registered_runner(class_name)
    if runner is not None:
        return runner
    generic = generic_runner()
    pipeline_cls = checked_pipeline_class(class_name, generic)
    if "num_frames" in call_parameters(pipeline_cls):
        return import_object(VIDEO_RUNNER)
    return generic


def checked_pipeline_class(class_name: str, runner: type[Any]) -> type:
    """The diffusers class ``class_name``, once it is known that ``runner`` can drive it."""
    import diffusers

    try:
        pipeline_cls = getattr(diffusers, class_name, None) if class_name.isidentifier() else None
    except (ImportError, RuntimeError) as exc:  # diffusers' lazy import of a class whose extras are missing
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnservablePipelineError(f"{class_name} cannot be imported: {reason}") from None
    if not isinstance(pipeline_cls, type) or not hasattr(pipeline_cls, "from_pretrained"):
        registered = ", ".join(sorted(PIPELINE_RUNNERS))
        raise UnknownPipelineError(
            f"diffusers {diffusers.__version__} has no pipeline class {class_name!r}, and no runner is "
            f"registered for it (registered: {registered}); add one with "
            "vllm_omni_plugin.diffusion.diffusers_registry.register_diffusion_pipeline"
        )
    missing = runner.missing_call_arguments(pipeline_cls)
    if missing:
        raise UnservablePipelineError(
            f"{class_name} cannot be served: its __call__ takes no {', '.join(missing)} (a text-to-image "
            f"stage passes {', '.join(CALL_ARGUMENTS)}); register a runner for it with "
            "vllm_omni_plugin.diffusion.diffusers_registry.register_diffusion_pipeline"
        )
    return pipeline_cls


@functools.lru_cache(maxsize=16)
def inspect_model(model: str) -> ModelFacts:
    """What the model's pipeline takes, from ``model_index.json`` and the class alone (no weights):
    raises ``ValueError`` with one line when no runner can drive it (or it is no diffusers model)."""
    name = pipeline_class_name(model)
    runner = runner_class(name)
    pipeline_cls = checked_pipeline_class(runner.pipeline_class or name, runner)
    text, images, mask = (runner.task_pipeline(pipeline_cls, task) for task in TASKS)
    return ModelFacts(
        pipeline_class=name,
        takes_images=images is not None or mask is not None,
        takes_mask=mask is not None,
        needs_mask=mask is not None and text is None and images is None,
        needs_images=runner.needs_images or text is None,
        max_images=runner.max_images,
        prompt_token_limit=runner.prompt_token_limit,
        prompt_tokenizer=runner.prompt_tokenizer,
    )


def model_index(model: str | Path) -> dict[str, Any]:
    """The model's ``model_index.json`` (a local directory or a cached hub id)."""
    path = Path(model)
    if path.is_dir():
        index_file = path / "model_index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{path} has no model_index.json: not a diffusers pipeline directory")
    elif path.is_absolute() or str(model).startswith(".") or str(model).count("/") != 1:
        raise FileNotFoundError(f"{model}: no such model directory (with a model_index.json)")
    else:  # a hub id: its model_index.json from the hub cache (or the hub, when online)
        from huggingface_hub import hf_hub_download

        try:
            index_file = Path(hf_hub_download(str(model), "model_index.json"))
        except Exception as exc:
            raise FileNotFoundError(
                f"{model} is neither a local directory nor a reachable hub model with a "
                f"model_index.json: {exc}"
            ) from exc
    index = json.loads(index_file.read_text())
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ValueError(f"{index_file} names no pipeline (_class_name)")
    return index


def pipeline_class_name(model: str | Path) -> str:
    """``_class_name`` from the model's ``model_index.json``."""
    return str(model_index(model)["_class_name"])


def model_components(model: str | Path) -> dict[str, tuple[str, str]]:
    """The pipeline's components in ``model_index.json``: name -> (library, class name)."""
    return {
        name: (entry[0], entry[1])
        for name, entry in model_index(model).items()
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[1]
    }


def stage_runner_class(diffusion_args: dict[str, Any]) -> type[Any]:
    """The runner class a resolved diffusion stage loads: the one its pipeline names (``runner_cls``),
    else the registered runner of its model's ``model_index.json`` class."""
    from vllm_omni_plugin.dotted import import_object

    if diffusion_args.get("runner_cls"):
        return import_object(diffusion_args["runner_cls"])
    return runner_class(pipeline_class_name(diffusion_args["model"]))


def load_pipeline_runner(model: str | Path, *, dtype: Any, device: Any) -> DiffusionRunner:
    """The registered runner for the model's pipeline class, loaded."""
    return runner_class(pipeline_class_name(model)).load(str(model), dtype=dtype, device=device)
