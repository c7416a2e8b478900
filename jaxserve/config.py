"""Frozen, validated configuration dataclasses.

Every config is a frozen dataclass checked in ``__post_init__``: a bad value fails at construction time
with a ``ValueError`` that names the field. Variants are made with ``dataclasses.replace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from jaxserve.models import registry


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A rope scaling (``jaxserve.layers.rope`` computes it): "linear", "llama3" (``low_freq_factor``,
    ``high_freq_factor``), "yarn" (``beta_fast``, ``beta_slow``, ``truncate``, ``mscale``, ``mscale_all_dim``) or
    "longrope" (``short_factor``, ``long_factor``: one divisor per frequency); ``attention_factor`` overrides the
    cos / sin scale YaRN and longrope derive from ``factor``."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor!r}")
        _positive(self, "original_max_position_embeddings")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
            elif self.rope_type == "longrope":
                raise ValueError(f"RopeScaling.{name} is required by rope_type 'longrope'")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    The architecture flags (bias, QK-norm, Gemma norms, soft caps, sliding windows) are explicit fields so
    that one model implementation covers every supported family.
    """

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections.
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before rope.
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w).
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size).
    sandwich_norms: bool = False  # Gemma-2: extra norms after attention and around the MLP.
    query_pre_attn_scalar: float | None = None  # Gemma-2: attention scale is this ** -0.5.
    attn_logit_softcap: float | None = None  # Gemma-2.
    final_logit_softcap: float | None = None  # Gemma-2.
    sliding_window: int | None = None  # Mistral / Gemma-2 window, in tokens.
    sliding_window_layers: tuple[bool, ...] | None = None  # per layer; None = all layers if window set
    local_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' own rope base (no scaling)
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rope rotates only this share of each head (rotary_dim)
    o_bias: bool = False  # gpt-oss: a bias on the attention's output projection too
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax's denominator
    # Mixture of experts (``jaxserve.layers.moe``): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int | None = None  # one expert's hidden size (None: intermediate_size)
    norm_topk_prob: bool = True  # softmax over the chosen k (Mixtral, gpt-oss) or their share of the softmax over all
    moe_layers: tuple[bool, ...] | None = None  # per layer, MoE (True) or the dense MLP; None: every layer MoE
    moe_activation: str = "swiglu"  # or gpt-oss's "swiglu_clamped" (swiglu_alpha, swiglu_limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_router_bias: bool = False  # gpt-oss
    moe_expert_bias: bool = False  # gpt-oss: biases on each expert's gate, up and down products
    # DeepSeek-V3 / Kimi-K2 routing ("grouped_sigmoid", ``kernels.moe.route_grouped``): sigmoid scores, a
    # score-correction bias moving the choice, the experts in ``n_group`` groups of which ``topk_group`` are open,
    # the weights times ``routed_scaling_factor``; DeepSeek-V2's "grouped_softmax" (softmax scores, no bias);
    # "softmax" (``kernels.route``) for every other family.
    moe_routing: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # DeepSeek: shared experts, a dense MLP beside the routed ones
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), on when ``kv_lora_rank`` > 0: the pool holds one
    # latent per token, [c (kv_lora_rank) ; k_pe (qk_rope_head_dim)]; ``head_dim`` is the query / key head's
    # qk_nope_head_dim + qk_rope_head_dim, ``v_head_dim`` the value head's; ``q_lora_rank`` None: a direct q_proj;
    # ``num_kv_heads`` is 1 (one latent a token, replicated on every device under tensor parallelism).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims stored as interleaved pairs (DeepSeek's checkpoints)
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __post_init__(self):
        if self.architecture not in registry.names():
            raise ValueError(
                f"ModelConfig.architecture {self.architecture!r} is not supported; known: {', '.join(registry.names())}"
            )
        _positive(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"ModelConfig.hidden_act must be 'silu' or 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.local_rope_theta is not None and not (self.local_rope_theta > 0 and self.sliding_window):
            raise ValueError(
                f"ModelConfig.local_rope_theta must be > 0 and needs a sliding_window, got {self.local_rope_theta!r} "
                f"with sliding_window={self.sliding_window!r}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.sliding_window_layers is not None and len(self.sliding_window_layers) != self.num_layers:
            raise ValueError(
                f"ModelConfig.sliding_window_layers has {len(self.sliding_window_layers)} entries, "
                f"expected num_layers={self.num_layers}"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor must be in (0, 1] and give an even rotary_dim > 0, got "
                f"{self.partial_rotary_factor!r} (rotary_dim {self.rotary_dim} of head_dim {self.head_dim})"
            )
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(rs, name)) != self.rotary_dim // 2:
                    raise ValueError(
                        f"ModelConfig.rope_scaling.{name} has {len(getattr(rs, name))} entries, expected "
                        f"rotary_dim / 2 = {self.rotary_dim // 2}"
                    )
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        self._check_moe()
        self._check_mla()

    def _check_mla(self) -> None:
        if not self.is_mla:
            if self.q_lora_rank is not None or self.qk_rope_head_dim or self.v_head_dim:
                raise ValueError(
                    f"ModelConfig: q_lora_rank={self.q_lora_rank} / qk_rope_head_dim={self.qk_rope_head_dim} / "
                    f"v_head_dim={self.v_head_dim} are multi-head latent attention's and need kv_lora_rank > 0"
                )
            return
        _positive(self, "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= self.head_dim:
            raise ValueError(
                f"ModelConfig.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and below head_dim "
                f"({self.head_dim} = qk_nope_head_dim + qk_rope_head_dim)"
            )
        unsupported = [
            n for n in ("attention_bias", "qk_norm", "sandwich_norms", "attention_sinks", "o_bias") if getattr(self, n)
        ]
        if unsupported or self.sliding_window is not None or self.attn_logit_softcap is not None:
            raise ValueError(
                f"ModelConfig: multi-head latent attention does not combine with {unsupported or 'sliding windows'}"
                " / soft caps"
            )

    def _check_moe(self) -> None:
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.moe_layers is not None:
                raise ValueError(
                    f"ModelConfig: num_experts_per_tok={self.num_experts_per_tok} / moe_layers={self.moe_layers} "
                    "need num_experts > 0"
                )
            return
        _positive(self, "num_experts", "num_experts_per_tok")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts}): each token picks that many distinct experts"
            )
        if self.moe_intermediate_size is not None:
            _positive(self, "moe_intermediate_size")
        if self.moe_layers is not None:
            if len(self.moe_layers) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.moe_layers has {len(self.moe_layers)} entries, expected num_layers={self.num_layers}"
                )
            if not any(self.moe_layers):
                raise ValueError("ModelConfig.moe_layers marks no layer MoE; a dense model has num_experts=0")
        if self.moe_routing not in ("softmax", "grouped_sigmoid", "grouped_softmax"):
            raise ValueError(
                "ModelConfig.moe_routing must be 'softmax', 'grouped_sigmoid' or 'grouped_softmax', got "
                f"{self.moe_routing!r}"
            )
        _positive(self, "n_group", "topk_group")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(
                f"ModelConfig: n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and be >= "
                f"topk_group ({self.topk_group})"
            )
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                f"topk_group={self.topk_group} open groups"
            )
        if self.moe_activation not in ("swiglu", "swiglu_clamped"):
            raise ValueError(
                f"ModelConfig.moe_activation must be 'swiglu' or 'swiglu_clamped', got {self.moe_activation!r}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer_flags(self) -> tuple[bool, ...]:
        """Per layer: MoE block (True) or dense MLP."""
        if not self.is_moe:
            return (False,) * self.num_layers
        return self.moe_layers or (True,) * self.num_layers

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rope rotates (the rest pass through); MLA: its decoupled rotary dims."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """The pool's (K, V) row widths per KV head: (head_dim, head_dim); MLA: the latent (kv_lora_rank +
        qk_rope_head_dim) in the K pool, [layers, pages, page_size, width], and nothing in the V pool."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.head_dim, self.head_dim

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        scale = 1.0 / math.sqrt(base)
        rs = self.rope_scaling
        if self.is_mla and rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim and rs.factor > 1:
            # DeepSeek scales q . k by YaRN's mscale(factor, mscale_all_dim) squared, the non-rotary dims too.
            mscale = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def layer_windows(self) -> tuple[int, ...]:
        """Sliding window per layer, 0 meaning full attention."""
        if self.sliding_window is None:
            return (0,) * self.num_layers
        flags = self.sliding_window_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if f else 0 for f in flags)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Builds a config from our own field names (the format of ``configs/*.json``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
        data = dict(data)
        if isinstance(data.get("rope_scaling"), dict):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        for name in ("eos_token_ids", "sliding_window_layers", "moe_layers"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: the model type is not a supported architecture.
        """
        family = registry.for_hf(hf)
        if isinstance(hf.get("text_config"), dict):  # a multimodal config: its language model's, under the top's
            hf = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")} | hf["text_config"]
        hf = dict(family.hf_defaults) | hf  # the family's values for the keys its configs may leave out
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        fields = dict(
            architecture=family.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            **_hf_rope(hf),
        )
        fields |= family.flags
        act = hf.get("hidden_activation") or hf.get("hidden_act") or fields.get("hidden_act", "silu")
        # Gemma's reference implementation uses the tanh approximation for "gelu".
        fields["hidden_act"] = "gelu_pytorch_tanh" if act in ("gelu", "gelu_pytorch_tanh") else act
        fields |= family.hf_fields(hf, fields)
        return cls(**fields)


# config.json's rope keys -> RopeScaling fields, per rope type.
_HF_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
    ),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
}


def _hf_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from a ``config.json``: transformers 4 writes ``rope_theta`` /
    ``rope_scaling``, transformers 5 one ``rope_parameters`` dict.

    Raises:
        ValueError: a rope type jaxserve does not implement (naming it and the supported ones), or a missing key.
    """
    rope_params = hf.get("rope_parameters") or {}
    if "full_attention" in rope_params:  # one dict per layer type (Gemma 3): the global layers' is the model's
        rope_params = rope_params["full_attention"] or {}
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    partial = {
        "partial_rotary_factor": float(hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
    }
    rs = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    if not rs or rs.get("rope_type", rs.get("type", "default")) == "default":
        return {"rope_theta": theta, "rope_scaling": None} | partial
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type == "su":  # Phi-3's first configs: longrope's old name
        rope_type = "longrope"
    if rope_type not in _HF_ROPE_KEYS:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; jaxserve implements {', '.join(_HF_ROPE_KEYS)}"
        )
    fields = {k: rs[k] for k in _HF_ROPE_KEYS[rope_type] if rs.get(k) is not None}
    if rope_type in ("yarn", "longrope"):
        # Phi-3 and DeepSeek keep the pretraining context here and the extended one in max_position_embeddings.
        original = rs.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
        if original is None:
            raise ValueError(f"rope scaling {rope_type!r} needs original_max_position_embeddings")
        fields["original_max_position_embeddings"] = original
        if fields.get("factor") is None:
            fields["factor"] = hf.get("max_position_embeddings", original) / original
    return {"rope_theta": theta, "rope_scaling": RopeScaling(rope_type, **fields)} | partial


def list_presets() -> list[str]:
    from jaxserve import configs

    return configs.list_presets()


def load_preset(name: str) -> ModelConfig:
    """Loads a model preset from ``configs/`` by name (e.g. ``"smollm2-135m"``)."""
    from jaxserve import configs

    return ModelConfig.from_dict(json.loads(configs.preset_path(name).read_text())["model"])


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: ``num_pages`` pages of ``page_size`` tokens per layer.

    If ``num_pages`` is None, the pool is sized from ``kv_cache_memory``: bytes (an int) or a fraction (a
    float in (0, 1]) of the memory available at startup; if that is None too, from
    ``kv_cache_memory_fraction`` of the device memory left after the weights (on the CPU: what every
    sequence can use, within a share of the available host memory).
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.9
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU/TPU.
    kv_cache_memory: int | float | None = None

    def __post_init__(self):
        _positive(self, "page_size")
        if self.num_pages is not None:
            _positive(self, "num_pages")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"CacheConfig.kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}"
            )
        if self.dtype is not None and self.dtype not in KV_DTYPES:
            raise ValueError(f"CacheConfig.dtype must be one of {KV_DTYPES} or None, got {self.dtype!r}")
        m = self.kv_cache_memory
        if m is not None and (
            isinstance(m, bool) or not (isinstance(m, int) and m > 0 or isinstance(m, float) and 0 < m <= 1)
        ):
            raise ValueError(
                f"CacheConfig.kv_cache_memory must be bytes (an int > 0), a fraction of the available "
                f"memory (a float in (0, 1]) or None, got {m!r}"
            )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Host-side batching policy."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    speculative: SpeculativeConfig | None = None
    # Steps scheduled while the previous one runs: each sampled token is counted pending until its step's results are
    # read (``jaxserve.core.sched.async_scheduler.AsyncScheduler``), and the runner feeds it to the next step on the
    # device.
    async_scheduling: bool = False
    # Pipeline parallelism's batches in flight (one per stage,
    # ``jaxserve.core.sched.async_scheduler.PipelineScheduler``): each holds at most max_num_seqs sequences, and the
    # running requests at most this many times that.
    pipeline_stages: int = 1

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def __post_init__(self):
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len", "pipeline_stages")
        if self.pipeline_stages > 1 and self.speculative is not None:
            raise ValueError("SchedulerConfig: pipeline stages do not schedule speculative proposals")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"SchedulerConfig.policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("SchedulerConfig: async scheduling does not schedule speculative proposals")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, written as vLLM users write it: ``{"method": "ngram", "num_speculative_tokens": 3,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1}``.

    ``ngram`` (prompt lookup) proposes, for a decoding sequence, the tokens that followed the latest earlier
    occurrence of its last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its own prompt
    and output; ``draft_model`` has a smaller model of the same vocabulary (``model``) propose them, greedily
    (``jaxserve.spec_decode.draft_model``). The step computes them with the sequence's next token, and keeps the longest run the model
    itself would have produced (see ``jaxserve.spec_decode.ngram``).

    Raises:
        ValueError: an unknown method or key, or a value out of range (naming it).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None  # draft_model: a path, preset or hub id, or a LoadedModel (same vocabulary as the target)

    def __post_init__(self):
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if (self.model is None) == (self.method == "draft_model"):
            raise ValueError(
                "speculative_config.model names the draft model of method 'draft_model' (and only of "
                f"it); got method {self.method!r} with model {self.model!r}"
            )
        for name, lo, hi in (
            ("num_speculative_tokens", 1, 16),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a dict, a JSON object (the command line) or a SpeculativeConfig -> SpeculativeConfig or None."""
        return parse_json_config(cls, value, "speculative_config")


def parse_json_config(cls, value, what: str):
    """``value`` as a ``cls`` (a dataclass): itself, a dict of its fields or a JSON object string; None stays None.

    Raises:
        ValueError: not JSON, not an object, or an unknown key (each named, with ``what``), or a bad value.
    """
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object (a dict), got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what} has unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
    return cls(**value)


def batching_defaults(platform: str, device_memory: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) where the user sets neither, for a platform ("cpu", "gpu", "tpu") and
    the memory of one of its devices in bytes (None: unknown).

    On the CPU: 64 sequences and 512 tokens a step, where the offline benchmark peaks on a few cores (a bigger
    step only waits longer for the same arithmetic). On a GPU or TPU a step's cost hardly grows with its tokens
    until the matrix units are busy, so the budget is larger, and sized by memory, which bounds the activations and
    the batch's KV: 128 and 2048 below 24 GiB (TPU v5e, 16 GB GPUs), 256 and 4096 below 64 GiB (TPU v6e, 24-48 GB
    GPUs), 256 and 8192 from 64 GiB (H100 / H200, A100-80G, TPU v5p); vLLM's GPU defaults are of the same size.
    """
    if platform == "cpu":
        return 64, 512
    gib = (device_memory or 0) / 2**30
    if gib >= 64:
        return 256, 8192
    if gib >= 24:
        return 256, 4096
    return 128, 2048


def _setting(default, help: str, **cli):
    """An EngineConfig field: its default, its help, and how its command-line flag parses (``cli``)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


_DTYPES = ("float32", "bfloat16", "float16")
# fp8 KV pages, stored without scales (vLLM's fp8 cache with k_scale = v_scale = 1): e4m3 keeps more mantissa, e5m2
# more range. "fp8" is e4m3, as in vLLM.
# "int8": int8 pages with one float32 scale per token and KV head (symmetric, max|x| -> 127).
KV_DTYPES = _DTYPES + ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_KV_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype(name: str | None, default):
    """The KV pool's numpy/jax dtype for a ``kv_cache_dtype`` name (None: ``default``)."""
    import jax.numpy as jnp

    if name is None:
        return jnp.dtype(default)
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {name!r}")
    return jnp.dtype(_KV_FP8.get(name, name))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def bytes_or_fraction(text: str) -> int | float:
    """``--kv-cache-memory``: "0.5" is a fraction (float); "8000000000", "8G", "8GiB", "512M" are bytes (int)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if "." in t or "E" in t:
        return float(t)
    unit = t[-1:] if t[-1:] in _UNITS else ""
    return int(t[: len(t) - len(unit)]) * _UNITS[unit]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every setting of an engine, in one place: ``LLM(**settings)``, ``LLMEngine(config=...)`` and the command
    line (``add_engine_args`` / ``from_cli_args``, one flag per field) all read this.

    Raises:
        ValueError: a bad value, naming the field (at construction).
    """

    dtype: str | None = _setting(
        None, "weights and activations (default: float32 on the CPU, bfloat16 on GPU/TPU)", choices=_DTYPES
    )
    matmul_dtype: str | None = _setting(
        None,
        "bfloat16: the weights' matrix products on bfloat16 inputs with float32 accumulation (about 2x "
        "faster on the CPU; with --quantization, steps of more than 8 tokens dequantize to bfloat16; w8a8 "
        "refuses it; default: exact, in --dtype)",
        choices=_DTYPES,
    )
    quantization: str | None = _setting(
        None,
        "quantize the weights on load: int8 (per output channel), int4 (groups of 32, with min; 8-bit "
        "scale codes), w8a8 (int8 weights and per-token int8 activations), fp8 (e4m3; GPUs/TPUs with fp8); "
        "gguf: serve a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K matrices as stored (default: float weights)",
        choices=("int8", "int4", "w8a8", "fp8", "gguf"),
    )
    kv_cache_dtype: str | None = _setting(
        None,
        "the KV page pool's dtype (default: --dtype's); bfloat16 halves the memory attention reads, fp8 "
        "(e4m3, or fp8_e5m2; no scales) quarters it against float32; int8 stores a float32 scale per token "
        "and KV head besides (0.27x float32's bytes at head_dim 64, 0.26x at 128)",
        choices=KV_DTYPES,
    )
    num_pages: int | None = _setting(None, "KV pages per data-parallel replica (default: from memory)", type=int)
    page_size: int = _setting(16, "tokens per KV page", type=int)
    kv_cache_memory_fraction: float = _setting(0.9, "share of free device memory the KV pool may take", type=float)
    kv_cache_memory: int | float | None = _setting(
        None,
        "KV pool size: bytes (8000000000, 8G, 512MiB) or a fraction of the memory available at startup "
        "(0.5); default: on the CPU at most min(4 GiB, a quarter of available memory)",
        type=bytes_or_fraction,
    )
    max_num_seqs: int | None = _setting(
        None,
        "most sequences in one step (default: per platform, see "
        "batching_defaults: 64 on the CPU, 128-256 on GPUs / TPUs)",
        type=int,
    )
    max_num_batched_tokens: int | None = _setting(
        None,
        "most tokens in one step, the token budget (default: per platform: 512 on the CPU, 2048-8192 on GPUs / "
        "TPUs by memory)",
        type=int,
    )
    max_model_len: int | None = _setting(
        None, "longest prompt + output in tokens (default: the model's, at most 2048)", type=int
    )
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV pages of shared prompt prefixes", flag="--no-prefix-caching", action="store_false"
    )
    policy: str = _setting(
        "fcfs",
        "priority: requests' priority orders the queue (lower first)",
        flag="--scheduling-policy",
        choices=("fcfs", "priority"),
    )
    attention_impl: str = _setting(
        "auto",
        "attention kernels (auto: Pallas on GPU/TPU, C++/XLA on the CPU; pallas-tpu: the TPU's kernels and pool "
        "layout, interpreted off a TPU)",
        choices=("auto", "xla", "reference", "pallas", "pallas-tpu"),
    )
    tensor_parallel_size: int = _setting(
        1, "devices each replica's weights, heads and KV pool are split over", type=int
    )
    data_parallel_size: int = _setting(
        1,
        "independent replicas (each on its own tensor_parallel_size devices) that requests are balanced over",
        type=int,
    )
    pipeline_parallel_size: int = _setting(
        1,
        "stages the layers are split over, each on its own tensor_parallel_size devices holding its layers' "
        "weights and KV pages; up to that many batches in flight, one in each stage",
        type=int,
    )
    enable_expert_parallel: bool = _setting(
        False,
        "a mixture of experts' whole experts placed on the tensor-parallel devices (num_experts / "
        "tensor_parallel_size each) instead of every expert's matrices split over them",
        action="store_true",
    )
    speculative_config: dict | None = _setting(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,'
        ' "prompt_lookup_min": 1} (default: off)',
        type=SpeculativeConfig.parse,
    )
    async_scheduling: bool | None = _setting(
        None,
        "schedule and pack each step while the previous one runs, its sampled tokens fed on the device "
        "(default: on GPUs and TPUs; off on the CPU, where the host is ~2%% of a step and the overlap measured "
        "slower; always off with speculative decoding or several processes)",
        action=argparse.BooleanOptionalAction,
    )
    seed: int = _setting(0, "seeds the per-request seeds of requests that give none", flag="--engine-seed", type=int)
    compilation_cache: bool = _setting(
        True,
        "JAX's persistent compilation cache (~/.cache/jaxserve/xla)",
        flag="--no-compilation-cache",
        action="store_false",
    )

    def __post_init__(self):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("dtype", "kv_cache_dtype", "matmul_dtype", "quantization", "policy", "attention_impl"):
            value, choices = getattr(self, name), self._meta(name)["choices"]
            if value not in choices and not (value is None and defaults[name] is None):  # None: where it is the default
                raise ValueError(f"EngineConfig.{name} must be one of {', '.join(choices)}, got {value!r}")
        _positive(self, "page_size", "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size")
        for name in ("num_pages", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _positive(self, name)
        self.cache_config()  # validates the pool's fields
        SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def _meta(cls, name: str) -> dict:
        return {f.name: f.metadata for f in dataclasses.fields(cls)}[name]

    @classmethod
    def from_settings(cls, config: EngineConfig | None = None, **settings) -> EngineConfig:
        """``config`` (default: the defaults) with ``settings`` replaced; an unknown setting is a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(config or cls(), **settings)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            self.page_size, self.num_pages, self.kv_cache_memory_fraction, self.kv_cache_dtype, self.kv_cache_memory
        )

    def scheduler_config(
        self, max_model_len: int, platform: str = "cpu", device_memory: int | None = None
    ) -> SchedulerConfig:
        """The scheduler's settings; budgets left at None take ``batching_defaults(platform, device_memory)``."""
        seqs, tokens = batching_defaults(platform, device_memory)
        spec = SpeculativeConfig.parse(self.speculative_config)
        return SchedulerConfig(
            self.max_num_seqs or seqs,
            self.max_num_batched_tokens or tokens,
            max_model_len,
            self.enable_prefix_caching,
            self.policy,
            spec,
            async_scheduling=spec is None
            and (platform != "cpu" if self.async_scheduling is None else self.async_scheduling),
            pipeline_stages=self.pipeline_parallel_size,
        )

    # ------------------------------------------------------------------ command line
    @classmethod
    def add_cli_args(cls, parser, **defaults) -> None:
        """One flag per field (``--max-num-seqs`` ...); ``defaults`` overrides a field's default for this parser."""
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
            default = defaults.get(f.name, f.default)
            if meta.get("action") == "store_false":
                meta["help"] = "off: " + meta["help"]
            elif default is not None:
                meta["help"] += f" (default: {default})"
            parser.add_argument(flag, dest=f.name, default=default, **meta)

    @classmethod
    def from_cli_args(cls, args) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
