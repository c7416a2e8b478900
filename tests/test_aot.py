"""The whole engine step compiled ahead of time for TPU slices on this CPU (libtpu, from the dev extra), and the
memory plan checked against hand arithmetic.

Kernel-level TPU compiles are in test_tpu_kernels_aot.py; these compile the engine's sharded step (weights by
logical axes, the pool split over KV heads, the Pallas kernels under shard_map) as the runner would on the TPU.
"""

from __future__ import annotations

import math

import pytest
from helpers import hlo_ops

from jaxserve.aot import CHIPS, GiB, parse_topology, plan
from jaxserve.config import load_preset
from jaxserve.models.schema import param_schema

pytestmark = pytest.mark.slow


def _weight_bytes(preset: str, itemsize: int = 2) -> int:
    return sum(math.prod(s.shape) for s in param_schema(load_preset(preset)).values()) * itemsize


def _kv_bytes_per_page(preset: str, tp: int, page_size: int = 16, itemsize: int = 2) -> int:
    cfg = load_preset(preset)
    kv_heads = max(cfg.num_kv_heads, tp)  # fewer KV heads than chips: each is repeated
    return 2 * cfg.num_layers * page_size * (kv_heads // tp) * cfg.head_dim * itemsize


def _check_against_arithmetic(p, preset: str, tp: int, sized: bool = True) -> None:
    # Weights: the model's bytes / TP, plus the replicated norms (well under 1%).
    assert p.weight_bytes_per_chip == pytest.approx(_weight_bytes(preset) / tp, rel=0.01)
    # A page on a chip: the arithmetic bytes, head_dim padded to the TPU's 128 lanes. The TPU's pool is [.., KV
    # heads, page_size, head_dim]: its minor dims are a bfloat16 tile's (16, 128), not (KV heads, head_dim).
    cfg = load_preset(preset)
    padded = -(-cfg.head_dim // 128) * 128
    assert p.page_bytes_per_chip == _kv_bytes_per_page(preset, tp) * padded // cfg.head_dim
    assert p.kv_bytes_per_chip == p.num_pages * p.page_bytes_per_chip
    if not sized:
        return
    # The pool takes what the weights and activations leave of 90% of the chip's HBM.
    left = 0.9 * p.chip.hbm_bytes - p.weight_bytes_per_chip - p.activation_bytes_per_chip
    assert left - p.page_bytes_per_chip < p.kv_bytes_per_chip <= left


def test_default_model_every_variant_compiles_for_v5e():
    p = plan("smollm2-135m", "v5e:2x4", 1, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, variants="all")
    # decode steps of 2-4 sequences are padded to the 8-token bucket: its decode-only shape too
    assert [(v.tokens, v.pages, v.decode_only) for v in p.variants] == [(8, 8, False), (8, 8, True), (16, 8, False)]
    assert p.fits and p.max_sequences > 1000
    assert all(v.peak_bytes < CHIPS["v5e"].hbm_bytes and v.flops > 0 and v.code_bytes > 0 for v in p.variants)
    _check_against_arithmetic(p, "smollm2-135m", 1)


def test_llama3_8b_tp8_on_v5e_2x4_compiles_and_fits():
    # The pool as the plan sizes it for this slice (bench/RESULTS.md: 46,767 pages of 256 KiB, 23,384 of 512 in the
    # [.., page_size, KV heads, head_dim] layout); given here, so that only the decode step compiles (the sizing
    # itself is checked on the default model above).
    p = plan(
        "llama-3-8b",
        "v5e:2x4",
        8,
        max_num_seqs=64,
        max_model_len=2048,
        variants="decode",
        num_pages=46000,
        sampler="greedy",  # the common step (the full variant's are checked at 4 layers below)
    )
    _check_against_arithmetic(p, "llama-3-8b", 8, sized=False)
    (decode,) = p.variants
    assert decode.sampler == "greedy" and (decode.audit.conditionals, decode.audit.whiles) == (0, 1)
    assert decode.decode_only and 13 * GiB < decode.peak_bytes < 16 * GiB
    assert p.page_bytes_per_chip == 32 * 16 * 2 * 128 * 2  # the arithmetic: one KV head per chip, K and V
    assert p.max_sequences == 46000 // 128
    # Roofline: weights (1.9 GiB) + 64 x 2048 tokens of KV per step at 819 GB/s.
    step_bytes = p.weight_bytes_per_chip + 64 * 2048 * p.page_bytes_per_chip / 16
    assert p.decode_tokens_per_s() == pytest.approx(64 / (step_bytes / 819e9), rel=1e-6)


def test_decode_steps_for_v5e_copy_no_weight_and_gather_no_vocabulary():
    """The step of all-greedy batches, as a v5e-8 runs it for 64 sequences at Llama-3-8B's shapes (four of its
    layers: the layers are scanned, the property does not depend on depth): no conditional (on GPUs one blocks the
    host until the device is idle; on TPUs they multiply compile time), and one while loop, the layers' scan (the
    attention wrappers' block owners were a searchsorted loop in every layer: three loops then)."""
    import dataclasses

    cfg = dataclasses.replace(load_preset("llama-3-8b"), num_layers=4)
    settings = dict(max_num_seqs=64, max_model_len=2048, num_pages=4096, variants="decode")
    p = plan(cfg, "v5e:2x4", 8, sampler="greedy", keep_hlo=True, **settings)
    (decode,) = p.variants
    assert decode.sampler == "greedy" and decode.decode_only and decode.tokens == 64
    assert hlo_ops(decode.hlo, "conditional") == []
    assert len(hlo_ops(decode.hlo, "while")) == 1, hlo_ops(decode.hlo, "while")
    # The audit: no weight copied (XLA laid q out heads-major and copied each layer's wq transposed to make it, until
    # the runner pinned q's layout), within 1.15x the floor, and no collective but the two all-reduces of the hidden
    # states a layer (the sampler's argmax and logsumexp reduce each chip's vocabulary shard: the logits gathered
    # whole were f32[8, 16032, 64], 31 MiB a step).
    a = decode.audit
    assert (a.weight_copies, a.conditionals, a.whiles, a.unknown_trips) == (0, 0, 1, 0), a
    assert p.floor_bytes(decode) < p.audited_bytes(decode) <= 1.15 * p.floor_bytes(decode), p.summary()
    assert a.collective_bytes <= 2 * cfg.num_layers * 64 * 4096 * 2 + (1 << 20), a
    # The sampled variant (temperature, min-p, top-k): the same, its top-k partitioned by XLA over the shards (each
    # chip's 256 best of 64 rows gathered, values and ids: 1 MiB; the gathered logits were 31 MiB)
    (sampled,) = plan(cfg, "v5e:2x4", 8, sampler="sampled", **settings).variants
    b = sampled.audit
    assert (b.weight_copies, b.conditionals, b.whiles) == (0, 0, 1), b
    assert p.audited_bytes(sampled) <= 1.15 * p.floor_bytes(sampled), b.summary()
    assert b.collective_bytes <= 2 * cfg.num_layers * 64 * 4096 * 2 + 8 * 64 * 256 * 8 + (1 << 20), b
    # The full variant (every feature, branchless) on the logits' shards too: the bias and penalties scatter into
    # each chip's own shard, the top-p bisection sums counts and masses over chips, and only each chip's top
    # candidates cross (the vocabulary gathered whole was f32[8, 16032, 64], 31 MiB a step).
    (full,) = plan(cfg, "v5e:2x4", 8, sampler="full", **settings).variants
    c = full.audit
    assert (c.weight_copies, c.conditionals) == (0, 0), c
    assert c.collective_bytes <= 2 * cfg.num_layers * 64 * 4096 * 2 + 8 * 64 * 256 * 8 + (1 << 20), c
    with pytest.raises(ValueError, match="sampler must be one of 'greedy', 'sampled', 'full', 'prompt', got 'fast'"):
        plan(cfg, "v5e:2x4", 8, sampler="fast", compile=False)


def test_greedy_and_sampled_decode_steps_for_h200_read_each_weight_once():
    """The same step compiled for an H200 on this CPU (JAX's CUDA plugin and our target description; no GPU): inside
    the layers' scan XLA:GPU copied each layer's slice of every weight stack before its product read it (7 copies a
    layer, 0.44 GB each step at Llama-3-8B's shapes); the Pallas product reads each in place. No conditional (on a
    GPU one blocks the host until the device is idle), one loop, and the bytes the step moves (the audit of its
    optimized HLO, loops times their trips) within 1.15x the floor: the weights once and the KV of 64 sequences."""
    import dataclasses

    cfg = dataclasses.replace(load_preset("llama-3-8b"), num_layers=4)
    settings = dict(max_num_seqs=64, max_model_len=2048, num_pages=4096, variants="decode")
    p = plan(cfg, "h200:1", 1, sampler="greedy", **settings)
    (decode,) = p.variants
    a = decode.audit
    assert (a.weight_copies, a.conditionals, a.whiles, a.unknown_trips) == (0, 0, 1, 0), a
    assert p.floor_bytes(decode) < p.audited_bytes(decode) <= 1.15 * p.floor_bytes(decode), p.summary()
    assert "x the floor of" in p.summary()
    # Kernels per step: at most 800 at 32 layers, 24 a layer (q, k and v in one launch, gate and up in another:
    # separately, with the narrow k and v split over K and summed, a layer took 26)
    assert a.kernels <= 20 + 24 * cfg.num_layers, a
    # Rows sampling with temperature, min-p and top-k: the "sampled" variant, no conditional either (the full
    # variant's were 9, each a wait of the host for the device)
    (sampled,) = plan(cfg, "h200:1", 1, sampler="sampled", **settings).variants
    b = sampled.audit
    assert (b.weight_copies, b.conditionals, b.whiles) == (0, 0, 1), b
    assert p.audited_bytes(sampled) <= 1.15 * p.floor_bytes(sampled), b.summary()
    # Everything else (top-p, penalties, bias, grammars, logprobs): the full variant, branchless on a GPU or TPU
    # (every feature computed for every row): no conditional either; its loops are the layers' scan and the top-p
    # bisection's two, of fixed trips (9 conditionals when it skipped what no row asked for)
    (full,) = plan(cfg, "h200:1", 1, sampler="full", **settings).variants
    c = full.audit
    assert (c.conditionals, c.whiles, c.unknown_trips) == (0, 3, 0), c
    # Two H200s at TP 2: each GPU's product reads its shard of each stack in place (the kernel under shard_map); XLA's
    # products copied every layer's slices again (15 copies a step at 2 layers, 0.42 GiB)
    tp2 = plan(cfg, "h200:2", 2, sampler="greedy", **settings)
    (d,) = tp2.variants
    assert (d.audit.weight_copies, d.audit.conditionals, d.audit.whiles) == (0, 0, 1), d.audit
    assert tp2.audited_bytes(d) <= 1.15 * tp2.floor_bytes(d), d.audit.summary()


def test_gpu_targets_and_a_target_without_one():
    from jaxserve.aot import gpu_devices, gpu_targets

    assert set(gpu_targets()) >= {"a100", "h100", "h200"}
    with pytest.raises(
        ValueError, match="no GPU target description for 'b200': jaxserve compiles for a100, h100, h200"
    ):
        gpu_devices("b200")
    with pytest.raises(ValueError, match="unknown topology 'b200:8'"):
        plan("llama-3-8b", "b200:8", compile=False)


def test_tpu_pool_pages_take_their_arithmetic_bytes_at_tp_16():
    """Llama-3.1-70B's pool on a two-host v5e:4x4 at TP 16 (8 KV heads, each on 2 chips), as XLA:TPU lays it out:
    one KV head per chip a page, 80 x 16 x 128 x 2 bytes for K and for V, 640 KiB (1,280 in the old layout)."""
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.aot import no_persistent_cache, topology_devices
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.parallel.sharding import kv_heads_for, make_mesh
    from jaxserve.runner.kv_pool import KVPool

    cfg = load_preset("llama-3.1-70b")
    cfg = dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg, 16))  # as the runner repeats them
    mesh = make_mesh(16, topology_devices("v5e:4x4")[:16])
    pool = KVPool(cfg, CacheConfig(num_pages=64, dtype="bfloat16"), SchedulerConfig(), mesh, jnp.bfloat16, "tpu")
    assert pool.layout == "heads_tokens" and pool.shape(64) == (80, 64, 16, 16, 128)
    with no_persistent_cache():  # TPU executables stay out of the CPU engines' cache (as plan does)
        assert pool.device_page_bytes() == _kv_bytes_per_page("llama-3.1-70b", 16) == 640 * 1024


def test_llama31_70b_needs_a_bigger_slice_than_v5e_8():
    with pytest.raises(ValueError, match=r"llama-3.1-70b does not fit v5e:2x4 at tensor_parallel_size=8"):
        plan("llama-3.1-70b", "v5e:2x4", 8, compile=False)
    p = plan("llama-3.1-70b", "v5e:4x4", 16, compile=False)  # a two-host slice, by arithmetic
    assert p.fits and p.weight_bytes_per_chip == _weight_bytes("llama-3.1-70b") // 16
    assert p.page_bytes_per_chip == _kv_bytes_per_page("llama-3.1-70b", 16)


def test_gpu_topologies_plan_by_arithmetic_where_asked():
    p = plan("llama-3.1-70b", "h100:8", 8, compile=False)
    assert not p.variants and p.chip is CHIPS["h100"] and "(not compiled: arithmetic only)" in p.summary()
    assert p.weight_bytes_per_chip == _weight_bytes("llama-3.1-70b") // 8
    assert p.kv_bytes_per_chip == p.num_pages * _kv_bytes_per_page("llama-3.1-70b", 8)


@pytest.mark.parametrize(
    "topology, tp, match",
    [
        ("v9z:2x4", 8, "unknown topology 'v9z:2x4'"),
        ("v5e:2by4", 8, "unknown topology"),
        ("v5e:2x2", 8, "tensor_parallel_size=8 needs 8 chips, but v5e:2x2 has 4"),
        ("v5e:2x4", 3, "tensor_parallel_size=3 must divide the model's 32 attention heads"),
    ],
)
def test_bad_plans_are_clear_errors(topology, tp, match):
    with pytest.raises(ValueError, match=match):
        plan("llama-3-8b", topology, tp, compile=False)


def test_parse_topology():
    assert parse_topology("v5e:4x4") == (CHIPS["v5e"], 16)
    assert parse_topology("v5p:2x2x1") == (CHIPS["v5p"], 4)


@pytest.mark.parametrize(
    "preset",
    [
        "smollm2-135m",
        "llama-3-8b",
        "llama-3.1-70b",
        "mistral-7b",
        "qwen2.5-7b",
        "gemma-2-9b",
        "gemma-3-1b-it",
        "gemma-3-27b-it",
        "phi-3-mini-4k-instruct",
        "phi-4-mini-instruct",
    ],
)
def test_every_preset_plans_on_a_v5p_slice(preset):
    cfg = load_preset(preset)
    tp = 4 if cfg.num_heads % 4 == 0 else 1
    p = plan(preset, "v5p:2x2x1", tp, compile=False)
    assert p.fits and p.weight_bytes_per_chip == _weight_bytes(preset) // tp
    assert p.page_bytes_per_chip == _kv_bytes_per_page(preset, tp)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_gemma3_local_and_global_layers_compile_for_tpu(tmp_path, topology):
    """Gemma 3's layers (5 local : 1 global, each kind on its own rope, q/k and sandwich norms) through XLA's and
    Mosaic's TPU compilers: a small model of the family, its largest step (16 tokens, mixed). The layers are
    scanned, so one step compiles every kind of layer; the smaller buckets are the same program over fewer tokens,
    and every bucket's compile is checked on the default model above."""
    import json

    config = {
        "model_type": "gemma3_text",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "sliding_window": 32,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # The pool given (as for Llama-3-8B above): unsized, plan compiles the 16-token step a first time only to measure
    # its activations, then again over the sized pool (the sizing is checked on the default model).
    settings = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_pages=64, variants="mixed")
    p = plan(str(tmp_path), topology, 1, **settings)
    assert p.fits and [(v.tokens, v.decode_only) for v in p.variants] == [(16, False)]
    assert all(v.flops > 0 and v.code_bytes > 0 for v in p.variants)


def test_plan_reads_an_hf_config_json(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 32000,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "max_position_embeddings": 2048,
            }
        )
    )
    p = plan(str(tmp_path), "h100:2", 2, compile=False)
    embed = 32000 * 2048
    layer = 2048 * 2048 * 2 + 2048 * 256 * 2 + 3 * 2048 * 5632 + 2 * 2048
    assert p.weight_bytes_per_chip == (2 * embed + 22 * layer + 2048) * 2 // 2  # untied head, bf16, TP 2
    assert p.page_bytes_per_chip == 2 * 22 * 16 * 2 * 64 * 2  # 2 of 4 KV heads of 64 per chip


_QUANT_PLAN = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, num_pages=64, variants="decode")


@pytest.mark.parametrize("mode, max_ratio", [("int8", 0.53), ("w8a8", 0.53), ("int4", 0.30)])
def test_quantized_default_model_compiles_for_v5e(mode, max_ratio):
    """The quantized step (int8 and int4 weights dequantized inside the products, W8A8's int8 x int8 dots) through
    XLA's and Mosaic's TPU compilers, with weight bytes per chip measured on the compiled arguments, against the
    bfloat16 model's bytes by hand (the norms, replicated on the 3 chips, add 0.05%)."""
    p = plan("smollm2-135m", "v5e:2x4", 3, quantization=mode, **_QUANT_PLAN)
    (decode,) = p.variants
    assert decode.decode_only and decode.flops > 0
    assert p.weight_bytes_per_chip / (_weight_bytes("smollm2-135m") / 3) <= max_ratio


def test_fp8_plans_only_where_the_chip_has_fp8():
    with pytest.raises(ValueError, match="fp8 arithmetic"):
        plan("smollm2-135m", "v5e:2x4", 1, quantization="fp8", compile=False)
    p = plan("llama-3-8b", "h100:8", 8, quantization="fp8", max_model_len=2048, compile=False)
    assert p.weight_bytes_per_chip == pytest.approx(_weight_bytes("llama-3-8b", 1) / 8, rel=0.02)


def test_int8_kv_pages_plan_and_compile_for_v5e():
    """kv_cache_dtype="int8": on a GPU the page is int8 values plus a float32 scale per token and KV head; on a v5e
    the whole step (Mosaic attention and write over Int8Pages, under TP 3) compiles, its pool measured as laid out,
    and the engine warns that the tile padding makes those pages larger than bfloat16's there."""
    p = plan("llama-3-8b", "h100:8", 8, kv_cache_dtype="int8", max_model_len=2048, compile=False)
    assert p.page_bytes_per_chip == 2 * 32 * 16 * 1 * (128 + 4)  # 8 KV heads over 8 GPUs: one each
    settings = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128, num_pages=64, variants="corners")
    with pytest.warns(RuntimeWarning, match="more HBM per page than bfloat16 on a TPU"):
        q = plan("smollm2-135m", "v5e:2x4", 3, kv_cache_dtype="int8", **settings)
    assert {v.decode_only for v in q.variants} == {True, False} and all(v.flops > 0 for v in q.variants)
    assert q.page_bytes_per_chip > 2 * 30 * 16 * 64  # at least the values; the TPU pads the minor dims to tiles


@pytest.mark.parametrize("topology, expert_parallel", [("v5e:2x4", False), ("v6e:2x4", True)])
def test_moe_steps_compile_and_plan_by_active_parameters(topology, expert_parallel):
    """Qwen3-30B-A3B's layers (its 128 experts of 768, top 8, and its attention; 2 of its 48 layers: the layers are
    scanned, so the compile does not grow with depth) through XLA's and Mosaic's TPU compilers (megablox), split over
    8 chips by every expert's hidden (TP) or by whole experts (EP), checked against the counts by hand."""
    import dataclasses

    cfg = dataclasses.replace(load_preset("qwen3-30b-a3b"), num_layers=2)
    D, N, K, H, E, k, F, V, L = 2048, 32, 4, 128, 128, 8, 768, 151936, 2
    attention = D * N * H + 2 * D * K * H + N * H * D + 2 * H + 2 * D  # q, k, v, o, q/k norms, the 2 layer norms
    expert = 3 * D * F  # gate, up, down
    total = 2 * V * D + D + L * (attention + D * E + E * expert)  # embedding, head, final norm; router [D, E]
    active = total - L * (E - k) * expert
    p = plan(cfg, topology, 8, enable_expert_parallel=expert_parallel, **_QUANT_PLAN)
    (decode,) = p.variants
    assert (p.total_params, p.active_params) == (total, active) and p.expert_parallel == expert_parallel
    # Per chip: an eighth of everything but the router and the norms (replicated) and the 4 KV heads' k / v
    # matrices (each KV head repeated on 2 of the 8 chips); the experts exactly an eighth.
    replicated = L * D * E + 2 * L * D + 2 * L * H + D
    by_hand = (total - replicated + L * 2 * D * K * H) * 2 / 8 + replicated * 2
    assert p.weight_bytes_per_chip == by_hand
    assert p.expert_bytes_per_chip == L * E * expert * 2 // 8
    assert decode.decode_only and decode.argument_bytes >= p.weight_bytes_per_chip + p.kv_bytes_per_chip
    assert decode.peak_bytes < p.chip.hbm_bytes and decode.flops > 0
    # Decode reads the experts that batch x k choices can touch: 8 of 128 at batch 1, all of them from batch 16.
    assert [p.experts_read(b) for b in (1, 8, 16, 64)] == [8, 64, 128, 128]
    dense = by_hand - L * E * expert * 2 / 8  # all but the experts, per chip
    kv_token = p.page_bytes_per_chip / 16
    read_1 = dense + L * k * expert * 2 / 8 + 128 * kv_token  # 8 of 128 experts, one 128-token sequence's KV
    assert p.decode_tokens_per_s(1) == pytest.approx(p.chip.hbm_bytes_per_s / read_1, rel=1e-9)
    read_8 = dense + L * 64 * expert * 2 / 8 + 8 * 128 * kv_token  # 64 of 128 experts
    assert p.decode_tokens_per_s(8) == pytest.approx(8 * p.chip.hbm_bytes_per_s / read_8, rel=1e-4)
    assert "experts min(128, 1x8) = 8 per layer" in p.summary()


def test_moe_plans_by_arithmetic_on_gpus_and_checks_the_expert_parallel_degree():
    p = plan("qwen3-30b-a3b", "h200:1", 1, compile=False)
    assert p.fits and not p.variants and p.weight_bytes_per_chip == p.total_params * 2
    assert p.expert_bytes_per_chip == 48 * 128 * 3 * 2048 * 768 * 2
    assert p.active_params == p.total_params - 48 * 120 * 3 * 2048 * 768  # 8 of 128 experts per layer
    assert (p.total_params // 10**9, p.active_params // 10**9) == (30, 3)  # "30B-A3B"
    with pytest.raises(ValueError, match="tensor_parallel_size=64 must divide the model's 32 experts"):
        plan("gpt-oss-20b", "h100:64", 64, enable_expert_parallel=True, compile=False)
    with pytest.raises(ValueError, match="gpt-oss-120b does not fit h200:1"):  # 117 B parameters in bfloat16
        plan("gpt-oss-120b", "h200:1", 1, compile=False)
    # int8 experts fit it: 1 byte a weight, a float32 scale per expert and output channel, bfloat16 biases
    q = plan("gpt-oss-120b", "h200:1", 1, quantization="int8", compile=False)
    L, E, D = 36, 128, 2880  # gate, up [E, D, F]; down [E, F, D]; F = D
    assert q.fits and q.expert_bytes_per_chip == L * E * (3 * D * D + 3 * D * 4 + 3 * D * 2)
    assert q.weight_bytes_read(1) < q.weight_bytes_per_chip / 15  # 4 of 128 experts read at batch 1


def test_latent_attention_plans_one_latent_a_token_and_layer():
    """The DeepSeek-V3 and Kimi-K2 presets: their published sizes (671B with 37B active; 1T with 32B), and a pool
    page per chip of one 576-value latent a token and layer, not K and V per head (64 chips: 2 heads each, which
    would take 2 x 2 x (192 + 128) values)."""
    p = plan("deepseek-v3", "v5p:4x4x4", compile=False, enable_expert_parallel=True)
    assert (p.total_params // 10**9, p.active_params // 10**9) == (671, 37)
    assert p.page_bytes_per_chip == 61 * 16 * (512 + 64) * 2
    assert p.fits and p.expert_bytes_per_chip == 58 * 256 * 3 * 7168 * 2048 * 2 // 64
    k = plan("kimi-k2-instruct", "v5p:4x4x4", compile=False, enable_expert_parallel=True)
    assert (k.total_params // 10**12, k.active_params // 10**9) == (1, 32)


def test_latent_attention_steps_compile_for_tpu_over_an_unpadded_pool():
    """A 2-layer DeepSeek-V3 (its attention shapes, 16 heads, 16 experts in groups, one dense layer) compiled for a
    v5e chip: the engine's steps run the latent TPU kernel, and a page takes (page_size, 576 -> 640 lanes) per layer
    from the compiler: 1.11x the arithmetic, where a [.., 1 head, 576] page took 2.22x (80 KiB for 36)."""
    import dataclasses

    from jaxserve.config import load_preset

    cfg = dataclasses.replace(
        load_preset("deepseek-v3"),
        num_layers=2,
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_heads=16,
        q_lora_rank=256,
        num_experts=16,
        n_group=4,
        topk_group=2,
        moe_layers=(False, True),
    )
    settings = dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64, num_pages=256, variants="decode")
    p = plan(cfg, "v5e:2x2", 1, **settings)
    assert p.page_bytes_per_chip == 2 * 16 * 640 * 2  # layers x page_size x (512 + 64 padded to 640) x bf16
    (decode,) = p.variants
    assert decode.decode_only and decode.flops > 0 and decode.peak_bytes < p.chip.hbm_bytes


def test_pipeline_parallel_plans_by_arithmetic():
    """Llama-3.1-70B as 2 stages x TP 8 over two v5e-8 slices: each chip holds 40 layers' eighth and an eighth of the
    embedding, final norm and output head (on every stage), their KV pages, and the decode roofline counts the
    bubble. Checked against the sizes by hand."""
    D, N, K, H, F, V = 8192, 64, 8, 128, 28672, 128256
    layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D  # q, k, v, o, gate / up / down, 2 norms
    p = plan("llama-3.1-70b", "v5e:2x4", 8, compile=False, pipeline_parallel_size=2, num_slices=2)
    assert (p.pipeline_parallel_size, p.stage_layer_counts, p.topology) == (2, (40, 40), "2 x v5e:2x4")
    assert p.weight_bytes_per_chip == (40 * layer + D + 2 * V * D) * 2 // 8
    assert p.page_bytes_per_chip == 2 * 40 * 16 * 1 * H * 2  # 40 layers, one KV head per chip, K and V
    assert p.fits and not p.variants
    # 2 batches of 8 in flight: twice the tokens a tick of one batch yields (the other stage idles)
    assert p.decode_tokens_per_s(8) == pytest.approx(2 * p.decode_tokens_per_s(8, in_flight=1), rel=1e-12)
    one = plan("llama-3.1-70b", "v5e:4x4", 16, compile=False)  # the same 16 chips as one TP 16 replica
    assert p.weight_bytes_per_chip == pytest.approx(one.weight_bytes_per_chip, rel=0.04)  # + the replicated head
    assert "the bubble: 1 of 2 stages idle" in p.summary()


def test_pipeline_parallel_degrees_are_checked():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 x pipeline_parallel_size=2 needs 16 chips"):
        plan("llama-3.1-70b", "v5e:2x4", 8, compile=False, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 exceeds the model's 30 layers"):
        plan("smollm2-135m", "v5e:2x4", 1, compile=False, pipeline_parallel_size=31)
    p = plan("smollm2-135m", "v5e:2x4", 1, compile=False, pipeline_parallel_size=4)  # 30 layers: 8, 8, 7, 7
    assert p.stage_layer_counts == (8, 8, 7, 7) and p.page_bytes_per_chip == 2 * 8 * 16 * 3 * 64 * 2


def test_pipeline_step_compiles_for_two_tpu_slices():
    """SmolLM2 as 2 stages over two v5e-4 slices (a stage a slice: the stages' ppermute crosses the data-center
    network): the decode step compiles through XLA's and Mosaic's TPU compilers, each chip holding 15 layers."""
    settings = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_pages=64, variants="decode")
    p = plan("smollm2-135m", "v5e:2x2", 1, pipeline_parallel_size=2, num_slices=2, **settings)
    one = plan("smollm2-135m", "v5e:2x2", 1, compile=False, **settings)
    (decode,) = p.variants
    assert decode.decode_only and decode.flops > 0 and decode.peak_bytes < p.chip.hbm_bytes
    assert p.stage_layer_counts == (15, 15) and p.topology == "2 x v5e:2x2"
    # a chip holds half the layers' weights (the embedding and head whole) and half of each page
    embedding, norm = 49152 * 576 * 2, 576 * 2  # tied: the head is the embedding
    layers = one.weight_bytes_per_chip - embedding - norm
    assert p.weight_bytes_per_chip == embedding + norm + layers // 2
    # A whole page on one v5e chip: the arithmetic bytes, head_dim 64 padded to 128 lanes (what the compiled plans
    # of the default model measure, test_default_model_every_variant_compiles_for_v5e).
    assert p.page_bytes_per_chip * 2 == _kv_bytes_per_page("smollm2-135m", 1) * 128 // 64
