"""fp8 KV pages (``kv_cache_dtype="fp8_e4m3" | "fp8_e5m2"``, stored without scales) in every attention path.

Truth: the jnp reference reading the same fp8 pool (it widens with XLA's own conversion), and ml_dtypes' decoding of
every fp8 byte for the C++ kernel's table. The paths widen the stored values exactly and compute in float32, so the
tolerance is float32's, not fp8's. What fp8 costs in accuracy is measured end to end against HF in
``bench/quant_quality.py`` (bench/RESULTS.md), not here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import make_batch
from jaxserve.kernels import AttentionBatch
from jaxserve.kernels.attention import cpu as attention_cpu
from jaxserve.kernels.attention import reference
from jaxserve.kernels.attention.gpu import ragged_paged_attention_gpu
from jaxserve.kernels.attention.tpu import ragged_paged_attention_tpu
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla
from jaxserve.kernels.cpu import ffi as cpu_ffi

from jaxserve import kernels

FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
SM_SCALE = 0.125
TOL = 2e-5  # float32 products over exactly widened fp8 values


def fp8_batch(dtype, q_lens=(5, 1, 17, 1), kv_lens=(40, 9, 17, 33)):
    b = make_batch(list(q_lens), list(kv_lens), hq=8, hk=2, d=64)
    return dataclasses.replace(b, k_cache=b.k_cache.astype(dtype), v_cache=b.v_cache.astype(dtype))


def paths():
    out = {
        "xla blocks": lambda *a, **k: ragged_paged_attention_xla(*a, **k, impl="xla"),
        "pallas gpu (interpret)": lambda *a, **k: ragged_paged_attention_gpu(*a, **k, interpret=True),
        "pallas tpu (interpret)": lambda *a, **k: ragged_paged_attention_tpu(*a, **k, interpret=True),
    }
    if cpu_ffi.available():
        out["c++"] = lambda *a, **k: ragged_paged_attention_xla(*a, **k, impl="ffi")
    return out


@pytest.mark.parametrize("path", list(paths()))
@pytest.mark.parametrize("kv", list(FP8))
def test_every_path_reads_fp8_pages_as_the_reference(kv, path):
    b = fp8_batch(FP8[kv])
    kw = dict(sm_scale=SM_SCALE, sliding_window=9, soft_cap=None)
    expected = reference.ragged_paged_attention_ref(*b.args(1), **kw)
    out = paths()[path](*b.args(1), **kw)
    assert out.dtype == jnp.float32
    out, expected = np.asarray(out), np.asarray(expected)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=TOL, rtol=TOL)


def test_cpp_kernel_is_on_this_machine():
    """The C++ path is the CPU default: its absence would hide it from the test above, so it must be built here."""
    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()


@pytest.mark.parametrize("kv", list(FP8))
def test_cpp_decodes_every_fp8_byte_as_ml_dtypes(kv):
    """One sequence of one token: attention returns its V row exactly. V holds all 256 byte values."""
    dtype = FP8[kv]
    codes = np.arange(256, dtype=np.uint8).view(dtype)
    v = np.zeros((1, 1, 16, 1, 256), dtype)
    v[0, 0, 0, 0] = codes
    k = np.zeros_like(v)
    q = jnp.zeros((1, 1, 256), jnp.float32)
    out = attention_cpu.paged_attention(
        q,
        jnp.asarray(k),
        jnp.asarray(v),
        0,
        AttentionBatch(
            kv_lens=jnp.array([1], jnp.int32),
            page_indices=jnp.zeros((1, 1), jnp.int32),
            cu_q_lens=jnp.array([0, 1], jnp.int32),
            num_seqs=1,
        ),
        sm_scale=1.0,
        soft_cap=None,
    )
    np.testing.assert_array_equal(np.asarray(out)[0, 0], codes.astype(np.float32))  # NaN == NaN here


@pytest.mark.parametrize("impl,backend", [("reference", None), ("xla", None), ("pallas", "gpu"), ("pallas", "tpu")])
@pytest.mark.parametrize("kv", list(FP8))
def test_writes_round_like_xla(kv, impl, backend):
    """New K/V rows land in the fp8 pool as XLA's float32 -> fp8 conversion gives them (ml_dtypes: the same)."""
    dtype = FP8[kv]
    rng = np.random.default_rng(3)
    shape = (2, 5, 16, 2, 64)
    kc = jnp.zeros(shape, dtype)
    vc = jnp.zeros(shape, dtype)
    new = (rng.standard_normal((2, 7, 2, 64)) * 3).astype(np.float32)
    slots = np.array([3, 17, -1, 40, 41, 79, 0], np.int32)
    out_k, out_v = kernels.write_kv(
        kc,
        vc,
        1,
        jnp.asarray(new[0]),
        jnp.asarray(new[1]),
        AttentionBatch(slot_mapping=slots),
        impl=impl,
        backend=backend,
    )
    assert out_k.dtype == dtype
    want = np.zeros(shape, dtype)
    for t, s in enumerate(slots):
        if s >= 0:
            want[1, s // 16, s % 16] = new[0, t].astype(ml_dtypes.finfo(dtype).dtype)
    np.testing.assert_array_equal(np.asarray(out_k).view(np.uint8), want.view(np.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("kv", list(FP8))
def test_engine_serves_an_fp8_pool_in_a_quarter_of_the_bytes(default_loaded, kv):
    """The default model with fp8 pages: a quarter of float32's bytes per page, and next-token agreement with the
    float32 pool under teacher forcing (the fp8 run's own tokens fed to both)."""
    from jaxserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    runs = {}
    for name in ("float32", kv):
        llm = LLM(default_loaded, kv_cache_dtype=name, max_num_seqs=4, num_pages=64, max_model_len=256)
        runs[name] = llm
        assert llm.engine.runner.k_cache.dtype == jnp.dtype(FP8.get(name, name))
    page = {n: r.engine.runner.pool.page_bytes() for n, r in runs.items()}
    assert page[kv] * 4 == page["float32"]
    outs = runs[kv].generate(prompts, sp, use_tqdm=False)
    agree = total = 0
    for o in outs:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        ref = runs["float32"].generate(
            [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
        )[0]
        # prompt_logprobs[i]: the float32 pool's top token at position i (given ids[:i]) and the actual one.
        n0 = len(o.prompt_token_ids)
        for i, tok in enumerate(o.outputs[0].token_ids[1:], start=n0 + 1):
            best = max(ref.prompt_logprobs[i].items(), key=lambda kv_: kv_[1].logprob)[0]
            agree += best == tok
            total += 1
    assert agree / total >= 0.85, f"{agree}/{total}"
