"""The mixture-of-experts MLP block: the router's product, then ``jaxserve.kernels.moe_experts`` (routing, the
experts' grouped products, the combine).

One layer's parameters, by name (:func:`moe_param_shapes`; the layout the schema will stack over the layers, a
leading ``layers`` axis added, as the dense MLP's ``w_gate`` / ``w_up`` / ``w_down``):

  router            [D, E]      (embed, routes)          the router, ``h @ router`` (HF: ``gate.weight`` /
                                                         ``router.weight`` [E, D], transposed on load)
  router_bias       [E]         (routes,)                gpt-oss only
  expert_gate       [E, D, F]   (experts, embed, expert_mlp) each expert's gate projection, [in, out]
  expert_up         [E, D, F]   (experts, embed, expert_mlp) each expert's up projection
  expert_down       [E, F, D]   (experts, expert_mlp, embed) each expert's down projection
  expert_gate_bias  [E, F], expert_up_bias [E, F], expert_down_bias [E, D]   gpt-oss only

Matrices are [in, out] per expert like every linear of the schema, so a layer scan's slice of a stacked
[L, E, D, F] parameter is the kernel's [E, D, F]. From transformers 5.x's tensors (``F`` the expert's intermediate
size): Mixtral / Qwen3-MoE ``experts.gate_up_proj`` [E, 2F, D] holds gate then up, ``experts.down_proj`` [E, D, F]
(both [out, in]: ``expert_gate = gate_up_proj[:, :F].transpose(0, 2, 1)``, ``expert_down = down_proj.transpose(0,
2, 1)``); gpt-oss ``experts.gate_up_proj`` [E, D, 2F] interleaves gate (even columns) and up (odd), already [in, out]
(``expert_gate = gate_up_proj[..., ::2]``), its ``gate_up_proj_bias`` [E, 2F] likewise, ``down_proj`` [E, F, D].
Names are distinct from the dense MLP's so that a model can hold both kinds of block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve import kernels
from jaxserve.kernels.moe.reference import ACTIVATIONS, route_grouped

ROUTINGS = ("softmax", "grouped_sigmoid", "grouped_softmax")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """What a family's MoE block is.

    ``renormalize``: softmax over the k chosen logits (Mixtral, Qwen3-MoE ``norm_topk_prob=True``, gpt-oss), or the
    chosen experts' probabilities of the softmax over all (Qwen3-MoE ``norm_topk_prob=False``).
    ``activation``: "swiglu", or gpt-oss's "swiglu_clamped" with ``swiglu_alpha`` / ``swiglu_limit``.
    ``router_bias`` / ``expert_bias``: the block has a router bias / per-expert gate, up and down biases (gpt-oss).
    ``routing``: "softmax" (``kernels.route``), or DeepSeek's grouped routings (``kernels.moe.route_grouped`` with
    ``num_groups`` / ``top_groups`` / ``scaling``): V3's "grouped_sigmoid" (with the layer's ``router_correction``
    bias), V2's "grouped_softmax".
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool = True
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_bias: bool = False
    expert_bias: bool = False
    routing: str = "softmax"
    num_groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0

    @classmethod
    def of(cls, cfg) -> MoeSpec:
        """The MoE block of a ``ModelConfig`` with experts."""
        return cls(
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            intermediate_size=cfg.expert_intermediate_size,
            renormalize=cfg.norm_topk_prob,
            activation=cfg.moe_activation,
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
            router_bias=cfg.moe_router_bias,
            expert_bias=cfg.moe_expert_bias,
            routing=cfg.moe_routing,
            num_groups=cfg.n_group,
            top_groups=cfg.topk_group,
            scaling=cfg.routed_scaling_factor,
        )

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoeSpec.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoeSpec.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoeSpec.routing must be one of {ROUTINGS}, got {self.routing!r}")

    def route(self, h: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """The routing of the normed hidden states h [T, D] with one layer's parameters -> (expert ids [T, k],
        combine weights [T, k] float32)."""
        logits = router_logits(h, p["router"])
        if self.routing != "softmax":
            return route_grouped(
                logits,
                self.top_k,
                num_groups=self.num_groups,
                top_groups=self.top_groups,
                correction_bias=p.get("router_correction"),
                renormalize=self.renormalize,
                scaling=self.scaling,
                scoring=self.routing.removeprefix("grouped_"),
            )
        return kernels.route(logits, self.top_k, renormalize=self.renormalize, bias=p.get("router_bias"))


def moe_param_shapes(hidden_size: int, spec: MoeSpec) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """One layer's MoE parameters: ``{name: (shape, logical axes)}``, in the module docstring's layout."""
    D, E, F = hidden_size, spec.num_experts, spec.intermediate_size
    shapes = {
        "router": ((D, E), ("embed", "routes")),
        "expert_gate": ((E, D, F), ("experts", "embed", "expert_mlp")),
        "expert_up": ((E, D, F), ("experts", "embed", "expert_mlp")),
        "expert_down": ((E, F, D), ("experts", "expert_mlp", "embed")),
    }
    if spec.router_bias:
        shapes["router_bias"] = ((E,), ("routes",))
    if spec.expert_bias:
        shapes["expert_gate_bias"] = ((E, F), ("experts", "expert_mlp"))
        shapes["expert_up_bias"] = ((E, F), ("experts", "expert_mlp"))
        shapes["expert_down_bias"] = ((E, D), ("experts", "embed"))
    return shapes


def router_logits(h: jax.Array, router: jax.Array) -> jax.Array:
    """h [T, D] @ router [D, E] -> [T, E] float32 (the bias, if any, is added by the routing)."""
    return jnp.dot(h, router.astype(h.dtype), preferred_element_type=jnp.float32)


def moe_mlp(
    h: jax.Array, p: dict[str, jax.Array], spec: MoeSpec, *, impl: str = "auto", interpret: bool | None = None
) -> jax.Array:
    """The MoE block on the normed hidden states h [T, D] with one layer's parameters ``p`` (names above)
    -> [T, D] in h.dtype. ``impl`` / ``interpret``: ``jaxserve.kernels.moe_experts``'s."""
    return kernels.moe_experts(
        h,
        spec.route(h, p),
        p["expert_gate"],
        p["expert_up"],
        p["expert_down"],
        activation=spec.activation,
        gate_bias=p.get("expert_gate_bias") if spec.expert_bias else None,
        up_bias=p.get("expert_up_bias") if spec.expert_bias else None,
        down_bias=p.get("expert_down_bias") if spec.expert_bias else None,
        swiglu_alpha=spec.swiglu_alpha,
        swiglu_limit=spec.swiglu_limit,
        impl=impl,
        interpret=interpret,
    )
