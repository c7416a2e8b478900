"""Each architecture against HF transformers' own implementation, on tiny random checkpoints written here.

The checkpoint is saved by transformers (config.json + safetensors), loaded by our reader, and run through
our paged forward in several steps (a prefill chunk, a second chunk, then one token at a time), so the page
writes and the ragged attention are exercised too. Tolerance: 1e-4 absolute on float32 logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import longrope

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jaxserve.kernels import ragged_paged_attention_ref, write_kv_ref  # noqa: E402

from jaxserve.loading.safetensors_dir import iter_hf_dir, read_config  # noqa: E402
from jaxserve.loading.weights import params_from_hf_tensors  # noqa: E402
from jaxserve.models.decoder import AttentionBatch, model_from_params  # noqa: E402

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

CASES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
            rope_theta=500000.0,
        ),
    ),
    # longrope's short factors (positions below the original context: all 19 here), transformers-5 rope_parameters.
    "llama_longrope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters=longrope(
                [1.0, 1.1, 1.3, 1.7, 2.2, 2.9, 3.5, 4.0], [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]
            )
        ),
    ),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # YaRN with a 4-token original context, so that its ramp falls inside the 16 frequencies of head_dim 32.
    "qwen3_yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=32,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4),
        ),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh")),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # 5 local : 1 global over 7 layers, the local layers on their own rope base, the global ones linearly scaled.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=7,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    # Fused qkv and gate_up matrices split on load; longrope (short factors below the original context).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            original_max_position_embeddings=64,
            rope_parameters=longrope(
                [1.0, 1.2, 1.5, 1.9, 2.4, 3.0, 3.7, 4.5], [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]
            ),
        ),
    ),
    # Phi-4-mini's partial rotary (here half of each head) and a sliding window on every layer.
    "phi3_partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            sliding_window=6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    # Mixtures of experts: 5 experts, top 2 (odd sizes); per-expert tensors stacked on load.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=7),
    ),
    # Dense MLP on layer 1 (mlp_only_layers), experts on 0 and 2; the chosen experts' share of the softmax over all.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=32, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=40, mlp_only_layers=[1]),
    ),
    "qwen3_moe_norm_topk": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True),
    ),
    # Sinks, biases on q/k/v/o, router and experts, the clamped SwiGLU (a limit the activations reach), sliding
    # and full layers alternating, YaRN.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=5,
            num_experts_per_tok=2,
            intermediate_size=40,
            sliding_window=5,
            swiglu_limit=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=8,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
}


def _hf_model(case: str, tmp_path):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(hash(case) % 1000)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norm weights and biases, so a wrong norm convention or a dropped bias shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in case else 1.0))
            elif name.endswith(("bias", "sinks")) or "router" in name or ".gate." in name:
                p.copy_(torch.randn_like(p) * (1.0 if "gate" in name or "router.weight" in name else 0.3))
            elif "experts" in name:  # transformers 5 starts expert stacks at zero: random, as checkpoints are
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


def _paged_logits(graphdef, state, cfg, tokens: np.ndarray, chunks: list[int], page_size: int = 4) -> np.ndarray:
    """Runs `tokens` through our model in the given chunk sizes, one sequence, pages in scrambled order."""
    num_pages = -(-len(tokens) // page_size) + 2
    pages = np.random.default_rng(0).permutation(num_pages).astype(np.int32)  # non-contiguous page table
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    k_cache, v_cache = jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)  # unwritten slots would poison
    model = nnx.merge(graphdef, state)
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        batch = AttentionBatch(
            positions=jnp.asarray(pos, jnp.int32),
            slot_mapping=jnp.asarray(pages[pos // page_size] * page_size + pos % page_size, jnp.int32),
            kv_lens=jnp.asarray([start + n], jnp.int32),
            page_indices=jnp.asarray(pages[None]),
            cu_q_lens=jnp.asarray([0, n], jnp.int32),
            num_seqs=jnp.asarray(1, jnp.int32),
        )
        hidden, k_cache, v_cache = model(
            jnp.asarray(tokens[pos]), batch, k_cache, v_cache, ragged_paged_attention_ref, write_kv_ref
        )
        out.append(np.asarray(model.logits(hidden)))
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(case, tmp_path):
    hf = _hf_model(case, tmp_path)
    cfg = read_config(tmp_path)
    graphdef, state = model_from_params(cfg, params_from_hf_tensors(cfg, iter_hf_dir(tmp_path)))
    tokens = np.random.default_rng(1).integers(0, COMMON["vocab_size"], 19)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float().numpy()
    ours = _paged_logits(graphdef, state, cfg, tokens, chunks=[7, 6, 1, 1, 1, 1, 1, 1])
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope_type", ["yarn", "longrope"])
def test_rope_frequencies_match_hf(rope_type):
    """Our inverse frequencies and attention factor against transformers' rope functions, with options the
    checkpoint cases leave at their defaults (YaRN's mscale pair and untruncated band; longrope's long factors,
    which HF takes for a whole forward past the original context, and we per position from it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.config import ModelConfig
    from jaxserve.layers.rope import Rope

    params = {
        "yarn": dict(factor=8.0, original_max_position_embeddings=16, mscale=1.3, mscale_all_dim=0.7, truncate=False),
        "longrope": dict(
            original_max_position_embeddings=32, short_factor=[1.5] * 8, long_factor=[1.0 + i for i in range(8)]
        ),
    }[rope_type]
    hf_config = transformers.LlamaConfig(
        **COMMON, rope_parameters=dict(rope_type=rope_type, rope_theta=5000.0, beta_fast=16.0, **params)
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=hf_config.max_position_embeddings)
    rope = Rope.of(ModelConfig.from_hf(hf_config.to_dict()))
    np.testing.assert_allclose(rope.inv_freq(long=True), inv_freq.double().numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-9) and factor != 1.0
    cos, _ = rope.tables(jnp.asarray([0, 31, 32], jnp.int32))  # longrope: short below 32, long from it
    expected = np.cos(np.outer([0, 31, 32], inv_freq.double().numpy())) * factor
    if rope_type == "longrope":
        expected[1] = np.cos(31 * rope.inv_freq()) * factor
    np.testing.assert_allclose(np.asarray(cos), expected, atol=1e-5)


def test_phi4_mini_preset_is_its_hub_config():
    """configs/phi-4-mini-instruct.json against transformers' Phi3Config of the hub's config.json: transformers
    accepts its 48 long / short factors (one per frequency of the 96 rotated dims of 128), our HF reader gives the
    preset back, and our rope (partial, longrope over a 4,096 original context) gives transformers' frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.config import ModelConfig, load_preset
    from jaxserve.layers.rope import Rope

    cfg = load_preset("phi-4-mini-instruct")
    rs = cfg.rope_scaling
    hf_config = transformers.Phi3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        original_max_position_embeddings=rs.original_max_position_embeddings,
        partial_rotary_factor=cfg.partial_rotary_factor,
        rope_scaling=dict(type="longrope", short_factor=list(rs.short_factor), long_factor=list(rs.long_factor)),
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        sliding_window=cfg.sliding_window,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids),
    )
    assert ModelConfig.from_hf(hf_config.to_dict()) == cfg
    rope = Rope.of(cfg)
    assert cfg.rotary_dim == 96 and len(rs.long_factor) == len(rope.inv_freq()) == 48
    for seq_len, long in ((4096, False), (4097, True)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=seq_len)
        np.testing.assert_allclose(rope.inv_freq(long=long), inv_freq.double().numpy(), rtol=1e-6)
        assert rope.attention_factor == pytest.approx(factor, rel=1e-9) and factor > 1.1


def test_unknown_rope_type_is_a_clear_error(tmp_path):
    config = dict(COMMON, model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported; jaxserve implements linear"):
        read_config(tmp_path)


def test_multimodal_gemma3_serves_its_language_model(tmp_path):
    """Gemma 3 4B / 12B / 27B are multimodal checkpoints (model_type "gemma3", the text model under text_config,
    its tensors under language_model.*, a vision tower beside them): we load the language model, whose logits on
    text equal HF's whole model's."""
    text = dict(COMMON, num_hidden_layers=7, head_dim=16, sliding_window=5, query_pre_attn_scalar=24)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision | {"patch_size": 14})
    config.mm_tokens_per_image = 4
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "language_model" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path)
    cfg = read_config(tmp_path)
    assert cfg.architecture == "gemma3" and cfg.num_layers == 7 and cfg.sliding_window_layers[5] is False
    graphdef, state = model_from_params(cfg, params_from_hf_tensors(cfg, iter_hf_dir(tmp_path)))
    tokens = np.random.default_rng(1).integers(0, COMMON["vocab_size"], 19)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)[None]).logits[0].float().numpy()
    ours = _paged_logits(graphdef, state, cfg, tokens, chunks=[7, 6, 1, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_gemma3_bad_layer_types_are_a_clear_error(tmp_path):
    config = dict(COMMON, model_type="gemma3_text", head_dim=16, sliding_window=5)
    for layer_types, match in (
        (["sliding_attention", "chunked_attention", "full_attention"], "layer_types must list 3 of"),
        (["sliding_attention", "full_attention"], "layer_types must list 3 of"),
    ):
        (tmp_path / "config.json").write_text(__import__("json").dumps(config | {"layer_types": layer_types}))
        with pytest.raises(ValueError, match=match):
            read_config(tmp_path)
    # EmbeddingGemma: a gemma3_text encoder, which a causal decoder would serve wrongly.
    (tmp_path / "config.json").write_text(__import__("json").dumps(config | {"use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        read_config(tmp_path)


# The hub's config.json files as released (transformers 4.50): 1B text-only and complete; 4B / 12B / 27B multimodal,
# their text_config listing only what differs from Gemma3TextConfig's defaults (4B: not even the heads).
_GEMMA3_LINEAR8 = {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "model_type": "gemma3_text"}
_GEMMA3_HUB = {
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "vocab_size": 262144,
    },
    "gemma-3-4b-it": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, sliding_window=1024),
    "gemma-3-12b-it": dict(
        hidden_size=3840,
        intermediate_size=15360,
        num_attention_heads=16,
        num_hidden_layers=48,
        num_key_value_heads=8,
        sliding_window=1024,
    ),
    "gemma-3-27b-it": dict(
        head_dim=128,
        hidden_size=5376,
        intermediate_size=21504,
        num_attention_heads=32,
        num_hidden_layers=62,
        num_key_value_heads=16,
        query_pre_attn_scalar=168,
        sliding_window=1024,
    ),
}


@pytest.mark.parametrize("preset", sorted(_GEMMA3_HUB))
def test_gemma3_hub_configs_read_as_transformers_does(preset, tmp_path):
    """Each released Gemma 3 config.json, read by us and by transformers' AutoConfig (the independent reading):
    the same sizes, layer pattern and both ropes, and exactly our preset of that model."""
    import json

    from jaxserve.config import ModelConfig, load_preset

    hub = _GEMMA3_HUB[preset]
    if "architectures" not in hub:  # multimodal: the text model under text_config, a vision tower beside it
        vision = {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
        }
        hub = {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "eos_token_id": [1, 106],
            "model_type": "gemma3",
            "text_config": hub | _GEMMA3_LINEAR8,
            "vision_config": vision | {"num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14},
        }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    ours = ModelConfig.from_hf(hub)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs = getattr(theirs, "text_config", theirs)
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        theirs.vocab_size,
        theirs.hidden_size,
        theirs.intermediate_size,
        theirs.num_hidden_layers,
    )
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.query_pre_attn_scalar) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.query_pre_attn_scalar,
    )
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.sliding_window) == (
        theirs.rms_norm_eps,
        theirs.max_position_embeddings,
        theirs.sliding_window,
    )
    assert ours.sliding_window_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
    scaling = (ours.rope_scaling.rope_type, ours.rope_scaling.factor) if ours.rope_scaling else ("default", None)
    assert scaling == (full["rope_type"], full.get("factor")) and local["rope_type"] == "default"
    assert ours == load_preset(preset)


# The MoE presets' hub config.json values (the keys that differ from the config class's defaults, as released),
# read through transformers' config class (transformers 5 rewrites some: rope_parameters, num_local_experts).
_GPT_OSS_HUB = dict(
    num_hidden_layers=24,
    num_local_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    sliding_window=128,
    rope_theta=150000.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    ),
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    attention_bias=True,
    tie_word_embeddings=False,
    bos_token_id=199998,
    eos_token_id=[200002, 199999, 200012],  # generation_config.json's
    pad_token_id=199999,
)
_QWEN3_MOE_HUB = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=[151645, 151643],  # generation_config.json's
)
_MIXTRAL_HUB = dict(
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    sliding_window=None,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE_HUB = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        _QWEN3_MOE_HUB
        | dict(
            num_hidden_layers=48,
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=32,
            moe_intermediate_size=768,
        ),
    ),
    "qwen3-235b-a22b": (
        "Qwen3MoeConfig",
        _QWEN3_MOE_HUB
        | dict(
            num_hidden_layers=94,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=64,
            moe_intermediate_size=1536,
        ),
    ),
    "mixtral-8x7b": (
        "MixtralConfig",
        _MIXTRAL_HUB
        | dict(
            num_hidden_layers=32,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            vocab_size=32000,
            max_position_embeddings=32768,
        ),
    ),
    "mixtral-8x22b": (
        "MixtralConfig",
        _MIXTRAL_HUB
        | dict(
            num_hidden_layers=56,
            hidden_size=6144,
            intermediate_size=16384,
            num_attention_heads=48,
            vocab_size=32768,
            max_position_embeddings=65536,
        ),
    ),
    "gpt-oss-20b": ("GptOssConfig", _GPT_OSS_HUB),
    "gpt-oss-120b": ("GptOssConfig", _GPT_OSS_HUB | dict(num_hidden_layers=36, num_local_experts=128)),
}


@pytest.mark.parametrize("preset", sorted(_MOE_HUB))
def test_moe_presets_are_their_hub_configs(preset):
    """configs/<MoE preset>.json is what our HF reader makes of the hub's config.json as transformers' config class
    writes it, and the expert shapes agree with transformers' reading of it."""
    from jaxserve.config import ModelConfig, load_preset

    cls, hub = _MOE_HUB[preset]
    theirs = getattr(transformers, cls)(**hub)
    ours = ModelConfig.from_hf(theirs.to_dict())
    assert ours == load_preset(preset)
    experts = getattr(theirs, "num_local_experts", None) or theirs.num_experts
    expert_mlp = getattr(theirs, "moe_intermediate_size", None) or theirs.intermediate_size
    assert (ours.num_layers, ours.hidden_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers,
        theirs.hidden_size,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads,
    )
    assert (ours.num_experts, ours.num_experts_per_tok, ours.expert_intermediate_size) == (
        experts,
        theirs.num_experts_per_tok,
        expert_mlp,
    )
    if cls == "GptOssConfig":  # sliding first, then alternating; yarn over a 4,096 context
        assert ours.sliding_window_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
        assert ours.sliding_window_layers[:2] == (True, False) and ours.sliding_window == 128
        rs = ours.rope_scaling
        assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings, rs.truncate) == (
            "yarn",
            32.0,
            4096,
            False,
        )
        assert ours.attention_sinks and ours.o_bias and ours.moe_activation == "swiglu_clamped"


def test_llama_405b_preset_is_its_hub_config():
    """configs/llama-3.1-405b.json (pipeline parallelism's plans) is our HF reader's view of the hub's config.json
    as transformers' LlamaConfig writes it."""
    from jaxserve.config import ModelConfig, load_preset

    hub = dict(
        vocab_size=128256,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    )
    assert ModelConfig.from_hf(transformers.LlamaConfig(**hub).to_dict()) == load_preset("llama-3.1-405b")


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    with pytest.raises(ValueError, match="unknown architecture.*mamba"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    "case, tensor, rows, match",
    [
        (
            "llama",
            "layers.1.self_attn.k_proj.weight",
            1,
            r"layers\.1\.self_attn\.k_proj\.weight.*\(31, 64\).*\(32, 64\)",
        ),
        (
            "phi3",
            "layers.1.mlp.gate_up_proj.weight",
            2,
            r"fused tensor 'model\.layers\.1\.mlp\.gate_up_proj\.weight' has 190 rows",
        ),
    ],
)
def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, case, tensor, rows, match):
    _hf_model(case, tmp_path)
    cfg = read_config(tmp_path)
    tensors = [(n, a[:-rows] if n.endswith(tensor) else a) for n, a in iter_hf_dir(tmp_path)]
    with pytest.raises(ValueError, match=match):
        params_from_hf_tensors(cfg, tensors)


def test_missing_tensor_is_named(tmp_path):
    """By the checkpoint's own name for it (and its HF shape), not only by jaxserve's parameter."""
    _hf_model("llama", tmp_path)
    cfg = read_config(tmp_path)
    names = ("layers.2.mlp.up_proj", "layers.1.self_attn.k_proj")
    tensors = [(n, a) for n, a in iter_hf_dir(tmp_path) if not any(x in n for x in names)]
    with pytest.raises(ValueError, match=r"missing 2 tensors 'model\.layers\.1\.self_attn\.k_proj\.weight' \(") as e:
        params_from_hf_tensors(cfg, tensors)
    shapes = {n: tuple(a.shape) for n, a in iter_hf_dir(tmp_path)}
    k, up = "model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight"
    assert f"'{k}' (weight 'wk' of layer 1, shape {shapes[k]})" in str(e.value), str(e.value)
    assert f"'{up}' (weight 'w_up' of layer 2, shape {shapes[up]})" in str(e.value), str(e.value)
