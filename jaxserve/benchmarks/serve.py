"""``jaxserve bench serve``: an online benchmark against a running OpenAI-compatible server, like vLLM's.

Requests arrive at Poisson-distributed times (exponential gaps at ``--request-rate`` per second; ``inf`` sends
all at once). Prompts are random text cut to a length drawn uniformly from ``input_len * [1 - r, 1 + r]`` tokens
(the server's /tokenize makes the cut exact; prompts go as token ids), outputs likewise (``ignore_eos``, so each
request generates exactly its length). Reported per rate: TTFT, TPOT (time per output token after the first),
ITL (gap between streamed chunks) and end-to-end latency, mean / median / p99, and request and token throughput.
Several rates make a sweep, and ``--plot`` draws latency against request rate.

Needs httpx (and matplotlib for ``--plot``), the ``bench`` extra (``pip install -e ".[bench]"``); both are imported
only when the benchmark runs, so the command line and the server never need them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

_WORDS = [
    "the",
    "a",
    "of",
    "river",
    "city",
    "light",
    "north",
    "stone",
    "garden",
    "music",
    "paper",
    "window",
    "seven",
    "quiet",
    "market",
    "winter",
    "bright",
    "history",
    "engine",
    "forest",
    "number",
    "table",
    "ocean",
    "silver",
    "story",
    "mountain",
    "coffee",
    "language",
    "science",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Registers the benchmark's flags on ``p`` (the ``jaxserve bench serve`` parser)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="requests per second (several: a sweep; inf: all at once)",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--plot", default=None, help="PNG of latency vs request rate")
    p.add_argument("--result-json", default=None, help="write the results here")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


async def _request(client, url: str, payload: dict, headers: dict, prompt_len: int) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft > 0.0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result too
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _prompts(client, args, headers: dict) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request."""
    rng = random.Random(args.seed)

    def draw(n: int) -> int:
        lo, hi = max(1, int(n * (1 - args.range_ratio))), max(1, int(n * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(args.num_prompts):
        want = draw(args.input_len)
        text = " ".join(rng.choice(_WORDS) for _ in range(want * 2 + 8))
        r = await client.post(
            f"{args.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers
        )
        r.raise_for_status()
        out.append((r.json()["tokens"][:want], draw(args.output_len)))
    return out


def _payload(args, model: str, ids: list[int], out_len: int, detok: str | None) -> dict:
    common = {
        "model": model,
        "max_tokens": out_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "/v1/completions":
        return {**common, "prompt": ids}
    return {**common, "messages": [{"role": "user", "content": detok}]}


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    s = sorted(xs)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(s) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"mean": sum(s) / len(s) * 1000, "median": pct(0.5) * 1000, "p99": pct(0.99) * 1000}


async def run_rate(client, args, model: str, work, headers: dict, rate: float) -> dict:
    rng = random.Random(args.seed + 1)
    url = f"{args.base_url}{args.endpoint}"
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def go(ids, out_len, detok):
        payload = _payload(args, model, ids, out_len, detok)
        if sem is None:
            return await _request(client, url, payload, headers, len(ids))
        async with sem:
            return await _request(client, url, payload, headers, len(ids))

    start = time.perf_counter()
    tasks = []
    for ids, out_len, detok in work:
        tasks.append(asyncio.create_task(go(ids, out_len, detok)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def print_result(r: dict) -> None:
    rate = "inf" if not math.isfinite(r["request_rate"]) else f"{r['request_rate']:g}"
    print(f"\n==== request rate {rate}/s: {r['completed']} completed, {r['failed']} failed in {r['duration_s']:.1f}s")
    for e in r["errors"]:
        print(f"  error: {e}")
    print(
        f"  throughput: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
        f"{r['total_token_throughput']:.1f} total tok/s"
    )
    print(f"  {'(ms)':<6}{'mean':>10}{'median':>10}{'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = r[f"{key}_ms"]
        print(f"  {key.upper():<6}{s['mean']:>10.1f}{s['median']:>10.1f}{s['p99']:>10.1f}")


def plot(results: list[dict], path: str, title: str = "") -> None:
    """Latency (TTFT, TPOT, ITL: median and p99) and throughput against the request rate."""
    matplotlib = _require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(results, key=lambda r: r["request_rate"])
    finite = [r["request_rate"] for r in rs if math.isfinite(r["request_rate"])]
    top = max(finite) * 2 if finite else 1.0
    x = [r["request_rate"] if math.isfinite(r["request_rate"]) else top for r in rs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        ax.plot(x, [r[key]["median"] for r in rs], "o-", label=f"{name} median")
        ax.plot(x, [r[key]["p99"] for r in rs], "s--", label=f"{name} p99")
        if key == "tpot_ms":
            ax.plot(x, [r["itl_ms"]["p99"] for r in rs], "^:", label="ITL p99")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
    axes[2].plot(x, [r["output_throughput"] for r in rs], "o-", label="output tok/s")
    axes[2].plot(x, [r["total_token_throughput"] for r in rs], "s--", label="total tok/s")
    axes[2].set_ylabel("tokens / s")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)" + ("; rightmost = all at once" if len(finite) < len(rs) else ""))
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title or "jaxserve: latency vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _main(args) -> list[dict]:
    httpx = _require("httpx")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{args.base_url}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = await _prompts(client, args, headers)
        detok = [None] * len(prompts)
        if args.endpoint == "/v1/chat/completions":
            for i, (ids, _) in enumerate(prompts):
                r = await client.post(f"{args.base_url}/detokenize", json={"tokens": ids}, headers=headers)
                detok[i] = r.json()["prompt"]
        work = [(ids, n, d) for (ids, n), d in zip(prompts, detok)]
        results = []
        for rate in args.request_rate:
            results.append(await run_rate(client, args, model, work, headers, rate))
            print_result(results[-1])
    return results


def _require(module: str, what: str = "jaxserve bench serve"):
    """Imports an optional dependency of the benchmark, or raises naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModuleNotFoundError(
            f'{what} needs {module}: pip install {module} (or the bench extra: pip install -e ".[bench]")'
        ) from e


def main(args) -> int:
    """Runs ``jaxserve bench serve`` with parsed ``args`` (see ``add_arguments``). Returns the exit code: 0 when
    every rate completed at least one request, 2 when a dependency is missing (checked before anything runs)."""
    try:
        _require("httpx")
        if args.plot:
            _require("matplotlib", "--plot")
    except ModuleNotFoundError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    results = asyncio.run(_main(args))
    if args.result_json:
        with open(args.result_json, "w") as f:
            kept = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
            json.dump({"args": kept, "results": results}, f, indent=1)
    if args.plot:
        plot(
            results,
            args.plot,
            f"jaxserve bench serve: {args.num_prompts} requests, ~{args.input_len} in / {args.output_len} out tokens",
        )
        print(f"plot: {args.plot}")
    return 0 if all(r["completed"] for r in results) else 1
