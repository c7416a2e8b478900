"""int8 KV pages with a scale per token and KV head (``kv_cache_dtype="int8"``, ``kernels.Int8Pages``): the Pallas
kernels (GPU and TPU, in interpret mode here; the TPU ones also compiled for real chips), the writes, and the engine.

Truth: the jnp reference reading and writing the same ``Int8Pages`` (``reference.py``): every path dequantizes the
same stored values and computes in float32, so the tolerance is float32's. The rounding itself is checked against
numpy, and what int8 pages cost end to end is measured against the float32 pool (agreement here; perplexity in
``bench/quantization.py``, bench/RESULTS.md). The CPU paths (C++ and XLA blocks) are in test_kv_int8_cpu.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_batch
from jaxserve.kernels import AttentionBatch, Int8Pages, write_kv_ref
from jaxserve.kernels._common import quantize_rows
from jaxserve.kernels.attention import reference
from jaxserve.kernels.attention.gpu import ragged_paged_attention_gpu
from jaxserve.kernels.attention.tpu import ragged_paged_attention_tpu

from jaxserve import LLM, SamplingParams, kernels

SM_SCALE = 0.125
TOL = 2e-5  # float32 products over the same dequantized values


def int8_batch(q_lens=(5, 1, 17, 1), kv_lens=(40, 9, 17, 33), hq=8, hk=2, d=64, dtype=jnp.float32):
    """make_batch's poisoned pool quantized: NaN rows (junk the kernels must not read) become int8 rows with a NaN
    scale, so reading one still poisons the output."""
    b = make_batch(list(q_lens), list(kv_lens), hq=hq, hk=hk, d=d, dtype=dtype)

    def quantize(cache):
        x = np.asarray(cache, np.float32)
        bad = np.isnan(x).any(-1)
        values, scales = quantize_rows(jnp.asarray(np.nan_to_num(x)))
        return Int8Pages(values, jnp.where(bad, jnp.nan, scales))

    return dataclasses.replace(b, k_cache=quantize(b.k_cache), v_cache=quantize(b.v_cache))


PATHS = {
    "pallas gpu (interpret)": lambda *a, **k: ragged_paged_attention_gpu(*a, **k, interpret=True),
    "pallas tpu (interpret)": lambda *a, **k: ragged_paged_attention_tpu(*a, **k, interpret=True),
}


def test_quantize_rows_is_symmetric_rounding_to_127_steps():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 3, 64)) * rng.uniform(0.01, 50, (6, 3, 1))).astype(np.float32)
    x[2, 1] = 0.0
    values, scales = map(np.asarray, quantize_rows(jnp.asarray(x)))
    amax = np.abs(x).max(-1)
    want_scale = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    np.testing.assert_allclose(scales, want_scale, rtol=1e-7)
    np.testing.assert_array_equal(values, np.clip(np.round(x / want_scale[..., None]), -127, 127).astype(np.int8))
    assert np.abs(values).max() == 127 and (values[2, 1] == 0).all()
    # dequantized within half a step of the input
    assert (np.abs(values * scales[..., None] - x) <= scales[..., None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("window,cap", [(0, None), (9, None), (0, 30.0)])
def test_pallas_kernels_read_int8_pages_as_the_reference(path, window, cap):
    b = int8_batch()
    kw = dict(sm_scale=SM_SCALE, sliding_window=window, soft_cap=cap)
    expected = np.asarray(reference.ragged_paged_attention_ref(*b.args(1), **kw))
    out = np.asarray(PATHS[path](*b.args(1), **kw))
    assert np.isfinite(expected).all() and np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("path", list(PATHS))
def test_pallas_kernels_with_bf16_queries_over_int8_pages(path):
    """bfloat16 queries: the dequantized rows are cast to bfloat16 before the products (as the fp8 path)."""
    b = int8_batch(hq=4, hk=1, d=128, dtype=jnp.bfloat16)
    kw = dict(sm_scale=SM_SCALE)
    expected = np.asarray(reference.ragged_paged_attention_ref(*b.args(0), **kw), np.float32)
    out = PATHS[path](*b.args(0), **kw)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=3e-2, rtol=3e-2)


def test_int8_pages_stay_close_to_float32_attention():
    """The cost of quantizing: attention over int8 pages vs over the float32 rows they came from."""
    b = make_batch([5, 1, 17, 1], [40, 9, 17, 33], hq=8, hk=2, d=64)
    q = int8_batch()
    kw = dict(sm_scale=SM_SCALE)
    exact = np.asarray(reference.ragged_paged_attention_ref(*b.args(1), **kw))
    approx = np.asarray(reference.ragged_paged_attention_ref(*q.args(1), **kw))
    err = np.abs(approx - exact).max() / np.abs(exact).max()
    assert 0 < err < 0.02, err


@pytest.mark.parametrize("impl,backend", [("pallas", "gpu"), ("pallas", "tpu")])
def test_pallas_writes_equal_the_reference(impl, backend):
    """New rows quantized and written exactly as the reference does: values and scales bit for bit; padding slots
    (-1) write nothing."""
    rng = np.random.default_rng(3)
    shape = (2, 5, 16, 2, 64)
    pools = [
        Int8Pages(
            jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
            jnp.asarray(rng.uniform(0.1, 1, shape[:4]), jnp.float32),
        )
        for _ in range(2)
    ]
    new = (rng.standard_normal((2, 7, 2, 64)) * 3).astype(np.float32)
    slots = jnp.asarray(np.array([3, 17, -1, 40, 41, 79, 0], np.int32))
    args = (1, jnp.asarray(new[0]), jnp.asarray(new[1]), AttentionBatch(slot_mapping=slots))
    want = write_kv_ref(*pools, *args)
    got = kernels.write_kv(*pools, *args, impl=impl, backend=backend)
    for g, w, before in zip(got, want, pools, strict=True):
        assert isinstance(g, Int8Pages)
        np.testing.assert_array_equal(np.asarray(g.values), np.asarray(w.values))
        np.testing.assert_array_equal(np.asarray(g.scales), np.asarray(w.scales))
        assert not np.array_equal(np.asarray(g.values), np.asarray(before.values))  # something was written


def test_plain_int8_pool_without_scales_is_refused():
    b = make_batch([3], [10])
    values = jnp.zeros(b.k_cache.shape, jnp.int8)
    with pytest.raises(ValueError, match="needs its scales"):
        kernels.ragged_paged_attention(
            b.q,
            values,
            values,
            0,
            b.meta,
            sm_scale=SM_SCALE,
            impl="reference",
        )
    pool = Int8Pages(values, jnp.zeros(b.k_cache.shape[:4], jnp.float32))
    with pytest.raises(ValueError, match="both be Int8Pages"):
        kernels.ragged_paged_attention(
            b.q,
            pool,
            values,
            0,
            b.meta,
            sm_scale=SM_SCALE,
            impl="reference",
        )


# ---------------------------------------------------------------------------------------------- the engine
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
ENGINE = dict(max_num_seqs=4, num_pages=64, max_model_len=256)


def _tokens(llm, prompts=PROMPTS, **params):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True} | params)
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def int8_llm(default_loaded):
    return LLM(default_loaded, kv_cache_dtype="int8", **ENGINE)


@pytest.mark.slow
def test_engine_int8_pool_bytes_and_agreement_with_float32(default_loaded, int8_llm):
    """The default model over int8 pages: (64 + 4) bytes per row against float32's 256, the pool an Int8Pages, and
    the float32 pool's next token agreeing with the int8 run's own under teacher forcing (>= 90%)."""
    runner = int8_llm.engine.runner
    assert isinstance(runner.k_cache, Int8Pages) and runner.k_cache.values.dtype == jnp.int8
    assert runner.k_cache.scales.shape == runner.k_cache.shape[:4]
    ref = LLM(default_loaded, kv_cache_dtype="float32", **ENGINE)
    assert runner.pool.page_bytes() * 256 == ref.engine.runner.pool.page_bytes() * 68
    live = sum(x.nbytes for x in jax.tree.leaves((runner.k_cache, runner.v_cache)))
    assert live == runner.pool.page_bytes() * runner.num_pages  # the live arrays are what the sizing counts
    outs = int8_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    agree = total = 0
    for o in outs:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        lp = ref.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[
            0
        ].prompt_logprobs
        for i, tok in enumerate(o.outputs[0].token_ids[1:], start=len(o.prompt_token_ids) + 1):
            agree += max(lp[i].items(), key=lambda kv: kv[1].logprob)[0] == tok
            total += 1
    assert agree / total >= 0.9, f"{agree}/{total}"


@pytest.mark.slow
def test_engine_int8_copy_on_write_carries_the_scales(int8_llm):
    """n=2 greedy forks share the prompt's last page and copy it on the first decode step: a copy that dropped the
    scales would leave the second sample reading zeros. Both samples equal n=1's tokens."""
    one = _tokens(int8_llm)
    two = _tokens(int8_llm, n=2)
    assert all(len(o) == 2 and o[0] == o[1] == w[0] for o, w in zip(two, one, strict=True))


@pytest.mark.slow
@pytest.mark.multidevice
def test_engine_int8_pool_under_tensor_parallelism(default_loaded, int8_llm):
    """Three devices, one KV head each: values and scales split over the heads, the same greedy tokens."""
    from jaxserve.runner.kv_pool import KV_POOL_SPEC, KV_SCALES_SPEC

    llm = LLM(default_loaded, kv_cache_dtype="int8", tensor_parallel_size=3, **ENGINE)
    cache = llm.engine.runner.k_cache
    assert cache.values.sharding.spec == KV_POOL_SPEC and cache.scales.sharding.spec == KV_SCALES_SPEC
    assert {s.data.shape[3] for s in cache.scales.addressable_shards} == {1}
    assert _tokens(llm) == _tokens(int8_llm)


@pytest.mark.slow
def test_engine_int8_pool_with_the_pallas_kernels(default_loaded, int8_llm):
    """The Pallas kernels (interpret mode on the CPU) over int8 pages give the CPU path's greedy tokens."""
    llm = LLM(
        default_loaded,
        kv_cache_dtype="int8",
        attention_impl="pallas",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        num_pages=24,
    )
    assert _tokens(llm, PROMPTS[:3], max_tokens=6) == _tokens(int8_llm, PROMPTS[:3], max_tokens=6)
