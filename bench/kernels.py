"""Benchmark and compiled correctness check of the attention kernels.

    python bench/kernels.py                      # decode timings on this machine's default backend
    python bench/kernels.py --check              # first: compiled kernels vs the reference, edge-case batches
    python bench/kernels.py --impls pallas,reference,jax_paged --batches 1,32,128 --contexts 512,2048,8192

Decode steps (one query token per sequence, every sequence ``context`` long) of one layer of a cache shaped
like Llama-3-8B's by default (32 query heads, 8 KV heads, head_dim 128, bf16, page 16). Each timing runs
``--iters`` steps inside one jitted ``fori_loop`` (alternating between two layers so nothing is hoisted),
so host dispatch is not counted. Reported: time per step, K/V bytes read per step / time, and that as a
fraction of the measured device copy bandwidth (read + write of a large array).

Implementations: ``pallas`` (our kernel for the platform: GPU Triton or TPU Mosaic; interpret mode on CPU,
so keep shapes tiny there), ``reference`` (the jnp reference), ``jax_paged`` (JAX's own
``jax.experimental.pallas.ops.gpu.paged_attention``, GPU only, on the same data transposed to its layout).
Only jax and numpy are needed: ``jaxserve.kernels`` must be importable (installed, or see gpu_check.sh).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import traceback
from operator import itemgetter

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxserve.kernels import write_kv_ref
from jaxserve.kernels._common import quantize_rows

from jaxserve import kernels

ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------ data
def decode_batch(batch, context, *, hq, hk, d, page, dtype, layers=2, seed=0):
    """One token per sequence, each with ``context`` tokens of context; pages shuffled over the pool."""
    pages_per_seq = -(-context // page)
    num_pages = batch * pages_per_seq + 1
    key = jax.random.key(seed)
    kq, kk, kv, kp = jax.random.split(key, 4)
    shape = (layers, num_pages, page, hk, d)
    k_cache = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    v_cache = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    table = jax.random.permutation(kp, num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    q = jax.random.normal(kq, (batch, hq, d), jnp.float32).astype(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        kv_lens=jnp.full((batch,), context, jnp.int32),
        page_indices=table.astype(jnp.int32),
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        num_seqs=jnp.int32(batch),
    )


def edge_batch(q_lens, kv_lens, *, hq, hk, d, page=16, dtype=jnp.float32, seed=0, pad_seqs=2, pad_tokens=5):
    """Mixed ragged batch with NaN in every cache slot no sequence owns (a stray read shows as NaN)."""
    rng = np.random.default_rng(seed)
    need = [-(-k // page) for k in kv_lens]
    pages_per_seq, num_pages = max(need) + 1, sum(need) + 3
    perm = rng.permutation(num_pages)
    table = np.full((len(q_lens) + pad_seqs, pages_per_seq), -1, np.int32)
    kc = rng.standard_normal((2, num_pages, page, hk, d)).astype(np.float32)
    vc = rng.standard_normal((2, num_pages, page, hk, d)).astype(np.float32)
    owned = np.zeros((num_pages, page), bool)
    i = 0
    for s, (n, kvl) in enumerate(zip(need, kv_lens)):
        table[s, :n] = perm[i : i + n]
        i += n
        for p in range(kvl):
            owned[table[s, p // page], p % page] = True
    kc[:, ~owned] = np.nan
    vc[:, ~owned] = np.nan
    cu = np.full(len(table) + 1, sum(q_lens), np.int32)
    cu[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kvl = np.zeros(len(table), np.int32)
    kvl[: len(kv_lens)] = kv_lens
    q = rng.standard_normal((sum(q_lens) + pad_tokens, hq, d)).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(kc, dtype),
        v_cache=jnp.asarray(vc, dtype),
        kv_lens=jnp.asarray(kvl),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.int32(len(q_lens)),
    )


def attend(impl, b, layer, **kw):
    return kernels.ragged_paged_attention(b["q"], b["k_cache"], b["v_cache"], layer, meta(b), impl=impl, **kw)


def meta(b: dict) -> kernels.AttentionBatch:
    """The batch's attention metadata."""
    return kernels.AttentionBatch(
        kv_lens=b["kv_lens"], page_indices=b["page_indices"], cu_q_lens=b["cu_q_lens"], num_seqs=b["num_seqs"]
    )


# ------------------------------------------------------------------------------------------ correctness
CHECKS = [
    # name, (q_lens, kv_lens), heads (q, kv), head_dim, kwargs
    ("mixed gqa4 d128", ([15, 16, 17, 0, 1, 1, 1, 5, 16], [15, 16, 17, 15, 16, 17, 1, 25, 48]), (8, 2), 128, {}),
    ("mixed gqa3 d64", ([15, 16, 17, 0, 1, 5], [15, 16, 17, 15, 17, 25]), (6, 2), 64, {}),
    ("mixed mha d256", ([15, 16, 17, 0, 1, 5], [15, 16, 17, 15, 17, 25]), (2, 2), 256, {}),
    ("mixed gqa8 window 7", ([17, 1, 5, 40], [17, 300, 25, 90]), (8, 1), 128, dict(sliding_window=7)),
    ("softcap 30 window 100", ([3, 1, 64], [500, 1000, 64]), (32, 8), 128, dict(soft_cap=30.0, sliding_window=100)),
    ("decode long contexts", ([1] * 6, [1, 16, 17, 2000, 4097, 999]), (32, 8), 128, {}),
    ("prefill 300 tokens", ([300, 2], [300, 1000]), (32, 8), 128, {}),
]


def check_case(label, make, backend, tol, kw) -> bool:
    """One compiled-kernel-vs-reference case (``make()`` builds its batch); logs and records it, never raises."""
    try:
        b = make()
        d = b["q"].shape[-1]
        out = np.asarray(attend("pallas", b, 1, backend=backend, sm_scale=d**-0.5, **kw), np.float32)
        ref = np.asarray(attend("reference", b, 1, sm_scale=d**-0.5, **kw), np.float32)
        err = float(np.max(np.abs(out - ref)))
        ok = bool(np.isfinite(out).all() and np.allclose(out, ref, atol=tol, rtol=tol))
        log(f"{label}: {'OK' if ok else 'FAIL'} max|err|={err:.2e} (tol {tol})")
        ROWS.append(dict(case=label, impl="pallas", result="OK" if ok else "FAIL", err=err))
        return ok
    except Exception as e:  # noqa: BLE001 -- keep going, report at the end
        log(f"{label}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
        ROWS.append(dict(case=label, impl="pallas", result=f"ERROR {type(e).__name__}"))
        return False


def fp8_pages(b: dict, kv) -> dict:
    return {**b, "k_cache": b["k_cache"].astype(kv), "v_cache": b["v_cache"].astype(kv)}


def int8_pages(b: dict) -> dict:
    """kv_cache_dtype="int8": the batch's pools as Int8Pages; NaN rows (poison) keep int8 values and a NaN scale."""

    def quantize(cache):
        x = cache.astype(jnp.float32)
        values, scales = quantize_rows(jnp.nan_to_num(x))
        return kernels.Int8Pages(values, jnp.where(jnp.isnan(x).any(-1), jnp.nan, scales))

    return {**b, "k_cache": quantize(b["k_cache"]), "v_cache": quantize(b["v_cache"])}


def check_write(label, backend, pools) -> bool:
    """The compiled K/V write vs the reference's, bit for bit (NaN == NaN), for ``pools(batch)`` -> (k, v)."""
    try:
        b = edge_batch([1] * 4, [5, 16, 17, 33], hq=8, hk=2, d=128, dtype=jnp.bfloat16)
        new = jax.random.normal(jax.random.key(3), (6, 2, 128), jnp.float32).astype(jnp.bfloat16)
        slots = jnp.array([3, -1, 40, 17, 63, -1], jnp.int32)
        args = (*pools(b), jnp.int32(1), new, -new, kernels.AttentionBatch(slot_mapping=slots))
        exp = write_kv_ref(*args)
        got = jax.jit(functools.partial(kernels.write_kv, impl="pallas", backend=backend))(*args)
        ok = all(
            np.array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32), equal_nan=True)
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exp), strict=True)
        )
        log(f"{label}: {'OK' if ok else 'FAIL'}")
        ROWS.append(dict(case=label, impl="pallas", result="OK" if ok else "FAIL"))
        return ok
    except Exception as e:  # noqa: BLE001
        log(f"{label}: ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
        ROWS.append(dict(case=label, impl="pallas", result=f"ERROR {type(e).__name__}"))
        return False


def run_checks(backend):
    """Compiled kernel vs the reference (float32 reference matmuls at full precision)."""
    failures = 0
    with jax.default_matmul_precision("highest"):
        for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
            for name, (q_lens, kv_lens), (hq, hk), d, kw in CHECKS:
                make = functools.partial(edge_batch, q_lens, kv_lens, hq=hq, hk=hk, d=d, dtype=dtype)
                failures += not check_case(f"check {name} {jnp.dtype(dtype).name}", make, backend, tol, kw)
        for kv in (jnp.float8_e4m3fn, jnp.float8_e5m2):  # kv_cache_dtype="fp8_e4m3" / "fp8_e5m2" under bf16 queries
            batch = functools.partial(
                edge_batch, [17, 1, 5, 40], [17, 300, 25, 90], hq=32, hk=8, d=128, dtype=jnp.bfloat16
            )
            make = lambda kv=kv, batch=batch: fp8_pages(batch(), kv)  # noqa: E731
            failures += not check_case(f"check fp8 pages {jnp.dtype(kv).name}", make, backend, 2e-2, {})
        batch = functools.partial(
            edge_batch, [17, 1, 5, 40], [17, 300, 25, 90], hq=32, hk=8, d=128, dtype=jnp.bfloat16
        )  # kv_cache_dtype="int8": Int8Pages under bf16 queries
        failures += not check_case("check int8 pages", lambda: int8_pages(batch()), backend, 2e-2, {})
        failures += not check_write("check write_kv bf16", backend, lambda b: (b["k_cache"], b["v_cache"]))
        failures += not check_write(
            "check write_kv int8 pages", backend, lambda b: itemgetter("k_cache", "v_cache")(int8_pages(b))
        )
    return failures


# ------------------------------------------------------------------------------------------ timing
def time_steps(step, args, iters):
    """Seconds per call of ``step(i, *args)``, iters calls in one jitted loop; best of 3."""

    @jax.jit
    def loop(*args):
        def body(i, acc):
            out = step(i, *args)  # step must depend on i, or XLA may hoist it out of the loop
            return acc + out[0, 0, 0].astype(jnp.float32)

        return lax.fori_loop(0, iters, body, jnp.float32(0))

    jax.block_until_ready(loop(*args))  # compile + warm up
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(loop(*args))
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def copy_bandwidth(num_bytes, iters=20):
    """Bytes/s of read + write of a large array on the default device."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)

    @jax.jit
    def loop(x):
        return lax.fori_loop(0, iters, lambda i, y: y + 1.0, x)

    jax.block_until_ready(loop(x))
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(loop(x))
        best = min(best, (time.perf_counter() - t) / iters)
    return 2 * num_bytes / best


def jax_paged_step(b, sm_scale):
    """JAX's GPU paged_attention on our data in its layout ([kv_heads, pages, page_size, head_dim])."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    k_pages = jnp.transpose(b["k_cache"][0], (2, 0, 1, 3))  # [K, pages, page, D], made outside the timed loop
    v_pages = jnp.transpose(b["v_cache"][0], (2, 0, 1, 3))
    q = b["q"] * jnp.asarray(sm_scale, b["q"].dtype)  # it has no scale argument

    def step(i, q, k_pages, v_pages, table, lens):
        q = jnp.where(i % 2 == 0, q, -q)  # one layer only: vary q instead so the call stays in the loop
        return jpa.paged_attention(q, k_pages, v_pages, table, lens)

    return step, (q, k_pages, v_pages, b["page_indices"], b["kv_lens"])


def bench_case(impl, batch, context, a, copy_bw):
    label = f"decode b={batch} ctx={context}"
    hq, hk, d, page = a.heads, a.kv_heads, a.head_dim, a.page_size
    dtype = jnp.dtype(a.dtype)
    kv_bytes = 2 * batch * context * hk * d * dtype.itemsize
    ref_bytes = batch * context * hk * d * 4 * 2  # the reference gathers K and V per token in float32
    if impl == "reference" and ref_bytes > a.max_ref_gb * 2**30:
        log(f"{label} {impl}: skipped (would gather {ref_bytes / 2**30:.1f} GiB > --max-ref-gb)")
        ROWS.append(dict(case=label, impl=impl, result="skipped"))
        return
    try:
        b = decode_batch(batch, context, hq=hq, hk=hk, d=d, page=page, dtype=dtype)
        sm_scale = d**-0.5
        if impl == "jax_paged":
            step, args = jax_paged_step(b, sm_scale)
        else:

            def step(i, q, kc, vc, batch):  # alternate layers, as lax.scan over layers would
                return kernels.ragged_paged_attention(
                    q, kc, vc, i % 2, batch, sm_scale=sm_scale, impl=impl, backend=a.backend
                )

            args = (b["q"], b["k_cache"], b["v_cache"], meta(b))
        sec = time_steps(step, args, a.iters)
        bw = kv_bytes / sec
        row = dict(
            case=label, impl=impl, result="OK", us=sec * 1e6, gbs=bw / 1e9, frac=(bw / copy_bw) if copy_bw else None
        )
        log(f"{label} {impl}: {sec * 1e6:.1f} us/step, {bw / 1e9:.1f} GB/s")
        ROWS.append(row)
        del b, args
    except Exception as e:  # noqa: BLE001 -- one failing case must not lose the others
        log(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[:2000]}")
        traceback.print_exc()
        ROWS.append(dict(case=label, impl=impl, result=f"ERROR {type(e).__name__}"))


def print_table(copy_bw):
    log("\n" + "=" * 96)
    log(
        f"jax {jax.__version__} | device {jax.devices()[0].device_kind} | "
        f"copy bandwidth (read+write) {copy_bw / 1e9:.0f} GB/s"
        if copy_bw
        else f"jax {jax.__version__}"
    )
    log(f"{'case':<38} {'impl':<10} {'result':<16} {'us/step':>10} {'KV GB/s':>9} {'% copy bw':>10} {'max err':>9}")
    for r in ROWS:
        us = f"{r['us']:.1f}" if "us" in r else ""
        gbs = f"{r['gbs']:.1f}" if "gbs" in r else ""
        frac = f"{100 * r['frac']:.0f}%" if r.get("frac") is not None else ""
        err = f"{r['err']:.1e}" if "err" in r else ""
        log(f"{r['case']:<38} {r['impl']:<10} {r['result']:<16} {us:>10} {gbs:>9} {frac:>10} {err:>9}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compiled correctness vs the reference first")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--impls", default="pallas,reference", help="comma list of pallas, reference, jax_paged")
    p.add_argument("--backend", choices=["gpu", "tpu"], default=None, help="which Pallas kernel (default: platform)")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--extra-cases", default="", help="more BxC cases, e.g. 64x2048, run with --extra-impls")
    p.add_argument("--extra-impls", default="pallas,jax_paged")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-ref-gb", type=float, default=24.0, help="skip reference cases gathering more than this")
    p.add_argument("--copy-mb", type=int, default=1024)
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds; later timing cases are skipped")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")

    failures = run_checks(a.backend) if (a.check or a.check_only) else 0
    copy_bw = None
    if not a.check_only:
        try:
            copy_bw = copy_bandwidth(a.copy_mb * 2**20)
            log(f"copy bandwidth (read+write): {copy_bw / 1e9:.1f} GB/s")
        except Exception as e:  # noqa: BLE001
            log(f"copy bandwidth: ERROR {type(e).__name__}: {e}")
        cases = [(int(b), int(c), a.impls) for b in a.batches.split(",") for c in a.contexts.split(",")]
        cases += [(*map(int, s.split("x")), a.extra_impls) for s in a.extra_cases.split(",") if s]
        for batch, context, impls in cases:
            for impl in impls.split(","):
                if time.perf_counter() - t0 > a.time_budget:
                    log(f"decode b={batch} ctx={context} {impl}: skipped (time budget)")
                    ROWS.append(dict(case=f"decode b={batch} ctx={context}", impl=impl, result="skipped (time)"))
                    continue
                bench_case(impl, batch, context, a, copy_bw)
    print_table(copy_bw)
    log(f"total {time.perf_counter() - t0:.0f} s; {failures} correctness failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
