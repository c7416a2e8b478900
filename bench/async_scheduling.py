"""Async scheduling against steps one after the other, on the default model: where a step's wall time goes.

One engine per mode (``async_scheduling`` False / True, same loaded weights, warmed up), alternating in one
invocation. Workloads: one request decoding (a chat prompt, --output-len greedy tokens, ignore_eos) and a batch of
--batch requests at once. Reported per mode and workload: output tokens/s (median of --rounds), wall time per step,
and for the synchronous engine the device's share (``runner.device_seconds``: from handing the step to the device
to its results on the host) and the host's (the rest: scheduling, packing, detokenizing, stop checks). The goal of
async scheduling is the async engine's wall time per step within 10% of the synchronous one's device time; outputs
must be identical.

    python bench/async_scheduling.py [--output-len 128] [--rounds 5] [--batch 16] [--matmul-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def run(llm, prompts, params) -> tuple[float, int, float, list]:
    """(seconds, device steps, device seconds, outputs) of one generate call."""
    runner = llm.engine.runner
    steps, device = runner.num_steps, runner.device_seconds
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, runner.num_steps - steps, runner.device_seconds - device, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--matmul-dtype", default=None)
    args = ap.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.loading import load_model

    loaded = load_model(None, "float32")
    kw = dict(max_num_seqs=max(8, args.batch), max_model_len=1024, num_pages=256, matmul_dtype=args.matmul_dtype)
    engines = {mode: LLM(loaded, async_scheduling=mode, **kw) for mode in (False, True)}
    chat = lambda text: engines[False].tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    one = [chat("Tell me a long story about a lighthouse keeper and a storm.")]
    many = [chat(f"Write a short poem about the number {i}.") for i in range(args.batch)]
    for llm in engines.values():  # compile what these prompts use, unmeasured
        for prompts in (one, many):
            llm.generate(prompts, params, use_tqdm=False)
    print(
        f"# async scheduling; {platform.node()}, {os.cpu_count()} CPUs; greedy, {args.output_len} tokens per "
        f"request, matmul_dtype={args.matmul_dtype}; medians of {args.rounds} rounds",
        flush=True,
    )
    print("| workload | mode | tok/s | ms per step | device ms per step | host ms per step | identical |")
    print("|---|---|---|---|---|---|---|")
    for name, prompts in (("one request", one), (f"{args.batch} requests", many)):
        times = {m: [] for m in engines}
        per_step = {m: [] for m in engines}
        device = {m: [] for m in engines}
        outs = {}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                seconds, steps, dev, outs[mode] = run(llm, prompts, params)
                times[mode].append(seconds)
                per_step[mode].append(seconds / steps)
                device[mode].append(dev / steps)
        identical = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs[False], outs[True]))
        tokens = len(prompts) * args.output_len
        for mode in engines:
            wall, dev = statistics.median(per_step[mode]), statistics.median(device[mode])
            # Async: the device time is no longer separable (the host works while the device runs).
            dev_s, host_s = (f"{1e3 * dev:.2f}", f"{1e3 * (wall - dev):.2f}") if not mode else ("-", "-")
            print(
                f"| {name} | {'async' if mode else 'sync'} | {tokens / statistics.median(times[mode]):.1f} | "
                f"{1e3 * wall:.2f} | {dev_s} | {host_s} | {identical} |",
                flush=True,
            )
        sync_dev, async_wall = statistics.median(device[False]), statistics.median(per_step[True])
        print(f"| {name} | async wall / sync device | {async_wall / sync_dev:.3f} | | | | |", flush=True)


if __name__ == "__main__":
    main()
