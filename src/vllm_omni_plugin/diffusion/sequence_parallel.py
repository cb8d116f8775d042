"""Sequence parallelism over a denoiser group (``sequence_parallel_size``; the group and its peers are
``peer_group.py``'s): every rank runs the whole forward on its contiguous share of the image tokens.

A denoiser's :class:`SequencePlan` says where its image tokens are cut (the output of the module that
hands them to the blocks, and the image part of its rotary table) and where they are joined again (the
input of the final norm). Its attentions exchange at the attention call itself, after the projections,
norms and rotation, each running its own share of the tokens: every attention processor runs as diffusers
wrote it, with the attention function it calls bound, for that processor class alone (no global patch;
diffusers' own outside a sequence-parallel call), to one that exchanges: ``dispatch_attention_fn`` (FLUX,
Qwen-Image, GLM-Image: ``(batch, tokens, heads, dim)``, [text, image]) or, for SD3's
``JointAttnProcessor2_0``, which calls ``F.scaled_dot_product_attention`` directly, that (through its own
``F``: ``(batch, heads, tokens, dim)``, [image, text]). The text tokens every rank holds whole.

- Ulysses (DeepSpeed's all-to-all attention), where every attention's head count divides by the ranks:
  an all-to-all gives each rank the whole image's queries, keys and values for its share of the heads (the
  text's it slices itself), it attends over [text, whole image] (a key mask gathered over the image), and
  a second all-to-all returns each rank its tokens' outputs over all heads.
- K/V all-gather otherwise (and for a call whose mask differs between queries or heads): each rank's
  queries, all heads, against the image keys and values (and mask) gathered from every rank.

Which one a replica uses it logs at start. Both compute the same attention; Ulysses is built for more
ranks (its exchanges shrink with them, the all-gather's do not) and many heads. The ranks exchange by send
and receive posted together (:func:`_swap`), not gloo's all-to-all, which is no faster at these sizes
(the measurements: ``docs/benchmarks.md``).
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni_plugin.diffusion.peer_group import DenoiserGroup, DenoiserStandIn
from vllm_omni_plugin.diffusion.step_batching import ArgumentJoin, by_name, is_tensor, without_unused

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequencePlan:
    """Where a denoiser's image tokens are cut over the ranks and joined again."""

    embeds: tuple[Any, ...]
    """The modules whose outputs are (added up to) the blocks' image tokens, ``(batch, tokens, dim)``: cut."""
    final: Any
    """The module whose first argument is the blocks' last image tokens: gathered."""
    tokens: Callable[[dict[str, Any]], int | None]
    """The image tokens of a call (None: not known; the call then runs on rank 0)."""
    heads: tuple[int, ...] = ()
    """The head counts of its attentions (0: not known), which :func:`attention_method` splits."""
    text_first: bool = True
    """Whether its attentions' text tokens precede the image's (SD3's follow them)."""
    rope: Any = None
    """The module whose output is the rotary table of the text and image positions: its image rows cut."""
    cut_rope: Callable[[Any, int, int, int], Any] | None = None
    """``cut_rope(output, text_tokens, rank, size)``: ``rope``'s output with this rank's image rows."""
    text_tokens: Callable[[dict[str, Any]], int] | None = None
    """The text tokens of a call, which precede the image's rotary rows in ``rope``'s output."""
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
        if not is_tensor(latents) or latents.dim() != 4:
            return None
        return (int(latents.shape[-2]) // patch) * (int(latents.shape[-1]) // patch)

    return tokens


def _sd3_plan(module: Any) -> SequencePlan:
    """SD3 (and SD3.5): positions added before the blocks; each joint attention runs over [image, text]
    (SD3.5's second one over the image alone), through ``F.scaled_dot_product_attention``."""
    return SequencePlan(
        embeds=(module.pos_embed,),
        final=module.norm_out,
        tokens=_latent_tokens(int(module.config.patch_size)),
        heads=_exchange_in_attention(module),
        text_first=False,
    )


def _packed_tokens(kwargs: dict[str, Any]) -> int | None:
    latents = kwargs.get("hidden_states")
    return int(latents.shape[1]) if is_tensor(latents) and latents.dim() == 3 else None


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
    image]: the image's rotary rows cut with its tokens."""
    return SequencePlan(
        embeds=embeds,
        final=module.norm_out,
        tokens=tokens,
        heads=_exchange_in_attention(module),
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


def attention_method(plan: SequencePlan, size: int) -> str:
    """``"ulysses"`` where every attention's head count divides by ``size`` (the ranks), else
    ``"all-gather"`` (each rank's queries against the whole image's gathered keys and values)."""
    return "ulysses" if plan.heads and all(h > 0 and h % size == 0 for h in plan.heads) else "all-gather"


@dataclass(frozen=True)
class _Exchange:
    """The sequence-parallel call running on this thread: its group, this rank, the ranks, this rank's
    image tokens in each attention, whether they precede the text there, and the attention method."""

    group: Any
    rank: int
    size: int
    image: int
    text_first: bool
    ulysses: bool


_current = threading.local()


def sequence_call(
    module: Any, plan: SequencePlan, kwargs: dict[str, Any], group: Any, rank: int, size: int
) -> Any:
    """One rank's part of a sequence-parallel forward (every rank calls it with the same arguments):
    hooks cut the image tokens (and their rotary rows) and gather the blocks' output, for this call; the
    attentions exchange through :func:`_exchanging`."""
    text = plan.text_tokens(kwargs) if plan.text_tokens is not None else 0
    tokens = plan.tokens(kwargs)
    assert tokens is not None and tokens % size == 0

    def cut(_module: Any, _args: Any, output: Any) -> Any:
        return output.chunk(size, dim=1)[rank].contiguous()

    def cut_rope(_module: Any, _args: Any, output: Any) -> Any:
        assert plan.cut_rope is not None
        return plan.cut_rope(output, text, rank, size)

    def gather_input(_module: Any, args: Any, kwargs: Any) -> Any:
        return (_all_gather(group, args[0], rank, size, dim=1), *args[1:]), kwargs

    handles = [
        *(embed.register_forward_hook(cut) for embed in plan.embeds),
        plan.final.register_forward_pre_hook(gather_input, with_kwargs=True),
    ]
    if plan.rope is not None:
        handles.append(plan.rope.register_forward_hook(cut_rope))
    ulysses = attention_method(plan, size) == "ulysses"
    _current.exchange = _Exchange(group, rank, size, tokens // size, plan.text_first, ulysses)
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


def _swap(group: Any, sends: Any, received: Any, rank: int, size: int) -> None:
    """``sends[peer]`` (contiguous host tensors) to every peer, into ``received[peer]`` of each, this rank's
    own row left to the caller. Sends and receives are posted together, then awaited: as fast as gloo's
    ``alltoall_base`` (faster than ``allgather``) at the sizes a forward exchanges."""
    peers = [peer for peer in range(size) if peer != rank]
    # every receive before any send: a message that finds its receive posted takes gloo's fast path
    works = [group.recv([received[peer]], peer, EXCHANGE_TAG) for peer in peers]
    works += [group.send([sends[peer]], peer, EXCHANGE_TAG) for peer in peers]
    for work in works:
        work.wait()


def _all_to_all(group: Any, rows: Any, rank: int, size: int) -> Any:
    """``rows[peer]`` to every peer; row ``peer`` of the result is what that peer sent this rank (staged
    through host memory, as every exchange of the group is)."""
    import torch

    local = rows.detach().to("cpu").contiguous()
    received = torch.empty_like(local)
    received[rank] = local[rank]
    _swap(group, local, received, rank, size)
    return received.to(rows.device)


def _all_gather(group: Any, tensor: Any, rank: int, size: int, dim: int) -> Any:
    """Every rank's share of ``tensor``, joined along ``dim`` in rank order."""
    import torch

    local = tensor.detach().to("cpu").contiguous()
    parts = [local if peer == rank else torch.empty_like(local) for peer in range(size)]
    _swap(group, [local] * size, parts, rank, size)
    return torch.cat(parts, dim=dim).to(tensor.device)


def _split(tensor: Any, image: int, text_first: bool, dim: int) -> tuple[Any, Any]:
    """``tensor``'s text and image parts along ``dim`` (``image`` entries, after or before the text)."""
    text = tensor.shape[dim] - image
    if text < 0:
        raise ValueError(
            f"sequence parallelism: an attention over {tensor.shape[dim]} tokens, not {image} images"
        )
    if text_first:
        return tensor.narrow(dim, 0, text), tensor.narrow(dim, text, image)
    return tensor.narrow(dim, image, text), tensor.narrow(dim, 0, image)


def _join(text: Any, image: Any, text_first: bool, dim: int) -> Any:
    import torch

    return torch.cat([text, image] if text_first else [image, text], dim=dim)


def _key_mask(mask: Any) -> bool:
    """Whether ``mask`` (None, or with a batch and a key axis, any between them of one entry) masks keys
    alone: the same for every query and head, so that it holds for a rank's whole-image queries too."""
    return mask is None or (mask.dim() >= 2 and all(n == 1 for n in mask.shape[1:-1]))


def _ulysses(attend: Callable[..., Any], query: Any, key: Any, value: Any, mask: Any, ex: _Exchange) -> Any:
    """Attention of ``(batch, tokens, heads, dim)`` inputs (one shape and dtype) by all-to-all: every rank
    sends each rank the image part of its queries, keys and values for that rank's share of the heads
    (and the mask's image keys); attends over the text (its own slice of the heads) and the whole image;
    and sends each rank its tokens' outputs for those heads, with the text's (which every rank needs), so
    that each rank gets its tokens over all heads. Two exchanges an attention."""
    import torch

    size, rank, image, first = ex.size, ex.rank, ex.image, ex.text_first
    batch, _seq, heads, dim = query.shape
    share = heads // size
    text_part, image_part = _split(torch.stack([query, key, value]), image, first, 2)
    # row p: the image tokens' heads of rank p, (3, batch, image, share, dim)
    rows = image_part.unflatten(3, (size, share)).movedim(3, 0).reshape(size, -1)
    width = rows.shape[1]
    keys = None if mask is None or mask.shape[-1] == 1 else _split(mask, image, first, mask.dim() - 1)
    carried = keys is not None and mask.dtype in (torch.bool, query.dtype)  # exact in the rows' dtype
    if carried:
        rows = torch.cat([rows, keys[1].reshape(1, -1).to(rows.dtype).expand(size, -1)], dim=1)
    got = _all_to_all(ex.group, rows, rank, size)
    whole_image = got[:, :width].reshape(size, 3, batch, image, share, dim).movedim(0, 2)
    own_text = text_part.narrow(3, rank * share, share)
    q, k, v = _join(own_text, whole_image.reshape(3, batch, size * image, share, dim), first, 2)
    if keys is not None:
        if carried:
            gathered = torch.cat(list(got[:, width:].reshape(size, *keys[1].shape)), dim=-1).to(mask.dtype)
        else:
            gathered = _all_gather(ex.group, keys[1], rank, size, mask.dim() - 1)
        mask = _join(keys[0], gathered, first, mask.dim() - 1)
    out_text, out_image = _split(attend(q, k, v, mask), size * image, first, 1)
    # row p: the text and rank p's image tokens, this rank's heads
    back = _join(
        out_text.expand(size, *out_text.shape), out_image.unflatten(1, (size, image)).movedim(1, 0), first, 2
    )
    got = _all_to_all(ex.group, back, rank, size)  # row p: this rank's tokens, rank p's heads
    return got.movedim(0, 2).reshape(batch, got.shape[2], heads, dim)


def _gathered(attend: Callable[..., Any], query: Any, key: Any, value: Any, mask: Any, ex: _Exchange) -> Any:
    """Attention of ``(batch, tokens, heads, dim)`` inputs with the image part of the keys, the values
    and the mask's key axis gathered from every rank: this rank's queries, all heads."""
    import torch

    def whole(tensor: Any, dim: int) -> Any:
        text, own = _split(tensor, ex.image, ex.text_first, dim)
        return _join(text, _all_gather(ex.group, own, ex.rank, ex.size, dim), ex.text_first, dim)

    if key.shape == value.shape and key.dtype == value.dtype:  # both in one exchange
        key, value = whole(torch.stack([key, value]), 2)
    else:
        key, value = whole(key, 1), whole(value, 1)
    if mask is not None and mask.shape[-1] > 1:  # one entry per key (a single one broadcasts)
        mask = whole(mask, mask.dim() - 1)
    return attend(query, key, value, mask)


def _exchanging(attend: Callable[..., Any], heads_first: bool) -> Callable[..., Any]:
    """``attend`` (diffusers' ``dispatch_attention_fn``, inputs ``(batch, tokens, heads, dim)``, or
    torch's ``scaled_dot_product_attention``, ``(batch, heads, tokens, dim)``: ``heads_first``) as it is
    outside a sequence-parallel call and for an attention onto other tokens than its queries' (keys every
    rank holds whole); inside one, by :func:`_ulysses`, or :func:`_gathered` where that cannot split the
    heads or the mask."""

    def flip(tensor: Any) -> Any:
        return tensor.transpose(1, 2) if heads_first else tensor

    @functools.wraps(attend)
    def exchanged(query: Any, key: Any, value: Any, attn_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        ex: _Exchange | None = getattr(_current, "exchange", None)
        seq = 2 if heads_first else 1
        if ex is None or not query.shape[seq] == key.shape[seq] == value.shape[seq]:
            return attend(query, key, value, attn_mask, *args, **kwargs)

        def inner(q: Any, k: Any, v: Any, mask: Any) -> Any:
            return flip(attend(flip(q), flip(k), flip(v), mask, *args, **kwargs))

        query, key, value = flip(query), flip(key), flip(value)
        heads = query.shape[2]
        alike = query.shape == key.shape == value.shape and query.dtype == key.dtype == value.dtype
        if ex.ulysses and heads % ex.size == 0 and alike and _key_mask(attn_mask):
            return flip(_ulysses(inner, query, key, value, attn_mask, ex))
        return flip(_gathered(inner, query, key, value, attn_mask, ex))

    return exchanged


def _exchange_in_attention(module: Any) -> tuple[int, ...]:
    """Give every attention of ``module`` a processor whose attention exchanges (:func:`_exchanging`);
    once per module (a peer plans again after rank 0). The attentions' head counts (0: not known)."""
    heads = []
    for attn in module.modules():
        processor = getattr(attn, "processor", None)
        if processor is None or not hasattr(attn, "set_processor"):
            continue
        heads.append(int(getattr(attn, "heads", 0) or 0))
        if not isinstance(processor, _ExchangingProcessor):
            attn.set_processor(_exchanging_class(type(processor))(processor))
    return tuple(heads)


class _ExchangingProcessor:
    """An attention processor run as its class wrote it, with its attention function exchanging (a
    subclass per processor class: :func:`_exchanging_class`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Functional:
    """``torch.nn.functional`` with its ``scaled_dot_product_attention`` exchanging: the ``F`` of a
    processor that calls it directly (SD3's ``JointAttnProcessor2_0``), for that processor alone."""

    def __init__(self) -> None:
        self.scaled_dot_product_attention = _exchanging(self._sdpa, heads_first=True)

    @staticmethod
    def _sdpa(*args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.nn.functional, name)


@functools.cache
def _exchanging_class(processor: type) -> type[_ExchangingProcessor]:
    call = processor.__call__
    names = dict(call.__globals__)
    if "dispatch_attention_fn" in call.__code__.co_names:
        names["dispatch_attention_fn"] = _exchanging(names["dispatch_attention_fn"], heads_first=False)
    elif {"F", "scaled_dot_product_attention"} <= set(call.__code__.co_names):
        names["F"] = _Functional()
    else:
        raise ValueError(
            f"sequence parallelism: {processor.__name__} computes attention without diffusers' "
            "dispatch_attention_fn or F.scaled_dot_product_attention; remove sequence_parallel_size"
        )
    rebound = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
    rebound.__kwdefaults__ = call.__kwdefaults__

    # wraps: the signature is the processor's own (diffusers passes a processor only the keyword
    # arguments its __call__ names)
    @functools.wraps(call)
    def __call__(self: _ExchangingProcessor, *args: Any, **kwargs: Any) -> Any:
        return rebound(self._inner, *args, **kwargs)

    return type(f"Exchanging{processor.__name__}", (_ExchangingProcessor,), {"__call__": __call__})


# --- the denoiser as the pipelines call it -----------------------------------------------------------------


class SequenceParallelDenoiser(DenoiserStandIn):
    """The denoiser as the pipelines call it on a sequence-parallel replica: each forward's image tokens
    cut over the group's ranks (:meth:`DenoiserGroup.exchange`), or the forward computed here
    where they cannot be (a token count the ranks do not divide, a hook inside the denoiser, a call the
    plan keeps local)."""

    def __init__(
        self,
        module: Any,
        group: DenoiserGroup,
        plan: SequencePlan,
        joins: Mapping[str, ArgumentJoin] | None = None,
    ) -> None:
        super().__init__(module, group)
        self._plan = plan
        self._joins: Mapping[str, ArgumentJoin] = joins or {}
        """The runner's step joins: an argument one says a call leaves unused goes to the peers as None."""
        self.split_calls = 0
        """Forwards whose tokens went over the group (tests count them)."""
        if attention_method(plan, group.size) == "ulysses":
            how = "Ulysses attention (an all-to-all of heads)"
        else:
            heads = sorted(set(plan.heads))
            how = f"K/V all-gather attention (head counts {heads} do not divide by {group.size})"
        logger.info("sequence parallelism over %d ranks: %s", group.size, how)

    def _splittable(self, kwargs: dict[str, Any]) -> bool:
        if self._hooked() or self._plan.local(self._module, kwargs) is not None:
            return False
        tokens = self._plan.tokens(kwargs)
        return tokens is not None and tokens % self._group.size == 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = by_name(self._signature, args, kwargs)
        group = self._group
        # Every forward holds the group's lock: a forward here must not run into another's hooks.
        with group.lock:
            if group.failed is not None or not self._splittable(named):
                return self._module(**named)
        self.split_calls += 1
        size = group.size
        done = group.exchange(
            "sequence",
            dict.fromkeys(range(1, size), without_unused(named, self._joins)),
            lambda: sequence_call(self._module, self._plan, named, group.process_group, 0, size),
        )
        if done is not None:
            return done[0]
        with group.lock:
            return self._module(**named)
