"""``ar_worker/paged_kv.py`` against the KV caches vLLM's attention backends write.

Caches are built the way vLLM's workers build them: the backend's ``customize_spec``, the byte strides of
``compute_layout_strides`` and the per-layer views of ``create_kv_cache_views`` (kernel-block views where
vLLM splits blocks), for every ``KVCacheLayout`` a backend accepts and for fp32, bf16 and fp16. Tokens are
written where the backend's kernels put them: ``CPU_ATTN`` through its own ``do_kv_cache_update`` (vLLM's
``cpu_attn_reshape_and_cache``), the GPU backends through the K/V views their forward passes split the
cache into (vLLM's code, called where it is a function) stored at the addresses vLLM's
``reshape_and_cache_flash`` kernel computes (``triton_reshape_and_cache_flash``, mirrored below with its
stride arithmetic, as it needs a GPU). The reader is compared exactly against what was written.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_omni_plugin.ar_worker import paged_kv
from vllm_omni_plugin.ar_worker.paged_kv import UnsupportedKVLayoutError
from vllm_omni_plugin.compat import resolve

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 32
HEAD_DIM = 64
KV_HEADS = 2
NUM_BLOCKS = 6
REQUEST_BLOCKS = [4, 1, 3]
"""A request's (manager) blocks, out of order; its tokens fill two of them and part of the third."""
NUM_TOKENS = 70
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


# --- how vLLM lays out and writes caches -------------------------------------------------------------


def layer_views(
    spec: Any, layout: Any, num_blocks: int = NUM_BLOCKS, kernel_block_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Per-layer views of one allocation, as ``get_kv_cache_config`` places layers and
    ``allocate_kv_cache`` views them; the bytes start as noise so a misread cannot match."""
    layer_stride, block_stride, *_ = resolve("compute_layout_strides")(spec, num_blocks, len(LAYERS), layout)
    size = len(LAYERS) * num_blocks * spec.page_size_bytes
    tensor = resolve("KVCacheTensor")(
        size=size, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(7))
    views = resolve("create_kv_cache_views")(raw, spec, num_blocks, layout, tensor, kernel_block_size)
    return dict(zip(LAYERS, views, strict=True))


def known(layer: int, num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[Any, Any]:
    """Token t, head h of layer ``layer``: keys and values that every dtype holds exactly."""
    generator = torch.Generator().manual_seed(1000 + layer)
    shape = (num_tokens, kv_heads, head_dim)
    keys = torch.randint(-120, 120, shape, generator=generator).to(dtype)
    values = (torch.randint(-120, 120, shape, generator=generator) + 0.5).to(dtype)
    return keys, values


def slot_mapping(kernel_block_ids: list[int], kernel_block_size: int, num_tokens: int) -> torch.Tensor:
    """``BlockTable.compute_slot_mapping``: position p goes to slot ``table[p // size] * size + p % size``."""
    positions = torch.arange(num_tokens)
    table = torch.tensor(kernel_block_ids)
    return table[positions // kernel_block_size] * kernel_block_size + positions % kernel_block_size


def storage_from(cache: torch.Tensor) -> torch.Tensor:
    """A flat tensor from ``cache``'s first element to the end of its storage (the kernel's pointer)."""
    size = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()
    return torch.empty(0, dtype=cache.dtype).set_(cache.untyped_storage(), cache.storage_offset(), (size,))


def triton_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """vLLM's ``triton_reshape_and_cache_flash`` (``v1/attention/ops/triton_reshape_and_cache_flash.py``):
    the wrapper's stride arguments and the kernel's target index, for both of its cache shapes."""
    num_heads, head_size = key.shape[1], key.shape[2]
    use_head_major_layout = key_cache.ndim == 5
    if use_head_major_layout:
        block_size = key_cache.shape[3]
        x = key_cache.shape[4]
        head_stride = key_cache.stride(1)
        dim_stride_k = key_cache.stride(2)
        dim_stride_v = value_cache.stride(2)
    else:
        block_size = key_cache.shape[1]
        x = 1
        dim_stride_k = dim_stride_v = 0
        head_stride = key_cache.stride()[2]
    block_stride = key_cache.stride()[0]
    page_stride = key_cache.stride()[1]
    tile_pos = torch.arange(num_heads * head_size)
    cur_head, cur_dim = tile_pos // head_size, tile_pos % head_size
    key_out, value_out = storage_from(key_cache), storage_from(value_cache)
    for token_idx, slot_idx in enumerate(slots.tolist()):
        block_idx, block_offset = slot_idx // block_size, slot_idx % block_size
        if use_head_major_layout:
            tgt_idx_v = (
                block_idx * block_stride + cur_head * head_stride + cur_dim * dim_stride_v + block_offset
            )
            tgt_idx_k = (
                block_idx * block_stride
                + cur_head * head_stride
                + (cur_dim // x) * dim_stride_k
                + block_offset * x
                + (cur_dim % x)
            )
        else:
            tgt_idx_k = (
                block_idx * block_stride + block_offset * page_stride + cur_head * head_stride + cur_dim
            )
            tgt_idx_v = tgt_idx_k
        key_out[tgt_idx_k] = key[token_idx].flatten()
        value_out[tgt_idx_v] = value[token_idx].flatten()


def interleaved_views(cache: torch.Tensor, heads: int, head_dim: int) -> tuple[Any, Any]:
    """``kv_cache.transpose(1, 2).split(self.head_size, dim=-1)``: the forward pass of flash_attn.py,
    triton_attn.py, flex_attention.py, flashinfer.py (not importable without flashinfer) and hpc_attn.py."""
    return cache.transpose(1, 2).split(head_dim, dim=-1)


def impl_method(name: str, method: str, **attrs: Any) -> Callable[[torch.Tensor, int, int], Any]:
    """A backend impl's own K/V split, called on the attributes it reads (its constructor needs ROCm)."""

    def split(cache: torch.Tensor, heads: int, head_dim: int) -> Any:
        impl = resolve("AttentionBackendEnum")[name].get_class().get_impl_cls()
        this = SimpleNamespace(
            num_kv_heads=heads, head_size=head_dim, kv_cache_dtype="auto", kv_torch_dtype=cache.dtype, **attrs
        )
        return getattr(impl, method)(this, cache)

    return split


def paged_views(cache: torch.Tensor, heads: int, head_dim: int) -> Any:
    """rocm_attn.py: ``PagedAttention.split_kv_cache(kv_cache.transpose(0, 1), num_kv_heads, head_size)``."""
    return resolve("PagedAttention").split_kv_cache(cache.transpose(0, 1), heads, head_dim)


KERNEL_VIEWS: dict[str, Callable[[torch.Tensor, int, int], Any]] = {
    "FLASH_ATTN": interleaved_views,
    "TRITON_ATTN": interleaved_views,
    "FLEX_ATTENTION": interleaved_views,
    "FLASHINFER": interleaved_views,
    "TRITON_FLASH_ATTN": interleaved_views,
    "TRITON_FLASHINFER": interleaved_views,
    "HPC_ATTN": interleaved_views,
    "ROCM_AITER_FA": impl_method("ROCM_AITER_FA", "_split_kv_cache"),
    "ROCM_AITER_UNIFIED_ATTN": impl_method(
        "ROCM_AITER_UNIFIED_ATTN", "_split_kv_cache", _shuffle_kv_layout=False
    ),
    "ROCM_SEGMENTED_ATTN": impl_method("ROCM_SEGMENTED_ATTN", "_split_kv_cache"),
    "B12X": impl_method("B12X", "_kv_cache_views"),
    "ROCM_ATTN": paged_views,
}
"""How each GPU backend's kernels see a layer's cache (the views its cache writer gets)."""


def backend_class(name: str) -> type | None:
    """The backend's class, None where its module cannot be imported here (FlashInfer needs flashinfer)."""
    try:
        return resolve("AttentionBackendEnum")[name].get_class()
    except ImportError:
        return None


def backend_spec_and_layouts(name: str, dtype: torch.dtype, block_size: int = BLOCK) -> tuple[Any, list]:
    """The backend's customised spec and every KV cache layout it accepts."""
    cls = backend_class(name)
    spec = resolve("FullAttentionSpec")(
        block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=dtype
    )
    layouts = cls.supported_kv_cache_layouts() if cls is not None else None
    return (cls.customize_spec(spec) if cls is not None else spec), list(layouts or resolve("KVCacheLayout"))


def write_request(name: str, views: dict[str, torch.Tensor], slots: torch.Tensor) -> list[tuple[Any, Any]]:
    """Write one request's tokens into every layer the way backend ``name`` does; what was written."""
    written = []
    for layer, cache in enumerate(views.values()):
        keys, values = known(layer, len(slots), KV_HEADS, HEAD_DIM, cache.dtype)
        key_cache, value_cache = KERNEL_VIEWS[name](cache, KV_HEADS, HEAD_DIM)
        triton_reshape_and_cache_flash(keys, values, key_cache, value_cache, slots)
        written.append((keys, values))
    return written


def assert_reads(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[Any, Any], what: str) -> None:
    assert actual[0].shape == expected[0].shape, what
    assert torch.equal(actual[0], expected[0]), f"{what}: keys differ"
    assert torch.equal(actual[1], expected[1]), f"{what}: values differ"


# --- every supported layout reads back what its backend wrote -------------------------------------------


GPU_BACKENDS = sorted(KERNEL_VIEWS)


def test_every_supported_backend_is_tested() -> None:
    assert set(paged_kv.SUPPORTED_BACKENDS) == {*GPU_BACKENDS, "CPU_ATTN"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_layouts_read_back_exactly(name: str, dtype: torch.dtype) -> None:
    spec, layouts = backend_spec_and_layouts(name, dtype)
    backend = backend_class(name) or name
    for layout in layouts:
        views = layer_views(spec, layout)
        written = write_request(name, views, slot_mapping(REQUEST_BLOCKS, BLOCK, NUM_TOKENS))
        for (layer, cache), expected in zip(views.items(), written, strict=True):
            what = f"{name} {layout.name} {layer}"
            paged_kv.check_kv_cache(cache, backend, HEAD_DIM, block_size=BLOCK, layer_name=layer)
            assert_reads(
                paged_kv.read_tokens(cache, backend, HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS), expected, what
            )
            if paged_kv.BACKEND_LAYOUTS[name] != paged_kv.PAGED_X:
                keys, values = paged_kv.key_value_blocks(cache, backend, HEAD_DIM)
                assert keys.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()  # views
                assert_reads(paged_kv.gather_tokens(keys, values, REQUEST_BLOCKS, NUM_TOKENS), expected, what)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_reads_on_the_device_equal_the_host(name: str) -> None:
    """The same cache bytes on a CUDA device: the reader gives exactly what it gives on the host."""
    pytest.importorskip("vllm", reason="vLLM is not installed on this host (its attention backends)")
    spec, layouts = backend_spec_and_layouts(name, torch.bfloat16)
    backend = backend_class(name) or name
    views = layer_views(spec, layouts[0])
    write_request(name, views, slot_mapping(REQUEST_BLOCKS, BLOCK, NUM_TOKENS))
    for layer, cache in views.items():
        on_host = paged_kv.read_tokens(cache, backend, HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS)
        device_cache = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device="cuda")
        device_cache.copy_(cache)
        keys, values = paged_kv.read_tokens(device_cache, backend, HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS)
        assert keys.device.type == "cuda"
        assert_reads((keys.cpu(), values.cpu()), on_host, f"{name} {layer} on cuda")


def test_rocm_aiter_fa_reads_as_flash_attn_the_name_it_reports() -> None:
    """AITER's FA backend calls itself FLASH_ATTN (what ``get_name()`` callers pass) and writes alike."""
    cls = backend_class("ROCM_AITER_FA")
    assert cls is not None and cls.get_name() == "FLASH_ATTN"
    assert paged_kv.backend_name(cls) == "ROCM_AITER_FA"
    assert paged_kv.backend_name(backend_class("FLASH_ATTN")) == "FLASH_ATTN"
    spec, layouts = backend_spec_and_layouts("ROCM_AITER_FA", torch.bfloat16)
    views = layer_views(spec, layouts[0])
    written = write_request("ROCM_AITER_FA", views, slot_mapping(REQUEST_BLOCKS, BLOCK, NUM_TOKENS))
    cache = views[LAYERS[1]]
    assert_reads(
        paged_kv.read_tokens(cache, "FLASH_ATTN", HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS), written[1], ""
    )


def test_rocm_attn_has_no_token_major_view() -> None:
    spec, layouts = backend_spec_and_layouts("ROCM_ATTN", torch.float16)
    cache = layer_views(spec, layouts[0])[LAYERS[0]]
    with pytest.raises(UnsupportedKVLayoutError, match="read_tokens"):
        paged_kv.key_value_blocks(cache, "ROCM_ATTN", HEAD_DIM)


# --- kernel blocks smaller than the KV manager's blocks -------------------------------------------------


def test_kernel_blocks_smaller_than_manager_blocks() -> None:
    """AITER FA's kernels take 16- or 32-token blocks: vLLM splits 128-token manager blocks into 32-token
    kernel blocks; a request's manager block ids then address kernel blocks ``b * 4 .. b * 4 + 3``."""
    manager = 128
    name = "ROCM_AITER_FA"
    cls = backend_class(name)
    spec, layouts = backend_spec_and_layouts(name, torch.bfloat16, block_size=manager)
    kernel = resolve("select_common_block_size")(manager, [cls], [spec])
    assert kernel == 32
    group = resolve("AttentionGroup")(
        backend=cls,
        layer_names=list(LAYERS),
        kv_cache_spec=spec,
        kv_cache_group_id=0,
        kernel_block_size=kernel,
        kernel_block_table=torch.zeros(1, 1, len(REQUEST_BLOCKS) * manager // kernel, dtype=torch.int32),
        kernel_block_offsets=torch.arange(manager // kernel, dtype=torch.int32),
    )
    kernel_table = group.map_to_kernel_block_table(torch.tensor([REQUEST_BLOCKS], dtype=torch.int32))[0]
    num_tokens = 2 * manager + 70
    split = []
    for layout in layouts:
        try:
            views = layer_views(spec, layout, kernel_block_size=kernel)
        except ValueError as exc:  # vLLM itself refuses to split blocks in this layout
            assert "cannot be split into 4 kernel blocks" in str(exc)
            continue
        split.append(layout)
        cache = views[LAYERS[1]]
        assert cache.shape[0] == NUM_BLOCKS * manager // kernel and cache.shape[2] == kernel
        written = write_request(name, views, slot_mapping(kernel_table.tolist(), kernel, num_tokens))[1]
        paged_kv.check_kv_cache(cache, cls, HEAD_DIM, block_size=manager)
        # the scheduler's block ids (context export): manager blocks of `manager` tokens
        assert_reads(
            paged_kv.read_tokens(cache, cls, HEAD_DIM, REQUEST_BLOCKS, num_tokens, block_size=manager),
            written,
            layout.name,
        )
        keys, values = paged_kv.key_value_blocks(cache, cls, HEAD_DIM)
        assert_reads(
            paged_kv.gather_tokens(keys, values, REQUEST_BLOCKS, num_tokens, block_size=manager),
            written,
            layout.name,
        )
        # the attention metadata's block table (the thinker): kernel block ids already
        assert_reads(
            paged_kv.read_tokens(cache, cls, HEAD_DIM, kernel_table, num_tokens), written, layout.name
        )
        # manager ids taken for kernel ids silently read other memory: the mistake block_size prevents
        wrong = paged_kv.read_tokens(cache, cls, HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS)
        assert not torch.equal(wrong[0], written[0][:NUM_TOKENS])
    assert split, "no layout AITER FA accepts splits blocks"


def test_block_sizes_that_do_not_divide_are_refused() -> None:
    spec, layouts = backend_spec_and_layouts("FLASH_ATTN", torch.bfloat16)
    cache = layer_views(spec, layouts[0])[LAYERS[0]]
    with pytest.raises(
        UnsupportedKVLayoutError, match="48-token blocks are not a whole number of the 32-token"
    ):
        paged_kv.check_kv_cache(cache, "FLASH_ATTN", HEAD_DIM, block_size=48)
    with pytest.raises(UnsupportedKVLayoutError, match="kernel blocks"):
        paged_kv.read_tokens(cache, "FLASH_ATTN", HEAD_DIM, [1], 10, block_size=48)
    with pytest.raises(ValueError, match="70 tokens need 3 KV blocks of 32 tokens, the request holds 2"):
        paged_kv.read_tokens(cache, "FLASH_ATTN", HEAD_DIM, [1, 2], 70)


# --- CPU_ATTN: vLLM's own layers and cache writer --------------------------------------------------------


def cpu_layers(model: Any, dtype: torch.dtype, head_size: int, cache_dtype: str = "auto") -> tuple[Any, dict]:
    """Real vLLM attention layers (CPU backend) of a tiny model's config, and that config."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype=dtype),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype),
    )
    attention = resolve("Attention")
    with set_current_vllm_config(config):
        layers = {
            name: attention(
                num_heads=2 * KV_HEADS,
                head_size=head_size,
                scale=head_size**-0.5,
                num_kv_heads=KV_HEADS,
                cache_config=config.cache_config,
                prefix=name.removesuffix(".attn"),
            )
            for name in LAYERS
        }
    return config, layers


def cpu_spec(config: Any, layer: Any) -> Any:
    return layer.attn_backend.customize_spec(layer.get_kv_cache_spec(config))


def has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("head_size", [32, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_attn_reads_what_its_kernels_write(
    tiny_text_model: Any, dtype: torch.dtype, head_size: int, isa: str
) -> None:
    expected_reads(tiny_text_model, dtype, head_size, isa, views_too=True)


@pytest.mark.skipif(not has_amx(), reason="this CPU has no AMX: vLLM never picks its amx kernels here")
@pytest.mark.parametrize("head_size", [32, 64, 128])
def test_cpu_attn_amx_blocks_read_back_exactly(tiny_text_model: Any, head_size: int) -> None:
    """The amx kernels pack each bfloat16 block for the matrix units: the reader gathers the places vLLM's
    own write uses, learnt once per geometry, and those places are a permutation of the block."""
    assert resolve("cpu_attn_isa")(torch.bfloat16, BLOCK, head_size) == "amx"
    expected_reads(tiny_text_model, torch.bfloat16, head_size, "amx", views_too=False)
    places = paged_kv.cpu_packed_positions("amx", torch.bfloat16, KV_HEADS, BLOCK, head_size)
    assert torch.equal(places.flatten().sort().values, torch.arange(places.numel()))
    plain = paged_kv.cpu_packed_positions("vec", torch.bfloat16, KV_HEADS, BLOCK, head_size)
    assert not torch.equal(places, plain), "amx's blocks are laid out as the vec kernels' (nothing learnt)"


def expected_reads(
    tiny_text_model: Any, dtype: torch.dtype, head_size: int, isa: str, *, views_too: bool
) -> None:
    """Tokens written by CPU_ATTN's ``isa`` kernels (vLLM's own cache update) read back exactly."""
    config, layers = cpu_layers(tiny_text_model, dtype, head_size)
    first = layers[LAYERS[0]]
    assert first.attn_backend.get_name() == "CPU_ATTN"
    (layout,) = first.attn_backend.supported_kv_cache_layouts()
    views = layer_views(cpu_spec(config, first), layout)
    slots = slot_mapping(REQUEST_BLOCKS, BLOCK, NUM_TOKENS)
    for index, (name, cache) in enumerate(views.items()):
        layer = layers[name]
        layer.isa = isa  # what CPUAttentionMetadataBuilder sets on its layers
        keys, values = known(index, NUM_TOKENS, KV_HEADS, head_size, dtype)
        layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)
    paged_kv.check_kv_caches(views, layers, BLOCK)
    for index, (name, cache) in enumerate(views.items()):
        expected = known(index, NUM_TOKENS, KV_HEADS, head_size, dtype)
        what = f"CPU_ATTN {isa} {name}"
        isa_read = paged_kv.layer_cpu_isa(layers[name], cache)
        assert isa_read == isa
        assert_reads(
            paged_kv.read_tokens(cache, "CPU_ATTN", head_size, REQUEST_BLOCKS, NUM_TOKENS, cpu_isa=isa_read),
            expected,
            what,
        )
        backend = layers[name].attn_backend
        if views_too:
            keys, values = paged_kv.key_value_blocks(cache, backend, head_size, cpu_isa=isa_read)
            assert_reads(paged_kv.gather_tokens(keys, values, REQUEST_BLOCKS, NUM_TOKENS), expected, what)
        else:
            with pytest.raises(UnsupportedKVLayoutError, match="no token-major view"):
                paged_kv.key_value_blocks(cache, backend, head_size, cpu_isa=isa_read)


def test_cpu_attn_kernels_that_cannot_write_the_cache_are_refused(tiny_text_model: Any) -> None:
    """A layer whose CPU kernels cannot write its blocks (neon's on this x86 CPU; any whose write is not a
    placement of each value) is refused at start-up in one line naming the layer, never read wrongly."""
    config, layers = cpu_layers(tiny_text_model, torch.bfloat16, 32)
    views = layer_views(cpu_spec(config, layers[LAYERS[0]]), resolve("KVCacheLayout").LBHNC)
    for layer in layers.values():
        layer.isa = "neon"
    with pytest.raises(UnsupportedKVLayoutError) as refused:
        paged_kv.check_kv_caches(views, layers, BLOCK)
    message = str(refused.value)
    assert "\n" not in message
    assert f"layer {LAYERS[0]}: CPU_ATTN's neon kernels cannot write a 32-token block" in message
    for layer in layers.values():
        layer.isa = None
    with pytest.raises(UnsupportedKVLayoutError, match="picked no CPU_ATTN kernels"):
        paged_kv.check_kv_cache(views[LAYERS[0]], "CPU_ATTN", 32, cpu_isa=None)


# --- refusals ------------------------------------------------------------------------------------------


def test_fp8_cache_of_real_layers_is_refused(tiny_text_model: Any) -> None:
    config, layers = cpu_layers(tiny_text_model, torch.bfloat16, 32, cache_dtype="fp8")
    spec = cpu_spec(config, layers[LAYERS[0]])
    assert spec.dtype == torch.uint8
    views = layer_views(spec, resolve("KVCacheLayout").LBHNC)
    with pytest.raises(UnsupportedKVLayoutError) as refused:
        paged_kv.check_kv_caches(views, layers, BLOCK)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"layer {LAYERS[0]}: kv_cache_dtype 'fp8' quantises the KV cache")
    assert "--kv-cache-dtype auto" in message
    cache = views[LAYERS[0]]
    for read in (
        lambda: paged_kv.key_value_blocks(cache, "CPU_ATTN", 32),
        lambda: paged_kv.read_tokens(cache, "CPU_ATTN", 32, [0], 4),
    ):
        with pytest.raises(UnsupportedKVLayoutError, match="holds uint8, a quantised cache"):
            read()


@pytest.mark.parametrize(
    ("name", "cache_dtype", "dtype", "mode"),
    [
        ("FLASH_ATTN", "fp8_e4m3", torch.uint8, "FP8_PER_TENSOR"),
        ("FLASHINFER", "fp8", torch.uint8, "FP8_PER_TENSOR"),
        ("TRITON_ATTN", "int8_per_token_head", torch.int8, "INT8_PER_TOKEN_HEAD"),
        ("TRITON_ATTN", "fp8_per_token_head", torch.uint8, "FP8_PER_TOKEN_HEAD"),
    ],
)
def test_quantised_caches_are_refused(name: str, cache_dtype: str, dtype: torch.dtype, mode: str) -> None:
    """fp8 caches are stored as uint8; Triton's per-token-head modes pack data and inline fp32 scales."""
    spec = resolve("FullAttentionSpec")(
        block_size=BLOCK,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_DIM,
        dtype=dtype,
        kv_quant_mode=getattr(resolve("KVQuantMode"), mode),
    )
    cls = backend_class(name)
    if cls is not None:
        spec = cls.customize_spec(spec)
    cache = layer_views(spec, resolve("KVCacheLayout").LBNHC)[LAYERS[0]]
    stored = str(dtype).removeprefix("torch.")
    with pytest.raises(UnsupportedKVLayoutError) as refused:
        paged_kv.check_kv_cache(cache, name, HEAD_DIM, kv_cache_dtype=cache_dtype, layer_name=LAYERS[0])
    assert str(refused.value) == (
        f"layer {LAYERS[0]}: kv_cache_dtype {cache_dtype!r} quantises the KV cache, which the KV handoff cannot "
        f"read back as keys and values; set --kv-cache-dtype auto (or bfloat16 / float16)"
    )
    for call in (
        lambda: paged_kv.check_kv_cache(cache, name, HEAD_DIM),
        lambda: paged_kv.key_value_blocks(cache, name, HEAD_DIM),
        lambda: paged_kv.read_tokens(cache, name, HEAD_DIM, REQUEST_BLOCKS, NUM_TOKENS),
    ):
        with pytest.raises(
            UnsupportedKVLayoutError, match=f"holds {stored}, a quantised cache .*kv-cache-dtype auto"
        ):
            call()


@pytest.mark.parametrize("name", ["FLASH_ATTN_DIFFKV", "TURBOQUANT", "TRITON_MLA", "FLASHMLA", "SOME_PLUGIN"])
def test_unknown_backends_are_refused_by_name(name: str) -> None:
    spec, layouts = backend_spec_and_layouts("FLASH_ATTN", torch.bfloat16)
    cache = layer_views(spec, layouts[0])[LAYERS[0]]
    for call in (
        lambda: paged_kv.check_kv_cache(cache, name, HEAD_DIM, layer_name=LAYERS[0]),
        lambda: paged_kv.key_value_blocks(cache, name, HEAD_DIM),
        lambda: paged_kv.read_tokens(cache, name, HEAD_DIM, [0], 1),
    ):
        with pytest.raises(UnsupportedKVLayoutError) as refused:
            call()
        message = str(refused.value)
        assert f"vLLM's {name} attention backend" in message and "\n" not in message
        assert "supported: B12X, CPU_ATTN, FLASHINFER, FLASH_ATTN, FLEX_ATTENTION" in message


def test_aiter_shuffled_layout_is_refused() -> None:
    """Under VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT AITER FA publishes K and V as two head planes
    (``customize_spec``) that its kernels shuffle in place: the shape alone shows it unless kv_heads == 2."""
    cls = backend_class("ROCM_AITER_FA")
    dtype = torch.bfloat16
    base = resolve("FullAttentionSpec")(block_size=BLOCK, num_kv_heads=4, head_size=HEAD_DIM, dtype=dtype)
    shuffled = type(base)(
        block_size=BLOCK,
        num_kv_heads=4,
        head_size=HEAD_DIM,
        dtype=dtype,
        num_head_slots=2,
        state_content_bytes=4 * HEAD_DIM * dtype.itemsize,
    )
    cache = layer_views(shuffled, resolve("KVCacheLayout").LHBNC)[LAYERS[0]]
    with pytest.raises(
        UnsupportedKVLayoutError, match="stores 256 values per token and head, not a key and a"
    ):
        paged_kv.check_kv_cache(cache, cls, HEAD_DIM)
    spec, layouts = backend_spec_and_layouts("ROCM_AITER_FA", dtype)
    two_heads = layer_views(spec, layouts[0])[LAYERS[0]]
    with pytest.raises(UnsupportedKVLayoutError, match="unset VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT"):
        paged_kv.check_kv_cache(two_heads, cls, HEAD_DIM, shuffled=True)


def test_kv_cache_dtype_at_configuration_time() -> None:
    dtypes = typing.get_args(resolve("CacheDType"))
    assert {"auto", "bfloat16", "float16", "fp8"} <= set(dtypes)
    for kv_cache_dtype in dtypes:
        refusal = paged_kv.kv_cache_dtype_refusal(kv_cache_dtype)
        if kv_cache_dtype in ("auto", "bfloat16", "float16"):
            assert refusal is None
        else:
            assert refusal is not None and "\n" not in refusal
            assert f"kv_cache_dtype {kv_cache_dtype!r} quantises the KV cache" in refusal
            assert "set --kv-cache-dtype auto" in refusal
    assert paged_kv.kv_cache_dtype_refusal(None) is None
