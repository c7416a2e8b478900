"""Async scheduling: each step is scheduled and launched while the previous one runs, its sampled tokens fed to the
next step on the device. Reference: the same engine with ``async_scheduling=False`` (steps one after the other),
whose greedy output is checked against HF transformers elsewhere (tests/test_engine.py). Everything a user sees must
be the same: tokens, logprobs (to float tolerance: the batches are composed differently), text cut at stop strings,
finish reasons; and no token past a request's end may ever reach a user, not even in a streamed output.

Mechanics only, so the model is the default one cut to its first two layers (``helpers.first_layers``): real
tokens, text-like output, a quarter of the cost a token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers import first_layers

from jaxserve import LLM, SamplingParams
from jaxserve.request import PENDING_TOKEN

WORDS = (
    "the river city light north stone garden music paper window seven quiet market winter bright "
    "history engine forest number table ocean silver story mountain coffee language science"
).split()


def _requests(n: int = 32) -> list[tuple[str, SamplingParams]]:
    """Mixed prompts (3-150 words) and parameters: greedy and seeded sampling, logprobs, stop strings and stop
    token ids, min_tokens, penalties (steps then wait for the previous one's tokens), n=2, prompt logprobs."""
    rng = random.Random(3)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 150))).capitalize() + "."
        kind = i % 8
        kw = dict(max_tokens=rng.randint(1, 40), logprobs=2 if i % 3 == 0 else None)
        if kind == 0:  # long enough for the aborts below
            sp = SamplingParams(temperature=0.0, ignore_eos=True, **kw | dict(max_tokens=10 + kw["max_tokens"]))
        elif kind == 1:
            sp = SamplingParams(temperature=0.0, stop=[" the", ","], **kw)
        elif kind == 2:
            sp = SamplingParams(temperature=0.9, seed=100 + i, **kw)
        elif kind == 3:
            sp = SamplingParams(temperature=0.0, stop_token_ids=[13, 28], min_tokens=2, **kw)
        elif kind == 4:
            sp = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, **kw)
        elif kind == 5:
            sp = SamplingParams(temperature=0.8, seed=200 + i, n=2, **kw)
        elif kind == 6:
            sp = SamplingParams(temperature=0.0, prompt_logprobs=1, **kw)
        else:
            sp = SamplingParams(temperature=0.0, stop=["."], include_stop_str_in_output=True, **kw)
        out.append((prompt, sp))
    return out


def _run(llm: LLM, requests, abort_at: dict[int, int]):
    """Adds every request, steps to the end; aborts request i once its streamed output holds abort_at[i] tokens.
    Returns (final outputs by id, every streamed output by id)."""
    engine = llm.engine
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, sp)
    final, streamed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out)
            i = int(out.request_id[1:])
            if out.finished:
                final[out.request_id] = out
            elif i in abort_at and len(out.outputs[0].token_ids) >= abort_at[i]:
                assert engine.abort_request(out.request_id)
                final[out.request_id] = out
    assert engine.runner.k_cache is not None and engine.scheduler.block_manager.num_used_pages == 0
    return final, streamed


@pytest.fixture(scope="module")
def model(default_loaded):
    return first_layers(default_loaded)


@pytest.fixture(scope="module")
def runs(model):
    requests = _requests()
    abort_at = {0: 3, 8: 6, 16: 1}  # ignore_eos requests of at least 10 tokens
    results, stats = {}, {}
    for mode in (False, True):
        # A small pool (32 pages of 16 tokens, 8 sequences): long prompts preempt others.
        llm = LLM(
            model,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=512,
            num_pages=32,
            async_scheduling=mode,
        )
        assert llm.engine.scheduler_config.async_scheduling is mode
        results[mode] = _run(llm, requests, abort_at)
        stats[mode] = (llm.engine.scheduler.num_preemptions, llm.engine.runner.num_steps)
    return requests, abort_at, results, stats


def test_async_equals_sync_on_mixed_requests_with_preemption_and_aborts(runs):
    requests, abort_at, results, stats = runs
    (sync, _), (async_, _) = results[False], results[True]
    assert stats[False][0] > 0 and stats[True][0] > 0, f"no preemption: {stats}"
    assert sorted(sync) == sorted(async_) == sorted(f"r{i}" for i in range(len(requests)))
    checked_lp = 0
    for rid, ref in sync.items():
        got = async_[rid]
        assert len(got.outputs) == len(ref.outputs)
        for a, b in zip(ref.outputs, got.outputs):
            assert b.token_ids == a.token_ids, rid
            assert b.text == a.text, rid
            assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), rid
            if a.logprobs is not None:
                for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
                    assert list(ea) == list(eb), rid  # the same ids (sampled + top-k), in the same order
                    np.testing.assert_allclose(
                        [x.logprob for x in eb.values()], [x.logprob for x in ea.values()], atol=2e-4, err_msg=rid
                    )
                    checked_lp += 1
        if ref.prompt_logprobs is not None:
            for ea, eb in zip(ref.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
                assert list(ea) == list(eb)
                np.testing.assert_allclose(
                    [x.logprob for x in eb.values()], [x.logprob for x in ea.values()], atol=2e-4
                )
    assert checked_lp > 50
    # The mixture did exercise stop strings and stop tokens (the cut model still writes punctuation and " the").
    reasons = {a.stop_reason for r in sync.values() for a in r.outputs}
    assert reasons & {" the", ",", "."} and reasons & {13, 28}, reasons
    # Aborted at the same count of streamed tokens in both modes.
    for i, n in abort_at.items():
        assert sync[f"r{i}"].outputs[0].token_ids == async_[f"r{i}"].outputs[0].token_ids
        assert len(async_[f"r{i}"].outputs[0].token_ids) == n


def test_no_token_past_the_end_reaches_a_user(runs):
    requests, _, results, _ = runs
    final, streamed = results[True]
    for rid, outs in streamed.items():
        sp = requests[int(rid[1:])][1]
        end = final[rid]
        for out in outs:  # every streamed output is a prefix of the final one
            for part, last in zip(out.outputs, end.outputs):
                assert PENDING_TOKEN not in part.token_ids
                assert part.token_ids == last.token_ids[: len(part.token_ids)], rid
                assert last.text.startswith(part.text), rid
        for last in end.outputs:
            assert len(last.token_ids) <= sp.max_tokens
            if last.finish_reason == "stop" and last.stop_reason is None and not sp.ignore_eos:  # EOS: the last one
                assert last.token_ids[-1] in (0, 2) or last.token_ids[-1] in (sp.stop_token_ids or ())
        assert outs[-1] is end or outs[-1].finished is False  # nothing after the final output


def test_async_scheduling_overlaps_and_switches_off(model):
    """Steps launch before the previous step's results are read (the runner holds a step in flight between
    ``step()`` calls); on by default on GPUs and TPUs, off on the CPU and with speculative decoding."""
    default = LLM(model, max_num_seqs=4, max_model_len=256, num_pages=32)
    assert not default.engine.scheduler_config.async_scheduling  # off by default on the CPU, where it does not win
    llm = LLM(model, max_num_seqs=4, max_model_len=256, num_pages=32, async_scheduling=True)
    engine = llm.engine
    assert engine.scheduler_config.async_scheduling
    engine.add_request("a", "Name a color.", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert engine.step() == []  # the first step is launched; its token is read during the next step()
    assert engine.replicas[0].in_flight is not None
    request = engine.scheduler.requests["a#0"] if "a#0" in engine.scheduler.requests else engine.scheduler.requests["a"]
    assert request.output_token_ids == [PENDING_TOKEN] and request.num_pending == 1
    outs = engine.step()  # launches step 2 (its input token fed on the device), then reads step 1
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 1 and request.num_pending == 1
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs[0].token_ids) == 8 and engine.replicas[0].in_flight is None
    spec = LLM(
        model,
        max_num_seqs=4,
        max_model_len=256,
        num_pages=32,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    assert not spec.engine.scheduler_config.async_scheduling
    from jaxserve.config import EngineConfig

    assert EngineConfig().scheduler_config(256, "gpu").async_scheduling  # on by default on GPUs and TPUs
    assert EngineConfig().scheduler_config(256, "tpu").async_scheduling
    assert not EngineConfig(async_scheduling=False).scheduler_config(256, "gpu").async_scheduling
