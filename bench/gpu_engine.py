"""The whole engine on one GPU (bfloat16), for a device check: the offline throughput workload, random weights.

So that nothing but the repository (and a small tokenizer file) has to reach the GPU host, this builds SmolLM2-135M's
architecture (``configs/smollm2-135m.json``) with random weights and takes the vocabulary from a tensor-free
``tokenizer.gguf`` (``--tokenizer``; ``python bench/gpu_engine.py --write-tokenizer DIR`` makes one here).
Token ids are random: throughput does not depend on the weights' values, only on their shapes.

Runs, each engine in this process one after the other:
  1. agreement: 8 prompts x 24 greedy tokens in float32 with attention "pallas" (Triton on GPU), "xla" and
     "reference"; prints how many tokens each matches the reference (random weights give small logit gaps,
     so a rare flip near a tie is possible; a kernel bug flips most of them);
  2. throughput: 64 requests, prompts 64-512 tokens, 128 output tokens each, greedy, ignore_eos, bf16, per
     attention impl: run once to compile the shapes it meets, then timed; output tok/s, steps, the split of
     step time between host packing, device (dispatch to results on the host) and the rest of the host loop.
     The first impl runs again with async_scheduling=False (steps one after the other) for the host's share;
  3. one stream: 4 requests one at a time, plain (async and sync) vs n-gram speculation (k=3), tok/s, ms/step;
  4. with ``--quant-sweep bf16,int8,fp8,int4`` (and ``--concurrency 1,64,256``): the weights quantized on load in
     each mode ("bf16": not quantized), output tok/s with that many concurrent requests (prompts 64-256 tokens,
     ``--output-len`` out), each mode and count once compiled, then timed (``bash bench/gpu_quant.sh``: Llama-3-8B).
A table is printed last. Every engine here is the sharded path at TP 1: one SPMD program over a one-GPU mesh,
weights placed by their logical axes, the kernels under shard_map, the logits gathered before sampling.

    python bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf [--impls pallas,xla] [--time-budget 240]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROWS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def write_tokenizer(out_dir: str) -> None:
    from jaxserve.defaults import default_model_path
    from jaxserve.loading.orbax_ckpt import copy_tokenizer

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    copy_tokenizer(default_model_path(), Path(out_dir))
    log(f"wrote {out_dir}/tokenizer.gguf")


def random_model(
    tokenizer: str, seed: int = 0, preset: str = "smollm2-135m", zeros_on_device: bool = False, random_on_device=False
):
    """Random host weights; or, for big presets, bf16 zeros made on the device (no 16 GB host round trip: the
    step's cost depends on shapes only, and greedy decoding of all-zero logits picks token 0 every time); or bf16
    N(0, 0.02) weights drawn on the device (a mixture of experts: zeros would route every token to the same k
    experts, random weights spread them as real routing does)."""
    import numpy as np

    from jaxserve.config import load_preset
    from jaxserve.loading import LoadedModel
    from jaxserve.loading.weights import param_shapes

    cfg = load_preset(preset)
    params = {}
    if zeros_on_device:
        import jax.numpy as jnp

        for name, shape in param_shapes(cfg).items():
            params[name] = (jnp.ones if name.endswith("norm") else jnp.zeros)(shape, jnp.bfloat16)
        return LoadedModel(f"{preset}-zeros", cfg, params, Path(tokenizer))
    if random_on_device:
        import jax
        import jax.numpy as jnp

        key = jax.random.key(seed)
        for i, (name, shape) in enumerate(param_shapes(cfg).items()):
            if name.endswith("norm"):
                params[name] = jnp.ones(shape, jnp.bfloat16)
            else:
                draw = jax.jit(lambda k, s=shape: jax.random.normal(k, s, jnp.bfloat16) * 0.02)
                params[name] = draw(jax.random.fold_in(key, i))
        return LoadedModel(f"{preset}-random", cfg, params, Path(tokenizer))
    rng = np.random.default_rng(seed)
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm"):
            params[name] = np.ones(shape, np.float32)
        else:
            params[name] = (rng.standard_normal(shape, np.float32) * 0.05).astype(np.float32)
    return LoadedModel(f"{preset}-random", cfg, params, Path(tokenizer))


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def agreement(loaded, impls: list[str]) -> None:
    import jax

    from jaxserve import LLM, SamplingParams

    # IEEE float32 products everywhere (a GPU's default lets XLA use TF32, and reference vs xla then differ at the
    # 1e-3 level, which flips near-ties of random weights); the Triton kernel asks for HIGHEST itself.
    jax.config.update("jax_default_matmul_precision", "highest")
    prompts = workload(8, 5, 200, loaded.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    toks = {}
    for impl in ["reference"] + [i for i in impls if i != "reference"]:
        t = time.perf_counter()
        try:
            llm = LLM(
                loaded,
                dtype="float32",
                attention_impl=impl,
                num_pages=512,
                max_num_seqs=8,
                max_num_batched_tokens=256,
                max_model_len=512,
                compilation_cache=False,
            )
            toks[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"agreement {impl}: ERROR {type(e).__name__}: {str(e)[:1500]}")
            ROWS.append(f"| agreement f32 | {impl} | ERROR {type(e).__name__} | |")
            continue
        ref = toks["reference"]
        same = sum(a == b for x, y in zip(toks[impl], ref) for a, b in zip(x, y))
        first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(toks[impl], ref)]
        log(
            f"agreement {impl}: {same}/{sum(map(len, ref))} tokens equal the reference; first differing index per "
            f"prompt {first_diff}; {time.perf_counter() - t:.0f}s"
        )
        ROWS.append(f"| agreement f32 | {impl} | {same}/{sum(map(len, ref))} tokens = reference | |")
    jax.config.update("jax_default_matmul_precision", None)


def timed_run(llm, prompts, params, out_len: int) -> tuple[float, int, float]:
    """Runs the prompts once (compiling the shapes they meet), then again with the runner's timers reset: seconds of
    the second run, compiled step variants after the first, seconds of the first."""
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    first = time.perf_counter() - t
    runner = llm.engine.runner
    compiled = runner.num_compilations
    runner.reset_timers()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    e = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return e, compiled, first


def throughput(loaded, impl: str, n: int, out_len: int, async_scheduling: bool = True) -> None:
    from jaxserve import LLM, SamplingParams

    mode = "async" if async_scheduling else "sync"

    prompts = workload(n, 64, 512, loaded.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    try:
        t = time.perf_counter()
        llm = LLM(
            loaded,
            dtype="bfloat16",
            attention_impl=impl,
            num_pages=n * 48 + 1,
            max_num_seqs=n,
            max_num_batched_tokens=512,
            max_model_len=768,
            compilation_cache=False,
            enable_prefix_caching=False,
            async_scheduling=async_scheduling,
        )
        built = time.perf_counter() - t
        e, compiled, first = timed_run(llm, prompts, params, out_len)
        first += built
        runner = llm.engine.runner
    except Exception as ex:  # noqa: BLE001
        log(f"throughput {impl} {mode}: ERROR {type(ex).__name__}: {str(ex)[:1500]}")
        ROWS.append(f"| throughput bf16 {mode} | {impl} | ERROR {type(ex).__name__} | |")
        return
    n_in, n_out = sum(map(len, prompts)), n * out_len
    steps = runner.num_steps
    other = e - runner.device_seconds - runner.pack_seconds
    # Async: "device" spans launch to results, overlapping the host's work on the next step.
    log(
        f"throughput {impl} {mode}: {e:.2f}s, {n_out / e:.0f} output tok/s, {(n_in + n_out) / e:.0f} total tok/s; "
        f"{steps} steps, {1e3 * e / steps:.2f} ms/step: device {1e3 * runner.device_seconds / steps:.2f}, "
        f"packing {1e3 * runner.pack_seconds / steps:.2f}, other host {1e3 * other / steps:.2f}; first run "
        f"(with compiles) {first:.0f}s, {compiled} step variants, {runner.num_compilations - compiled} recompiles"
    )
    ROWS.append(
        f"| throughput bf16 {mode} | {impl} | {n_out / e:.0f} out tok/s, {(n_in + n_out) / e:.0f} total "
        f"tok/s | {1e3 * e / steps:.2f} ms/step (device {1e3 * runner.device_seconds / steps:.2f}, packing "
        f"{1e3 * runner.pack_seconds / steps:.2f}) |"
    )


def single_stream(loaded, impl: str, out_len: int, k: int = 3) -> None:
    """One request at a time: plain decoding with and without async scheduling, and n-gram speculation (k
    proposals; synchronous), bf16. Random prompts and weights give few
    proposals and fewer right ones: this measures what speculation costs per step where it does not pay (the
    host's proposal search, the wider sampler), not a real workload's gain (bench/speculative.py, real model)."""
    from jaxserve import LLM, SamplingParams

    prompts = workload(4, 64, 256, loaded.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    rates = {}
    for name, spec, overlap in (
        ("plain", None, True),
        ("plain sync", None, False),
        ("ngram", {"method": "ngram", "num_speculative_tokens": k}, False),
    ):
        try:
            llm = LLM(
                loaded,
                dtype="bfloat16",
                attention_impl=impl,
                num_pages=256,
                max_num_seqs=4,
                max_num_batched_tokens=512,
                max_model_len=768,
                compilation_cache=False,
                speculative_config=spec,
                async_scheduling=overlap,
            )
            llm.generate(prompts[:1], params, use_tqdm=False)  # compiles
            before = llm.engine.get_stats()
            t = time.perf_counter()
            for p in prompts:
                llm.generate([p], params, use_tqdm=False)
            e = time.perf_counter() - t
        except Exception as ex:  # noqa: BLE001
            log(f"single stream {impl} {name}: ERROR {type(ex).__name__}: {str(ex)[:1500]}")
            ROWS.append(f"| one stream bf16 {name} | {impl} | ERROR {type(ex).__name__} | |")
            return
        stats = llm.engine.get_stats()
        steps = stats["num_steps"] - before["num_steps"]
        drafted = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        rates[name] = len(prompts) * out_len / e
        log(
            f"single stream {impl} {name}: {rates[name]:.0f} tok/s, {steps} steps, {1e3 * e / steps:.2f} ms/step, "
            f"accepted {accepted}/{drafted}"
        )
        ROWS.append(
            f"| one stream bf16 {name} | {impl} | {rates[name]:.0f} tok/s, accepted {accepted}/{drafted} | "
            f"{1e3 * e / steps:.2f} ms/step |"
        )
    log(
        f"single stream {impl}: ngram / plain {rates['ngram'] / rates['plain']:.2f}x, async / sync "
        f"{rates['plain'] / rates['plain sync']:.2f}x"
    )


def quant_sweep(loaded, impl: str, modes: list[str], counts: list[int], out_len: int, deadline: float) -> None:
    """Output tok/s per quantization mode and number of concurrent requests (bf16 activations and KV)."""
    from jaxserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for mode in modes:
        llm = None
        for n in counts:
            if time.perf_counter() > deadline:
                ROWS.append(f"| quantized {mode}, {n} requests | {impl} | skipped (time budget) | |")
                continue
            prompts = workload(n, 64, 256, loaded.config.vocab_size, seed=4)
            try:
                if llm is None:  # one engine per mode, sized for the largest count
                    top = max(counts)
                    llm = LLM(
                        loaded,
                        dtype="bfloat16",
                        attention_impl=impl,
                        num_pages=top * 24 + 1,
                        max_num_seqs=top,
                        max_num_batched_tokens=512,
                        max_model_len=512,
                        compilation_cache=False,
                        enable_prefix_caching=False,
                        quantization=None if mode == "bf16" else mode,
                    )
                e = timed_run(llm, prompts, params, out_len)[0]
                runner = llm.engine.runner
            except Exception as ex:  # noqa: BLE001
                log(f"quantized {mode}, {n} requests: ERROR {type(ex).__name__}: {str(ex)[:1500]}")
                ROWS.append(f"| quantized {mode}, {n} requests | {impl} | ERROR {type(ex).__name__} | |")
                break
            steps = runner.num_steps
            log(
                f"quantized {mode}, {n} requests: {n * out_len / e:.0f} output tok/s, {steps} steps, "
                f"{1e3 * e / steps:.2f} ms/step"
            )
            ROWS.append(
                f"| quantized {mode}, {n} requests | {impl} | {n * out_len / e:.0f} out tok/s | "
                f"{1e3 * e / steps:.2f} ms/step |"
            )
        del llm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tokenizer.gguf")
    ap.add_argument("--write-tokenizer", metavar="DIR")
    ap.add_argument("--impls", default="pallas,xla")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--time-budget", type=float, default=240.0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-single-stream", action="store_true", help="skip one stream, plain vs n-gram speculation")
    ap.add_argument("--preset", default="smollm2-135m", help="model shapes for the throughput runs")
    ap.add_argument("--zeros-on-device", action="store_true", help="bf16 zero weights made on the device")
    ap.add_argument("--random-on-device", action="store_true", help="bf16 random weights drawn on the device (MoE)")
    ap.add_argument("--quant-sweep", default="", help="quantization modes to time, e.g. bf16,int8,fp8,int4")
    ap.add_argument("--concurrency", default="1,64,256", help="concurrent requests for --quant-sweep")
    a = ap.parse_args()
    if a.write_tokenizer:
        write_tokenizer(a.write_tokenizer)
        return 0
    import jax

    t0 = time.perf_counter()
    log(f"jax {jax.__version__} {jax.devices()}")
    impls = a.impls.split(",")
    if not a.skip_agreement:
        agreement(random_model(a.tokenizer), impls)
    loaded = random_model(
        a.tokenizer, preset=a.preset, zeros_on_device=a.zeros_on_device, random_on_device=a.random_on_device
    )
    for impl in [] if a.skip_throughput else impls:
        if time.perf_counter() - t0 > a.time_budget:
            ROWS.append(f"| throughput bf16 | {impl} | skipped (time budget) | |")
            continue
        throughput(loaded, impl, a.num_requests, a.output_len)
        if impl == impls[0] and time.perf_counter() - t0 < a.time_budget:
            throughput(loaded, impl, a.num_requests, a.output_len, async_scheduling=False)
    if not a.skip_single_stream and time.perf_counter() - t0 < a.time_budget:
        single_stream(loaded, impls[0], a.output_len)
    if a.quant_sweep:
        quant_sweep(
            loaded,
            impls[0],
            a.quant_sweep.split(","),
            [int(c) for c in a.concurrency.split(",")],
            a.output_len,
            t0 + a.time_budget,
        )
    log(
        f"\n{loaded.name}; {a.num_requests} requests, prompts 64-512, {a.output_len} out, "
        f"greedy, ignore_eos; {time.perf_counter() - t0:.0f}s in all"
    )
    log("| check | impl | result | step time |\n|---|---|---|---|")
    for r in ROWS:
        log(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
