"""Mixture of experts: routing, the dense reference (the contract), the grouped implementation whose grouped
products run on ``lax.ragged_dot`` (portable) or megablox ``gmm`` (Pallas TPU), and ``moe_experts``
(``dispatch.py``), the entry point that routes and picks an implementation."""

from jaxserve.kernels.moe.dispatch import moe_experts
from jaxserve.kernels.moe.grouped import megablox_tiling, moe_blocked, moe_gathered, moe_grouped, sort_by_expert
from jaxserve.kernels.moe.reference import ACTIVATIONS, activate, combine_matrix, moe_ref, route, route_grouped

__all__ = [
    "ACTIVATIONS",
    "activate",
    "combine_matrix",
    "megablox_tiling",
    "moe_blocked",
    "moe_experts",
    "moe_gathered",
    "moe_grouped",
    "moe_ref",
    "route",
    "route_grouped",
    "sort_by_expert",
]
