"""Pipeline parallelism through the engine on the fake CPU devices of conftest.py: the layer stacks and the KV pool
split over stages (``pipeline.PipelineTick``), against the same model on one device (greedy tokens identical,
logprobs within 1e-5), the bytes each device holds, no recompiles in steady state, and the bad degrees."""

from __future__ import annotations

import pytest
from helpers import DEFAULT_ENGINE, assert_same_completions, tiny_model

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.multidevice  # stages over up to 5 fake CPU devices

ENGINE = dict(num_pages=64, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 11)]  # one over the 32-token budget: chunked prefill


@pytest.fixture(scope="module")
def tiny(default_model_path):
    """A random model of 30 layers (2, 3 and 5 stages divide it) and its tokens on one device."""
    model = tiny_model(default_model_path, num_layers=30)
    return model, LLM(model, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)


def _same_outputs(got, want, atol=1e-5):
    assert_same_completions([o.outputs[0] for o in got], [o.outputs[0] for o in want], atol)


@pytest.mark.parametrize(("pp", "tp", "dp"), [(2, 1, 1), (3, 1, 1), (5, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_stages_give_one_devices_tokens_and_hold_only_their_layers(tiny, pp, tp, dp):
    model, want = tiny
    llm = LLM(model, pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE)
    for replica in llm.engine.replicas:
        runner = replica.runner
        assert dict(runner.mesh.shape) == {"stage": pp, "data": 1, "model": tp}
        for name in ("wq", "w_down", "attn_norm"):  # a layer stack: 30 / pp layers on each device
            w = runner.state[name].get_value()
            assert w.sharding.spec[0] == "stage" and w.addressable_shards[0].data.shape[0] == 30 // pp, name
        wq = runner.state["wq"].get_value()
        assert wq.addressable_shards[0].data.nbytes * pp * tp == wq.nbytes
        for pool in (runner.k_cache, runner.v_cache):  # the pool: each stage its layers' pages
            assert pool.addressable_shards[0].data.shape[0] == 30 // pp and pool.shape[0] == 30
    _same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
    compiled = llm.engine.runner.num_compilations
    llm.generate([p[::-1] for p in PROMPTS], GREEDY, use_tqdm=False)  # steady state: the same buckets
    assert llm.engine.runner.num_compilations == compiled


def test_a_batch_in_flight_on_every_stage(tiny):
    """PP 2, two sequences a step, four requests of 8 tokens: two batches in flight, one in each stage at every
    tick. 16 steps take 17 ticks (N + S - 1: the last one drains the pipeline); one batch of all four takes 2 ticks
    a step (the bubble: 8 steps, 16 ticks). Tokens: one device's either way."""
    model, _ = tiny
    prompts = [[5 + i, 9, 2 * i + 1] for i in range(4)]
    want = LLM(model, **ENGINE).generate(prompts, GREEDY, use_tqdm=False)
    for seqs, steps, ticks in ((2, 16, 17), (4, 8, 16)):
        llm = LLM(model, pipeline_parallel_size=2, **{**ENGINE, "max_num_seqs": seqs})
        _same_outputs(llm.generate(prompts, GREEDY, use_tqdm=False), want)
        runner = llm.engine.runner
        assert (runner.num_steps, runner.num_ticks) == (steps, ticks), seqs


def test_default_model_over_two_stages(default_loaded, default_llm):
    """SmolLM2-135M's 30 layers over 2 stages: the single device's tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    want = default_llm.generate(prompts, sp, use_tqdm=False)
    got = LLM(default_loaded, pipeline_parallel_size=2, **DEFAULT_ENGINE).generate(prompts, sp, use_tqdm=False)
    _same_outputs(got, want, atol=1e-4)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(pipeline_parallel_size=7), r"pipeline_parallel_size=7 exceeds the model's 6 layers"),
        (dict(pipeline_parallel_size=4), r"pipeline_parallel_size=4 must divide the model's 6 layers"),
        (
            dict(pipeline_parallel_size=3, tensor_parallel_size=4),
            r"tensor_parallel_size=4 x data_parallel_size=1 x pipeline_parallel_size=3 needs 12 devices",
        ),
        (dict(pipeline_parallel_size=0), r"pipeline_parallel_size must be a positive int"),
        (  # XLA:CPU aborts on this program: refused, not crashed
            dict(pipeline_parallel_size=2, dtype="bfloat16"),
            r"on the CPU runs float32 weights \(got dtype='bfloat16'\)",
        ),
    ],
)
def test_bad_degrees_are_refused_before_loading(default_model_path, settings, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model(default_model_path, num_layers=6), **{**ENGINE, **settings})
