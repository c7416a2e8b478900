"""Tensor parallelism over a mesh of fake CPU devices (tests/conftest.py asks XLA for 8).

The reference is the same engine on one device: sharding must not change a single greedy token. Tiny random
models cover every degree (including more devices than KV heads, where KV heads are replicated); the default
model covers TP 3 (9 query heads, 3 KV heads). The compiled step's HLO is checked for the collectives Megatron-style
tensor parallelism needs and for the absence of any gather of the KV pool.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.loading import LoadedModel
from jaxserve.models.schema import param_schema
from jaxserve.parallel.sharding import DEFAULT_RULES, logical_spec, make_mesh
from jaxserve.runner.kv_pool import KV_POOL_SPEC

pytestmark = pytest.mark.multidevice  # meshes of up to 8 fake CPU devices

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(num_pages=64, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64)


def _tiny(tokenizer_path, num_heads=8, num_kv_heads=2, **cfg) -> LoadedModel:
    return tiny_model(tokenizer_path, num_heads, num_kv_heads, intermediate_size=128, **cfg)


def _prompts(n=5, seed=0):
    rng = np.random.default_rng(seed)  # lengths around the 64-token budget: chunked prefill and mixed steps
    return [rng.integers(3, 49000, size=int(k)).tolist() for k in rng.integers(2, 150, size=n)]


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.fixture(scope="module")
def tiny(default_loaded):
    return _tiny(default_loaded.tokenizer_path, attention_bias=True)


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    return _generate(LLM(tiny, **ENGINE), _prompts(), params)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_tokens_equal_one_device(tiny, tiny_reference, tp):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    llm = LLM(tiny, tensor_parallel_size=tp, **ENGINE)
    tokens, logprobs = _generate(llm, _prompts(), params)
    assert tokens == tiny_reference[0]
    got = [[next(iter(d.values())).logprob for d in row] for row in logprobs]
    want = [[next(iter(d.values())).logprob for d in row] for row in tiny_reference[1]]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-4)  # float32, summed in another order
    # More devices than the model's 2 KV heads: each device holds one (replicated) head.
    assert llm.engine.runner.cfg.num_kv_heads == max(2, tp)


def _per_device_bytes(x: jax.Array) -> set[int]:
    return {s.data.nbytes for s in x.addressable_shards}


def test_weights_and_pool_are_sharded(tiny):
    tp = 4
    runner = LLM(tiny, tensor_parallel_size=tp, **ENGINE).engine.runner
    schema = param_schema(runner.cfg)
    params = nnx.to_pure_dict(runner.state)
    assert set(params) == set(schema)
    for name, spec in schema.items():
        arr, split = params[name], any(DEFAULT_RULES[a] == "model" for a in spec.axes)
        assert len(arr.sharding.device_set) == tp, name
        assert _per_device_bytes(arr) == {arr.nbytes // tp if split else arr.nbytes}, name
    # wq is column-parallel, wo row-parallel, embed split over the vocabulary, norms whole on every device.
    assert params["wq"].sharding.spec == P(None, None, "model")
    assert params["wo"].sharding.spec == P(None, "model", None)
    assert params["embed"].sharding.spec == P("model", None)
    assert params["attn_norm"].sharding.spec == P(None, None)
    for cache in (runner.k_cache, runner.v_cache):
        assert cache.sharding.spec == KV_POOL_SPEC
        assert _per_device_bytes(cache) == {cache.nbytes // tp}


def test_default_model_tp3_equals_one_device(default_loaded, default_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours: red,"]
    want = _generate(default_llm, prompts)[0]
    llm = LLM(default_loaded, tensor_parallel_size=3, **ENGINE)
    assert _generate(llm, prompts)[0] == want
    runner = llm.engine.runner
    assert runner.cfg.num_kv_heads == 3 and _per_device_bytes(runner.k_cache) == {runner.k_cache.nbytes // 3}

    # The compiled step: per layer one all-reduce after attention and one after the MLP (both [T, D], inside the
    # layer loop) and one for the vocabulary-parallel embedding lookup. The logits stay in their vocabulary shards:
    # the greedy step moves nothing else but [rows] values; the full one gathers each shard's top candidates
    # ([rows, k]) and, on this CPU only, [rows, V] for the top-k (XLA:CPU does not partition it; XLA:TPU and XLA:GPU
    # do: tests/test_aot.py). Nothing moves the KV pool.
    d, v = default_loaded.config.hidden_size, default_loaded.config.vocab_size
    for variant in ("greedy", "full"):
        hlo = runner.compiler.lower_step(16, 8, variant=variant).compile().as_text()
        collectives = re.findall(
            r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo
        )
        wide = [shape for shape, _ in collectives if re.fullmatch(rf"[fs]32\[16,{d}\]\{{1,0\}}", shape)]
        assert wide == [f"f32[16,{d}]{{1,0}}"] * 3, collectives
        small = lambda shape: re.fullmatch(r"[fs]32\[\d+(,\d{1,2})?\]\{[01,]+\}", shape)  # noqa: E731
        logits = [(shape, op) for shape, op in collectives if shape not in wide and not small(shape)]
        assert all(op == "all-gather" and re.fullmatch(rf"f32\[\d+,{v}\]\{{0,1\}}", s) for s, op in logits), logits
        assert variant == "full" or not logits, collectives
    assert {op for _, op in collectives} == {"all-reduce", "all-gather"}, collectives


def test_steady_state_does_not_recompile_under_tp(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, **ENGINE)
    llm.engine.runner.warmup()
    before = llm.engine.runner.num_compilations
    _generate(llm, _prompts(8, seed=1))
    assert llm.engine.runner.num_compilations == before


def test_bad_degrees_are_clear_errors(tiny, default_loaded):
    with pytest.raises(ValueError, match="needs 16 devices, but 8"):
        LLM(tiny, tensor_parallel_size=16, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 8 attention heads"):
        LLM(tiny, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="6 and the model's 4 KV heads must divide one another"):
        LLM(_tiny(default_loaded.tokenizer_path, num_heads=12, num_kv_heads=4), tensor_parallel_size=6, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(TypeError, match="unknown engine setting"):
        LLM(tiny, tensor_paralel_size=2)


def test_logical_rules_name_the_parameter():
    mesh = make_mesh(4)
    assert logical_spec("w", (8, 12), ("embed", "mlp"), mesh) == P(None, "model")
    with pytest.raises(ValueError, match=r"parameter 'w_up': dimension 1 \(mlp, size 10\) does not divide"):
        logical_spec("w_up", (8, 10), ("embed", "mlp"), mesh)
    with pytest.raises(ValueError, match="parameter 'x': logical axes 'vocab' and 'mlp' both map to mesh axis"):
        logical_spec("x", (8, 8), ("vocab", "mlp"), mesh)
    with pytest.raises(ValueError, match="parameter 'y': logical axis 'stage' has no sharding rule"):
        logical_spec("y", (8,), ("stage",), mesh)


def test_orbax_restores_shards_onto_another_mesh(default_loaded, default_model_path, tmp_path):
    from jaxserve.loading import load_model, orbax_ckpt
    from jaxserve.parallel.sharding import checkpoint_shardings

    tiny = _tiny(default_loaded.tokenizer_path, num_heads=8, num_kv_heads=4)
    written = LLM(tiny, tensor_parallel_size=2, **ENGINE)  # the checkpoint is written from arrays split 2 ways
    orbax_ckpt.save(tmp_path, tiny.config, nnx.to_pure_dict(written.engine.runner.state), "float32")
    orbax_ckpt.copy_tokenizer(default_model_path, tmp_path)
    on_devices = load_model(tmp_path, "float32", shardings=lambda cfg: checkpoint_shardings(cfg, make_mesh(4)))
    assert on_devices.params["wq"].sharding.spec == P(None, None, "model")  # restored straight onto 4 devices
    # Restored 8 ways: 8 devices, 4 KV heads, so the KV projections come whole and their heads are repeated.
    restored = LLM(str(tmp_path), tensor_parallel_size=8, **ENGINE)
    got = nnx.to_pure_dict(restored.engine.runner.state)
    for name, want in tiny.params.items():
        arr = got[name]
        assert len(arr.sharding.device_set) == 8, name
        if name in ("wk", "wv"):
            want = np.repeat(want.reshape(2, 64, 4, 16), 2, axis=2).reshape(2, 64, 128)
        np.testing.assert_array_equal(np.asarray(arr), want, err_msg=name)
    assert _generate(restored, _prompts(3))[0] == _generate(LLM(tiny, **ENGINE), _prompts(3))[0]


def test_data_parallel_replicas_equal_one_device(tiny, tiny_reference):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    for tp, dp in ((1, 2), (2, 2)):
        llm = LLM(tiny, tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE)
        assert _generate(llm, _prompts(), params)[0] == tiny_reference[0], (tp, dp)
        replicas = llm.engine.replicas
        assert len(replicas) == dp
        devices = [r.runner.k_cache.sharding.device_set for r in replicas]
        assert all(len(d) == tp for d in devices) and not set.intersection(*devices)  # disjoint sub-meshes
        # Balanced: each replica computed a share of the 5 prompts.
        assert all(r.runner.num_tokens_computed > 0 for r in replicas)
        assert llm.engine.get_stats()["num_used_pages"] == 0  # every replica freed its pages


def test_data_parallel_steady_state_does_not_recompile(tiny):
    llm = LLM(tiny, data_parallel_size=2, **ENGINE)
    assert all(r.runner.token_buckets[0] == 8 for r in llm.engine.replicas)  # one-token buckets: one engine only
    llm.engine.warmup()
    before = llm.engine.get_stats()["num_compilations"]
    _generate(llm, _prompts(8, seed=2))
    assert llm.engine.get_stats()["num_compilations"] == before


def test_gguf_loads_tensor_by_tensor_onto_the_mesh(default_model_path, default_loaded):
    from jaxserve.loading import load_model
    from jaxserve.parallel.sharding import checkpoint_shardings

    mesh = make_mesh(3)
    loaded = load_model(default_model_path, "float32", shardings=lambda cfg: checkpoint_shardings(cfg, mesh))
    assert set(loaded.params) == set(default_loaded.params)
    for name, want in default_loaded.params.items():
        got = loaded.params[name]
        assert isinstance(got, jax.Array) and len(got.sharding.device_set) == 3, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    assert loaded.params["w_down"].sharding.spec == P(None, "model", None)
