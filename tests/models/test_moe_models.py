"""Mixture-of-experts models through the whole engine, against HF transformers and across device layouts.

Tiny random checkpoints written by transformers (Mixtral, Qwen3-MoE with a dense layer among MoE ones, gpt-oss),
with SmolLM2's tokenizer so that the engine serves them as it serves any directory. Routers, biases, sinks and
norms are perturbed away from their initial values, so a dropped bias or a wrong routing convention changes
tokens. References: HF transformers teacher-forced on our tokens (greedy choices identical, logprobs within 1e-3),
and the same engine on one device for tensor and expert parallelism over the fake CPU devices of conftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY_ENGINE, TINY_VOCAB, assert_matches_hf, assert_same_completions, tiny_prompts
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.loading import orbax_ckpt

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

VOCAB = TINY_VOCAB
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(intermediate_size=96, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1]),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            intermediate_size=40,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=6,
            swiglu_limit=2.0,
            max_position_embeddings=131072,  # YaRN's factor 32 over the original 4,096
        ),
    ),
}
ENGINE = TINY_ENGINE
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def write_checkpoint(family: str, path, **overrides):
    """A tiny random HF checkpoint of ``family`` in ``path`` (with a tokenizer); returns the torch model."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(7)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
            elif name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * 0.3)
            elif ".gate.weight" in name or "router.weight" in name:
                p.copy_(torch.randn_like(p))
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_path):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, write_checkpoint(family, path))
        orbax_ckpt.copy_tokenizer(default_model_path, path)
    return out


@pytest.fixture(scope="module")
def one_device(checkpoints):
    """Each family's greedy tokens and logprobs on one device: the reference of the parallel layouts."""
    out = {}
    for family, (path, _) in checkpoints.items():
        llm = LLM(str(path), **ENGINE)
        res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
        out[family] = [o.outputs[0] for o in res]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_and_logprobs_match_hf(family, checkpoints, one_device):
    _, hf = checkpoints[family]
    assert_matches_hf(hf, tiny_prompts(), one_device[family])


def write_mxfp4_checkpoint(path, seed=0):
    """A tiny gpt-oss checkpoint in OpenAI's MXFP4 layout: the expert stacks as random FP4 ``_blocks`` and e8m0
    ``_scales`` (2^-6 .. 2^-2), ``quant_method: mxfp4`` in config.json (as the hub's gpt-oss ships)."""
    import json

    from safetensors.numpy import load_file, save_file

    write_checkpoint("gpt_oss", path, intermediate_size=64)  # 32-value groups along both contractions
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows, cols = tensors.pop(name).shape  # [E, in, out]
        tensors[name + "_blocks"] = rng.integers(0, 256, size=(experts, cols, rows // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(121, 126, size=(experts, cols, rows // 32), dtype=np.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))


def test_dequantized_mxfp4_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxserve.loading.mxfp4 import dequantize_mxfp4, mxfp4_as_int8
    from jaxserve.loading.weights import _quantized_parts
    from jaxserve.quant import QArray, dequantize

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(3, 40, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, size=(3, 40, 4), dtype=np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), ref.numpy())
    # served: int8 values (twice the FP4 ones) and power-of-two scales, the same weights exactly
    q = mxfp4_as_int8(blocks, scales)
    assert q.values.dtype == np.int8 and q.values.shape == (3, 40, 128) and np.abs(q.values).max() <= 12
    served = QArray(**_quantized_parts(q, transpose=True))  # [E, in, out], grouped by 32 along in
    np.testing.assert_array_equal(np.asarray(dequantize(served)), ref.numpy())
    with pytest.raises(ValueError, match=r"blocks of shape \(3, 40, 4, 16\) do not match scales of shape"):
        dequantize_mxfp4(blocks, scales[:, :, :3])


@pytest.fixture(scope="module")
def mxfp4_one_device(tmp_path_factory, default_model_path):
    """The MXFP4 gpt-oss checkpoint (``write_mxfp4_checkpoint``), its one-device engine (``LLM(path, **ENGINE)``),
    the text that engine logged at INFO while loading, and its greedy outputs of ``tiny_prompts()``: the reference
    of the two tests below (written and compiled once)."""
    import logging

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(path)
    orbax_ckpt.copy_tokenizer(default_model_path, path)
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        llm = LLM(str(path), **ENGINE)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    text = "\n".join(r.getMessage() for r in records)
    return path, llm, text, llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)


def test_gpt_oss_mxfp4_checkpoint_matches_hf(mxfp4_one_device):
    """The hub's gpt-oss layout: MXFP4 expert stacks, read by jaxserve and by transformers' own dequantizer."""
    path, llm, log_text, res = mxfp4_one_device
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert "MXFP4 expert weights are served as int8 in groups of 32" in log_text
    for name in ("expert_gate", "expert_up", "expert_down"):
        w = llm.engine.runner.state[name].get_value()
        assert w.q.dtype == np.int8 and w.group == 32, name
    assert_matches_hf(hf, tiny_prompts(), [o.outputs[0] for o in res])


@pytest.mark.multidevice
def test_mxfp4_stacks_split_by_tensor_parallelism_are_served_as_floats(mxfp4_one_device, caplog):
    """At TP 2 each device holds 32 of gpt-oss's 64 down-projection inputs: whole groups of 32, served quantized.
    A stack whose groups a degree would cut is served dequantized, logged; expert parallelism keeps it quantized.
    Either way one device's tokens (with expert parallelism over quantized experts: the int8 test of the flag
    below)."""
    tmp_path, _, _, one = mxfp4_one_device
    for tp, ep, quantized in ((2, False, True), (4, False, False), (4, True, True)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            llm = LLM(str(tmp_path), tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
        down = llm.engine.runner.state["expert_down"].get_value()
        assert hasattr(down, "scale") == quantized, (tp, ep)
        if not quantized:
            assert "expert_down: quantized in groups of 32 along its 64 input channels" in caplog.text
        if ep:
            continue
        res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in res] == [o.outputs[0].token_ids for o in one], (tp, ep)


def test_mxfp4_blocks_without_their_scales_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    write_mxfp4_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales is missing"):
        LLM(str(tmp_path), **ENGINE)


@pytest.mark.multidevice
@pytest.mark.parametrize(
    ("family", "tp", "ep"), [("gpt_oss", 2, True), ("gpt_oss", 4, True), ("qwen3_moe", 4, True), ("mixtral", 4, False)]
)
def test_parallel_layouts_give_one_devices_tokens(family, tp, ep, checkpoints, one_device):
    path, _ = checkpoints[family]
    llm = LLM(str(path), tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
    runner = llm.engine.runner
    gate = runner.state["expert_gate"].get_value()
    experts, hidden = gate.shape[-3], gate.shape[-1]
    local = gate.addressable_shards[0].data.shape
    if ep:  # whole experts per device: the expert axis split, each expert's matrices whole
        assert runner.param_shardings["expert_gate"].spec == P(None, "model", None, None)
        assert local[-3:] == (experts // tp, 64, hidden)
    else:  # every expert on every device, its hidden split
        assert local[-3:] == (experts, 64, hidden // tp)
    assert gate.addressable_shards[0].data.nbytes * tp == gate.nbytes  # 1 / degree of the stack per device
    res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    assert_same_completions([o.outputs[0] for o in res], one_device[family], atol=1e-4)
    compiled = runner.num_compilations
    llm.generate(tiny_prompts(seed=1), GREEDY, use_tqdm=False)  # steady state: the same buckets, nothing new
    assert runner.num_compilations == compiled


@pytest.mark.multidevice  # the degree is checked against the experts once 4 devices exist
def test_expert_parallel_degree_must_divide_the_experts(tmp_path, default_model_path):
    write_checkpoint("mixtral", tmp_path, num_local_experts=6)
    orbax_ckpt.copy_tokenizer(default_model_path, tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's 6 experts"):
        LLM(str(tmp_path), tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)


def test_top_k_above_the_expert_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be <= num_experts \(8\)"):
        ModelConfig(architecture="mixtral", num_experts=8, num_experts_per_tok=9)


def test_a_checkpoint_missing_an_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxserve.loading import load_model

    write_checkpoint("mixtral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing expert\(s\) \[5\] of weight 'expert_up' in layer 1"):
        load_model(str(tmp_path), "float32")


@pytest.mark.multidevice
def test_orbax_checkpoint_of_a_moe_restores_onto_expert_parallel_devices(checkpoints, one_device, tmp_path):
    """``jaxserve convert`` of gpt-oss (a directory whose tokenizer is a ``tokenizer.gguf``), restored straight onto
    2 devices with whole experts on each: one device's tokens."""
    from jaxserve.loading import convert

    path, _ = checkpoints["gpt_oss"]
    convert(str(path), tmp_path / "orbax", "float32")
    llm = LLM(str(tmp_path / "orbax"), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    assert llm.engine.runner.state["expert_up"].get_value().sharding.spec == P(None, "model", None, None)
    res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in res] == [list(o.token_ids) for o in one_device["gpt_oss"]]


def _hf_with_experts(hf, experts):
    """A copy of HF's Mixtral whose expert stacks are ``experts`` (ours: [L, E, D, F] gate / up, [L, E, F, D] down)."""
    import copy

    hf = copy.deepcopy(hf)
    gate, up, down = (np.asarray(experts[n], np.float32) for n in ("expert_gate", "expert_up", "expert_down"))
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):  # HF: gate_up_proj [E, 2F, D] (gate first), down_proj [E, D, F]
            gate_up = np.concatenate([gate[i], up[i]], axis=-1).transpose(0, 2, 1)
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(down[i].transpose(0, 2, 1).copy()))
    return hf


@pytest.mark.parametrize(("mode", "tp"), [("int4", 1), pytest.param("int8", 2, marks=pytest.mark.multidevice)])
def test_quantized_expert_stacks_match_hf_on_their_values(mode, tp, checkpoints):
    """Only the expert stacks quantized: served as 8 / 4-bit values (each device holding 1 / degree of them under
    expert parallelism), tokens and logprobs those of HF with the experts set to the dequantized values."""
    import dataclasses

    import jax

    from jaxserve import quant
    from jaxserve.loading import load_model

    path, hf = checkpoints["mixtral"]
    loaded = load_model(str(path), "float32")
    names = ("expert_gate", "expert_up", "expert_down")
    q = {n: jax.tree.map(np.asarray, quant.quantize_param(n, loaded.params[n], mode, group=16)) for n in names}
    llm = LLM(
        dataclasses.replace(loaded, params={**loaded.params, **q}),
        tensor_parallel_size=tp,
        enable_expert_parallel=tp > 1,
        **ENGINE,
    )
    served = llm.engine.runner.state["expert_down"].get_value()
    assert isinstance(served, quant.QArray) and served.bits == int(mode[3:])
    values = served.q
    assert values.dtype == (np.uint8 if mode == "int4" else np.int8)
    assert values.addressable_shards[0].data.nbytes * tp == values.nbytes
    res = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    ref = _hf_with_experts(hf, {n: quant.dequantize(q[n]) for n in names})
    assert_matches_hf(ref, tiny_prompts(), [o.outputs[0] for o in res])


@pytest.mark.multidevice
def test_quantization_flag_quantizes_the_experts_and_expert_parallel_keeps_its_tokens(checkpoints):
    """``quantization="int8"`` quantizes the expert stacks with the rest: 1 byte a weight, and TP 2 with expert
    parallelism gives one device's tokens on them."""
    from jaxserve import quant

    path, _ = checkpoints["mixtral"]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(path), quantization="int8", tensor_parallel_size=tp, enable_expert_parallel=tp > 1, **ENGINE)
        gate = llm.engine.runner.state["expert_gate"].get_value()
        assert isinstance(gate, quant.QArray) and gate.q.dtype == np.int8 and gate.q.shape == (3, 8, 64, 48)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)])
    assert outs[0] == outs[1]
