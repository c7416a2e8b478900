"""One request's greedy decode speed on the default model, best of a few runs in this process.

Run it with two Pythons (two trees' installations) in turn, each in a fresh process, to compare them without the
in-process and subprocess difference of ``bench/throughput.py --baseline``:

    for i in 1 2 3; do for py in .venv/bin/python ../old/.venv/bin/python; do $py -P bench/one_request.py; done; done
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens generated a run")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    llm = LLM()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["Hello, my name is"], params, use_tqdm=False)  # compiles the buckets it needs
    best = 0.0
    for _ in range(args.runs):
        t0 = time.perf_counter()
        llm.generate(["The capital of France is"], params, use_tqdm=False)
        best = max(best, args.tokens / (time.perf_counter() - t0))
    import jaxserve

    print(f"{jaxserve.__file__}: best of {args.runs}: {best:.1f} tok/s ({args.tokens} tokens)", file=sys.stdout)


if __name__ == "__main__":
    main()
