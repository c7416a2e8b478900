"""First numbers: load time, time to first token and decode tokens/s for one request, on the default
model, for jaxserve and HF transformers on the same prompt, in one run.

    python bench/first_numbers.py [--max-tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


def bench_jaxserve(prompt_ids: list[int], max_tokens: int, runs: int) -> dict:
    from jaxserve import LLMEngine, SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(None, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=1024, num_pages=80)
    load = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttfts, rates = [], []
    for run in range(runs + 1):  # run 0 compiles
        engine.add_request(f"r{run}", prompt_ids, params)
        t_start = time.perf_counter()
        t_first = None
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if t_first is None and n:
                    t_first = time.perf_counter()
        t_end = time.perf_counter()
        if run:
            ttfts.append(t_first - t_start)
            rates.append((n - 1) / (t_end - t_first))
    return {"load_s": load, "ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(rates)}


def bench_hf(prompt_ids: list[int], max_tokens: int, runs: int) -> dict:
    import torch
    import transformers

    from jaxserve.defaults import default_model_path

    path = default_model_path()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    load = time.perf_counter() - t0
    ids = torch.tensor([prompt_ids])
    ttfts, rates = [], []
    with torch.no_grad():
        for run in range(runs + 1):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            total = time.perf_counter() - t
            if run:
                ttfts.append(ttft)
                rates.append((max_tokens - 1) / max(total - ttft, 1e-9))
    return {"load_s": load, "ttft_s": statistics.median(ttfts), "decode_tok_s": statistics.median(rates)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from jaxserve.defaults import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    prompt = tok.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Write a short story about a lighthouse keeper "
                "who finds a message in a bottle. Describe the sea, the weather and the "
                "keeper's thoughts in detail.",
            }
        ],
        tokenize=True,
    )
    js = bench_jaxserve(prompt, args.max_tokens, args.runs)
    hf = bench_hf(prompt, args.max_tokens, args.runs)
    print(
        f"machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores; "
        f"prompt {len(prompt)} tokens, {args.max_tokens} new tokens, greedy, median of {args.runs}"
    )
    print("| metric | jaxserve | HF transformers | ratio (jaxserve/HF) |")
    print("|---|---|---|---|")
    for key, better in (("load_s", "lower"), ("ttft_s", "lower"), ("decode_tok_s", "higher")):
        ratio = js[key] / hf[key]
        print(f"| {key} ({better} is better) | {js[key]:.3f} | {hf[key]:.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
