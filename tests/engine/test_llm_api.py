"""The user-facing surface on small checkpoints written here: LLM on an HF directory (with its tokenizer),
orbax conversion, the CLI, and clear errors for bad inputs. Reference: HF transformers' greedy generate.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="HF transformers' reference needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")

from helpers import hf_greedy  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.cli import main as cli_main  # noqa: E402

TEXT = ["hello world, this is a small test of the tokenizer and the model.", "numbers 12345 and words"] * 40
ENGINE = dict(num_pages=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Qwen2 (QKV bias) with a byte-level BPE tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tiny_qwen2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": template})
    )
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return path, model


def test_hf_directory_generates_like_hf(hf_dir):
    path, model = hf_dir
    llm = LLM(str(path), **ENGINE)
    prompts = ["hello world", "numbers 12345 and", "this is a small test of the"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 12)
        # As vLLM, bytes of a character cut at the end (max_tokens inside it) are left out rather than written as
        # U+FFFD (the detokenizer's own tests check which ones).
        full = llm.tokenizer.decode(out.outputs[0].token_ids)
        assert full.startswith(out.outputs[0].text) and set(full[len(out.outputs[0].text) :]) <= {"\ufffd"}
    chat = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    tail = llm.tokenizer.encode("<|im_start|>assistant\n")
    assert chat.prompt_token_ids[-len(tail) :] == tail


def test_orbax_convert_round_trip(hf_dir, tmp_path):
    path, model = hf_dir
    dst = tmp_path / "ckpt"
    assert cli_main(["convert", str(path), str(dst)]) == 0
    a = LLM(str(path), **ENGINE)
    b = LLM(str(dst), **ENGINE)
    assert b.engine.model_config == a.engine.model_config
    from flax import nnx

    a_params, b_params = nnx.to_pure_dict(a.engine.runner.state), nnx.to_pure_dict(b.engine.runner.state)
    assert a_params.keys() == b_params.keys()
    for name, value in a_params.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(b_params[name]))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert b.generate("hello world", params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(
        model, a.tokenizer.encode("hello world"), 8
    )


def test_cli_generate_streams_the_text(hf_dir, capsys):
    path, model = hf_dir
    assert cli_main(["generate", "hello world", "--model", str(path), "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    llm_tok = LLM(str(path), **ENGINE).tokenizer
    ids = llm_tok.encode("hello world")
    assert out == llm_tok.decode(hf_greedy(model, ids, 6)) + "\n"


def test_cli_reports_a_missing_model(capsys, tmp_path):
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("missing", FileNotFoundError, "not a file, a directory"),
        ("truncated", ValueError, "truncated"),
        ("unknown_arch", ValueError, "unknown architecture.*mamba"),
        ("empty_dir", FileNotFoundError, "not a GGUF file, an HF model directory"),
    ],
)
def test_bad_models_are_clear_errors(bad, error, match, tmp_path, default_model_path):
    if bad == "missing":
        target = "no/such/model/anywhere"
    elif bad == "truncated":
        target = tmp_path / "cut.gguf"
        target.write_bytes(default_model_path.read_bytes()[:5_000_000])
    elif bad == "unknown_arch":
        target = tmp_path
        (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    else:
        target = tmp_path
    with pytest.raises(error, match=match):
        LLM(str(target), **ENGINE)


def test_bad_requests_are_clear_errors(hf_dir):
    llm = LLM(str(hf_dir[0]), **ENGINE)
    with pytest.raises(ValueError, match="prompt has 200 tokens.*max_model_len=128"):
        llm.generate([[5] * 200], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-queued
