"""Speculative decoding (n-gram prompt lookup, draft model): proposals, verification, outputs identical to plain.

The reference is jaxserve's own plain decoding, which the fidelity tests hold to HF transformers: with proposals,
every request must produce the very same tokens, text, logprobs and finish reasons (greedy, and sampled with
seeds: each position's draw is the one plain decoding makes there, so equal outputs over many seeds are equal
distributions), with stop strings, stop tokens, n > 1, min_tokens, penalties (not speculated) and preemption.
Both sides run the default model cut to its first two layers (``helpers.first_layers``): real tokens and text-like
continuations that repeat what the prompt holds, at a fraction of the 30 layers' prefill cost.
"""

from __future__ import annotations

import pytest
from helpers import first_layers

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.spec_decode.ngram import accepted, propose_ngram

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}

# Prompts whose continuations repeat what they hold (lists, code, quotes: high acceptance) and free text (low).
PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    "# the same again:\ndef fib(n):",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Tell me a story about a cat.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Write the word hello ten times: hello hello hello",
    "What is the capital of France?",
    "<html><body><ul><li>one</li><li>two</li><li>three</li><li>",
    "Copy: 'To be, or not to be, that is the question.' Copy: 'To be, or not",
    "Name three colors.",
    "a b c d e f g a b c d e f g a b c",
    "import numpy as np\nimport numpy as np\nimport",
    "Explain gravity in one sentence.",
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT name FROM",
    "Monday, Tuesday, Wednesday, Monday, Tuesday,",
    "Once upon a time",
]


# ------------------------------------------------------------------------------------------------ host side
@pytest.mark.parametrize(
    "tokens, k, n_max, n_min, want",
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, 3, 1, [9, 1, 2]),  # the suffix 1 2 3 occurred at 0: what followed it
        ([1, 2, 3, 9, 1, 2, 3], 1, 3, 1, [9]),  # at most k
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 1, [8, 1]),  # the latest earlier occurrence wins
        ([4, 4, 4, 4], 3, 2, 1, [4]),  # overlapping: 4 4 at 1 is followed by the last 4 only
        ([1, 2, 3, 4], 3, 3, 1, []),  # nothing recurs
        ([7, 1, 2, 9, 3, 2], 2, 3, 2, []),  # only a 1-gram recurs, and n_min is 2
        ([7, 1, 2, 9, 3, 2], 2, 3, 1, [9, 3]),
        ([3], 2, 3, 1, []),
    ],
)
def test_propose_ngram(tokens, k, n_max, n_min, want):
    assert propose_ngram(tokens, k, n_max, n_min) == want


def test_accepted_counts_the_confirmed_prefix():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted([], [4]) == 0


@pytest.mark.parametrize(
    "value, words",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "draft": "x"}, "unknown key"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ("{not json", "JSON"),
        ([1, 2], "object"),
    ],
)
def test_bad_speculative_config_is_named(value, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(speculative_config=value)


def test_the_cli_flag_parses_json():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    cfg = EngineConfig.from_cli_args(args)
    assert SpeculativeConfig.parse(cfg.speculative_config).num_speculative_tokens == 5


# ------------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def model(default_loaded):
    """The default model's first two layers: every engine of this module (the target, and the draft that is it)."""
    return first_layers(default_loaded)


@pytest.fixture(scope="module")
def engines(model):
    kw = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, num_pages=256)
    return LLM(model, **kw), LLM(model, speculative_config=SPEC, **kw)


def _chat(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


_PLAIN: dict = {}


def _plain(plain, prompts, params):
    """Plain decoding's outputs for (prompts, params), generated once for the module's comparisons."""
    key = (repr(prompts), repr(params))
    if key not in _PLAIN:
        _PLAIN[key] = plain.generate(prompts, params, use_tqdm=False)
    return _PLAIN[key]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x.outputs) == len(y.outputs)
        for u, v in zip(x.outputs, y.outputs):
            assert u.token_ids == v.token_ids, (x.prompt_token_ids[-8:], u.token_ids, v.token_ids)
            assert u.text == v.text and u.finish_reason == v.finish_reason and u.stop_reason == v.stop_reason
            if u.logprobs is not None:
                for eu, ev in zip(u.logprobs, v.logprobs):
                    assert eu.keys() == ev.keys()
                    for t in eu:
                        assert eu[t].logprob == pytest.approx(ev[t].logprob, abs=1e-4)


@pytest.mark.slow
def test_greedy_is_identical_and_proposals_are_accepted(engines):
    plain, spec = engines
    prompts = [_chat(plain, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    before = spec.engine.get_stats()
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    _same(a, b)
    stats = spec.engine.get_stats()
    drafted = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    taken = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and taken > 0.15 * drafted, (drafted, taken)  # chat replies copy less than raw text
    assert stats["num_used_pages"] == 0


@pytest.mark.slow
def test_one_request_takes_fewer_steps(engines):
    """Counting on: the proposals for ", " (the tokens that followed it before) often hold, so one request's 48
    tokens take far fewer steps than 48 (measured: 28)."""
    plain, spec = engines
    prompt = plain.tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    before = spec.engine.get_stats()["num_steps"]
    b = spec.generate([prompt], params, use_tqdm=False)
    steps = spec.engine.get_stats()["num_steps"] - before
    _same(plain.generate([prompt], params, use_tqdm=False), b)
    assert steps <= 0.8 * 48, steps


@pytest.mark.slow
def test_sampled_with_seeds_is_identical(engines):
    """32 seeds at temperature 0.8 with top-p / top-k / min_tokens: the same tokens as plain decoding, seed by
    seed (each position's draw is plain decoding's draw there), hence the same distribution."""
    plain, spec = engines
    prompts = [_chat(plain, p) for p in PROMPTS[:8]] * 4
    params = [
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, top_k=50, min_tokens=4, seed=s, logprobs=1)
        for s in range(len(prompts))
    ]
    _same(plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False))


@pytest.mark.slow
def test_stops_n_penalties_and_bias_are_identical(engines):
    plain, spec = engines
    prompts = [_chat(plain, p) for p in PROMPTS[:6]]
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, stop=[", pears", "fib(n - 2)", "hello hello"]),
        SamplingParams(max_tokens=40, temperature=0.0, stop=["e"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[28]),  # ","
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, n=2, temperature=0.7, seed=9),
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3),  # not speculated
        SamplingParams(max_tokens=30, temperature=0.0, logit_bias={28: -5.0, 11: 3.0}),
    ]
    # Every case on every prompt in one batch of 42 (a request's output does not depend on its neighbours).
    batch, params = [p for _ in cases for p in prompts], [c for c in cases for _ in prompts]
    _same(plain.generate(batch, params, use_tqdm=False), spec.generate(batch, params, use_tqdm=False))


@pytest.mark.slow
def test_preemption_loses_nothing_with_proposals(model, engines):
    """A pool too small for the batch: requests are preempted and recomputed, with proposals in flight."""
    plain, _ = engines
    tight = LLM(
        model,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=512,
        num_pages=24,
        speculative_config=SPEC,
    )
    prompts = [_chat(plain, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    b = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0 and stats["num_used_pages"] == 0
    _same(plain.generate(prompts, params, use_tqdm=False), b)


@pytest.mark.slow
def test_no_recompiles_in_steady_state(engines):
    _, spec = engines
    prompts = [_chat(spec, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.5, seed=i) for i in range(len(prompts))]
    # Twice: the second pass finds the prompts in the prefix cache and prefills only their tails (a shorter bucket,
    # compiled here if no earlier test of the module did).
    for _ in range(2):
        spec.generate(prompts, params, use_tqdm=False)
    n = spec.engine.get_stats()["num_compilations"]
    # The same traffic again (every step a different mix of proposal counts): nothing new to compile.
    spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.get_stats()["num_compilations"] == n


# ------------------------------------------------------------------------------------------------ draft model
def _tiny_draft(default_loaded):
    """A random 2-layer Llama of the default model's vocabulary: a draft that is nearly always wrong."""
    import dataclasses

    import numpy as np

    from jaxserve.loading.weights import param_shapes

    cfg = dataclasses.replace(
        default_loaded.config,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    rng = np.random.default_rng(0)
    params = {
        name: (rng.standard_normal(shape) * 0.05 + (1.0 if "norm" in name else 0.0)).astype(np.float32)
        for name, shape in param_shapes(cfg).items()
    }
    return dataclasses.replace(default_loaded, name="tiny-draft", config=cfg, params=params)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["itself", "tiny"])
def test_draft_model_output_is_identical(model, engines, draft):
    """The (cut) default model as its own draft proposes what it then samples (near-full acceptance); a tiny random
    draft is mostly rejected. Both give plain decoding's outputs, and every page is freed."""
    plain, _ = engines
    draft_model = model if draft == "itself" else _tiny_draft(model)
    spec = LLM(
        model,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=512,
        num_pages=256,
        speculative_config={"method": "draft_model", "model": draft_model, "num_speculative_tokens": 3},
    )
    prompts = [_chat(plain, p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)
    _same(_plain(plain, prompts, greedy), spec.generate(prompts, greedy, use_tqdm=False))
    stats = spec.engine.get_stats()
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    if draft == "itself":
        assert rate > 0.9, rate  # the same greedy choices, up to float ties between the two step shapes
    else:
        assert rate < 0.2, rate
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, stop=["."]) for i in range(len(prompts))]
    _same(_plain(plain, prompts, sampled), spec.generate(prompts, sampled, use_tqdm=False))
    assert spec.engine.get_stats()["num_used_pages"] == 0


@pytest.mark.slow
def test_draft_model_under_a_small_budget_and_pool(model, engines):
    """A 32-token budget (the draft catches up on each prompt in chunks) and a pool small enough to preempt."""
    plain, _ = engines
    spec = LLM(
        model,
        max_num_seqs=16,
        max_num_batched_tokens=32,
        max_model_len=512,
        num_pages=20,
        speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4},
    )
    prompts = [_chat(plain, p) for p in PROMPTS[:6]]  # 95 pages of 16 wanted at once, of 20
    params = SamplingParams(max_tokens=32, temperature=0.0)
    b = spec.generate(prompts, params, use_tqdm=False)
    stats = spec.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0 and stats["num_used_pages"] == 0
    _same(plain.generate(prompts, params, use_tqdm=False), b)


def test_a_draft_of_another_vocabulary_is_refused(default_loaded):
    import dataclasses

    other = dataclasses.replace(default_loaded, config=dataclasses.replace(default_loaded.config, vocab_size=1000))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            default_loaded,
            max_model_len=128,
            num_pages=16,
            speculative_config={"method": "draft_model", "model": other, "num_speculative_tokens": 2},
        )


@pytest.mark.slow
def test_the_server_counts_proposals_in_metrics(engines):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import ServerThread
    from jaxserve.server.metrics import parse_metrics

    # The module's n-gram engine (``engines``), its steps compiled already; the counters are the engine's, so what
    # this request proposed and had accepted is their growth from the engine's stats before it.
    engine = engines[1].engine
    before = engine.get_stats()
    app = build_app(engine, shutdown_timeout=5)
    with ServerThread(app) as thread:
        r = httpx.post(
            thread.url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0}, timeout=300
        )
        assert r.status_code == 200, r.text
        metrics = parse_metrics(httpx.get(thread.url + "/metrics", timeout=60).text)
    drafted = metrics["jaxserve:spec_decode_num_draft_tokens_total"] - before["spec_draft_tokens"]
    accepted_ = metrics["jaxserve:spec_decode_num_accepted_tokens_total"] - before["spec_accepted_tokens"]
    assert drafted > 0 and 0 < accepted_ <= drafted, (drafted, accepted_)
