"""The mixture-of-experts entry point: checks a call's shapes, routes the logits (unless given a routing), and runs
the experts on the implementation ``impl`` picks for this platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxserve.kernels._common import settle_tpu_interpret
from jaxserve.kernels.dispatch import platform
from jaxserve.kernels.matmul.qarray import QArray, dequantize
from jaxserve.kernels.moe.grouped import moe_blocked, moe_gathered, moe_grouped
from jaxserve.kernels.moe.reference import moe_ref, route

IMPLS = ("auto", "ragged", "megablox", "gather", "blocked", "reference")


def moe_experts(
    x: jax.Array,
    router: jax.Array | tuple[jax.Array, jax.Array],
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int | None = None,
    renormalize: bool = True,
    activation: str = "swiglu",
    router_bias: jax.Array | None = None,
    gate_bias: jax.Array | None = None,
    up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    impl: str = "auto",
    interpret: bool | None = None,
    tiling: tuple[int, int, int] | None = None,
) -> jax.Array:
    """A mixture-of-experts MLP over the step's tokens (layouts and semantics: ``moe/reference.py``).

    Args:
      x: [T, D] tokens.
      router: the router's logits [T, E] (routed here by ``route``: ``top_k``, ``renormalize``, ``router_bias``),
        or a routing already made, (expert ids [T, k] int, combine weights [T, k]).
      w_gate, w_up: [E, D, F] expert stacks; w_down: [E, F, D]; float, or quantized (``QArray`` grouped along D,
        F: dequantized inside the step to x's dtype; with fewer token slots than experts, as in decode, every
        implementation gathers the chosen experts and dequantizes only those).
      top_k: experts per token (with logits; taken from the ids' shape with a routing).
      renormalize: with logits, softmax over the chosen k (True) or the chosen k's softmax-over-all probabilities.
      activation: "swiglu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss, with ``swiglu_alpha`` and
        ``swiglu_limit``).
      router_bias: [E] added to the logits (gpt-oss); gate_bias, up_bias: [E, F]; down_bias: [E, D].
      impl: "auto" (megablox on a TPU, ragged on a GPU; on the CPU gather for steps of fewer slots than experts,
        else blocked), "ragged" (``lax.ragged_dot``, any backend), "megablox" (Pallas TPU ``gmm``; off a TPU in
        interpret mode unless ``interpret`` says otherwise), "gather" (each slot's expert matrices gathered:
        ``moe_gathered``), "blocked" (a loop over experts and blocks of their rows: ``moe_blocked``), "reference"
        (every expert on every token: tests only).
      tiling: megablox's (tm, tk, tn) for its three products (default ``grouped.megablox_tiling``).

    Returns:
      [T, D] in x.dtype.

    Raises:
      ValueError: a bad impl or activation, or inconsistent shapes (naming the argument).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    T, D = x.shape
    if any(len(w.shape) != 3 for w in (w_gate, w_up, w_down)):
        raise ValueError(
            f"w_gate, w_up must be [E, D, F] and w_down [E, F, D], got {w_gate.shape}, {w_up.shape}, {w_down.shape}"
        )
    E, _, F = w_gate.shape
    if w_gate.shape != (E, D, F):
        raise ValueError(f"w_gate must be [E, D, F] with D = x's hidden size {D}, got {w_gate.shape}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up must match w_gate's [E, D, F] = {w_gate.shape}, got {w_up.shape}")
    if w_down.shape != (E, F, D):
        raise ValueError(f"w_down must be [E, F, D] = {(E, F, D)} (w_gate's experts and F), got {w_down.shape}")
    for name, b, shape in (
        ("gate_bias", gate_bias, (E, F)),
        ("up_bias", up_bias, (E, F)),
        ("down_bias", down_bias, (E, D)),
    ):
        if b is not None and jnp.shape(b) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got shape {jnp.shape(b)}")
    if activation not in ("swiglu", "swiglu_clamped"):
        raise ValueError(f"activation must be 'swiglu' or 'swiglu_clamped', got {activation!r}")
    if isinstance(router, tuple):
        ids, weights = router
        if router_bias is not None:
            raise ValueError("router_bias applies to router logits, not to a routing (ids, weights) already made")
        if ids.ndim != 2 or ids.shape[0] != T or weights.shape != ids.shape:
            raise ValueError(f"router (ids, weights) must both be [T={T}, k], got {ids.shape} and {weights.shape}")
        if top_k is not None and top_k != ids.shape[1]:
            raise ValueError(f"top_k={top_k} differs from the routing's k={ids.shape[1]}")
    else:
        if router.shape != (T, E):
            raise ValueError(f"router_logits must be [T, E] = {[T, E]} (E from the expert stacks), got {router.shape}")
        if top_k is None or not 1 <= top_k <= E:
            raise ValueError(f"top_k must be in [1, num_experts={E}], got {top_k}")
        if router_bias is not None and jnp.shape(router_bias) != (E,):
            raise ValueError(f"router_bias must be [E] = [{E}], got shape {jnp.shape(router_bias)}")
        ids, weights = route(router, top_k, renormalize=renormalize, bias=router_bias)
    act = dict(activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
    biases = dict(b_gate=gate_bias, b_up=up_bias, b_down=down_bias)
    if impl == "reference":
        w_gate, w_up, w_down = (dequantize(w, x.dtype) if isinstance(w, QArray) else w for w in (w_gate, w_up, w_down))
        return moe_ref(x, ids, weights, w_gate, w_up, w_down, **act, **biases)
    if impl == "auto":
        # XLA:CPU's ragged_dot runs every expert over every row (as slow as the reference): on the CPU each
        # expert's rows run in blocks (bench/moe.py: 12x faster than ragged_dot at 512 tokens, D 1024, E 32, F 256,
        # top 4), or with fewer slots than experts the chosen experts' matrices are gathered.
        if platform() == "cpu":
            impl = "gather" if x.shape[0] * ids.shape[1] < E else "blocked"
        else:
            impl = "megablox" if platform() == "tpu" else "ragged"
    if impl in ("ragged", "megablox") and isinstance(w_gate, QArray) and x.shape[0] * ids.shape[1] < E:
        # a grouped product needs the layer's stacks as floats: with fewer slots than experts (decode) only the
        # chosen experts are dequantized, so a step reads k experts' bytes per token, not the whole stack
        impl = "gather"
    if impl == "gather":
        return moe_gathered(x, ids, weights, w_gate, w_up, w_down, **biases, **act)
    if impl == "blocked":
        return moe_blocked(x, ids, weights, w_gate, w_up, w_down, **biases, **act)
    interp = False
    if impl == "megablox":
        interp = (platform() != "tpu") if interpret is None else bool(interpret)
    out = moe_grouped(
        x, ids, weights, w_gate, w_up, w_down, **biases, product=impl, **act, tiling=tiling, interpret=interp
    )
    return settle_tpu_interpret(out, interp)
