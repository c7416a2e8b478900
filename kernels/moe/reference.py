"""The MoE layer's contract: routing, the experts' activations, and the dense reference that every other
implementation is checked against.

Layouts (``E`` experts, ``T`` tokens, ``D`` hidden, ``F`` one expert's intermediate size, ``k`` experts per token):

  x        [T, D]        the step's tokens
  logits   [T, E]        the router's logits (before any softmax)
  w_gate   [E, D, F]     each expert's gate projection, ``x @ w_gate[e]`` ([in, out], as the dense MLP's weights)
  w_up     [E, D, F]     each expert's up projection
  w_down   [E, F, D]     each expert's down projection
  b_gate, b_up [E, F], b_down [E, D]   optional per-expert biases (gpt-oss)

An expert's output is ``act(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) @ w_down[e] + b_down[e]``; a token's
output is the sum over its ``k`` routed experts of that output times the expert's combine weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "swiglu_clamped")

# gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate, config swiglu_alpha / swiglu_limit).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def route(
    logits: jax.Array, top_k: int, *, renormalize: bool = True, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: logits [T, E] (+ bias [E]) -> (expert ids [T, k] int32, combine weights [T, k] float32).

    ``renormalize=True`` (Mixtral, Qwen3-MoE ``norm_topk_prob=True``, gpt-oss): the softmax over the k chosen
    logits, which equals softmax over all, top-k, then dividing by the chosen ones' sum. ``renormalize=False``
    (Qwen3-MoE ``norm_topk_prob=False``): the chosen experts' probabilities of the softmax over all E, as they are.
    ``bias`` is added to the logits (gpt-oss's router bias) and so moves both the choice and the weights.

    The experts are chosen on the logits, not on rounded probabilities, by ``lax.top_k``: descending, and among
    equal logits the lower expert id first, so ties resolve the same way on every backend.
    """
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    top, ids = jax.lax.top_k(logits, top_k)
    if renormalize:
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    return ids.astype(jnp.int32), weights


def route_grouped(
    logits: jax.Array,
    top_k: int,
    *,
    num_groups: int = 1,
    top_groups: int = 1,
    correction_bias: jax.Array | None = None,
    renormalize: bool = True,
    scaling: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's routing (Kimi-K2's too): logits [T, E] -> (expert ids [T, k] int32, combine weights [T, k]
    float32), on sigmoid scores rather than a softmax. ``scoring="softmax"``: DeepSeek-V2's (``topk_method``
    "greedy" with one group, "group_limited_greedy" with several), a softmax over the E logits, each group scored by
    its best expert, no correction bias.

    The choice: the scores plus ``correction_bias`` [E] (the checkpoint's ``e_score_correction_bias``, a load-balancing
    offset that moves the choice, never the weights); the E experts fall in ``num_groups`` groups of consecutive ids
    (``n_group``), each group scored by the sum of its two best, and only the ``top_groups`` best groups
    (``topk_group``) are open to the top-k. The weights: the chosen experts' plain sigmoid scores, divided by their sum
    when ``renormalize`` (``norm_topk_prob``), times ``scaling`` (``routed_scaling_factor``). Ties go to the lower
    group and expert id (``lax.top_k``); the order of the k chosen is by descending biased score.
    """
    logits = logits.astype(jnp.float32)
    num_tokens, num_experts = logits.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {num_experts} experts")
    if not 1 <= top_groups <= num_groups:
        raise ValueError(f"top_groups={top_groups} must be in [1, num_groups={num_groups}]")
    per_group = num_experts // num_groups
    if top_k > top_groups * per_group:
        raise ValueError(f"top_k={top_k} exceeds the {top_groups} open groups' {top_groups * per_group} experts")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    scores = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if top_groups < num_groups:
        best_of = min(2, per_group) if scoring == "sigmoid" else 1  # V3: a group's two best; V2: its best
        best = jax.lax.top_k(choice.reshape(num_tokens, num_groups, per_group), best_of)[0]
        _, groups = jax.lax.top_k(best.sum(-1), top_groups)  # [T, top_groups]
        open_ = jnp.zeros((num_tokens, num_groups), bool).at[jnp.arange(num_tokens)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(open_, per_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


def activate(
    gate: jax.Array,
    up: jax.Array,
    activation: str = "swiglu",
    *,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> jax.Array:
    """The gated activation of the gate and up projections (float32 in, float32 out).

    "swiglu":          silu(gate) * up (Mixtral, Qwen3-MoE).
    "swiglu_clamped":  gpt-oss's: gate clamped to <= limit, up to [-limit, limit],
                       (up + 1) * gate * sigmoid(alpha * gate).
    """
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def combine_matrix(ids: jax.Array, weights: jax.Array, num_experts: int) -> jax.Array:
    """(ids [T, k], weights [T, k]) -> [T, E] float32: each token's weight for every expert, 0 where not routed."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)  # [T, k, E]
    return jnp.einsum("tke,tk->te", one_hot, weights.astype(jnp.float32))


def moe_ref(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: str = "swiglu",
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> jax.Array:
    """Every expert on every token in float32 (HIGHEST precision), weighted by the combine matrix -> [T, D] in
    x.dtype. O(T * E) work: for tests, not for serving."""
    hi = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    xf = x.astype(f32)
    gate = jnp.einsum("td,edf->etf", xf, w_gate.astype(f32), precision=hi)
    up = jnp.einsum("td,edf->etf", xf, w_up.astype(f32), precision=hi)
    if b_gate is not None:
        gate = gate + b_gate.astype(f32)[:, None, :]
    if b_up is not None:
        up = up + b_up.astype(f32)[:, None, :]
    h = activate(gate, up, activation, alpha=alpha, limit=limit)
    out = jnp.einsum("etf,efd->etd", h, w_down.astype(f32), precision=hi)
    if b_down is not None:
        out = out + b_down.astype(f32)[:, None, :]
    combine = combine_matrix(ids, weights, w_gate.shape[0])  # [T, E]
    return jnp.einsum("te,etd->td", combine, out, precision=hi).astype(x.dtype)
