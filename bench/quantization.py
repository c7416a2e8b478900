"""Quantized weights and KV pages on the default model: memory, fidelity and speed of each mode, in one invocation.

For float32, bfloat16 matmuls, int8, w8a8, int4 and gguf (the file's own Q4_1/Q8_0 blocks) weights, and float32
weights over bfloat16 / fp8 (e4m3, e5m2) / int8 (a float32 scale per token and KV head) KV pages:
- device bytes of the weights (live arrays) and of a KV page against float32;
- perplexity on a fixed English text (Python's ``pydoc_data.topics``, teacher-forced in 512-token chunks) and the
  share of positions whose most likely next token agrees with float32's;
- one request's decode tokens/s (128 tokens, greedy) and offline throughput (N requests of 64-256 tokens, 64
  output tokens each).

    python bench/quantization.py [--modes float32 bf16 int8 w8a8 int4 gguf kv-fp8_e4m3 ...] [--num-requests 32]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_quant import _score as score  # noqa: E402 - perplexity and top-1 under teacher forcing

from bench.throughput import make_workload  # noqa: E402

MODES = {
    "float32": {},
    "bf16": {"matmul_dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "int4": {"quantization": "int4"},
    "gguf": {"quantization": "gguf"},
    "kv-bf16": {"kv_cache_dtype": "bfloat16"},
    "kv-fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "kv-int8": {"kv_cache_dtype": "int8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--num-requests", type=int, default=32)
    args = ap.parse_args()

    from pydoc_data.topics import topics

    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.loading import load_model

    float_model = load_model(None, "float32")
    gguf_model = load_model(None, "float32", keep_quantized=True) if "gguf" in args.modes else None
    text = "\n\n".join(topics[k] for k in sorted(topics))[:40000]
    rows, base = [], None
    for mode in args.modes:
        llm = LLM(
            gguf_model if mode == "gguf" else float_model,
            max_model_len=1024,
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=512,
            num_pages=800,
            **MODES[mode],
        )
        llm.engine.warmup()
        nbytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
        page = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.k_cache)) // llm.engine.runner.num_pages
        ids = llm.tokenizer.encode(text)
        chunks = [ids[i : i + 512] for i in range(0, 6 * 512, 512)]
        ppl, top = score(llm, chunks)
        if base is None:
            base = (nbytes, ppl, top, page)
        one = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(["Write a long story about a lighthouse keeper."], one, use_tqdm=False)
        decode = 128 / (time.perf_counter() - t)
        prompts = make_workload(llm.tokenizer, args.num_requests, 64, 256)
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        offline = args.num_requests * 64 / (time.perf_counter() - t)
        rows.append(
            (
                mode,
                nbytes / base[0],
                page / base[3],
                ppl,
                ppl / base[1] - 1,
                float(np.mean(top == base[2])),
                decode,
                offline,
            )
        )
        print(rows[-1], flush=True)
        del llm

    print(f"\n## Quantized weights ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs)\n")
    print(f"`python bench/quantization.py --modes {' '.join(args.modes)} --num-requests {args.num_requests}`\n")
    print(
        "| mode | weight bytes vs float32 | KV page bytes vs float32 | perplexity | vs float32 "
        "| next-token agreement | one request decode tok/s | offline output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, b, kv, ppl, d, agree, decode, offline in rows:
        print(f"| {mode} | {b:.3f}x | {kv:.3f}x | {ppl:.3f} | {d:+.1%} | {agree:.1%} | {decode:.1f} | {offline:.1f} |")


if __name__ == "__main__":
    main()
