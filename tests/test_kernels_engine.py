"""End to end: the engine on the default model with the Pallas kernels (interpret mode on the CPU: the GPU's, and
the TPU's over the TPU's pool layout) gives the same greedy tokens as with the jnp reference."""

import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_pallas_interpret_matches_reference(default_loaded):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    outs = {}
    for impl in ("reference", "pallas", "pallas-tpu"):  # pallas-tpu: the TPU kernels over the TPU's pool layout
        llm = LLM(
            default_loaded,
            attention_impl=impl,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=64,
            num_pages=24,
        )
        if impl == "pallas-tpu":
            assert llm.engine.runner.pool.layout == "heads_tokens" and llm.engine.runner.k_cache.shape[2:4] == (3, 16)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["pallas"] == outs["reference"] == outs["pallas-tpu"]
