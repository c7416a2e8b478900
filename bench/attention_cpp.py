"""The C++ paged attention (``attention_cpu.paged_attention``) in a 64-sequence decode step, per layer, per KV dtype.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, 30 layers, pages of 16), one query token per
sequence, contexts drawn from 128-575 tokens (the offline workload's mid-decode lengths), every sequence on its own
pages in random order. ``--layers 30`` calls every layer of the pool inside one jit, so the K/V comes from DRAM as
in a real step; ``--layers 1`` calls layer 0 thirty times, so it stays in the caches (the kernel's compute).
Prints ms per layer (median of ``--runs``), the K/V bytes read per second, and the largest difference from the jnp
reference (float32 products, so within ~1e-6).

    python bench/attention_cpp.py [--dtypes float32 bfloat16 int8] [--layers 30] [--seqs 64] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jaxserve.kernels import AttentionBatch, Int8Pages  # noqa: E402
from jaxserve.kernels._common import quantize_rows  # noqa: E402
from jaxserve.kernels.attention import cpu as attention_cpu  # noqa: E402
from jaxserve.kernels.attention import reference  # noqa: E402
from jaxserve.kernels.cpu import ffi as cpu_ffi  # noqa: E402

LAYERS, PAGE, HK, HQ, D = 30, 16, 3, 9, 64


def pool(rng, lens):
    """A page table giving each sequence its own pages, in random order, and the pool's page count."""
    need = [(n + PAGE - 1) // PAGE for n in lens]
    perm = rng.permutation(sum(need) + 1)
    table = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for s, k in enumerate(need):
        table[s, :k] = perm[at : at + k]
        at += k
    return table, sum(need) + 1


def caches(rng, pages, dtype):
    k, v = (rng.standard_normal((LAYERS, pages, PAGE, HK, D), np.float32) for _ in range(2))
    if dtype == "int8":
        return tuple(Int8Pages(*quantize_rows(jnp.asarray(x))) for x in (k, v))
    return jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    ap.add_argument("--layers", type=int, default=LAYERS, help="distinct layers per call (1: cache-resident)")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    assert cpu_ffi.available(), cpu_ffi.unavailable_reason()
    rng = np.random.default_rng(0)
    lens = rng.integers(128, 576, args.seqs).astype(np.int32)
    table, pages = pool(rng, lens)
    cu = np.arange(args.seqs + 1, dtype=np.int32)
    q = jnp.asarray(rng.standard_normal((args.seqs, HQ, D), np.float32))
    batch = AttentionBatch(
        kv_lens=jnp.asarray(lens), page_indices=jnp.asarray(table), cu_q_lens=jnp.asarray(cu), num_seqs=args.seqs
    )
    print(
        f"{args.seqs} sequences, contexts {lens.min()}-{lens.max()} (mean {lens.mean():.0f}), {pages} pages a "
        f"layer, {args.layers} distinct layer(s) a call\n"
    )
    print("| KV dtype | ms per layer | K/V GB/s | max abs diff from the reference |\n|---|---|---|---|")
    for dtype in args.dtypes:
        kc, vc = caches(rng, pages, dtype)

        def attend(layer, qi=q, kc=kc, vc=vc):
            return attention_cpu.paged_attention(qi, kc, vc, layer, batch, sm_scale=D**-0.5, soft_cap=None)

        # each call its own queries: XLA would merge identical calls (same layer, same inputs) into one
        step = jax.jit(lambda: sum(attend(i % args.layers, q * (1 + i / 1024)) for i in range(LAYERS)))
        step().block_until_ready()
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            step().block_until_ready()
            times.append((time.perf_counter() - t) / LAYERS)
        ms = statistics.median(times) * 1e3
        row_bytes = HK * D * (1 if dtype == "int8" else jnp.dtype(dtype).itemsize) + (HK * 4 if dtype == "int8" else 0)
        gbs = 2 * float(lens.sum()) * row_bytes / (ms / 1e3) / 1e9
        ref = reference.ragged_paged_attention_ref(q, kc, vc, 0, batch, sm_scale=D**-0.5)
        diff = float(jnp.abs(ref - attend(0)).max())
        print(f"| {dtype} | {ms:.3f} | {gbs:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
