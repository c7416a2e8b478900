"""CPU benchmark of ragged paged attention: the jnp reference vs the XLA implementation, per layer.

    python bench/attention_cpu.py                        # every case, both implementations
    python bench/attention_cpu.py --cases decode --runs 9
    python bench/attention_cpu.py --pool full --mode scan  # a pool with distinct pages; layers in a loop
    python bench/attention_cpu.py --impls xla --block-q 32 --ctx-chunk 128 --cases prefill

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), page 16, float32. A case is T tokens over
S sequence slots with P pages per slot; each real sequence has a full context of P * 16 tokens with its query
chunk at the end of it; the hint passed to the XLA version is the longest chunk rounded up to a power of two
(``--hint none``: no hint; ``--hint tokens``: T). The page table is random: with ``--pool 140``
(the default) it draws from a 140-page pool, so the cache stays in the last-level cache; ``--pool full`` gives
every sequence its own pages (S * P + 1 of them), the way the engine's pool looks.

Modes: ``call`` times one jitted call per layer (median of ``--runs`` after a warm-up), which charges every call
for mapping fresh memory for its temporaries; ``scan`` runs ``--layers`` layers inside one jitted loop and
divides, which is how the model calls attention (inside ``lax.scan``). Both report wall milliseconds per layer.
Also reported: the speed-up over the reference on the same inputs, the max abs difference between the two, and
for decode the K/V bytes the sequences own divided by the time (GB/s).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxserve.kernels import AttentionBatch, ragged_paged_attention_ref
from jaxserve.kernels.attention.xla import ragged_paged_attention_xla

from jaxserve.utils import next_pow2

PAGE = 16
HQ, HK, D = 9, 3, 64
SM_SCALE = D**-0.5

# (name, T, S, P, query lengths of the real sequences); the first five are the shapes the reference was first
# measured on. "decode+prefill" is continuous batching's usual step: S - 1 decodes and one prefill chunk.
CASES = [
    ("mixed", 8, 4, 128, [2] * 4),
    ("mixed", 128, 4, 128, [32] * 4),
    ("decode", 64, 64, 64, [1] * 64),
    ("decode", 64, 64, 128, [1] * 64),
    ("mixed", 256, 16, 64, [16] * 16),
    ("decode", 64, 64, 32, [1] * 64),
    *[("prefill", t, s, p, [t // s] * s) for t in (256, 512) for s in (1, 2, 4) for p in (32, 64, 128)],
    ("decode+prefill", 256, 64, 64, [256 - 63] + [1] * 63),
    ("decode+prefill", 512, 32, 128, [512 - 31] + [1] * 31),
]


def make_inputs(t, s, p, q_lens, *, pool, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    num_pages = 140 if pool == "140" else s * p + 1
    k_cache = rng.standard_normal((layers, num_pages, PAGE, HK, D), dtype=np.float32)
    v_cache = rng.standard_normal((layers, num_pages, PAGE, HK, D), dtype=np.float32)
    if pool == "140":
        table = rng.integers(0, num_pages, (s, p))
    else:
        table = rng.permutation(num_pages)[: s * p].reshape(s, p)
    n = len(q_lens)  # real sequences; the rest of the S slots are padding
    cu = np.full(s + 1, sum(q_lens))
    cu[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(s, np.int32)
    kv[:n] = p * PAGE
    q = rng.standard_normal((t, HQ, D), dtype=np.float32)
    args = (
        jnp.asarray(q),
        jnp.asarray(k_cache),
        jnp.asarray(v_cache),
        jnp.int32(1),
        AttentionBatch(
            kv_lens=jnp.asarray(kv),
            page_indices=jnp.asarray(table, jnp.int32),
            cu_q_lens=jnp.asarray(cu, jnp.int32),
            num_seqs=jnp.int32(n),
        ),
    )
    kv_bytes = 2 * n * p * PAGE * HK * D * 4
    return args, kv_bytes


def per_layer(fn, mode, layers):
    """A jitted function of the attention inputs whose wall time / ``layers`` is the time of one layer."""
    if mode == "call":
        return jax.jit(fn), 1

    def looped(q, k_cache, v_cache, layer, batch):
        def body(i, acc):  # alternate layers so nothing is loop-invariant
            return acc + fn(q, k_cache, v_cache, i % k_cache.shape[0], batch)

        return lax.fori_loop(0, layers, body, jnp.zeros_like(q))

    return jax.jit(looped), layers


def time_ms(fn, args, runs):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names, e.g. decode,T=512")
    ap.add_argument("--impls", default="reference,xla")
    ap.add_argument("--pool", choices=("140", "full"), default="140")
    ap.add_argument("--mode", choices=("call", "scan"), default="call")
    ap.add_argument("--layers", type=int, default=4, help="layers per timed loop in --mode scan")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--hint",
        choices=("chunk", "none", "tokens"),
        default="chunk",
        help="max_q_len for the XLA version: longest chunk (pow2), None, or T (a loose bound)",
    )
    ap.add_argument("--block-q", type=int, default=None)
    ap.add_argument("--ctx-chunk", type=int, default=None)
    ap.add_argument("--decode-chunk", type=int, default=None)
    a = ap.parse_args()
    impls = a.impls.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; pool={a.pool} mode={a.mode} runs={a.runs}")
    print(f"{'case':30s} {'hint':>4s} {'ref ms':>8s} {'xla ms':>8s} {'speedup':>8s} {'KV GB/s':>8s} {'max err':>8s}")
    for name, t, s, p, q_lens in CASES:
        label = f"{name} T={t} S={s} P={p}"
        if a.cases and not any(c in label for c in a.cases.split(",")):
            continue
        args, kv_bytes = make_inputs(t, s, p, q_lens, pool=a.pool)
        hint = {"chunk": next_pow2(max(q_lens)), "none": None, "tokens": t}[a.hint]
        fns = {
            "reference": functools.partial(ragged_paged_attention_ref, sm_scale=SM_SCALE),
            "xla": functools.partial(
                ragged_paged_attention_xla,
                sm_scale=SM_SCALE,
                max_q_len=hint,
                block_q=a.block_q,
                ctx_chunk=a.ctx_chunk,
                decode_chunk=a.decode_chunk,
            ),
        }
        ms, outs = {}, {}
        for impl in impls:
            f, n = per_layer(fns[impl], a.mode, a.layers)
            ms[impl] = time_ms(f, args, a.runs) / n
            outs[impl] = jax.jit(fns[impl])(*args)
        ref_ms, xla_ms = ms.get("reference", float("nan")), ms.get("xla", float("nan"))
        err = float(jnp.max(jnp.abs(outs["reference"] - outs["xla"]))) if len(outs) == 2 else float("nan")
        gbs = kv_bytes / (xla_ms * 1e6) if name == "decode" else float("nan")
        print(
            f"{label:30s} {hint!s:>4s} {ref_ms:8.2f} {xla_ms:8.2f} {ref_ms / xla_ms:7.1f}x {gbs:8.1f} {err:8.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
