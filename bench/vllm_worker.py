"""Runs vLLM's CPU build on bench/throughput.py's workload; started by it under bench/.venv-vllm's Python.

    bench/.venv-vllm/bin/python bench/vllm_worker.py JOB.json   # prints VLLM_RESULT {json}

JOB.json: {"model": HF dir, "dtype": "float32" | "bfloat16", "prompts": [[token ids], ...], "output_len": N,
"single_len": M, "decode_prompt_len": D, "max_num_batched_tokens": B, "kv_cache_gib": G}. It generates every
prompt at once (offline throughput, greedy, ignore_eos), then one request of ``single_len`` tokens alone from the
first prompt and from its first D tokens (decode tokens/s), each after an untimed warm-up of the same shape.
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULT = "VLLM_RESULT"  # vLLM logs to stdout too: the result line starts with this (bench/throughput.py looks for it)


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    t = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=1024,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=job["max_num_batched_tokens"],
        seed=0,
    )
    load = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(x) == job["output_len"] for x in tokens)
    one = SamplingParams(temperature=0.0, max_tokens=job["single_len"], ignore_eos=True)
    short = TokensPrompt(prompt_token_ids=job["prompts"][0][: job.get("decode_prompt_len", 16)])
    result = {"elapsed": elapsed, "load_s": load, "tokens": tokens, "version": __import__("vllm").__version__}
    for key, prompt in (("single_s", prompts[0]), ("decode_s", short)):
        llm.generate([prompt], one, use_tqdm=False)
        times = []
        for _ in range(3):  # the median of 3, as bench/throughput.py times jaxserve
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            times.append(time.perf_counter() - t)
        result[key] = sorted(times)[1]
    print(RESULT, json.dumps(result))


if __name__ == "__main__":
    main()
