"""One row through the default model's matrices: the C++ products for few rows against XLA's float32 product.

The shapes of SmolLM2-135M (7 matrices x 30 layers in one ``lax.scan``, then the [V, D] output projection), random
weights, one float32 row, as one request's decode step runs them on one CPU device. Prints ms per "token" and the
weight bytes read per second, per mode:

- ``float32``: XLA's own products on float32 weights (the scan's slices), and its output projection;
- ``float32-cpp``: ``matmul_cpu.matmul_rows`` on the float32 stacks, each layer's matrix read in place (what one
  request's steps run on one CPU device), XLA's output projection;
- ``bf16``: ``matmul_cpu.matmul_rows`` on bfloat16 weights;
- ``int8`` / ``int4``: ``matmul_cpu.matmul_quant_rows`` on quantized weights (int4 in groups of 32, as the default
  model's Q4_1 file).

    python bench/rows_products.py [--modes float32 float32-cpp bf16 int8 int4] [--rows 1] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

LAYERS = 30
SHAPES = {
    "wq": (576, 576),
    "wk": (576, 192),
    "wv": (576, 192),
    "wo": (576, 576),
    "w_gate": (576, 1536),
    "w_up": (576, 1536),
    "w_down": (1536, 576),
}
VOCAB = 49152


def weights(mode: str) -> dict:
    import jax

    from jaxserve import quant
    from jaxserve.layers.linear import pack_bf16

    def convert(w, axis: int):
        if mode.startswith("float32"):
            return w
        if mode == "bf16":  # the layers' [K, N] matrices packed; the output projection as [D, V], as the runner
            return pack_bf16(w) if axis == -2 else w.T.astype(jax.numpy.bfloat16)
        return quant.quantize(w, mode, axis=axis, group=32)

    ws = {
        name: convert(jax.random.normal(jax.random.key(i), (LAYERS, k, n)), -2)
        for i, (name, (k, n)) in enumerate(SHAPES.items())
    }
    ws["output"] = convert(jax.random.normal(jax.random.key(99), (VOCAB, 576)), -1)
    return ws


def step_fn(mode: str):
    import jax
    import jax.numpy as jnp
    from jaxserve.kernels.matmul import cpu as matmul_cpu

    def layer(h, mul):
        a = mul(h, "wq") + mul(h, "wo")
        b = mul(h, "wk").sum() + mul(h, "wv").sum()
        g = mul(h, "w_gate") * mul(h, "w_up")
        return h + 1e-3 * (a + b + mul(g, "w_down"))

    @jax.jit
    def step(x, ws):
        if mode == "float32":  # the scan slices each layer's matrices, as the model's float32 path does
            layers = {n: ws[n] for n in SHAPES}
            h = jax.lax.scan(lambda h, p: (layer(h, lambda x, n: x @ p[n]), None), x, layers)[0]
            return h @ ws["output"].T
        ids = jnp.arange(LAYERS, dtype=jnp.int32)
        h = jax.lax.scan(lambda h, i: (layer(h, lambda x, n: matmul_cpu.ROWS(x, ws[n], i)), None), x, ids)[0]
        return h @ ws["output"].T if mode == "float32-cpp" else matmul_cpu.ROWS(h, ws["output"])

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ["float32", "float32-cpp", "bf16", "int8", "int4", "w8a8"]
    ap.add_argument("--modes", nargs="+", default=modes, choices=modes)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    x = jnp.ones((args.rows, 576), jnp.float32)
    print("| mode | ms per token | weight MB | GB/s |\n|---|---|---|---|")
    for mode in args.modes:
        ws, fn = weights(mode), step_fn(mode)
        fn(x, ws).block_until_ready()
        nbytes = sum(a.nbytes for a in jax.tree.leaves(ws))
        best = float("inf")
        for _ in range(3):  # the best of 3 runs of ``repeats`` steps
            t = time.perf_counter()
            for _ in range(args.repeats):
                out = fn(x, ws)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - t) / args.repeats)
        print(f"| {mode} | {best * 1e3:.2f} | {nbytes / 1e6:.0f} | {nbytes / best / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
