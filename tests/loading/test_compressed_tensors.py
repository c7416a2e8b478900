"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A16 / W8A8 / FP8 output) served quantized.

The reference is the compressed-tensors library itself: it quantizes and packs the weights the tests make, and
its own ``decompress`` gives the float weights ours must equal (float32 scales: to float32 rounding; bfloat16
scales are read exactly). End to end, a tiny Llama saved in this format by the tests runs in jaxserve with its
weights still packed, and its logits match HF transformers running the same model on the library's decompressed
weights (1e-4).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference model is HF transformers")
ct = pytest.importorskip("compressed_tensors", reason="the reference is the compressed-tensors library")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from flax import nnx  # noqa: E402
from jaxserve.kernels import ragged_paged_attention_ref, write_kv_ref  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from jaxserve import quant  # noqa: E402
from jaxserve.loading import load_model  # noqa: E402
from jaxserve.loading.compressed import quantized_tensors  # noqa: E402
from jaxserve.loading.weights import _quantized_parts, _stack_quantized  # noqa: E402
from jaxserve.models.decoder import AttentionBatch, model_from_params  # noqa: E402

# (format, weight args, activation args or None)
SCHEMES = {
    "w4a16_group32": ("pack-quantized", dict(num_bits=4, symmetric=True, strategy="group", group_size=32), None),
    "w4a16_asym_group32": ("pack-quantized", dict(num_bits=4, symmetric=False, strategy="group", group_size=32), None),
    "w4a16_channel": ("pack-quantized", dict(num_bits=4, symmetric=True, strategy="channel"), None),
    "w8a16_packed": ("pack-quantized", dict(num_bits=8, symmetric=True, strategy="channel"), None),
    "w8a16_packed_asym": ("pack-quantized", dict(num_bits=8, symmetric=False, strategy="group", group_size=32), None),
    "w8a16_int": ("int-quantized", dict(num_bits=8, symmetric=True, strategy="channel"), None),
    "w8a8_dynamic": (
        "int-quantized",
        dict(num_bits=8, symmetric=True, strategy="channel"),
        dict(num_bits=8, symmetric=True, strategy="token", dynamic=True),
    ),
    "fp8_channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"), None),
    "fp8_tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), None),
}


def _compress(w: torch.Tensor, fmt: str, wargs: dict, scale_dtype=torch.float32) -> tuple[dict, dict]:
    """(compressed tensors, the library's decompressed float32 weight) of one [out, in] weight."""
    args = QuantizationArgs(**wargs)
    if args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    scale, zp = calculate_qparams(lo, hi, args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    packed = compressor.compress({"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zp}, scheme)
    ref = compressor.decompress(dict(packed), scheme)["weight"].float()
    return packed, ref


def _np(v: torch.Tensor) -> np.ndarray:
    """A tensor as the safetensors reader gives it (bfloat16 and float8 through ml_dtypes)."""
    if v.dtype == torch.bfloat16:
        return v.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if v.dtype == torch.float8_e4m3fn:
        return v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return v.numpy()


def _ours(packed: dict, qcfg: dict) -> tuple[quant.QArray, np.ndarray]:
    """Our QArray of one compressed module (as the loader builds it) and its dequantized [out, in] weight."""
    [(name, q)] = list(quantized_tensors([(f"m.{k}", _np(v)) for k, v in packed.items()], qcfg))
    assert name == "m.weight"
    qa = _stack_quantized({None: _quantized_parts(q, transpose=True)})
    return qa, np.asarray(quant.dequantize(qa)).T


def _qcfg(fmt: str, wargs: dict, aargs: dict | None) -> dict:
    group = {"targets": ["Linear"], "weights": QuantizationArgs(**wargs).model_dump(mode="json")}
    if aargs is not None:
        group["input_activations"] = QuantizationArgs(**aargs).model_dump(mode="json")
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_weights_equal_the_librarys_decompression(scheme):
    fmt, wargs, aargs = SCHEMES[scheme]
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.linspace(0.1, 3.0, 128)  # channels of different ranges
    packed, ref = _compress(w, fmt, wargs)
    qa, ours = _ours(packed, _qcfg(fmt, wargs, aargs))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6, atol=1e-6)
    bits = wargs["num_bits"]
    assert qa.bits == bits and qa.q.dtype == (
        np.uint8 if bits == 4 else np.int8 if fmt != "float-quantized" else jnp.float8_e4m3fn
    )
    assert qa.act_quant == (aargs is not None)
    x = np.random.default_rng(1).normal(size=(5, 128)).astype(np.float32)
    product = np.asarray(quant.matmul(jnp.asarray(x), qa))
    want = x @ ref.numpy().T
    tol = 0.02 * np.abs(want).max() if aargs is not None else 1e-4 * np.abs(want).max()  # w8a8: int8 activations
    np.testing.assert_allclose(product, want, atol=tol, rtol=0)


def test_bfloat16_scales_are_read_exactly():
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    wargs = dict(num_bits=4, symmetric=True, strategy="group", group_size=32)
    packed, ref = _compress(w, "pack-quantized", wargs, scale_dtype=torch.bfloat16)
    _, ours = _ours(packed, _qcfg("pack-quantized", wargs, None))
    # Ours is (q - 8) * scale in float32, exact for a bfloat16 scale; the library computes it in bfloat16, which
    # rounds that exact product once.
    np.testing.assert_array_equal(ours.astype(ml_dtypes.bfloat16).astype(np.float32), ref.numpy())
    assert np.abs(ours - ref.numpy()).max() > 0  # so the scales were not rounded on the way in


COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def _logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    """One prefill chunk through our paged forward (reference kernels)."""
    page_size, n = 4, len(tokens)
    num_pages = -(-n // page_size)
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    model = nnx.merge(*model_from_params(cfg, params))
    batch = AttentionBatch(
        positions=jnp.arange(n, dtype=jnp.int32),
        slot_mapping=jnp.arange(n, dtype=jnp.int32),
        kv_lens=jnp.asarray([n], jnp.int32),
        page_indices=jnp.arange(num_pages)[None],
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray(1, jnp.int32),
    )
    hidden, _, _ = model(
        jnp.asarray(tokens), batch, jnp.zeros(shape), jnp.zeros(shape), ragged_paged_attention_ref, write_kv_ref
    )
    return np.asarray(model.logits(hidden))


def _save_compressed(tmp_path, scheme: str, **config) -> torch.nn.Module:
    """A random tiny Llama saved as a compressed-tensors directory; returns the HF model holding the library's
    decompressed weights (the reference)."""
    fmt, wargs, aargs = SCHEMES[scheme]
    torch.manual_seed(2)
    config = transformers.LlamaConfig(**{**COMMON, **config})
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).eval()
    tensors, decompressed = {}, {}
    for name, p in hf.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and ".layers." in name and "norm" not in name:
            packed, ref = _compress(p.detach().float(), fmt, wargs)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            decompressed[name] = ref
        else:
            tensors[name] = p.detach().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf_cfg = json.loads(config.to_json_string())
    hf_cfg["quantization_config"] = _qcfg(fmt, wargs, aargs)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    hf.load_state_dict({**hf.state_dict(), **decompressed})
    return hf


@pytest.mark.parametrize("scheme", ["w4a16_group32", "w4a16_asym_group32", "w8a16_int", "fp8_channel"])
def test_a_compressed_tensors_llama_matches_hf_on_the_decompressed_weights(scheme, tmp_path):
    hf = _save_compressed(tmp_path, scheme)
    wargs = SCHEMES[scheme][1]
    loaded = load_model(tmp_path)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert quant.is_quantized(loaded.params[name]) and loaded.params[name].bits == wargs["num_bits"], name
    tokens = np.random.default_rng(3).integers(0, COMMON["vocab_size"], 13)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float().numpy()
    np.testing.assert_allclose(_logits(loaded.params, loaded.config, tokens), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "qcfg, words",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
    ],
)
def test_unsupported_quantization_is_named(tmp_path, qcfg, words):
    config = transformers.LlamaConfig(**COMMON)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf_cfg, "quantization_config": qcfg}))
    with pytest.raises(ValueError, match=words):
        load_model(tmp_path)


@pytest.mark.slow
@pytest.mark.multidevice
def test_the_engine_serves_a_compressed_directory_quantized(tmp_path, default_loaded):
    """``LLM(dir)`` (weights placed on the 8 test devices as loaded, tensor-parallel 2): greedy tokens that HF,
    teacher-forced on them, ranks first (within 1e-4 of its best logit, for near-ties of a random model)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.tokenizer import load_tokenizer

    hf = _save_compressed(tmp_path, "w4a16_asym_group32", vocab_size=49152)  # the default tokenizer's vocabulary
    (tmp_path / "tokenizer.json").write_text(load_tokenizer(default_loaded.tokenizer_path).to_json())
    llm = LLM(str(tmp_path), tensor_parallel_size=2, max_model_len=64, num_pages=16)
    assert llm.engine.runner.state is not None and any(
        quant.is_quantized(v) for v in jax.tree.leaves(llm.engine.runner.state, is_leaf=quant.is_quantized)
    )
    prompt = [1, 504, 3458, 314, 260]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float().numpy()
    chosen = logits[np.arange(len(tokens)), tokens]
    np.testing.assert_array_less(logits.max(-1) - chosen, 1e-4)


# ------------------------------------------------------------------------------------------------ AutoAWQ (GEMM)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i of each int32 holds column AWQ_ORDER[i]


def _awq_pack(v: np.ndarray) -> np.ndarray:
    """[rows, cols] values in [0, 15] -> AutoAWQ GEMM int32 [rows, cols / 8], written from its packing rule."""
    rows, cols = v.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def _awq_module(out: int, cols: int, group: int, seed: int) -> dict:
    """Random AWQ tensors of a [out, in=cols] linear layer (AWQ stores them [in, ...])."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (cols, out))
    z = rng.integers(0, 16, (cols // group, out))
    scales = (rng.random((cols // group, out)) * 0.02 + 0.001).astype(np.float16)
    return {
        "qweight": torch.from_numpy(_awq_pack(q)),
        "qzeros": torch.from_numpy(_awq_pack(z)),
        "scales": torch.from_numpy(scales),
    }


def _awq_reference(module: dict, group: int) -> torch.Tensor:
    """The float weight [out, in] by compressed-tensors: its AutoAWQ converter, then its own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converted = AutoAWQConverter(group_size=group).process({f"m.{k}": v for k, v in module.items()})
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=group)
    )
    parts = {k.removeprefix("m."): v.float() if k.endswith("scale") else v for k, v in converted.items()}
    return PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()


def test_awq_weights_equal_the_converters_decompression():
    module = _awq_module(48, 256, 64, seed=4)
    ref = _awq_reference(module, 64)
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    [(name, q)] = list(quantized_tensors([(f"m.{k}", v.numpy()) for k, v in module.items()], qcfg))
    qa = _stack_quantized({None: _quantized_parts(q, transpose=True)})
    assert name == "m.weight" and qa.bits == 4 and qa.q.dtype == np.uint8
    np.testing.assert_allclose(np.asarray(quant.dequantize(qa)).T, ref.numpy(), rtol=1e-6, atol=1e-7)


def test_an_awq_llama_matches_hf_on_the_decompressed_weights(tmp_path):
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**COMMON)
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).eval()
    tensors, decompressed = {}, {}
    for i, (name, p) in enumerate(hf.state_dict().items()):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and ".layers." in name and "norm" not in name:
            parts = _awq_module(p.shape[0], p.shape[1], 32, seed=i)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
            decompressed[name] = _awq_reference(parts, 32)
        else:
            tensors[name] = p.detach().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf_cfg = json.loads(config.to_json_string())
    hf_cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    hf.load_state_dict({**hf.state_dict(), **decompressed})
    loaded = load_model(tmp_path)
    assert all(quant.is_quantized(loaded.params[n]) for n in ("wq", "wo", "w_gate", "w_down"))
    tokens = np.random.default_rng(6).integers(0, COMMON["vocab_size"], 13)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float().numpy()
    np.testing.assert_allclose(_logits(loaded.params, loaded.config, tokens), ref, atol=1e-4, rtol=0)
