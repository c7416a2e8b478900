"""Each architecture against HF transformers' own implementation, on tiny random checkpoints written here.

The checkpoint is saved by transformers (config.json + safetensors), loaded by our reader, and run through
our paged forward in several steps (a prefill chunk, a second chunk, then one token at a time), so the page
writes and the ragged attention are exercised too. Tolerance: 1e-4 absolute on float32 logits.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jaxserve.kernels.reference import ragged_paged_attention_ref, write_kv_ref  # noqa: E402

from jaxserve.loading.safetensors_dir import iter_hf_dir, read_config  # noqa: E402
from jaxserve.loading.weights import params_from_hf_tensors  # noqa: E402
from jaxserve.models.dense import AttentionBatch, model_from_params  # noqa: E402

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
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
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
}


def _hf_model(case: str, tmp_path):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(hash(case) % 1000)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norm weights, so a wrong norm convention shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in case else 1.0))
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


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    with pytest.raises(ValueError, match="unknown architecture.*mamba"):
        read_config(tmp_path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    _hf_model("llama", tmp_path)
    cfg = read_config(tmp_path)
    tensors = [(n, a[:-1] if n.endswith("layers.1.self_attn.k_proj.weight") else a) for n, a in iter_hf_dir(tmp_path)]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight.*\(31, 64\).*\(32, 64\)"):
        params_from_hf_tensors(cfg, tensors)


def test_missing_tensor_is_named(tmp_path):
    _hf_model("llama", tmp_path)
    cfg = read_config(tmp_path)
    tensors = [(n, a) for n, a in iter_hf_dir(tmp_path) if "layers.2.mlp.up_proj" not in n]
    with pytest.raises(ValueError, match=r"missing weight 'w_up' \(layers \[2\]\)"):
        params_from_hf_tensors(cfg, tensors)
