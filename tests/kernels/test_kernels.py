"""Tests of jaxserve.kernels: the jnp reference against a naive numpy loop, then every Pallas kernel against it.

The kernels run in Pallas interpret mode on the CPU (GPU-style kernels in the HLO interpreter, TPU kernels in
TPU interpret mode, which also simulates the DMAs and semaphores). Inputs are random normal, never zeros.

Poisoning, so that a read of the wrong element or an element never written fails loudly:
  * cache pages no sequence owns, and slots past a sequence's kv_len inside owned pages, are NaN;
  * page-table entries past a sequence's pages point out of range (or are -1 for padding sequences);
  * both interpreters fill output buffers and VMEM scratch with NaN before the kernel runs (checked below by
    ``test_interpreters_poison_unwritten_memory``), so every output element a kernel fails to write is NaN;
  * layer 1 is compared (layer 0 holds different data), so reading the wrong layer fails.

Tolerances: float32 atol = rtol = 1e-5 (reference vs naive float64 loop, and kernels vs reference);
bfloat16 atol = rtol = 1e-2.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Batch, make_batch
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxserve.kernels import AttentionBatch, write_kv_ref
from jaxserve.kernels.attention import reference
from jaxserve.kernels.attention.gpu import ragged_paged_attention_gpu
from jaxserve.kernels.attention.tpu import ragged_paged_attention_tpu
from jaxserve.kernels.dispatch import choose_kernel

from jaxserve import kernels

PAGE = 16
F32_TOL = 1e-5
BF16_TOL = 1e-2
SM_SCALE = 0.125

# A batch with every edge at once (page 16): full prefills of 15 / 16 / 17 tokens, an empty chunk (q_len 0),
# decode tokens at and just past a page boundary and as a sequence's very first token, a chunk starting
# mid-page (positions 20..24) and one starting on a page boundary (32..47); padding sequences and tokens.
MIXED_Q = [15, 16, 17, 0, 1, 1, 1, 5, 16]
MIXED_KV = [15, 16, 17, 15, 16, 17, 1, 25, 48]
# Decode only: one token per sequence, contexts around page boundaries and a longer one.
DECODE_Q = [1, 1, 1, 1, 1]
DECODE_KV = [1, 16, 17, 33, 70]


# The batches of these tests: every row of the table has a spare column, 4 unowned pages, 2 layers.
make_batch = functools.partial(make_batch, page=PAGE)


def naive_attention(b: Batch, layer, *, sm_scale, window=0, soft_cap=None, sinks=None) -> np.ndarray:
    """One query token and one head at a time, in float64, straight from the definition (``sinks``: gpt-oss's,
    as HF transformers computes them: the head's sink concatenated to its scores, softmaxed, then dropped)."""
    q = np.asarray(b.q, np.float64)
    kc, vc = np.asarray(b.k_cache, np.float64), np.asarray(b.v_cache, np.float64)
    cu, kv_lens, table = np.asarray(b.cu_q_lens), np.asarray(b.kv_lens), np.asarray(b.page_indices)
    group = q.shape[1] // kc.shape[3]
    out = np.zeros_like(q)
    for s in range(int(b.num_seqs)):
        q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
        ks = np.stack([kc[layer, table[s, p // PAGE], p % PAGE] for p in range(kv_len)])  # [kv_len, K, D]
        vs = np.stack([vc[layer, table[s, p // PAGE], p % PAGE] for p in range(kv_len)])
        for j in range(q_len):
            t, pos = cu[s] + j, kv_len - q_len + j
            lo = max(0, pos - window + 1) if window > 0 else 0
            for h in range(q.shape[1]):
                scores = ks[lo : pos + 1, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                if sinks is not None:
                    scores = np.append(scores, float(sinks[h]))
                p = np.exp(scores - scores.max())
                p = (p / p.sum())[: pos + 1 - lo]
                out[t, h] = p @ vs[lo : pos + 1, h // group]
    return out


def assert_close(out, expected, dtype=jnp.float32):
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


def assert_padding_zero(out, b: Batch):
    n = int(b.cu_q_lens[int(b.num_seqs)])
    assert n < out.shape[0], "test batch should have padding tokens"
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0)


# ------------------------------------------------------------------------------------------ the reference
def sinks_for(hq: int) -> jax.Array:
    """Attention sinks around the scores' range (scaled scores here are ~N(0, 1)): some heads' sinks dominate their
    softmax, some hardly count."""
    return jnp.asarray(np.random.default_rng(7).normal(0.0, 2.0, hq), jnp.float32)


@pytest.mark.parametrize("path", ["dense", "gather"])
@pytest.mark.parametrize(
    "hq, hk, window, soft_cap, sinks",
    [(8, 2, 0, None, False), (6, 2, 7, None, False), (4, 1, 20, 5.0, False), (2, 2, 0, None, False)]
    + [(8, 2, 0, None, True), (6, 2, 7, 5.0, True)],
    ids=["gqa4", "gqa3-window7", "gqa4-window20-softcap", "mha", "gqa4-sinks", "gqa3-window7-softcap-sinks"],
)
def test_reference_matches_naive(path, hq, hk, window, soft_cap, sinks):
    if path == "dense":  # few sequences: every sequence's context is gathered once and masked densely
        b = make_batch([5, 1, 0, 17, 3], [20, 16, 15, 17, 40], hq=hq, hk=hk, pad_seqs=2)
        assert b.page_indices.shape[0] <= reference._DENSE_MAX_SEQS
    else:  # many sequences: each token gathers its own context
        b = make_batch(MIXED_Q, MIXED_KV, hq=hq, hk=hk, pad_seqs=2)
        assert b.page_indices.shape[0] > reference._DENSE_MAX_SEQS
    sinks = sinks_for(hq) if sinks else None
    for layer in (0, 1):
        out = reference.ragged_paged_attention_ref(
            *b.args(layer), sm_scale=SM_SCALE, sliding_window=window, soft_cap=soft_cap, sinks=sinks
        )
        expected = naive_attention(b, layer, sm_scale=SM_SCALE, window=window, soft_cap=soft_cap, sinks=sinks)
        assert_close(out, expected)
        assert_padding_zero(out, b)


def test_reference_traced_window_and_layer():
    b = make_batch(MIXED_Q, MIXED_KV)
    fn = jax.jit(functools.partial(reference.ragged_paged_attention_ref, sm_scale=SM_SCALE))
    out = fn(b.q, b.k_cache, b.v_cache, jnp.int32(1), b.meta, sliding_window=jnp.int32(9))
    assert_close(out, naive_attention(b, 1, sm_scale=SM_SCALE, window=9))


def test_write_kv_in_the_tpu_layout_matches_numpy():
    """``kernels.write_kv`` on pools [L, pages, kv_heads, page_size, head_dim] (the TPU's): row t's head h lands at
    [layer, page, h, offset]; a negative slot writes nothing."""
    rng = np.random.default_rng(3)
    kc, vc = (rng.standard_normal((2, 6, 2, PAGE, 64)).astype(np.float32) for _ in range(2))
    new_k, new_v = (rng.standard_normal((9, 2, 64)).astype(np.float32) for _ in range(2))
    slots = rng.choice(6 * PAGE, 9, replace=False).astype(np.int32)
    slots[[0, 7]] = -1
    out_k, out_v = kernels.write_kv(
        jnp.asarray(kc),
        jnp.asarray(vc),
        1,
        jnp.asarray(new_k),
        jnp.asarray(new_v),
        AttentionBatch(slot_mapping=slots),
        impl="pallas",
        backend="tpu",
        layout="heads_tokens",
    )
    for t, slot in enumerate(slots):
        if slot >= 0:
            kc[1, slot // PAGE, :, slot % PAGE] = new_k[t]
            vc[1, slot // PAGE, :, slot % PAGE] = new_v[t]
    np.testing.assert_array_equal(out_k, kc)
    np.testing.assert_array_equal(out_v, vc)


def test_write_kv_ref_matches_numpy():
    rng = np.random.default_rng(1)
    kc = rng.standard_normal((2, 6, PAGE, 2, 64)).astype(np.float32)
    vc = rng.standard_normal((2, 6, PAGE, 2, 64)).astype(np.float32)
    new_k = rng.standard_normal((9, 2, 64)).astype(np.float32)
    new_v = rng.standard_normal((9, 2, 64)).astype(np.float32)
    slots = rng.choice(6 * PAGE, 9, replace=False).astype(np.int32)
    slots[[2, 5]] = -1
    out_k, out_v = write_kv_ref(
        jnp.asarray(kc), jnp.asarray(vc), 1, jnp.asarray(new_k), jnp.asarray(new_v), AttentionBatch(slot_mapping=slots)
    )
    for t, slot in enumerate(slots):
        if slot >= 0:
            kc[1, slot // PAGE, slot % PAGE] = new_k[t]
            vc[1, slot // PAGE, slot % PAGE] = new_v[t]
    np.testing.assert_array_equal(out_k, kc)
    np.testing.assert_array_equal(out_v, vc)


# ------------------------------------------------------------------------------------------ the kernels
def test_interpreters_poison_unwritten_memory():
    """The premise of the poisoning: memory a kernel never writes reads back as NaN in both interpreters."""

    def writes_nothing(x_ref, o_ref):
        pass

    x = jnp.ones((8, 128), jnp.float32)
    out_shape = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    gpu = pl.pallas_call(writes_nothing, out_shape=out_shape, interpret=True)(x)
    tpu = pl.pallas_call(
        writes_nothing, out_shape=out_shape, interpret=pltpu.InterpretParams(uninitialized_memory="nan")
    )(x)
    assert np.isnan(np.asarray(gpu)).all() and np.isnan(np.asarray(tpu)).all()


def run_kernel(backend, b: Batch, layer=1, **kw):
    """The GPU or TPU kernel in interpret mode; "tpu-heads": the TPU kernel over the pool in its TPU layout,
    [L, pages, kv_heads, page_size, head_dim] (the same values)."""
    if backend == "tpu-heads":
        q, k, v, *rest = b.args(layer)
        k, v = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
        return ragged_paged_attention_tpu(
            q, k, v, *rest, sm_scale=SM_SCALE, interpret=True, layout="heads_tokens", **kw
        )
    fn = ragged_paged_attention_gpu if backend == "gpu" else ragged_paged_attention_tpu
    return fn(*b.args(layer), sm_scale=SM_SCALE, interpret=True, **kw)


def check_kernel(backend, b: Batch, *, dtype=jnp.float32, window=0, soft_cap=None, sinks=None, **kw):
    out = run_kernel(backend, b, sliding_window=window, soft_cap=soft_cap, sinks=sinks, **kw)
    expected = reference.ragged_paged_attention_ref(
        *b.args(1), sm_scale=SM_SCALE, sliding_window=window, soft_cap=soft_cap, sinks=sinks
    )
    assert out.dtype == b.q.dtype
    assert_close(out, expected, dtype)
    assert_padding_zero(out, b)


KERNEL_CASES = {
    # name: (make_batch kwargs, check kwargs)
    "mixed-gqa4-d64": (dict(hq=8, hk=2, d=64), {}),
    "mixed-mha-d128": (dict(hq=2, hk=2, d=128), {}),
    "mixed-gqa3": (dict(hq=6, hk=2, d=64), {}),
    "mixed-gqa8-d128": (dict(hq=8, hk=1, d=128), {}),
    "mixed-window7": (dict(hq=8, hk=2, d=64), dict(window=7)),
    "mixed-window20-softcap": (dict(hq=8, hk=2, d=64), dict(window=20, soft_cap=5.0)),
    "mixed-bf16-d128": (dict(hq=8, hk=2, d=128, dtype=jnp.bfloat16), dict(dtype=jnp.bfloat16)),
    "mixed-window7-sinks": (dict(hq=8, hk=2, d=64), dict(window=7, sinks=sinks_for(8))),
    "mixed-gqa3-softcap-sinks": (dict(hq=6, hk=2, d=64), dict(soft_cap=5.0, sinks=sinks_for(6))),
}


# The TPU kernel over the TPU's pool layout: the cases whose head handling differs (groups, one KV head, sinks).
HEADS_TOKENS_CASES = ("mixed-gqa3", "mixed-gqa8-d128", "mixed-bf16-d128", "mixed-window7-sinks")


@pytest.mark.parametrize(
    "backend, case",
    [(b, c) for b in ("gpu", "tpu") for c in KERNEL_CASES] + [("tpu-heads", c) for c in HEADS_TOKENS_CASES],
)
def test_kernel_matches_reference(backend, case):
    batch_kw, check_kw = KERNEL_CASES[case]
    check_kernel(backend, make_batch(MIXED_Q, MIXED_KV, **batch_kw), **check_kw)


@pytest.mark.parametrize("backend", ["gpu", "tpu", "tpu-heads"])
def test_kernel_decode_batch(backend):
    check_kernel(backend, make_batch(DECODE_Q, DECODE_KV, hq=8, hk=2, d=64, pad_seqs=3, pad_tokens=3))


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_gpu_kernel_context_splits(num_splits):
    """Flash-decoding: the context of each query block split over programs (uneven splits too)."""
    b = make_batch(MIXED_Q, MIXED_KV, hq=8, hk=2, d=64)
    check_kernel("gpu", b, window=20, num_splits=num_splits, block_kv=16)
    check_kernel("gpu", b, window=20, num_splits=num_splits, block_kv=16, sinks=sinks_for(8))  # merged after


@pytest.mark.slow
def test_tpu_kernel_small_blocks():
    """One-page DMA steps, 2-token query blocks that straddle sequences, one KV head per program."""
    b = make_batch(MIXED_Q, MIXED_KV, hq=8, hk=2, d=64)
    for backend in ("tpu", "tpu-heads"):
        check_kernel(backend, b, window=20, block_q=2, pages_per_block=1, kv_heads_per_block=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_in_layer_scan_with_traced_layer_and_window(backend):
    """As the model calls it: under jit, in lax.scan over layers, full cache, traced layer and window."""
    b = make_batch(MIXED_Q, MIXED_KV, hq=8, hk=2, d=64)
    windows = jnp.array([0, 7], jnp.int32)

    @jax.jit
    def all_layers(q, k_cache, v_cache, batch):
        def body(carry, xs):
            layer, window = xs
            out = kernels.ragged_paged_attention(
                q,
                k_cache,
                v_cache,
                layer,
                batch,
                sm_scale=SM_SCALE,
                sliding_window=window,
                impl="pallas",
                backend=backend,
            )
            return carry, out

        return lax.scan(body, 0, (jnp.arange(2, dtype=jnp.int32), windows))[1]

    outs = jax.block_until_ready(
        all_layers(b.q, b.k_cache, b.v_cache, b.meta)
    )  # see kernels._common.settle_tpu_interpret
    for layer in (0, 1):
        expected = reference.ragged_paged_attention_ref(
            *b.args(layer), sm_scale=SM_SCALE, sliding_window=int(windows[layer])
        )
        assert_close(outs[layer], expected)


# ------------------------------------------------------------------------------------------ KV write
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_kernel_matches_reference(backend, dtype):
    rng = np.random.default_rng(2)
    kc = rng.standard_normal((2, 6, PAGE, 2, 64)).astype(np.float32)
    kc[:, 5] = np.nan  # untouched NaN pages must stay exactly as they were
    vc = rng.standard_normal((2, 6, PAGE, 2, 64)).astype(np.float32)
    new_k = rng.standard_normal((13, 2, 64)).astype(np.float32)
    new_v = rng.standard_normal((13, 2, 64)).astype(np.float32)
    slots = rng.choice(5 * PAGE, 13, replace=False).astype(np.int32)
    slots[[0, 6, 12]] = [-1, -1, -7]  # padding tokens write nothing
    args = (
        jnp.asarray(kc, dtype),
        jnp.asarray(vc, dtype),
        jnp.int32(1),
        jnp.asarray(new_k, dtype),
        jnp.asarray(new_v, dtype),
        AttentionBatch(slot_mapping=slots),
    )
    exp_k, exp_v = write_kv_ref(*args)
    out_k, out_v = kernels.write_kv(*args, impl="pallas", backend=backend)
    assert out_k.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(exp_k, np.float32))
    np.testing.assert_array_equal(np.asarray(out_v, np.float32), np.asarray(exp_v, np.float32))


# ------------------------------------------------------------------------------------------ dispatch, validation
def test_dispatch_auto_on_cpu_is_the_xla_path():
    b = make_batch(DECODE_Q, DECODE_KV)
    out = kernels.ragged_paged_attention(*b.args(1), sm_scale=SM_SCALE)
    expected = reference.ragged_paged_attention_ref(*b.args(1), sm_scale=SM_SCALE)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)  # float32
    assert choose_kernel("auto", None, None) == ("xla", False)
    assert choose_kernel("pallas", None, None) == ("gpu", True)
    assert choose_kernel("pallas", "tpu", None) == ("tpu", True)
    assert choose_kernel("reference", "tpu", None) == ("reference", False)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_pallas_float32_queries_over_a_bfloat16_cache(backend):
    """float32 weights with a bfloat16 pool (kv_cache_dtype): the dispatch casts q for the kernels' products and
    gives float32 back (Triton refuses an f32 x bf16 product)."""
    b = make_batch(MIXED_Q, MIXED_KV, hq=8, hk=2, d=64)
    k, v = b.k_cache.astype(jnp.bfloat16), b.v_cache.astype(jnp.bfloat16)
    args = (b.q, k, v, *b.args(1)[3:])
    out = kernels.ragged_paged_attention(*args, sm_scale=SM_SCALE, impl="pallas", backend=backend)
    expected = reference.ragged_paged_attention_ref(b.q.astype(jnp.bfloat16), *args[1:], sm_scale=SM_SCALE)
    assert out.dtype == jnp.float32
    assert_close(out, expected, jnp.bfloat16)
    assert_padding_zero(out, b)


def test_dispatch_rejects_unknown_impl_and_backend():
    b = make_batch(DECODE_Q, DECODE_KV)
    with pytest.raises(ValueError, match="impl"):
        kernels.ragged_paged_attention(*b.args(0), sm_scale=SM_SCALE, impl="triton")
    with pytest.raises(ValueError, match="backend"):
        kernels.ragged_paged_attention(*b.args(0), sm_scale=SM_SCALE, impl="pallas", backend="cuda")


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_validation_errors_are_clear(impl):
    b = make_batch(DECODE_Q, DECODE_KV, hq=8, hk=2)
    call = functools.partial(kernels.ragged_paged_attention, sm_scale=SM_SCALE, impl=impl)
    q, kc, vc, layer, meta = b.args(0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(q[:, :7], kc, vc, layer, meta)
    with pytest.raises(ValueError, match="head_dim"):
        call(q[..., :32], kc, vc, layer, meta)
    with pytest.raises(ValueError, match="page table too short"):
        call(q, kc, vc, layer, dataclasses.replace(meta, page_indices=meta.page_indices[:, :2]))
    with pytest.raises(ValueError, match="kv_lens must have shape"):
        call(q, kc, vc, layer, dataclasses.replace(meta, kv_lens=meta.kv_lens[:-1]))
    with pytest.raises(ValueError, match="cu_q_lens must have shape"):
        call(q, kc, vc, layer, dataclasses.replace(meta, cu_q_lens=meta.cu_q_lens[:-1]))
    with pytest.raises(ValueError, match="k_cache and v_cache differ"):
        call(q, kc, vc[:1], layer, meta)


# ------------------------------------------------------------------------------------------ lowering
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernels_lower_for_their_platform(backend, monkeypatch):
    """Lowering (Pallas -> Triton IR / Mosaic MLIR) runs on the CPU too: catches ops the real backends lack.

    Compiling that IR (Triton -> PTX, Mosaic's layout passes) needs the device; bench/gpu_check.sh does that.
    """
    if backend == "tpu":
        tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
        if not hasattr(tpu_info, "registry"):
            pytest.skip("this jax has no TPU info registry to fake a TPU with")
        monkeypatch.setitem(
            tpu_info.registry,
            jax.devices()[0].device_kind,
            lambda: tpu_info._get_tpu_info_impl(tpu_info.ChipVersion.TPU_V5E, 1),
        )
    platform = {"gpu": "cuda", "tpu": "tpu"}[backend]
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    # fp8 pages on the GPU: Triton cannot cast a masked load's integer fill value to fp8 (found on an H200).
    cache_dtypes = [jnp.bfloat16] + ([jnp.float8_e4m3fn, jnp.float8_e5m2] if backend == "gpu" else [])
    cases = [(8, None, dt) for dt in cache_dtypes] + [(64, 30.0, jnp.bfloat16)]
    for num_tokens, soft_cap, cache_dtype in cases:  # decode-like and prefill-like block choices
        cache = jax.ShapeDtypeStruct((4, 256, PAGE, 8, 128), cache_dtype)
        q = jax.ShapeDtypeStruct((num_tokens, 32, 128), jnp.bfloat16)

        def step(q, kc, vc, layer, batch, window, new_kv, soft_cap=soft_cap):
            kc, vc = kernels.write_kv(
                kc, vc, layer, new_kv, new_kv, batch, impl="pallas", backend=backend, interpret=False
            )
            return kernels.ragged_paged_attention(
                q,
                kc,
                vc,
                layer,
                batch,
                sm_scale=SM_SCALE,
                sliding_window=window,
                soft_cap=soft_cap,
                impl="pallas",
                backend=backend,
                interpret=False,
            )

        lowered = (
            jax.jit(step)
            .trace(
                q,
                cache,
                cache,
                i32(()),
                kernels.AttentionBatch(
                    positions=i32((num_tokens,)),
                    slot_mapping=i32((num_tokens,)),
                    kv_lens=i32((8,)),
                    page_indices=i32((8, 32)),
                    cu_q_lens=i32((9,)),
                    num_seqs=i32(()),
                ),
                i32(()),
                jax.ShapeDtypeStruct((num_tokens, 8, 128), jnp.bfloat16),
            )
            .lower(lowering_platforms=(platform,))
        )
        assert lowered.as_text()
