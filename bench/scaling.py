"""Tensor, data and pipeline parallelism on simulated CPU devices: the plumbing, then the throughput workload.

Part 1, "plumbing, not speed": a random Llama-shaped model (8 query and 8 KV heads, 4 layers) on 8 simulated CPU
devices sharing this machine's cores, for TP 1/2/4/8, TP x DP 1x2, 2x2, 4x2 and pipeline stages PP 2, 4 and PP 2 x
DP 2. It reports per-device bytes of the weights and of the KV pool (they must fall as 1/TP, and the layers' and
pool's as 1/PP), the steps and, with pipeline stages, the ticks, and output tokens/s (the same cores do all
devices' work, so a higher degree adds collectives and per-device overhead without adding compute: expect it to
fall). Pipeline layouts run twice: the 16 requests, which the scheduler spreads over S batches in flight (about one
tick a step), then one request alone, one batch in flight (S ticks a step: the bubble).

Part 2: bench/throughput.py's workload (default model, greedy) at TP 1 and TP 3 in the same invocation; TP 2 is
impossible for SmolLM2-135M's 9 query heads. Token agreement with TP 1 is reported.

    python bench/scaling.py [--skip-plumbing] [--skip-throughput] [--layouts 1x1x1 1x1x2] [--num-requests 64]
                            [--output-len 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# (tensor_parallel_size, data_parallel_size, pipeline_parallel_size)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (1, 2, 1), (2, 2, 1), (4, 2, 1), (1, 1, 2), (1, 1, 4), (1, 2, 2)]


def _per_device_bytes(tree) -> int:
    import jax

    dev = None
    total = 0
    for leaf in jax.tree.leaves(tree):
        dev = dev or leaf.addressable_shards[0].device
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev)
    return total


def plumbing(args) -> None:
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig
    from jaxserve.defaults import default_model_path
    from jaxserve.loading import LoadedModel
    from jaxserve.models.schema import random_params

    cfg = ModelConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=1024,
    )
    rng = np.random.default_rng(0)
    params = random_params(cfg, 0.05, rng)
    model = LoadedModel("random-llama", cfg, params, default_model_path())
    prompts = [rng.integers(3, 49000, size=128).tolist() for _ in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    print(
        f"\n## Plumbing: {cfg.num_layers} layers, D={cfg.hidden_size}, 8 q / 8 kv heads, V={cfg.vocab_size}; "
        f"16 prompts x 128 tokens, 32 output tokens; 8 simulated devices on {os.cpu_count()} cores\n"
    )
    print(
        "| TP x DP x PP | requests | weights / device (MiB) | KV pool / device (MiB) | steps | ticks | "
        "output tok/s | tokens = TP 1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    reference = None
    for tp, dp, pp in [x for x in LAYOUTS if args.layouts is None or "x".join(map(str, x)) in args.layouts]:
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            pipeline_parallel_size=pp,
            num_pages=256,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=512,
            compilation_cache=False,
        )
        llm.engine.warmup()
        runner = llm.engine.runner
        weights, pool = _per_device_bytes(runner.state), _per_device_bytes((runner.k_cache, runner.v_cache))
        for n in (16, 1) if pp > 1 else (16,):
            for r in llm.engine.replicas:
                r.runner.reset_timers()
            t0 = time.perf_counter()
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], greedy, use_tqdm=False)]
            rate = sum(map(len, outs)) / (time.perf_counter() - t0)
            reference = reference or outs
            steps = sum(r.runner.num_steps for r in llm.engine.replicas)
            ticks = sum(r.runner.num_ticks for r in llm.engine.replicas) if pp > 1 else "-"
            print(
                f"| {tp} x {dp} x {pp} | {n} | {weights / 2**20:.1f} | {pool / 2**20:.1f} | {steps} | {ticks} | "
                f"{rate:.0f} | {'yes' if outs == reference[:n] else 'NO'} |",
                flush=True,
            )


def throughput(args) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from throughput import make_workload, run_jaxserve

    from jaxserve.defaults import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    prompts = make_workload(load_tokenizer(default_model_path()), args.num_requests, 64, 512)
    print(
        f"\n## Throughput: {args.num_requests} requests, prompts 64-512 tokens, {args.output_len} output tokens, "
        f"greedy (bench/throughput.py's workload), float32\n"
    )
    print("| TP | wall (s) | output tok/s | vs TP 1 | warm-up (s) | recompiles | tokens = TP 1 |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for tp in (1, 3):
        r = run_jaxserve(prompts, args.output_len, 512, {"tensor_parallel_size": tp})
        base = base or r
        rate = args.num_requests * args.output_len / r["elapsed"]
        print(
            f"| {tp} | {r['elapsed']:.1f} | {rate:.0f} | {base['elapsed'] / r['elapsed']:.2f}x | "
            f"{r['warmup_s']:.0f} | {r['recompiles']} | {'yes' if r['tokens'] == base['tokens'] else 'NO'} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-plumbing", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--layouts", nargs="*", default=None, help="plumbing layouts TPxDPxPP to run (default: all)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    print(
        f"# bench/scaling.py on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    if not args.skip_plumbing:
        plumbing(args)
    if not args.skip_throughput:
        throughput(args)


if __name__ == "__main__":
    main()
