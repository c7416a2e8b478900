"""Every parameter of a decoder, declared once, in blocks: its shape, logical axes, kind and checkpoint names.

The model builds its parameters from :func:`param_schema`, the loaders place HF and GGUF tensors by the names
declared here, the sharding rules place each parameter by its axes, and quantization takes the kinds it can
quantize. Nothing else lists parameter names. Host code: no jax here.

The schema is nested by block: ``param_blocks(cfg)`` -> ``{"embedding": ..., "attention": ..., "mlp": ...,
"final": ...}``, each a ``{name: ParamSpec}``; a per-layer block's parameters are stacked over the layers (their
first axis is ``layers``). Parameter names are unique across blocks, so the model's state is flat
(``param_schema``): checkpoints written by earlier versions keep loading.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig

# What a parameter is, which fixes how it starts, loads and quantizes:
#   "embedding"  the [V, D] token table (quantizable; the output projection when tied)
#   "linear"     a matrix [..., in, out] (HF and GGUF store [out, in]: transposed on load; quantizable)
#   "bias"       a vector added after a linear
#   "norm"       a norm's scale (starts at 1, or 0 where the norm scales by 1 + w)
#   "router"     a MoE router [D, E] (transposed on load like a linear; computed in float32, never quantized)
#   "experts"    a stack of expert matrices [E, in, out] (HF and GGUF: [E, out, in], or one tensor per expert;
#                quantizable: each expert's matrix grouped along its input axis, dequantized inside the MoE kernels)
#   "absorbed"   a matrix [..., in, out] the attention folds into its query and output instead of multiplying by it
#                (MLA's kv_b_proj): transposed on load like a linear, kept in the model's dtype
KINDS = ("embedding", "linear", "bias", "norm", "router", "experts", "absorbed")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter.

    Logical axes (``jaxserve.parallel.sharding.DEFAULT_RULES`` maps them to mesh axes): ``layers`` (the stacked layer
    axis), ``embed`` (hidden), ``vocab``, ``q_heads`` / ``kv_heads`` (heads x head_dim, flattened), ``heads``
    (one entry per query head), ``head_dim``, ``mlp`` (the MLP hidden), ``experts``, ``expert_mlp`` (one
    expert's hidden) and ``routes`` (the router's output, one per expert).

    ``hf`` and ``gguf`` are its tensor names in HF transformers and llama.cpp checkpoints; for a per-layer
    parameter, the part after ``model.layers.N.`` and ``blk.N.``. None: no such tensor. An expert stack's HF name
    holds ``{e}`` where checkpoints store one tensor per expert (``mlp.experts.{e}.gate_proj.weight``); the name
    without ``{e}.`` is the whole stack in one tensor (gpt-oss).

    ``layers``: for a stack over only some layers (the MoE and dense MLP blocks of a model that mixes them), which
    layers, in order; its first axis is then ``len(layers)`` long and the model indexes it per layer instead of the
    layer scan slicing it. None: every layer (or a parameter that is not per layer).
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kind: str = "linear"
    hf: str | None = None
    gguf: str | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ParamSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec: shape {self.shape} and axes {self.axes} differ in length")

    @property
    def norm(self) -> bool:
        return self.kind == "norm"

    @property
    def per_layer(self) -> bool:
        """Stacked over the layers (all of them, or ``layers``)."""
        return self.axes[0] == "layers"

    @property
    def scanned(self) -> bool:
        """Stacked over every layer: the layer scan slices it."""
        return self.per_layer and self.layers is None

    def stack_index(self, layer: int) -> int | None:
        """Where model layer ``layer`` is in this stack; None: the stack does not hold that layer."""
        if self.layers is None:
            return layer
        return self.layers.index(layer) if layer in self.layers else None

    @property
    def num_stacked(self) -> int:
        return self.shape[0]

    @property
    def transposed(self) -> bool:
        """Stored [out, in] in HF and GGUF checkpoints (each expert's, for a stack), [in, out] here."""
        return self.kind in ("linear", "router", "experts", "absorbed")

    @property
    def quantizable(self) -> bool:
        """Served quantized under ``--quantization`` (and kept quantized from a GGUF file)."""
        return self.kind in ("embedding", "linear", "experts")


def _spec(kind: str, hf: str | None, gguf: str | None, *dims: tuple[int, str]) -> ParamSpec:
    return ParamSpec(tuple(n for n, _ in dims), tuple(a for _, a in dims), kind, hf, gguf)


def _on(spec: ParamSpec, layers: tuple[int, ...] | None) -> ParamSpec:
    """A per-layer spec stacked over only ``layers`` (None: unchanged)."""
    if layers is None:
        return spec
    return dataclasses.replace(spec, shape=(len(layers), *spec.shape[1:]), layers=layers)


def attention_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Pre-norm grouped-query attention (``jaxserve.layers.attention.gqa_attention``): q/k/v/o projections, optional
    q/k/v biases (Qwen2; gpt-oss: o too), q/k norms (Qwen3, Gemma 3), sinks (gpt-oss) and the norm after attention
    (sandwich norms, Gemma 2/3)."""
    L, D, N, K, H = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers, embed, q, kv = (L, "layers"), (D, "embed"), (N * H, "q_heads"), (K * H, "kv_heads")
    block = {
        "attn_norm": _spec("norm", "input_layernorm.weight", "attn_norm.weight", layers, embed),
        "wq": _spec("linear", "self_attn.q_proj.weight", "attn_q.weight", layers, embed, q),
        "wk": _spec("linear", "self_attn.k_proj.weight", "attn_k.weight", layers, embed, kv),
        "wv": _spec("linear", "self_attn.v_proj.weight", "attn_v.weight", layers, embed, kv),
        "wo": _spec("linear", "self_attn.o_proj.weight", "attn_output.weight", layers, q, embed),
    }
    if cfg.attention_bias:
        block["bq"] = _spec("bias", "self_attn.q_proj.bias", "attn_q.bias", layers, q)
        block["bk"] = _spec("bias", "self_attn.k_proj.bias", "attn_k.bias", layers, kv)
        block["bv"] = _spec("bias", "self_attn.v_proj.bias", "attn_v.bias", layers, kv)
    if cfg.o_bias:
        block["bo"] = _spec("bias", "self_attn.o_proj.bias", "attn_output.bias", layers, embed)
    if cfg.attention_sinks:
        block["sinks"] = _spec("bias", "self_attn.sinks", "attn_sinks.weight", layers, (N, "heads"))
    if cfg.qk_norm:
        head = (H, "head_dim")
        block["q_norm"] = _spec("norm", "self_attn.q_norm.weight", "attn_q_norm.weight", layers, head)
        block["k_norm"] = _spec("norm", "self_attn.k_norm.weight", "attn_k_norm.weight", layers, head)
    if cfg.sandwich_norms:
        block["post_attn_norm"] = _spec(
            "norm", "post_attention_layernorm.weight", "post_attention_norm.weight", layers, embed
        )
    return block


def mla_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Pre-norm multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; ``jaxserve.layers.attention.mla_attention``
    on ``kernels.attention.mla``): the query from the hidden state directly (``wq``) or through a low-rank ``wq_a``,
    its norm and ``wq_b``; the latent [c ; k_pe] from ``wkv_a``, c normed by ``kv_a_norm``; ``wkv_b``
    [R, N (d_nope + d_v)], each head's key and value up-projections, absorbed into the query and the output; ``wo``.
    The latent dims (``latent``) are replicated: every device computes the whole latent and keeps it in its pool;
    the heads split after the up-projections."""
    L, D, N = cfg.num_layers, cfg.hidden_size, cfg.num_heads
    R, r, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    layers, embed, q = (L, "layers"), (D, "embed"), (N * cfg.head_dim, "q_heads")
    a = "self_attn."
    block = {"attn_norm": _spec("norm", "input_layernorm.weight", None, layers, embed)}
    if cfg.q_lora_rank is None:
        block["wq"] = _spec("linear", a + "q_proj.weight", None, layers, embed, q)
    else:
        rank = (cfg.q_lora_rank, "latent")
        block["wq_a"] = _spec("linear", a + "q_a_proj.weight", None, layers, embed, rank)
        block["q_a_norm"] = _spec("norm", a + "q_a_layernorm.weight", None, layers, rank)
        block["wq_b"] = _spec("linear", a + "q_b_proj.weight", None, layers, rank, q)
    block["wkv_a"] = _spec("linear", a + "kv_a_proj_with_mqa.weight", None, layers, embed, (R + r, "latent"))
    block["kv_a_norm"] = _spec("norm", a + "kv_a_layernorm.weight", None, layers, (R, "latent"))
    block["wkv_b"] = _spec(
        "absorbed", a + "kv_b_proj.weight", None, layers, (R, "latent"), (N * (cfg.qk_nope_head_dim + dv), "q_heads")
    )
    block["wo"] = _spec("linear", a + "o_proj.weight", None, layers, (N * dv, "q_heads"), embed)
    return block


def block_layers(cfg: ModelConfig) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(the layers of the dense MLP, the layers of the MoE block): None for every layer, () for none."""
    flags = cfg.moe_layer_flags()
    if not any(flags):
        return None, ()
    if all(flags):
        return (), None
    return tuple(i for i, f in enumerate(flags) if not f), tuple(i for i, f in enumerate(flags) if f)


def mlp_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Gated MLP (SwiGLU / GeGLU, ``jaxserve.layers.mlp.gated_mlp``): pre-norm, gate and up projections, down
    projection, and the norm after it under sandwich norms. HF calls the pre-MLP norm ``post_attention_layernorm``
    unless the model has sandwich norms, where that name is the norm after attention and this one is
    ``pre_feedforward_layernorm``. In a MoE model the norms stay (every layer has them) and the matrices are on the
    dense layers only (none, or some)."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    layers, embed, mlp = (L, "layers"), (D, "embed"), (F, "mlp")
    pre = "pre_feedforward_layernorm.weight" if cfg.sandwich_norms else "post_attention_layernorm.weight"
    dense, _ = block_layers(cfg)
    block = {"mlp_norm": _spec("norm", pre, "ffn_norm.weight", layers, embed)}
    if dense != ():
        block |= {
            "w_gate": _on(_spec("linear", "mlp.gate_proj.weight", "ffn_gate.weight", layers, embed, mlp), dense),
            "w_up": _on(_spec("linear", "mlp.up_proj.weight", "ffn_up.weight", layers, embed, mlp), dense),
            "w_down": _on(_spec("linear", "mlp.down_proj.weight", "ffn_down.weight", layers, mlp, embed), dense),
        }
    if cfg.sandwich_norms:
        block["post_mlp_norm"] = _spec(
            "norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight", layers, embed
        )
    return block


def moe_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The mixture of experts (``jaxserve.layers.mlp.moe_block``, ``jaxserve.layers.moe``) on the MoE layers: the
    router, the experts' stacked gate / up / down matrices and, for gpt-oss, their biases. HF names are Qwen3-MoE's
    (one tensor per expert); families that name them otherwise rename on load (``registry.Family.hf_renames``)."""
    _, moe = block_layers(cfg)
    if moe == ():
        return {}
    L, D, E, F = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    layers, embed, experts, mlp = (L, "layers"), (D, "embed"), (E, "experts"), (F, "expert_mlp")
    x = "mlp.experts.{e}."
    block = {
        # The router's outputs (one per expert) are replicated: every device routes every token.
        "router": _spec("router", "mlp.gate.weight", "ffn_gate_inp.weight", layers, embed, (E, "routes")),
        "expert_gate": _spec("experts", x + "gate_proj.weight", "ffn_gate_exps.weight", layers, experts, embed, mlp),
        "expert_up": _spec("experts", x + "up_proj.weight", "ffn_up_exps.weight", layers, experts, embed, mlp),
        "expert_down": _spec("experts", x + "down_proj.weight", "ffn_down_exps.weight", layers, experts, mlp, embed),
    }
    if cfg.moe_routing == "grouped_sigmoid":  # DeepSeek-V3: moves the choice of experts, not their weights
        block["router_correction"] = _spec("bias", "mlp.gate.e_score_correction_bias", None, layers, (E, "routes"))
    if cfg.shared_expert_intermediate_size:  # DeepSeek: a dense MLP every token runs beside the routed experts
        shared, se = (cfg.shared_expert_intermediate_size, "mlp"), "mlp.shared_experts."
        block["shared_gate"] = _spec("linear", se + "gate_proj.weight", None, layers, embed, shared)
        block["shared_up"] = _spec("linear", se + "up_proj.weight", None, layers, embed, shared)
        block["shared_down"] = _spec("linear", se + "down_proj.weight", None, layers, shared, embed)
    if cfg.moe_router_bias:
        block["router_bias"] = _spec("bias", "mlp.gate.bias", "ffn_gate_inp.bias", layers, (E, "routes"))
    if cfg.moe_expert_bias:
        block["expert_gate_bias"] = _spec("bias", x + "gate_proj.bias", "ffn_gate_exps.bias", layers, experts, mlp)
        block["expert_up_bias"] = _spec("bias", x + "up_proj.bias", "ffn_up_exps.bias", layers, experts, mlp)
        block["expert_down_bias"] = _spec("bias", x + "down_proj.bias", "ffn_down_exps.bias", layers, experts, embed)
    return {name: _on(spec, moe) for name, spec in block.items()}


def param_blocks(cfg: ModelConfig) -> dict[str, dict[str, ParamSpec]]:
    """The nested schema: the embedding, the per-layer blocks in the order a layer runs them, the final norm and
    the output projection (absent when tied to the embedding)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    final = {"final_norm": _spec("norm", "model.norm.weight", "output_norm.weight", (D, "embed"))}
    if not cfg.tie_word_embeddings:
        final["lm_head"] = _spec("linear", "lm_head.weight", "output.weight", (D, "embed"), (V, "vocab"))
    return {
        "embedding": {
            "embed": _spec("embedding", "model.embed_tokens.weight", "token_embd.weight", (V, "vocab"), (D, "embed"))
        },
        "attention": mla_block(cfg) if cfg.is_mla else attention_block(cfg),
        "mlp": mlp_block(cfg),
        "moe": moe_block(cfg),
        "final": final,
    }


def param_schema(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of the decoder for this config, flat: ``{name: ParamSpec}`` in ``param_blocks``' order."""
    flat: dict[str, ParamSpec] = {}
    for block in param_blocks(cfg).values():
        for name, spec in block.items():
            if name in flat:
                raise ValueError(f"parameter {name!r} is declared by two blocks")
            flat[name] = spec
    return flat


def layer_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The parameters stacked over every layer, which the layer scan slices."""
    return tuple(n for n, s in schema.items() if s.scanned)


def partial_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The parameters stacked over some layers only, which the layer indexes."""
    return tuple(n for n, s in schema.items() if s.per_layer and not s.scanned)


def matmul_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The per-layer matrices of the layer's products (bfloat16 copies under ``matmul_dtype``, C++ rows
    products on the CPU): the scanned linears (the experts run in ``jaxserve.kernels.moe``)."""
    return tuple(n for n, s in schema.items() if s.scanned and s.kind == "linear")


def quantizable_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The parameters ``--quantization`` quantizes: every matrix (expert stacks too) and the embedding."""
    return tuple(n for n, s in schema.items() if s.quantizable)


def random_params(cfg: ModelConfig, std: float, rng) -> dict:
    """Random float32 weights for ``cfg``: norm scales 1, the rest N(0, ``std``), drawn from the NumPy generator
    ``rng`` in ``param_schema``'s order. For tests and benchmarks whose subject is shapes or plumbing, not values."""
    import numpy as np

    return {
        n: (np.ones(s.shape, np.float32) if s.norm else rng.normal(0, std, s.shape).astype(np.float32))
        for n, s in param_schema(cfg).items()
    }
