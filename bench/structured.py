"""Structured outputs: what a grammar costs, on the default model.

1. Offline throughput: N requests (default 64; prompts of 64-512 tokens), greedy, up to 128 output tokens, once
   with no constraint and once with half of the requests under a JSON schema (a list of at least 12 short records:
   longer than max_tokens, so constrained requests generate as many tokens as the others). Runs alternate (plain,
   constrained, plain, constrained) on one warmed-up engine; the figure of merit is output tokens/s, since a
   grammar may end a request early. Also reports the host time spent filling the token masks.
2. Grammar compile time per schema (the ten schemas of tests/sampling/test_structured.py): cold (first compile) and
   cached, and the one-off build of the grammar engine's tokenizer.

    python bench/structured.py [--num-requests 64] [--output-len 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.throughput import make_workload  # noqa: E402

RECORDS = {
    "type": "array",
    "minItems": 12,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "city", "age"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "city": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling.structured import StructuredOutputs

    llm = LLM(None, max_num_seqs=args.num_requests, max_num_batched_tokens=512, max_model_len=1024)
    engine = llm.engine
    prompts = make_workload(llm.tokenizer, args.num_requests, 64, 512)
    compiled = engine.warmup()
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    json_params = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_outputs={"json": RECORDS})
    mixed = [json_params if i % 2 else plain for i in range(len(prompts))]
    engine.structured.compile(json_params.structured_outputs)  # the grammar compile is measured below

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # first-run costs, unmeasured
    results: dict[str, list[dict]] = {"plain": [], "half constrained": []}
    for _ in range(args.rounds):
        for name, params in (("plain", plain), ("half constrained", mixed)):
            fill0 = engine.structured.fill_seconds
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results[name].append(
                {
                    "elapsed": elapsed,
                    "tokens": tokens,
                    "tok_s": tokens / elapsed,
                    "fill_s": engine.structured.fill_seconds - fill0,
                }
            )
    recompiles = engine.runner.num_compilations - compiled

    print(f"\n## Structured outputs ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs)\n")
    print(
        f"`python bench/structured.py --num-requests {args.num_requests} --output-len {args.output_len} "
        f"--rounds {args.rounds}`; {recompiles} compiles after warm-up\n"
    )
    print("| run | output tokens | time (s) | output tok/s | mask fill (s) |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        for r in rs:
            print(f"| {name} | {r['tokens']} | {r['elapsed']:.1f} | {r['tok_s']:.1f} | {r['fill_s']:.2f} |")
    best = {name: max(r["tok_s"] for r in rs) for name, rs in results.items()}
    med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in results.items()}
    print(
        f"\nhalf constrained / plain, output tok/s: best {best['half constrained'] / best['plain']:.3f}, "
        f"median {med['half constrained'] / med['plain']:.3f}"
    )

    from tests.test_structured import SCHEMAS  # the ten schemas the tests validate against

    t = time.perf_counter()
    fresh = StructuredOutputs(llm.tokenizer.to_json(), engine.model_config.vocab_size, engine.eos_token_ids)
    fresh._tokenizer  # noqa: B018 - built on first use; timed apart
    build = time.perf_counter() - t
    from jaxserve.core.sampling_params import StructuredOutputsParams

    cold, cached = [], []
    for schema in SCHEMAS:
        so = StructuredOutputsParams(json=schema)
        t = time.perf_counter()
        fresh.matchers(so)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        fresh.matchers(so)
        cached.append(time.perf_counter() - t)
    print(
        f"\ngrammar engine tokenizer (once per engine): {build * 1e3:.0f} ms; per schema (10 schemas): cold "
        f"median {statistics.median(cold) * 1e3:.2f} ms (max {max(cold) * 1e3:.2f}), cached median "
        f"{statistics.median(cached) * 1e6:.0f} us (max {max(cached) * 1e6:.0f})"
    )


if __name__ == "__main__":
    main()
