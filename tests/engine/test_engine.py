"""The engine on the real default model: batching, preemption, chunked prefill, prefix caching, seeds,
compilation counts. References: each prompt run alone, and HF transformers (same GGUF) for greedy tokens.
"""

from __future__ import annotations

import random

import pytest
from helpers import SMALL_POOL_ENGINE, WARMUP_ENGINE, first_layers, hf_greedy_choices

from jaxserve import LLM, SamplingParams
from jaxserve.utils import cdiv, next_pow2

pytestmark = pytest.mark.slow

WORDS = (
    "the river city light north stone garden music paper window seven quiet market winter bright "
    "history engine forest number table ocean silver story mountain coffee language science"
).split()


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


def _mixed_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 200) -> list[str]:
    rng = random.Random(seed)
    return [_prompt(rng, rng.randint(lo, hi)) for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def small_llm(default_llm):
    """The session's shared engine (32 sequences, 256 tokens, max_model_len 2048): its steps are compiled already."""
    return default_llm


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batch_equals_alone_and_hf(small_llm, hf_default):
    prompts = _mixed_prompts(32)
    batched = _tokens(small_llm.generate(prompts, GREEDY, use_tqdm=False))
    for i, p in enumerate(prompts[:8]):  # alone: one request at a time
        assert _tokens(small_llm.generate([p], GREEDY, use_tqdm=False))[0] == batched[i], f"prompt {i}"
    for i, p in enumerate(prompts):
        ids = small_llm.tokenizer.encode(p)
        assert batched[i] == hf_greedy_choices(hf_default, ids, batched[i]), (
            f"prompt {i} ({len(ids)} tokens) differs from HF"
        )


def test_small_pool_preempts_and_loses_nothing(default_loaded, small_llm):
    # 8 x (55-160 prompt tokens + 32) need about 70 pages of 16 tokens at once; the pool has 24.
    prompts = _mixed_prompts(8, seed=1, lo=40, hi=120)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(small_llm.generate(prompts, params, use_tqdm=False))
    tiny = LLM(default_loaded, **SMALL_POOL_ENGINE)
    got = _tokens(tiny.generate(prompts, params, use_tqdm=False))
    stats = tiny.engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert got == expected
    assert all(len(t) == 32 for t in got)
    assert stats["num_used_pages"] == 0 and not tiny.engine.has_unfinished_requests()


def test_chunked_prefill_matches_unchunked(default_loaded, small_llm):
    prompt = _mixed_prompts(1, seed=2, lo=1100, hi=1100)[0]
    ids = small_llm.tokenizer.encode(prompt)[:1500]
    assert len(ids) >= 1000
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    big = LLM(default_loaded, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=2048, num_pages=140)
    unchunked = _tokens(big.generate([ids], params, use_tqdm=False))
    assert big.engine.get_stats()["num_steps"] == 8  # the whole prompt in one step, then 7 decodes
    chunked_llm = LLM(default_loaded, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=2048, num_pages=140)
    chunked = _tokens(chunked_llm.generate([ids], params, use_tqdm=False))
    assert chunked_llm.engine.get_stats()["num_steps"] == -(-len(ids) // 128) + 7
    assert chunked == unchunked


def test_prefix_caching_skips_shared_prefix(small_llm):
    rng = random.Random(3)
    prefix_ids = small_llm.tokenizer.encode(_prompt(rng, 700))[:512]
    suffixes = [small_llm.tokenizer.encode(" " + _prompt(rng, 10)) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = _tokens(small_llm.generate([prefix_ids + s for s in suffixes], params, use_tqdm=False))
    engine = small_llm.engine
    before = engine.get_stats()["num_tokens_computed"]
    second = _tokens(small_llm.generate([prefix_ids + s for s in suffixes], params, use_tqdm=False))
    computed = engine.get_stats()["num_tokens_computed"] - before
    total = sum(len(prefix_ids) + len(s) for s in suffixes)
    assert computed <= 0.2 * total, f"computed {computed} of {total} prompt tokens"
    assert second == first


def test_seed_gives_same_text_alone_and_in_batch(small_llm):
    prompts = _mixed_prompts(6, seed=4, lo=5, hi=60)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = small_llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = small_llm.generate(
        prompts[1:3] + [prompts[0]] + prompts[3:], [others] * 2 + [seeded] + [others] * 3, use_tqdm=False
    )
    assert batch[2].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=4321, ignore_eos=True)
    assert small_llm.generate([prompts[0]], different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt(small_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = small_llm.generate(["Write a word:"], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_strings_across_tokens(small_llm):
    base = (
        small_llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert len(base) > 8
    stop = base[3:7]  # four characters that most likely straddle a token boundary
    out = small_llm.generate(
        ["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == base[: base.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_no_recompilation_after_warmup(default_loaded):
    # Mechanics: the step's shapes do not depend on the depth, so the default model's first two layers (a quarter of
    # the cost a token) compile the same variants; tests/engine/test_reliability.py warms up the same engine.
    llm = LLM(first_layers(default_loaded), **WARMUP_ENGINE)
    runner = llm.engine.runner
    # On the CPU the widest page table serves every step (the C++ attention reads only each sequence's pages).
    assert runner.page_buckets == [next_pow2(cdiv(WARMUP_ENGINE["max_model_len"], runner.page_size))]
    compiled = runner.warmup()  # every bucket, once for each of the sampler's variants (greedy, full)
    assert (
        compiled
        == len(runner.compiler.buckets.shapes()) * len(runner.sampler_variants)
        == (len(runner.token_buckets) + len([b for b in runner.token_buckets if b <= runner.max_seqs])) * 2
    )
    rng = random.Random(5)
    prompts = [_prompt(rng, rng.randint(1, 120)) for _ in range(100)]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            max_tokens=rng.randint(1, 40),
            seed=rng.randint(0, 99),
        )
        for _ in prompts
    ]
    before = llm.engine.runner.num_compilations
    outs = llm.generate(prompts, params, use_tqdm=False)
    outs += llm.generate(prompts[:20], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # all greedy
    assert all(o.finished for o in outs)
    assert llm.engine.runner.num_compilations == before


def test_warmup_leaves_the_full_variant_to_the_background(default_loaded):
    """With the "sampled" variant (GPUs and TPUs), warm-up returns after greedy's and sampled's compiles; "full" and
    "prompt" are compiled by a background thread, and a step that needs one (top-p, prompt logprobs) waits for it
    rather than compiling its own."""
    from jaxserve.runner.compilation import StepCompiler
    from jaxserve.sampling.sampler import VARIANTS

    llm = LLM(first_layers(default_loaded, 1), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, num_pages=20)
    runner = llm.engine.runner
    runner.sampler_variants = VARIANTS  # as on a GPU or a TPU
    runner.compiler = StepCompiler(runner.step_program(), runner.buckets)
    shapes = len(runner.compiler.buckets.shapes())
    assert runner.compiler.program.deferred == ("full", "prompt")
    assert runner.warmup() == shapes * 2
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4, prompt_logprobs=1),
        SamplingParams(max_tokens=4, seed=2),
    ]
    outs = llm.generate(["Hello there", "One two"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    plp = outs[0].prompt_logprobs
    assert len(plp) == len(outs[0].prompt_token_ids) > 1 and plp[0] is None and all(plp[1:])
    assert runner.compiler._deferred.done() and runner.num_compilations == shapes * 4
