"""Async scheduling: each step is scheduled and launched while the previous one runs, its sampled tokens fed to the
next step on the device. Reference: the same engine with ``async_scheduling=False`` (steps one after the other),
whose greedy output is checked against HF transformers elsewhere (tests/engine/test_engine.py). Everything a user sees must
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
                assert min(part.token_ids, default=0) >= 0
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
    assert request.output_token_ids == [] and request.num_pending == 1  # counted, not written
    outs = engine.step()  # launches step 2 (its input token fed on the device), then reads step 1
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 1 and request.num_pending == 1
    assert request.output_token_ids == outs[0].outputs[0].token_ids
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


def _fed_step(rids_fed, others=()):
    """A SchedulerOutput over an InputBatch that holds requests a, b, c (prompts of 5): ``rids_fed`` decode the token
    the previous step sampled for them; ``others`` are (request id, token ids, draft token ids) chunks at position
    5."""
    from jaxserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput

    sched = []
    for rid in rids_fed:
        sched.append(ScheduledRequest(rid, [], 5, True, 1, [], from_previous_step=True))
    for rid, tokens, drafts in others:
        sched.append(ScheduledRequest(rid, list(tokens), 5, True, 1, [], None, tuple(drafts)))
    start = [
        ScheduledRequest(rid, list(range(5)), 0, True, 0, [k + 1, k + 4], NewRequestData(list(range(5)), [], None))
        for k, rid in enumerate("abc")
    ]
    return SchedulerOutput(start, [], [], [], 15), SchedulerOutput(sched, [], [], [], sum(s.num_tokens for s in sched))


def test_fed_rows_0_and_1_never_read_as_token_ids_or_placeholders():
    """The tokens fed from the previous step's samples (rows 0 and 1 of them here) are named in an index array of
    their own, apart from the token ids: a draft model's placeholder (-1) left unfilled is refused, never taken for
    fed row 0, and no token id is ever negative."""
    from jaxserve.runner.input_batch import InputBatch
    from jaxserve.spec_decode.ngram import PLACEHOLDER

    batch = InputBatch(4, [8, 16], [4], max_seqs=4, num_speculative_tokens=2)
    start, step = _fed_step("ab", [("c", [7, 8, 9], [8, 9])])
    batch.update(start)
    tokens, fed_index, attn, logits_indices, rows = batch.pack(step, {"a": 0, "b": 1})
    assert fed_index.tolist()[:5] == [0, 1, -1, -1, -1] and set(fed_index.tolist()[5:]) == {-1}
    assert tokens.tolist()[:5] == [0, 0, 7, 8, 9] and tokens.min() >= 0
    assert attn.positions.tolist()[:5] == [5, 5, 5, 6, 7] and logits_indices.tolist()[:5] == [0, 1, 2, 3, 4]
    assert rows == [(0, 0), (1, 0), (2, 0), (2, 1), (2, 2)]
    _, step = _fed_step("ab", [("c", [7, PLACEHOLDER, PLACEHOLDER], [PLACEHOLDER, PLACEHOLDER])])
    with pytest.raises(ValueError, match=r"negative: \[-1\]"):
        batch.pack(step, {"a": 0, "b": 1})
    _, step = _fed_step("ab")
    with pytest.raises(ValueError, match="'b' is fed a token the previous step did not sample"):
        batch.pack(step, {"a": 0})


def test_rows_0_and_1_fed_on_the_device_decode_as_sync(model):
    """Two greedy requests decoding together under async scheduling: every step after the first feeds rows 0 and 1
    of the previous step's samples; the tokens are the synchronous engine's."""
    prompts = ["Name a color.", "The river city light north stone"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, fed = {}, {}
    for mode in (False, True):
        llm = LLM(model, max_num_seqs=4, max_model_len=256, num_pages=32, async_scheduling=mode)
        inputs, pack, seen = llm.engine.runner.inputs, llm.engine.runner.inputs.pack, fed.setdefault(mode, [])

        def recording_pack(sched, fed_rows, pack=pack, seen=seen):
            packed = pack(sched, fed_rows)
            seen.append(sorted(packed[1][packed[1] >= 0].tolist()))
            return packed

        inputs.pack = recording_pack
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
    assert fed[True].count([0, 1]) == 11 and all(f == [] for f in fed[False])  # sync steps feed nothing


def test_async_scheduling_refuses_speculative_proposals():
    from jaxserve.config import SchedulerConfig, SpeculativeConfig

    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async scheduling does not schedule speculative proposals"):
        SchedulerConfig(speculative=spec, async_scheduling=True)
