"""Per-kernel device time of one decode-only step and one mixed step (prefill chunks beside decodes) of the engine,
from ``jax.profiler`` traces: the standing GPU check's profile (``bench/gpu_run.sh``).

The engine runs with synchronous scheduling (each step's results are read before the next is packed), so one traced
``engine.step()`` holds exactly that step's kernels. The mixed step: half the requests decoding when the other half
arrive; the decode step: once every prompt is in. For each, the kernels by device time (summed over a name: a layer's
kernel runs once per layer), their count, and the step's total. It runs anywhere: on the CPU its "kernels" are
XLA:CPU's thunks (a check of the script, not a measurement). Weights as ``bench/gpu_engine.py`` makes them.

    python bench/gpu_profile.py --tokenizer .gpu/tokenizer.gguf [--preset llama-3-8b --zeros-on-device] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import random_model, workload  # noqa: E402

_HOST_NOISE = ("end:", "ThreadpoolListener", "ThunkExecutor", "SlinkyThreadPool", "Await")


def kernel_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter, str]:
    """(microseconds by kernel name, launches by name, where they ran) from the newest perfetto trace under
    ``trace_dir``: a GPU's device tracks, else XLA:CPU's executor threads."""
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    devices = {pid for pid, name in procs.items() if name.startswith("/device:")}

    def counted(e) -> bool:
        if devices:
            return e["pid"] in devices
        thread = threads.get((e["pid"], e["tid"]), "")
        return thread.startswith("tf_XLA") and not e["name"].startswith(_HOST_NOISE)

    us, launches = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and counted(e):
            us[e["name"]] += e.get("dur", 0)
            launches[e["name"]] += 1
    return us, launches, ", ".join(procs[p] for p in devices) or "the host (XLA:CPU thunks)"


def traced_step(engine, trace_dir: str):
    """One engine step under the profiler; (kernel times, launches, where, whether it was decode-only)."""
    import jax

    runner = engine.runner
    before = runner.decode_steps
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        engine.step()
    return (*kernel_times(trace_dir), runner.decode_steps > before)


def report(kind: str, us: collections.Counter, launches: collections.Counter, where: str, top: int) -> None:
    total = sum(us.values())
    print(f"\n{kind} step: {total / 1e3:.3f} ms of kernels, {sum(launches.values())} launches, on {where}")
    print(f"  {'ms':>8} {'share':>6} {'launches':>8}  kernel")
    for name, t in us.most_common(top):
        print(f"  {t / 1e3:8.3f} {t / max(total, 1e-9):6.1%} {launches[name]:8d}  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=".gpu/tokenizer.gguf")
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--zeros-on-device", action="store_true", help="bf16 zero weights made on the device")
    ap.add_argument("--num-requests", type=int, default=64, help="sequences decoding in the decode step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the platform's (GPU 8,192)")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per step")
    ap.add_argument("--out", default=None, help="where the traces go (default: a temporary folder)")
    args = ap.parse_args()

    import jax

    from jaxserve import LLM, SamplingParams

    loaded = random_model(args.tokenizer, preset=args.preset, zeros_on_device=args.zeros_on_device)
    n, length = args.num_requests, args.prompt_len
    on_cpu = jax.default_backend() == "cpu"
    llm = LLM(
        loaded,
        dtype="float32" if on_cpu else "bfloat16",
        num_pages=n * (length // 16 + 8) + 1,
        max_num_seqs=n,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
        max_model_len=length + 128,
        compilation_cache=False,
        enable_prefix_caching=False,
        async_scheduling=False,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = workload(n, length, length, loaded.config.vocab_size, seed=3)
    t = time.perf_counter()
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(f"{args.preset} on {jax.devices()[0].device_kind}: built and warmed in {time.perf_counter() - t:.0f}s")
    out = args.out or tempfile.mkdtemp(prefix="jaxserve-profile-")

    half = n // 2
    for i, p in enumerate(prompts[:half]):
        engine.add_request(f"a{i}", p, params)
    runner = engine.runner
    while runner.decode_steps == 0:  # the first half's prompts in, all decoding
        engine.step()
    for i, p in enumerate(prompts[half:]):
        engine.add_request(f"b{i}", p, params)
    us, launches, where, decode_only = traced_step(engine, f"{out}/mixed")
    assert not decode_only, "the step after the second half arrived should hold their prompts' chunks"
    budget = engine.scheduler_config.max_num_batched_tokens
    report(f"mixed ({budget}-token budget, {half} decoding)", us, launches, where, args.top)
    for _ in range(10 * n):  # until a step is decode-only, then trace the next
        before = runner.decode_steps
        engine.step()
        if runner.decode_steps > before:
            break
    us, launches, where, decode_only = traced_step(engine, f"{out}/decode")
    assert decode_only, "every prompt should be in by now"
    report(f"decode ({n} sequences)", us, launches, where, args.top)
    print(f"\ntraces: {out}")


if __name__ == "__main__":
    main()
