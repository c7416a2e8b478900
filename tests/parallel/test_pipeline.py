"""Pipeline parallelism's layer split (host code)."""

from __future__ import annotations

import re

import pytest

from jaxserve.parallel.pipeline import stage_layers


@pytest.mark.parametrize(
    "layers, stages, counts",
    [(30, 1, [30]), (30, 2, [15, 15]), (30, 3, [10, 10, 10]), (30, 4, [8, 8, 7, 7]), (30, 5, [6] * 5), (7, 7, [1] * 7)],
)
def test_layers_split_as_evenly_as_possible(layers, stages, counts):
    split = stage_layers(layers, stages)
    assert [len(r) for r in split] == counts
    assert [i for r in split for i in r] == list(range(layers))  # contiguous, in order, each layer once


@pytest.mark.parametrize(("stages", "match"), [(31, "exceeds the model's 30 layers"), (0, "positive int")])
def test_bad_degrees_are_named(stages, match):
    with pytest.raises(ValueError, match=match):
        stage_layers(30, stages)


@pytest.mark.parametrize(
    ("model", "hf_config", "named"),
    [
        ("deepseek_v3", dict(first_k_dense_replace=2), "first_k_dense_replace"),
        ("deepseek_v2", dict(first_k_dense_replace=1), "first_k_dense_replace"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers, decoder_sparse_step"),
        ("qwen3_moe", dict(decoder_sparse_step=2), "mlp_only_layers, decoder_sparse_step"),
    ],
)
def test_dense_and_moe_layers_apart_are_refused_naming_the_models_own_setting(model, hf_config, named):
    """A model whose dense and MoE layers are stacked apart is refused over pipeline stages, naming the config.json
    setting that model's family has (DeepSeek's first_k_dense_replace, not Qwen3-MoE's mlp_only_layers) and the
    dense layers."""
    from jaxserve.config import ModelConfig
    from jaxserve.parallel.pipeline import check_pipeline

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)
    if model.startswith("deepseek"):
        moe |= dict(n_routed_experts=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    else:
        moe |= dict(num_experts=4, num_key_value_heads=2)
    cfg = ModelConfig.from_hf({"model_type": model, **common, **moe, **hf_config})
    dense = [i for i, moe_layer in enumerate(cfg.moe_layer_flags()) if not moe_layer]
    assert dense and len(dense) < 4
    with pytest.raises(ValueError, match=re.escape(f"({model}'s {named}: dense layers {dense})")) as e:
        check_pipeline(cfg, 2)
    assert model == "qwen3_moe" or "mlp_only_layers" not in str(e.value), str(e.value)
