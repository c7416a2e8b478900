"""A step's host arrays go to the device as one buffer (``jaxserve.runner.host_pack``), bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.host_pack import Packed, pack, unpack


def _tree():
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, :3] = [np.nan, -np.inf, -0.0]
    return {
        "tokens": rng.integers(-(2**31), 2**31 - 1, 7, dtype=np.int32),
        "seed": np.array([[0xFFFFFFFF, 0x80000001], [1, 0]], np.uint32),  # past int32's range: bits, not values
        "floats": floats,
        "flags": np.array([True, False, True]),
        "small": np.array([-128, 5, 127], np.int8),
        "empty": np.zeros((0, 4), np.int32),
        "scalar": np.float32(2.5),
        "wide": np.arange(4, dtype=np.int64),  # narrowed as jnp.asarray would (x64 off)
        "placed": jnp.arange(6.0).reshape(2, 3),  # a device array: passed beside, not packed
    }


def test_unpack_inside_jit_gives_every_leaf_bit_for_bit():
    tree = _tree()
    packed = pack(tree)
    assert isinstance(packed.buffer, np.ndarray) and packed.buffer.dtype == np.int32
    assert packed.buffer.size == 7 + 4 + 15 + 3 + 3 + 0 + 1 + 4 and len(packed.on_device) == 1
    got = jax.jit(unpack)(packed)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    for name, want in tree.items():
        want = np.asarray(jnp.asarray(want))  # the dtype jit would have given the array passed alone
        have = np.asarray(got[name])
        assert have.dtype == want.dtype and have.shape == want.shape, name
        np.testing.assert_array_equal(have.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8), err_msg=name)


def test_layout_is_static_and_a_new_shape_retraces():
    traces = []

    @jax.jit
    def total(p):
        traces.append(1)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(unpack(p)))

    a = {"x": np.ones(3, np.int32), "y": np.full(2, 0.5, np.float32)}
    assert float(total(pack(a))) == 4.0
    assert float(total(pack({"x": np.full(3, 2, np.int32), "y": np.zeros(2, np.float32)}))) == 6.0
    assert len(traces) == 1  # same layout: one trace
    total(pack({"x": np.ones(4, np.int32), "y": np.zeros(2, np.float32)}))
    assert len(traces) == 2


def test_a_64_bit_array_that_cannot_narrow_is_refused():
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match="int64 host array"):
            pack({"x": np.arange(3, dtype=np.int64)})


def test_packed_steps_upload_one_host_array_and_give_the_same_outputs(default_loaded):
    """As on a GPU or a TPU (``pack_host``), the engine's steps (greedy, sampled, prompt logprobs) pass the jitted step
    exactly one numpy array, and give the same tokens, logprobs and prompt logprobs as the CPU's unpacked steps."""
    from helpers import first_layers

    from jaxserve import LLM
    from jaxserve.core.sampling_params import SamplingParams

    llm = LLM(
        first_layers(default_loaded, 2), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_pages=40
    )
    runner = llm.engine.runner
    assert not runner.pack_host  # the CPU's steps take their arrays as they are
    prompts = ["Hello there", "One two three four"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=1, prompt_logprobs=1),
    ]
    want = llm.generate(prompts, params, use_tqdm=False)

    compiler, seen = runner.compiler, []
    original = compiler.step

    def counting(decode_only):
        fn = original(decode_only)

        def call(*args):
            seen.append(sum(isinstance(x, np.ndarray | np.generic) for x in jax.tree.leaves(args)))
            assert isinstance(args[4], Packed)
            return fn(*args)

        return call

    compiler.step, runner.pack_host = counting, True
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del compiler.step
    assert len(seen) >= 4 and set(seen) == {1}, seen
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
        assert g.prompt_logprobs == w.prompt_logprobs
    assert got[1].prompt_logprobs and got[0].outputs[0].logprobs
