"""BAGEL's stage-input processors: the user's request -> the thinker; the thinker's contexts -> the DiT.

BAGEL conditions generation on three contexts (its ``interleave_inference``): ``cond`` (everything),
``cfg_text`` (everything before the text: text-to-image -> nothing, an edit -> the image blocks) and
``cfg_img`` (no image: the text alone; text-to-image -> ``cond`` itself). The thinker builds contexts
in its paged KV cache and exports them (``export_context``); how each one is obtained:

========== ======================================= =============================================
context    text-to-image                           edit (image + text)
========== ======================================= =============================================
cond       the main request                        the main request
cfg_text   empty (a negative prompt: a companion)  a prefix of ``cond`` (negative: a companion)
cfg_img    ``cond``                                a companion request (the text alone)
========== ======================================= =============================================

A prefix is delivered as the same tensor with a shorter length (no compute, no transfer); a companion is
a request of its own in the same engine batch. Think mode first lets the thinker write its plan
(``<|im_start|>`` ... ``<|im_end|>``), then builds ``cond`` with the plan appended (decoded and encoded
again, as BAGEL does) while the companions are built from the context before thinking; in think mode the
system prompt opens ``cond`` and ``cfg_img``, so ``cfg_text`` (system prompt [+ image]) is a prefix too.

Understanding and chat (``modality="text"``) end in the thinker: the prompt ends with ``<|im_start|>``
and the answer is decoded up to ``<|im_end|>``; images go in as ViT blocks only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_omni_plugin.ar_channel import EXPORT_CONTEXT, OMNI_KEY
from vllm_omni_plugin.stage.core_types import (
    StageDiffusionCoreRequest,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
)
from vllm_omni_plugin.stage.errors import StageError, StageRequestError
from vllm_omni_plugin.stage.input_processor import request_size

if TYPE_CHECKING:
    from vllm_omni_plugin.families.bagel.settings import BagelSettings

VLM_THINK_SYSTEM_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the user with the "
    "answer. \nThe reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning "
    "process here </think> answer here"
)
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \nThe "
    "planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
    "image here"
)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CONTEXTS = ("cond", "cfg_text", "cfg_img")
DEFAULT_MAX_TEXT_TOKENS = 512
EXPORT = {OMNI_KEY: {EXPORT_CONTEXT: True}}


def unwrap_text(text: str) -> str:
    """A prompt already wrapped in ``<|im_start|>...<|im_end|>`` (as vllm-omni clients send it) is not
    wrapped twice: the processor adds BAGEL's markers itself."""
    stripped = text.strip()
    if stripped.startswith(IM_START):
        stripped = stripped[len(IM_START) :]
    if stripped.endswith(IM_END):
        stripped = stripped[: -len(IM_END)]
    return stripped.strip()


@dataclass(frozen=True)
class BagelTokens:
    """Token ids of a BAGEL model folder and its text segments."""

    tokenizer: Any
    bos: int
    eos: int
    image_pad: int

    def segment(self, text: str) -> list[int]:
        """A text segment of a context: ``<|im_start|> text <|im_end|>``."""
        return [self.bos, *self.tokenizer.encode(text, add_special_tokens=False), self.eos]

    def decode(self, token_ids: list[int]) -> str:
        """Generated text up to (without) ``<|im_end|>``."""
        ids = list(token_ids)
        if self.eos in ids:
            ids = ids[: ids.index(self.eos)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def bagel_tokens(model_dir: str) -> BagelTokens:
    from transformers import AutoTokenizer

    from vllm_omni_plugin.models.bagel.config import read_special_tokens

    tokens = read_special_tokens(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return BagelTokens(tokenizer=tokenizer, bos=tokens.bos, eos=tokens.eos, image_pad=tokens.image_pad)


@dataclass
class ContextPlan:
    """The contexts of one image request and how the thinker obtains each (BAGEL's bookkeeping)."""

    main: list[int]
    """``cond``'s prompt (think mode: the prompt the plan is written from; the plan is appended later)."""
    images: int = 0
    companions: dict[str, list[int]] = field(default_factory=dict)
    """Contexts that need requests of their own, by name."""
    prefixes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Contexts that are a prefix of ``cond``: name -> (text tokens kept, images kept)."""
    same_as_cond: tuple[str, ...] = ()
    empty: tuple[str, ...] = ()


def plan_contexts(
    tokens: BagelTokens, prompt: str, images: int, negative: str | None, think: bool
) -> ContextPlan:
    """Prompt ids (one ``<|image_pad|>`` per image) of every context a generation request needs."""
    system = tokens.segment(GEN_THINK_SYSTEM_PROMPT) if think else []
    image_part = [tokens.image_pad] * images
    text = tokens.segment(prompt)
    plan = ContextPlan(main=system + image_part + text, images=images)
    if negative:
        plan.companions["cfg_text"] = system + image_part + tokens.segment(negative)
    elif images or think:
        plan.prefixes["cfg_text"] = (len(system), images)
    else:
        plan.empty = ("cfg_text",)
    if images:
        plan.companions["cfg_img"] = system + text
    elif think:
        plan.prefixes["cfg_img"] = (len(system) + len(text), 0)
    else:
        plan.same_as_cond = ("cfg_img",)
    return plan


def image_block_tokens(model_dir: str, image: Any, *, vae: bool = True) -> int:
    """Tokens one input image takes in a context: its VAE block (an edit's; ``vae``) and its ViT block,
    markers included."""
    from vllm_omni_plugin.models.bagel.transforms import ImageTransform, as_pil

    cfg = _config(model_dir)
    width, height = ImageTransform(cfg.vae_transform).size(*as_pil(image).size)
    vit_w, vit_h = ImageTransform(cfg.vit_transform).size(width, height)
    vit = (vit_h // cfg.vit.patch_size) * (vit_w // cfg.vit.patch_size) + 2
    if not vae:
        return vit
    return (height // cfg.latent_downsample) * (width // cfg.latent_downsample) + 2 + vit


def check_thinker_room(
    context: Any, prompt_tokens: int, images: list[Any], generated: int, what: str, prompt: str = "prompt"
) -> None:
    """Refuse, before the thinker runs, a request its ``max_model_len`` cannot hold: the prompt, the source
    images and what it is to generate there (``what``: the plan, the answer, the image's one token), with
    every count named (vLLM would name one total, the generated part counted as input)."""
    limit = context.deployment.stage(context.stage_id).engine_args.get("max_model_len")
    if not limit:
        return
    edit = context.request.modality != "text"
    image_tokens = sum(image_block_tokens(context.model, image, vae=edit) for image in images)
    total = prompt_tokens + image_tokens + generated
    if total <= int(limit):
        return
    room = int(limit) - prompt_tokens - image_tokens
    held, verb = (f"the {prompt} and source images", "leave") if images else (f"the {prompt}", "leaves")
    numbers = f"{prompt} {prompt_tokens}" + (f" + source images {image_tokens}" if images else "")
    advice = f"{held} {verb} {room} tokens for it" if room > 0 else f"{held} alone {verb} no room"
    raise StageRequestError(
        f"this request needs {total} tokens of the thinker's max_model_len {limit}: {numbers} + {what} "
        f"{generated}; {advice}",
        stage_id=context.stage_id,
        request_id=context.request.request_id,
    )


def _config(model_dir: str) -> Any:
    from vllm_omni_plugin.models.bagel.config import cached_bagel_config

    return cached_bagel_config(model_dir)


def settings(context: Any) -> BagelSettings:
    """The request's BAGEL settings, complete (the input processor put the deploy config's and the
    authors' under the request's)."""
    return context.request.settings


def thinks(context: Any) -> bool:
    """Think mode (the request's, else the deploy config's ``think``: ``deploy/bagel_think.yaml``)."""
    return bool(settings(context).think)


def request2thinker(sources: dict[int, Any], context: Any) -> StageLLMCoreRequest:
    """The user's request -> the thinker's request (with companion requests for image generation)."""
    request = context.request
    tokens = bagel_tokens(context.model)
    prompt = unwrap_text(request.prompt)
    images = list(request.images or [])
    user = dict(request.sampling_params or {})
    if request.seed is not None:
        user.setdefault("seed", request.seed)
    mm = {"image": images} if images else None
    if request.modality == "text":
        system = tokens.segment(VLM_THINK_SYSTEM_PROMPT) if thinks(context) else []
        ids = system + [tokens.image_pad] * len(images) + tokens.segment(prompt) + [tokens.bos]
        sampling = {"max_tokens": DEFAULT_MAX_TEXT_TOKENS, "temperature": 0.0, **user}
        if "max_tokens" in user:  # what the client asked for must fit; the default stops at the end
            asked = int(user["max_tokens"])
            check_thinker_room(
                context, len(ids) - len(images), images, asked, f"the answer (max_tokens {asked})"
            )
        check_thinker_room(context, len(ids) - len(images), images, 1, "at least one answer token")
        return StageLLMCoreRequest(
            request_id=request.request_id,
            stage_id=context.stage_id,
            prompt_token_ids=ids,
            sampling_params={
                **sampling,
                "stop_token_ids": [tokens.eos],
                "detokenize": True,  # the answer goes back as text
            },
            multi_modal_data=mm,
            mm_processor_kwargs={"bagel_vae": False} if images else None,
        )
    think = thinks(context)
    plan = plan_contexts(tokens, prompt, len(images), request.negative_prompt, think)
    text_tokens = len(plan.main) - len(images)
    if "cfg_text" in plan.companions:  # the negative prompt's context, built beside the request's
        negative = len(plan.companions["cfg_text"]) - len(images)
        check_thinker_room(context, negative, images, 1, "the image's token", "negative prompt")
    if think:  # write the plan first; continue_thinker then builds the contexts
        # BAGEL's max_think_token_n counts the start token: 1000 lets it write 999 tokens.
        max_think = int(settings(context).max_think_tokens or 0) - 1
        # cond is then the prompt, the plan (up to max_think, in its markers) and the image's token
        what = f"the plan (max_think_tokens {max_think + 1}) with its markers and the image's token"
        check_thinker_room(context, text_tokens, images, max_think + 3, what)
        return StageLLMCoreRequest(
            request_id=request.request_id,
            stage_id=context.stage_id,
            prompt_token_ids=plan.main + [tokens.bos],
            sampling_params={
                "temperature": 0.0,
                **user,
                "max_tokens": max_think,
                "stop_token_ids": [tokens.eos],
                "detokenize": False,
            },
            multi_modal_data=mm,
        )
    check_thinker_room(context, text_tokens, images, 1, "the image's token")
    return _context_request(request, context, plan, plan.main, mm)


def _context_request(
    request: Any, context: Any, plan: ContextPlan, cond: list[int], mm: dict[str, Any] | None
) -> StageLLMCoreRequest:
    """The request that builds ``cond`` and its companions, each exporting its context."""
    export = {"max_tokens": 1, "temperature": 0.0, "detokenize": False, "extra_args": EXPORT}
    stage_id = context.stage_id
    companions = {
        name: StageLLMCoreRequest(
            request_id=f"{request.request_id}:{name}",
            stage_id=stage_id,
            prompt_token_ids=ids,
            sampling_params=export,
            multi_modal_data=mm if name == "cfg_text" else None,  # cfg_img: the context without the image
        )
        for name, ids in plan.companions.items()
    }
    return StageLLMCoreRequest(
        request_id=request.request_id,
        stage_id=stage_id,
        prompt_token_ids=cond,
        sampling_params=export,
        multi_modal_data=mm,
        companions=companions,
        companion_timeout_s=context.deployment.stage(stage_id).companion_timeout_s,
    )


def continue_thinker(output: StageLLMCoreOutput, context: Any) -> StageLLMCoreRequest | None:
    """Think mode, once the plan is written: the request that builds the contexts, the plan (decoded and
    encoded again, as BAGEL does) appended to ``cond``. None when the thinker is done."""
    request = context.request
    if not thinks(context) or request.modality == "text" or "context" in output.stage_outputs:
        return None
    tokens = bagel_tokens(context.model)
    images = len(request.images or [])
    plan = plan_contexts(tokens, unwrap_text(request.prompt), images, request.negative_prompt, True)
    plan_text = tokens.decode(output.token_ids)
    context.notes["think_text"] = plan_text
    cond = plan.main + tokens.segment(plan_text)
    return _context_request(request, context, plan, cond, {"image": list(request.images)} if images else None)


# --- thinker -> DiT ----------------------------------------------------------------------------------


def _context_of(output: StageLLMCoreOutput, name: str) -> dict[str, Any]:
    extra = output.stage_outputs or {}
    if "context_error" in extra:
        raise StageError(f"the {name} context: {extra['context_error']}", stage_id=output.stage_id)
    ctx = extra.get("context")
    if not isinstance(ctx, dict):
        raise StageError(f"the thinker returned no {name} context", stage_id=output.stage_id)
    return ctx


def thinker2dit(sources: dict[int, Any], context: Any) -> StageDiffusionCoreRequest | None:
    """The thinker's contexts -> the DiT's generation request; None for a text request (no DiT)."""
    from vllm_omni_plugin.families.bagel.request import BagelContext, BagelGenerationRequest

    request = context.request
    if request.modality == "text":
        return None
    output: StageLLMCoreOutput = sources[min(sources)]
    tokens = bagel_tokens(context.model)
    images = list(request.images or [])
    plan = plan_contexts(
        tokens, unwrap_text(request.prompt), len(images), request.negative_prompt, thinks(context)
    )
    cond = _context_of(output, "cond")
    contexts = {"cond": BagelContext(kv=cond["kv"], kv_len=int(cond["kv_len"]), rope=int(cond["rope"]))}
    for name in plan.empty:
        contexts[name] = BagelContext.empty()
    for name in plan.same_as_cond:  # the same tensor travels once
        contexts[name] = BagelContext(
            kv_len=contexts["cond"].kv_len, rope=contexts["cond"].rope, prefix_of="cond"
        )
    image_tokens = sum(image_block_tokens(context.model, image) for image in images)
    for name, (text_kept, images_kept) in plan.prefixes.items():
        length = text_kept + (image_tokens if images_kept else 0)
        contexts[name] = BagelContext(kv_len=length, rope=text_kept + 2 * images_kept, prefix_of="cond")
    missing = [name for name in plan.companions if name not in (output.companions or {})]
    if missing:
        raise StageError(
            f"the thinker did not deliver the {', '.join(missing)} context", stage_id=output.stage_id
        )
    for name in plan.companions:
        ctx = _context_of(output.companions[name], name)
        contexts[name] = BagelContext(kv=ctx["kv"], kv_len=int(ctx["kv_len"]), rope=int(ctx["rope"]))
    height, width = generation_size(context)
    generation = request.runner_request(
        BagelGenerationRequest,
        cond=contexts["cond"],
        cfg_text=contexts["cfg_text"],
        cfg_img=contexts["cfg_img"],
        height=height,
        width=width,
        sampling=dit_sampling(context),
    )
    return StageDiffusionCoreRequest(
        request_id=request.request_id, stage_id=context.stage_id, diffusion=generation
    )


def dit_sampling(context: Any) -> Any:
    """The generation stage's sampling: the request's complete settings and step count."""
    from vllm_omni_plugin.families.bagel.request import BagelSampling

    given = msgspec.structs.asdict(settings(context))
    params = {name: given[name] for name in BagelSampling.__struct_fields__ if name in given}
    params["num_inference_steps"] = context.request.num_inference_steps
    params["cfg_interval"] = tuple(params["cfg_interval"])
    try:
        return msgspec.convert(params, BagelSampling)
    except msgspec.ValidationError as exc:
        raise StageRequestError(f"bad BAGEL generation setting: {exc}", stage_id=context.stage_id) from None


def generation_size(context: Any) -> tuple[int, int]:
    """The output size: an edit keeps its input's size after BAGEL's VAE resize; text-to-image takes the
    request's."""
    from vllm_omni_plugin.models.bagel.transforms import ImageTransform, as_pil

    request = context.request
    if request.images:
        spec = _config(context.model).vae_transform
        width, height = ImageTransform(spec).size(*as_pil(request.images[0]).size)
        return int(height), int(width)
    return request_size(request, context.stage_id)
