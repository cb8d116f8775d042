"""Sequence parallelism over a denoiser group (``sequence_parallel_size``; the group, its peers and its
wire are ``parallel.py``'s): every rank runs the whole forward on its contiguous share of the image tokens.

A denoiser's :class:`SequencePlan` says where its image tokens are cut (the output of the module that
hands them to the blocks, and the image part of its rotary table), where they are joined again (the input
of the final norm), and how each attention gets the keys and values of the whole image:

- SD3 adds positions to the tokens before the blocks and projects the image's keys and values from the
  image tokens alone (``to_k``/``to_v``), so those projections' outputs are all-gathered.
- FLUX, Qwen-Image and GLM-Image rotate queries and keys inside the attention, so a rank's queries need
  its own rotary rows and the gathered keys everyone's: the keys and values are gathered after the
  rotation, at the attention call. Their processors run as diffusers wrote them, with
  ``dispatch_attention_fn`` bound, for that processor alone, to one that all-gathers the image part
  (after the text, which every rank holds whole) of the keys, the values and a mask, and is diffusers'
  own outside a sequence-parallel call.

That is K/V all-gather attention rather than Ulysses (an all-to-all of heads, which gloo lacks) or Ring
(K/V blocks passed around with an online softmax): a rank's attention still holds the whole image's keys,
but its queries, projections and MLPs shrink with the rank count.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.diffusion.parallel import DenoiserGroup, DenoiserStandIn, _wait
from vllm_omni_plugin.diffusion.step_batching import _by_name, _is_tensor


@dataclass(frozen=True)
class SequencePlan:
    """Where a denoiser's image tokens are cut over the ranks and joined again."""

    embeds: tuple[Any, ...]
    """The modules whose outputs are (added up to) the blocks' image tokens, ``(batch, tokens, dim)``: cut."""
    final: Any
    """The module whose first argument is the blocks' last image tokens: gathered."""
    tokens: Callable[[dict[str, Any]], int | None]
    """The image tokens of a call (None: not known; the call then runs on rank 0)."""
    projections: tuple[Any, ...] = ()
    """Linear projections whose outputs (image keys and values, token by token) are gathered."""
    rope: Any = None
    """The module whose output is the rotary table of the text and image positions: its image rows cut."""
    cut_rope: Callable[[Any, int, int, int], Any] | None = None
    """``cut_rope(output, text_tokens, rank, size)``: ``rope``'s output with this rank's image rows."""
    text_tokens: Callable[[dict[str, Any]], int] | None = None
    """The text tokens of a call, which precede the image tokens in its attentions (gathered there)."""
    local: Callable[[Any, dict[str, Any]], str | None] = lambda _module, _kwargs: None
    """``local(module, kwargs)``: why a call cannot be shared (None: it can)."""


def sequence_plan(module: Any) -> SequencePlan:
    """``module``'s plan, or ValueError saying why it has none."""
    name = type(module).__name__
    planner = _PLANNERS.get(name)
    if planner is None:
        raise ValueError(
            f"sequence parallelism covers {', '.join(sorted(_PLANNERS))}, not {name}; "
            "remove sequence_parallel_size"
        )
    return planner(module)


def _latent_tokens(patch: int) -> Callable[[dict[str, Any]], int | None]:
    def tokens(kwargs: dict[str, Any]) -> int | None:
        latents = kwargs.get("hidden_states")
        if not _is_tensor(latents) or latents.dim() != 4:
            return None
        return (int(latents.shape[-2]) // patch) * (int(latents.shape[-1]) // patch)

    return tokens


def _sd3_plan(module: Any) -> SequencePlan:
    """SD3 (and SD3.5): positions added before the blocks; each attention's image keys and values come
    from the image tokens alone (``to_k``/``to_v``; the text's from ``add_k_proj``/``add_v_proj``)."""
    projections: list[Any] = []
    for block in module.transformer_blocks:
        for attn in (block.attn, getattr(block, "attn2", None)):
            if attn is not None:
                projections += [attn.to_k, attn.to_v]
    return SequencePlan(
        embeds=(module.pos_embed,),
        final=module.norm_out,
        tokens=_latent_tokens(int(module.config.patch_size)),
        projections=tuple(projections),
    )


def _packed_tokens(kwargs: dict[str, Any]) -> int | None:
    latents = kwargs.get("hidden_states")
    return int(latents.shape[1]) if _is_tensor(latents) and latents.dim() == 3 else None


def _text_tokens(kwargs: dict[str, Any]) -> int:
    return int(kwargs["encoder_hidden_states"].shape[1])


def _rotating_plan(
    module: Any,
    embeds: tuple[Any, ...],
    rope: Any,
    cut_rope: Callable[[Any, int, int, int], Any],
    tokens: Callable[[dict[str, Any]], int | None] = _packed_tokens,
    local: Callable[[Any, dict[str, Any]], str | None] | None = None,
) -> SequencePlan:
    """A plan for a denoiser that rotates queries and keys inside its attentions, each over [text,
    image]: keys and values gathered at the attention call, the final norm's input gathered."""
    _gather_in_attention(module)
    return SequencePlan(
        embeds=embeds,
        final=module.norm_out,
        tokens=tokens,
        rope=rope,
        cut_rope=cut_rope,
        text_tokens=_text_tokens,
        local=local or SequencePlan.local,
    )


def _flux_plan(module: Any) -> SequencePlan:
    """FLUX: packed image tokens after ``x_embedder``; one rotary table (cos, sin) for the text then the
    image positions; every attention (double- and single-stream) runs over [text, image]."""

    def cut_rope(output: Any, text: int, rank: int, size: int) -> Any:
        return tuple(_cut_after(t, text, rank, size, dim=0) for t in output)

    return _rotating_plan(module, (module.x_embedder,), module.pos_embed, cut_rope)


def _qwen_image_plan(module: Any) -> SequencePlan:
    """Qwen-Image (and its edit pipelines, whose source images' tokens follow the noise's): image tokens
    after ``img_in``; rotary tables (image, text) apart; every attention runs over [text, image]."""

    def cut_rope(output: Any, text: int, rank: int, size: int) -> Any:
        image, text_freqs = output
        return image.chunk(size, dim=0)[rank], text_freqs

    def local(module: Any, kwargs: dict[str, Any]) -> str | None:
        # A per-token modulation index over the whole sequence (Qwen-Image-Edit-2511's zero_cond_t).
        return "zero_cond_t" if getattr(module, "zero_cond_t", False) else None

    return _rotating_plan(module, (module.img_in,), module.pos_embed, cut_rope, local=local)


def _glm_image_plan(module: Any) -> SequencePlan:
    """GLM-Image's DiT: image tokens are the patches' projection plus the prior tokens' (both cut); the
    rotary table covers the image positions alone; every attention runs over [glyph text, image]. An
    edit's calls that write or read its source images' cached keys and values stay on rank 0: the cache
    holds whole images."""

    def cut_rope(output: Any, text: int, rank: int, size: int) -> Any:
        return tuple(t.chunk(size, dim=0)[rank] for t in output)

    def local(module: Any, kwargs: dict[str, Any]) -> str | None:
        caches = kwargs.get("kv_caches")
        return "source-image cache" if caches is not None and caches[0].mode in ("write", "read") else None

    embeds = (module.image_projector, module.prior_projector)
    tokens = _latent_tokens(int(module.config.patch_size))
    return _rotating_plan(module, embeds, module.rope, cut_rope, tokens=tokens, local=local)


_PLANNERS: dict[str, Callable[[Any], SequencePlan]] = {
    "SD3Transformer2DModel": _sd3_plan,
    "FluxTransformer2DModel": _flux_plan,
    "QwenImageTransformer2DModel": _qwen_image_plan,
    "GlmImageTransformer2DModel": _glm_image_plan,
}
"""The denoisers with a plan, by class name."""


# --- a call ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Exchange:
    """The sequence-parallel call running on this thread: its group, this rank, the ranks, and the text
    tokens ahead of the image tokens in its attentions."""

    group: Any
    rank: int
    size: int
    text: int


_current = threading.local()


def sequence_call(
    module: Any, plan: SequencePlan, kwargs: dict[str, Any], group: Any, rank: int, size: int
) -> Any:
    """One rank's part of a sequence-parallel forward (every rank calls it with the same arguments):
    hooks cut the image tokens (and their rotary rows) and gather what the plan gathers, for this call."""
    text = plan.text_tokens(kwargs) if plan.text_tokens is not None else 0

    def cut(_module: Any, _args: Any, output: Any) -> Any:
        return output.chunk(size, dim=1)[rank].contiguous()

    def cut_rope(_module: Any, _args: Any, output: Any) -> Any:
        assert plan.cut_rope is not None
        return plan.cut_rope(output, text, rank, size)

    def gather(_module: Any, _args: Any, output: Any) -> Any:
        return _all_gather(group, output, rank, size, dim=1)

    def gather_input(_module: Any, args: Any, kwargs: Any) -> Any:
        return (_all_gather(group, args[0], rank, size, dim=1), *args[1:]), kwargs

    handles = [
        *(embed.register_forward_hook(cut) for embed in plan.embeds),
        plan.final.register_forward_pre_hook(gather_input, with_kwargs=True),
        *(p.register_forward_hook(gather) for p in plan.projections),
    ]
    if plan.rope is not None:
        handles.append(plan.rope.register_forward_hook(cut_rope))
    _current.exchange = _Exchange(group, rank, size, text)
    try:
        return module(**kwargs)
    finally:
        _current.exchange = None
        for handle in handles:
            handle.remove()


def _cut_after(tensor: Any, keep: int, rank: int, size: int, dim: int) -> Any:
    """``tensor`` with its first ``keep`` entries along ``dim`` and this rank's share of the rest."""
    import torch

    head, rest = tensor.narrow(dim, 0, keep), tensor.narrow(dim, keep, tensor.shape[dim] - keep)
    return torch.cat([head, rest.chunk(size, dim=dim)[rank]], dim=dim)


EXCHANGE_TAG = 1
"""The tag of the ranks' exchanges inside a forward (the wire's messages are tag 0)."""


def _all_gather(group: Any, tensor: Any, rank: int, size: int, dim: int) -> Any:
    """Every rank's share of ``tensor``, joined along ``dim`` in rank order (staged through host memory,
    as every exchange of the group is). Each pair of ranks swaps its shares by send and receive, posted
    together: gloo's ``allgather`` took 0.5-0.7 ms for 1 KiB between two processes here, a swap 0.1 ms."""
    import torch

    local = tensor.detach().to("cpu").contiguous()
    parts = [local if peer == rank else torch.empty_like(local) for peer in range(size)]
    works = []
    for peer in range(size):
        if peer != rank:
            works.append(group.send([local], peer, EXCHANGE_TAG))
            works.append(group.recv([parts[peer]], peer, EXCHANGE_TAG))
    for work in works:
        _wait(work)
    return torch.cat(parts, dim=dim).to(tensor.device)


def _gathering_dispatch(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' ``dispatch_attention_fn`` (``query``/``key``/``value``: ``(batch, tokens, heads, dim)``,
    text tokens first) with, inside a sequence-parallel call, the image part of the keys, the values and
    the mask's key axis gathered from every rank."""

    @functools.wraps(dispatch)
    def gathered(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        exchange: _Exchange | None = getattr(_current, "exchange", None)
        if exchange is None:
            return dispatch(query, key, value, *args, **kwargs)
        text, group, rank, size = exchange.text, exchange.group, exchange.rank, exchange.size
        import torch

        def whole(tensor: Any, dim: int) -> Any:
            own = tensor.narrow(dim, text, tensor.shape[dim] - text)
            return torch.cat([tensor.narrow(dim, 0, text), _all_gather(group, own, rank, size, dim)], dim=dim)

        if key.shape == value.shape and key.dtype == value.dtype:  # both in one exchange
            pair = whole(torch.stack([key, value]), 2)
            key, value = pair[0], pair[1]
        else:
            key, value = whole(key, 1), whole(value, 1)
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.shape[-1] > 1:  # one entry per key (a single one broadcasts)
            kwargs["attn_mask"] = whole(mask, mask.dim() - 1)
        return dispatch(query, key, value, *args, **kwargs)

    return gathered


def _gather_in_attention(module: Any) -> None:
    """Give every attention of ``module`` a processor that gathers keys and values at the attention call
    (:func:`_gathering_dispatch`); once per module (a peer plans again after rank 0)."""
    for attn in module.modules():
        processor = getattr(attn, "processor", None)
        if (
            processor is None
            or isinstance(processor, _GatheringProcessor)
            or not hasattr(attn, "set_processor")
        ):
            continue
        attn.set_processor(_gathering_class(type(processor))(processor))


class _GatheringProcessor:
    """An attention processor run as its class wrote it, with ``dispatch_attention_fn`` gathering (a
    subclass per processor class: :func:`_gathering_class`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@functools.cache
def _gathering_class(processor: type) -> type[_GatheringProcessor]:
    call = processor.__call__
    if "dispatch_attention_fn" not in call.__code__.co_names:
        raise ValueError(
            f"sequence parallelism: {processor.__name__} computes attention without diffusers' "
            "dispatch_attention_fn; remove sequence_parallel_size"
        )
    names = dict(call.__globals__)
    names["dispatch_attention_fn"] = _gathering_dispatch(names["dispatch_attention_fn"])
    rebound = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
    rebound.__kwdefaults__ = call.__kwdefaults__

    # wraps: the signature is the processor's own (diffusers passes a processor only the keyword
    # arguments its __call__ names)
    @functools.wraps(call)
    def __call__(self: _GatheringProcessor, *args: Any, **kwargs: Any) -> Any:
        return rebound(self._inner, *args, **kwargs)

    return type(f"Gathering{processor.__name__}", (_GatheringProcessor,), {"__call__": __call__})


# --- the denoiser as the pipelines call it -----------------------------------------------------------------


class SequenceParallelDenoiser(DenoiserStandIn):
    """The denoiser as the pipelines call it on a sequence-parallel replica: each forward's image tokens
    cut over the group's ranks (:meth:`DenoiserGroup.forward_sequence`), or the forward computed here
    where they cannot be (a token count the ranks do not divide, a hook inside the denoiser, a call the
    plan keeps local)."""

    def __init__(self, module: Any, group: DenoiserGroup, plan: SequencePlan) -> None:
        super().__init__(module, group)
        self._plan = plan
        self.split_calls = 0
        """Forwards whose tokens went over the group (tests count them)."""

    def _splittable(self, kwargs: dict[str, Any]) -> bool:
        if self._hooked() or self._plan.local(self._module, kwargs) is not None:
            return False
        tokens = self._plan.tokens(kwargs)
        return tokens is not None and tokens % self._group.size == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = _by_name(self._signature, args, kwargs)
        group = self._group
        # Every forward holds the group's lock: a forward here must not run into another's hooks.
        with group._lock:
            if group.failed is not None or not self._splittable(named):
                return self._module(**named)
        self.split_calls += 1
        return group.forward_sequence(self._module, named, self._plan)
