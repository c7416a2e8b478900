"""The MLP blocks of a layer, on its normed hidden states h [T, D] -> [T, D]: the gated MLP (``gated_mlp``, SwiGLU or
GeGLU: every dense layer) and the mixture of experts (``moe_block``: the routed experts through ``moe_fn``, and
DeepSeek's shared experts, a gated MLP every token runs beside them).

Each takes the config, h, one layer's parameters ``p`` (declared by ``jaxserve.models.schema.mlp_block`` /
``moe_block``) and its products ``mul``. The routed experts are the ``moe_fn`` the decoder is given
(``jaxserve.layers.moe.moe_mlp``, or its form sharded over the mesh), as attention is its ``attention_fn``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import Product

# moe_fn(h [T, D], one layer's routed-expert parameters {name: array}) -> [T, D] (``jaxserve.layers.moe``)
MoeFn = Callable[[jax.Array, dict], jax.Array]

DENSE_NAMES = ("w_gate", "w_up", "w_down")  # the dense MLP's matrices
SHARED_NAMES = ("shared_gate", "shared_up", "shared_down")  # DeepSeek's shared experts'
ROUTER_NAMES = ("router", "router_bias", "router_correction")


def is_routed(name: str) -> bool:
    """A parameter ``moe_fn`` reads: the router's (its matrix, gpt-oss's bias, DeepSeek-V3's correction) or an
    expert stack's (``expert_*``)."""
    return name in ROUTER_NAMES or name.startswith("expert_")


def gated_mlp(cfg: ModelConfig, h: jax.Array, mul: Product, names: tuple[str, str, str] = DENSE_NAMES) -> jax.Array:
    """``down(act(gate(h)) * up(h))`` with act silu (SwiGLU) or tanh-approximated gelu (GeGLU, ``cfg.hidden_act``);
    ``names`` are the three matrices (gate, up, down): the dense MLP's, or the shared experts'."""
    gate, up = mul(h, names[:2])
    act = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    return mul(act * up, names[2])


def moe_block(cfg: ModelConfig, h: jax.Array, p: dict[str, jax.Array], mul: Product, moe_fn: MoeFn) -> jax.Array:
    """The routed experts (``moe_fn`` on ``p``'s routed parameters), plus the shared experts' gated MLP when the
    model has them (``cfg.shared_expert_intermediate_size``)."""
    out = moe_fn(h, {n: w for n, w in p.items() if is_routed(n)})
    if cfg.shared_expert_intermediate_size:
        out = out + gated_mlp(cfg, h, mul, SHARED_NAMES)
    return out
