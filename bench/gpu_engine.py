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
     ``--output-len`` out), each mode and count once compiled, then timed (``bash bench/gpu_quant.sh``: Llama-3-8B);
  5. with ``--step-truth`` (that alone; ``bash bench/gpu_run.sh`` runs it at Llama-3-8B shapes): one engine at the
     engine's own default budgets for the platform (a GPU's token budget, not the CPU's 512), ``--concurrency``
     requests at once (default 1,64,256) of ``--input-len`` random token ids (default 1,024), ``--output-len`` out
     (default 1,024 here), greedy, ignore_eos, each count warmed up with ``--warmup-output-len`` tokens out and then
     timed: output tok/s; decode-only and mixed ms/step, each the wall time between a step's results and the
     previous step's (``StepRecorder``: under async scheduling the runner's device timer overlaps two steps), beside
     its floor (``StepFloor``: max(bytes / HBM bandwidth, flops / peak bf16) of each step's own sequences and cached
     context, with ``GPU_PEAKS``; "unknown GPU: no floor" elsewhere); host ms/step (all but waiting for results)
     and its packing share; then the launch probe (``launch_probe``: does the jitted step return before the
     device is done). Its own table is printed last, then the probe's line.
Otherwise a table is printed last. Every engine here is the sharded path at TP 1: one SPMD program over a one-GPU mesh,
weights placed by their logical axes, the kernels under shard_map, the sampler on the logits' vocabulary shards.

    python bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf [--impls pallas,xla] [--time-budget 240]
    python bench/gpu_engine.py --tokenizer .gpu/tokenizer.gguf --preset llama-3-8b --zeros-on-device --step-truth
"""

from __future__ import annotations

import argparse
import dataclasses
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


# Published peaks of the GPUs this bench knows (NVIDIA data sheets, SXM parts): HBM bytes/s and dense bf16 flop/s,
# keyed by words of ``jax.devices()[0].device_kind`` ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB" ...).
GPU_PEAKS = {
    ("H100",): (3.35e12, 989e12),
    ("H200",): (4.8e12, 989e12),
    ("A100", "80GB"): (2.0e12, 312e12),
}


def gpu_peaks(device_kind: str) -> tuple[float, float] | None:
    """(HBM bytes/s, bf16 flop/s) of a device kind in ``GPU_PEAKS``; None for any other device (a CPU included)."""
    for words, peaks in GPU_PEAKS.items():
        if all(w in device_kind for w in words):
            return peaks
    return None


@dataclasses.dataclass(frozen=True)
class StepFloor:
    """The least one step must move and compute, from ``jaxserve.aot.Plan``'s arithmetic (``Plan.floor_bytes``),
    with the step's own sequences and context instead of the plan's one ``seq_len``: the weights read once (a MoE:
    the experts its sequences can touch; the embedding table only by rows where the model has its own output head)
    and every sequence's cached KV (its ``start_pos`` tokens; the step's own tokens' K/V are computed, not read).
    Flops: 2 per active parameter and token for the layers, 2 per head parameter and sampled row for the output
    head (the embedding is a lookup); attention's own flops are left out, so the floor stays a lower bound."""

    plan: object  # jaxserve.aot.Plan, by arithmetic (no compile)
    head_params: int  # the output head's (vocab x hidden; the embedding table itself where tied)
    layer_params: int  # active parameters per token besides the embedding and the head

    @classmethod
    def of(cls, cfg, dtype: str = "bfloat16", page_size: int = 16) -> StepFloor:
        import math

        import jax.numpy as jnp

        from jaxserve.aot import plan
        from jaxserve.models.schema import param_schema

        # A GPU topology for the pool's plain byte arithmetic (no TPU tile padding); its chip's figures are unused.
        p = plan(cfg, "h200:1", compile=False, dtype=dtype, page_size=page_size, num_pages=1, seq_len=1)
        schema = param_schema(cfg)
        embed = math.prod(schema["embed"].shape)
        untied = "lm_head" in schema
        if untied:  # what Plan.floor_bytes leaves out of the weights: the table, looked up by rows
            p = dataclasses.replace(p, gathered_bytes_per_chip=embed * jnp.dtype(dtype).itemsize)
        return cls(p, embed, p.active_params - embed * (2 if untied else 1))

    def bytes(self, seqs: int, cached_tokens: int) -> float:
        p = self.plan  # planned at seq_len=1: kv_bytes_read(n) is the KV of n cached tokens
        return p.weight_bytes_read(seqs) - p.gathered_bytes_per_chip + p.kv_bytes_read(cached_tokens)

    def flops(self, tokens: int, rows: int) -> float:
        return 2.0 * (self.layer_params * tokens + self.head_params * rows)

    def seconds(self, peaks: tuple[float, float], seqs: int, tokens: int, rows: int, cached_tokens: int) -> float:
        """max(bytes / HBM bandwidth, flops / peak bf16 flop/s) of a step of ``seqs`` sequences computing ``tokens``
        tokens, sampling ``rows`` rows, over ``cached_tokens`` tokens of cached context in all."""
        bw, flops = peaks
        return max(self.bytes(seqs, cached_tokens) / bw, self.flops(tokens, rows) / flops)


class StepRecorder:
    """Wraps a runner's ``collect`` (on the instance) to note, per step, where its results reached the host, the
    time spent in ``collect`` (waiting for the device, then reading the results) and the step itself (its
    ``SchedulerOutput``: sequences, tokens, cached context). A step's wall time is the time since the previous
    step's results: under async scheduling the runner's own device timer spans launch to results, which includes
    the wait for the step before it (two steps overlap), while these intervals add up to the run's wall time."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[bool, object, float]] = []  # (decode_only, SchedulerOutput, wall seconds)
        self.collect_seconds = 0.0
        self.last = time.perf_counter()
        inner = runner.collect

        def collect(flight):
            t0 = time.perf_counter()
            result = inner(flight)
            t1 = time.perf_counter()
            if flight is not None:
                self.collect_seconds += t1 - t0
                self.steps.append((flight.decode_only, flight.sched, t1 - self.last))
                self.last = t1
            return result

        runner.collect = collect

    def start(self) -> None:
        self.steps, self.collect_seconds, self.last = [], 0.0, time.perf_counter()

    def close(self) -> None:
        del self.runner.collect  # the class's method again

    def per_kind(self, floor: StepFloor, peaks) -> dict[bool, tuple[int, float, float | None]]:
        """decode_only -> (steps, wall seconds, floor seconds or None) over the recorded steps."""
        out = {}
        for decode in (True, False):
            steps = [(s, w) for d, s, w in self.steps if d == decode]
            floor_s = None
            if peaks is not None:
                floor_s = sum(
                    floor.seconds(
                        peaks,
                        len(s.scheduled),
                        s.num_scheduled_tokens,
                        sum(c.sample * (1 + len(c.draft_token_ids)) for c in s.scheduled),
                        sum(c.start_pos for c in s.scheduled),
                    )
                    for s, _ in steps
                )
            out[decode] = (len(steps), sum(w for _, w in steps), floor_s)
        return out


def launch_probe(llm, prompts, steps: int) -> tuple[float, float, int]:
    """Whether the jitted step returns before the device is done: the runner's ``_launch`` wrapped on the instance,
    each decode-only step timed from call to return (dispatch) and to ``jax.block_until_ready`` on its result
    (ready). Blocks every step, so it runs apart from the timed runs. Returns the medians (dispatch s, ready s) over
    the last ``steps`` decode-only steps, and how many there were."""
    import statistics

    import jax

    from jaxserve import SamplingParams

    runner = llm.engine.runner
    inner = runner._launch
    times: list[tuple[float, float]] = []

    def launch(copy, step):
        t0 = time.perf_counter()
        result = inner(copy, step)
        t1 = time.perf_counter()
        if step is not None and step[0]:  # decode_only
            jax.block_until_ready(result)
            times.append((t1 - t0, time.perf_counter() - t0))
        return result

    runner._launch = launch
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)
    finally:
        del runner._launch
    times = times[-steps:]
    if not times:
        return float("nan"), float("nan"), 0
    return statistics.median(t for t, _ in times), statistics.median(r for _, r in times), len(times)


def step_truth(
    loaded,
    impl: str,
    counts: list[int],
    in_len: int,
    out_len: int,
    warm_len: int,
    probe_requests: int,
    probe_steps: int,
    deadline: float,
) -> None:
    """Output tok/s at each count of concurrent requests (``in_len`` random token ids in, ``out_len`` out, greedy,
    ignore_eos) at the engine's own default budgets for this platform, with decode-only and mixed ms per step
    beside their floors (``StepFloor``), host ms per step; then the launch probe (``launch_probe``). One engine for
    every count; each count is first run with ``warm_len`` tokens out (compiling the shapes it meets), then timed."""
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig, batching_defaults
    from jaxserve.engine.llm_engine import device_memory
    from jaxserve.utils import cdiv

    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    peaks = gpu_peaks(kind)
    page_size = EngineConfig().page_size
    floor = StepFloor.of(loaded.config, "bfloat16", page_size)
    default_seqs, _ = batching_defaults(backend, device_memory())
    # The KV pool: the engine's default (sized from the device's memory); on the CPU, what the workload needs.
    num_pages = max(counts) * cdiv(in_len + out_len, page_size) + 1 if backend == "cpu" else None
    llm = LLM(
        loaded,
        dtype="bfloat16",
        attention_impl=impl,
        num_pages=num_pages,
        max_num_seqs=max(default_seqs, max(counts)),
        max_model_len=in_len + out_len,
        compilation_cache=False,
        enable_prefix_caching=False,
    )
    runner, sched_cfg = llm.engine.runner, llm.engine.scheduler_config
    p = floor.plan
    log(
        f"step truth on {kind} ({backend}), attention {impl}: token budget {sched_cfg.max_num_batched_tokens} "
        f"(the engine's default here), max_num_seqs {sched_cfg.max_num_seqs}, {runner.num_pages} KV pages of "
        f"{page_size}, async scheduling {sched_cfg.async_scheduling}"
    )
    log(
        f"floor per step: weights {(p.weight_bytes_per_chip - p.gathered_bytes_per_chip) / 1e9:.3f} GB read once "
        f"(embedding table by rows: {p.gathered_bytes_per_chip / 1e9:.3f} GB left out), KV "
        f"{p.page_bytes_per_chip / p.page_size / 1024:.1f} KiB per cached token of each sequence, from each step's "
        f"own sequences and context (recorded per step, no approximation); flops 2 x {floor.layer_params / 1e9:.3f} B "
        f"params x tokens + 2 x {floor.head_params / 1e9:.3f} B head params x sampled rows (attention flops left "
        f"out); floor = max(bytes / HBM, flops / peak bf16)"
        + (f" at {peaks[0] / 1e12:.2f} TB/s, {peaks[1] / 1e12:.0f} Tflop/s" if peaks else "")
    )
    if peaks is None:
        log(f"unknown GPU: no floor ({kind!r} is not in GPU_PEAKS)")
    rec = StepRecorder(runner)
    rows: list[str] = []
    vocab = loaded.config.vocab_size
    ran, interrupted = [], False
    try:
        for n in counts:
            if time.perf_counter() > deadline:
                rows.append(f"| {n} | skipped (time budget) | | | | |")
                continue
            prompts = workload(n, in_len, in_len, vocab, seed=5)
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(
                workload(n, in_len, in_len, vocab, seed=6),
                SamplingParams(temperature=0.0, max_tokens=warm_len, ignore_eos=True),
                use_tqdm=False,
            )
            warm = time.perf_counter() - t
            compiled, before = runner.num_compilations, llm.engine.get_stats()["num_preemptions"]
            runner.reset_timers()
            rec.start()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            e = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
            ran.append(n)
            steps = runner.num_steps
            kinds = rec.per_kind(floor, peaks)
            cells = []
            for decode in (True, False):
                k, wall, floor_s = kinds[decode]
                if not k:
                    cells.append("none")
                    continue
                cell = f"{1e3 * wall / k:.2f}"
                if floor_s is not None:
                    cell += f" vs {1e3 * floor_s / k:.2f} ({wall / floor_s:.2f}x)"
                cells.append(cell)
            host = e - rec.collect_seconds  # the host loop's own time: all but waiting in collect
            recompiles = runner.num_compilations - compiled
            preempted = llm.engine.get_stats()["num_preemptions"] - before
            dev_dec = runner.decode_device_seconds / max(runner.decode_steps, 1)
            dev_mix = (runner.device_seconds - runner.decode_device_seconds) / max(steps - runner.decode_steps, 1)
            log(
                f"step truth {n} x ({in_len} in, {out_len} out): {e:.2f}s, {n * out_len / e:.0f} output tok/s; "
                f"{steps} steps ({kinds[True][0]} decode-only, {kinds[False][0]} mixed; {len(rec.steps)} recorded); "
                f"ms/step decode {cells[0]}, mixed {cells[1]}; host {1e3 * host / steps:.2f} ms/step (packing "
                f"{1e3 * runner.pack_seconds / steps:.2f}, rest {1e3 * (host - runner.pack_seconds) / steps:.2f}), "
                f"in collect {1e3 * rec.collect_seconds / steps:.2f}; runner's device timer (launch to results) "
                f"decode {1e3 * dev_dec:.2f}, mixed {1e3 * dev_mix:.2f} ms/step; warm-up ({warm_len} out) {warm:.0f}s, "
                f"{recompiles} compiles in the timed run, {preempted} preemptions"
            )
            rows.append(
                f"| {n} | {n * out_len / e:.0f} | {cells[0]} | {cells[1]} | {1e3 * host / steps:.2f} "
                f"({1e3 * runner.pack_seconds / steps:.2f}) | {kinds[True][0]} + {kinds[False][0]}"
                + (f" ({recompiles} compiles!)" if recompiles else "")
                + " |"
            )
    except Exception as ex:  # noqa: BLE001 - report what ran
        log(f"step truth: ERROR {type(ex).__name__}: {str(ex)[:1500]}")
        rows.append(f"| ERROR {type(ex).__name__} | | | | | |")
    except KeyboardInterrupt:  # the hard stop (timeout --signal=INT): print what ran
        interrupted = True
        rows.append("| interrupted (hard stop) | | | | | |")
    finally:
        rec.close()
    log(
        f"\n{loaded.name} on {kind}, attention {impl}, bf16; {in_len} random tokens in, {out_len} out, greedy, "
        f"ignore_eos; token budget {sched_cfg.max_num_batched_tokens}; ms/step = wall time between a step's results "
        "and the previous step's, vs the floor (ratio); host = all but waiting for results"
        + ("" if peaks else "; unknown GPU: no floor")
    )
    log(
        "| concurrency | output tok/s | decode ms/step vs floor | mixed ms/step vs floor | host ms/step (packing) "
        "| steps (decode + mixed) |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        log(r)
    if not ran or interrupted:  # the table first: the probe comes after it, so a hard stop in it loses nothing
        log("probe: not run (" + ("interrupted" if interrupted else "no count ran") + ")")
        return
    n = min(probe_requests, max(ran))
    try:
        dispatch, ready, k = launch_probe(
            llm, workload(n, in_len, in_len, vocab, seed=7), min(probe_steps, out_len - 1)
        )
    except Exception as ex:  # noqa: BLE001
        log(f"probe: ERROR {type(ex).__name__}: {str(ex)[:1500]}")
        return
    log(
        f"probe ({n} requests x {in_len} in, {k} decode-only steps, each blocked on): the jitted call returns in "
        f"{1e3 * dispatch:.2f} ms (dispatch), its results are ready at {1e3 * ready:.2f} ms; returned before done: "
        f"{'yes' if dispatch < 0.5 * ready else 'no'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tokenizer.gguf")
    ap.add_argument("--write-tokenizer", metavar="DIR")
    ap.add_argument("--impls", default="pallas,xla")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument(
        "--output-len", type=int, default=None, help="tokens out per request (default 128; 1024 with --step-truth)"
    )
    ap.add_argument("--input-len", type=int, default=1024, help="--step-truth: random tokens in per request")
    ap.add_argument("--time-budget", type=float, default=240.0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-single-stream", action="store_true", help="skip one stream, plain vs n-gram speculation")
    ap.add_argument("--preset", default="smollm2-135m", help="model shapes for the throughput runs")
    ap.add_argument("--zeros-on-device", action="store_true", help="bf16 zero weights made on the device")
    ap.add_argument("--random-on-device", action="store_true", help="bf16 random weights drawn on the device (MoE)")
    ap.add_argument("--quant-sweep", default="", help="quantization modes to time, e.g. bf16,int8,fp8,int4")
    ap.add_argument("--concurrency", default="1,64,256", help="concurrent requests for --quant-sweep, --step-truth")
    ap.add_argument(
        "--step-truth",
        action="store_true",
        help="only this: output tok/s, decode and mixed ms/step vs their floors, host ms/step per concurrency "
        "(--concurrency, --input-len, --output-len) at the engine's default budgets, then the launch probe",
    )
    ap.add_argument(
        "--warmup-output-len",
        type=int,
        default=None,
        help="--step-truth: tokens out of the warm-up run before each timed one (default: output-len / 8, at least 2)",
    )
    ap.add_argument("--probe-steps", type=int, default=20, help="--step-truth: decode-only steps the probe times")
    ap.add_argument(
        "--probe-requests",
        type=int,
        default=64,
        help="--step-truth: requests of the probe (at most the largest concurrency that ran)",
    )
    a = ap.parse_args()
    if a.output_len is None:
        a.output_len = 1024 if a.step_truth else 128
    if a.write_tokenizer:
        write_tokenizer(a.write_tokenizer)
        return 0
    import jax

    t0 = time.perf_counter()
    log(f"jax {jax.__version__} {jax.devices()}")
    impls = a.impls.split(",")
    if a.step_truth:
        loaded = random_model(
            a.tokenizer, preset=a.preset, zeros_on_device=a.zeros_on_device, random_on_device=a.random_on_device
        )
        step_truth(
            loaded,
            impls[0],
            [int(c) for c in a.concurrency.split(",")],
            a.input_len,
            a.output_len,
            a.warmup_output_len or max(2, a.output_len // 8),
            a.probe_requests,
            a.probe_steps,
            t0 + a.time_budget,
        )
        log(f"{time.perf_counter() - t0:.0f}s in all")
        return 0
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
