"""The MoE kernels (``jaxserve.kernels.moe``) and layer (``jaxserve.layers.moe``) against independent references.

- routing against a NumPy reference (softmax over all then top-k, with and without renormalizing, router bias);
- the grouped paths (``lax.ragged_dot``, megablox ``gmm`` in interpret mode) against the dense reference (every
  expert on every token), float32 within 2e-5 (values of order 1): odd sizes, experts with no token, top-k 1 and 4;
- the layer against transformers' own blocks (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock with norm_topk_prob
  True and False, GptOssMLP) on random weights copied into our layout, within 1e-5;
- megablox compiles for v5e and v6e at Qwen3-30B-A3B's shapes (deviceless AOT, as tests/kernels/test_tpu_kernels_aot.py);
- bad inputs raise ValueError naming the argument.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.kernels.moe.grouped import megablox_tiling, sort_by_expert
from jaxserve.kernels.moe.reference import route, route_grouped

from jaxserve import kernels
from jaxserve.layers.moe import MoeSpec, moe_mlp, moe_param_shapes

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = 2e-5


def _softmax(a: np.ndarray) -> np.ndarray:
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _route_np(logits, k, renormalize, bias=None):
    logits = logits.astype(np.float64) + (0 if bias is None else bias)
    probs = _softmax(logits)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # descending, lower id first among ties
    w = np.take_along_axis(probs, ids, -1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    return ids, w


def _weights(rng, E, D, F, scale=0.3, bias=False):
    w = {
        "w_gate": rng.normal(size=(E, D, F)) * scale,
        "w_up": rng.normal(size=(E, D, F)) * scale,
        "w_down": rng.normal(size=(E, F, D)) * scale,
    }
    if bias:
        w |= {
            "gate_bias": rng.normal(size=(E, F)),
            "up_bias": rng.normal(size=(E, F)),
            "down_bias": rng.normal(size=(E, D)),
        }
    return {n: jnp.asarray(a, F32) for n, a in w.items()}


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_routing_matches_numpy(renormalize, with_bias):
    rng = np.random.default_rng(0)
    T, E, k = 37, 11, 3
    logits = rng.normal(size=(T, E)).astype(np.float32)
    bias = rng.normal(size=(E,)).astype(np.float32) if with_bias else None
    ids, w = route(jnp.asarray(logits), k, renormalize=renormalize, bias=None if bias is None else jnp.asarray(bias))
    ids_np, w_np = _route_np(logits, k, renormalize, bias)
    np.testing.assert_array_equal(np.asarray(ids), ids_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-6, atol=1e-7)
    assert ids.dtype == jnp.int32 and w.dtype == F32


@pytest.mark.parametrize(
    ("groups", "top_groups", "renormalize", "scaling"), [(4, 2, True, 2.5), (8, 3, False, 1.0), (1, 1, True, 1.0)]
)
def test_grouped_sigmoid_routing_matches_deepseek_v3s_router(groups, top_groups, renormalize, scaling):
    """DeepSeek-V3's routing against transformers' DeepseekV3TopkRouter, whose weights and correction bias are
    random (the bias of the order of the scores, so that it changes choices): the same experts per token (HF's
    top-k is unsorted: compared as sets) with the same weights within 1e-6."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    T, E, D, k = 29, 32, 16, 6
    cfg = DeepseekV3Config(
        hidden_size=D,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=top_groups,
        norm_topk_prob=renormalize,
        routed_scaling_factor=scaling,
    )
    router = DeepseekV3TopkRouter(cfg)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(rng.normal(size=(E, D)), dtype=torch.float32))
        router.e_score_correction_bias.copy_(torch.tensor(rng.normal(scale=0.3, size=E), dtype=torch.float32))
        x = torch.tensor(rng.normal(size=(T, D)), dtype=torch.float32)
        logits, hf_w, hf_ids = router(x)
    bias = jnp.asarray(router.e_score_correction_bias.numpy())
    ids, w = route_grouped(
        jnp.asarray(logits.numpy()),
        k,
        num_groups=groups,
        top_groups=top_groups,
        correction_bias=bias,
        renormalize=renormalize,
        scaling=scaling,
    )
    ids, w, hf_ids, hf_w = np.asarray(ids), np.asarray(w), hf_ids.numpy(), hf_w.numpy()
    unbiased = np.asarray(route_grouped(jnp.asarray(logits.numpy()), k, num_groups=groups, top_groups=top_groups)[0])
    assert any(set(a) != set(b) for a, b in zip(ids, unbiased))  # the bias moved some choice
    for t in range(T):
        assert set(ids[t]) == set(hf_ids[t]), t
        mine, theirs = dict(zip(ids[t], w[t])), dict(zip(hf_ids[t], hf_w[t]))
        np.testing.assert_allclose([mine[e] for e in theirs], list(theirs.values()), rtol=1e-6, atol=1e-7)


def test_grouped_routing_refuses_groups_that_do_not_divide_the_experts():
    logits = jnp.zeros((2, 10), F32)
    with pytest.raises(ValueError, match=r"num_groups=4 must divide the 10 experts"):
        route_grouped(logits, 2, num_groups=4, top_groups=2)
    with pytest.raises(ValueError, match=r"top_k=6 exceeds the 1 open groups' 5 experts"):
        route_grouped(logits, 6, num_groups=2, top_groups=1)


def test_routing_ties_pick_the_lower_expert():
    logits = jnp.zeros((2, 6), F32).at[1, 4].set(1.0)
    ids, w = route(logits, 2, renormalize=True)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1], [4, 0]])
    np.testing.assert_allclose(np.asarray(w[0]), [0.5, 0.5])


def test_sort_by_expert_is_stable_and_counts_every_slot():
    ids = jnp.asarray([[3, 0], [0, 3], [2, 0]], jnp.int32)
    order, sorted_ids, sizes = sort_by_expert(ids, 5)
    np.testing.assert_array_equal(np.asarray(order), [1, 2, 5, 4, 0, 3])
    np.testing.assert_array_equal(np.asarray(sorted_ids), [0, 0, 0, 2, 3, 3])
    np.testing.assert_array_equal(np.asarray(sizes), [3, 0, 1, 2, 0])


# (T, D, F, E, k): odd sizes, one token, top-1, top-k of half the experts
SHAPES = [(13, 24, 20, 8, 2), (1, 17, 9, 5, 1), (29, 33, 15, 6, 4), (7, 8, 8, 3, 3)]


@pytest.mark.parametrize("impl", ["ragged", "megablox", "gather", "blocked"])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_matches_reference(impl, shape):
    T, D, F, E, k = shape
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    w = _weights(rng, E, D, F)
    ref = kernels.moe_experts(x, logits, **w, top_k=k, impl="reference")
    out = kernels.moe_experts(x, logits, **w, top_k=k, impl=impl)
    assert out.shape == (T, D) and out.dtype == F32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("impl", ["ragged", "megablox", "gather", "blocked"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_expert_stacks_equal_the_reference_on_their_values(impl, mode):
    """Quantized stacks (int4: groups of 32 along D = 64 and F = 32) give what the dense reference gives on the
    dequantized floats: each implementation dequantizes (or gathers, then dequantizes) exactly those values."""
    from jaxserve import quant

    T, D, F, E, k = 11, 64, 32, 6, 2
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    w = _weights(rng, E, D, F, bias=True)
    q = {n: quant.quantize(a, mode) if n.startswith("w_") else a for n, a in w.items()}
    floats = {n: quant.dequantize(a) if quant.is_quantized(a) else a for n, a in q.items()}
    assert all(quant.is_quantized(q[n]) for n in ("w_gate", "w_up", "w_down"))
    ref = kernels.moe_experts(x, logits, **floats, top_k=k, impl="reference")
    out = kernels.moe_experts(x, logits, **q, top_k=k, impl=impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL)


def test_quantized_decode_dequantizes_only_the_chosen_experts():
    """Fewer token slots than experts (2 tokens x top 2 of 6): the grouped product would dequantize the whole
    stack, so the chosen experts are gathered and dequantized instead (no ragged_dot in the step), same values."""
    from jaxserve import quant

    T, D, F, E, k = 2, 64, 32, 6, 2
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    q = {n: quant.quantize(a, "int8") for n, a in _weights(rng, E, D, F).items()}
    floats = {n: quant.dequantize(a) for n, a in q.items()}
    ref = kernels.moe_experts(x, logits, **floats, top_k=k, impl="reference")
    step = functools.partial(kernels.moe_experts, top_k=k, impl="ragged")
    assert "ragged_dot" not in str(jax.make_jaxpr(step)(x, logits, **q))
    assert "ragged_dot" in str(jax.make_jaxpr(step)(x, logits, **floats))
    np.testing.assert_allclose(np.asarray(step(x, logits, **q)), np.asarray(ref), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("impl", ["ragged", "megablox", "gather", "blocked"])
def test_experts_without_tokens_and_clamped_swiglu_with_biases(impl):
    """Every token routed to experts 1 and 4 of 7 (the others get no row, the first and the last included), gpt-oss's
    activation with large pre-activations so that both clamps bite, and per-expert biases."""
    T, D, F, E = 10, 12, 16, 7
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(T, D)) * 3, F32)
    w = _weights(rng, E, D, F, scale=1.0, bias=True)
    ids = jnp.asarray(np.where(rng.random((T, 2)) < 0.5, [[1, 4]], [[4, 1]]), jnp.int32)
    cw = jnp.asarray(_softmax(rng.normal(size=(T, 2))), F32)
    kw = dict(activation="swiglu_clamped", **w)
    ref = kernels.moe_experts(x, (ids, cw), **kw, impl="reference")
    out = kernels.moe_experts(x, (ids, cw), **kw, impl=impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL * 10)
    # the clamps are exercised: some gate pre-activations above the limit, some up ones beyond +-limit
    gate, up = (np.einsum("td,edf->etf", np.asarray(x), np.asarray(w[f"w_{n}"])) for n in ("gate", "up"))
    assert (gate > 7).any() and (up > 7).any() and (up < -7).any()


@pytest.mark.parametrize("impl", ["ragged", "megablox", "gather", "blocked"])
def test_experts_held_elsewhere_contribute_nothing(impl):
    """Expert parallelism hands each device the ids minus its first expert: ids outside [0, E) are experts of other
    devices. The output is the reference's over the slots in range only (weights of the others zeroed)."""
    T, D, F, E, k = 11, 16, 12, 4, 3
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    w = _weights(rng, E, D, F, bias=True)
    ids = jnp.asarray(rng.integers(-4, 2 * E, size=(T, k)), jnp.int32)  # about half out of range, both sides
    cw = jnp.asarray(rng.random((T, k)), F32)
    here = (ids >= 0) & (ids < E)
    ref = kernels.moe_experts(x, (jnp.where(here, ids, 0), jnp.where(here, cw, 0.0)), **w, impl="reference")
    out = kernels.moe_experts(x, (ids, cw), **w, impl=impl)
    assert 0 < int(here.sum()) < T * k
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL)


def test_megablox_multiple_row_tiles_and_explicit_tiling():
    """More slots than one row tile: groups straddle tile boundaries; padding rows join the last expert."""
    T, D, F, E, k = 50, 256, 128, 6, 3  # 150 slots, tm 16 -> 10 row tiles
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    w = _weights(rng, E, D, F, scale=0.1)
    ref = kernels.moe_experts(x, logits, **w, top_k=k, impl="reference")
    out = kernels.moe_experts(x, logits, **w, top_k=k, impl="megablox", tiling=(16, 128, 128))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL)


def test_bfloat16_weights():
    T, D, F, E, k = 9, 32, 24, 4, 2
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(T, D)), BF16)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    w = {n: a.astype(BF16) for n, a in _weights(rng, E, D, F).items()}
    ref = kernels.moe_experts(x, logits, **w, top_k=k, impl="reference")
    for impl in ("ragged", "megablox", "gather", "blocked"):
        out = kernels.moe_experts(x, logits, **w, top_k=k, impl=impl)
        assert out.dtype == BF16
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=0.03, atol=0.03)


def test_megablox_tiling():
    assert megablox_tiling(8, 2048, 768, BF16) == (16, 512, 256)
    assert megablox_tiling(4096, 2048, 768, BF16) == (128, 512, 256)
    assert megablox_tiling(20, 2880, 2880, F32) == (24, 512, 512)  # gpt-oss: no 128-multiple divides 2880
    assert megablox_tiling(20, 320, 2880, F32) == (24, 320, 512)


def test_megablox_irregular_last_blocks_equal_the_reference():
    """A hidden size past 512 that no 128-multiple divides (gpt-oss's 2880 in miniature: 576 = 512 + 64): the
    gate / up products mask the contraction's remainder block, the down product clips its last output block."""
    T, D, F, E, k = 9, 576, 200, 4, 2
    assert megablox_tiling(T * k, D, F, F32)[1:] == (512, 200) and megablox_tiling(T * k, F, D, F32)[1:] == (200, 512)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(T, D)), F32)
    logits = jnp.asarray(rng.normal(size=(T, E)), F32)
    w = _weights(rng, E, D, F, scale=0.05)
    ref = kernels.moe_experts(x, logits, **w, top_k=k, impl="reference")
    out = kernels.moe_experts(x, logits, **w, top_k=k, impl="megablox", interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL, atol=TOL)


def _moe_args(T=4, D=6, F=5, E=4):
    x = jnp.ones((T, D), F32)
    return x, jnp.zeros((T, E), F32), jnp.ones((E, D, F)), jnp.ones((E, D, F)), jnp.ones((E, F, D))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(w_up=jnp.ones((3, 6, 5))), "w_up"),
        (dict(w_down=jnp.ones((5, 5, 6))), "w_down"),
        (dict(w_down=jnp.ones((4, 6, 6))), "w_down"),
        (dict(w_gate=jnp.ones((4, 7, 5)), w_up=jnp.ones((4, 7, 5))), "w_gate"),
        (dict(router=jnp.zeros((4, 5))), "router_logits"),
        (dict(router_bias=jnp.zeros(3)), "router_bias"),
        (dict(gate_bias=jnp.zeros((4, 6))), "gate_bias"),
        (dict(down_bias=jnp.zeros((4, 5))), "down_bias"),
        (dict(activation="gelu"), "activation"),
        (dict(impl="triton"), "impl"),
        (dict(router=(jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 3)))), "router"),
    ],
)
def test_bad_inputs_name_the_argument(change, match):
    x, logits, wg, wu, wd = _moe_args()
    args = dict(router=logits, w_gate=wg, w_up=wu, w_down=wd, top_k=2) | change
    with pytest.raises(ValueError, match=match):
        kernels.moe_experts(x, args.pop("router"), args.pop("w_gate"), args.pop("w_up"), args.pop("w_down"), **args)


def test_moe_spec_validates():
    with pytest.raises(ValueError, match="top_k"):
        MoeSpec(num_experts=4, top_k=5, intermediate_size=8)
    with pytest.raises(ValueError, match="activation"):
        MoeSpec(num_experts=4, top_k=2, intermediate_size=8, activation="relu")


def test_layer_runs_inside_the_layer_scan():
    """Parameters stacked over layers [L, E, D, F] (the schema's layout), sliced by lax.scan: each layer's output
    equals the layer run alone; "auto" is the ragged path on the CPU."""
    L, T, D, F, E, k = 3, 5, 12, 10, 6, 2
    rng = np.random.default_rng(4)
    spec = MoeSpec(num_experts=E, top_k=k, intermediate_size=F, router_bias=True, expert_bias=True)
    stacked = {
        n: jnp.asarray(rng.normal(size=(L, *shape)) * 0.3, F32) for n, (shape, _) in moe_param_shapes(D, spec).items()
    }
    x = jnp.asarray(rng.normal(size=(T, D)), F32)

    def layer(h, p):
        return h + moe_mlp(h, p, spec, impl="auto"), None

    got, _ = jax.jit(lambda h, ps: jax.lax.scan(layer, h, ps))(x, stacked)
    want = x
    for i in range(L):
        want = want + moe_mlp(want, {n: a[i] for n, a in stacked.items()}, spec, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL)


# --- the layer against transformers' own MoE blocks ------------------------------------------------------------

D_HF, F_HF, E_HF, K_HF, T_HF = 19, 13, 8, 2, 23  # odd hidden and intermediate sizes, 8 experts top-2


def _torch_out(block, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = block(torch.from_numpy(x)[None])
    out = out[0] if isinstance(out, tuple) else out
    return out[0].numpy()


def _perturb(block, seed: int) -> None:
    """Every parameter random (transformers initializes some with zeros or leaves them empty)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _concatenated_experts(block) -> dict[str, jnp.ndarray]:
    """Mixtral / Qwen3-MoE: gate_up_proj [E, 2F, D] (gate, then up), down_proj [E, D, F], router weight [E, D]."""
    gate_up = block.experts.gate_up_proj.detach().numpy()
    F = gate_up.shape[1] // 2
    return {
        "router": jnp.asarray(block.gate.weight.detach().numpy().T),
        "expert_gate": jnp.asarray(gate_up[:, :F].transpose(0, 2, 1)),
        "expert_up": jnp.asarray(gate_up[:, F:].transpose(0, 2, 1)),
        "expert_down": jnp.asarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1)),
    }


def _check_layer(block, params, spec, seed):
    x = np.random.default_rng(seed).normal(size=(T_HF, D_HF)).astype(np.float32)
    want = _torch_out(block, x)
    for name, (shape, _) in moe_param_shapes(D_HF, spec).items():
        assert params[name].shape == shape, name
    for impl in ("ragged", "megablox", "gather", "blocked", "reference"):
        got = np.asarray(moe_mlp(jnp.asarray(x), params, spec, impl=impl))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


@functools.cache
def _transformers():
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("transformers / torch not installed")
    import torch

    torch.manual_seed(0)
    import transformers

    return transformers


@pytest.mark.slow
def test_layer_matches_transformers_mixtral():
    tf = _transformers()
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = tf.MixtralConfig(hidden_size=D_HF, intermediate_size=F_HF, num_local_experts=E_HF, num_experts_per_tok=K_HF)
    block = MixtralSparseMoeBlock(cfg).eval()
    _perturb(block, 0)
    spec = MoeSpec(num_experts=E_HF, top_k=K_HF, intermediate_size=F_HF, renormalize=True)
    _check_layer(block, _concatenated_experts(block), spec, 0)


@pytest.mark.slow
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_layer_matches_transformers_qwen3_moe(norm_topk_prob):
    tf = _transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tf.Qwen3MoeConfig(
        hidden_size=D_HF,
        moe_intermediate_size=F_HF,
        num_experts=E_HF,
        num_experts_per_tok=K_HF,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    _perturb(block, 1)
    spec = MoeSpec(num_experts=E_HF, top_k=K_HF, intermediate_size=F_HF, renormalize=norm_topk_prob)
    _check_layer(block, _concatenated_experts(block), spec, 1)


@pytest.mark.slow
def test_layer_matches_transformers_gpt_oss():
    """Router bias, interleaved gate/up with biases, clamped SwiGLU (alpha 1.702, limit 7): pre-activations large
    enough that the clamps bite."""
    tf = _transformers()
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = tf.GptOssConfig(hidden_size=D_HF, intermediate_size=F_HF, num_local_experts=E_HF, num_experts_per_tok=K_HF)
    block = GptOssMLP(cfg).eval()
    _perturb(block, 2)
    e = block.experts
    gate_up, gate_up_b = e.gate_up_proj.detach().numpy(), e.gate_up_proj_bias.detach().numpy()
    params = {
        "router": jnp.asarray(block.router.weight.detach().numpy().T),
        "router_bias": jnp.asarray(block.router.bias.detach().numpy()),
        "expert_gate": jnp.asarray(gate_up[..., ::2] * 4),
        "expert_up": jnp.asarray(gate_up[..., 1::2] * 4),
        "expert_down": jnp.asarray(e.down_proj.detach().numpy()),
        "expert_gate_bias": jnp.asarray(gate_up_b[..., ::2]),
        "expert_up_bias": jnp.asarray(gate_up_b[..., 1::2]),
        "expert_down_bias": jnp.asarray(e.down_proj_bias.detach().numpy()),
    }
    import torch

    with torch.no_grad():  # scaled so that |pre-activations| exceed the limit
        e.gate_up_proj.mul_(4)
    spec = MoeSpec(
        num_experts=E_HF,
        top_k=K_HF,
        intermediate_size=F_HF,
        activation="swiglu_clamped",
        swiglu_alpha=cfg.swiglu_alpha,
        swiglu_limit=cfg.swiglu_limit,
        router_bias=True,
        expert_bias=True,
    )
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    x = np.random.default_rng(2).normal(size=(T_HF, D_HF)).astype(np.float32)  # _check_layer's tokens
    pre = np.einsum("td,edf->etf", x, gate_up * 4) + gate_up_b[:, None]
    assert (pre[..., ::2] > 7).any() and (pre[..., 1::2] > 7).any() and (pre[..., 1::2] < -7).any()
    _check_layer(block, params, spec, 2)


# --- megablox compiles for TPUs -------------------------------------------------------------------------------


@functools.cache
def _mesh(topology: str) -> jax.sharding.Mesh:
    if importlib.util.find_spec("libtpu") is None:
        pytest.fail("libtpu is not installed: install the dev extra (pip install -e '.[dev]')", pytrace=False)
    from jaxserve.aot import topology_devices  # sets ALLOW_MULTIPLE_LIBTPU_LOAD: the other worker may hold libtpu

    return jax.sharding.Mesh(np.array(topology_devices(topology)[:1]), ("x",))


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology, shapes",
    [
        ("v5e:2x2", "qwen3-30b-a3b"),
        ("v6e:2x2", "qwen3-30b-a3b"),
        ("v5e:2x2", "gpt-oss-120b"),
    ],
)
def test_megablox_compiles_for_tpu_at_real_shapes(topology, shapes):
    """Qwen3-30B-A3B's MoE (hidden 2048, moe_intermediate 768, 128 experts, top-8), bfloat16, 64 and 512 tokens;
    gpt-oss-120b's 16 experts a chip holds under 8-way expert parallelism (2880 x 2880, top 4: irregular blocks,
    which whole-dimension blocks of 2880 would overflow v5e's scoped VMEM)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.aot import no_persistent_cache

    mesh = _mesh(topology)
    D, F, E, k = (2048, 768, 128, 8) if shapes == "qwen3-30b-a3b" else (2880, 2880, 16, 4)

    def a(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    def step(x, logits, wg, wu, wd):
        return kernels.moe_experts(x, logits, wg, wu, wd, top_k=k, impl="megablox", interpret=False)

    with no_persistent_cache():
        for T in (64, 512):
            args = (a((T, D), BF16), a((T, E), F32), a((E, D, F), BF16), a((E, D, F), BF16), a((E, F, D), BF16))
            with jax.set_mesh(mesh):
                compiled = jax.jit(step).lower(*args).compile()
            hlo = compiled.as_text()
            assert hlo.count("tpu_custom_call") >= 3, f"{topology} T={T}: no Mosaic gmm in the compiled HLO"
