"""Quantized weights: the formats against independent references, and the default model quantized on load.

References: ``gguf.quants`` (the gguf package's own dequantizers) for GGUF blocks; plain numpy for the
on-load formats' defining formulas; the float32 model for perplexity and greedy agreement.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import first_layers, hf_greedy_choices

from jaxserve import LLM, SamplingParams, quant

# ---------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("mode, axis", [("int8", -2), ("w8a8", -2), ("int4", -2), ("int8", -1), ("int4", -1)])
def test_quantize_round_trip_within_half_a_step(mode, axis):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 512, 256)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(1, 1, 256))
    a = quant.quantize(w, mode, axis=axis)
    assert a.shape == w.shape
    d = np.asarray(quant.dequantize(a))
    # Independent recomputation of each element's step from the stored scales (int4: codes times their
    # multipliers), in numpy.
    scale = np.asarray(a.scale, np.float32)
    if mode == "int4":
        assert a.scale.dtype == np.uint8 and a.zero.dtype == np.int8 and a.group == 32
        scale = scale * np.asarray(a.scale_mul)
        zero = np.asarray(a.zero, np.float32) * np.asarray(a.zero_mul)
        values = np.asarray(quant._unpack4(a.q, axis), np.float32)
        np.testing.assert_array_equal(d, values * np.repeat(scale, 32, axis=axis) + np.repeat(zero, 32, axis=axis))
        assert values.min() == 0 and values.max() == 15
    step = np.repeat(scale, a.group, axis=axis)
    assert np.all(np.abs(d - w) <= step / 2 + 1e-6 * np.abs(w) + 1e-7)
    if mode == "int4":
        assert a.q.dtype == np.uint8 and a.q.shape[axis] == w.shape[axis] // 2  # two per byte, stays packed
        assert a.nbytes / w.nbytes <= 0.15
    else:
        assert a.q.dtype == np.int8 and a.nbytes / w.nbytes <= 0.27


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("rows", [5, 12])  # w8a8: the output projection takes a float product below 8 rows
def test_matmul_equals_the_dequantized_product(mode, rows):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(384, 64)).astype(np.float32)
    x = rng.normal(size=(rows, 384)).astype(np.float32)
    a = quant.quantize(w, mode)
    got = np.asarray(quant.matmul(jnp.asarray(x), a))
    if mode == "w8a8":  # activations quantized per row too: numpy's int8 x int8 product, rescaled
        xs = np.abs(x).max(-1, keepdims=True) / 127
        xq = np.clip(np.round(x / xs), -127, 127).astype(np.int64)
        ref = (xq @ np.asarray(a.q, np.int64)) * xs * np.asarray(a.scale).reshape(1, -1)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_allclose(got, x @ np.asarray(quant.dequantize(a)), rtol=1e-5, atol=1e-4)
    e = rng.normal(size=(100, 64)).astype(np.float32)  # the tied embedding: rows taken, and x @ E.T
    ea = quant.quantize(e, "int8" if mode == "w8a8" else mode, axis=-1)
    ids = jnp.array([3, 0, 99])
    np.testing.assert_array_equal(np.asarray(quant.take(ea, ids)), np.asarray(quant.dequantize(ea))[[3, 0, 99]])
    xe = rng.normal(size=(2, 64)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(quant.matmul(jnp.asarray(xe), ea)), xe @ np.asarray(quant.dequantize(ea)).T, rtol=1e-5, atol=1e-4
    )
    if mode == "w8a8":  # the output projection under w8a8 (its rows quantized too), x @ E.T against numpy's ints
        ew = quant.quantize(e, "w8a8", axis=-1)
        xe = rng.normal(size=(rows, 64)).astype(np.float32)
        xs = np.abs(xe).max(-1, keepdims=True) / 127
        xq = np.clip(np.round(xe / xs), -127, 127).astype(np.int64)
        ref = (xq @ np.asarray(ew.q, np.int64).T) * xs * np.asarray(ew.scale).reshape(1, -1)
        np.testing.assert_allclose(np.asarray(quant.matmul(jnp.asarray(xe), ew)), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_cpp_rows_product_equals_the_dequantized_product(mode, m):
    """The C++ product of a few rows by quantized weights (one request's decode steps on one CPU device), reading
    the values packed, one matrix of a stack in place: numpy's float64 product by the weights the jnp reference
    (``quant.dequantize``) gives, within float32 accumulation error. 200 columns: not a multiple of the 64-column
    strips nor of 16 (the scalar tails); 4-bit products of up to 4 rows sum ranges of groups apart (12 groups in 4);
    the [V, D] embedding's ``x @ E.T`` too (int4 in groups of 64, and of 16: two groups in each 16 bytes); scales
    float32 (int8) and 8-bit codes times a multiplier per output channel (int4)."""
    from jaxserve.kernels.cpu import ffi as cpu_ffi
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()
    rng = np.random.default_rng(m)
    stack = quant.quantize(rng.normal(size=(3, 384, 200)).astype(np.float32), mode, group=32)
    x = rng.normal(size=(m, 384)).astype(np.float32)
    cases = [(stack, 0), (stack, 2)]
    if mode == "int4":  # groups of 6: 3 bytes a column, an odd count (up to 4 rows stream two byte rows at a time)
        cases.append((quant.quantize(rng.normal(size=(2, 384, 200)).astype(np.float32), mode, group=6), 1))
    for w, layer in cases:
        got = np.asarray(matmul_cpu.matmul_quant_rows(jnp.asarray(x), w, jnp.int32(layer)))
        want = x.astype(np.float64) @ np.asarray(quant.dequantize(w)[layer], np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for group in (64, 16) if mode == "int4" else (64,):
        embed = quant.quantize(rng.normal(size=(300, 384)).astype(np.float32), mode, axis=-1, group=group)
        got = np.asarray(matmul_cpu.matmul_quant_rows(jnp.asarray(x), embed))
        want = x.astype(np.float64) @ np.asarray(quant.dequantize(embed), np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the model's matmul routes up to 8 rows there (int8 per output channel: fewer than 8); W8A8 (activations
    # quantized too) has its own product
    from jaxserve.layers.linear import matmul

    routed = np.asarray(matmul(jnp.asarray(x), embed, matmul_cpu.ROWS))
    np.testing.assert_array_equal(routed, got)
    assert matmul_cpu.ROWS.serves(stack, 8) == (mode == "int4") and matmul_cpu.ROWS.serves(stack, 7)
    assert matmul_cpu.ROWS.serves(stack, 9) == (mode == "int4")  # from 9 rows: dequantized in C++, XLA's product
    assert not matmul_cpu.quant_rows_serves(quant.quantize(rng.normal(size=(384, 64)).astype(np.float32), "w8a8"))
    with pytest.raises(ValueError, match="M <= 8"):
        matmul_cpu.matmul_quant_rows(jnp.zeros((9, 384), jnp.float32), stack, jnp.int32(0))
    with pytest.raises(Exception, match="matmul_quant_rows"):  # the C++ check of the layer index
        np.asarray(matmul_cpu.matmul_quant_rows(jnp.asarray(x), stack, jnp.int32(3)))
    if mode == "int4":  # coded scales whose multipliers do not match their output channels
        bad = dataclasses.replace(stack, scale_mul=stack.scale_mul[..., :100])
        with pytest.raises(Exception, match="multipliers"):
            np.asarray(matmul_cpu.matmul_quant_rows(jnp.asarray(x), bad, jnp.int32(0)))


def _int8_rows(x):
    """W8A8's activations in numpy: each row to int8 (scale max |row| * float32(1 / 127), 1 for a zero row)."""
    amax = np.abs(x).max(-1, keepdims=True)
    xs = np.where(amax > 0, amax * np.float32(1 / 127), np.float32(1))
    return np.clip(np.round(x / xs), -127, 127).astype(np.int64), xs


@pytest.mark.parametrize("m", [1, 3, 5, 8])
def test_cpp_w8a8_rows_equal_numpy_integer_sums(m):
    """W8A8 steps of up to 8 rows in C++ (AVX-512 VNNI, else plain loops): the activations quantized per row, the
    int8 x int8 sums in int32, then ``sums * x_scale * w_scale`` in float32: bit for bit numpy's quantization and int64
    sums scaled in the same order, and XLA's product (quant.matmul, the larger steps').
    K = 387 and N = 200 leave tails of every block (VNNI's 4 rows of K, 64 columns, the transposed rows' 64 values;
    K odd); a stack's layers and the transposed [V, D] embedding; 5 rows split in blocks of 4 and 1; and a [384, 192]
    stack (K a multiple of 4, N of 64), which up to 4 rows stream in ranges of rows."""
    from jaxserve.kernels.cpu import ffi as cpu_ffi
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    from jaxserve.layers.linear import matmul

    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()
    rng = np.random.default_rng(m)
    x = (rng.normal(size=(m, 387)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
    if m > 1:
        x[1] = 0  # a zero row: scale 1
    xq, xs = _int8_rows(x)
    jxq, jxs = quant.quantize_rows(jnp.asarray(x))  # XLA's quantization (larger steps): the same numbers
    np.testing.assert_array_equal(np.asarray(jxq), xq)
    np.testing.assert_array_equal(np.asarray(jxs), xs)

    def want(q, scale):  # q [K, N] int8, scale [N]
        return (xq @ np.asarray(q, np.int64)).astype(np.float32) * xs.astype(np.float32) * scale.astype(np.float32)

    stack = quant.quantize(rng.normal(size=(3, 387, 200)).astype(np.float32), "w8a8")
    embed = quant.quantize(rng.normal(size=(300, 387)).astype(np.float32), "w8a8", axis=-1)
    assert (
        matmul_cpu.ROWS.serves(stack, m) and matmul_cpu.ROWS.serves(embed, m) and not matmul_cpu.ROWS.serves(stack, 9)
    )
    for layer in (0, 2):
        got = np.asarray(matmul(jnp.asarray(x), stack, matmul_cpu.ROWS, jnp.int32(layer)))
        np.testing.assert_array_equal(got, want(stack.q[layer], np.asarray(stack.scale[layer]).reshape(-1)))
    got = np.asarray(matmul(jnp.asarray(x), embed, matmul_cpu.ROWS))
    np.testing.assert_array_equal(got, want(np.asarray(embed.q).T, np.asarray(embed.scale).reshape(-1)))
    # and XLA's product (quant.matmul) gives the same
    np.testing.assert_array_equal(got, np.asarray(quant.matmul(jnp.asarray(x), embed)))
    np.testing.assert_array_equal(
        np.asarray(matmul_cpu.matmul_w8a8_rows(jnp.asarray(x), stack, jnp.int32(1))),
        np.asarray(quant.matmul(jnp.asarray(x), jax.tree.map(lambda a: a[1], stack))),
    )
    with pytest.raises(Exception, match="matmul_w8a8_rows"):  # the C++ check of the layer index
        np.asarray(matmul_cpu.matmul_w8a8_rows(jnp.asarray(x), stack, jnp.int32(3)))
    # K a multiple of 4 and N of 64: up to 4 rows stream ranges of rows, their int32 sums added after
    x = x[:, :384]
    xq, xs = _int8_rows(x)
    aligned = quant.quantize(rng.normal(size=(2, 384, 192)).astype(np.float32), "w8a8")
    for layer in (0, 1):
        got = np.asarray(matmul(jnp.asarray(x), aligned, matmul_cpu.ROWS, jnp.int32(layer)))
        np.testing.assert_array_equal(got, want(aligned.q[layer], np.asarray(aligned.scale[layer]).reshape(-1)))


def _grouped(rng, shape, bits, group, axis, scale_dtype, offset=0, zero=True):
    """A QArray of random values and scales, grouped along ``axis`` (as GGUF's blocks: int8 in groups too).
    ``scale_dtype`` "coded": uint8 scale and int8 zero codes with float32 multipliers per output channel."""
    k_axis = len(shape) + axis
    groups = list(shape)
    groups[k_axis] //= group
    packed = list(shape)
    packed[k_axis] //= 8 // bits
    q = rng.integers(-128, 128, packed).astype(np.int8) if bits == 8 else rng.integers(0, 256, packed).astype(np.uint8)
    muls = {}
    if scale_dtype == "coded":
        scale = rng.integers(0, 256, groups).astype(np.uint8)
        z = rng.integers(-127, 128, groups).astype(np.int8) if zero else None
        channels = groups[:k_axis] + [1] + groups[k_axis + 1 :]
        muls = {"scale_mul": jnp.asarray(rng.random(channels) + 0.01, jnp.float32)}
        muls["zero_mul"] = jnp.asarray(rng.random(channels) + 0.01, jnp.float32) if zero else None
    else:
        scale = (rng.random(groups) + 0.5).astype(scale_dtype)
        z = rng.normal(size=groups).astype(scale_dtype) if zero else None
    return quant.QArray(
        jnp.asarray(q),
        jnp.asarray(scale),
        None if z is None else jnp.asarray(z),
        **muls,
        bits=bits,
        group=group,
        offset=offset,
        axis=axis,
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_cpp_dequantize_equals_the_jnp_reference(bits):
    """The C++ dequantization (steps of more than 8 rows on one CPU device dequantize each layer in place for XLA's
    product): bit for bit the jnp reference's weights, in float32 and rounded to bfloat16; both layouts, float16
    and float32 scales and coded ones (int4's: uint8 / int8 codes times float32 multipliers per output channel),
    with and without zero and offset, a stack's layers, 200 columns (not a multiple of 16); transposed groups of 8
    bytes (two in each 16-byte chunk)."""
    from jaxserve.kernels.cpu import ffi as cpu_ffi
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()
    rng = np.random.default_rng(bits)
    cases = [
        ((3, 64, 200), -2, 32, np.float16, 8 if bits == 4 else 0, True),
        ((3, 96, 48), -2, 16, np.float32, 0, False),
        ((2, 40, 128), -1, 32, np.float16, 0, True),
        ((2, 40, 128), -1, 64, np.float32, 3, False),
        ((3, 64, 200), -2, 32, "coded", 0, True),
        ((2, 40, 128), -1, 64 // bits, "coded", 0, True),
        ((2, 40, 128), -1, 32, "coded", 0, False),
    ]
    for shape, axis, group, scale_dtype, offset, zero in cases:
        w = _grouped(rng, shape, bits, group, axis, scale_dtype, offset, zero)
        for layer in range(shape[0]):
            ref = quant.dequantize(jax.tree.map(lambda a, i=layer: a[i], w))
            for dtype in (jnp.float32, jnp.bfloat16):
                got = matmul_cpu.dequantize(w, jnp.int32(layer), dtype)
                assert got.dtype == dtype and got.shape == ref.shape
                np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref.astype(dtype), np.float32))
    with pytest.raises(Exception, match="dequantize"):  # the C++ check of the layer index
        np.asarray(matmul_cpu.dequantize(w, jnp.int32(2)))


@pytest.mark.parametrize("dot_dtype", [None, "bfloat16"])
def test_rows_product_of_many_rows_dequantizes_in_cpp(dot_dtype):
    """From 9 rows the model's product by a grouped quantized stack is XLA's, by the C++ dequantization of each
    layer (in ``dot_dtype``): against numpy's float64 product by the jnp reference's weights (float32: within its
    accumulation error; bfloat16: within the rounding of both operands, 2**-8 relative each). The tied output
    projection by the [V, D] embedding dequantizes 4,096 rows at a time (three blocks here)."""
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    from jaxserve.layers.linear import matmul

    rng = np.random.default_rng(9)
    tol = dict(rtol=1e-5, atol=1e-5) if dot_dtype is None else dict(rtol=0, atol=1e-2)
    stack = dataclasses.replace(_grouped(rng, (2, 128, 96), 4, 32, -2, np.float16), dot_dtype=dot_dtype)
    embed = dataclasses.replace(_grouped(rng, (12288, 64), 8, 32, -1, np.float16, zero=False), dot_dtype=dot_dtype)
    if dot_dtype:  # int4's coded scales, the vocabulary's groups of 16 (each block takes its multipliers)
        embed = _grouped(rng, (12288, 64), 4, 16, -1, "coded")
    assert matmul_cpu._vocab_blocks(12288) == 3
    for rows in (9, 40):
        assert matmul_cpu.ROWS.serves(stack, rows) and matmul_cpu.ROWS.serves(embed, rows)
        x = rng.normal(size=(rows, 128)).astype(np.float32)
        got = np.asarray(matmul(jnp.asarray(x), stack, matmul_cpu.ROWS, jnp.int32(1)))
        want = x.astype(np.float64) @ np.asarray(quant.dequantize(stack)[1], np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"{dot_dtype} {rows} rows: worst error {err:.2e} of the largest output")
        np.testing.assert_allclose(got / np.abs(want).max(), want / np.abs(want).max(), **tol)
        assert (err > 1e-4) == (dot_dtype is not None)  # the bfloat16 product really ran (or really did not)
        xe = x[:, :64]
        got = np.asarray(matmul(jnp.asarray(xe), embed, matmul_cpu.ROWS))
        want = xe.astype(np.float64) @ np.asarray(quant.dequantize(embed), np.float64).T
        # the output projection multiplies in float32 whatever dot_dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    per_channel = quant.quantize(rng.normal(size=(2, 128, 96)).astype(np.float32), "int8")
    assert not matmul_cpu.ROWS.serves(per_channel, 9)  # XLA converts int8 per channel inside its own product


def test_bad_modes_are_refused(default_loaded):
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.quantize(np.ones((4, 4)), "int3")
    with pytest.raises(ValueError, match="EngineConfig.quantization must be one of"):
        LLM(default_loaded, quantization="nf4")
    with pytest.raises(ValueError, match="fp8.*cpu"):
        LLM(default_loaded, quantization="fp8")
    with pytest.raises(ValueError, match="cannot be combined"):
        LLM(default_loaded, quantization="w8a8", matmul_dtype="bfloat16")
    with pytest.raises(ValueError, match="no quantization group"):
        quant.quantize(np.ones((24, 4)), "int4")


# ---------------------------------------------------------------------------------------------- the default model

ENGINE = dict(max_model_len=1024, num_pages=160, max_num_seqs=8, max_num_batched_tokens=512)


def _english_text_ids(llm, n_chunks=6, chunk=512):
    from pydoc_data.topics import topics  # Python's own documentation text, present in every Python

    text = "\n\n".join(topics[k] for k in sorted(topics))[:40000]
    ids = llm.tokenizer.encode(text)
    return [ids[i : i + chunk] for i in range(0, n_chunks * chunk, chunk)]


def _score(llm, chunks):
    """(perplexity, the most likely next token at every position) under teacher forcing."""
    outs = llm.generate(chunks, SamplingParams(prompt_logprobs=1, max_tokens=1), use_tqdm=False)
    nll, top = [], []
    for ids, out in zip(chunks, outs):
        for pos in range(1, len(ids)):
            entries = out.prompt_logprobs[pos]
            nll.append(-entries[ids[pos]].logprob)
            top.append(max(entries.items(), key=lambda kv: kv[1].logprob)[0])
    return float(np.exp(np.mean(nll))), np.array(top)


# The quantized engines that two tests of this module serve: built once (the int4 and GGUF conversions are checked
# against the engines that the quality and HF tests use).
SHARED_MODES = ("int4", "gguf")


@pytest.fixture(scope="module")
def quantized_llm(default_model_path, default_loaded):
    """``quantized_llm(mode, source=None)``: the default model quantized on load with the module's ENGINE
    (``LLM(source, quantization=mode, **ENGINE)``; source: the float32 weights, or for "gguf" the file's own
    blocks); SHARED_MODES' engines are kept for the module."""
    from jaxserve.loading import load_model

    engines = {}

    def get(mode, source=None):
        if mode in engines:
            return engines[mode]
        if source is None:
            gguf = mode == "gguf"
            source = load_model(default_model_path, "float32", keep_quantized=True) if gguf else default_loaded
        llm = LLM(source, quantization=mode, **ENGINE)
        if mode in SHARED_MODES:
            engines[mode] = llm
        return llm

    yield get
    engines.clear()


@pytest.fixture(scope="module")
def float_reference(default_loaded):
    llm = LLM(default_loaded, **ENGINE)
    chunks = _english_text_ids(llm)
    ppl, top = _score(llm, chunks)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
    return chunks, ppl, top, nbytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, max_ppl_ratio, min_agreement, max_bytes_ratio",
    [
        ("int8", 1.01, 0.90, 0.27),
        ("w8a8", 1.06, 0.85, 0.27),
        # int4: groups of 32 (the GGUF file's own, exactly re-found) and of 16 for the 8-bit embedding: +3.2%, 88.5%
        ("int4", 1.05, 0.85, 0.15),
    ],
)
def test_default_model_quantized_on_load(
    quantized_llm, float_reference, mode, max_ppl_ratio, min_agreement, max_bytes_ratio
):
    chunks, ppl, top, nbytes = float_reference
    llm = quantized_llm(mode)
    state = llm.engine.runner.state
    assert any(isinstance(v, quant.QArray) for v in jax.tree.leaves(state, is_leaf=quant.is_quantized))
    q_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert q_bytes / nbytes <= max_bytes_ratio + 0.01  # norms stay float32: ~0.1% of the weights
    q_ppl, q_top = _score(llm, chunks)
    agreement = float(np.mean(q_top == top))
    assert q_ppl / ppl <= max_ppl_ratio, (mode, q_ppl, ppl)
    assert agreement >= min_agreement, (mode, agreement)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mode", ["int4", "int8", "w8a8"])
def test_quantized_under_tensor_parallelism_equals_one_device(default_loaded, mode):
    prompts = ["The capital of France is", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # W8A8's per-token activation quantization turns float32 noise into whole rounding steps that later layers carry
    # on: on one device the jnp reference attention instead of the C++ one moved a teacher-forced logprob by 0.05 on
    # an AVX-512 CPU and by 0.9 on an AVX2 one. Its two sides therefore take the same attention (the reference); the
    # sharded products' int32 sums are exact, so what is left to differ is only the sharding.
    attention = dict(attention_impl="reference") if mode == "w8a8" else {}
    # Sharding plumbing: the default model's first two layers (every kind of quantized parameter, a quarter of the
    # bytes to quantize on load and of the cost a token); the quantized model's quality is checked on all 30 above.
    model = first_layers(default_loaded)
    one = LLM(model, quantization=mode, **attention, **ENGINE)
    tp = LLM(model, quantization=mode, tensor_parallel_size=3, **attention, **ENGINE)
    runs = one.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in runs
    ]
    # Teacher-forced on one device's tokens, the two give the same log-probabilities.
    texts = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in runs]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for ids, a, b in zip(texts, one.generate(texts, score, use_tqdm=False), tp.generate(texts, score, use_tqdm=False)):
        want = [lp[t].logprob for lp, t in zip(a.prompt_logprobs[1:], ids[1:])]
        got = [lp[t].logprob for lp, t in zip(b.prompt_logprobs[1:], ids[1:])]
        np.testing.assert_allclose(got, want, atol=1e-3)
    wo = tp.engine.runner.state["wo"].get_value()
    assert isinstance(wo, quant.QArray) and wo.q.sharding.spec[1] == "model"  # row-parallel: split input rows
    # int4's group scales are split with their rows; a per-channel scale (one row) is replicated.
    assert wo.scale.sharding.spec[1] == ("model" if mode == "int4" else None)


# ---------------------------------------------------------------------------------------------- GGUF served quantized


def _random_k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Valid K-quant blocks (the gguf package cannot quantize to these): random bytes, with the float16 super-block
    scales set to sane values."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    at = (208,) if qtype.name == "Q6_K" else (0, 2)
    for start in at:
        b[:, start : start + 2] = rng.uniform(1e-3, 2e-2, size=(len(b), 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_repacked_dequantize_exactly_as_gguf_quants(qtype):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    from jaxserve.loading.gguf import repack
    from jaxserve.loading.weights import _quantized_parts

    t = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(48, 256)) * rng.uniform(0.01, 2, size=(48, 1))).astype(np.float32)  # [out, in]
    blocks = _random_k_blocks(t, *w.shape, rng) if qtype.endswith("_K") else gguf_quants.quantize(w, t)
    reference = gguf_quants.dequantize(blocks, t)  # the gguf package's own dequantizer
    for transpose in (True, False):  # a linear weight ([in, out], grouped along in) and the embedding ([V, D])
        parts = _quantized_parts(repack(blocks, t, w.shape), transpose)
        a = quant.QArray(**{k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in parts.items()})
        got = np.asarray(quant.dequantize(a))
        np.testing.assert_array_equal(got, reference.T if transpose else reference)
        x = rng.normal(size=(3, 256)).astype(np.float32)
        if transpose:
            np.testing.assert_allclose(
                np.asarray(quant.matmul(jnp.asarray(x), a)), x @ reference.T, rtol=1e-5, atol=1e-4
            )
        # The C++ product of one request's steps reads the blocks as repacked (scales, mins, offsets): x @ W for the
        # linear weight, x @ E.T for the embedding, both x @ reference.T.
        assert matmul_cpu.quant_rows_serves(a)
        want = x.astype(np.float64) @ reference.T.astype(np.float64)
        np.testing.assert_allclose(
            np.asarray(matmul_cpu.matmul_quant_rows(jnp.asarray(x), a)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )
    with pytest.raises(ValueError, match="cannot be served quantized"):
        repack(gguf_quants.quantize(w, GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0, w.shape, name="x")


@pytest.mark.slow
def test_default_model_served_from_its_own_blocks_matches_hf(
    default_model_path, hf_default, default_loaded, quantized_llm
):
    """The Q4_1 / Q8_0 file served quantized: weights dequantized bit for bit as HF's GGUF loader does, greedy
    tokens identical to HF transformers' (teacher-forced: ``helpers.hf_greedy_choices``), at 0.18x the float32
    bytes."""
    from jaxserve.loading import load_model

    loaded = load_model(default_model_path, "float32", keep_quantized=True)
    for name in ("embed", "wq", "wk", "w_down"):
        assert isinstance(loaded.params[name], quant.QArray)
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, loaded.params[name]))), default_loaded.params[name]
        )
    llm = quantized_llm("gguf", loaded)  # LLM(loaded, quantization="gguf", **ENGINE), kept for the conversion test
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # and each prompt alone: one-row decode steps, which take the C++ product of the packed blocks on the CPU
    runner = llm.engine.runner
    assert runner._rows_fn() is not None and runner.token_buckets[0] == 1
    steps = runner.decode_steps
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert runner.decode_steps - steps >= 3 * 23
    for prompt, out, single in zip(prompts, outs, alone):
        ids = llm.tokenizer.encode(prompt)
        want = list(out.outputs[0].token_ids)
        assert len(want) == 24 and hf_greedy_choices(hf_default, ids, want) == want, prompt
        assert single.outputs[0].token_ids == want, prompt
    q_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
    f_bytes = sum(np.asarray(v).nbytes for v in default_loaded.params.values())
    assert q_bytes / f_bytes < 0.19
    with pytest.raises(ValueError, match="keep_quantized"):
        LLM(default_loaded, quantization="gguf", **ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "gguf"])
def test_convert_writes_quantized_orbax_and_serves_it_the_same(default_model_path, quantized_llm, tmp_path, mode):
    from jaxserve.cli import main
    from jaxserve.loading import load_model

    dst = tmp_path / "ckpt"
    assert main(["convert", str(default_model_path), str(dst), "--quantization", mode]) == 0
    restored = load_model(dst)
    assert isinstance(restored.params["wq"], quant.QArray) and isinstance(restored.params["embed"], quant.QArray)
    direct = quantized_llm(mode)  # the source quantized on load (gguf: its own blocks), with the same ENGINE
    served = LLM(str(dst), **ENGINE)  # quantized as written, no flag needed
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):"]
    assert [o.outputs[0].token_ids for o in served.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in direct.generate(prompts, params, use_tqdm=False)
    ]
    assert isinstance(served.engine.runner.state["wq"].get_value(), quant.QArray)
