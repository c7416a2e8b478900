"""The decoder: every family of ``jaxserve.models.registry`` (Llama, SmolLM2, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3,
and the mixtures of experts Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V2/V3, Kimi-K2) as one flax NNX module, built
from the parameter schema (``jaxserve.models.schema``). A layer is a composition of the blocks in
``jaxserve.layers``: the attention block (``layers/attention.py``: grouped-query or latent) and the MLP block
(``layers/mlp.py``: gated MLP or mixture of experts), each behind its pre-norm (and Gemma 2/3's post-norm) on the
residual stream. The math of a block lives in its module; this one picks the blocks per layer and runs the layers.

Weights of all layers are stacked on a leading layer axis and the layers run under ``lax.scan``, so compile
time does not grow with depth. The runner holds the module split into ``(graphdef, state)``
(:func:`model_from_params`); its jitted step merges them back (``nnx.merge``) and calls
:meth:`Decoder.__call__` (hidden states, K/V written into the pool) and :meth:`Decoder.logits`. Attention and the
K/V write are arguments of ``__call__`` (``attention_fn``, ``write_kv_fn``), so the same model runs on any kernel
of ``jaxserve.kernels``.

Dimension letters: T tokens in the step, D hidden, N query heads, K kv heads, H head_dim, F MLP hidden,
V vocabulary, L layers, S sequences.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.kernels import AttentionBatch
from jaxserve.layers.attention import AttentionFn, WriteKVFn, gqa_attention, mla_attention
from jaxserve.layers.linear import PLAIN, MatmulPolicy, Product, matmul, pack_bf16, product_of
from jaxserve.layers.mlp import MoeFn, gated_mlp, moe_block
from jaxserve.layers.moe import MoeSpec, moe_mlp
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import Rope
from jaxserve.models.schema import block_layers, layer_names, matmul_names, param_schema, partial_names

# The [D, V] output projection in ``Decoder.matmul_weights`` (the transposed embedding when tied).
OUTPUT_AXES = ("embed", "vocab")


class Decoder(nnx.Module):
    """Decoder-only transformer: per layer the schema's attention block, then its MLP or MoE block (the functions of
    ``jaxserve.layers.attention`` / ``jaxserve.layers.mlp``). Parameters are created from ``param_schema`` and
    filled by the loaders."""

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
        stages: ``pipeline.PipelineTick``), where ``step`` is what a layer reads of the step besides its weights:
        (batch, rotary tables, local rotary tables or None); under pipeline stages ``batch`` stacks one step per
        stage and each stage reads its own. A layer's inputs end with the index of its entry in the caches it is
        given.
        """
        cfg = self.cfg
        T = tokens.shape[0]
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
        attention = mla_attention if cfg.is_mla else gqa_attention
        attend = functools.partial(attention, cfg, attention_fn=attention_fn, write_kv_fn=write_kv_fn)
        mlp = self._mlp(schema, moe_fn)

        def layer_on(step, carry, xs):  # one layer on this step's tokens, its K/V written where ``batch`` says
            batch, rope, local = step
            x, k_cache, v_cache = carry
            p, layer_idx, window, cache_idx = xs  # cache_idx: the layer's entry in these caches (a stage's own)

            def mul(h: jax.Array, name):  # a name, or a tuple of them (linear.Product)
                return policy.product(h, name, p, whole, layer_idx)

            h = rms_norm(x, p["attn_norm"], eps, off)
            o, k_cache, v_cache = attend(
                h,
                p,
                mul,
                (k_cache, v_cache),
                cache_idx=cache_idx,
                batch=batch,
                rope=rope,
                local_rope=local,
                window=window,
            )
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

    def _mlp(self, schema: dict, moe_fn: MoeFn | None) -> Callable[[jax.Array, dict, Product, jax.Array], jax.Array]:
        """A layer's MLP block, ``mlp(h, p, mul, layer) -> [T, D]``: the gated MLP, the MoE block (routed experts on
        ``moe_fn``, default ``jaxserve.layers.moe.moe_mlp`` on one device), or in a model that mixes them the layer's
        own (``lax.cond``), whose weights are entry ``index[layer]`` of its block's stack over its own layers
        (``ParamSpec.layers``) rather than the layer scan's slice ``p``."""
        cfg = self.cfg
        dense_layers, moe_layers = block_layers(cfg)
        if moe_fn is None and cfg.is_moe:
            moe_fn = functools.partial(moe_mlp, spec=MoeSpec.of(cfg))
        if moe_layers == ():
            return lambda h, p, mul, layer_idx: gated_mlp(cfg, h, mul)
        if moe_layers is None:
            return lambda h, p, mul, layer_idx: moe_block(cfg, h, p, mul, moe_fn)
        partial = {n: getattr(self, n).get_value() for n in partial_names(schema)}
        flags = cfg.moe_layer_flags()
        index = jnp.asarray(
            [(flags[:i].count(True) if f else flags[:i].count(False)) for i, f in enumerate(flags)], jnp.int32
        )
        flags_arr = jnp.asarray(flags)

        def entry(layers, i):  # one layer's parameters of the stack over ``layers``
            names = (n for n in partial if schema[n].layers == layers)
            return {n: jax.lax.dynamic_index_in_dim(partial[n], i, keepdims=False) for n in names}

        def mlp(h, p, mul, layer_idx):
            i = index[layer_idx]

            def dense(h):
                w = entry(dense_layers, i)
                return gated_mlp(cfg, h, product_of(lambda x, n: matmul(x, w[n])))

            def sparse(h):
                w = entry(moe_layers, i)
                return moe_block(cfg, h, w, product_of(lambda x, n: matmul(x, w[n])), moe_fn)

            return jax.lax.cond(flags_arr[layer_idx], sparse, dense, h)

        return mlp

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
