"""Online serving numbers for bench/RESULTS.md: latency vs request rate, and the server's overhead.

Starts ``jaxserve serve`` (the default model unless --model) as a subprocess, then with ``jaxserve bench serve``'s
client (``jaxserve/benchmarks/serve.py``):
  1. a sweep at --rates (default 1, 4, 16 requests/s; Poisson arrivals): TTFT, TPOT, ITL mean/median/p99 and
     throughput per rate, and a PNG of latency vs rate;
  2. the overhead run: --overhead-prompts requests sent at once, streamed, through the server, and the same
     requests (same token ids, greedy, ignore_eos, the same engine settings) through offline ``LLM.generate``
     in this process while the server idles; --overhead-reps pairs, each on fresh prompts, the order alternating
     (a shared machine's load drifts; a pair run back to back sees about the same). Ratio = offline time /
     server time, the median over the pairs (the target is >= 0.9).

    python bench/serve.py [--rates 1 4 16] [--out-dir bench/out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxserve.benchmarks import serve as bench
from jaxserve.server.launch import free_port


def start_server(args, port: int, log_path: Path, max_waiting: int = 100_000) -> subprocess.Popen:
    """``jaxserve serve`` on ``port``, once /health answers (the bench measures latency, not admission)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxserve",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-waiting-requests",
        str(max_waiting),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--model", args.model]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + 900  # loading + compiling every bucket
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)


def client_args(args, port: int, rates: list[float], num_prompts: int, seed: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    ns = p.parse_args([])
    ns.base_url = f"http://127.0.0.1:{port}"
    ns.request_rate, ns.num_prompts, ns.seed = rates, num_prompts, seed
    ns.input_len, ns.output_len, ns.range_ratio = args.input_len, args.output_len, args.range_ratio
    ns.seconds_per_rate = getattr(args, "seconds_per_rate", 0.0)
    ns.max_requests_per_rate = getattr(args, "max_requests_per_rate", num_prompts)
    return ns


def requests_per_rate(ns, rate: float) -> int:
    """The same seconds of arrivals at every rate (so more requests at higher rates), capped."""
    n = ns.num_prompts if not math.isfinite(rate) else max(16, int(rate * ns.seconds_per_rate))
    return min(n, ns.max_requests_per_rate)


async def sweep(ns) -> tuple[list[dict], list]:
    """Runs ``ns.request_rate`` one after the other, each on prompts of its own (no prefix-cache hits from an
    earlier rate). Returns the results and every prompt made."""
    import httpx

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(3600, connect=30), limits=httpx.Limits(max_connections=None)
    ) as client:
        model = (await client.get(f"{ns.base_url}/v1/models")).json()["data"][0]["id"]
        sizes = [requests_per_rate(ns, rate) for rate in ns.request_rate]
        ns.num_prompts = sum(sizes) or ns.num_prompts
        prompts = await bench._prompts(client, ns, {})
        work = [(ids, ns.output_len, None) for ids, _ in prompts]  # fixed output length: TPOT is comparable
        results, start = [], 0
        for rate, n in zip(ns.request_rate, sizes):
            results.append(await bench.run_rate(client, ns, model, work[start : start + n], {}, rate))
            start += n
            bench.print_result(results[-1])
    return results, prompts


class Offline:
    """``LLM.generate`` with the server's engine settings, compiled once."""

    def __init__(self, args):
        from jaxserve import LLM, SamplingParams

        self.llm = LLM(
            args.model,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        self.llm.engine.warmup()
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(self, prompts: list[list[int]]) -> dict:
        t = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        return {"elapsed": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def markdown(args, results: list[dict], over: dict | None, load: list[float]) -> str:
    setup = (
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, CPU only. "
        f"Model: {args.model or 'SmolLM2-135M-Instruct (default)'}; "
        f"engine max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, "
        f"max_model_len={args.max_model_len}. Prompts {int(args.input_len * (1 - args.range_ratio))}-"
        f"{int(args.input_len * (1 + args.range_ratio))} tokens, {args.output_len} output tokens (ignore_eos, "
        f"greedy), streamed; Poisson arrivals for {args.seconds_per_rate:g} s per rate."
    )
    lines = [
        f"### Online serving (`python bench/serve.py`), {time.strftime('%Y-%m-%d')}",
        setup,
        "",
        "| rate (req/s) | done | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rate = "all at once" if not math.isfinite(r["request_rate"]) else f"{r['request_rate']:g}"
        lines.append(
            f"| {rate} | {r['completed']}/{r['completed'] + r['failed']} | {r['request_throughput']:.2f} | "
            f"{r['output_throughput']:.0f} | {r['ttft_ms']['median']:.0f} ms | {r['ttft_ms']['p99']:.0f} ms | "
            f"{r['tpot_ms']['median']:.0f} ms | {r['tpot_ms']['p99']:.0f} ms | {r['itl_ms']['p99']:.0f} ms |"
        )
    if over:
        pairs = ", ".join(f"{o:.1f} s / {v:.1f} s" for o, v in zip(over["offline_s"], over["server_s"]))
        lines += [
            "",
            (
                f"Server overhead: {over['n']} requests at once, streamed through the server vs offline "
                f"`LLM.generate` (same token ids and engine settings), alternated (offline / server: "
                f"{pairs}): server throughput = **{over['ratio']:.2f}x** offline (median of the pairs)."
            ),
        ]
    lines += [
        "",
        (
            f"1-minute load average of the machine at the start / end: {load[0]:.1f} / {load[1]:.1f} "
            f"(other jobs share it; above {os.cpu_count()} means contention)."
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    ap.add_argument("--seconds-per-rate", type=float, default=40.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-requests-per-rate", type=int, default=160)
    ap.add_argument("--overhead-prompts", type=int, default=64, help="0 skips the overhead run")
    ap.add_argument("--overhead-reps", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out-dir", default="bench/out")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    load = [os.getloadavg()[0]]
    port = free_port()
    t = time.perf_counter()
    proc = start_server(args, port, out / "serve.log")
    print(f"server up in {time.perf_counter() - t:.0f}s (load + compile)")
    over = None
    try:
        ns = client_args(args, port, args.rates, args.max_requests_per_rate, seed=0)
        results, _ = asyncio.run(sweep(ns))
        if args.overhead_prompts:
            offline = Offline(args)
            off_s, srv_s, srv_runs = [], [], []
            for rep in range(args.overhead_reps):
                # Fresh prompts each time (neither side has them in its prefix cache), the order flipping so a
                # drifting machine load evens out.
                over_ns = client_args(args, port, [float("inf")], args.overhead_prompts, seed=100 + rep)
                prompts = asyncio.run(sweep(client_args(args, port, [], args.overhead_prompts, seed=100 + rep)))[1]
                if rep % 2:
                    srv_run = asyncio.run(sweep(over_ns))[0]
                off = offline.run([ids for ids, _ in prompts])
                if rep % 2 == 0:
                    srv_run = asyncio.run(sweep(over_ns))[0]
                assert srv_run[0]["output_tokens"] == off["output_tokens"], (srv_run[0], off)
                off_s.append(off["elapsed"])
                srv_s.append(srv_run[0]["duration_s"])
                srv_runs.append(srv_run[0])
                print(
                    f"overhead rep {rep}: offline {off_s[-1]:.1f}s, server {srv_s[-1]:.1f}s: "
                    f"{off_s[-1] / srv_s[-1]:.2f}x",
                    flush=True,
                )
            over = {
                "n": args.overhead_prompts,
                "offline_s": off_s,
                "server_s": srv_s,
                "ratio": statistics.median(o / v for o, v in zip(off_s, srv_s)),
                "server_runs": srv_runs,
            }
    finally:
        code = stop_server(proc)
    print(f"server exited with {code}")
    load.append(os.getloadavg()[0])
    bench.plot(
        results,
        str(out / "latency_vs_rate.png"),
        f"jaxserve serve, default model, {os.cpu_count()} CPUs: ~{args.input_len} in / {args.output_len} out tokens",
    )
    (out / "serve_results.json").write_text(json.dumps({"sweep": results, "overhead": over}, indent=1))
    md = markdown(args, results, over, load)
    (out / "serve_results.md").write_text(md + "\n")
    print("\n" + md + f"\n\nplot: {out / 'latency_vs_rate.png'}")


if __name__ == "__main__":
    main()
