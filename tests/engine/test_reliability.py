"""Engine reliability: no compile after warm-up whatever a request asks, batch admission,
validation at the door, failures confined to their requests, the CPU pool sized from available memory."""

from __future__ import annotations

import dataclasses
import random
import types

import jax
import numpy as np
import pytest
from helpers import WARMUP_ENGINE, first_layers

from jaxserve import LLM, SamplingParams
from jaxserve.config import CacheConfig, SchedulerConfig, bytes_or_fraction
from jaxserve.engine.exceptions import StepFailed
from jaxserve.runner.kv_pool import KVPool, available_host_memory, coarse_floor

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
WORDS = "river city light north stone garden music paper window seven quiet market winter".split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def llm(default_llm):
    """The session's shared engine (32 sequences, 256 tokens, max_model_len 2048): its steps are compiled already."""
    return default_llm


def _run(engine, ids=None):
    """Steps until every request finishes; returns {request_id: final output} and the number of device steps run
    (with async scheduling the last ``step()`` only reads the last device step's results)."""
    done, steps = {}, engine.runner.num_steps
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done, engine.runner.num_steps - steps


def _idle(engine):
    s = engine.scheduler
    return not engine.has_unfinished_requests() and not s.requests and s.block_manager.num_used_pages == 0


# ---------------------------------------------------------------- item 1: no compile after warm-up


def test_no_compile_after_warmup_for_any_sampling_option(default_loaded, caplog):
    # Step shapes, not depth, decide what compiles: two layers (tests/engine/test_engine.py's warm-up test builds the same).
    llm = LLM(first_layers(default_loaded), **WARMUP_ENGINE)
    runner = llm.engine.runner
    with caplog.at_level("INFO", logger="jaxserve.runner.compilation"):
        assert runner.warmup() == len(runner.compiler.buckets.shapes()) * len(runner.sampler_variants)
    assert (
        f"warm-up: {len(runner.compiler.buckets.shapes()) * len(runner.sampler_variants)} step variants" in caplog.text
    )
    before = runner.num_compilations
    rng = random.Random(3)
    prompts, params = [], []
    for keys in (33, 65, 129, 513, 1024):
        prompts.append(_text(rng, 8))
        params.append(SamplingParams(max_tokens=3, logit_bias={rng.randrange(49152): -5.0 for _ in range(keys)}))
    for words in (40, 100, 300):  # ~ tokens of history: every history length shares the fixed width
        prompts.append(_text(rng, words))
        params.append(SamplingParams(max_tokens=3, repetition_penalty=1.1, seed=words))
    options = [
        dict(logprobs=1),
        dict(logprobs=20),
        dict(logprobs=0),
        dict(prompt_logprobs=0),
        dict(prompt_logprobs=20, logprobs=5, seed=11),
        dict(presence_penalty=0.5, frequency_penalty=-0.5),
        dict(top_k=5, top_p=0.9, min_p=0.1, seed=7),
        dict(temperature=0.0, stop=["e", "a"]),
        dict(min_tokens=2, stop_token_ids=list(range(256))),
        dict(n=3, temperature=0.8),
        dict(seed=-(2**63)),
        dict(temperature=0.0, top_k=2**31 - 1),
        dict(structured_outputs={"regex": "[a-z]+ [0-9]"}),
        dict(n=2, structured_outputs={"json": {"type": "object"}}),
    ]
    for o in options:
        prompts.append(_text(rng, rng.randint(1, 60)))
        params.append(SamplingParams(max_tokens=4, **o))
    caplog.clear()
    with jax.log_compiles(), caplog.at_level("WARNING", logger="jax"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert runner.num_compilations == before  # no trace of the step ...
    assert "Compiling" not in caplog.text  # ... and no XLA compile of anything (page copies of n=3 included)
    with jax.log_compiles(), caplog.at_level("WARNING", logger="jax"):
        jax.jit(lambda x: x + 1)(1)  # the log does catch a compile
    assert "Compiling" in caplog.text
    # The optional outputs did come back, and alone or batched they are the same.
    plp = outs[len(prompts) - len(options) + 4]
    assert plp.prompt_logprobs[0] is None and all(len(d) >= 20 for d in plp.prompt_logprobs[1:])
    assert all(len(d) >= 5 for d in plp.outputs[0].logprobs)
    alone = llm.generate([prompts[-len(options) + 4]], [params[-len(options) + 4]], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == plp.outputs[0].token_ids
    assert runner.num_compilations == before


def test_page_copies_in_padded_chunks(llm):
    runner = llm.engine.runner
    chunks = runner.compiler.buckets.copy_chunks([(p, p + 100) for p in range(1, 80)])
    assert [len(src) for src, _ in chunks] == [32, 32, 16]  # max_seqs 32, then the power of two >= 15
    assert (chunks[-1][0][15:] == 0).all() and (chunks[-1][1][15:] == 0).all()  # null page onto itself
    assert runner.compiler.buckets.copy_chunks([]) is None
    k = np.asarray(runner.k_cache)
    marked = k.copy()
    marked[:, 1:4] = np.arange(1, 4, dtype=k.dtype)[None, :, None, None, None]
    runner.k_cache = jax.device_put(marked, runner.k_cache.sharding)
    runner._launch(runner.compiler.buckets.copy_chunks([(1, 204), (2, 205), (3, 206)]), None)
    got = np.asarray(runner.k_cache)
    np.testing.assert_array_equal(got[:, 204:207], marked[:, 1:4])
    np.testing.assert_array_equal(np.delete(got, [204, 205, 206], axis=1), np.delete(marked, [204, 205, 206], axis=1))
    runner.k_cache = jax.device_put(k, runner.k_cache.sharding)


# ---------------------------------------------------------------- item 3: batch admission


def test_many_prompts_at_once_take_as_few_steps_as_separate_requests(llm):
    engine = llm.engine
    prompts = [f"Prompt number {i} says" for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_requests([(f"b{i}", p, params) for i, p in enumerate(prompts)])
    batched, batched_steps = _run(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    separate, separate_steps = _run(engine)
    # max_num_seqs=32: two waves of a prefill step and a decode step each.
    assert batched_steps == separate_steps == 4
    assert [batched[f"b{i}"].outputs[0].token_ids for i in range(64)] == [
        separate[f"s{i}"].outputs[0].token_ids for i in range(64)
    ]
    # LLM.generate queues all its prompts at once too.
    steps = engine.runner.num_steps
    llm.generate(prompts, params, use_tqdm=False)
    assert engine.runner.num_steps - steps == 4


def test_add_requests_is_atomic_and_names_the_bad_item(llm):
    engine = llm.engine
    good = ("ok", "Hello there", GREEDY)
    cases = [
        ([good, ("bad", "x", SamplingParams(logit_bias={49152: 1.0}))], r"item 1 of 2: request 'bad'.*logit_bias"),
        ([good, ("ok", "again", None)], r"item 1 of 2: request id 'ok' is already in use"),
        ([good, ("x", [1, 2], SamplingParams(n=2)), ("x#1", [3], None)], r"item 2 of 3: request id 'x#1'"),
        ([good, ("x#0", [3], None), ("x", [1, 2], SamplingParams(n=2))], r"item 2 of 3:.*'x#0' \(n=2\)"),
        ([good, ("big", [5] * 2100, None)], r"item 1 of 2: request 'big'.*max_model_len=2048"),
        ([good, ("p", "hi", None, "high")], r"item 1 of 2: request 'p': priority"),
        ([good, ("two", "hi")], r"item 1 of 2: an item must be"),
    ]
    for items, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_requests(items)
        assert _idle(engine)  # nothing was queued
    with pytest.raises(ValueError, match=r"item 2 of 3: request 'gen-\d+': the prompt must be .*got a dict"):
        llm.generate(["fine", "also fine", {"a": 1}], GREEDY, use_tqdm=False)  # LLM.generate: nothing queued
    with pytest.raises(ValueError, match="prompts must be .* got dict"):
        llm.generate({"a": 1}, GREEDY, use_tqdm=False)
    assert _idle(engine)


# ---------------------------------------------------------------- item 4: validation at the door


def test_ids_collide_with_children_ids_in_both_orders(llm):
    engine = llm.engine
    engine.add_request("x#1", "First prompt", GREEDY)
    with pytest.raises(ValueError, match=r"request 'x': its sequence id 'x#1' \(n=2\) is already in use"):
        engine.add_request("x", "Second prompt", dataclasses.replace(GREEDY, n=2))
    engine.add_request("y", "Third prompt", dataclasses.replace(GREEDY, n=2))
    for taken in ("y#0", "y#1", "y"):
        with pytest.raises(ValueError, match=rf"'{taken}'.* already in use"):
            engine.add_request(taken, "Fourth", GREEDY)
    done, _ = _run(engine)
    assert sorted(done) == ["x#1", "y"] and len(done["y"].outputs) == 2
    assert all(len(o.token_ids) == 6 for out in done.values() for o in out.outputs)
    assert _idle(engine)


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([True, False], r"holding \['bool'\]"),
        ([1, 2.0], r"holding \['float', 'int'\]"),
        ({"a": 1}, "got a dict"),
        (b"abc", "got a bytes"),
        (np.array([[1, 2]]), r"int64 with shape \(1, 2\)"),
        (np.array([1.0, 2.0]), "float64"),
        ([], "empty"),
        ([49152], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
    ],
)
def test_bad_prompts_are_rejected_and_others_go_on(llm, prompt, match):
    engine = llm.engine
    engine.add_request("before", "The river", GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, GREEDY)
    done, _ = _run(engine)
    assert list(done) == ["before"] and len(done["before"].outputs[0].token_ids) == 6
    assert _idle(engine)


def test_token_arrays_and_vocabulary_checked_params(llm):
    ids = llm.tokenizer.encode("The quiet market at night")
    as_list = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for arr in (np.array(ids), np.array(ids, np.int32), np.array(ids, np.uint16)):
        assert llm.generate(arr, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == as_list  # one 1-D prompt
    two = llm.generate(np.array([ids, ids]), GREEDY, use_tqdm=False)  # 2-D: one prompt per row
    assert [o.outputs[0].token_ids for o in two] == [as_list, as_list]
    vocab = llm.engine.model_config.vocab_size
    for params, field in (
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
    ):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} has token ids \[{vocab}"):
            llm.generate(["ok", "fine"], params, use_tqdm=False)
    # The largest valid id is fine.
    out = llm.generate(
        ["ok"], SamplingParams(temperature=0, max_tokens=2, logit_bias={vocab - 1: 100.0}), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == [vocab - 1, vocab - 1]
    assert _idle(llm.engine)


def test_a_failed_step_fails_only_its_requests(llm, monkeypatch):
    engine = llm.engine
    rng = random.Random(9)
    prompts = [_text(rng, 5) for _ in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine.add_requests([(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:2])])
    engine.step()  # r0 and r1 are running
    engine.add_requests([(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[2:], 2)])
    real = engine.runner.launch

    def broken(sched, token_masks=None):
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.runner, "launch", broken)
    with pytest.raises(StepFailed, match="device fault") as err:
        engine.step()  # holds r0, r1 (decoding) and r2, r3 (admitted this step)
    assert err.value.request_ids == ["r0", "r1", "r2", "r3"] and err.value.outputs == []
    assert isinstance(err.value.__cause__, RuntimeError) and _idle(engine)
    monkeypatch.setattr(engine.runner, "launch", real)
    # A host-side failure of one request: the others' outputs of the step come with the exception.
    engine.add_requests([(f"q{i}", p, GREEDY) for i, p in enumerate(prompts)])
    real_append = engine.output_processor.append

    def append(tracked, seq, tok, **kw):
        if tracked.request_id == "q1":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return real_append(tracked, seq, tok, **kw)

    monkeypatch.setattr(engine.output_processor, "append", append)
    with pytest.raises(StepFailed) as err:
        for _ in range(2):  # with async scheduling the first step() only launches the prefill
            engine.step()
    assert err.value.request_ids == ["q1"] and sorted(o.request_id for o in err.value.outputs) == ["q0", "q2", "q3"]
    monkeypatch.setattr(engine.output_processor, "append", real_append)
    done, _ = _run(engine)
    assert sorted(done) == ["q0", "q2", "q3"]
    assert [done[f"q{i}"].outputs[0].token_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert _idle(engine)


# ---------------------------------------------------------------- item 5: the pool from available memory


class _FakePool:
    page_size = 16
    mesh = types.SimpleNamespace(local_devices=jax.local_devices())

    def page_bytes(self):
        return 1 << 20  # 1 MiB pages


def test_cpu_pool_sized_from_available_memory(monkeypatch, tmp_path, caplog):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:    2097152 kB\n")
    assert available_host_memory(str(meminfo)) == 2 << 30
    assert available_host_memory(str(tmp_path / "missing")) > 0  # falls back to sysconf
    import jaxserve.runner.kv_pool as pool_mod

    sched = SchedulerConfig(max_num_seqs=64, max_model_len=2048)  # wants 64 * 128 + 1 pages
    pages = lambda **kw: KVPool.pages_from_memory(_FakePool(), CacheConfig(**kw), sched)  # noqa: E731
    # A quarter of what is available, at most 4 GiB, rounded down to m * 2**k pages (m 4..7): 1.9 GiB / 4 = 486
    # pages -> 448; the same pool for any availability in a band, so a restarted process reuses its compiled steps.
    cases = ((2 << 30, 512), ((2 << 30) - (100 << 20), 448), (64 << 30, 4096), (1 << 40, 4096), (8 << 20, 2))
    for available, expected in cases:
        monkeypatch.setattr(pool_mod, "available_host_memory", lambda a=available: a)
        with caplog.at_level("INFO", logger="jaxserve.runner.kv_pool"):
            assert pages() == expected, available
        assert f"KV pool: {expected} pages of 16 tokens = {expected * 16} tokens" in caplog.text
    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: 2 << 30)
    assert pages(kv_cache_memory=100 << 20) == 100  # bytes: exactly that
    assert pages(kv_cache_memory=0.5) == 1024  # a fraction of what is available
    assert pages(kv_cache_memory=1.0) == 2048
    with pytest.raises(ValueError, match="not enough memory"):
        pages(kv_cache_memory=1 << 20)
    floors = {1: 1, 7: 7, 8: 8, 9: 8, 15: 14, 16: 16, 17: 16, 4369: 4096, 5825: 5120, 8193: 8192}
    assert {n: coarse_floor(n) for n in floors} == floors
    small = SchedulerConfig(max_num_seqs=2, max_model_len=64)  # the default never exceeds what can be used
    assert KVPool.pages_from_memory(_FakePool(), CacheConfig(), small) == 2 * 4 + 1


@pytest.mark.parametrize("bad", [0, -5, 1.5, 0.0, True, "1G"])
def test_kv_cache_memory_validated(bad):
    with pytest.raises(ValueError, match="CacheConfig.kv_cache_memory"):
        CacheConfig(kv_cache_memory=bad)


def test_kv_cache_memory_flag_parses_bytes_and_fractions():
    assert [bytes_or_fraction(s) for s in ("0.25", "1.0", "8000000000", "8G", "8GiB", "512MiB", "512m")] == [
        0.25,
        1.0,
        8000000000,
        8 << 30,
        8 << 30,
        512 << 20,
        512 << 20,
    ]
    with pytest.raises(ValueError):
        bytes_or_fraction("lots")
    from jaxserve.cli import build_parser
    from jaxserve.config import EngineConfig

    args = build_parser().parse_args(["serve", "--kv-cache-memory", "512MiB"])
    assert EngineConfig.from_cli_args(args).cache_config().kv_cache_memory == 512 << 20


def test_batching_defaults_follow_the_platform_and_what_the_user_sets():
    from jaxserve.config import EngineConfig, batching_defaults

    gib = 1 << 30
    assert batching_defaults("cpu", None) == (64, 512)
    assert batching_defaults("tpu", 16 * gib) == (128, 2048)  # v5e
    assert batching_defaults("tpu", 32 * gib) == (256, 4096)  # v6e
    assert batching_defaults("gpu", 141 * gib) == (256, 8192)  # H200
    assert batching_defaults("gpu", None) == (128, 2048)
    cfg = EngineConfig().scheduler_config(1024, "gpu", 80 * gib)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 8192)
    cfg = EngineConfig(max_num_seqs=8).scheduler_config(1024, "gpu", 80 * gib)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (8, 8192)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_cpu_engine_takes_the_cpu_defaults(default_loaded):
    llm = LLM(default_loaded, max_model_len=256, num_pages=64)
    cfg = llm.engine.scheduler_config
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (64, 512)


def test_engine_pool_from_kv_cache_memory(default_loaded):
    llm = LLM(default_loaded, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, kv_cache_memory=64 << 20)
    runner = llm.engine.runner
    assert runner.num_pages == (64 << 20) // runner.pool.page_bytes()
    assert runner.k_cache.shape[1] == runner.num_pages
    assert llm.engine.scheduler.block_manager.num_pages == runner.num_pages
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


def test_a_dropped_engine_is_freed_before_the_next_one_is_built(default_loaded):
    """Engines hold reference cycles; their compiled steps hold memory mappings (a process may have 65,530). A new
    engine runs the cycle collector first, so dropped ones do not pile up (notebooks, test suites)."""
    import gc
    import weakref

    gc.disable()  # only the engine's own collection can free it
    try:
        first = LLM(default_loaded, max_num_seqs=2, num_pages=16, max_model_len=128)
        first.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # compiled steps: closures, cycles
        gone = weakref.ref(first.engine.runner)  # its compiled steps close over it
        del first
        assert gone() is not None  # cycles: not freed by reference counting alone
        LLM(default_loaded, max_num_seqs=2, num_pages=16, max_model_len=128)
        assert gone() is None
    finally:
        gc.enable()


def test_memory_maps_near_the_limit_warn(caplog):
    """Past vm.max_map_count a compile crashes the process (XLA:CPU keeps ~350 mappings per compiled step): the
    engine warns after warm-up when the process holds most of them."""
    from jaxserve.engine.llm_engine import warn_memory_maps

    used = warn_memory_maps()
    assert used is not None and used > 100  # this process maps its libraries at least
    with caplog.at_level("WARNING", logger="jaxserve.engine.llm_engine"):
        warn_memory_maps(share=0.0)  # any use is over a share of 0
    assert any("vm.max_map_count" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxserve.engine.llm_engine"):
        warn_memory_maps(share=1.0)
    assert not caplog.records
