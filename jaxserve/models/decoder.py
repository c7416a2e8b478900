"""The decoder: every family of ``jaxserve.models.registry`` (Llama, SmolLM2, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3,
and the mixtures of experts Mixtral, Qwen3-MoE, gpt-oss) as one flax NNX module, built from the parameter schema
(``jaxserve.models.schema``).

Weights of all layers are stacked on a leading layer axis and the layers run under ``lax.scan``, so compile
time does not grow with depth. The runner holds the module split into ``(graphdef, state)``
(:func:`model_from_params`); its jitted step merges them back (``nnx.merge``) and calls
:meth:`Decoder.__call__` (hidden states, K/V written into the pool) and :meth:`Decoder.logits`. Attention and the K/V write are arguments
of ``__call__`` (``attention_fn``, ``write_kv_fn``), so the same model runs on any kernel of
``jaxserve.kernels``.

Dimension letters: T tokens in the step, D hidden, N query heads, K kv heads, H head_dim, F MLP hidden,
V vocabulary, L layers, S sequences.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.kernels import AttentionBatch
from jaxserve.kernels.attention.mla import absorb_query, expand_output, mla_attention
from jaxserve.layers.linear import PLAIN, MatmulPolicy, matmul, pack_bf16
from jaxserve.layers.moe import MoeSpec, moe_mlp
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import Rope, apply_rope
from jaxserve.models.schema import block_layers, layer_names, matmul_names, param_schema, partial_names

# attention_fn(q, k_cache, v_cache, layer, batch, *, sm_scale, sliding_window, soft_cap) -> [T, N, H]
AttentionFn = Callable[..., jax.Array]
# write_kv_fn(k_cache, v_cache, layer, new_k, new_v, batch) -> (k_cache, v_cache)
WriteKVFn = Callable[..., tuple[jax.Array, jax.Array]]
# moe_fn(h [T, D], one layer's MoE parameters {name: array}) -> [T, D] (``jaxserve.layers.moe``)
MoeFn = Callable[[jax.Array, dict], jax.Array]


# The [D, V] output projection in ``Decoder.matmul_weights`` (the transposed embedding when tied).
OUTPUT_AXES = ("embed", "vocab")


class Decoder(nnx.Module):
    """Decoder-only transformer: per layer the schema's attention block, then its MLP or MoE block. Parameters are created
    from ``param_schema`` and filled by the loaders."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        rngs = rngs or nnx.Rngs(0)
        init = nnx.initializers.normal(0.02)
        for name, spec in param_schema(cfg).items():
            # Gemma scales by (1 + w): its norms start from w = 0, the others' from w = 1.
            value = (
                jnp.full(spec.shape, 1.0 - cfg.norm_weight_offset, dtype)
                if spec.norm
                else init(rngs.params(), spec.shape, dtype)
            )
            setattr(self, name, nnx.Param(value))

    def matmul_weights(self) -> dict[str, jax.Array]:
        """bfloat16 copies of the weights of every matrix product, for :func:`matmul`.

        Keys: the schema's ``matmul_names`` (stacked over layers, packed by :func:`pack_bf16`) and "output", the [D, V]
        output projection.

        Raises:
            ValueError: the weights are quantized (they are not copied to bfloat16).
        """
        names = matmul_names(param_schema(self.cfg))
        if any(isinstance(getattr(self, n).get_value(), quant.QArray) for n in (*names, "embed")):
            raise ValueError("matmul_dtype='bfloat16' copies float weights; it cannot be combined with quantization")
        out = {n: pack_bf16(getattr(self, n)[...]) for n in names}
        # Outside the scan no slice is copied, and unpacking the [D, V] matrix would copy it every step.
        out["output"] = (self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]).astype(jnp.bfloat16)
        return out

    def __call__(
        self,
        tokens: jax.Array,
        batch: AttentionBatch,
        k_cache: jax.Array,
        v_cache: jax.Array,
        attention_fn: AttentionFn,
        write_kv_fn: WriteKVFn,
        policy: MatmulPolicy = PLAIN,
        copies: dict[str, jax.Array] | None = None,
        moe_fn: MoeFn | None = None,
        scan_fn=None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Runs the decoder over the step's tokens. Returns (hidden [T, D] after the final norm, k, v caches).

        ``policy`` decides how each matrix product runs, with ``copies`` (from :meth:`matmul_weights`) the
        bfloat16 copies it may use. ``moe_fn`` runs a MoE layer's block (default: ``jaxserve.layers.moe.moe_mlp``
        on one device; the runner passes it sharded over the mesh). ``scan_fn(layer_on, step, carry, (params,
        layer ids, windows))`` runs the layers (default: one ``lax.scan`` of ``layer_on`` on ``step``; pipeline
        stages: ``sharding.PipelineTick``), where ``step`` is what a layer reads of the step besides its weights:
        (batch, rotary tables, local rotary tables or None); under pipeline stages ``batch`` stacks one step per
        stage and each stage reads its own. A layer's inputs end with the index of its entry in the caches it is
        given.
        """
        cfg = self.cfg
        T = tokens.shape[0]
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, off = cfg.rms_norm_eps, cfg.norm_weight_offset
        # What a layer reads of the step besides its weights: the batch and its rotary tables ([T, H/2] each, shared
        # by the layers; Gemma 3's sliding-window layers have their own, picked per layer).
        local_rope = None if cfg.local_rope_theta is None else Rope(cfg.rotary_dim, cfg.local_rope_theta)
        tables = lambda positions: (  # noqa: E731
            Rope.of(cfg).tables(positions),
            None if local_rope is None else local_rope.tables(positions),
        )
        step = (batch, *tables(batch.positions))

        embed = self.embed.get_value()
        if isinstance(embed, quant.QArray):  # dequantized rows, in the dtype of the rest of the model
            x = quant.take(embed, tokens, self.final_norm[...].dtype)  # [T, D]
        else:
            x = embed[tokens]  # [T, D]
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)

        schema = param_schema(cfg)
        layer_params, whole = policy.layer_weights(
            {n: getattr(self, n).get_value() for n in layer_names(schema)}, matmul_names(schema), copies, T
        )
        windows = jnp.asarray(cfg.layer_windows(), jnp.int32)  # [L], 0 = full attention
        # A model that mixes dense and MoE layers holds each block's stack over its own layers (``partial``); each
        # layer runs one of them (``lax.cond``), from the stack's entry ``index[layer]``.
        partial = {n: getattr(self, n).get_value() for n in partial_names(schema)}
        _, moe_layers = block_layers(cfg)
        flags = cfg.moe_layer_flags()
        index = jnp.asarray(
            [(flags[:i].count(True) if f else flags[:i].count(False)) for i, f in enumerate(flags)], jnp.int32
        )
        if moe_fn is None and cfg.is_moe:
            moe_fn = functools.partial(moe_mlp, spec=MoeSpec.of(cfg))

        def dense_mlp(h, mul, names=("w_gate", "w_up", "w_down")):
            gate = mul(h, names[0])
            act = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
            return mul(act * mul(h, names[1]), names[2])

        def entry(names, i):  # one layer's parameters of a partial stack
            return {n: jax.lax.dynamic_index_in_dim(partial[n], i, keepdims=False) for n in names}

        def mlp(h, p, mul, layer_idx):
            if moe_layers == ():
                return dense_mlp(h, mul)
            if moe_layers is None:
                return moe(h, p, mul)
            i = index[layer_idx]

            def dense(h):
                w = entry(("w_gate", "w_up", "w_down"), i)
                return dense_mlp(h, lambda x, n: matmul(x, w[n]))

            def sparse(h):
                w = entry(moe_names + shared_names, i)
                return moe(h, w, lambda x, n: matmul(x, w[n]))

            return jax.lax.cond(flags_arr[layer_idx], sparse, dense, h)

        moe_names = tuple(
            n for n in schema if n in ("router", "router_bias", "router_correction") or n.startswith("expert_")
        )
        shared_names = tuple(n for n in schema if n.startswith("shared_"))

        def moe(h, p, mul):  # the routed experts (``moe_fn``), and DeepSeek's shared experts beside them
            out = moe_fn(h, {n: p[n] for n in moe_names})
            if shared_names:
                out = out + dense_mlp(h, mul, ("shared_gate", "shared_up", "shared_down"))
            return out

        flags_arr = jnp.asarray(flags)

        def gqa(h, p, mul, rope, local, window, caches, cache_idx, batch):  # grouped-query attention -> [T, D]
            (cos, sin), (k_cache, v_cache) = rope, caches
            q, k, v = mul(h, "wq"), mul(h, "wk"), mul(h, "wv")
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H)
            if cfg.qk_norm:
                q, k = rms_norm(q, p["q_norm"], eps, off), rms_norm(k, p["k_norm"], eps, off)
            if cfg.local_rope_theta is None:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:
                c, s = jnp.where(window > 0, local[0], cos), jnp.where(window > 0, local[1], sin)
                q, k = apply_rope(q, c, s), apply_rope(k, c, s)
            k_cache, v_cache = write_kv_fn(k_cache, v_cache, cache_idx, k, v, batch)
            sinks = {"sinks": p["sinks"]} if cfg.attention_sinks else {}
            attn = attention_fn(
                q,
                k_cache,
                v_cache,
                cache_idx,
                batch,
                sm_scale=cfg.attn_scale,
                sliding_window=window,
                soft_cap=cfg.attn_logit_softcap,
                **sinks,
            )  # [T, N, H]
            return mul(attn.reshape(T, N * H), "wo"), k_cache, v_cache

        def mla(h, p, mul, rope, local, window, caches, cache_idx, batch):  # latent attention, absorbed -> [T, D]
            (cos, sin), (k_cache, v_cache) = rope, caches
            R, dn, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
            q = (
                mul(h, "wq")
                if cfg.q_lora_rank is None
                else mul(rms_norm(mul(h, "wq_a"), p["q_a_norm"], eps, off), "wq_b")
            )
            q = q.reshape(T, N, H)
            q_nope, q_pe = q[..., :dn], q[..., dn:]
            kv = mul(h, "wkv_a")  # [T, R + r]: the latent c before its norm, and the shared rotary key
            c, k_pe = rms_norm(kv[:, :R], p["kv_a_norm"], eps, off), kv[:, None, R:]
            if cfg.rope_interleave:  # pairs (x0, x1), (x2, x3) ...: rotated as halves, the same order in q and k
                r = cfg.rotary_dim
                deinterleave = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
                q_pe, k_pe = q_pe[..., deinterleave], k_pe[..., deinterleave]
            q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
            latent = jnp.concatenate([c, k_pe[:, 0].astype(c.dtype)], axis=-1)  # [T, R + r]
            k_cache, v_cache = write_kv_fn(k_cache, v_cache, cache_idx, latent, latent, batch)  # the latent pool
            w = p["wkv_b"].reshape(R, N, dn + dv)  # each head's key (d_nope) and value (d_v) up-projections
            q_latent = absorb_query(q_nope, w[..., :dn].transpose(1, 2, 0))  # [T, N, R]
            context = mla_attention(  # over the latent pool: each latent is every head's key and value
                q_latent,
                q_pe,
                k_cache,
                cache_idx,
                batch,
                sm_scale=cfg.attn_scale,
                attention=attention_fn,
                sliding_window=window,
                soft_cap=None,
            )
            out = expand_output(context, w[..., dn:].transpose(1, 2, 0))  # [T, N, d_v]
            return mul(out.reshape(T, N * dv), "wo"), k_cache, v_cache

        def layer_on(step, carry, xs):  # one layer on this step's tokens, its K/V written where ``batch`` says
            batch, (cos, sin), local = step
            x, k_cache, v_cache = carry
            p, layer_idx, window, cache_idx = xs  # cache_idx: the layer's entry in these caches (a stage's own)

            def mul(h: jax.Array, name: str) -> jax.Array:
                return policy.product(h, name, p, whole, layer_idx)

            h = rms_norm(x, p["attn_norm"], eps, off)
            attend = mla if cfg.is_mla else gqa
            o, k_cache, v_cache = attend(h, p, mul, (cos, sin), local, window, (k_cache, v_cache), cache_idx, batch)
            if cfg.o_bias:
                o = o + p["bo"]
            if cfg.sandwich_norms:
                o = rms_norm(o, p["post_attn_norm"], eps, off)
            x = x + o
            h = rms_norm(x, p["mlp_norm"], eps, off)
            m = mlp(h, p, mul, layer_idx)
            if cfg.sandwich_norms:
                m = rms_norm(m, p["post_mlp_norm"], eps, off)
            return (x + m, k_cache, v_cache), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        if scan_fn is None:
            (x, k_cache, v_cache), _ = jax.lax.scan(
                functools.partial(layer_on, step), (x, k_cache, v_cache), (layer_params, layer_ids, windows, layer_ids)
            )
        else:
            x, k_cache, v_cache = scan_fn(layer_on, step, (x, k_cache, v_cache), (layer_params, layer_ids, windows))
        return rms_norm(x, self.final_norm[...], eps, off), k_cache, v_cache

    def logits(
        self, hidden: jax.Array, policy: MatmulPolicy = PLAIN, copies: dict[str, jax.Array] | None = None
    ) -> jax.Array:
        """[..., D] -> [..., V] float32 logits (with Gemma-2's final soft cap); ``policy`` and ``copies`` as in
        ``__call__``."""
        if self.cfg.tie_word_embeddings:
            w = self.embed.get_value()  # quantized: [V, D] grouped along D, and matmul transposes it
            w = w if isinstance(w, quant.QArray) else w.T
        else:
            w = self.lm_head.get_value()
        logits = policy.output(hidden, w, copies).astype(jnp.float32)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs) without allocating or initializing any weight."""
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def model_from_params(cfg: ModelConfig, params: dict) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) with the given parameter arrays (host or device) as the state's values."""
    graphdef, state = abstract_model(cfg, dtype=params["final_norm"].dtype)
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state
