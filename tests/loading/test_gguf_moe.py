"""GGUF mixtures of experts: tiny random HF MoE checkpoints (``write_checkpoint`` of test_moe_models.py: perturbed
routers and norms) written to GGUF the way llama.cpp's converter does (``_write_like_llamacpp`` of test_gguf.py:
expert stacks merged into one [E, out, in] tensor each, Mixtral as architecture ``llama`` with its q/k rows
permuted, the ``{arch}.expert_*`` keys), read back by our GGUF loader and run through our paged forward against
HF transformers' logits (1e-4), and the files' configs against the HF configs'.

Qwen3-MoE's renormalized top-k (``norm_topk_prob``) is what llama.cpp's qwen3moe graph does whatever the file says
(and what transformers' GGUF loader assumes): the HF models here set it. gpt-oss is not read from GGUF: llama.cpp
stores its experts as MXFP4, a type our dequantizer lacks, and transformers' GGUF loader looks for other tensor
names (``ffn_*_projs``) than llama.cpp writes (``ffn_*_exps``), so there is no reference to follow.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

from test_gguf import _write_like_llamacpp  # noqa: E402
from test_models_hf import _paged_logits  # noqa: E402
from test_moe_models import write_checkpoint  # noqa: E402

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.loading import load_model  # noqa: E402
from jaxserve.loading.gguf import GGUFCheckpoint  # noqa: E402
from jaxserve.loading.weights import params_from_hf_tensors  # noqa: E402
from jaxserve.models.decoder import model_from_params  # noqa: E402
from jaxserve.quant import QArray, dequantize  # noqa: E402

VOCAB = 128  # the GGUF files' own token list: no tokenizer is needed for logits
CASES = {  # case: (write_checkpoint family, GGUF architecture, overrides)
    "mixtral": ("mixtral", "llama", {}),
    "qwen3moe": ("qwen3_moe", "qwen3moe", dict(norm_topk_prob=True, mlp_only_layers=[])),
}


def _llamacpp_state(path) -> dict[str, np.ndarray]:
    """The saved HF checkpoint's tensors with each layer's per-expert matrices stacked, [E, out, in], under the
    name without the expert index (``...experts.w1.weight``), which the ``gguf`` package's name map knows."""
    from safetensors.numpy import load_file

    out, stacks = {}, {}
    for name, value in load_file(path / "model.safetensors").items():
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(.+)", name)
        if m:
            stacks.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = value
        else:
            out[name] = value
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (HF model, its HF-layout state with merged expert stacks, GGUF path); built once per case."""
    cache = {}

    def build(case: str):
        if case not in cache:
            family, arch, overrides = CASES[case]
            path = tmp_path_factory.mktemp(case)
            hf = write_checkpoint(family, path, vocab_size=VOCAB, **overrides)
            state = _llamacpp_state(path)
            _write_like_llamacpp(path / f"{case}.gguf", arch, hf.config, state)
            cache[case] = hf, state, path / f"{case}.gguf"
        return cache[case]

    return build


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_matches_hf(tiny, case):
    hf, _, path = tiny(case)
    ours = GGUFCheckpoint(path).model_config()
    expected = ModelConfig.from_hf(hf.config.to_dict())
    assert ours.architecture == CASES[case][0] and ours.num_experts == 8
    assert ours == dataclasses.replace(expected, rms_norm_eps=float(np.float32(expected.rms_norm_eps)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tiny, case):
    hf, _, path = tiny(case)
    ckpt = GGUFCheckpoint(path)
    cfg = ckpt.model_config()
    graphdef, state = model_from_params(cfg, params_from_hf_tensors(cfg, ckpt.iter_hf_tensors(progress=False)))
    tokens = np.random.default_rng(1).integers(0, VOCAB, 19)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float().numpy()
    ours = _paged_logits(graphdef, state, cfg, tokens, chunks=[16, 1, 1, 1])
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_wrong_expert_count_names_the_tensor(tiny, tmp_path):
    hf, state, _ = tiny("qwen3moe")
    name = "model.layers.1.mlp.experts.up_proj.weight"
    state = dict(state) | {name: state[name][:7]}  # 7 experts where the file says 8
    path = tmp_path / "short.gguf"
    _write_like_llamacpp(path, "qwen3moe", hf.config, state)
    with pytest.raises(
        ValueError,
        match=r"short\.gguf: tensor 'blk\.1\.ffn_up_exps\.weight' has shape \(7, 40, 64\), whose first axis should "
        r"have one entry per expert: qwen3moe\.expert_count is 8",
    ):
        load_model(path, "float32")


def test_quantized_experts_are_served_quantized(tiny, tmp_path, caplog):
    """Kept quantized, a Q8_0 file's expert stacks stay Q8_0 blocks as its matrices do: their values the ``gguf``
    package's dequantizer's exactly, and the model's logits those of the same file read as floats."""
    hf, state, _ = tiny("mixtral")
    path = tmp_path / "q8.gguf"
    _write_like_llamacpp(path, "llama", hf.config, state)
    ckpt = GGUFCheckpoint(path)
    writer = gguf.GGUFWriter(str(tmp_path / "q8_0.gguf"), "llama")
    for key, field in gguf.GGUFReader(str(path)).fields.items():  # the same file, its matrices as Q8_0
        if key.startswith("llama.") or key.startswith("tokenizer."):
            value = ckpt.metadata[key]
            if isinstance(value, list):
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, field.types[0])
    quantized = ("ffn_gate_exps", "ffn_up_exps", "attn_q.")  # rows of 64 (ffn_down_exps': 48, not whole blocks)
    for name in ckpt.tensors:
        value = ckpt.tensor(name)
        if any(q in name for q in quantized):
            writer.add_tensor(
                name,
                gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.WARNING, logger="jaxserve.loading.gguf"):
        loaded = load_model(tmp_path / "q8_0.gguf", "float32", keep_quantized=True)
    assert not [r for r in caplog.records if "dequantized" in r.getMessage()]
    params = loaded.params
    reader = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "q8_0.gguf")).tensors}
    assert isinstance(params["wq"], QArray) and params["wq"].bits == 8
    for param, tensor in (("expert_gate", "ffn_gate_exps"), ("expert_up", "ffn_up_exps")):
        assert isinstance(params[param], QArray) and params[param].bits == 8, param
        t = reader[f"blk.1.{tensor}.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        np.testing.assert_array_equal(np.asarray(dequantize(params[param]))[1], np.swapaxes(want, -1, -2))
    assert isinstance(params["expert_down"], np.ndarray)  # stored as F32
    tokens = np.random.default_rng(2).integers(0, VOCAB, 19)
    floats = load_model(tmp_path / "q8_0.gguf", "float32").params
    cfg = loaded.config
    ours = _paged_logits(*model_from_params(cfg, params), cfg, tokens, chunks=[16, 1, 1, 1])
    ref = _paged_logits(*model_from_params(cfg, floats), cfg, tokens, chunks=[16, 1, 1, 1])
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
