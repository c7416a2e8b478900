"""The embedded default model (SmolLM2-135M-Instruct, Q4_1) against HF transformers loading the same GGUF.

Greedy continuations of 32 tokens must be token-identical and the chosen tokens' logprobs must agree within
1e-2 (both sides dequantize the same Q4_1/Q8_0 blocks to float32 and compute in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import hf_greedy

from jaxserve import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The first ten prime numbers are 2, 3, 5,",
    "12 * 12 = 144. 13 * 13 =",
    "La capitale de l'Allemagne est",
    "東京は日本の",
    "My favourite emojis are 🎉 and",
    "Once upon a time, in a small village,",
    "SELECT name, age FROM users WHERE",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 32


def test_greedy_matches_hf_token_for_token(default_llm, hf_default):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = default_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        assert ids == default_llm.tokenizer.encode(prompt)
        ref_tokens, ref_lps = hf_greedy(hf_default, ids, MAX_TOKENS, logprobs=True)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {prompt!r}: {got.text!r}"
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(ours, ref_lps, atol=1e-2)


def test_chat_knows_the_capital_of_france(default_llm):
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=48),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_prompt_logprobs_match_hf(default_llm, hf_default):
    import torch

    prompt = "The quick brown fox jumps over the lazy dog because it was"
    out = default_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_default(torch.tensor([ids])).logits[0].float(), -1).numpy()
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        assert ids[pos] in plp[pos]
        np.testing.assert_allclose(plp[pos][ids[pos]].logprob, ref[pos - 1, ids[pos]], atol=1e-2)
        top3 = set(np.argsort(-ref[pos - 1])[:3].tolist())
        assert top3 <= set(plp[pos])
