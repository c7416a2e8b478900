"""Soak test of ``jaxserve serve``: a bounded run at a request rate just above capacity.

Starts the server (default model) as a subprocess, measures its capacity (requests/s with everything sent at
once), then sends streamed requests with Poisson arrivals at ``--overload`` x capacity for ``--duration`` seconds.
Every request must end one of two ways: completed (its stream ends with a finish reason and [DONE]) or turned
away at once with 503 + Retry-After (the admission limit, ``--max-waiting-requests``). Anything else is a
failure: an error, a broken stream, or a request still unanswered ``--request-timeout`` seconds after it was sent
(hung). The server's RSS is sampled every few seconds ("memory flat": its growth after the first minute), and
at the end every KV page must be free and nothing running.

    python bench/soak.py [--duration 300] [--overload 1.2] [--out-dir bench/out]

Exit status 0 when nothing was lost or hung, no page leaked and memory stayed flat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve import client_args, start_server, stop_server

from jaxserve.benchmarks import serve as bench
from jaxserve.server.launch import free_port
from jaxserve.server.metrics import parse_metrics as metrics


async def sample_rss(pid: int, samples: list, stop: asyncio.Event, every: float) -> None:
    import psutil

    proc = psutil.Process(pid)
    t0 = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def soak(args, port: int, pid: int) -> dict:
    import httpx

    base = f"http://127.0.0.1:{port}"
    ns = client_args(args, port, [float("inf")], args.calibration_prompts, seed=3)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30), limits=limits) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        ns.num_prompts = max(args.calibration_prompts, 256)
        prompts = await bench._prompts(client, ns, {})
        work = [(ids, args.output_len, None) for ids, _ in prompts]
        # Capacity: everything at once, the throughput the engine sustains on this workload.
        cal = await bench.run_rate(client, ns, model, work[: args.calibration_prompts], {}, float("inf"))
        capacity = cal["request_throughput"]
        rate = args.rate or capacity * args.overload
        print(
            f"capacity {capacity:.2f} req/s ({cal['output_throughput']:.0f} output tok/s); soaking at {rate:.2f} "
            f"req/s for {args.duration:.0f}s",
            flush=True,
        )
        before = metrics((await client.get(f"{base}/metrics")).text)

        rss: list[tuple[float, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, rss, stop, args.rss_every))
        rng = random.Random(7)
        url = f"{base}/v1/completions"
        tasks = []
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < args.duration:
            ids, out_len, _ = work[i % len(work)]
            payload = {
                "model": model,
                "prompt": ids,
                "max_tokens": out_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            # asyncio.wait_for bounds each request: one still open after request_timeout counts as hung.
            tasks.append(
                asyncio.create_task(
                    asyncio.wait_for(bench._request(client, url, payload, {}, len(ids)), args.request_timeout)
                )
            )
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        sent_s = time.monotonic() - t0
        results = await asyncio.gather(*tasks, return_exceptions=True)
        drained_s = time.monotonic() - t0
        await asyncio.sleep(1.0)
        after = metrics((await client.get(f"{base}/metrics")).text)
        stop.set()
        await sampler

    ok = [r for r in results if isinstance(r, bench.RequestResult) and r.ok and r.output_len == args.output_len]
    busy = [r for r in results if isinstance(r, bench.RequestResult) and r.error.startswith("HTTP 503")]
    hung = [r for r in results if isinstance(r, asyncio.TimeoutError)]
    failed = len(results) - len(ok) - len(busy) - len(hung)
    errors = sorted(
        {
            str(r.error if isinstance(r, bench.RequestResult) else repr(r))
            for r in results
            if not (isinstance(r, bench.RequestResult) and (r.ok or r.error.startswith("HTTP 503")))
        }
    )
    steady = [m for t, m in rss if t >= 60.0] or [m for _, m in rss]
    growth = (steady[-1] - steady[0]) / steady[0] if steady else math.nan
    finished = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("jaxserve:request_success_total"))
    ttft = bench._stats([r.ttft for r in ok])
    return {
        "capacity_req_s": capacity,
        "rate_req_s": rate,
        "duration_s": sent_s,
        "drained_s": drained_s,
        "sent": len(results),
        "completed": len(ok),
        "rejected_503": len(busy),
        "hung": len(hung),
        "failed": failed,
        "errors": errors[:5],
        "server_counted_finished": finished,
        "completed_throughput_req_s": len(ok) / drained_s,
        "ttft_ms": ttft,
        "tpot_ms": bench._stats([r.tpot for r in ok if r.tpot is not None]),
        "rss_mib_first": rss[0][1] if rss else None,
        "rss_mib_at_60s": steady[0] if steady else None,
        "rss_mib_last": rss[-1][1] if rss else None,
        "rss_growth_after_60s": growth,
        "rss_samples": rss,
        "end_running": after.get("jaxserve:num_requests_running"),
        "end_waiting": after.get("jaxserve:num_requests_waiting"),
        "end_used_pages": after.get("jaxserve:kv_cache_used_pages"),
        "preemptions": after.get("jaxserve:num_preemptions_total", 0) - before.get("jaxserve:num_preemptions_total", 0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals")
    ap.add_argument("--overload", type=float, default=1.2, help="rate = this x measured capacity")
    ap.add_argument("--rate", type=float, default=None, help="fixed rate instead of --overload x capacity")
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="a request open longer is hung")
    ap.add_argument("--max-waiting-requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth after the first minute")
    ap.add_argument("--out-dir", default="bench/out")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    proc = start_server(args, port, out / "soak_server.log", max_waiting=args.max_waiting_requests)
    try:
        r = asyncio.run(soak(args, port, proc.pid))
    finally:
        r_code = stop_server(proc)
    r["server_exit_code"] = r_code
    (out / "soak_results.json").write_text(json.dumps(r, indent=1))
    good = (
        r["hung"] == 0
        and r["failed"] == 0
        and r["end_used_pages"] == 0
        and r["end_running"] == 0
        and r["rss_growth_after_60s"] <= args.max_rss_growth
        and r_code == 0
        and r["server_counted_finished"] == r["completed"]
    )
    print(json.dumps({k: v for k, v in r.items() if k != "rss_samples"}, indent=1))
    print(
        f"\nsoak {'PASSED' if good else 'FAILED'}: {r['sent']} requests in {r['duration_s']:.0f}s at "
        f"{r['rate_req_s']:.2f} req/s (capacity {r['capacity_req_s']:.2f}): {r['completed']} completed, "
        f"{r['rejected_503']} turned away with 503, {r['hung']} hung, {r['failed']} failed; RSS "
        f"{r['rss_mib_at_60s']:.0f} -> {r['rss_mib_last']:.0f} MiB after the first minute "
        f"({r['rss_growth_after_60s']:+.1%}); KV pages in use at the end: {r['end_used_pages']:.0f}"
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
