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
KINDS = ("embedding", "linear", "bias", "norm")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter.

    Logical axes (``jaxserve.sharding.DEFAULT_RULES`` maps them to mesh axes): ``layers`` (the stacked layer
    axis), ``embed`` (hidden), ``vocab``, ``q_heads`` / ``kv_heads`` (heads x head_dim, flattened), ``head_dim``
    and ``mlp`` (the MLP hidden).

    ``hf`` and ``gguf`` are its tensor names in HF transformers and llama.cpp checkpoints; for a per-layer
    parameter, the part after ``model.layers.N.`` and ``blk.N.``. None: no such tensor.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    kind: str = "linear"
    hf: str | None = None
    gguf: str | None = None

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
        """Stacked over the layers (and run inside the layer scan)."""
        return self.axes[0] == "layers"

    @property
    def transposed(self) -> bool:
        """Stored [out, in] in HF and GGUF checkpoints, [in, out] here."""
        return self.kind == "linear"

    @property
    def quantizable(self) -> bool:
        """Served quantized under ``--quantization`` (and kept quantized from a GGUF file)."""
        return self.kind in ("embedding", "linear")


def _spec(kind: str, hf: str | None, gguf: str | None, *dims: tuple[int, str]) -> ParamSpec:
    return ParamSpec(tuple(n for n, _ in dims), tuple(a for _, a in dims), kind, hf, gguf)


def attention_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Pre-norm grouped-query attention: q/k/v/o projections, optional q/k/v biases (Qwen2), q/k norms (Qwen3,
    Gemma 3) and the norm after attention (sandwich norms, Gemma 2/3)."""
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
    if cfg.qk_norm:
        head = (H, "head_dim")
        block["q_norm"] = _spec("norm", "self_attn.q_norm.weight", "attn_q_norm.weight", layers, head)
        block["k_norm"] = _spec("norm", "self_attn.k_norm.weight", "attn_k_norm.weight", layers, head)
    if cfg.sandwich_norms:
        block["post_attn_norm"] = _spec(
            "norm", "post_attention_layernorm.weight", "post_attention_norm.weight", layers, embed
        )
    return block


def mlp_block(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Gated MLP (SwiGLU / GeGLU): pre-norm, gate and up projections, down projection, and the norm after it
    under sandwich norms. HF calls the pre-MLP norm ``post_attention_layernorm`` unless the model has sandwich
    norms, where that name is the norm after attention and this one is ``pre_feedforward_layernorm``."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    layers, embed, mlp = (L, "layers"), (D, "embed"), (F, "mlp")
    pre = "pre_feedforward_layernorm.weight" if cfg.sandwich_norms else "post_attention_layernorm.weight"
    block = {
        "mlp_norm": _spec("norm", pre, "ffn_norm.weight", layers, embed),
        "w_gate": _spec("linear", "mlp.gate_proj.weight", "ffn_gate.weight", layers, embed, mlp),
        "w_up": _spec("linear", "mlp.up_proj.weight", "ffn_up.weight", layers, embed, mlp),
        "w_down": _spec("linear", "mlp.down_proj.weight", "ffn_down.weight", layers, mlp, embed),
    }
    if cfg.sandwich_norms:
        block["post_mlp_norm"] = _spec(
            "norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight", layers, embed
        )
    return block


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
        "attention": attention_block(cfg),
        "mlp": mlp_block(cfg),
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
    """The parameters stacked over the layers, which the layer scan slices."""
    return tuple(n for n, s in schema.items() if s.per_layer)


def matmul_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The per-layer matrices of the layer's products (bfloat16 copies under ``matmul_dtype``, C++ rows
    products on the CPU)."""
    return tuple(n for n, s in schema.items() if s.per_layer and s.kind == "linear")


def quantizable_names(schema: dict[str, ParamSpec]) -> tuple[str, ...]:
    """The parameters ``--quantization`` quantizes: every matrix and the embedding."""
    return tuple(n for n, s in schema.items() if s.quantizable)


def random_params(cfg: ModelConfig, std: float, rng) -> dict:
    """Random float32 weights for ``cfg``: norm scales 1, the rest N(0, ``std``), drawn from the NumPy generator
    ``rng`` in ``param_schema``'s order. For tests and benchmarks whose subject is shapes or plumbing, not values."""
    import numpy as np

    return {
        n: (np.ones(s.shape, np.float32) if s.norm else rng.normal(0, std, s.shape).astype(np.float32))
        for n, s in param_schema(cfg).items()
    }
