"""What a MoE layer moves between chips under expert parallelism: the ``psum`` combine jaxserve compiles, read from
the TPU HLO (ahead of time, no TPU needed), against an all-to-all dispatch by arithmetic.

jaxserve's attention is tensor parallel, so the hidden states entering the MoE are already on every chip: each chip
runs its own experts for every token and one all-reduce of [T, D] sums the outputs. The alternative the peers use
with data-parallel attention: tokens split over the chips, sent to their experts' chips (``ragged_all_to_all``,
T k / n slots a chip), computed, sent back, then gathered again for the next (tensor-parallel) attention.

Per chip, with n chips, T tokens, hidden D, b bytes a value (ring collectives):
  psum combine                 2 (n - 1) / n * T D b
  all-to-all dispatch + back   2 (n - 1) / n * T k D b / n   (+ (n - 1) / n * T D b to gather the tokens again)

    python bench/moe_collectives.py --model qwen3-30b-a3b --topology v5e:2x4
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.aot import no_persistent_cache, topology_devices
from jaxserve.config import load_preset
from jaxserve.models.schema import moe_block
from jaxserve.parallel.sharding import logical_spec, make_mesh, rules_for, shard_moe

_COLLECTIVES = ("all-reduce", "all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "s8": 1, "u8": 1}


def hlo_collectives(hlo: str) -> list[tuple[str, int]]:
    """(op, result bytes) of each collective in a compiled module's text (async pairs counted once, at -start)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+([\w-]+)\(", line)
        if not m:
            continue
        dtype, dims, op = m.groups()
        op = op.removesuffix("-start")
        if op in _COLLECTIVES and not m.group(3).endswith("-done"):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out.append((op, n * _BYTES.get(dtype, 4)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--topology", default="v5e:2x4")
    ap.add_argument("--tokens", default="1,8,64,256,2048")
    args = ap.parse_args()
    cfg = load_preset(args.model)
    devices = topology_devices(args.topology)
    n = len(devices)
    mesh = make_mesh(n, devices)
    rules = rules_for(cfg, mesh, expert_parallel=True)
    dt = jnp.bfloat16
    b = jnp.dtype(dt).itemsize
    params = {
        name: jax.ShapeDtypeStruct(
            s.shape[1:],
            jnp.float32 if s.kind == "router" else dt,
            sharding=NamedSharding(mesh, logical_spec(name, s.shape[1:], s.axes[1:], mesh, rules)),
        )
        for name, s in moe_block(cfg).items()
    }
    moe = shard_moe(cfg, mesh, expert_parallel=True, impl="megablox", interpret=False)
    D, k = cfg.hidden_size, cfg.num_experts_per_tok
    print(
        f"{args.model} MoE layer, expert parallel over {args.topology} ({n} chips), {jnp.dtype(dt).name}, "
        f"D {D}, top {k} of {cfg.num_experts}; KiB per chip per layer"
    )
    print(
        f"{'tokens':>7} {'HLO collectives (result bytes)':<34} {'psum moves':>11} {'a2a moves':>10} "
        f"{'a2a + gather':>13}"
    )
    with no_persistent_cache():
        for T in (int(t) for t in args.tokens.split(",")):
            h = jax.ShapeDtypeStruct((T, D), dt, sharding=NamedSharding(mesh, P()))
            with jax.set_mesh(mesh):
                hlo = jax.jit(moe).lower(h, params).compile().as_text()
            found = hlo_collectives(hlo)
            psum = sum(2 * (n - 1) / n * nb for op, nb in found if op == "all-reduce")
            a2a = 2 * (n - 1) / n * T * k * D * b / n
            gather = (n - 1) / n * T * D * b
            listed = ", ".join(f"{op} {nb / 1024:.0f}K" for op, nb in found) or "none"
            print(f"{T:>7} {listed:<34} {psum / 1024:>11.1f} {a2a / 1024:>10.1f} {(a2a + gather) / 1024:>13.1f}")


if __name__ == "__main__":
    main()
