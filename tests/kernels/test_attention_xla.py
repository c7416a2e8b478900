"""The XLA (jnp/lax) ragged paged attention against the jnp reference, on the CPU.

Inputs are random normal, never zeros, and poisoned so that reading anything the contract says is junk fails:
cache pages no sequence owns and slots past a sequence's kv_len are NaN, page-table entries past a sequence's
pages point out of range (-1 for padding sequences), and layer 1 is compared while layer 0 holds other data.
Tolerance: float32 atol = rtol = 1e-5. Small ``ctx_chunk`` / ``decode_chunk`` / ``block_q`` overrides make the
short test contexts take the multi-chunk online-softmax path and multi-block sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Batch, make_batch, sized_copies
from jaxserve.kernels import AttentionBatch, ragged_paged_attention_ref
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla
from jaxserve.kernels.dispatch import choose_kernel

from jaxserve import kernels

PAGE = 16
TOL = 1e-5
SM_SCALE = 0.125

# Every edge at once: full prefills of 15 / 16 / 17 tokens (page boundaries), an empty sequence (q_len 0), decode
# tokens at and past a page boundary and as a sequence's first token, a chunk starting mid-page (positions
# 20..24), one starting on a page boundary (32..47), one of 3 tokens (odd against small blocks).
MIXED_Q = [15, 16, 17, 0, 1, 1, 1, 5, 16, 3]
MIXED_KV = [15, 16, 17, 15, 16, 17, 1, 25, 48, 40]
PREFILL_WINDOW = ([70, 1, 20], [150, 90, 20], 37)  # q_lens, kv_lens, sliding window
DECODE_Q = [1] * 7
DECODE_KV = [1, 15, 16, 17, 33, 70, 129]
PREFILL_Q = [15, 16, 17, 70]
PREFILL_KV = [15, 16, 17, 86]  # the last one is a second chunk starting mid-page


# These tests' batches: 9 query and 3 KV heads, 3 unowned pages (kernels' tests: 8 / 2 / 4).
make_batch = functools.partial(make_batch, hq=9, hk=3, extra_pages=3, page=PAGE)


_reference = jax.jit(ragged_paged_attention_ref, static_argnames=("sm_scale", "soft_cap"))


def reference(b: Batch, layer=1, sliding_window=0, soft_cap=None, sinks=None):
    return _reference(*b.args(layer), sm_scale=SM_SCALE, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)


def check(out, b: Batch, expected, tol=TOL):
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    n = b.num_real_tokens
    assert n < out.shape[0], "test batches have padding tokens"
    np.testing.assert_array_equal(out[n:], 0.0)  # padding tokens: exact zeros
    assert np.isfinite(out).all(), f"{np.count_nonzero(~np.isfinite(out))} non-finite outputs"
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------ against the reference
SIZES = {  # block and chunk overrides: defaults (one context chunk here), then small ones (many chunks and blocks)
    "default": {},
    "chunked": dict(block_q=4, ctx_chunk=16, decode_chunk=32),
    "tiny": dict(block_q=2, ctx_chunk=8, decode_chunk=8),
}


@pytest.mark.parametrize(
    "name, q_lens, kv_lens, hint, sizes",
    [
        ("decode-hint1", DECODE_Q, DECODE_KV, 1, "default"),
        ("decode-nohint", DECODE_Q, DECODE_KV, None, "default"),
        ("decode-chunked", DECODE_Q, DECODE_KV, 1, "chunked"),
        ("prefill", PREFILL_Q, PREFILL_KV, 64, "default"),
        ("prefill-chunked", PREFILL_Q, PREFILL_KV, 64, "chunked"),
        ("mixed", MIXED_Q, MIXED_KV, 32, "default"),
        ("mixed-chunked", MIXED_Q, MIXED_KV, 32, "chunked"),
    ],
)
def test_matches_reference(name, q_lens, kv_lens, hint, sizes):
    b = make_batch(q_lens, kv_lens)
    out = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=hint, **SIZES[sizes])
    check(out, b, reference(b))


def test_tiny_blocks_and_chunks():
    """Blocks of 2 (a 3-token chunk needs 2 blocks, a 17-token one 9) and 8-token context chunks."""
    b = make_batch(MIXED_Q, MIXED_KV)
    check(ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, **SIZES["tiny"]), b, reference(b))


@pytest.mark.parametrize("hq, hk, d", [(4, 4, 64), (8, 2, 128), (16, 2, 64)], ids=["gqa1", "gqa4-d128", "gqa8"])
def test_head_layouts(hq, hk, d):
    """GQA 3 with head_dim 64 is every other test's layout. The mixed batch has decode tokens, short chunks and long
    ones: every loop runs."""
    b = make_batch(MIXED_Q, MIXED_KV, hq=hq, hk=hk, d=d, seed=1)
    out = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=32, decode_chunk=32)
    check(out, b, reference(b))


@pytest.mark.parametrize("sizes, soft_cap", [("default", None), ("chunked", 3.0), ("tiny", 5.0)])
def test_window_and_soft_cap_traced_under_jit(sizes, soft_cap):
    """Layer and sliding_window are traced (arguments of the jitted function); soft_cap is static."""
    b = make_batch(MIXED_Q, MIXED_KV, seed=2)
    fn = jax.jit(
        functools.partial(
            ragged_paged_attention_xla, sm_scale=SM_SCALE, soft_cap=soft_cap, max_q_len=32, **SIZES[sizes]
        )
    )
    for window in (0, 1, 7, 20):
        for layer in (0, 1):
            out = fn(b.q, b.k_cache, b.v_cache, jnp.int32(layer), b.meta, sliding_window=jnp.int32(window))
            check(out, b, reference(b, layer, sliding_window=jnp.int32(window), soft_cap=soft_cap))


def test_many_sequences_and_decode_window():
    """More sequence slots than tokens per sequence, long decode contexts, a window cutting whole chunks."""
    rng = np.random.default_rng(3)
    kv_lens = [int(x) for x in rng.integers(1, 300, 24)]
    b = make_batch([1] * 24, kv_lens, seed=3, pad_seqs=8)
    for window in (0, 40):  # traced: one compilation for both
        window = jnp.int32(window)
        out = ragged_paged_attention_xla(
            *b.args(), sm_scale=SM_SCALE, sliding_window=window, max_q_len=1, decode_chunk=32
        )
        check(out, b, reference(b, sliding_window=window))


def test_wrong_hint_only_costs_speed():
    """Hints that are too small (1, 2) or loose (128: a loop per class 2..16, 17..64, 65+) give the right answer."""
    b = make_batch(MIXED_Q, MIXED_KV, seed=4)
    check(ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=1), b, reference(b))
    check(ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=2), b, reference(b))
    b = make_batch(PREFILL_Q + [1, 3], PREFILL_KV + [30, 20], seed=4)
    check(ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=128), b, reference(b))


@pytest.mark.parametrize(
    "q_lens, kv_lens, hint",
    [(DECODE_Q, DECODE_KV, 1), (MIXED_Q, MIXED_KV, 32), (PREFILL_Q, PREFILL_KV, 64)],
    ids=["decode", "mixed", "prefill"],
)
def test_no_hint_equals_hint(q_lens, kv_lens, hint):
    b = make_batch(q_lens, kv_lens, seed=5)
    hinted = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=hint)
    plain = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(hinted), atol=1e-6, rtol=1e-6)


def test_empty_and_all_padding():
    b = make_batch([0, 1, 0], [5, 9, 0], seed=6)  # empty chunks around one decode token
    check(ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=1), b, reference(b))
    b = dataclasses.replace(b, num_seqs=jnp.int32(0))  # nothing real at all
    out = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_bfloat16_cache():
    b = make_batch(MIXED_Q, MIXED_KV, seed=7, dtype=jnp.bfloat16)
    out = ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=32)
    assert out.dtype == jnp.bfloat16
    check(out, b, reference(b), tol=1e-2)


def test_bad_arguments():
    b = make_batch(DECODE_Q, DECODE_KV)
    with pytest.raises(ValueError, match="max_q_len"):
        ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, max_q_len=-1)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, block_q=-4)
    with pytest.raises(ValueError, match="num_q_heads"):
        ragged_paged_attention_xla(b.q[:, :4], *b.args()[1:], sm_scale=SM_SCALE)


# ------------------------------------------------------------------------------------------ dispatch
def test_dispatch_auto_is_xla_on_cpu():
    assert choose_kernel("auto", None, None)[0] == "xla"
    assert choose_kernel("xla", None, None)[0] == "xla"
    assert choose_kernel("reference", None, None)[0] == "reference"
    b = make_batch(MIXED_Q, MIXED_KV, seed=8)
    expected = reference(b)
    fn = jax.jit(functools.partial(kernels.ragged_paged_attention, sm_scale=SM_SCALE, max_q_len=32))  # "auto"
    check(fn(*b.args()), b, expected)
    # write_kv under "auto" on the CPU still works (the C++ in-place write)
    slots = jnp.array([0, 17, -1], jnp.int32)
    new = jnp.ones((3, 3, 64), jnp.float32)
    kc, vc = kernels.write_kv(b.k_cache, b.v_cache, 1, new, new * 2, AttentionBatch(slot_mapping=slots))
    assert float(kc[1, 1, 1, 0, 0]) == 1.0 and float(vc[1, 0, 0, 2, 5]) == 2.0


# ------------------------------------------------------------------------------------------ C++ kernel vs XLA blocks
def test_cpp_kernel_builds_here():
    """The C++ paged attention must build on a machine like CI's (g++ and jaxlib's FFI headers); without it
    impl="auto" silently loses its fast path, so a build failure fails here with the compiler's message."""
    from jaxserve.kernels.cpu import ffi as cpu_ffi

    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()


def test_processes_that_start_together_build_the_library_once(tmp_path):
    """Three processes that find no library at once (``make``'s early build, test workers, a notebook's kernel):
    one runs the compiler, the others wait for its build and get the same file. A fake compiler (``$CXX``) records
    each run and takes a second, so that without the lock all three would run it."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(f'#!/bin/sh\necho run >> {runs}\nsleep 1\nfor a; do out=$a; done\necho lib > "$out"\n')
    cxx.chmod(0o755)
    code = "from jaxserve.kernels.cpu import ffi; print(ffi._build())"
    env = {**os.environ, "CXX": str(cxx), "JAXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in "abc"]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(paths) == 1 and Path(paths.pop()).read_text() == "lib\n"
    assert runs.read_text() == "run\n"  # the compiler ran once


@pytest.mark.parametrize("impl", ["xla", "ffi"])
@pytest.mark.parametrize(
    "case",
    [
        "decode",
        "mixed",
        "many-window-softcap",
        "gqa8-d128",
        "d40",
        "empty",
        "prefill",
        "prefill-window",
        "page8",
        "page24",
    ],
)
def test_cpu_impls_match_reference(impl, case):
    """Both CPU paths (the C++ kernel, the XLA blocks), on NaN-poisoned pools with out-of-range junk past every page
    table's used columns."""
    window, soft_cap = 0, None
    if case == "decode":
        b = make_batch(DECODE_Q, DECODE_KV, seed=11)
    elif case == "mixed":
        b = make_batch(MIXED_Q, MIXED_KV, seed=12)
    elif case == "many-window-softcap":
        rng = np.random.default_rng(13)
        b = make_batch([1] * 20 + [5], [int(x) for x in rng.integers(1, 200, 20)] + [30], seed=13, pad_seqs=5)
        window, soft_cap = jnp.int32(23), 4.0
    elif case == "gqa8-d128":
        b = make_batch(DECODE_Q + [3], DECODE_KV + [40], hq=16, hk=2, d=128, seed=14)
    elif case == "d40":  # head_dim not a multiple of 16: the C++ kernel's scalar tail
        b = make_batch(DECODE_Q, DECODE_KV, hq=6, hk=2, d=40, seed=16)
    elif case == "prefill":  # chunks longer than the C++ kernel's 16-token blocks, at the start and mid-context
        b = make_batch([40, 100, 1, 33], [40, 300, 50, 47], seed=17)
    elif case == "prefill-window":
        b = make_batch(*PREFILL_WINDOW[:2], seed=18)
        window, soft_cap = jnp.int32(PREFILL_WINDOW[2]), 5.0
    elif case == "page8":  # pages shorter than the C++ kernel's 16-key groups
        b = make_batch([1, 1, 19, 1], [3, 40, 50, 17], seed=19, page=8)
    elif case == "page24":  # a 16-key group and a partial one per page
        b = make_batch([1, 1, 30, 1], [24, 41, 77, 100], seed=20, page=24)
    else:
        b = make_batch([0, 1, 0], [5, 9, 0], seed=15)
    fn = jax.jit(
        functools.partial(ragged_paged_attention_xla, sm_scale=SM_SCALE, soft_cap=soft_cap, impl=impl, decode_chunk=32)
    )
    check(fn(*b.args(), sliding_window=window), b, reference(b, sliding_window=window, soft_cap=soft_cap))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("case", ["decode", "prefill-window", "gqa8-d128"])
def test_sinks_match_reference(impl, case):
    """Attention sinks (one logit per query head in the softmax's denominator) in both CPU paths: decode rows (the
    C++ kernel's per-row softmax), prefill chunks (its lane groups), a window and a soft cap, head_dim 128."""
    window, soft_cap = 0, None
    if case == "decode":
        b = make_batch(DECODE_Q, DECODE_KV, seed=31)
    elif case == "prefill-window":
        b = make_batch(*PREFILL_WINDOW[:2], seed=32)
        window, soft_cap = jnp.int32(PREFILL_WINDOW[2]), 5.0
    else:
        b = make_batch(DECODE_Q + [40], DECODE_KV + [90], hq=16, hk=2, d=128, seed=33)
    sinks = jnp.asarray(np.random.default_rng(34).normal(0.0, 2.0, b.q.shape[1]), jnp.float32)
    fn = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SM_SCALE, soft_cap=soft_cap, impl=impl))
    expected = reference(b, sliding_window=window, soft_cap=soft_cap, sinks=sinks)
    check(fn(*b.args(), sliding_window=window, sinks=sinks), b, expected)
    plain = reference(b, sliding_window=window, soft_cap=soft_cap)
    assert np.abs(np.asarray(expected) - np.asarray(plain)).max() > 0.1  # the sinks change the output


@pytest.mark.parametrize("case", ["decode", "mixed", "prefill-window"])
def test_ffi_reads_bf16_caches(case):
    """bfloat16 caches: the C++ kernel widens each element exactly, so it must match the reference run on the
    same values in float32 to float32 tolerance."""
    q_lens, kv_lens, window = {
        "decode": (DECODE_Q, DECODE_KV, 0),
        "mixed": (MIXED_Q, MIXED_KV, 0),
        "prefill-window": PREFILL_WINDOW,
    }[case]
    b = make_batch(q_lens, kv_lens, seed=21)
    b16 = dataclasses.replace(b, k_cache=b.k_cache.astype(jnp.bfloat16), v_cache=b.v_cache.astype(jnp.bfloat16))
    widened = dataclasses.replace(b, k_cache=b16.k_cache.astype(jnp.float32), v_cache=b16.v_cache.astype(jnp.float32))
    out = ragged_paged_attention_xla(*b16.args(), sm_scale=SM_SCALE, impl="ffi", sliding_window=window)
    assert out.dtype == jnp.float32  # q's dtype
    check(out, b, reference(widened, sliding_window=window))


def test_ffi_write_kv_matches_reference():
    """The in-place C++ write, inside a jit that donates the pool: same pool as the reference scatter (float32
    and bfloat16 bits), negative and out-of-pool slots write nothing."""
    from jaxserve.kernels import write_kv_ref
    from jaxserve.kernels.kv_write import cpu as kv_write_cpu

    rng = np.random.default_rng(22)
    shape = (3, 7, 16, 3, 64)
    slots = jnp.array([0, 17, -1, 7 * 16 - 1, 5000, 40], jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        kc = jnp.asarray(rng.standard_normal(shape), dtype)
        vc = jnp.asarray(rng.standard_normal(shape), dtype)
        new_k = jnp.asarray(rng.standard_normal((6, 3, 64)), dtype)
        new_v = jnp.asarray(rng.standard_normal((6, 3, 64)), dtype)
        exp_k, exp_v = write_kv_ref(kc, vc, 2, new_k, new_v, AttentionBatch(slot_mapping=slots))
        fn = jax.jit(kv_write_cpu.write_kv, donate_argnums=(0, 1))
        out_k, out_v = fn(kc, vc, jnp.int32(2), new_k, new_v, AttentionBatch(slot_mapping=slots))
        np.testing.assert_array_equal(np.asarray(out_k.astype(jnp.float32)), np.asarray(exp_k.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(out_v.astype(jnp.float32)), np.asarray(exp_v.astype(jnp.float32)))


def test_ffi_refuses_what_it_cannot_do():
    b = make_batch(DECODE_Q, DECODE_KV, dtype=jnp.float16)
    with pytest.raises(ValueError, match="float32, bfloat16 or fp8 caches"):
        ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, impl="ffi")
    with pytest.raises(ValueError, match="impl must"):
        ragged_paged_attention_xla(*b.args(), sm_scale=SM_SCALE, impl="cpp")
    b = make_batch(DECODE_Q, DECODE_KV)  # a page index outside the pool in a used column: an error, not a wild read
    table = b.page_indices.at[0, 0].set(10_000)
    with pytest.raises(Exception, match="page index out of range"):
        ragged_paged_attention_xla(
            *dataclasses.replace(b, page_indices=table).args(), sm_scale=SM_SCALE, impl="ffi"
        ).block_until_ready()


# ------------------------------------------------------------------------------------------ in a model's layer scan
def test_a_layer_scan_writing_and_reading_the_pool_never_copies_it():
    """The path without the C++ kernels, as a model's step runs it: a scan over layers that writes each layer's new
    K/V with the reference scatter, then reads the pool with the XLA attention. Its compiled program must update the
    donated pool in place and copy no pool-sized buffer: a reshaped view of the pool between the write and the
    attention's loops once made XLA:CPU duplicate the write and copy the whole pool 8 times a layer (a decode step at
    300 tokens on a 512-page pool took 8.6 s instead of 7 ms; on the default 5,120 pages 72-98 s)."""
    from jax import lax
    from jaxserve.kernels.kv_write.reference import write_kv_ref

    layers, pages, heads, group, dim, ctx = 3, 64, 3, 3, 64, 300
    table = jnp.arange(32, dtype=jnp.int32)[None]  # 512 tokens: 4 decode chunks, so the chunk loop is a loop
    batch = AttentionBatch(
        slot_mapping=jnp.array([ctx - 1], jnp.int32),
        kv_lens=jnp.array([ctx], jnp.int32),
        page_indices=table,
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        num_seqs=jnp.array(1, jnp.int32),
    )

    def step(k_cache, v_cache, x):
        def layer(carry, i):
            kc, vc, x = carry
            q = jnp.broadcast_to(x[:, None, :], (1, heads * group, dim))
            kc, vc = write_kv_ref(kc, vc, i, q[:, :heads] * 0.5, q[:, :heads] * 0.25, batch)
            o = ragged_paged_attention_xla(q, kc, vc, i, batch, sm_scale=SM_SCALE, max_q_len=1, impl="xla")
            return (kc, vc, x + o[:, 0]), None

        return lax.scan(layer, (k_cache, v_cache, x), jnp.arange(layers))[0]

    pool = jax.ShapeDtypeStruct((layers, pages, PAGE, heads, dim), jnp.float32)
    x = jax.ShapeDtypeStruct((1, dim), jnp.float32)
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(pool, pool, x).compile().as_text()
    copies = sized_copies(hlo, pool.shape)
    assert not copies, f"{len(copies)} pool-sized copies in the compiled step: {copies}"
