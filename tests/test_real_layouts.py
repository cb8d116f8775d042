"""Our loaders against the real checkpoints' layouts, without the 30 GB downloads.

``tests/data/real_models/`` holds the real configs of ByteDance-Seed/BAGEL-7B-MoT and zai-org/GLM-Image and
the tensor names and shapes of their weight files (its README says where each came from). Our models are
built from those configs on the meta device and loaded with meta tensors of the listed shapes: a naming or
shape mistake against the real checkpoints fails here instead of on a GPU host. BAGEL's weight files are
written as their real headers with no body, which also checks that learning names and shapes reads only
the header.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ENGINE_SCRIPTS, run_result_script
from vllm_omni_plugin.config.pipeline import detect_pipeline
from vllm_omni_plugin.models.bagel.config import BagelConfigError, load_bagel_config
from vllm_omni_plugin.models.bagel.weights import DTYPE_BYTES, CheckpointReader, read_header

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "real_models"
BAGEL_LISTINGS = DATA / "bagel_weights"
GLM_LISTINGS = DATA / "glm_image_weights"
SCRIPT = ENGINE_SCRIPTS / "real_layouts.py"
EMA, AE = "ema.safetensors", "ae.safetensors"


def listing(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def elements(tensors: dict[str, list[int]], keep: Any = lambda name: True) -> int:
    return sum(math.prod(shape) for name, shape in tensors.items() if keep(name))


def write_header_only(path: Path, entries: dict[str, Any]) -> int:
    """A safetensors file with the listing's real header (tensors laid out in order) and no body; returns
    the body size the header declares."""
    offset = 0
    header = {}
    for name, shape in entries["tensors"].items():
        size = math.prod(shape) * DTYPE_BYTES[entries["dtype"]]
        header[name] = {"dtype": entries["dtype"], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return offset


@pytest.fixture(scope="module")
def bagel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BAGEL-7B-MoT folder: its configs, the special tokens, header-only weight files."""
    root = tmp_path_factory.mktemp("bagel")
    for path in (DATA / "bagel").iterdir():
        shutil.copy(path, root / path.name)
    for name in (EMA, AE):
        write_header_only(root / name, listing(BAGEL_LISTINGS / f"{name}.json"))
    return root


# --- BAGEL: configs and what the checkpoint holds -------------------------------------------------------


def test_bagel_config_reader_takes_the_checkpoint_over_the_config(bagel_dir: Path) -> None:
    """The known facts of BAGEL-7B-MoT: Qwen2.5-7B's LLM, SigLIP so400m with one layer fewer in the
    checkpoint than vit_config says, and a 64 x 64 latent table where config.json says 32."""
    cfg = load_bagel_config(bagel_dir)
    llm = cfg.llm
    assert (llm.hidden_size, llm.intermediate_size, llm.num_layers) == (3584, 18944, 28)
    assert (llm.num_heads, llm.num_kv_heads, llm.head_dim, llm.vocab_size) == (28, 4, 128, 152064)
    assert llm.qk_norm and not llm.tie_word_embeddings
    assert (cfg.vit.hidden_size, cfg.vit.patch_size, cfg.vit.num_layers) == (1152, 14, 26)
    assert json.loads((bagel_dir / "vit_config.json").read_text())["num_hidden_layers"] == 27
    assert json.loads((bagel_dir / "config.json").read_text())["max_latent_size"] == 32
    assert (cfg.max_latent_size, cfg.vit_max_num_patch_per_side) == (64, 70)
    assert (cfg.latent_token_dim, cfg.max_image_side) == (64, 1024)
    assert (cfg.tokens.start_of_image, cfg.tokens.end_of_image) == (151652, 151653)

    tensors = listing(BAGEL_LISTINGS / f"{EMA}.json")["tensors"]
    vit_layers = {
        name.split(".")[4] for name in tensors if name.startswith("vit_model.vision_model.encoder.")
    }
    assert len(vit_layers) == cfg.vit.num_layers
    assert tensors["latent_pos_embed.pos_embed"] == [64 * 64, 3584]
    assert tensors["vit_model.vision_model.embeddings.patch_embedding.weight"] == [1152, 3 * 14 * 14]
    # 29 GB of bfloat16 and 335 MB of float32, the released files' sizes
    assert round(elements(tensors) * 2 / 1e9) == 29
    assert round(elements(listing(BAGEL_LISTINGS / f"{AE}.json")["tensors"]) * 4 / 1e6) == 335


def test_header_reads_need_only_the_header(bagel_dir: Path, tmp_path: Path) -> None:
    """The weight files here are headers without a body (29 GB declared, a few hundred KB present):
    safetensors' own reader, which maps the whole file, refuses them; names, shapes and the position
    tables come from the header alone, and only reading a tensor's data needs its bytes."""
    from safetensors import safe_open

    ema = bagel_dir / EMA
    declared = sum(e.end - e.start for e in read_header(ema).values())
    assert declared > 1000 * ema.stat().st_size
    with pytest.raises(Exception, match="(?i)incomplete|too small|metadata"):
        safe_open(str(ema), framework="pt")

    assert load_bagel_config(bagel_dir).max_latent_size == 64  # the table's rows, from the header
    with CheckpointReader(ema) as reader:
        assert reader.shape("language_model.lm_head.weight") == (152064, 3584)
        assert reader.tensor("vae2llm.weight", device="meta").shape == (3584, 64)
        assert reader.rows("language_model.model.embed_tokens.weight", [7, 9], device="meta").shape == (
            2,
            3584,
        )
        with pytest.raises(BagelConfigError, match=r"vae2llm.weight ends at byte \d+ but the file has"):
            reader.tensor("vae2llm.weight")
        with pytest.raises(BagelConfigError, match="has no tensor 'nope'"):
            reader.shape("nope")

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(BagelConfigError, match="header size"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 64) + b"{")
    with pytest.raises(BagelConfigError, match="truncated safetensors header"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(BagelConfigError, match="not JSON"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 2) + b"{}" + b"x")
    header = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4]}}
    raw = json.dumps(header).encode()
    bad.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    with pytest.raises(BagelConfigError, match="'a' .* is inconsistent"):
        read_header(bad)


def test_reads_match_safetensors_byte_for_byte(tmp_path: Path) -> None:
    """What the reader returns is what safetensors stores, whole tensors and single rows, every dtype."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn((5, 7), generator=gen).to(torch.bfloat16),
        "f32": torch.randn((3, 4, 2), generator=gen),
        "f16": torch.randn((6,), generator=gen).to(torch.float16),
        "i64": torch.arange(12).reshape(3, 4),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros((0, 4)),
    }
    path = tmp_path / "small.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with CheckpointReader(path) as reader:
        for name, value in tensors.items():
            assert torch.equal(reader.tensor(name), value), name
        assert torch.equal(reader.rows("bf16", [4, 0, 4]), tensors["bf16"][[4, 0, 4]])
        assert reader.tensor("f32", dtype=torch.float64).dtype == torch.float64
        assert reader.read == [*tensors, "bf16", "f32"]


# --- BAGEL: both stages' loaders ----------------------------------------------------------------------------


def test_bagel_dit_reads_the_real_layout(bagel_dir: Path) -> None:
    """The generation stage's loader on the real names and shapes (meta tensors): both experts of every
    layer, two embedding rows, the generation heads, the latent table and the FLUX decoder; nothing else."""
    from vllm_omni_plugin.families.bagel.transformer import GenerationTransformer
    from vllm_omni_plugin.models.bagel.autoencoder import load_vae_decoder, load_vae_encoder

    cfg = load_bagel_config(bagel_dir)
    meta = torch.device("meta")
    with CheckpointReader(cfg.llm_weights) as reader:
        model = GenerationTransformer.load(cfg, reader, dtype=torch.bfloat16, device=meta)
        ema_read = set(reader.read)
    assert len(model.layers) == 28 and model.latent_pos_embed.shape == (4096, 3584)
    assert model.markers.shape == (2, 3584)
    ema = set(listing(BAGEL_LISTINGS / f"{EMA}.json")["tensors"])
    not_for_generation = ("vit_model.", "connector.", "vit_pos_embed.", "language_model.lm_head.")
    assert ema_read == {
        n for n in ema if not n.startswith(not_for_generation) and n != "language_model.model.norm.weight"
    }
    assert len(ema_read) == 28 * 2 * 14 + 1 + 1 + 4 + 4 + 1  # experts, embed, norm_moe_gen, heads, table

    ae = set(listing(BAGEL_LISTINGS / f"{AE}.json")["tensors"])
    for load, part in ((load_vae_decoder, "decoder."), (load_vae_encoder, "encoder.")):
        with CheckpointReader(cfg.vae_weights) as reader:
            load(reader, cfg.vae, dtype=torch.bfloat16, device=meta)
            assert set(reader.read) == {n for n in ae if n.startswith(part)}
    assert ae == {n for n in ae if n.startswith(("encoder.", "decoder."))}


@pytest.fixture(scope="module")
def thinker_loads(bagel_dir: Path) -> list[dict[str, Any]]:
    """The thinker loaded twice: from ema + ae through vLLM's iterator (a folder without an index file),
    and from ema alone (the encoder then read from ae.safetensors by the thinker itself)."""
    ema, ae = BAGEL_LISTINGS / f"{EMA}.json", BAGEL_LISTINGS / f"{AE}.json"
    return run_result_script(SCRIPT, "bagel", str(bagel_dir), f"{ema},{ae}", str(ema), timeout=900)


def test_bagel_thinker_loads_every_weight_of_the_real_checkpoint(thinker_loads: list[dict[str, Any]]) -> None:
    """Nothing missing, no name or shape refused, and every element of the checkpoint lands in a
    parameter except what the thinker leaves by design: the DiT's heads and final norm, the decoder,
    and the two position tables (recomputed)."""
    ema = listing(BAGEL_LISTINGS / f"{EMA}.json")["tensors"]
    ae = listing(BAGEL_LISTINGS / f"{AE}.json")["tensors"]
    left = ("llm2vae.", "language_model.model.norm_moe_gen.", "latent_pos_embed.", "vit_pos_embed.")
    expected = elements(ema, lambda n: not n.startswith(left)) + elements(
        ae, lambda n: n.startswith("encoder.")
    )
    for load in thinker_loads:
        assert load["error"] is None
        assert load["missing"] == [] and load["not_params"] == []
        assert load["param_elements"] == expected


# --- GLM-Image ------------------------------------------------------------------------------------------


def test_glm_image_ar_loads_every_weight_of_the_real_checkpoint() -> None:
    """Our vLLM GLM-Image AR model with the real config and the engine arguments resolution gives it
    (sampling over the 16512 image ids, 168064 embedding rows), loaded with transformers' names."""
    encoder = DATA / "glm_image" / "vision_language_encoder"
    (load,) = run_result_script(
        SCRIPT, "glm_image", str(encoder), str(GLM_LISTINGS / "vision_language_encoder.json"), timeout=900
    )
    assert load["error"] is None
    assert load["missing"] == [] and load["not_params"] == []
    tensors = listing(GLM_LISTINGS / "vision_language_encoder.json")["tensors"]
    assert tensors["lm_head.weight"] == [16512, 4096]
    assert tensors["model.language_model.embed_tokens.weight"] == [168064, 4096]
    unused = "model.vqmodel.post_quant_conv."  # the decode half of the VQ model
    assert load["param_elements"] == elements(tensors, lambda n: not n.startswith(unused))


def test_glm_image_dit_components_load_into_the_diffusers_classes() -> None:
    """model_index.json names the classes; each component config builds its class with exactly the listed
    tensors, and the components agree with each other and with the AR model."""
    sys.path.insert(0, str(DATA))
    try:
        from generate_glm_image_weights import component_modules, weight_listing
    finally:
        sys.path.remove(str(DATA))

    modules = component_modules()
    index = json.loads((DATA / "glm_image" / "model_index.json").read_text())
    for name, module in modules.items():
        assert index[name][1] == type(module).__name__
        assert weight_listing(module) == listing(GLM_LISTINGS / f"{name}.json")["tensors"], name

    transformer, vae = modules["transformer"].config, modules["vae"].config
    ar = json.loads((DATA / "glm_image" / "vision_language_encoder" / "config.json").read_text())
    assert transformer.num_attention_heads * transformer.attention_head_dim == 4096
    assert transformer.text_embed_dim == modules["text_encoder"].config.d_model == 1472
    assert transformer.prior_vq_quantizer_codebook_size == ar["vq_config"]["num_embeddings"] == 16384
    assert transformer.in_channels == vae.latent_channels == 16
    dit = listing(GLM_LISTINGS / "transformer.json")["tensors"]
    assert round(elements(dit) / 1e9) == 7  # "a 7B-parameter decoder"
    assert detect_pipeline(str(DATA / "glm_image")).name == "glm_image"


def test_the_real_folders_select_their_pipelines(bagel_dir: Path) -> None:
    assert detect_pipeline(str(bagel_dir)).name == "bagel"
    assert detect_pipeline(str(DATA / "glm_image")).name == "glm_image"
