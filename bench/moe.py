"""Mixture of experts on the CPU: what routing costs, and a tiny MoE's offline throughput against HF transformers.

    python bench/moe.py [--layer] [--offline] [--num-requests 32] [--output-len 64]

``--layer``: one MoE block (router, top-k, grouped ``ragged_dot`` products, combine) against a dense gated MLP with
the same active parameters (hidden ``k * F``), float32, for steps of 1 to 512 tokens; the median of several jitted
calls each. The ratio is what the routing, the sort by expert and the grouped products cost over plain products.

``--offline``: a random Qwen3-MoE checkpoint written by transformers (4 layers, hidden 256, 32 experts, top 4, the
default model's tokenizer), served by jaxserve (float32, the engine's defaults) and by HF transformers
(``generate``, batches of 8, left padding), the same prompts, greedy; output tokens/s and the ratio, and how many
requests' greedy tokens agree.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from pathlib import Path

LAYER = dict(D=1024, E=32, k=4, F=256)
TOKENS = (1, 16, 128, 512)


def _median(fn, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bench_layer() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.layers.moe import MoeSpec, moe_mlp

    D, E, k, F = LAYER["D"], LAYER["E"], LAYER["k"], LAYER["F"]
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.normal(0, 0.05, shape), jnp.float32)

    spec = MoeSpec(num_experts=E, top_k=k, intermediate_size=F)
    p = {"router": arr(D, E), "expert_gate": arr(E, D, F), "expert_up": arr(E, D, F), "expert_down": arr(E, F, D)}
    dense = {"w_gate": arr(D, k * F), "w_up": arr(D, k * F), "w_down": arr(k * F, D)}
    moe = jax.jit(lambda h, p: moe_mlp(h, p, spec))  # "auto": on the CPU gathered or blocked
    mlp = jax.jit(lambda h, w: (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"])
    rows = []
    for T in TOKENS:
        h = arr(T, D)
        t_moe = _median(lambda: moe(h, p).block_until_ready())  # noqa: B023
        t_mlp = _median(lambda: mlp(h, dense).block_until_ready())  # noqa: B023
        rows.append({"tokens": T, "moe_ms": t_moe * 1e3, "dense_ms": t_mlp * 1e3, "ratio": t_moe / t_mlp})
    return rows


def write_checkpoint(path: Path) -> None:
    import torch
    import transformers

    from jaxserve.defaults import default_model_path
    from jaxserve.loading import orbax_ckpt

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers 5 starts expert stacks at zero
        for name, p in model.named_parameters():
            if "experts" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    orbax_ckpt.copy_tokenizer(default_model_path(), path)


def bench_offline(num_requests: int, output_len: int) -> dict:
    import importlib.util

    import torch
    import transformers

    # throughput.py by its path: bench/ on sys.path would shadow the ``kernels`` package transformers looks for
    spec = importlib.util.spec_from_file_location("throughput", Path(__file__).resolve().parent / "throughput.py")
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)

    from jaxserve import LLM, SamplingParams

    random.seed(0)
    prompts = [[random.randrange(3, 49000) for _ in range(random.randrange(64, 257))] for _ in range(num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_checkpoint(path)
        llm = LLM(str(path), max_num_seqs=num_requests, max_model_len=1024)
        llm.engine.warmup()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ours_s = time.perf_counter() - t
        ours = [list(o.outputs[0].token_ids) for o in outs]
        del llm

        torch.set_num_threads(os.cpu_count())
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        t = time.perf_counter()
        theirs = throughput.hf_generate(hf, prompts, output_len, batch_size=8)
        hf_s = time.perf_counter() - t
    agree = sum(a == b for a, b in zip(ours, theirs))
    n_out = num_requests * output_len
    return {
        "jaxserve_tok_s": n_out / ours_s,
        "hf_tok_s": n_out / hf_s,
        "jaxserve_s": ours_s,
        "hf_s": hf_s,
        "ratio": hf_s / ours_s,
        "agree": agree,
        "n": num_requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", action="store_true")
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    if not (args.layer or args.offline):
        args.layer = args.offline = True
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}")
    if args.layer:
        print(f"\nMoE block vs a dense MLP of the same active parameters ({LAYER}), float32, median ms:")
        print("| tokens | MoE ms | dense ms | MoE / dense |\n|---|---|---|---|")
        for r in bench_layer():
            print(f"| {r['tokens']} | {r['moe_ms']:.3f} | {r['dense_ms']:.3f} | {r['ratio']:.2f}x |")
    if args.offline:
        r = bench_offline(args.num_requests, args.output_len)
        print(
            f"\ntiny Qwen3-MoE offline, {r['n']} requests x {args.output_len} tokens: jaxserve {r['jaxserve_tok_s']:.1f} "
            f"tok/s ({r['jaxserve_s']:.1f} s), HF transformers {r['hf_tok_s']:.1f} tok/s ({r['hf_s']:.1f} s): "
            f"{r['ratio']:.2f}x; greedy tokens identical in {r['agree']}/{r['n']} requests"
        )


if __name__ == "__main__":
    main()
