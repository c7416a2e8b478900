"""DeepSeek-V3 (Kimi-K2's architecture): multi-head latent attention over a latent KV pool, grouped sigmoid routing,
shared experts, dense first layers, through the whole engine.

A tiny random float32 checkpoint written by transformers, with SmolLM2's tokenizer; its norms, routers and
score-correction biases perturbed (a dropped bias or a wrong routing convention changes the tokens), a YaRN scaling
with ``mscale_all_dim`` (the softmax scale's factor) and interleaved rotary dims as DeepSeek ships them. References:
HF transformers teacher-forced on our tokens (greedy choices identical, logprobs within 1e-3), and the same engine on
one device for expert parallelism over the fake CPU devices of conftest.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import TINY_ENGINE, TINY_VOCAB, assert_matches_hf, assert_same_completions, sized_copies, tiny_prompts

from jaxserve import LLM, SamplingParams
from jaxserve.loading import orbax_ckpt

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

VOCAB = TINY_VOCAB
R, ROPE, NOPE, V_DIM = 32, 8, 16, 12  # kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # HF expands the latent to every head (its default, 128, is V3's head count)
    n_shared_experts=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=R,
    q_lora_rank=48,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=NOPE,
    v_head_dim=V_DIM,
    max_position_embeddings=2048,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=512,
        mscale=1.0,
        mscale_all_dim=0.8,
        beta_fast=32,
        beta_slow=1,
    ),
    tie_word_embeddings=False,
)
# DeepSeek-V2: V2-Lite's direct q_proj (no q_lora_rank) with V2's group-limited softmax routing (of which V2-Lite's
# "greedy" is the one-group case), scaled.
V2 = dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)
ENGINE = TINY_ENGINE
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def write_checkpoint(path, version="v3", **overrides):
    """A tiny random DeepSeek-V3 (``version="v2"``: DeepSeek-V2, ``V2``) checkpoint in ``path``; returns the torch
    model."""
    torch.manual_seed(3)
    if version == "v3":
        config = transformers.DeepseekV3Config(**{**CONFIG, **overrides})
    else:
        config = transformers.DeepseekV2Config(**{**CONFIG, **V2, **overrides})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
            elif ".gate.weight" in name or "experts" in name:
                p.copy_(torch.randn_like(p) * (1.0 if ".gate." in name else 0.1))
        for layer in model.model.layers[CONFIG["first_k_dense_replace"] :] if version == "v3" else ():
            # a buffer: it moves the choice, not the weights
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(CONFIG["n_routed_experts"]) * 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("deepseek_v3")
    hf = write_checkpoint(path)
    orbax_ckpt.copy_tokenizer(default_model_path, path)
    return path, hf


@pytest.fixture(scope="module")
def one_device(checkpoint):
    llm = LLM(str(checkpoint[0]), **ENGINE)
    return llm, [o.outputs[0] for o in llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)]


def test_greedy_tokens_and_logprobs_match_hf(checkpoint, one_device):
    assert_matches_hf(checkpoint[1], tiny_prompts(), one_device[1])


def test_the_decode_step_writes_the_latent_pool_in_place(one_device):
    """The compiled decode step (the CPU's attention, C++ where it built) reads the latent pool [L, pages,
    page_size, width] as it is: through a one-KV-head view [.., 1, width] XLA:CPU copied the whole pool 4 times a
    layer (5 without the C++ kernels)."""
    runner = one_device[0].engine.runner
    hlo = runner.compiler.lower_step(1, runner.page_buckets[-1], True).compile().as_text()
    copies = sized_copies(hlo, runner.k_cache.shape)
    assert not copies, f"{len(copies)} pool-sized copies in the decode step: {copies}"


def test_deepseek_v2_greedy_tokens_and_logprobs_match_hf(tmp_path, default_model_path):
    """DeepSeek-V2 (group-limited softmax routing, not renormalized, scaled) with V2-Lite's direct q_proj: HF
    transformers' DeepseekV2 teacher-forced on our tokens."""
    hf = write_checkpoint(tmp_path, "v2")
    orbax_ckpt.copy_tokenizer(default_model_path, tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.engine.runner.cfg.moe_routing == "grouped_softmax"
    outputs = [o.outputs[0] for o in llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)]
    assert_matches_hf(hf, tiny_prompts(), outputs)


def test_the_pool_holds_one_latent_a_token_and_layer(one_device):
    """(kv_lora_rank + qk_rope_head_dim) x 4 bytes a token and layer on the live arrays, nothing in V."""
    runner = one_device[0].engine.runner
    cfg = runner.cfg
    assert cfg.is_mla and cfg.num_kv_heads == 1
    tokens = runner.num_pages * runner.page_size
    k, v = runner.k_cache, runner.v_cache
    assert k.shape == (cfg.num_layers, runner.num_pages, runner.page_size, R + ROPE)
    assert (k.nbytes + v.nbytes) / (tokens * cfg.num_layers) == (R + ROPE) * 4
    assert runner.pool.page_bytes() == runner.page_size * cfg.num_layers * (R + ROPE) * 4


def test_prefix_caching_preemption_and_chunked_prefill_on_the_latent_pool(checkpoint, one_device):
    """A pool of 12 pages of 16 for 8 sequences of up to 56 tokens: preemption; the prompts twice with a shared
    prefix: prefix-cache hits; 40-token prompts over a 32-token budget: chunked prefill. One pass's tokens."""
    prefix = list(range(1000, 1020))
    prompts = [prefix + p for p in tiny_prompts()] * 2
    want = one_device[0].generate(prompts, GREEDY, use_tqdm=False)
    small = dict(ENGINE, num_pages=12, enable_prefix_caching=True)
    llm = LLM(str(checkpoint[0]), **small)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_same_completions([o.outputs[0] for o in got], [o.outputs[0] for o in want], atol=1e-4)


@pytest.mark.multidevice
def test_expert_parallel_gives_one_devices_tokens(checkpoint, one_device):
    """TP 2 with whole experts per device: the heads split after the up-projections, the latent on every device."""
    llm = LLM(str(checkpoint[0]), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    runner = llm.engine.runner
    gate = runner.state["expert_gate"].get_value()
    assert gate.addressable_shards[0].data.shape[1] == CONFIG["n_routed_experts"] // 2
    assert runner.k_cache.addressable_shards[0].data.shape == runner.k_cache.shape  # the latent pool on each
    res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in res], one_device[1], atol=1e-4)


def test_the_tpu_latent_kernel_gives_the_same_tokens(checkpoint, one_device):
    """The engine on the TPU's latent attention kernel (interpret mode): one device's tokens."""
    llm = LLM(str(checkpoint[0]), attention_impl="pallas-tpu", **ENGINE)
    res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in res], one_device[1], atol=1e-4)


def test_ranks_that_disagree_with_the_config_are_named_at_load(tmp_path):
    from jaxserve.loading import load_model

    write_checkpoint(tmp_path, num_hidden_layers=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["kv_lora_rank"] = R + 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    # the first of the latent's tensors read (in the file's order) is its norm: 32 entries for a rank of 40
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.kv_a_layernorm\.weight' has shape \(32,\), expected \(40,\)"
    ):
        load_model(str(tmp_path), "float32")


def test_multi_token_prediction_layers_are_skipped_and_logged(tmp_path, caplog):
    """DeepSeek-V3's checkpoints hold a layer past num_hidden_layers (the MTP module): skipped, named in the log."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.loading import load_model

    write_checkpoint(tmp_path, num_hidden_layers=2)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = np.zeros((4 * (NOPE + V_DIM), R), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        loaded = load_model(str(tmp_path), "float32")
    assert loaded.config.num_layers == 2
    assert "skipped the checkpoint's multi-token-prediction layer(s) [2]" in caplog.text


_V3_HUB = dict(  # deepseek-ai/DeepSeek-V3's config.json
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
    ),
    bos_token_id=0,
    eos_token_id=1,
)


def test_the_deepseek_v3_preset_is_its_hub_config():
    """configs/deepseek-v3.json is our HF reader's view of the hub's config.json as transformers writes it; the
    softmax scale is transformers' (YaRN's mscale_all_dim squared), the latent 576 values."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from jaxserve.config import ModelConfig, load_preset

    theirs = transformers.DeepseekV3Config(**_V3_HUB)
    ours = ModelConfig.from_hf(theirs.to_dict())
    assert ours == load_preset("deepseek-v3")
    assert ours.head_dim == theirs.qk_head_dim and ours.rotary_dim == theirs.qk_rope_head_dim
    assert ours.attn_scale == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, theirs.qk_head_dim**-0.5))
    assert ours.attn_scale != pytest.approx(theirs.qk_head_dim**-0.5)  # the factor is there: 1.87x
    assert ours.kv_cache_dims == (576, 0) and ours.moe_layer_flags()[2:4] == (False, True)
    assert ours.shared_expert_intermediate_size == 2048 and ours.routed_scaling_factor == 2.5


def test_the_deepseek_v2_lite_preset_is_its_hub_config():
    """configs/deepseek-v2-lite.json from the hub's config.json as transformers' DeepseekV2Config writes it: 15.7 B
    parameters, 2.4 B active without the input embedding (as DeepSeek counts them); plan fits one H200."""
    from jaxserve.aot import plan
    from jaxserve.config import ModelConfig, load_preset

    hub = _V3_HUB | dict(  # deepseek-ai/DeepSeek-V2-Lite's config.json: what differs from V3's
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        rope_parameters=_V3_HUB["rope_parameters"] | dict(mscale=0.707, mscale_all_dim=0.707),
        bos_token_id=100000,
        eos_token_id=100001,
    )
    ours = ModelConfig.from_hf(transformers.DeepseekV2Config(**hub).to_dict())
    assert ours == load_preset("deepseek-v2-lite")
    p = plan("deepseek-v2-lite", "h200:1", 1, compile=False)
    embedding = 102400 * 2048
    assert round(p.total_params / 1e9, 1) == 15.7 and (p.active_params - embedding) // 10**8 == 24  # 2.45 B
    assert p.fits and p.page_bytes_per_chip == 27 * 16 * 576 * 2
