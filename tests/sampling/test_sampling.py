"""Tests of jaxserve.sampling.sampler: parameter validation, filters against numpy, statistics, seeds, compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxserve.sampling import sampler as sampling
from jaxserve.sampling.sampler import SamplingMetadata, SamplingParams, compute_logprobs, process_logits, sample

# A small known distribution with no ties and no token near a top-p / min-p boundary.
PROBS = np.array([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])
LOGITS = np.log(PROBS).astype(np.float32)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def meta_for(params, *args, **kw):
    return SamplingMetadata.from_params(params, *args, **kw)


def kept_set(logits, params):
    """Token ids with nonzero probability after filtering (one row, batched with greedy padding rows)."""
    batch = jnp.asarray(np.tile(logits, (4, 1)))
    out = np.asarray(process_logits(batch, meta_for([params], pad_to=4)))[0]
    return set(np.flatnonzero(np.isfinite(out)).tolist())


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {5: 150.0}}, "logit_bias"),
        ({"logit_bias": {5: -100.5}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
        ({"seed": "42"}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        # Everything the device sees is an int32; seeds are 64-bit signed ints (as in vLLM).
        ({"top_k": 2**40}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**40}, "min_tokens"),
        ({"n": 2**31}, "n"),
        ({"logit_bias": {2**40: 1.0}}, "logit_bias"),
        ({"logit_bias": {str(2**31): 1.0}}, "logit_bias"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        # The sampler's bias arrays have a fixed width.
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_int_limits_are_inclusive():
    top = 2**31 - 1
    p = SamplingParams(top_k=top, max_tokens=top, logit_bias={top: 1.0}, stop_token_ids=[top], seed=2**63 - 1)
    assert (p.top_k, p.logit_bias, p.stop_token_ids) == (top, {top: 1.0}, [top])
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(1024)}).logit_bias) == sampling.MAX_LOGIT_BIAS
    # A huge value is cut short in the message.
    with pytest.raises(ValueError, match=r"logit_bias may hold at most 1024 entries \(got 5000\), got .{200}\.\.\.$"):
        SamplingParams(logit_bias={i: 1.0 for i in range(5000)})


def test_params_normalization_and_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.seed, p.logprobs) == ([], [], None, None, None)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logit_bias={"50256": -100, 7: 1}).logit_bias == {50256: -100.0, 7: 1.0}
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_k=-1, max_tokens=None, logprobs=0, temperature=np.float32(0.5)).top_k == -1
    # replace re-validates.
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


# ---------------------------------------------------------------- metadata builder


def test_from_params_pads_rows_and_buckets_history():
    params = [SamplingParams(temperature=0.8, top_k=-1, repetition_penalty=1.2, logit_bias={3: 1.0}), SamplingParams()]
    meta = meta_for(params, prompt_ids=[list(range(20)), [1, 2]], output_ids=[[5] * 3, [7]], pad_to=4)
    assert meta.temperature.shape == (4,) and meta.seed.shape == (4, 2)
    np.testing.assert_array_equal(meta.temperature, np.float32([0.8, 1.0, 0.0, 0.0]))  # padding rows greedy
    np.testing.assert_array_equal(meta.top_k, [0, 0, 0, 0])  # -1 -> 0 (off)
    np.testing.assert_array_equal(meta.step, [3, 1, 0, 0])  # default step = outputs so far
    assert meta.history.shape == (4, 32)  # a power of two >= 16 holding prompt + outputs (23 tokens)
    np.testing.assert_array_equal(meta.history[0, :23], list(range(20)) + [5] * 3)
    np.testing.assert_array_equal(meta.num_prompt, [20, 0, 0, 0])
    # Row 1 has no penalty, so its history is not shipped.
    assert (meta.history[0, 23:] == sampling.PAD_ID).all() and (meta.history[1] == sampling.PAD_ID).all()
    assert meta.bias_ids.shape == (4, 4) and meta.bias_ids[0, 0] == 3 and meta.bias_values[0, 0] == 1.0
    with pytest.raises(ValueError, match="pad_to"):
        meta_for(params, pad_to=1)


def test_fixed_widths_keep_every_shape():
    """With fixed widths (the runner's), no parameter of any request changes a shape."""
    fixed = dict(pad_to=4, history_width=300, bias_width=sampling.bias_width(1), eos_token_ids=[2])
    batches = [
        ([SamplingParams()], {}),
        (
            [
                SamplingParams(
                    logit_bias={i: 1.0 for i in range(sampling.MAX_LOGIT_BIAS)},
                    min_tokens=3,
                    stop_token_ids=list(range(sampling.MAX_STOP_TOKEN_IDS)),
                )
            ],
            {},
        ),
        (
            [SamplingParams(repetition_penalty=1.1, logprobs=20)] * 2,
            dict(prompt_ids=[list(range(200))] * 2, output_ids=[[1] * 99] * 2),
        ),
    ]
    shapes = set()
    for params, hist in batches:
        meta = meta_for(params, **hist, **fixed)
        shapes.add(tuple((f.name, np.shape(getattr(meta, f.name))) for f in dataclasses.fields(meta)))
    assert len(shapes) == 1
    assert dict(shapes.pop())["history"] == (4, 300)
    with pytest.raises(ValueError, match="history"):
        meta_for([SamplingParams(frequency_penalty=1.0)], output_ids=[[1] * 301], **fixed)
    # Batches without bias or penalties share constant arrays instead of building them each step.
    a, b = meta_for([SamplingParams()], **fixed), meta_for([SamplingParams(seed=3)], **fixed)
    assert a.history is b.history and a.bias_ids is b.bias_ids and not a.history.flags.writeable


def test_seed_key_matches_prng_key():
    meta = meta_for([SamplingParams(seed=7), SamplingParams(seed=2**40 + 3)])
    np.testing.assert_array_equal(meta.seed[0], jax.random.key_data(jax.random.PRNGKey(7)))
    np.testing.assert_array_equal(meta.seed[1], [2**40 >> 32, 3])


# ---------------------------------------------------------------- filters


def test_top_k_never_leaves_top_k():
    rng = np.random.default_rng(0)
    b, v, k = 64, 50, 5
    logits = rng.normal(size=(b, v)).astype(np.float32) * 2
    allowed = np.argsort(-logits, axis=-1)[:, :k]
    # Every other row samples unfiltered: a batch mixing filtered and unfiltered rows filters each its own way.
    params = [SamplingParams(temperature=1.5, top_k=k if i % 2 else 0, seed=i) for i in range(b)]
    outside = 0
    for step in range(8):
        tokens = np.asarray(sample(jnp.asarray(logits), meta_for(params, steps=[step] * b)).tokens)
        inside = np.array([t in row for t, row in zip(tokens, allowed)])
        assert inside[1::2].all()
        outside += (~inside[::2]).sum()
    assert outside > 0.5 * 8 * b / 2  # the unfiltered rows do leave the top k (~90% of draws here)


def test_top_k_zero_and_minus_one_keep_everything():
    for top_k in (0, -1):
        assert kept_set(LOGITS, SamplingParams(top_k=top_k)) == set(range(len(PROBS)))


def numpy_top_p(probs, p):
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    return set(order[before < p].tolist())


@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.6, 0.75, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_keeps_exact_nucleus(top_p, temperature):
    probs_t = softmax(LOGITS / temperature)
    expected = numpy_top_p(probs_t, top_p)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    assert kept_set(LOGITS, params) == expected
    batch = [dataclasses.replace(params, seed=i) for i in range(256)]
    tokens = np.asarray(sample(jnp.asarray(np.tile(LOGITS, (256, 1))), meta_for(batch)).tokens)
    assert set(tokens.tolist()) <= expected


def test_top_k_then_top_p_renormalizes_within_top_k():
    # top_k=3 leaves {0,1,2} with renormalized probs 0.441, 0.324, 0.235; top_p=0.65 then keeps {0, 1}
    # (on the un-renormalized distribution it would keep {0, 1, 2}).
    assert kept_set(LOGITS, SamplingParams(top_k=3, top_p=0.65)) == {0, 1}
    renorm = PROBS[:3] / PROBS[:3].sum()
    assert numpy_top_p(renorm, 0.65) == {0, 1} and numpy_top_p(PROBS, 0.65) == {0, 1, 2}


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.25, 0.5, 1.0])  # none on a boundary but 1.0 (the max)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_keeps_exact_set(min_p, temperature):
    probs_t = softmax(LOGITS / temperature)
    expected = set(np.flatnonzero(probs_t >= min_p * probs_t.max()).tolist())
    params = SamplingParams(temperature=temperature, min_p=min_p)
    assert kept_set(LOGITS, params) == expected
    batch = [dataclasses.replace(params, seed=i) for i in range(256)]
    tokens = np.asarray(sample(jnp.asarray(np.tile(LOGITS, (256, 1))), meta_for(batch)).tokens)
    assert set(tokens.tolist()) <= expected


def numpy_filter_set(x, top_k, top_p):
    """Tokens kept by top-k then top-p (on the renormalized top-k distribution) of logits x."""
    order = np.argsort(-x)
    k = top_k if top_k > 0 else len(x)
    probs = softmax(x[order[:k]])
    before = np.cumsum(probs) - probs
    n = max(int((before < top_p).sum()), 1) if top_p < 1 else k
    return set(order[:n].tolist())


def test_filters_on_large_vocab_every_path():
    # V > TOP_K_CAP. Rows covered by lax.top_k(cap): small top_k, and top-p whose nucleus fits in the cap.
    # Rows that need the whole vocabulary (a bisection for the threshold): top_k > cap, top-p on a flat
    # distribution whose nucleus does not fit, and both at once (top-p on the renormalized top-k).
    rng = np.random.default_rng(1)
    cap = sampling.TOP_K_CAP
    v = 2 * cap + 37
    scale = np.float32([[3], [3], [3], [3], [0.1], [0.1], [0.3]])
    logits = rng.normal(size=(7, v)).astype(np.float32) * scale
    params = [
        SamplingParams(top_k=10),
        SamplingParams(top_p=0.8),
        SamplingParams(top_k=cap + 50),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.5),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=cap + 150, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=2 * cap, top_p=0.97),
    ]
    expected = [numpy_filter_set(logits[r] / p.temperature, p.top_k, p.top_p) for r, p in enumerate(params)]
    assert len(expected[1]) < cap < min(len(expected[4]), len(expected[5]), len(expected[6]))  # both paths
    assert len(expected[5]) < cap + 150 and len(expected[6]) < 2 * cap  # top-p cut inside the top-k
    for rows in ([0, 1, 2, 3, 4, 5, 6], [0, 3], [1], [4], [1, 4], [2], [5], [6, 0]):
        meta = meta_for([params[r] for r in rows])
        # branchless (GPUs and TPUs): the search takes 15 candidates a pass, 8 passes (the CPU bisects, 32)
        for m in (meta, dataclasses.replace(meta, branchless=True)):
            out = np.asarray(process_logits(jnp.asarray(logits[rows]), m))
            for i, r in enumerate(rows):
                assert set(np.flatnonzero(np.isfinite(out[i])).tolist()) == expected[r], (rows, params[r], m.branchless)


@pytest.mark.parametrize("ways", [2, 4, 16])
def test_search_over_float_keys_finds_the_exact_value(ways):
    """The threshold search (``_smallest_value_where``): the smallest value of each row with at most n values above
    it, i.e. the row's (n+1)-th largest, exactly as numpy's sort gives it, on rows of ties, -inf, signed zeros, the
    float32 extremes, the smallest normals and ordinary values, for 2 (a bisection), 4 and 16 ways. (No subnormals:
    XLA:CPU compares them as zeros.)"""
    rng = np.random.default_rng(ways)
    f32 = np.finfo(np.float32)
    specials = np.float32([-np.inf, -f32.max, -1.0, -f32.tiny, -0.0, 0.0, f32.tiny, 2 * f32.tiny, 1.0, f32.max])
    rows = [
        rng.normal(size=64).astype(np.float32) * 5,
        np.repeat(np.float32([2.5, -1.0, 7.0, 7.0]), 16),  # ties
        rng.choice(specials, 64).astype(np.float32),
        np.concatenate([specials, rng.normal(size=54).astype(np.float32) * 1e-30]),  # 1e-30: normal, near tiny
        np.full(64, 3.0, np.float32),  # one value
    ]
    x = np.stack(rows)
    for n in (0, 1, 5, 17, 63):
        at_most_n_above = lambda c, n=n: (jnp.asarray(x)[:, None, :] > c[..., None]).sum(-1) <= n  # noqa: E731
        got = np.asarray(sampling._smallest_value_where(jnp.asarray(x), at_most_n_above, ways))[:, 0]
        want = -np.sort(-x, axis=1)[:, n]
        np.testing.assert_array_equal(got, want, err_msg=str(n))  # by value: -0.0 == 0.0
        assert all(v in row for v, row in zip(got, x))  # a value of the row
    with pytest.raises(ValueError, match="ways must be one of \\[2, 4, 16\\], got 3"):
        sampling._smallest_value_where(jnp.asarray(x), lambda c: c > 0, 3)


# ---------------------------------------------------------------- statistics and greedy


def draw_many(logits, params, rows=2000, steps=10):
    batch = [dataclasses.replace(params, seed=1000 + i) for i in range(rows)]
    tiled = jnp.asarray(np.tile(logits, (rows, 1)))
    out = [np.asarray(sample(tiled, meta_for(batch, steps=[s] * rows)).tokens) for s in range(steps)]
    return np.concatenate(out)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    ],
    ids=["t1", "t0.7", "t0.7-k5-p0.9"],
)
def test_chi_square_matches_numpy_distribution(params):
    draws = draw_many(LOGITS, params)
    assert draws.size == 20_000
    expected_p = softmax(LOGITS / params.temperature)
    keep = np.zeros(len(PROBS), bool)
    if params.top_k > 0:
        keep[np.argsort(-expected_p)[: params.top_k]] = True
    else:
        keep[:] = True
    expected_p = np.where(keep, expected_p, 0.0)
    expected_p /= expected_p.sum()
    keep &= np.isin(np.arange(len(PROBS)), list(numpy_top_p(expected_p, params.top_p)))
    expected_p = np.where(keep, expected_p, 0.0)
    expected_p /= expected_p.sum()
    counts = np.bincount(draws, minlength=len(PROBS))
    assert counts[~keep].sum() == 0
    result = chisquare(counts[keep], expected_p[keep] * draws.size)
    assert result.pvalue > 1e-3, (counts, expected_p * draws.size)


def test_chi_square_detects_a_wrong_distribution():
    # The test above can fail: temperature-1 draws do not fit the temperature-0.7 distribution.
    draws = draw_many(LOGITS, SamplingParams(temperature=1.0))
    wrong = softmax(LOGITS / 0.7) * draws.size
    assert chisquare(np.bincount(draws, minlength=len(PROBS)), wrong).pvalue < 1e-6


def test_temperature_zero_is_greedy_argmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(32, 100)).astype(np.float32)
    expected = logits.argmax(-1)
    for t in (0.0, 1e-6):
        params = [SamplingParams(temperature=t, top_k=3, top_p=0.5, seed=i) for i in range(32)]
        np.testing.assert_array_equal(sample(jnp.asarray(logits), meta_for(params)).tokens, expected)
    # Approaching zero converges to greedy (logit gaps of >= 0.05 scaled by 1/1e-3).
    gapped = np.stack([rng.permutation(100) * 0.05 for _ in range(32)]).astype(np.float32)
    params = [SamplingParams(temperature=1e-3, seed=i) for i in range(32)]
    np.testing.assert_array_equal(sample(jnp.asarray(gapped), meta_for(params)).tokens, gapped.argmax(-1))


# ---------------------------------------------------------------- penalties and bias


def test_penalties_and_bias_match_hand_computation():
    v = 10
    raw = np.array([1.0, 2.0, -1.0, 0.5, -0.5, 3.0, 0.0, -2.0, 1.5, 0.25], np.float32)
    prompt, output = [1, 2, 2], [2, 3, 3, 8]
    p = SamplingParams(
        repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 2.0, 5: -100.0, 9: 1.0}
    )
    # numpy, in vLLM's order: bias, repetition (prompt or output), frequency and presence (output counts).
    x = raw.copy()
    x[[4, 5, 9]] += [2.0, -100.0, 1.0]
    seen = np.zeros(v, bool)
    seen[prompt + output] = True
    x = np.where(seen, np.where(x > 0, x / 1.5, x * 1.5), x)
    counts = np.bincount(output, minlength=v)
    x = x - 0.25 * counts - 0.5 * (counts > 0)
    # Spot-check a few by hand: token 2 (seen, negative, once in output): -1*1.5 - 0.25 - 0.5 = -2.25.
    assert np.isclose(x[2], -2.25) and np.isclose(x[3], 0.5 / 1.5 - 0.5 - 0.5) and np.isclose(x[4], 1.5)
    assert np.isclose(x[1], 2 / 1.5) and np.isclose(x[5], -97.0)

    meta = meta_for([p, dataclasses.replace(p, temperature=0)], prompt_ids=[prompt] * 2, output_ids=[output] * 2)
    got = np.asarray(process_logits(jnp.asarray(np.stack([raw, raw])), meta))
    np.testing.assert_allclose(got[0], x, rtol=1e-6)
    np.testing.assert_allclose(got[1], x, rtol=1e-6)  # greedy rows: same biased and penalized logits
    assert int(sample(jnp.asarray(np.stack([raw, raw])), meta).tokens[1]) == int(np.argmax(x)) == 4
    # Without penalties the history is ignored, even when given.
    plain = meta_for([SamplingParams()], prompt_ids=[prompt], output_ids=[output])
    np.testing.assert_allclose(np.asarray(process_logits(jnp.asarray(raw[None]), plain))[0], raw)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    raw = np.array([0.0, 5.0, 4.0, 1.0], np.float32)  # eos=1 and stop id 2 would win greedily
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2])
    for step, expected in ((0, 3), (2, 3), (3, 1)):
        meta = meta_for([p], steps=[step], eos_token_ids=[1])
        assert int(sample(jnp.asarray(raw[None]), meta).tokens[0]) == expected
    meta = meta_for([dataclasses.replace(p, ignore_eos=True)], steps=[0], eos_token_ids=[1])
    assert int(sample(jnp.asarray(raw[None]), meta).tokens[0]) == 1  # ignore_eos: only the stop id is banned


# ---------------------------------------------------------------- seeds


def random_params(rng, seed):
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.5, 1.0, 1.3])),
        top_k=int(rng.choice([0, 5, 300])),
        top_p=float(rng.choice([1.0, 0.8])),
        min_p=float(rng.choice([0.0, 0.1])),
        repetition_penalty=float(rng.choice([1.0, 1.2])),
        frequency_penalty=float(rng.choice([0.0, 0.3])),
        logit_bias={int(rng.integers(256)): 5.0} if rng.random() < 0.5 else None,
        seed=seed,
    )


def test_same_seed_same_tokens_alone_and_in_a_batch():
    rng = np.random.default_rng(3)
    v, steps, row = 256, 12, 5
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=1234)
    history = [int(t) for t in rng.integers(0, v, 7)]
    alone, batched, other_seed = [], [], []
    for step in range(steps):
        logits = (rng.normal(size=(8, v)) * 1.5).astype(np.float32)
        out = sample(jnp.asarray(logits[row : row + 1]), meta_for([target], [None], [step], [history], [history]))
        alone.append(int(out.tokens[0]))
        others = [random_params(rng, int(s)) for s in rng.integers(0, 10_000, 7)]
        batch = others[:row] + [target] + others[row:]
        hist = [[int(t) for t in rng.integers(0, v, rng.integers(1, 16))] for _ in range(8)]  # one bucket
        hist[row] = history
        meta = meta_for(batch, None, [step] * 8, hist, hist, pad_to=16)
        out = sample(jnp.asarray(np.concatenate([logits, np.zeros((8, v), np.float32)])), meta)
        batched.append(int(out.tokens[row]))
        meta = meta_for([target], [99], [step], [history], [history])
        other_seed.append(int(sample(jnp.asarray(logits[row : row + 1]), meta).tokens[0]))
    assert alone == batched
    assert alone != other_seed  # 12 draws from a ~50-token nucleus: equal with negligible probability


def test_different_seeds_and_steps_differ():
    logits = jnp.zeros((64, 1000), jnp.float32)  # uniform: collisions are rare
    tokens = np.asarray(sample(logits, meta_for([SamplingParams(seed=i) for i in range(64)])).tokens)
    assert len(set(tokens.tolist())) > 55
    same_seed = meta_for([SamplingParams(seed=7)] * 64, steps=list(range(64)))
    assert len(set(np.asarray(sample(logits, same_seed).tokens).tolist())) > 55


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(4)
    b, v = 6, 300
    raw = (rng.normal(size=(b, v)) * 2).astype(np.float32)
    params = [
        SamplingParams(temperature=0.5, top_k=3, seed=1),
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(repetition_penalty=1.7, frequency_penalty=1.0, seed=2),
        SamplingParams(top_p=0.3, min_p=0.2, seed=3),
        SamplingParams(temperature=1.5, seed=4),
        SamplingParams(temperature=0.0),
    ]
    params[0] = dataclasses.replace(params[0], logprobs=2)  # one row asking is enough to compute the top-K
    out = sample(jnp.asarray(raw), meta_for(params, output_ids=[[1, 2, 3]] * b), max_logprobs=sampling.MAX_LOGPROBS)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(raw), axis=-1))
    tokens = np.asarray(out.tokens)
    assert tokens[1] == 7  # biased token chosen; its logprob is still the raw one
    np.testing.assert_allclose(out.logprobs, ref[np.arange(b), tokens], rtol=1e-5, atol=1e-5)
    top = np.argsort(-ref, axis=-1)[:, : sampling.MAX_LOGPROBS]
    assert out.top_logprob_ids.shape == (b, sampling.MAX_LOGPROBS)
    np.testing.assert_array_equal(out.top_logprob_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, top, -1), rtol=1e-5, atol=1e-5)
    assert sample(jnp.asarray(raw), meta_for(params), max_logprobs=0).top_logprobs.shape == (b, 0)
    # No row asks: same shapes (no new compile), the top-K is skipped, the chosen logprobs are still there.
    params[0] = dataclasses.replace(params[0], logprobs=None)
    quiet = sample(jnp.asarray(raw), meta_for(params, output_ids=[[1, 2, 3]] * b), max_logprobs=sampling.MAX_LOGPROBS)
    assert quiet.top_logprobs.shape == (b, sampling.MAX_LOGPROBS) and not np.asarray(quiet.top_logprobs).any()
    np.testing.assert_allclose(quiet.logprobs, ref[np.arange(b), np.asarray(quiet.tokens)], rtol=1e-5, atol=1e-5)


def test_compute_logprobs_for_prompt():
    rng = np.random.default_rng(5)
    raw = rng.normal(size=(9, 50)).astype(np.float32)
    ids = rng.integers(0, 50, 9)
    lp, top_ids, top_lp = compute_logprobs(jnp.asarray(raw), jnp.asarray(ids), max_logprobs=3)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(raw), axis=-1))
    np.testing.assert_allclose(lp, ref[np.arange(9), ids], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, -1)[:, :3])
    np.testing.assert_allclose(top_lp, np.sort(ref, -1)[:, ::-1][:, :3], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- compilation


def test_one_compile_serves_every_parameter_mix():
    """One trace per sampler variant: the all-greedy batch's, and one for every other mix."""
    traces = 0

    def counted(logits, meta):
        nonlocal traces
        traces += 1
        return sample(logits, meta)  # the inner jit is inlined into this trace

    step = jax.jit(counted)
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(8, 64)).astype(np.float32))
    hist = [[1, 2, 3]] * 5
    mixes = [
        [SamplingParams(temperature=0)] * 5,  # all greedy
        [SamplingParams(seed=i) for i in range(5)],  # all random, no filters
        [random_params(rng, i) for i in range(5)],
        [SamplingParams(top_k=5, top_p=0.5, min_p=0.1, presence_penalty=1.0, logit_bias={1: 3.0}, seed=1)] * 5,
        [SamplingParams(min_tokens=4, stop_token_ids=[3, 4], seed=None)] * 5,
    ]
    for mix in mixes:
        meta = meta_for(mix, prompt_ids=hist, output_ids=hist, pad_to=8, eos_token_ids=[2])
        assert meta.variant == ("greedy" if mix is mixes[0] else "full")
        step(logits, meta).tokens.block_until_ready()
    assert traces == 2
    # The counter is live: a new batch bucket is a new compile.
    step(jnp.concatenate([logits, logits]), meta_for(mixes[2], pad_to=16)).tokens.block_until_ready()
    assert traces == 3


@pytest.mark.parametrize(
    "params, variant",
    [
        (dict(temperature=0.0), "greedy"),
        (dict(temperature=0.0, max_tokens=3, stop_token_ids=[5], ignore_eos=True), "greedy"),
        (dict(temperature=0.7), "full"),
        (dict(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2), "greedy"),  # filters act on sampled rows only
        (dict(temperature=0.0, logit_bias={3: 1.0}), "full"),
        (dict(temperature=0.0, min_tokens=2), "full"),  # bans EOS for two tokens: a bias
        (dict(temperature=0.0, repetition_penalty=1.1), "full"),
        (dict(temperature=0.0, presence_penalty=0.5), "full"),
        (dict(temperature=0.0, frequency_penalty=-0.5), "full"),
        (dict(temperature=0.0, logprobs=0), "greedy"),  # the chosen token's logprob: every variant has it
        (dict(temperature=0.0, logprobs=2), "full"),
    ],
)
def test_variant_is_greedy_only_when_no_row_asks_for_more(params, variant):
    rows = [SamplingParams(temperature=0.0), SamplingParams(**params)]
    kw = dict(prompt_ids=[[1], [1]], output_ids=[[], []], pad_to=4, eos_token_ids=[2])
    assert meta_for(rows, **kw).variant == variant
    # A constraining mask on any row, or the runner's prompt logprobs (``full``), needs the full variant.
    assert meta_for(rows, token_mask=np.array([[-1], [3]], np.int32), **kw).variant == "full"
    assert meta_for(rows, token_mask=np.full((2, 1), -1, np.int32), **kw).variant == variant
    assert meta_for(rows, full=True, **kw).variant == "full"


def test_greedy_variant_equals_numpy_and_the_full_variant():
    """The greedy variant's tokens and logprobs: numpy's argmax and log-softmax (1e-5), and exactly what the full
    variant gives the same batch; its top logprobs are zeros (no row asked)."""
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(6, 300)).astype(np.float32) * 4
    meta = meta_for([SamplingParams(temperature=0.0)] * 5, pad_to=6)
    assert meta.variant == "greedy"
    out = sample(jnp.asarray(logits), meta, max_logprobs=4)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    ref = np.log(softmax(logits))[np.arange(6), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(out.logprobs), ref, rtol=1e-5, atol=1e-5)
    assert np.asarray(out.top_logprob_ids).shape == (6, 4) and not np.asarray(out.top_logprobs).any()
    full = sample(jnp.asarray(logits), dataclasses.replace(meta, variant="full"), max_logprobs=4)
    np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(full.logprobs), np.asarray(out.logprobs))


@pytest.mark.parametrize(
    "params, variant",
    [
        (dict(temperature=0.7), "sampled"),
        (dict(temperature=0.7, top_k=40, min_p=0.05, seed=3), "sampled"),
        (dict(temperature=0.7, top_k=sampling.TOP_K_CAP), "sampled"),
        (dict(temperature=0.7, top_k=sampling.TOP_K_CAP + 1), "full"),  # past the cap: a bisection may be needed
        (dict(temperature=0.7, top_p=0.9), "full"),  # a nucleus can reach past the cap
        (dict(temperature=0.7, logprobs=2), "full"),
        (dict(temperature=0.7, presence_penalty=0.5), "full"),
        (dict(temperature=0.0, top_p=0.5), "greedy"),  # filters act on sampled rows only
    ],
)
def test_sampled_variant_where_the_caller_compiled_it(params, variant):
    """With the sampled variant among the caller's (GPU and TPU runners), plain sampling picks it; without it (the
    CPU's, and the default) the same batch is "full"."""
    rows = [SamplingParams(temperature=0.0), SamplingParams(**params)]
    kw = dict(prompt_ids=[[1], [1]], output_ids=[[], []], pad_to=4, eos_token_ids=[2])
    assert meta_for(rows, variants=sampling.VARIANTS, **kw).variant == variant
    assert meta_for(rows, **kw).variant == ("greedy" if variant == "greedy" else "full")
    assert meta_for(rows, variants=sampling.VARIANTS, full=True, **kw).variant == "prompt"  # with prompt logprobs
    assert sampling.variants_for("cpu") == ("greedy", "full") and sampling.variants_for("gpu") == sampling.VARIANTS


def test_sampled_variant_draws_what_the_full_variant_draws():
    """The sampled variant (no conditional: temperature, min-p, top-k from one lax.top_k) against the full one on the
    same seeded batch of greedy and sampled rows with every filter it takes: the same tokens and logprobs, the
    same kept sets (process_logits) and zero top logprobs (none asked)."""
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.normal(size=(8, 700)).astype(np.float32) * 3)
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=0.5, min_p=0.2, seed=3),
        SamplingParams(temperature=1.0, top_k=sampling.TOP_K_CAP, min_p=0.01, seed=4),
        SamplingParams(temperature=2.0, top_k=1, seed=5),
    ]
    meta = meta_for(rows, pad_to=8, steps=[0, 3, 1, 4, 1, 9], variants=sampling.VARIANTS)
    assert meta.variant == "sampled"
    full = dataclasses.replace(meta, variant="full")
    out, want = sample(logits, meta, max_logprobs=3), sample(logits, full, max_logprobs=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(want.logprobs), rtol=1e-6)
    assert np.asarray(out.top_logprobs).shape == (8, 3) and not np.asarray(out.top_logprobs).any()
    kept, kept_full = (np.isfinite(np.asarray(process_logits(logits, m))) for m in (meta, full))
    np.testing.assert_array_equal(kept, kept_full)
    assert kept[2].sum() == 5 and kept[5].sum() == 1 and kept[0].all()  # top-k 5, top-k 1, a greedy row untouched


@pytest.mark.multidevice
def test_greedy_and_sampled_variants_over_vocabulary_shards_equal_one_device():
    """What a TPU runner's step does (tests/test_aot.py audits it): the greedy and sampled variants on logits left
    sharded over the vocabulary, 8 shards, give one device's tokens and logprobs (XLA partitions the argmax, the
    log-sum-exp, the top-k and the draw's noise: jax's partitionable threefry draws the same bits)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("vocab",))  # automatic axes, as the runner's
    rng = np.random.default_rng(13)
    logits = jnp.asarray(rng.normal(size=(8, 1024)).astype(np.float32) * 3)
    sharded = jax.device_put(logits, NamedSharding(mesh, PartitionSpec(None, "vocab")))
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=7, seed=1)] + [
        SamplingParams(temperature=1.1, min_p=0.05, seed=i) for i in range(2, 8)
    ]
    for batch in (rows, [SamplingParams(temperature=0.0)] * 8):
        meta = meta_for(batch, pad_to=8, variants=sampling.VARIANTS)
        assert meta.variant == ("sampled" if batch is rows else "greedy")
        one, shards = sample(logits, meta), sample(sharded, meta)
        np.testing.assert_array_equal(np.asarray(shards.tokens), np.asarray(one.tokens))
        np.testing.assert_allclose(np.asarray(shards.logprobs), np.asarray(one.logprobs), rtol=1e-5, atol=1e-6)


@pytest.mark.multidevice
def test_branchless_full_variant_over_vocabulary_shards_equals_one_device():
    """The full variant as GPU and TPU runners compile it (branchless) on logits left in 8 vocabulary shards: bias,
    min_tokens bans, penalties (scattered into each shard), a grammar mask, top-k past the cap, top-p nuclei wider
    than the cap (the bisection, its counts and masses summed over shards), min-p, seeds and top logprobs give one
    device's tokens, kept sets and logprobs; prompt logprobs too. (The runner gathered the vocabulary onto every chip
    for this variant: 31 MiB a step at Llama-3-8B's shapes on a v5e-8.)"""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("vocab",))
    v = 2 * sampling.TOP_K_CAP + 64  # 8 shards of 72
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(8, v)).astype(np.float32) * np.float32([[3]] * 5 + [[0.1]] * 3)  # 3 flat rows
    sampled = dict(temperature=0.9, seed=11)
    rows = [
        SamplingParams(temperature=0.0, logprobs=5, logit_bias={3: 4.0, v - 1: -2.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3, min_tokens=3),
        SamplingParams(top_k=sampling.TOP_K_CAP + 40, presence_penalty=0.5, logprobs=2, **sampled),
        SamplingParams(top_k=20, min_p=0.05, **sampled),
        SamplingParams(top_p=0.8, **sampled),
        SamplingParams(top_p=0.95, **sampled),  # flat rows: nuclei past the cap
        SamplingParams(top_p=0.9, top_k=sampling.TOP_K_CAP + 100, temperature=1.3, seed=3),
        SamplingParams(temperature=0.0, logprobs=20),
    ]
    w = (v + 31) // 32
    mask = np.full((8, w), -1, np.int32)
    mask[3] = 0x0F0F0F0F  # a grammar allows a quarter of row 3's tokens
    meta = meta_for(
        rows, prompt_ids=[[1, 2, 3, 300]] * 8, output_ids=[[4, 5, 80]] * 8, steps=[3] * 8, pad_to=8,
        eos_token_ids=[2], history_width=8, bias_width=8, token_mask=mask, full=True, variants=sampling.VARIANTS,
    )  # fmt: skip
    assert meta.variant == "prompt" and meta.branchless
    one = jnp.asarray(logits)
    sharded = jax.device_put(one, NamedSharding(mesh, PartitionSpec(None, "vocab")))
    want, got = sample(one, meta, max_logprobs=20), sample(sharded, meta, max_logprobs=20)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.top_logprob_ids), np.asarray(want.top_logprob_ids))
    np.testing.assert_allclose(np.asarray(got.top_logprobs), np.asarray(want.top_logprobs), rtol=1e-5, atol=1e-5)
    kept, kept_one = (np.isfinite(np.asarray(process_logits(x, meta))) for x in (sharded, one))
    np.testing.assert_array_equal(kept, kept_one)
    assert (kept[5:7].sum(-1) > sampling.TOP_K_CAP).all()  # nuclei past the cap: the bisection decided
    assert 0 < kept[3].sum() <= 20 and (np.flatnonzero(kept[3]) % 8 < 4).all()  # top-k 20 of what the mask allows
    targets = jnp.asarray(rng.integers(0, v, 8), jnp.int32)
    for a, b in zip(compute_logprobs(sharded, targets, 20), compute_logprobs(one, targets, 20)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_fixed_widths_one_compile_for_every_size():
    """Biases of 0-1024 keys, histories of any length, logprobs on or off: one trace at fixed widths."""
    traces = 0

    def counted(logits, meta):
        nonlocal traces
        traces += 1
        return sample(logits, meta, max_logprobs=sampling.MAX_LOGPROBS)

    step = jax.jit(counted)
    rng = np.random.default_rng(7)
    v = 1100
    logits = jnp.asarray(rng.normal(size=(4, v)).astype(np.float32))
    fixed = dict(pad_to=4, history_width=512, bias_width=sampling.bias_width(1), eos_token_ids=[2])
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for keys in (0, 33, 65, 129, 513, 1024):
        for n_hist in (0, 40, 100, 300):
            params = [
                SamplingParams(
                    temperature=0,
                    logit_bias={t: -50.0 for t in range(keys)} or None,
                    repetition_penalty=1.1 if n_hist else 1.0,
                    logprobs=20 if keys % 2 else None,
                    min_tokens=1,
                    stop_token_ids=[7, 8],
                )
            ]
            meta = meta_for(params, prompt_ids=[list(range(n_hist))], output_ids=[[]], **fixed)
            out = step(logits, meta)
            x = np.asarray(logits[0]).copy()  # numpy: bias, the min_tokens ban, the repetition penalty
            x[:keys] -= 50.0
            x[[2, 7, 8]] = -np.inf
            x[:n_hist] = np.where(x[:n_hist] > 0, x[:n_hist] / 1.1, x[:n_hist] * 1.1)
            assert int(out.tokens[0]) == int(np.argmax(x)), (keys, n_hist)
            top = np.asarray(out.top_logprob_ids[0])
            if keys % 2:  # asked: the raw top 20
                np.testing.assert_array_equal(top, np.argsort(-ref[0])[:20])
    assert traces == 1


def test_argmax_rows_is_argmax():
    """The greedy token: numpy's argmax (first position on ties), also on all -inf rows and rows of ties; in a row
    with a NaN, a position holding a NaN or the row's largest number."""
    from jaxserve.sampling.sampler import argmax_rows

    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (64, 3000)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2] = 7.0
    x[3] = rng.normal(size=3000)
    got = np.asarray(argmax_rows(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    x[4, [5, 9]] = np.nan
    i = int(argmax_rows(jnp.asarray(x[4]))[()])
    assert np.isnan(x[4, i]) or x[4, i] == np.nanmax(x[4])


def test_prompt_logprobs_in_row_blocks_equal_numpy_over_the_whole_step():
    """A 512-token step's prompt logprobs are computed PROMPT_LOGPROBS_ROWS rows at a time (2 blocks here): the
    same logprobs and top logprobs as numpy's log-softmax over all 512 rows at once; with no target, zeros."""
    from jaxserve.runner.model_runner import PROMPT_LOGPROBS_ROWS, _prompt_logprobs
    from jaxserve.sampling.sampler import MAX_LOGPROBS

    rng = np.random.default_rng(5)
    T, D, V = 512, 16, 300
    assert T // PROMPT_LOGPROBS_ROWS == 2
    hidden = rng.normal(size=(T, D)).astype(np.float32)
    w = rng.normal(size=(D, V)).astype(np.float32)
    targets = rng.integers(0, V, size=T).astype(np.int32)
    targets[-3:] = -1  # no target (the last positions of a prompt chunk)
    logprobs, _, top = _prompt_logprobs(lambda h: h @ jnp.asarray(w), jnp.asarray(hidden), jnp.asarray(targets))
    logits = hidden.astype(np.float64) @ w
    ref = logits - logits.max(1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), ref[np.arange(T), np.maximum(targets, 0)], atol=1e-4)
    np.testing.assert_allclose(np.asarray(top), -np.sort(-ref, axis=1)[:, :MAX_LOGPROBS], atol=1e-4)
    none = _prompt_logprobs(lambda h: h @ jnp.asarray(w), jnp.asarray(hidden), jnp.full(T, -1, jnp.int32))
    assert all(not np.asarray(x).any() for x in none)
    # the "prompt" variant computes them without a conditional, the same; a variant without them, zeros
    args = (lambda h: h @ jnp.asarray(w), jnp.asarray(hidden), jnp.asarray(targets))
    always = _prompt_logprobs(*args, "always")
    np.testing.assert_array_equal(np.asarray(always[0]), np.asarray(logprobs))
    assert all(not np.asarray(x).any() for x in _prompt_logprobs(*args, "never"))
    with pytest.raises(ValueError, match="when must be 'asked', 'always' or 'never', got 'sometimes'"):
        _prompt_logprobs(*args, "sometimes")


def test_branchless_full_variant_draws_what_the_conditional_one_draws():
    """GPU and TPU runners' full variant computes every feature for every row instead of skipping, under
    ``lax.cond``, what no row asks for: on batches that skip each piece (all greedy, no bias, no penalty, no mask,
    filters off, every top-p nucleus inside the top TOP_K_CAP) and batches that need it (a nucleus past the cap: the
    bisection), the same tokens, logprobs and kept sets as the conditional one, and no conditional in its program."""
    rng = np.random.default_rng(21)
    v = 2 * sampling.TOP_K_CAP + 37
    logits = rng.normal(size=(8, v)).astype(np.float32) * np.float32([[3]] * 6 + [[0.1]] * 2)
    sampled = dict(temperature=0.9, seed=7)
    batches = [
        [SamplingParams(temperature=0.0)] * 3,  # every piece skipped
        [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, logit_bias={4: 9.0})],
        [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4), SamplingParams(**sampled)],
        [SamplingParams(top_p=0.8, **sampled), SamplingParams(top_k=20, min_p=0.05, **sampled)],  # nucleus in cap
        [SamplingParams(top_p=0.95, **sampled)] * 2 + [SamplingParams(temperature=0.0)],  # flat rows: bisection
        [SamplingParams(top_k=sampling.TOP_K_CAP + 40, presence_penalty=0.5, logprobs=2, **sampled)],
    ]
    w = (v + 31) // 32
    masks = {2: np.array([[-1] * w, [0x0F0F0F0F] * w], np.int32)}
    for i, rows in enumerate(batches):
        n = len(rows)
        x = jnp.asarray(logits[-n:] if i == 4 else logits[:n])  # batch 4: the flat rows (0.1 scale) for top-p
        kw = dict(prompt_ids=[[1, 2, 3]] * n, output_ids=[[4, 5]] * n, steps=[2] * n, pad_to=4, full=True)
        kw.update(history_width=8, bias_width=4, token_mask_width=w)  # one shape for every batch: one compile each
        meta = meta_for(rows, token_mask=masks.get(i), **kw)
        assert meta.variant == "full" and not meta.branchless
        branchless = dataclasses.replace(meta, branchless=True)
        x4 = jnp.pad(x, ((0, 4 - n), (0, 0)))
        want, got = sample(x4, meta, max_logprobs=4), sample(x4, branchless, max_logprobs=4)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), err_msg=str(i))
        np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs), err_msg=str(i))
        if any(p.logprobs for p in rows):  # the conditional one leaves zeros when no row asks
            np.testing.assert_array_equal(np.asarray(got.top_logprob_ids), np.asarray(want.top_logprob_ids))
            np.testing.assert_array_equal(np.asarray(got.top_logprobs), np.asarray(want.top_logprobs))
        kept, kept_want = (np.isfinite(np.asarray(process_logits(x4, m))) for m in (branchless, meta))
        np.testing.assert_array_equal(kept, kept_want, err_msg=str(i))
    hlo = sample.lower(x4, branchless, max_logprobs=4).compile().as_text()
    assert "conditional(" not in hlo and "conditional(" in sample.lower(x4, meta, max_logprobs=4).compile().as_text()
    # batch 4's flat rows need the bisection: their nucleus is wider than the cap
    flat = np.isfinite(np.asarray(process_logits(jnp.asarray(logits[-2:]), meta_for(batches[4][:2]))))
    assert (flat.sum(-1) > sampling.TOP_K_CAP).all()
