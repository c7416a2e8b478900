"""The CPU's decode step by context length with the C++ kernels and without them (the XLA path a CPU takes where
the kernels did not build), on the default model and its default 5,120-page pool, in one invocation.

    python bench/cpu_fallback.py [--contexts 40 120 300 1000]

Each setting runs in a subprocess (``JAXSERVE_CPU_KERNELS=0`` or not). Per context: one request's prompt of about
that many tokens, generated once to compile, then 2 and 18 greedy tokens from fresh prompts (no prefix-cache hit);
a decode step is the difference over 16 steps. Prints ms per decode step and the ratio off / on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(contexts: list[int]) -> dict[int, float]:
    from jaxserve import LLM, SamplingParams

    llm = LLM()
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    out = {}
    for ctx in contexts:
        prompt = " ".join(["word"] * ctx)
        llm.generate([prompt], greedy(20), use_tqdm=False)  # compiles every bucket this length touches
        took = {}
        for n in (2, 18):
            prompt = f"n{n} " + prompt  # a new first token: no prefix-cache hit
            start = time.perf_counter()
            llm.generate([prompt], greedy(n), use_tqdm=False)
            took[n] = time.perf_counter() - start
        out[ctx] = (took[18] - took[2]) / 16 * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[40, 120, 300, 1000])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.contexts)))
        return
    rows = {}
    for name, kernels in (("kernels", "1"), ("off", "0")):
        cmd = [sys.executable, "-P", __file__, "--child", "--contexts", *map(str, args.contexts)]
        env = dict(os.environ, JAXSERVE_CPU_KERNELS=kernels)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        rows[name] = {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    print("| context tokens | C++ kernels, ms a decode step | XLA path (kernels off), ms | off / on |")
    print("|---|---|---|---|")
    for ctx in args.contexts:
        on, off = rows["kernels"][ctx], rows["off"][ctx]
        print(f"| {ctx} | {on:.1f} | {off:.1f} | {off / on:.2f}x |")


if __name__ == "__main__":
    main()
