"""The model families jaxserve serves: one descriptor each, and nothing about a family anywhere else.

A :class:`Family` says which checkpoints are of the family (HF ``model_type``, llama.cpp's
``general.architecture``), which ``ModelConfig`` fields the family fixes, and how its config and GGUF metadata
give the fields only it has (sliding-window layouts, soft caps, ...). Tensor names come from the parameter schema
(``jaxserve.models.schema``), which is the same for every family built of the same blocks. Adding a family is adding
a descriptor to ``FAMILIES`` (and a block to the schema where its math is new); docs/adding-a-model.md.

Host code: no jax here (``jaxserve.config`` reads it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

# hf_fields(config_json, fields) / gguf_fields(meta, fields) -> the family's own ModelConfig fields. ``fields``:
# what the common reader made of the checkpoint (num_layers, hidden_size, head_dim, ...); ``meta(key, default)``:
# a GGUF metadata value under ``{architecture}.`` (default ``...``: required, a clear error when absent).
FieldsFn = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def _none(source, fields) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: ``ModelConfig.architecture``.
        hf_model_types: the ``model_type`` values of its HF ``config.json``.
        gguf_architecture: llama.cpp's ``general.architecture`` for it; None: not read from GGUF (llama.cpp
            converts Mistral to ``llama``, which loads as the llama family).
        flags: ``ModelConfig`` fields the family fixes, whatever the checkpoint's format.
        hf_defaults: ``config.json`` keys that may be absent, and their value then (its config class's defaults).
        hf_fields, gguf_fields: the family's own fields from a ``config.json`` / the GGUF metadata.
        gguf_permuted_qk: llama.cpp's converter interleaved the halves of each q/k head (the rope convention of
            its "normal" rope); the loader undoes it.
        gguf_moe_family: the family a file of ``gguf_architecture`` is when its ``{arch}.expert_count`` is above 0
            (llama.cpp writes Mixtral as ``llama``); None: this family's own. The file's family still decides
            how its tensors are stored (``gguf_permuted_qk``, ``gguf_fused``).
        hf_tensor_prefixes: checkpoint name prefixes renamed on load (prefix -> replacement; None: not this
            model's tensors, skipped), e.g. a multimodal checkpoint's language model and vision tower.
        hf_fused: a fused checkpoint tensor (per-layer name) -> the schema's tensors it holds, stacked along its
            rows (its output channels) in this order; each takes its schema shape's share. Split on load.
        gguf_fused: a per-layer GGUF tensor -> the fused HF tensor of ``hf_fused`` it is (llama.cpp keeps them).
        hf_renames: (regex, replacement) pairs applied in order to a per-layer tensor's name (after
            ``model.layers.N.``), for a family that names a block's tensors otherwise than the schema (Mixtral's
            ``block_sparse_moe.experts.E.w1``).
        hf_fixup: ``(per-layer name, array) -> [(per-layer name, array), ...]`` in the schema's names and HF's
            layout, for tensors a rename cannot express (gpt-oss's interleaved gate / up stack); after the renames.
        hf_mtp_layers: the checkpoint's layers past ``num_hidden_layers`` are multi-token-prediction modules
            (DeepSeek-V3's ``num_nextn_predict_layers``), skipped on load and named in the log.
        hf_dense_layer_settings: the ``config.json`` settings that keep some layers of a MoE model dense
            (``ModelConfig.moe_layers``), named where such a model is refused.
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_architecture: str | None = None
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_fields: FieldsFn = _none
    gguf_fields: FieldsFn = _none
    gguf_permuted_qk: bool = False
    gguf_moe_family: str | None = None
    hf_tensor_prefixes: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    hf_fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    gguf_fused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hf_renames: tuple[tuple[str, str], ...] = ()
    hf_fixup: Callable[[str, Any], list[tuple[str, Any]]] | None = None
    hf_mtp_layers: bool = False
    hf_dense_layer_settings: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "flags", MappingProxyType(dict(self.flags)))
        object.__setattr__(self, "hf_defaults", MappingProxyType(dict(self.hf_defaults)))
        object.__setattr__(self, "hf_tensor_prefixes", MappingProxyType(dict(self.hf_tensor_prefixes)))
        object.__setattr__(self, "hf_fused", MappingProxyType(dict(self.hf_fused)))
        object.__setattr__(self, "gguf_fused", MappingProxyType(dict(self.gguf_fused)))

    def hf_tensor_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the schema knows it; None: a tensor of another model (skipped)."""
        for prefix, replacement in self.hf_tensor_prefixes.items():
            if name.startswith(prefix):
                return None if replacement is None else replacement + name[len(prefix) :]
        return name

    def hf_layer_tensors(self, name: str, array) -> list[tuple[str, Any]]:
        """A per-layer tensor (its name after ``model.layers.N.``) under the schema's names: renamed, fixed up."""
        for pattern, replacement in self.hf_renames:
            name = re.sub(pattern, replacement, name)
        return self.hf_fixup(name, array) if self.hf_fixup else [(name, array)]


# ------------------------------------------------------------------------------------------ the families' own fields
def _mistral_hf(hf, fields) -> dict[str, Any]:
    return {"sliding_window": hf.get("sliding_window") or None}


def _qwen_hf(hf, fields) -> dict[str, Any]:
    """Qwen2/3 configs carry a ``sliding_window`` that applies only with ``use_sliding_window``, to the layers from
    ``max_window_layers`` on."""
    if not hf.get("use_sliding_window", False) or not hf.get("sliding_window"):
        return {}
    n = fields["num_layers"]
    first = hf.get("max_window_layers", n)
    return {"sliding_window": hf["sliding_window"], "sliding_window_layers": tuple(i >= first for i in range(n))}


def alternating_sliding_layers(num_layers: int) -> tuple[bool, ...]:
    """Gemma 2's layer pattern when the checkpoint does not list one: sliding window (local) on even layers, full
    attention (global) on odd ones."""
    return tuple(i % 2 == 0 for i in range(num_layers))


def _gemma2_hf(hf, fields) -> dict[str, Any]:
    out = {
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
        "attn_logit_softcap": hf.get("attn_logit_softcapping"),
        "final_logit_softcap": hf.get("final_logit_softcapping"),
    }
    if hf.get("sliding_window"):
        types = hf.get("layer_types")
        out["sliding_window"] = hf["sliding_window"]
        out["sliding_window_layers"] = (
            tuple(t == "sliding_attention" for t in types)
            if types
            else alternating_sliding_layers(fields["num_layers"])
        )
    return out


def _gemma3_hf(hf, fields) -> dict[str, Any]:
    """Gemma 3: Gemma 2's fields, a layer pattern of 5 local : 1 global by default, and the local layers' own rope
    base (transformers 5: ``rope_parameters["sliding_attention"]``; before: ``rope_local_base_freq``)."""
    n = fields["num_layers"]
    if not hf.get("layer_types"):
        every = hf.get("sliding_window_pattern", 6)
        hf = {
            **hf,
            "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)],
        }
    unknown = sorted(set(hf["layer_types"]) - {"sliding_attention", "full_attention"})
    if unknown or len(hf["layer_types"]) != n:
        raise ValueError(
            f"gemma3: layer_types must list {n} of 'sliding_attention' / 'full_attention', got {hf['layer_types']}"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention (EmbeddingGemma, an encoder) is not supported")
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3: a rope scaling on the local layers ({local['rope_type']!r}) is not supported")
    theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    # transformers' default global base is 1e6 (the hub's 4B / 12B / 27B configs leave it out), not 10,000.
    global_theta = hf.get("rope_theta", (rope.get("full_attention") or {}).get("rope_theta", 1_000_000.0))
    return _gemma2_hf(hf, fields) | {"rope_theta": float(global_theta), "local_rope_theta": float(theta)}


def _gemma3_gguf(meta, fields) -> dict[str, Any]:
    n, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    return {
        # llama.cpp: every 6th layer global, a fixed 10,000 rope base on the local ones; the 27B model (62 layers)
        # scales attention by hidden / heads, the others by head_dim.
        "sliding_window": meta("attention.sliding_window", None) or 4096,
        "sliding_window_layers": tuple((i + 1) % 6 != 0 for i in range(n)),
        "local_rope_theta": 10000.0,
        "query_pre_attn_scalar": float(hidden // heads if n == 62 else fields["head_dim"]),
    }


def _gemma2_gguf(meta, fields) -> dict[str, Any]:
    n, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
    return {
        "sliding_window": meta("attention.sliding_window", None) or 4096,  # llama.cpp's default when absent
        "sliding_window_layers": alternating_sliding_layers(n),
        # llama.cpp does not store query_pre_attn_scalar; it scales by head_dim ** -0.5, except for the 46-layer
        # 27B model, which uses hidden / heads (as does its HF config: 144).
        "query_pre_attn_scalar": float(hidden // heads if n == 46 else fields["head_dim"]),
        "attn_logit_softcap": float(meta("attn_logit_softcapping", 50.0)),
        "final_logit_softcap": float(meta("final_logit_softcapping", 30.0)),
    }


# A multimodal checkpoint (HF's ...ForConditionalGeneration) as its language model: the names transformers writes
# (the hub's checkpoints', and transformers 5's save_pretrained's) and those of its in-memory modules.
_MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "vision_tower.": None,
    "model.vision_tower.": None,
    "multi_modal_projector.": None,
    "model.multi_modal_projector.": None,
}


def _phi3_hf(hf, fields) -> dict[str, Any]:
    """Phi-3's ``sliding_window`` applies to every layer (Phi-3-mini-4k: 2047)."""
    return {"sliding_window": hf.get("sliding_window") or None}


# ------------------------------------------------------------------------------------------ mixtures of experts
def _moe_fields(hf, fields, moe_layers=None) -> dict[str, Any]:
    """The MoE fields every MoE family's config has (transformers 5 writes ``num_local_experts`` where the hub's
    Qwen3-MoE configs say ``num_experts``)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ValueError(f"{hf.get('model_type')}: config.json gives no expert count (num_experts / num_local_experts)")
    if moe_layers is not None and all(moe_layers):
        moe_layers = None
    return {"num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"], "moe_layers": moe_layers}


def _mixtral_hf(hf, fields) -> dict[str, Any]:
    return _mistral_hf(hf, fields) | _moe_fields(hf, fields)


def _qwen3_moe_hf(hf, fields) -> dict[str, Any]:
    """Qwen3-MoE: the MoE block on layers not in ``mlp_only_layers`` whose number is a multiple of
    ``decoder_sparse_step`` (transformers' rule), the dense MLP (``intermediate_size``) on the others."""
    n, step = fields["num_layers"], hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or ())
    flags = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    out = _qwen_hf(hf, fields) | {"norm_topk_prob": hf.get("norm_topk_prob", False)}
    if not any(flags):
        return out  # no MoE layer: a dense model
    return out | _moe_fields(hf, fields, flags) | {"moe_intermediate_size": hf["moe_intermediate_size"]}


def _qwen3_moe_gguf(meta, fields) -> dict[str, Any]:
    """llama.cpp's qwen3moe always renormalizes the chosen experts' weights (its graph passes norm_w = true, and
    its converter writes no key for it); transformers' GGUF loader sets ``norm_topk_prob=True`` likewise."""
    return {"norm_topk_prob": True}


def _gpt_oss_hf(hf, fields) -> dict[str, Any]:
    """gpt-oss: sliding and full attention alternating (``layer_types``), sinks, biases on every projection, the
    clamped SwiGLU; ``intermediate_size`` is each expert's."""
    types = hf.get("layer_types")
    n = fields["num_layers"]
    sliding = tuple(t == "sliding_attention" for t in types) if types else alternating_sliding_layers(n)
    if types and (len(types) != n or set(types) - {"sliding_attention", "full_attention"}):
        raise ValueError(f"gpt_oss: layer_types must list {n} of 'sliding_attention' / 'full_attention', got {types}")
    return _moe_fields(hf, fields) | {
        "sliding_window": hf.get("sliding_window") or 128,
        "sliding_window_layers": sliding,
        "o_bias": bool(hf.get("attention_bias", True)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def _gpt_oss_fixup(name: str, array) -> list[tuple[str, Any]]:
    """gpt-oss's expert stacks ([E, in, out], gate and up interleaved column by column in one ``gate_up_proj``) as
    the schema's stacked [E, out, in] tensors and [E, out] biases. MXFP4 stacks come quantized, already [E, out, in]
    (``loading.mxfp4``): their output rows are split the same way."""
    import numpy as np

    x = "mlp.experts."
    if hasattr(array, "scale") and name == x + "gate_up_proj":
        return [
            (x + "gate_proj.weight", array.map_rows(lambda v: v[:, ::2])),
            (x + "up_proj.weight", array.map_rows(lambda v: v[:, 1::2])),
        ]
    if hasattr(array, "scale") and name == x + "down_proj":
        return [(x + "down_proj.weight", array)]
    if name == x + "gate_up_proj":
        return [
            (x + "gate_proj.weight", np.swapaxes(array[..., ::2], 1, 2)),
            (x + "up_proj.weight", np.swapaxes(array[..., 1::2], 1, 2)),
        ]
    if name == x + "gate_up_proj_bias":
        return [(x + "gate_proj.bias", array[..., ::2]), (x + "up_proj.bias", array[..., 1::2])]
    if name == x + "down_proj":
        return [(x + "down_proj.weight", np.swapaxes(array, 1, 2))]
    if name == x + "down_proj_bias":
        return [(x + "down_proj.bias", array)]
    if name.startswith(x) and name.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"gpt_oss: tensor {name!r} is MXFP4, but config.json has no quantization_config with quant_method "
            "'mxfp4' (the checkpoint's own config names it)"
        )
    return [(name, array)]


def _deepseek_fields(hf, fields, routing: dict[str, Any], interleave: bool) -> dict[str, Any]:
    """DeepSeek-V2 / V3's: multi-head latent attention (``head_dim`` in their config.json is the rotary part's; the
    query head is qk_nope_head_dim + qk_rope_head_dim), the first ``first_k_dense_replace`` layers dense, the others
    MoE with shared experts and the ``routing`` given."""
    n, first = fields["num_layers"], hf.get("first_k_dense_replace") or 0
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    out = {
        "head_dim": nope + rope,
        "num_kv_heads": 1,
        "kv_lora_rank": hf["kv_lora_rank"],
        "q_lora_rank": hf.get("q_lora_rank"),
        "qk_rope_head_dim": rope,
        "v_head_dim": hf["v_head_dim"],
        "rope_interleave": interleave,
    }
    flags = tuple(i >= first for i in range(n))
    experts = hf.get("n_routed_experts")
    if not experts or not any(flags):
        return out
    return out | {
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_layers": None if all(flags) else flags,
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        **routing,
    }


def _deepseek_v3_hf(hf, fields) -> dict[str, Any]:
    """DeepSeek-V3 / R1, Kimi-K2: sigmoid scores with the score-correction bias, groups scored by their two best."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            raise ValueError(f"{hf.get('model_type')}: {key}={hf[key]!r} is not supported (only {want!r})")
    routing = {
        "moe_routing": "grouped_sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
    }
    return _deepseek_fields(hf, fields, routing, bool(hf.get("rope_interleave", True)))


def _deepseek_v2_hf(hf, fields) -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite: a softmax over the experts, the top k of it ("greedy") or of the ``topk_group`` groups
    with the best experts ("group_limited_greedy"), not renormalized (transformers' DeepseekV2 never does), times
    ``routed_scaling_factor``; rotary dims in interleaved pairs (its complex rope)."""
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2: topk_method={method!r} is not supported ('greedy', 'group_limited_greedy')")
    grouped = method == "group_limited_greedy"
    routing = {
        "moe_routing": "grouped_softmax",
        "norm_topk_prob": False,
        "n_group": (hf.get("n_group") or 1) if grouped else 1,
        "topk_group": (hf.get("topk_group") or 1) if grouped else 1,
    }
    return _deepseek_fields(hf, fields, routing, True)


_MIXTRAL_RENAMES = (
    (r"^block_sparse_moe\.gate\.", "mlp.gate."),
    (r"^block_sparse_moe\.experts\.(\d+)\.w1\.", r"mlp.experts.\1.gate_proj."),
    (r"^block_sparse_moe\.experts\.(\d+)\.w3\.", r"mlp.experts.\1.up_proj."),
    (r"^block_sparse_moe\.experts\.(\d+)\.w2\.", r"mlp.experts.\1.down_proj."),
)

# Gemma3TextConfig's defaults: the hub's multimodal configs list only what differs from them (4B: not even the
# number of heads or the vocabulary).
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}

_GEMMA = {"hidden_act": "gelu_pytorch_tanh", "norm_weight_offset": 1.0, "scale_embeddings": True}

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "llama", gguf_permuted_qk=True, gguf_moe_family="mixtral"),
    Family("mistral", ("mistral",), hf_fields=_mistral_hf),
    Family("qwen2", ("qwen2",), "qwen2", hf_defaults={"attention_bias": True}, hf_fields=_qwen_hf),
    Family("qwen3", ("qwen3",), "qwen3", flags={"qk_norm": True}, hf_fields=_qwen_hf),
    Family("gemma", ("gemma",), "gemma", flags=_GEMMA, hf_defaults={"tie_word_embeddings": True}),
    Family(
        "gemma2",
        ("gemma2",),
        "gemma2",
        flags=_GEMMA | {"sandwich_norms": True},
        hf_defaults={"tie_word_embeddings": True},
        hf_fields=_gemma2_hf,
        gguf_fields=_gemma2_gguf,
    ),
    Family(
        "gemma3",
        ("gemma3_text", "gemma3"),  # gemma3: the multimodal 4B / 12B / 27B, served as their language model
        "gemma3",
        flags=_GEMMA | {"sandwich_norms": True, "qk_norm": True},
        hf_defaults=_GEMMA3_TEXT_DEFAULTS,
        hf_fields=_gemma3_hf,
        gguf_fields=_gemma3_gguf,
        hf_tensor_prefixes=_MULTIMODAL_PREFIXES,
    ),
    Family(
        "phi3",
        ("phi3",),
        "phi3",
        hf_fields=_phi3_hf,
        gguf_fields=lambda meta, fields: {"sliding_window": meta("attention.sliding_window", None) or None},
        gguf_fused={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
        hf_fused={
            "self_attn.qkv_proj.weight": (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ),
            "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        },
    ),
    Family("mixtral", ("mixtral",), hf_fields=_mixtral_hf, hf_renames=_MIXTRAL_RENAMES),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        flags={"qk_norm": True},
        hf_defaults={"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False},
        hf_fields=_qwen3_moe_hf,
        hf_dense_layer_settings=("mlp_only_layers", "decoder_sparse_step"),
        gguf_architecture="qwen3moe",
        gguf_fields=_qwen3_moe_gguf,
    ),
    Family(
        "gpt_oss",
        ("gpt_oss",),
        flags={
            "attention_sinks": True,
            "moe_activation": "swiglu_clamped",
            "moe_router_bias": True,
            "moe_expert_bias": True,
        },
        hf_defaults={"attention_bias": True},
        hf_fields=_gpt_oss_hf,
        hf_renames=((r"^mlp\.router\.", "mlp.gate."),),
        hf_fixup=_gpt_oss_fixup,
    ),
    Family(
        "deepseek_v2",
        ("deepseek_v2",),
        hf_defaults={"first_k_dense_replace": 0, "n_shared_experts": 2, "topk_method": "greedy", "q_lora_rank": 1536},
        hf_fields=_deepseek_v2_hf,
        hf_mtp_layers=True,
        hf_dense_layer_settings=("first_k_dense_replace",),
    ),
    Family(
        "deepseek_v3",
        ("deepseek_v3", "kimi_k2"),
        hf_defaults={"first_k_dense_replace": 3, "n_shared_experts": 1, "rope_interleave": True, "q_lora_rank": 1536},
        hf_fields=_deepseek_v3_hf,
        hf_mtp_layers=True,
        hf_dense_layer_settings=("first_k_dense_replace",),
    ),
)


# ------------------------------------------------------------------------------------------ lookups
def names() -> tuple[str, ...]:
    """Every family's ``ModelConfig.architecture``."""
    return tuple(f.name for f in FAMILIES)


def family(name: str) -> Family:
    """The family of a ``ModelConfig.architecture``.

    Raises:
        ValueError: no such family, naming the known ones.
    """
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"model family {name!r} is not supported; known: {', '.join(names())}")


def for_hf(config: Mapping[str, Any]) -> Family:
    """The family of an HF ``config.json``.

    Raises:
        ValueError: its ``model_type`` is no family's, naming it, its ``architectures`` and the supported types.
    """
    model_type = config.get("model_type")
    for f in FAMILIES:
        if model_type in f.hf_model_types:
            return f
    known = sorted(t for f in FAMILIES for t in f.hf_model_types)
    raise ValueError(
        f"unknown architecture: model_type={model_type!r} (architectures={config.get('architectures')}); "
        f"jaxserve supports {', '.join(known)}"
    )


def gguf_architectures() -> tuple[str, ...]:
    return tuple(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)


def for_gguf(architecture: str | None, where: str) -> Family:
    """The family of a GGUF file's ``general.architecture``.

    Raises:
        ValueError: no family reads it, naming ``where`` (the file), the architecture and the supported ones.
    """
    for f in FAMILIES:
        if f.gguf_architecture is not None and f.gguf_architecture == architecture:
            return f
    raise ValueError(
        f"{where}: GGUF architecture {architecture!r} is not supported; "
        f"jaxserve supports {', '.join(gguf_architectures())}"
    )
