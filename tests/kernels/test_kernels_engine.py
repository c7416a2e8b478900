"""End to end: the engine on the default model with the Pallas kernels (interpret mode on the CPU: the GPU's, and
the TPU's over the TPU's pool layout) gives the same greedy tokens as with the jnp reference."""

import pytest
from helpers import first_layers

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_pallas_interpret_matches_reference(default_loaded):
    """Engine mechanics (each implementation's pool layout, page tables and K/V writes through the engine's steps)
    against the same engine with the jnp reference attention: on the default model's first two layers
    (``helpers.first_layers``: real tokens, a fifteenth of the interpreted kernels' blocks a step). The kernels'
    numerics against the reference are tests/kernels/test_kernels.py's."""
    model = first_layers(default_loaded)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    outs = {}
    for impl in ("reference", "pallas", "pallas-tpu"):  # pallas-tpu: the TPU kernels over the TPU's pool layout
        llm = LLM(
            model,
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


def test_without_the_cpp_kernels_a_long_context_decodes_in_place(default_loaded, hf_default, monkeypatch):
    """The CPU path a user meets where the C++ kernels did not build: the XLA attention and the reference K/V
    scatter. A 320-token prompt decodes HF transformers' greedy tokens (teacher-forced, exact), and the compiled
    decode step writes the donated pool in place: no pool-sized copy in its program (there
    were 8 a layer, a step at 300 tokens took 72-98 s on the default 5,120 pages). Only the step variants of the
    buckets traffic touched are compiled."""
    from helpers import hf_greedy_choices, sized_copies
    from jaxserve.kernels.cpu import ffi

    monkeypatch.setattr(ffi, "available", lambda: False)
    llm = LLM(default_loaded, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, num_pages=512)
    runner = llm.engine.runner
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun".split()
    ids = llm.tokenizer.encode(" ".join(words[i % len(words)] for i in range(300)))[:320]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == hf_greedy_choices(hf_default, ids, tokens)
    grid = len(runner.token_buckets) * len(runner.page_buckets) * 2  # (tokens, pages, decode-only) variants
    assert 0 < runner.compiler.num_compilations <= grid

    pages = runner.page_buckets[-1]
    hlo = runner.compiler.lower_step(1, pages, True).compile().as_text()
    copies = sized_copies(hlo, runner.k_cache.shape)
    assert not copies, f"{len(copies)} pool-sized copies in the decode step: {copies}"
