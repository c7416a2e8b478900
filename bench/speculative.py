"""Speculative decoding (n-gram prompt lookup) against plain decoding, one stream at a time, on the default model.

Two workloads of chat prompts, greedy, up to --output-len tokens each: input-grounded (edit, rewrite or continue a
text or code the prompt holds: what prompt lookup is for) and free-form (stories, explanations: little to copy).
Each prompt runs on a plain engine and on a speculative one (same loaded weights, warmed up), alternating, in one
invocation; reported per workload: output tokens/s of each, the ratio, steps per token, the acceptance rate
(accepted / proposed) and whether every output is identical (it must be).

    python bench/speculative.py [--output-len 256] [--k 3] [--lookup-max 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CODE = """def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result


def normalize(values):
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(v - low) / (high - low) for v in values]
"""
TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library by ten percent and to delay the renovation of the town hall "
    "until the spring. The mayor thanked the volunteers who had organized the summer festival, which raised "
    "more money than any festival before it."
)

GROUNDED = [
    f"Add type hints to this Python code and return the whole code:\n\n{CODE}",
    f"Rename the function moving_average to rolling_mean in this code and return all of it:\n\n{CODE}",
    f"Rewrite this paragraph, changing Tuesday to Thursday and keeping everything else:\n\n{TEXT}",
    f"Repeat the following text word for word:\n\n{TEXT}",
    f"Add a docstring to each function and return the full code:\n\n{CODE}",
    f"Convert this paragraph into a bulleted list of its facts:\n\n{TEXT}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system.",
    "Describe a day in the life of a medieval blacksmith.",
    "What are the pros and cons of working from home?",
    "Write a poem about autumn rain.",
    "Give advice to someone learning to cook for the first time.",
]


def run(llm, prompts, params) -> tuple[float, list, dict]:
    s0 = llm.engine.get_stats()
    t = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one stream at a time
    elapsed = time.perf_counter() - t
    s1 = llm.engine.get_stats()
    return elapsed, outs, {k: s1[k] - s0[k] for k in ("num_steps", "spec_draft_tokens", "spec_accepted_tokens")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.loading import load_model

    loaded = load_model(None, args.dtype or "float32")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024, num_pages=96)
    plain = LLM(loaded, **kw)
    spec = LLM(
        loaded,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max},
        **kw,
    )
    chat = lambda text: plain.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    for llm in (plain, spec):  # compile every shape these prompts use, unmeasured
        llm.generate(
            [chat(GROUNDED[0]), chat(FREE[0])],
            SamplingParams(temperature=0.0, max_tokens=args.output_len),
            use_tqdm=False,
        )
    print(
        f"# speculative decoding, n-gram k={args.k} lookup_max={args.lookup_max}; {platform.node()}, "
        f"{os.cpu_count()} CPUs; one stream, greedy, up to {args.output_len} tokens",
        flush=True,
    )
    print(
        "| workload | plain tok/s | spec tok/s | spec / plain | steps per token (plain, spec) | acceptance | "
        "identical |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, texts in (("input-grounded", GROUNDED), ("free-form", FREE)):
        prompts = [chat(t) for t in texts]
        times = {"plain": 0.0, "spec": 0.0}
        stats = {"plain": {}, "spec": {}}
        tokens, identical = 0, True
        for _ in range(args.rounds):
            tp, outs_p, sp = run(plain, prompts, params)
            ts, outs_s, ss = run(spec, prompts, params)
            times["plain"] += tp
            times["spec"] += ts
            for key, st in (("plain", sp), ("spec", ss)):
                for k, v in st.items():
                    stats[key][k] = stats[key].get(k, 0) + v
            tokens += sum(len(o.outputs[0].token_ids) for o in outs_p)
            identical &= all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs_p, outs_s))
        rate_p, rate_s = tokens / times["plain"], tokens / times["spec"]
        accept = stats["spec"]["spec_accepted_tokens"] / max(stats["spec"]["spec_draft_tokens"], 1)
        print(
            f"| {name} | {rate_p:.1f} | {rate_s:.1f} | {rate_s / rate_p:.2f}x | "
            f"{stats['plain']['num_steps'] / tokens:.2f}, {stats['spec']['num_steps'] / tokens:.2f} | "
            f"{accept:.0%} of {stats['spec']['spec_draft_tokens']} | {identical} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
