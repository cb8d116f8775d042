"""One request's keys and values, read out of vLLM's paged KV cache, and the checks that make that safe.

vLLM (0.31+) binds each attention layer a logical ``[blocks, slots, tokens, content]`` view of one shared
allocation (``create_kv_cache_views``): the resolved ``KVCacheLayout`` orders those axes in memory (the
view's strides), and the attention backend decides what a slot and a content row hold (its
``customize_spec`` and how its kernels split the view). Two readers need that knowledge: the KV export at
the end of a request's prefill (BAGEL's context handoff) and the BAGEL thinker's bidirectional image
blocks, which re-read the cached prefix of a request. Both go through this module, which reads four
layouts:

- interleaved: ``[blocks, kv_heads, tokens, 2 * head_dim]``, a token's key followed by its value, in any
  ``KVCacheLayout`` (the kernels transpose heads and tokens and split the last axis). ``FLASH_ATTN``,
  ``TRITON_ATTN`` (CUDA and ROCm), ``FLEX_ATTENTION``, ``FLASHINFER``, their composites
  ``TRITON_FLASH_ATTN`` and ``TRITON_FLASHINFER``, ``HPC_ATTN``, and ROCm's ``ROCM_AITER_FA`` (which calls
  itself ``FLASH_ATTN``) and ``ROCM_AITER_UNIFIED_ATTN`` without AITER's shuffled layout.
- CPU (``CPU_ATTN`` with the ``vec`` and ``vec16`` kernels): the same shape, head-major blocks (``LBHNC``)
  whose memory, per block and head, holds the keys dimension-major (``[head_dim, tokens]``) and then the
  values token-major (``[tokens, head_dim]``), as ``cpu_attn_reshape_and_cache`` writes them. The kernels
  that pack a block for their matrix units (``amx`` for bfloat16 on AMX CPUs) keep the same shape and
  strides but place each key and value elsewhere inside its block: where, is learnt once per geometry from
  vLLM's own cache write (:func:`cpu_packed_positions`), and such a cache is read by gathering those
  places (``read_tokens`` with the layer's ``cpu_isa``).
- planes (``ROCM_SEGMENTED_ATTN``, ``B12X``): ``[blocks, 2, tokens, kv_heads * head_dim]``, keys in slot 0
  and values in slot 1, token-major.
- paged-x (``ROCM_ATTN``): ``[blocks, 2, tokens, kv_heads * head_dim]`` whose key memory per block is
  ``[kv_heads, head_dim / x, tokens, x]`` (``x`` elements make 16 bytes) and value memory ``[kv_heads,
  head_dim, tokens]``, vLLM's classic paged-attention layout. No token-major view of it exists, so only
  :func:`read_tokens` reads it.

Everything else is refused in one line naming what to set instead, never read wrongly: other backends
(MLA, the diff-KV backends, the quantising ``TURBOQUANT`` / ``ULTRAQUANT`` / ``ROCM_OCTAVE``, ...), a
quantised or non-float cache (fp8 is stored as uint8; Triton's per-token-head modes pack int8/uint8 data
with inline scales), CPU kernels whose cache write is not a placement of each value (or that cannot write
this geometry) and ROCm's shuffled layouts.
:func:`check_kv_caches` runs once per worker when the caches exist; :func:`kv_cache_dtype_refusal` refuses
a ``kv_cache_dtype`` at configuration time.

Kernel blocks: a backend whose kernels take blocks smaller than the KV manager's gets kernel-block views
``[blocks * r, ..., kernel_block_size, ...]`` and kernel block tables in its attention metadata; manager
block ``b`` is kernel blocks ``b * r`` to ``b * r + r - 1``. Block ids from attention metadata are kernel
block ids (pass no ``block_size``); a request's scheduler ``block_ids`` are manager block ids (pass the
manager's ``block_size``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

INTERLEAVED = "interleaved"
CPU_BLOCKED = "cpu"
PLANES = "planes"
PAGED_X = "paged-x"

BACKEND_LAYOUTS: dict[str, str] = {
    "FLASH_ATTN": INTERLEAVED,
    "TRITON_ATTN": INTERLEAVED,
    "FLEX_ATTENTION": INTERLEAVED,
    "FLASHINFER": INTERLEAVED,
    "TRITON_FLASH_ATTN": INTERLEAVED,
    "TRITON_FLASHINFER": INTERLEAVED,
    "HPC_ATTN": INTERLEAVED,
    "ROCM_AITER_FA": INTERLEAVED,
    "ROCM_AITER_UNIFIED_ATTN": INTERLEAVED,
    "CPU_ATTN": CPU_BLOCKED,
    "ROCM_SEGMENTED_ATTN": PLANES,
    "B12X": PLANES,
    "ROCM_ATTN": PAGED_X,
}
"""``AttentionBackendEnum`` name -> the layout its kernels write (see the module docstring)."""

SUPPORTED_BACKENDS = tuple(sorted(BACKEND_LAYOUTS))
CPU_BACKENDS = frozenset(name for name, layout in BACKEND_LAYOUTS.items() if layout == CPU_BLOCKED)
KEY_VALUE_INTERLEAVED_BACKENDS = frozenset(
    name for name, layout in BACKEND_LAYOUTS.items() if layout == INTERLEAVED
)
READABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""``kv_cache_dtype`` values that store plain keys and values (every other one quantises)."""
CPU_ISAS = ("vec", "vec16")
"""``CPU_ATTN`` kernels whose cache has the plain CPU layout (``amx`` packs its blocks: read by gathering)."""
SHUFFLE_ENV = "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT"


class UnsupportedKVLayoutError(RuntimeError):
    """A KV cache this module cannot read back exactly (backend, dtype, packing or block sizes)."""


# --- configuration time and start-up checks ----------------------------------------------------------


def kv_cache_dtype_refusal(kv_cache_dtype: str | None) -> str | None:
    """None when the ``kv_cache_dtype`` engine argument keeps keys and values readable, else the one-line
    reason, so configuration resolution can refuse a deploy file before anything starts."""
    if kv_cache_dtype is None or kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    return (
        f"kv_cache_dtype {kv_cache_dtype!r} quantises the KV cache, which the KV handoff cannot read back "
        f"as keys and values; set --kv-cache-dtype auto (or bfloat16 / float16)"
    )


def backend_name(backend: str | type) -> str:
    """The ``AttentionBackendEnum`` name of a backend class (``ROCM_AITER_FA`` calls itself ``FLASH_ATTN``,
    so ``get_name()`` alone cannot tell it apart); a string is taken as that name."""
    if isinstance(backend, str):
        return backend
    path = f"{backend.__module__}.{backend.__qualname__}"
    try:
        from vllm_omni_plugin.compat import resolve

        for member in resolve("AttentionBackendEnum"):
            if member.value == path:
                return member.name
    except ImportError:
        pass
    return backend.get_name()


def check_kv_cache(
    kv_cache: torch.Tensor,
    backend: str | type,
    head_dim: int,
    *,
    block_size: int | None = None,
    kv_cache_dtype: str | None = None,
    cpu_isa: str | None = None,
    shuffled: bool = False,
    layer_name: str | None = None,
) -> None:
    """Raise :class:`UnsupportedKVLayoutError` (one line) unless one layer's cache reads back exactly.

    ``block_size`` is the KV manager's (None: not checked), ``cpu_isa`` the ``CPU_ATTN`` kernels vLLM picked
    (``layer.isa``), ``shuffled`` whether a ROCm backend keeps a shuffled or interleaved-V layout.
    """
    where = f"layer {layer_name}: " if layer_name else ""
    name = backend_name(backend)
    refusal = kv_cache_dtype_refusal(kv_cache_dtype)
    if refusal is not None:
        raise UnsupportedKVLayoutError(where + refusal)
    layout, _ = _layout(kv_cache, name, head_dim, where, kv_cache_dtype)
    if shuffled:
        raise UnsupportedKVLayoutError(
            f"{where}{name} keeps this KV cache in a shuffled (or interleaved-V) layout, which the KV "
            f"handoff cannot read back token by token; unset {SHUFFLE_ENV} or choose another "
            f"--attention-backend"
        )
    kernel_block_size = kv_cache.shape[2]
    if layout == CPU_BLOCKED and cpu_isa not in CPU_ISAS:
        if cpu_isa is None:
            raise UnsupportedKVLayoutError(
                f"{where}vLLM picked no CPU_ATTN kernels for this cache, so its layout is unknown"
            )
        try:
            cpu_packed_positions(cpu_isa, kv_cache.dtype, kv_cache.shape[1], kernel_block_size, head_dim)
        except UnsupportedKVLayoutError as exc:
            raise UnsupportedKVLayoutError(f"{where}{exc}") from None
    if block_size is not None:
        if block_size % kernel_block_size:
            raise UnsupportedKVLayoutError(
                f"{where}the KV manager's {block_size}-token blocks are not a whole number of the "
                f"{kernel_block_size}-token blocks {name}'s cache is split into; set --block-size to a "
                f"multiple of {kernel_block_size}"
            )
        ratio = block_size // kernel_block_size
        if kv_cache.shape[0] % ratio:
            raise UnsupportedKVLayoutError(
                f"{where}{kv_cache.shape[0]} kernel blocks of {kernel_block_size} tokens do not make whole "
                f"{block_size}-token KV manager blocks"
            )


def check_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], layers: Mapping[str, Any], block_size: int | None
) -> None:
    """Start-up check, once per worker when the KV caches exist (a KV connector's ``register_kv_caches``):
    raise :class:`UnsupportedKVLayoutError` (one line naming the layer) unless every attention layer's
    cache reads back exactly. ``layers`` maps layer names to vLLM's attention layers
    (``static_forward_context``); ``block_size`` is the KV manager's. Caches of other layers are skipped."""
    for layer_name, kv_cache in kv_caches.items():
        layer = layers.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        if backend is None:
            continue
        name = backend_name(backend)
        kv_cache_dtype = getattr(layer, "kv_cache_dtype", None)
        cpu = BACKEND_LAYOUTS.get(name) == CPU_BLOCKED and kv_cache_dtype_refusal(kv_cache_dtype) is None
        check_kv_cache(
            kv_cache,
            backend,
            layer.head_size,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            cpu_isa=layer_cpu_isa(layer, kv_cache) if cpu else None,
            shuffled=_shuffled(layer, name),
            layer_name=layer_name,
        )


def layer_cpu_isa(layer: Any, kv_cache: torch.Tensor) -> str | None:
    """The kernels vLLM's CPU backend runs for ``layer`` (set by its metadata builder, else its choice);
    None for a layer of another backend. Readers pass it to :func:`read_tokens`."""
    if BACKEND_LAYOUTS.get(backend_name(getattr(layer, "attn_backend", None) or "")) != CPU_BLOCKED:
        return None
    isa = getattr(layer, "isa", None)
    if isa is not None:
        return isa
    from vllm_omni_plugin.compat import resolve

    try:
        return resolve("cpu_attn_isa")(
            kv_cache.dtype, kv_cache.shape[2], layer.head_size, getattr(layer, "kv_cache_dtype", None)
        )
    except (ImportError, NotImplementedError):  # no kernels for this cache at all: refused as unknown
        return None


def _shuffled(layer: Any, name: str) -> bool:
    """Whether a ROCm backend keeps ``layer``'s cache shuffled (AITER) or with an interleaved V cache."""
    impl = getattr(layer, "impl", None)
    if getattr(impl, "_shuffle_kv_layout", False) or getattr(impl, "_use_interleaved_v_cache", False):
        return True
    if name == "ROCM_AITER_FA":
        import vllm.envs as envs

        return bool(getattr(envs, SHUFFLE_ENV, False))
    return False


def _layout(
    kv_cache: torch.Tensor, name: str, head_dim: int, where: str = "", kv_cache_dtype: str | None = None
) -> tuple[str, int]:
    """``(layout, kv_heads)`` of a cache whose shape, dtype and strides fit its backend's layout."""
    layout = BACKEND_LAYOUTS.get(name)
    if layout is None:
        raise UnsupportedKVLayoutError(
            f"{where}reading a request's KV cache is not supported with vLLM's {name} attention backend "
            f"(supported: {', '.join(SUPPORTED_BACKENDS)}); choose one with --attention-backend"
        )
    if kv_cache.dtype not in READABLE_DTYPES:
        setting = f" (kv_cache_dtype {kv_cache_dtype!r})" if kv_cache_dtype else ""
        raise UnsupportedKVLayoutError(
            f"{where}the KV cache holds {str(kv_cache.dtype).removeprefix('torch.')}{setting}, a quantised "
            f"cache the KV handoff cannot read back as keys and values; set --kv-cache-dtype auto"
        )
    if kv_cache.dim() != 4:
        raise UnsupportedKVLayoutError(
            f"{where}{name}'s KV cache has shape {tuple(kv_cache.shape)}, not vLLM's [blocks, slots, tokens, "
            f"content] layer view"
        )
    _, slots, tokens, content = kv_cache.shape
    if layout in (INTERLEAVED, CPU_BLOCKED):
        if content != 2 * head_dim:
            raise UnsupportedKVLayoutError(
                f"{where}{name} stores {content} values per token and head, not a key and a value of "
                f"{head_dim} (a packed or quantised layout); set --kv-cache-dtype auto"
            )
        kv_heads = slots
    else:
        if slots != 2 or content % head_dim:
            raise UnsupportedKVLayoutError(
                f"{where}{name}'s KV cache {tuple(kv_cache.shape)} is not a key plane and a value plane of "
                f"{head_dim}-value heads"
            )
        kv_heads = content // head_dim
    if layout == CPU_BLOCKED and kv_cache.stride()[1:] != (tokens * content, content, 1):
        raise UnsupportedKVLayoutError(
            f"{where}CPU_ATTN reads head-major blocks (KV cache layout LBHNC); this cache's strides are "
            f"{kv_cache.stride()}"
        )
    if layout == PAGED_X and (
        kv_cache.stride()[2:] != (content, 1) or head_dim % (16 // kv_cache.element_size())
    ):
        raise UnsupportedKVLayoutError(
            f"{where}ROCM_ATTN's KV cache {tuple(kv_cache.shape)} with strides {kv_cache.stride()} is not "
            f"its paged layout"
        )
    return layout, kv_heads


@functools.cache
def cpu_packed_positions(
    isa: str, dtype: torch.dtype, kv_heads: int, block_tokens: int, head_dim: int
) -> torch.Tensor:
    """Where ``CPU_ATTN``'s ``isa`` kernels keep each key and value of a block: ``[2, block_tokens,
    kv_heads, head_dim]`` offsets into one block's memory (keys, then values).

    Learnt from vLLM's own cache write rather than restated from its C++: one block is written with each
    value's index, one base-256 digit at a time (every readable dtype holds 0..255 exactly), so the answer
    is the kernels' own for this vLLM. Raises :class:`UnsupportedKVLayoutError` unless the write puts
    every value in a place of its own and fills the block (a packing, nothing dropped or padded)."""
    from vllm_omni_plugin.compat import resolve

    per_block = 2 * block_tokens * kv_heads * head_dim
    source = torch.arange(per_block).view(2, block_tokens, kv_heads, head_dim)
    cache = torch.empty(1, kv_heads, block_tokens, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(1, kv_heads, 2 * block_tokens, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_tokens)
    found = torch.zeros(per_block, dtype=torch.long)
    scale = 1
    while scale < per_block:
        digit = (source // scale) % 256
        cache.fill_(-1)  # a place the write leaves alone keeps it
        try:
            resolve("cpu_attn_reshape_and_cache")(
                digit[0].to(dtype), digit[1].to(dtype), key_cache, value_cache, slots, isa
            )
        except RuntimeError as exc:
            raise UnsupportedKVLayoutError(
                f"CPU_ATTN's {isa} kernels cannot write a {block_tokens}-token block of {kv_heads} "
                f"{head_dim}-value heads in {str(dtype).removeprefix('torch.')} "
                f"({str(exc).splitlines()[0]}), so the KV handoff cannot read it"
            ) from None
        written = cache.flatten().to(torch.long)
        if bool((written < 0).any()):
            found = None
            break
        found += written * scale
        scale *= 256
    if found is None or not torch.equal(torch.sort(found).values, torch.arange(per_block)):
        raise UnsupportedKVLayoutError(
            f"CPU_ATTN's {isa} kernels do not keep each key and value of a block in a place of its own "
            f"({str(dtype).removeprefix('torch.')}), so the KV handoff cannot read them back; serve with "
            f"--dtype float32"
        )
    positions = torch.empty(per_block, dtype=torch.long)
    positions[found] = torch.arange(per_block)
    return positions.view(2, block_tokens, kv_heads, head_dim)


# --- reading ----------------------------------------------------------------------------------------


def key_value_blocks(
    kv_cache: torch.Tensor, backend: str | type, head_dim: int, *, cpu_isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)``, each a ``[num_blocks, block_size, kv_heads, head_dim]`` view of ``kv_cache``
    (kernel blocks where vLLM split them). ``ROCM_ATTN`` and the packed ``CPU_ATTN`` kernels have none:
    read them with :func:`read_tokens`."""
    name = backend_name(backend)
    layout, kv_heads = _layout(kv_cache, name, head_dim)
    if layout == PAGED_X or (layout == CPU_BLOCKED and cpu_isa is not None and cpu_isa not in CPU_ISAS):
        raise UnsupportedKVLayoutError(
            f"{name}'s KV cache{f' ({cpu_isa} kernels)' if layout == CPU_BLOCKED else ''} has no "
            f"token-major view; read it with paged_kv.read_tokens"
        )
    return _split(kv_cache, layout, kv_heads, head_dim)


def gather_tokens(
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    num_tokens: int,
    *,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys and values of a request whose blocks are ``block_ids``, each
    ``[num_tokens, kv_heads, head_dim]`` (a copy). ``block_size``: the tokens per entry of ``block_ids``
    when they are KV manager blocks split into smaller kernel blocks (None: ids of ``keys``' blocks)."""
    kernel_block_size = keys.shape[1]
    ids = kernel_block_ids(block_ids, num_tokens, kernel_block_size, block_size).to(keys.device)
    rows = ids.numel() * kernel_block_size
    k = keys.index_select(0, ids).reshape(rows, *keys.shape[2:])[:num_tokens]
    v = values.index_select(0, ids).reshape(rows, *values.shape[2:])[:num_tokens]
    return k, v


def read_tokens(
    kv_cache: torch.Tensor,
    backend: str | type,
    head_dim: int,
    block_ids: Sequence[int] | torch.Tensor,
    num_tokens: int,
    *,
    block_size: int | None = None,
    cpu_isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys and values of a request out of one layer's cache, each
    ``[num_tokens, kv_heads, head_dim]`` (a copy), for every supported layout. ``block_ids`` and
    ``block_size`` as for :func:`gather_tokens`; only the request's blocks are copied. ``cpu_isa``: the
    ``CPU_ATTN`` kernels that wrote the cache (:func:`layer_cpu_isa`; None reads the plain CPU layout)."""
    name = backend_name(backend)
    layout, kv_heads = _layout(kv_cache, name, head_dim)
    kernel_block_size = kv_cache.shape[2]
    ids = kernel_block_ids(block_ids, num_tokens, kernel_block_size, block_size).to(kv_cache.device)
    blocks = kv_cache.index_select(0, ids)
    if layout == CPU_BLOCKED and cpu_isa is not None and cpu_isa not in CPU_ISAS:
        places = cpu_packed_positions(cpu_isa, kv_cache.dtype, kv_heads, kernel_block_size, head_dim)
        keys, values = blocks.flatten(1)[:, places.flatten()].unflatten(1, places.shape).unbind(1)
    else:
        keys, values = _split(blocks, layout, kv_heads, head_dim)
    rows = ids.numel() * kernel_block_size
    return (
        keys.reshape(rows, kv_heads, head_dim)[:num_tokens],
        values.reshape(rows, kv_heads, head_dim)[:num_tokens],
    )


def kernel_block_ids(
    block_ids: Sequence[int] | torch.Tensor,
    num_tokens: int,
    kernel_block_size: int,
    block_size: int | None = None,
) -> torch.Tensor:
    """The kernel block ids holding a request's first ``num_tokens`` tokens: manager block ``b`` of
    ``block_size`` tokens is kernel blocks ``b * r`` .. ``b * r + r - 1`` (``r = block_size /
    kernel_block_size``), as vLLM maps block tables for kernels; ``block_size`` None: ids are kernel ids."""
    ids = torch.as_tensor(block_ids).to(torch.long).flatten()
    if block_size is not None and block_size != kernel_block_size:
        if block_size % kernel_block_size:
            raise UnsupportedKVLayoutError(
                f"{block_size}-token KV manager blocks are not a whole number of {kernel_block_size}-token "
                f"kernel blocks"
            )
        ratio = block_size // kernel_block_size
        ids = (ids[:, None] * ratio + torch.arange(ratio, device=ids.device)).flatten()
    needed = -(-num_tokens // kernel_block_size)
    if ids.numel() < needed:
        raise ValueError(
            f"{num_tokens} tokens need {needed} KV blocks of {kernel_block_size} tokens, the request holds "
            f"{ids.numel()}"
        )
    return ids[:needed]


def _split(
    cache: torch.Tensor, layout: str, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[blocks, tokens, kv_heads, head_dim]`` of a (selection of a) layer cache."""
    if layout == INTERLEAVED:
        keys, values = cache.transpose(1, 2).split(head_dim, dim=-1)
        return keys, values
    blocks, _, tokens, _ = cache.shape
    if layout == CPU_BLOCKED:
        halves = cache.view(blocks, kv_heads, 2, tokens * head_dim)
        keys = halves[:, :, 0].view(blocks, kv_heads, head_dim, tokens).permute(0, 3, 1, 2)
        values = halves[:, :, 1].view(blocks, kv_heads, tokens, head_dim).transpose(1, 2)
        return keys, values
    if layout == PLANES:
        return cache[:, 0].unflatten(-1, (kv_heads, head_dim)), cache[:, 1].unflatten(
            -1, (kv_heads, head_dim)
        )
    # PAGED_X: the memory of each block's key (value) plane, as PagedAttention.split_kv_cache views it
    x = 16 // cache.element_size()
    keys = cache[:, 0].reshape(blocks, kv_heads, head_dim // x, tokens, x).permute(0, 3, 1, 2, 4)
    values = cache[:, 1].reshape(blocks, kv_heads, head_dim, tokens).permute(0, 3, 1, 2)
    return keys.reshape(blocks, tokens, kv_heads, head_dim), values
