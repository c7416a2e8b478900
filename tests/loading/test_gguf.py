"""GGUF reading, checked against independent references.

- Dequantization: every supported type against the ``gguf`` package's own ``gguf.quants.dequantize``, on random
  blocks and on blocks made by ``gguf.quants.quantize``.
- Parsing: our header parser against ``gguf.GGUFReader`` (through ``read_metadata``).
- The default model (SmolLM2-135M, Q4_1): config and every tensor against HF transformers' GGUF loader.
- Tiny random HF models of every architecture, written to GGUF here the way llama.cpp's converter does (names from
  the ``gguf`` package's own HF->GGUF map, llama q/k rows permuted, Gemma norms stored as 1 + w): we must give back
  the original HF tensors and config, and agree with transformers' GGUF loader where it reads that architecture.
- Bad files: missing, truncated, garbage, empty, unknown architecture, unsupported tensor type.

HF's reference goes through ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` (the function
``from_pretrained(gguf_file=...)`` calls to read, dequantize and rename the tensors) with the model built on the
meta device for its parameter names: ``from_pretrained`` itself insists on ``accelerate`` for GGUF files.
"""

from __future__ import annotations

import dataclasses
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import longrope

from jaxserve.config import ModelConfig
from jaxserve.loading.gguf import _CHUNK_VALUES, SUPPORTED_TYPES, GGUFCheckpoint, dequantize, read_metadata

# ------------------------------------------------------------------------------------------ dequantization
# Byte offsets of the float16 scale fields inside one block (ggml-common.h). Random bytes there are often NaN or
# inf, which would make whole blocks NaN and hide decoding errors, so the tests write finite values there.
F16_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
QUANTIZABLE = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # types gguf.quants.quantize implements


def test_supported_types_listed():
    assert set(SUPPORTED_TYPES) == {Q.F32, Q.F16, Q.BF16, Q.Q8_K, *F16_FIELDS}


def _random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, row_bytes] uint8: random bytes with finite float16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_dequantize_random_blocks_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block_size
    rows = _CHUNK_VALUES // cols + 3  # more than one chunk of our chunked loop
    raw = _random_blocks(qtype, rows, cols, rng)
    ours = dequantize(raw, qtype, (rows, cols), name="w")
    ref = gguf.quants.dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == (rows, cols) == ref.shape
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_dequantize_float_types_random_bits(qtype):
    rng = np.random.default_rng(7)
    itemsize = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (48, 40 * itemsize), dtype=np.uint8)  # every bit pattern, NaN and inf included
    ours = dequantize(raw, qtype, (48, 40))
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    np.testing.assert_array_equal(ours, ref.reshape(48, 40))  # NaNs compare equal here


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_realistic_blocks(qtype):
    rng = np.random.default_rng(11)
    data = rng.standard_normal((64, 256)).astype(np.float32) * 0.02
    raw = gguf.quants.quantize(data, qtype)
    ours = dequantize(raw, qtype, data.shape)
    np.testing.assert_allclose(ours, gguf.quants.dequantize(raw, qtype), rtol=1e-6, atol=0)
    rel_err = np.linalg.norm(ours - data) / np.linalg.norm(data)
    assert rel_err < 0.15, rel_err  # and it is the data that went in (4-bit types are the coarsest)


def test_dequantize_q8_k():
    # gguf.quants has no Q8_K; reference: a plain per-block reading of block_q8_K (f32 d, 256 int8, 16 int16).
    rng = np.random.default_rng(3)
    n_blocks = 5
    blocks = []
    for _ in range(n_blocks):
        qs = rng.integers(-128, 128, 256)
        bsums = qs.reshape(16, 16).sum(axis=1)
        blocks.append(struct.pack("<f256b16h", float(rng.standard_normal()), *qs, *bsums))
    raw = np.frombuffer(b"".join(blocks), np.uint8)
    ref = []
    for block in blocks:
        d, *qs = struct.unpack_from("<f256b", block)
        ref.extend(np.float32(d) * np.float32(q) for q in qs)
    np.testing.assert_array_equal(dequantize(raw, Q.Q8_K, (n_blocks, 256)), np.array(ref, np.float32).reshape(-1, 256))


def test_dequantize_bad_inputs():
    with pytest.raises(ValueError, match=r"unsupported ggml type IQ2_XXS for tensor 'blk\.0\.attn_q\.weight'"):
        dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,), name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"Q8_0 tensor 'x' of shape \(2, 32\) needs 68 bytes, got 34"):
        dequantize(np.zeros(34, np.uint8), Q.Q8_0, (2, 32), name="x")
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        dequantize(np.zeros(34, np.uint8), Q.Q8_0, (32, 1))
    with pytest.raises(ValueError, match="unknown ggml type 1234"):
        dequantize(np.zeros(4, np.uint8), 1234, (1,))


# ------------------------------------------------------------------------------------------ metadata parsing
def _writer(path, arch: str) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("test model")
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_metadata_all_value_types_match_gguf_reader(tmp_path):
    path = tmp_path / "types.gguf"
    w = _writer(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    _finish(w)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.metadata == read_metadata(path)
    assert ckpt.metadata["t.str"] == "héllo ✓" and ckpt.metadata["t.u64"] == 2**63 + 5
    assert ckpt.tensor_shapes() == {"x": (3, 4)}
    np.testing.assert_array_equal(ckpt.tensor("x"), np.arange(12, dtype=np.float32).reshape(3, 4))


# ------------------------------------------------------------------------------------------ bad files
@pytest.fixture(scope="module")
def default_path():
    from jaxserve.defaults import default_model_path

    return default_model_path()


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        GGUFCheckpoint(path)


def test_truncated_file(tmp_path, default_path):
    data = default_path.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"half\.gguf is truncated .*tensor '.+' needs bytes"):
        GGUFCheckpoint(half)
    header = tmp_path / "header.gguf"  # cut inside the token list
    header.write_bytes(data[:100_000])
    with pytest.raises(ValueError, match=r"header\.gguf is truncated"):
        GGUFCheckpoint(header)


def test_garbage_and_empty_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"garbage\.gguf is corrupt or not a GGUF file: bad magic"):
        GGUFCheckpoint(garbage)
    fake = tmp_path / "fake.gguf"  # right magic and version, absurd counts
    fake.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40) + bytes(100))
    with pytest.raises(ValueError, match="corrupt.*implausible counts"):
        GGUFCheckpoint(fake)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="truncated or corrupt: the file is empty"):
        GGUFCheckpoint(empty)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = _writer(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    _finish(w)
    ckpt = GGUFCheckpoint(path)  # the file itself is fine
    assert ckpt.architecture == "mamba"
    for call in (ckpt.model_config, lambda: next(ckpt.iter_hf_tensors())):
        with pytest.raises(ValueError, match="architecture 'mamba' is not supported; jaxserve supports llama, qwen2"):
            call()


def _tiny_llama_writer(path):
    w = _writer(path, "llama")
    for key, value in dict(block_count=1, embedding_length=32, feed_forward_length=64, context_length=128).items():
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    return w


def test_unsupported_tensor_type_and_unknown_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    w = _tiny_llama_writer(path)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.add_tensor("blk.0.mystery.weight", np.zeros(4, np.float32))
    _finish(w)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.tensor_shapes()["blk.0.attn_q.weight"] == (32, 256)
    with pytest.raises(ValueError, match=r"IQ2_XXS for tensor 'blk\.0\.attn_q\.weight'"):
        ckpt.tensor("blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.mystery\.weight' is not known to the llama GGUF loader"):
        next(ckpt.iter_hf_tensors())


def test_missing_tensor_is_named_as_the_file_names_it(tmp_path):
    """A GGUF file without one of its tensors: the error names llama.cpp's name for it (and HF's), not only
    jaxserve's parameter."""
    from jaxserve.loading import load_model

    path = tmp_path / "holed.gguf"
    w = _tiny_llama_writer(path)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    for name, shape in {"attn_norm": (32,), "ffn_norm": (32,), "attn_q": (32, 32), "attn_v": (32, 32)}.items():
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    for name, shape in {
        "attn_output": (32, 32),
        "ffn_gate": (64, 32),
        "ffn_up": (64, 32),
        "ffn_down": (32, 64),
    }.items():
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    _finish(w)  # no blk.0.attn_k.weight
    with pytest.raises(
        ValueError,
        match=r"missing tensor 'blk\.0\.attn_k\.weight' \(HF model\.layers\.0\.self_attn\.k_proj\.weight; weight 'wk' of layer 0, shape \(32, 32\)\)$",
    ):
        load_model(path)


def test_rope_freqs_that_are_not_llama3(tmp_path):
    path = tmp_path / "rope.gguf"
    w = _tiny_llama_writer(path)
    w.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))
    _finish(w)
    with pytest.raises(ValueError, match="rope_freqs.weight does not match llama3 rope scaling"):
        GGUFCheckpoint(path).model_config()


# ------------------------------------------------------------------------------------------ HF references
def _hf_gguf_tensors(path, hf_config) -> dict[str, np.ndarray]:
    """HF transformers' reading of a GGUF file: names of the model's parameters, float32 numpy values."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only the parameter names are needed
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    names = set(model.state_dict())
    tensors = {name: t.float().numpy() for name, t in parsed["tensors"].items()}
    assert set(tensors) <= names
    assert names - set(tensors) <= {"lm_head.weight"}  # tied to the embedding when absent
    return tensors


def _assert_same_tensors(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray], atol: float):
    assert sorted(ours) == sorted(ref)
    for name, value in ref.items():
        assert ours[name].dtype == np.float32, name
        assert ours[name].shape == value.shape, name
        np.testing.assert_allclose(ours[name], value, rtol=0, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def default_hf(default_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(default_path.parent, gguf_file=default_path.name)
    return config, _hf_gguf_tensors(default_path, config)


@pytest.mark.slow
def test_default_model_metadata_matches_gguf_reader(default_path):
    assert GGUFCheckpoint(default_path).metadata == read_metadata(default_path)


@pytest.mark.slow
def test_default_model_config_matches_hf(default_path, default_hf):
    hf, _ = default_hf
    cfg = GGUFCheckpoint(default_path).model_config()
    assert hf.model_type == cfg.architecture == "llama"
    ours = (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        cfg.rope_theta,
        cfg.max_position_embeddings,
        cfg.tie_word_embeddings,
        cfg.bos_token_id,
        cfg.eos_token_ids,
    )
    theirs = (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
        hf.rms_norm_eps,
        hf.rope_parameters["rope_theta"],
        hf.max_position_embeddings,
        hf.tie_word_embeddings,
        hf.bos_token_id,
        (hf.eos_token_id,),
    )
    assert ours == theirs
    assert hf.rope_parameters.get("rope_type", "default") == "default" and cfg.rope_scaling is None
    assert not (cfg.attention_bias or cfg.qk_norm or cfg.sandwich_norms or cfg.scale_embeddings)
    assert cfg.hidden_act == hf.hidden_act == "silu"


@pytest.mark.slow
def test_default_model_tensors_match_hf(default_path, default_hf):
    _, ref = default_hf
    ckpt = GGUFCheckpoint(default_path)
    ours = dict(ckpt.iter_hf_tensors(progress=False))
    assert ckpt.hf_tensor_shapes() == {name: v.shape for name, v in ours.items()}
    _assert_same_tensors(ours, ref, atol=1e-6)


# ------------------------------------------------------------------------------------------ tiny models
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CASES = {  # name: (gguf arch, HF config class, overrides)
    "llama": (
        "llama",
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=False,
        ),
    ),
    "llama_tied": ("llama", "LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2": ("qwen2", "Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # Fused qkv / gate_up tensors, longrope's factors as tensors, half of each head rotated.
    "phi3": (
        "phi3",
        "Phi3Config",
        dict(
            pad_token_id=0,
            original_max_position_embeddings=64,
            rope_parameters=longrope([1.0, 1.5, 2.0, 3.0], [1.0, 4.0, 9.0, 16.0], partial_rotary_factor=0.5),
        ),
    ),
    "qwen3_yarn": (
        "qwen3",
        "Qwen3Config",
        dict(
            head_dim=32,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    "gemma": ("gemma", "GemmaConfig", dict(head_dim=16, num_key_value_heads=1)),
    "gemma2": (
        "gemma2",
        "Gemma2Config",
        dict(
            head_dim=24,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
        ),
    ),  # llama.cpp scales Gemma-2 attention by head_dim ** -0.5 (but for 27B)
    # llama.cpp: every 6th layer global, the local layers' rope base 10,000, attention scaled by head_dim ** -0.5;
    # the global layers' linear rope scaling of 4B / 12B / 27B in rope.scaling.*.
    "gemma3": (
        "gemma3",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=7,
            head_dim=24,
            sliding_window=5,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
    ),
}
HF_READS = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
)  # GGUF architectures transformers' GGUF loader supports


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k row order for llama: the two rope halves of a head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(theta, head_dim, factor, low, high, orig) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for llama3 scaling: per-frequency divisors."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _write_like_llamacpp(path, arch: str, config, state: dict[str, np.ndarray]) -> None:
    """A GGUF file as llama.cpp's converter would write this HF model (float32 tensors). A MoE's ``state`` holds
    each expert stack in one [E, out, in] tensor (as the converter merges them), named without the expert index."""
    a = arch + "."
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: one per layer type, the global layers' in the file
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w = _writer(path, arch)
    w.add_uint32(a + "context_length", config.max_position_embeddings)
    w.add_uint32(a + "embedding_length", config.hidden_size)
    w.add_uint32(a + "block_count", config.num_hidden_layers)
    w.add_uint32(a + "feed_forward_length", config.intermediate_size)
    w.add_uint32(a + "attention.head_count", config.num_attention_heads)
    w.add_uint32(a + "attention.head_count_kv", config.num_key_value_heads)
    w.add_float32(a + "rope.freq_base", rope["rope_theta"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if arch == "llama":
        w.add_uint32(a + "rope.dimension_count", head_dim)
    elif arch == "phi3":
        w.add_uint32(a + "rope.dimension_count", int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    else:
        w.add_uint32(a + "attention.key_length", head_dim)
        w.add_uint32(a + "attention.value_length", head_dim)
    if getattr(config, "num_local_experts", None):  # a mixture of experts (llama.cpp writes Mixtral as llama)
        w.add_uint32(a + "expert_count", config.num_local_experts)
        w.add_uint32(a + "expert_used_count", config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            w.add_uint32(a + "expert_feed_forward_length", config.moe_intermediate_size)
    if arch == "gemma2":
        w.add_float32(a + "attn_logit_softcapping", config.attn_logit_softcapping)
        w.add_float32(a + "final_logit_softcapping", config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        w.add_uint32(a + "attention.sliding_window", config.sliding_window)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(config.vocab_size)])
    for key in ("bos_token_id", "eos_token_id"):
        if getattr(config, key, None) is not None:
            w.add_uint32("tokenizer.ggml." + key, getattr(config, key))
    if rope.get("rope_type") == "longrope":  # the converter's tensors (it also writes an attn_factor: derived here)
        w.add_uint32(a + "rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    if rope.get("rope_type") == "linear":
        w.add_string(a + "rope.scaling.type", "linear")
        w.add_float32(a + "rope.scaling.factor", rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_string(a + "rope.scaling.type", "yarn")
        w.add_float32(a + "rope.scaling.factor", rope["factor"])
        w.add_uint32(a + "rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor(
            "rope_freqs.weight",
            _llama3_rope_freqs(
                rope["rope_theta"],
                head_dim,
                rope["factor"],
                rope["low_freq_factor"],
                rope["high_freq_factor"],
                rope["original_max_position_embeddings"],
            ),
        )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, value in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and ".attn_q." in name:
            value = _llamacpp_permute(value, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            value = _llamacpp_permute(value, config.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp stores Gemma's RMSNorm scale as 1 + w
        w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    _finish(w)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (gguf arch, HF config, HF state dict as numpy, path of the GGUF file); built once per case."""
    import torch
    import transformers

    cache = {}

    def build(case: str):
        if case in cache:
            return cache[case]
        arch, config_cls, extra = CASES[case]
        config = getattr(transformers, config_cls)(**{**COMMON, **extra})
        torch.manual_seed(sorted(CASES).index(case))
        model = transformers.AutoModelForCausalLM.from_config(config)
        rng = np.random.default_rng(sorted(CASES).index(case))
        state = {}
        for name, t in model.state_dict().items():
            value = t.float().numpy().copy()
            if "norm" in name:  # random norm weights, so a wrong norm convention shows up
                value = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
            state[name] = value
        path = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
        _write_like_llamacpp(path, arch, config, state)
        cache[case] = arch, config, state, path
        return cache[case]

    return build


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_tensors_round_trip(tiny, case):
    _, config, state, path = tiny(case)
    ckpt = GGUFCheckpoint(path)
    expected = {k: v for k, v in state.items() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    # float32 tensors come back exactly, except Gemma norms: (1 + w) - 1 rounds to within 1.2e-7.
    _assert_same_tensors(dict(ckpt.iter_hf_tensors(progress=False)), expected, atol=2e-7)
    assert ckpt.metadata == read_metadata(path)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_config_round_trip(tiny, case):
    arch, config, _, path = tiny(case)
    ours = GGUFCheckpoint(path).model_config()
    expected = ModelConfig.from_hf(config.to_dict())
    f32 = float(np.float32(expected.rms_norm_eps))  # GGUF stores the epsilon as float32
    assert ours == dataclasses.replace(expected, rms_norm_eps=f32)
    assert ours.architecture == arch


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] in HF_READS])
def test_tiny_model_tensors_match_hf_gguf_loader(tiny, case):
    _, config, _, path = tiny(case)
    ours = dict(GGUFCheckpoint(path).iter_hf_tensors(progress=False))
    _assert_same_tensors(ours, _hf_gguf_tensors(path, config), atol=0)
