"""One request's keys and values, read out of vLLM's paged KV cache.

vLLM gives each attention layer one cache tensor per KV-cache group, and each attention backend decides
how keys and values sit inside it. Two readers need that knowledge: the KV export at the end of a
request's prefill (BAGEL's context handoff) and the BAGEL thinker's bidirectional image blocks, which
re-read the cached prefix of a request. Both go through :func:`key_value_blocks`, the one place that
knows the layouts:

- ``CPU_ATTN`` (vLLM's CPU backend): ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` whose memory,
  per block and head, holds the block's keys dimension-major (``[head_dim, block_size]``, the layout the
  CPU kernels vectorise over) and then its values token-major (``[block_size, head_dim]``).
- ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLEX_ATTENTION`` (CUDA): ``[num_blocks, kv_heads, block_size,
  2 * head_dim]`` as a logical view whose last axis is a token's key followed by its value (the backends
  transpose heads and tokens and split the last axis).

Another backend is refused with a message naming it, rather than read wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CPU_BACKENDS = frozenset({"CPU_ATTN"})
KEY_VALUE_INTERLEAVED_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})


class UnsupportedKVLayoutError(RuntimeError):
    """The attention backend stores its KV cache in a layout this module does not know."""


def key_value_blocks(
    kv_cache: torch.Tensor, backend: str, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)``, each a ``[num_blocks, block_size, kv_heads, head_dim]`` view of ``kv_cache``."""
    if backend in CPU_BACKENDS:
        num_blocks, kv_heads, block_size, _ = kv_cache.shape
        halves = kv_cache.view(num_blocks, kv_heads, 2, block_size * head_dim)
        keys = halves[:, :, 0].view(num_blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
        values = halves[:, :, 1].view(num_blocks, kv_heads, block_size, head_dim).transpose(1, 2)
        return keys, values
    if backend in KEY_VALUE_INTERLEAVED_BACKENDS:
        keys, values = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
        return keys, values
    raise UnsupportedKVLayoutError(
        f"reading a request's KV cache is not supported with vLLM's {backend} attention backend "
        f"(supported: {', '.join(sorted(CPU_BACKENDS | KEY_VALUE_INTERLEAVED_BACKENDS))})"
    )


def gather_tokens(
    keys: torch.Tensor, values: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` keys and values of a request whose blocks are ``block_ids``, each
    ``[num_tokens, kv_heads, head_dim]`` (a copy)."""
    block_size = keys.shape[1]
    needed = -(-num_tokens // block_size)
    ids = torch.as_tensor(block_ids, dtype=torch.long)[:needed]
    if ids.numel() < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} KV blocks, the request holds {ids.numel()}")
    ids = ids.to(keys.device)
    k = keys.index_select(0, ids).reshape(needed * block_size, *keys.shape[2:])[:num_tokens]
    v = values.index_select(0, ids).reshape(needed * block_size, *values.shape[2:])[:num_tokens]
    return k, v
