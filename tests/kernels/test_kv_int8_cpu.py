"""int8 KV pages (``Int8Pages``: int8 values, one float32 scale per token and KV head) on the CPU paths: the C++
kernel (``attention/cpu.py``), the jnp/lax blocks of ``ragged_paged_attention_xla`` and the C++ in-place write.

Truth: the jnp reference reading the same ``Int8Pages`` pool. Pools are built by writing random K/V with
``write_kv_ref`` (so values and scales are the reference's rounding), the rows scaled by random magnitudes so that
the scales differ from row to row by ~50x (a row read with another row's scale is far off). Everything the contract
calls junk is poisoned: slots never written keep NaN scales and random int8 values, pages no sequence owns are
never written, page-table entries past a sequence's pages point out of range, padding tokens and sequences are
there. Every path widens the stored rows exactly (int8 times its scale, in float32) and computes in float32, so
the tolerance is float32's relative to the output's magnitude, not int8's. What int8 costs against float32 K/V is
checked once, loosely (``test_int8_is_close_to_float32_attention``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Batch, make_batch
from jaxserve.kernels import AttentionBatch, ragged_paged_attention_ref, write_kv_ref
from jaxserve.kernels._common import Int8Pages, quantize_rows
from jaxserve.kernels.attention import cpu as attention_cpu
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla
from jaxserve.kernels.cpu import ffi as cpu_ffi
from jaxserve.kernels.kv_write import cpu as kv_write_cpu

SM_SCALE = 0.125
TOL = 1e-5  # relative to the largest |output|: float32 products over the same dequantized rows


def int8_pool(cache, rng) -> Int8Pages:
    """The finite rows of a float32 pool [L, P, S, K, H] (make_batch's NaN rows are junk), written with
    ``write_kv_ref`` into an ``Int8Pages`` pool whose unwritten slots hold NaN scales and random int8 values; each
    written (slot, KV head) row is first scaled by its own random magnitude."""
    cache = np.asarray(cache, np.float32)
    layers, pages, page, heads, dim = cache.shape
    pool = Int8Pages(
        jnp.asarray(rng.integers(-128, 128, cache.shape), jnp.int8), jnp.full(cache.shape[:4], np.nan, jnp.float32)
    )
    for layer in range(layers):
        rows = cache[layer].reshape(pages * page, heads, dim)
        written = np.isfinite(rows).all(axis=(1, 2))
        rows = np.where(written[:, None, None], rows, 0.0) * np.exp(rng.uniform(-2, 2, (pages * page, heads, 1)))
        slots = np.where(written, np.arange(pages * page), -1).astype(np.int32)
        pool, _ = write_kv_ref(
            pool,
            pool,
            layer,
            jnp.asarray(rows, jnp.float32),
            jnp.asarray(rows, jnp.float32),
            AttentionBatch(slot_mapping=slots),
        )
    return pool


def int8_batch(q_lens, kv_lens, *, seed, **kw) -> Batch:
    """make_batch's ragged batch (float32 q) over ``Int8Pages`` K and V pools built from its caches."""
    b = make_batch(list(q_lens), list(kv_lens), seed=seed, **kw)
    rng = np.random.default_rng(seed + 1000)
    return dataclasses.replace(b, k_cache=int8_pool(b.k_cache, rng), v_cache=int8_pool(b.v_cache, rng))


_reference = jax.jit(ragged_paged_attention_ref, static_argnames=("sm_scale", "soft_cap"))


def check(out, b: Batch, expected):
    out, expected = np.asarray(out), np.asarray(expected)
    assert out.dtype == np.float32 and out.shape == expected.shape
    n = b.num_real_tokens
    assert n < out.shape[0], "test batches have padding tokens"
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: exact zeros
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    scale = float(np.abs(expected).max())
    assert scale > 0.1, "a degenerate test batch"
    np.testing.assert_allclose(out, expected, atol=TOL * scale, rtol=TOL)


# name: (q_lens, kv_lens, make_batch options, sliding window, soft cap). Prefill chunks of 2..100 tokens (the C++
# kernel's 16-token items, lanes-of-rows and per-row paths), decode tokens at and past page boundaries, an empty
# sequence, GQA groups of 1, 2, 3, 4 and 8, head_dim 64 and 128 (C++: compiled for them), 80 (any head_dim, five
# 16-wide slices) and 40 (a scalar tail), more than 8 sequences (the reference's per-token path), pages of 8 and 24.
CASES = {
    "mixed-d64": ([15, 16, 17, 0, 1, 1, 1, 5, 3], [15, 16, 17, 15, 16, 17, 1, 25, 40], dict(hq=8, hk=2, d=64), 0, None),
    "gqa8-d128": ([1, 1, 20, 1, 3], [1, 17, 60, 129, 40], dict(hq=16, hk=2, d=128), 0, None),
    "d80": ([1, 1, 19, 1, 4], [9, 33, 50, 70, 4], dict(hq=6, hk=2, d=80), 0, None),
    "d40-softcap": ([1, 2, 1, 18], [16, 31, 5, 18], dict(hq=4, hk=1, d=40), 0, 4.0),
    "prefill-window-softcap": ([70, 1, 20, 100], [150, 90, 20, 300], dict(hq=8, hk=2, d=64), 37, 5.0),
    "many-decodes-window": (
        [1] * 12 + [5],
        [3, 9, 16, 17, 31, 33, 47, 64, 65, 80, 100, 128, 30],
        dict(hq=8, hk=4, d=64, pad_seqs=3),
        23,
        None,
    ),
    "page8": ([1, 1, 19, 1], [3, 40, 50, 17], dict(hq=8, hk=2, d=64, page=8), 0, None),
    "page24-d128": ([1, 1, 30, 1], [24, 41, 77, 100], dict(hq=8, hk=2, d=128, page=24), 11, 3.0),
}

# The jnp blocks with small blocks and chunks, so short contexts take the multi-chunk and multi-block paths.
IMPLS = {
    "ffi": dict(impl="ffi"),
    "xla": dict(impl="xla", decode_chunk=32, ctx_chunk=48, block_q=8),
}


def test_cpp_kernel_is_on_this_machine():
    """The C++ path is what the CPU runs for int8 pools: if it cannot be built here, fail (CI has g++)."""
    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()
    assert attention_cpu.serves(jnp.int8) and attention_cpu.serves(jnp.dtype(jnp.int8))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_paths_read_int8_pages_as_the_reference(case, impl):
    q_lens, kv_lens, shape, window, soft_cap = CASES[case]
    b = int8_batch(q_lens, kv_lens, seed=sorted(CASES).index(case), **shape)
    expected = _reference(*b.args(1), sm_scale=SM_SCALE, sliding_window=window, soft_cap=soft_cap)
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SM_SCALE, soft_cap=soft_cap, **IMPLS[impl]))
    check(fn(*b.args(1), sliding_window=jnp.int32(window)), b, expected)


def test_auto_sends_int8_pages_to_the_cpp_kernel():
    """impl="auto" on the CPU hands Int8Pages to the C++ kernel (deterministic: the same bits as impl="ffi")."""
    b = int8_batch([5, 1, 17, 1], [40, 9, 17, 33], seed=4, hq=8, hk=2, d=64)
    kw = dict(sm_scale=SM_SCALE, sliding_window=9)
    ffi = np.asarray(ragged_paged_attention_xla(*b.args(1), **kw, impl="ffi"))
    np.testing.assert_array_equal(np.asarray(ragged_paged_attention_xla(*b.args(1), **kw, impl="auto")), ffi)
    check(ffi, b, _reference(*b.args(1), **kw, soft_cap=None))


def test_cpp_reads_each_row_with_its_scale():
    """One sequence, one query token, scores all zero (q = 0): the output is the mean of the V rows, each row its
    int8 values times its own scale. Every value and scale differs, so a row read with another's scale shows."""
    rng = np.random.default_rng(5)
    shape = (2, 3, 16, 2, 48)
    values = rng.integers(-127, 128, shape).astype(np.int8)
    scales = rng.uniform(0.01, 2.0, shape[:4]).astype(np.float32)
    v = Int8Pages(jnp.asarray(values), jnp.asarray(scales))
    k = Int8Pages(jnp.asarray(values), jnp.asarray(scales))
    kv_len = 40  # pages 2, 0, then 8 slots of page 1
    table = jnp.array([[2, 0, 1]], jnp.int32)
    out = attention_cpu.paged_attention(
        jnp.zeros((1, 4, 48), jnp.float32),
        k,
        v,
        1,
        AttentionBatch(
            kv_lens=jnp.array([kv_len], jnp.int32),
            page_indices=table,
            cu_q_lens=jnp.array([0, 1], jnp.int32),
            num_seqs=1,
        ),
        sm_scale=1.0,
        soft_cap=None,
    )
    rows = (values[1].astype(np.float32) * scales[1][..., None])[[2, 0, 1]].reshape(48, 2, 48)[:kv_len]
    want = np.repeat(rows.mean(axis=0), 2, axis=0)  # query heads 0, 1 read KV head 0; 2, 3 read KV head 1
    np.testing.assert_allclose(np.asarray(out)[0], want, rtol=1e-5, atol=1e-6)


def test_int8_is_close_to_float32_attention():
    """Against float32 attention over the unquantized K/V: per-row int8 rounding moves the output by < 2%."""
    b = make_batch([15, 16, 17, 0, 1, 1, 1, 5, 3], [15, 16, 17, 15, 16, 17, 1, 25, 40], hq=8, hk=2, d=64, seed=7)
    k8, v8 = (Int8Pages(*quantize_rows(c)) for c in (b.k_cache, b.v_cache))  # NaN junk rows stay junk
    want = np.asarray(_reference(*b.args(1), sm_scale=SM_SCALE, sliding_window=0, soft_cap=None))
    n = b.num_real_tokens
    for impl in IMPLS:
        out = np.asarray(ragged_paged_attention_xla(b.q, k8, v8, 1, b.meta, sm_scale=SM_SCALE, **IMPLS[impl]))
        err = np.linalg.norm(out[:n] - want[:n]) / np.linalg.norm(want[:n])
        assert 0 < err < 0.02, (impl, err)  # not zero: the int8 pool really was read


def _write_case(seed):
    rng = np.random.default_rng(seed)
    shape = (3, 7, 16, 3, 64)
    pools = [
        Int8Pages(
            jnp.asarray(rng.integers(-128, 128, shape), jnp.int8),
            jnp.asarray(rng.uniform(0.1, 1.0, shape[:4]), jnp.float32),
        )
        for _ in range(2)
    ]
    new = rng.standard_normal((2, 7, 3, 64)) * np.exp(rng.uniform(-3, 3, (2, 7, 3, 1)))
    new[0, 1, 2] = 0.0  # an all-zero row: scale 1
    new[1, 3, 0, 5] = 1e4  # one element dominates the row
    slots = jnp.array([0, 17, -1, 7 * 16 - 1, 5000, 40, -7], jnp.int32)  # padding (< 0) and past the pool: nothing
    return pools, jnp.asarray(new[0], jnp.float32), jnp.asarray(new[1], jnp.float32), AttentionBatch(slot_mapping=slots)


def _assert_same_pool(got, want):
    assert isinstance(got, Int8Pages)
    assert got.values.dtype == jnp.int8 and got.scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want.values))
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32), np.asarray(want.scales).view(np.uint32))


def test_cpp_write_kv_int8_is_bit_identical_to_the_reference():
    (kc, vc), new_k, new_v, slots = _write_case(22)
    want_k, want_v = write_kv_ref(kc, vc, 2, new_k, new_v, slots)
    got_k, got_v = kv_write_cpu.write_kv(kc, vc, 2, new_k, new_v, slots)
    _assert_same_pool(got_k, want_k)
    _assert_same_pool(got_v, want_v)
    # the write did something, and only at the written slots of layer 2
    changed = np.asarray(want_k.scales != kc.scales).any(axis=-1)
    assert changed.sum() == 4 and changed[2].reshape(-1)[[0, 17, 111, 40]].all()
    assert float(want_k.scales[2, 1, 1, 2]) == 1.0  # token 1, slot 17, KV head 2: the zero row


def test_cpp_write_kv_int8_in_place_under_jit_with_donation():
    """Inside a jit that donates the pools, over several steps: the same bits as the reference; the donated
    buffers are consumed (in place), not copied."""
    (kc, vc), new_k, new_v, slots = _write_case(23)
    want_k, want_v = kc, vc
    fn = jax.jit(kv_write_cpu.write_kv, donate_argnums=(0, 1))
    hlo = fn.lower(kc, vc, jnp.int32(0), new_k, new_v, slots).compile().as_text()
    assert " copy(" not in hlo, "the donated pool (or its scales) is copied"
    for step, layer in enumerate((0, 2, 2)):
        nk, nv = new_k * (step + 1), new_v - step
        want_k, want_v = write_kv_ref(want_k, want_v, layer, nk, nv, slots)
        kc, vc = fn(kc, vc, jnp.int32(layer), nk, nv, slots)
    _assert_same_pool(kc, want_k)
    _assert_same_pool(vc, want_v)


def test_int8_pools_refused_without_scales():
    b = int8_batch([1, 3], [9, 20], seed=3, hq=8, hk=2, d=64)
    plain = b.k_cache.values
    args = (b.q, plain, plain, 1, b.meta)
    with pytest.raises(ValueError, match="scales"):
        attention_cpu.paged_attention(*args, sm_scale=SM_SCALE, soft_cap=None)
    with pytest.raises(ValueError, match="Int8Pages"):
        attention_cpu.paged_attention(b.q, b.k_cache, plain, 1, b.meta, sm_scale=SM_SCALE, soft_cap=None)
    for impl in ("ffi", "xla", "auto"):
        with pytest.raises(ValueError, match="Int8Pages"):
            ragged_paged_attention_xla(*args, sm_scale=SM_SCALE, impl=impl)
    new = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="scales"):
        kv_write_cpu.write_kv(plain, plain, 0, new, new, AttentionBatch(slot_mapping=jnp.array([0, 1], jnp.int32)))
