"""Structured outputs: the sampler's token mask against numpy, and constrained generation on the default model.

Outputs are checked by implementations we did not write: ``jsonschema`` for JSON schemas, Python's ``re`` for
regexes, llguidance's own numpy mask application for the sampler's unpacking.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers import SMALL_POOL_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.sampling.sampler import SamplingMetadata, sample
from jaxserve.sampling.structured import ConstraintUnsatisfiable, StructuredOutputs, endless_refs

jsonschema = pytest.importorskip("jsonschema")
llg_numpy = pytest.importorskip("llguidance.numpy")

# Ten schemas: nested objects, arrays, enums, bounded numbers, required and optional fields. Objects are closed
# (``additionalProperties: false``, as OpenAI's strict mode requires): an open object lets a small model add
# keys until max_tokens.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0}},
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        },
        "required": ["color", "hex"],
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}},
        "required": ["temperature", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 16},
                    "last": {"type": "string", "maxLength": 16},
                },
                "required": ["first", "last"],
            },
            "verified": {"type": "boolean"},
        },
        "required": ["person", "verified"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["title", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
]


def _closed(schema):
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]

PROMPTS = [
    "Describe a person as JSON.",
    "Give me data about a city in JSON.",
    "Pick a color, as JSON.",
    "A shopping list in JSON.",
    "Today's weather as JSON.",
    "A user record as JSON.",
    "Some small numbers as a JSON list.",
    "A news article summary as JSON.",
    "Is water wet? Answer in JSON.",
    "Three points on a plane, as JSON.",
]


def _chat(llm, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def llm(default_llm):
    """The session's shared engine: its steps are compiled already."""
    return default_llm


# ---------------------------------------------------------------------------------------------- the sampler


def test_sampler_mask_matches_llguidance_numpy():
    rng = np.random.default_rng(0)
    b, v = 6, 1000  # v not a multiple of 32: the last word is partial
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    mask = rng.integers(-(2**31), 2**31, size=(b, (v + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[2] = -1  # an unconstrained row among constrained ones
    mask[4] = 0
    mask[4, 5] = 1 << 7  # exactly one token allowed: 5 * 32 + 7
    reference = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(reference, mask)  # llguidance's own numpy unpacking

    greedy = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * b, token_mask=mask)
    out = sample(logits, greedy, max_logprobs=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference.argmax(-1))
    assert int(out.tokens[4]) == 5 * 32 + 7
    # Logprobs stay those of the raw logits (vLLM's raw_logprobs): the mask changes the choice only.
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(b), np.asarray(out.tokens)], rtol=1e-5)

    allowed = np.isfinite(reference)
    for seed in range(5):
        hot = SamplingMetadata.from_params([SamplingParams(temperature=2.0, seed=seed)] * b, token_mask=mask)
        toks = np.asarray(sample(logits, hot, max_logprobs=0).tokens)
        assert allowed[np.arange(b), toks].all(), f"seed {seed} drew a banned token"


@pytest.mark.parametrize(
    "extreme",
    [
        dict(repetition_penalty=5e-324),
        dict(repetition_penalty=1e-40),
        dict(repetition_penalty=1e300),
        dict(temperature=1e300),
        dict(temperature=1e300, repetition_penalty=5e-324, presence_penalty=2.0),
    ],
)
def test_extreme_parameters_never_lift_the_mask(extreme):
    """Penalties and temperatures past float32's range (valid request values) once made inf / nan logits that
    let a banned token win: the draw stays within llguidance's own unpacking of the mask, greedy or not."""
    rng = np.random.default_rng(2)
    b, v = 4, 200
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    logits[:, 0] = 0.0  # 0 * inf
    mask = np.zeros((b, (v + 31) // 32), np.int32)
    mask[:, 1] = 0b1011  # tokens 32, 33, 35
    allowed = np.zeros((b, v), np.float32)
    llg_numpy.apply_token_bitmask_inplace(allowed, mask)
    allowed = np.isfinite(allowed)
    history = [list(range(0, v, 2))] * b  # every even token seen: most banned ones and some allowed ones
    for seed in range(4):
        params = [
            SamplingParams(seed=seed, **{"temperature": 0.0, **extreme})
            if i == 0
            else SamplingParams(seed=seed, **{"temperature": 1.0, **extreme})
            for i in range(b)
        ]
        meta = SamplingMetadata.from_params(params, token_mask=mask, prompt_ids=history, output_ids=history)
        toks = np.asarray(sample(logits, meta, max_logprobs=0).tokens)
        assert allowed[np.arange(b), toks].all(), (extreme, seed, toks)


def test_sampler_without_mask_is_unchanged():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(4)]
    plain = sample(logits, SamplingMetadata.from_params(params, token_mask_width=10), max_logprobs=0)
    ones = SamplingMetadata.from_params(params, token_mask=np.full((4, 10), -1, np.int32))
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(sample(logits, ones, max_logprobs=0).tokens))


# ---------------------------------------------------------------------------------------------- parameters


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsn": {}})
    so = SamplingParams(structured_outputs={"json": {"b": 1, "a": 2}}).structured_outputs
    assert so.kind == "json" and list(json.loads(so.json)) == ["b", "a"]  # property order is output order


NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": "#/$defs/node"}}}
ENDLESS = [  # (schema, its $refs that no finite value satisfies)
    ({"$ref": "#"}, ["#"]),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ["#/$defs/a"]),
    (
        {
            "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"allOf": [{"$ref": "#/definitions/a"}]}},
            "$ref": "#/definitions/a",
        },
        ["#/definitions/a", "#/definitions/b"],
    ),
    ({"$defs": {"node": {**NODE, "required": ["child"]}}, "$ref": "#/$defs/node"}, ["#/$defs/node"]),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ["#"]),
]
WAY_OUT = [  # (schema, a finite value valid under it)
    ({"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, {"v": 1, "child": {"v": 2}}),
    (
        {
            "$defs": {
                "node": {
                    **NODE,
                    "properties": {"child": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    "required": ["child"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"child": {"child": None}},
    ),
    ({"type": "array", "items": {"$ref": "#"}}, [[], [[]]]),
    ({"$defs": {"unused": {"$ref": "#/$defs/unused"}}, "type": "integer"}, 3),
    ({"$ref": "https://example.com/schema.json"}, None),  # not local: left to llguidance
]


@pytest.mark.parametrize("schema, refs", ENDLESS)
def test_refs_with_no_way_out_are_found(schema, refs):
    assert sorted(endless_refs(schema)) == refs
    with pytest.raises(ConstraintUnsatisfiable, match=r"structured_outputs\.json .*\$ref .*itself"):
        StructuredOutputs("", 100, [0]).grammar_text(StructuredOutputsParams(json=json.dumps(schema)))
    if "required" in json.dumps(schema) or "minItems" in schema:  # finite candidates, each invalid (jsonschema)
        nested = [{}, []]
        for _ in range(4):
            nested += [{"child": nested[-2]}, [nested[-1]]]
        assert not any(jsonschema.Draft202012Validator(schema).is_valid(x) for x in nested)


@pytest.mark.parametrize("schema, value", WAY_OUT)
def test_recursive_schemas_with_a_way_out_are_kept(schema, value):
    assert endless_refs(schema) == []
    if value is not None:
        jsonschema.validate(value, schema)  # a finite value is valid: refusing the schema would be wrong


@pytest.mark.slow
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("json", '{"type": "object", "properties": {"a": {"type": "wrong"}}}', "json"),
        ("json", "{not json", "json"),
        ("regex", "a(b", "regex"),
        ("grammar", 'start: "a" undefined_rule', "grammar"),
        ("grammar", 'root ::= "a" (', "grammar"),
    ],
)
def test_bad_constraints_name_the_field(llm, field, value, words):
    with pytest.raises(ValueError, match=rf"request 'bad'.*structured_outputs\.{words}"):
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs={field: value}))
    assert not llm.engine.has_unfinished_requests()


# A character whose UTF-8 bytes (F2 A8 9E A0) no token of SmolLM2's byte-level vocabulary begins with.
UNSPELLABLE = "\U000a87a0"


def test_the_default_vocabulary_cannot_spell_the_test_character(llm):
    """The premise of the next tests, read from the tokenizer's own vocabulary (not from llguidance)."""
    vocab = json.loads(llm.tokenizer.to_json())["model"]["vocab"]
    byte_of = {ch: b for b, ch in _gpt2_byte_chars().items()}
    first_bytes = {byte_of.get(t[0]) for t in vocab if t and t[0] in byte_of}
    assert UNSPELLABLE.encode()[0] not in first_bytes and ord("a") in first_bytes


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet), written out from its definition."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.mark.slow
def test_a_choice_the_vocabulary_cannot_spell_is_refused_naming_it(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.choice\[1\].*U\+A87A0"):
        llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs={"choice": ["yes", "x" + UNSPELLABLE]}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_regex_the_vocabulary_cannot_follow_fails_that_request_alone(llm):
    """llguidance finds it only mid-generation (its mask then lets a wrong token through): that request fails
    with ConstraintUnsatisfiable, its neighbour finishes, and every page is freed."""
    from jaxserve.engine.exceptions import StepFailed
    from jaxserve.sampling.structured import ConstraintUnsatisfiable

    eng = llm.engine
    eng.add_request("bad", "hi", SamplingParams(max_tokens=8, structured_outputs={"regex": "ab" + UNSPELLABLE}))
    eng.add_request("good", "hi", SamplingParams(max_tokens=6, temperature=0))
    failures, finished = [], {}
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except StepFailed as e:
            failures.append(e)
            outs = e.outputs
        finished.update({o.request_id: o for o in outs if o.finished})
    assert [f.request_ids for f in failures] == [["bad"]], failures
    assert isinstance(failures[0].cause, ConstraintUnsatisfiable) and "vocabulary" in str(failures[0].cause)
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == 6
    assert eng.get_stats()["num_used_pages"] == 0


# ---------------------------------------------------------------------------------------------- generation


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_validate(llm, temperature):
    prompts = [_chat(llm, p) for p in PROMPTS]
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=160, structured_outputs={"json": s})
        for i, s in enumerate(SCHEMAS)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.slow
def test_json_object_choice_regex_grammar(llm):
    n = 50
    params = SamplingParams(
        n=n, temperature=1.0, seed=3, max_tokens=24, structured_outputs={"choice": ["red", "green", "light blue"]}
    )
    out = llm.generate([_chat(llm, "Name a color.")], params, use_tqdm=False)[0]
    assert len(out.outputs) == n and all(c.text in ("red", "green", "light blue") for c in out.outputs)
    assert all(c.finish_reason == "stop" for c in out.outputs)

    pattern = r"[A-Z][a-z]{2,8}-\d{3}"
    params = SamplingParams(n=n, temperature=1.0, seed=4, max_tokens=24, structured_outputs={"regex": pattern})
    out = llm.generate([_chat(llm, "Make up a product code.")], params, use_tqdm=False)[0]
    assert all(re.fullmatch(pattern, c.text) for c in out.outputs), [c.text for c in out.outputs]

    obj = llm.generate(
        [_chat(llm, "Anything, as JSON.")],
        SamplingParams(temperature=0.8, seed=5, max_tokens=120, structured_outputs={"json_object": True}),
        use_tqdm=False,
    )[0]
    assert isinstance(json.loads(obj.outputs[0].text), dict)

    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "The answer is " [0-9] [0-9]? "."'
    for grammar in (lark, gbnf):
        out = llm.generate(
            [_chat(llm, "What is 6 times 7?")],
            SamplingParams(n=8, temperature=1.0, seed=6, max_tokens=16, structured_outputs={"grammar": grammar}),
            use_tqdm=False,
        )[0]
        assert all(re.fullmatch(r"The answer is \d{1,3}\.", c.text) for c in out.outputs), [c.text for c in out.outputs]


@pytest.mark.slow
def test_constraints_mix_with_plain_requests_stops_logprobs_and_preemption(default_loaded, llm):
    """Constrained and plain requests in one batch, under a pool small enough to preempt: every constrained
    output still validates, the plain ones equal a run without any constrained neighbour, and nothing leaks."""
    schema = SCHEMAS[0]
    plain = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in range(6)]
    prompts = [_chat(llm, f"Tell me about topic {i} in a few sentences.") for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]

    tiny = LLM(default_loaded, **SMALL_POOL_ENGINE)
    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=80,
            logprobs=2,
            stop=["}"],
            include_stop_str_in_output=True,
            structured_outputs={"json": schema},
        )
        for _ in range(6)
    ]
    outs = tiny.generate(prompts + [_chat(llm, p) for p in PROMPTS[:6]], plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:6]] == expected
    stats = tiny.engine.get_stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
    for out in outs[6:]:
        c = out.outputs[0]
        jsonschema.validate(json.loads(c.text), schema)
        assert len(c.logprobs) == len(c.token_ids) and all(len(d) >= 2 for d in c.logprobs)
    assert stats["num_used_pages"] == 0 and not tiny.engine.has_unfinished_requests()


@pytest.mark.slow
def test_greedy_constrained_equals_greedy_when_the_model_already_complies(llm):
    """A constraint that allows what greedy decoding produces anyway changes nothing: the mask only bans."""
    prompt = _chat(llm, "What is the capital of France?")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    pattern = re.escape(free.text) if free.finish_reason == "stop" else re.escape(free.text) + ".*"
    constrained = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": pattern}), use_tqdm=False
    )[0].outputs[0]
    if free.finish_reason == "stop":  # free decoding sampled EOS; the constrained one ends with its grammar
        assert free.token_ids[-1] in llm.engine.eos_token_ids
        assert constrained.token_ids == free.token_ids[:-1] and constrained.text == free.text
    else:
        assert constrained.token_ids == free.token_ids


@pytest.mark.slow
def test_grammars_are_compiled_once(llm):
    so = llm.engine.structured
    schema = {"type": "object", "properties": {"unique_field_for_cache_test": {"type": "integer"}}}
    before = so.num_compiled
    for i in range(3):
        llm.generate(["x"], SamplingParams(max_tokens=20, seed=i, structured_outputs={"json": schema}), use_tqdm=False)
    assert so.num_compiled == before + 1


def test_host_side_has_no_jax():
    import subprocess
    import sys

    code = "import sys, jaxserve.sampling.structured; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mask_unpacking_compiles_once():
    """The packed mask is an ordinary argument: constrained or not, the sampler's "full" variant compiles once per
    shape; greedy rows under no constraint take the "greedy" variant (its own compile, once)."""
    logits = np.zeros((2, 64), np.float32)
    sample._clear_cache()
    p = [SamplingParams(temperature=0.0)] * 2
    plain = SamplingMetadata.from_params(p, token_mask_width=2)
    constrained = SamplingMetadata.from_params(p, token_mask=np.array([[1, 0], [-1, -1]], np.int32))
    hot = SamplingMetadata.from_params([SamplingParams(temperature=1.0, seed=1)] * 2, token_mask_width=2)
    assert (plain.variant, constrained.variant, hot.variant) == ("greedy", "full", "full")
    for meta in (plain, constrained, hot, plain):
        sample(logits, meta, max_logprobs=0)
    assert sample._cache_size() == 2


@pytest.mark.slow
def test_cli_constrains_and_names_a_bad_regex(capsys):
    from jaxserve.cli import main

    common = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--num-pages", "64"]
    assert main(["generate", "A product code:", "--regex", r"[A-Z]{3}-[0-9]{4}", "--max-tokens", "12"] + common) == 0
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}\n", capsys.readouterr().out)
    assert main(["generate", "x", "--regex", "a(b"] + common) == 2
    assert "structured_outputs.regex" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multidevice
def test_tensor_parallel_constrained_equals_one_device(default_loaded, llm):
    prompts = [_chat(llm, p) for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": s}) for s in SCHEMAS[:4]]
    one = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tp = LLM(
        default_loaded,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        num_pages=200,
        tensor_parallel_size=3,
    )  # 9 attention heads, 3 KV heads
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)] == one
