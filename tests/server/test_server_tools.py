"""Structured outputs and tool calling in the OpenAI-compatible server.

The tool-call parsers, grammars and the chat rendering of tools are tested on hand-written texts and the default
model's tokenizer. The server tests (marked slow) start one in-process server on the default model for the module
and check every answer against the request's JSON schema with ``jsonschema`` (not against our own outputs), through
the official ``openai`` client, raw HTTP, langchain and litellm.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import DEFAULT_ENGINE

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pydantic = pytest.importorskip("pydantic")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from jaxserve.server.tools import (  # noqa: E402
    PARSERS,
    ArgsDelta,
    CallStart,
    ContentDelta,
    get_parser,
    parser_for_template,
    tool_call_grammar,
)

slow = pytest.mark.slow  # the server tests load the default model

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now in a time zone", "parameters": TIME_PARAMS},
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


# ---------------------------------------------------------------------------------------------------- parsers
def _run(parser: str, text: str, sizes=None, seed: int = 0) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], events) of ``text`` fed in pieces of the given sizes (None: whole)."""
    p = get_parser(parser)
    events, i, rng = [], 0, random.Random(seed)
    while i < len(text):
        k = len(text) if sizes is None else rng.choice(sizes)
        events += p.feed(text[i : i + k])
        i += k
    events += p.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in calls and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ArgsDelta):
            calls[e.index][1] += e.text  # a call's arguments never come before its start
    return content, [tuple(v) for _, v in sorted(calls.items())], events


PARSE_CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n'
        "</tool_call>\n",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {"q": "a \\"}\\" b", "n": [1, {"x": null}]}, "name": "search"}</tool_call>',
        None,
        [("search", {"q": 'a "}" b', "n": [1, {"x": None}]})],
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("f", {"x": 1})]),
    ("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {})]),
    (
        "hermes",
        "Plain text with a < sign and <tool but no call.\n",
        "Plain text with a < sign and <tool but no call.\n",
        [],
    ),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"x": 1',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1',
        [],
    ),  # cut off: the whole text is content
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
        None,
        [("get_weather", {"city": "Oslo", "unit": "celsius"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1, 2]}}',
        None,
        [("a", {}), ("b", {"k": [1, 2]})],
    ),
    ("llama3_json", '{"answer": 42, "name": {"first": "x"}}', '{"answer": 42, "name": {"first": "x"}}', []),
    (
        "llama3_json",
        'The call would be {"name": "a", "parameters": {}}',
        'The call would be {"name": "a", "parameters": {}}',
        [],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        "Sure.",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "unit": "celsius"}',
        None,
        [("get_weather", {"city": "Rome", "unit": "celsius"})],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {"list": [1, "]"]}}', None, [("a", {"list": [1, "]"]})]),
    ("mistral", "[TOOLS] is not a call marker", "[TOOLS] is not a call marker", []),
]


@pytest.mark.parametrize("parser,text,content,calls", PARSE_CASES)
def test_parse_whole_output(parser, text, content, calls):
    out = get_parser(parser).parse(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert all(c.id.startswith("call_") for c in out.calls) and len({c.id for c in out.calls}) == len(out.calls)


@pytest.mark.parametrize("parser,text,content,calls", [c for c in PARSE_CASES if c[3]])
@pytest.mark.parametrize("sizes", [(1,), (1, 2, 3, 5, 8)], ids=["by-char", "random-pieces"])
def test_streamed_parse_equals_whole(parser, text, content, calls, sizes):
    whole_content, whole_calls, _ = _run(parser, text)
    for seed in range(3):
        got_content, got_calls, events = _run(parser, text, sizes, seed)
        assert (got_content, got_calls) == (whole_content, whole_calls)
    assert got_content == (content or "")
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


def test_streamed_arguments_come_while_they_are_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    p = get_parser("hermes")
    seen = []  # (characters fed, event)
    for i, ch in enumerate(text):
        seen += [(i, e) for e in p.feed(ch)]
    seen += [(len(text), e) for e in p.finish()]
    start = next(i for i, e in seen if isinstance(e, CallStart))
    args = [(i, e.text) for i, e in seen if isinstance(e, ArgsDelta)]
    assert start == text.index('"get_weather"') + len('"get_weather"') - 1  # announced as soon as the name closes
    assert len(args) > 10 and args[0][0] < text.index("Paris")  # piece by piece, before the object is done
    assert "".join(a for _, a in args) == '{"city": "Paris", "unit": "celsius"}'
    assert not any(isinstance(e, ContentDelta) for _, e in seen)  # no markup leaks as content


def test_content_around_calls_is_streamed_without_markup():
    text = "Checking the weather now.\n<tool_call>\n" + '{"name": "a", "arguments": {}}' + "\n</tool_call>\n"
    content, calls, events = _run("hermes", text, (1,))
    assert content == "Checking the weather now." and calls == [("a", "{}")]
    partial = get_parser("hermes")
    got = "".join(e.text for e in partial.feed("Checking the weather now.\n<tool") if isinstance(e, ContentDelta))
    assert got == "Checking the weather now."  # the possible start of a marker (and the newline) wait


def test_parser_for_template():
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{% if message.role == 'ipython' %}") == "llama3_json"
    assert parser_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_for_template("{{ messages }}") == "hermes" and parser_for_template(None) == "hermes"


# ---------------------------------------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from jaxserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    llg = pytest.importorskip("llguidance")
    return llg.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids))


def _accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    import llguidance as llg

    m = llg.LLMatcher(ll_tokenizer, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_tool_call_grammar_admits_valid_calls_in_the_parsers_format(parser, tokenizer, ll_tokenizer):
    fmt = PARSERS[parser]()
    fns = [WEATHER["function"], TIME["function"]]
    one = tool_call_grammar(parser, fns, 1)
    good = fmt.format_call("get_weather", {"city": "Paris", "unit": "celsius"})
    assert _accepts(ll_tokenizer, tokenizer, one, good)
    parsed = get_parser(parser).parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    for bad in (
        fmt.format_call("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
        fmt.format_call("get_weather", {"city": "Paris"}),  # a required argument missing
        fmt.format_call("delete_all", {}),
    ):  # not an allowed function
        assert not _accepts(ll_tokenizer, tokenizer, one, bad)
    sep = {"hermes": "\n", "llama3_json": "; ", "mistral": None}[parser]
    if sep is not None:  # two calls: only when more than one is allowed
        two = good + sep + fmt.format_call("get_time", {"timezone": "UTC"})
        assert not _accepts(ll_tokenizer, tokenizer, one, two)
        assert _accepts(ll_tokenizer, tokenizer, tool_call_grammar(parser, fns, 4), two)
        assert [c.name for c in get_parser(parser).parse(two).calls] == ["get_weather", "get_time"]


def test_tool_call_grammar_keeps_refs_of_the_parameters(tokenizer, ll_tokenizer):
    params = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}},
        "required": ["items"],
        "$defs": {"Item": {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}},
    }
    g = tool_call_grammar("hermes", [{"name": "order", "parameters": params}], 1)
    fmt = PARSERS["hermes"]()
    assert _accepts(ll_tokenizer, tokenizer, g, fmt.format_call("order", {"items": [{"q": 1}, {"q": 2}]}))
    assert not _accepts(ll_tokenizer, tokenizer, g, fmt.format_call("order", {"items": [{"q": "one"}]}))


# ---------------------------------------------------------------------------------------------------- rendering
REPLAY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "content": "18 degrees, sunny", "tool_call_id": "call_1"},
]


def _render(tokenizer, messages, tools=None, template=None):
    from jaxserve.server.chat import _message
    from jaxserve.server.chat import _render as render
    from jaxserve.server.protocol import ChatMessage

    if template is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = template
    return render(tokenizer, [_message(ChatMessage.model_validate(m)) for m in messages], True, {}, tools, "hermes")


def test_tools_and_replayed_calls_render_in_the_default_template(tokenizer):
    """SmolLM2's template knows neither tools nor tool calls: the tools go to a system prompt, the replayed call
    into the assistant's turn as text, the tool's result stays a tool turn."""
    with pytest.raises(Exception):  # noqa: B017 - what the template does with the raw messages (content None)
        tokenizer.apply_chat_template(REPLAY)
    text = _render(tokenizer, REPLAY, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text.split("\n</tools>")[0]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_templates_that_render_tool_calls_get_their_arguments_as_objects(tokenizer):
    template = (
        "{% if tools %}[tools]{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
    )
    text = _render(tokenizer, REPLAY, tools=[WEATHER], template=template)
    assert text.startswith("[tools] get_weather[user]") and "CALL get_weather city=Paris" in text
    assert "<tool_call>" not in text and "[tool] 18 degrees, sunny" in text


def test_templates_that_refuse_the_tool_role_get_results_as_text(tokenizer):
    template = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
        "[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    text = _render(tokenizer, REPLAY, template=template)
    assert "[user] <tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '[assistant] <tool_call>\n{"name": "get_weather"' in text


# ---------------------------------------------------------------------------------------------------- the server
class Served:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": self.model, **body}, timeout=300)


@pytest.fixture(scope="module")
def served(default_loaded):
    from jaxserve import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import ServerThread

    engine = LLMEngine(default_loaded, **DEFAULT_ENGINE)  # default_llm's steps, compiled already
    app = build_app(engine, shutdown_timeout=5)
    with ServerThread(app) as thread:
        yield Served(thread.url, app.state.server.model_name)


def _parallel(fn, args: list) -> list:
    with ThreadPoolExecutor(len(args)) as pool:  # at once, so the engine batches them
        return list(pool.map(fn, args))


def _valid(instance, schema) -> None:
    jsonschema.validators.validator_for(schema)(schema, format_checker=None).validate(instance)


JSON_SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "maxLength": 8},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                            },
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            },
            "status": {"enum": ["open", "shipped", "closed"]},
        },
        "required": ["order", "status"],
        "additionalProperties": False,
    },
    "reading": {
        "type": "object",
        "properties": {
            "celsius": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
            "raining": {"type": "boolean"},
        },
        "required": ["celsius", "humidity", "raining"],
        "additionalProperties": False,
    },
    "tagged": {
        "type": "object",
        "properties": {
            "level": {"type": "integer", "enum": [1, 2, 3]},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["red", "green", "blue"]}},
            "note": {"type": ["string", "null"], "maxLength": 16},
        },
        "required": ["level"],
        "additionalProperties": False,
    },
}


@slow
def test_json_schemas_hold_at_temperatures_0_and_1(served):
    c = served.client()

    def ask(job):
        name, temperature = job
        r = c.chat.completions.create(
            model=served.model,
            temperature=temperature,
            seed=7,
            max_tokens=160,
            messages=[{"role": "user", "content": f"Give an example {name} record as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": JSON_SCHEMAS[name], "strict": True},
            },
        )
        return name, temperature, r.choices[0]

    for name, temperature, choice in _parallel(ask, [(n, t) for n in JSON_SCHEMAS for t in (0.0, 1.0)]):
        assert choice.finish_reason == "stop", (name, temperature, choice.message.content)
        _valid(json.loads(choice.message.content), JSON_SCHEMAS[name])


@slow
def test_ten_more_schemas_through_the_openai_client(served):
    """The ten schemas the engine-level tests use (tests/sampling/test_structured.py), each with its prompt, through
    /v1/chat/completions at temperatures 0 and 1: every answer parses and validates."""
    from test_structured import PROMPTS
    from test_structured import SCHEMAS as ENGINE_SCHEMAS

    c = served.client()

    def ask(job):
        i, temperature = job
        r = c.chat.completions.create(
            model=served.model,
            temperature=temperature,
            seed=i,
            max_tokens=160,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema{i}", "schema": ENGINE_SCHEMAS[i], "strict": True},
            },
        )
        return i, temperature, r.choices[0]

    jobs = [(i, t) for i in range(len(ENGINE_SCHEMAS)) for t in (0.0, 1.0)]
    for i, temperature, choice in _parallel(ask, jobs):
        assert choice.finish_reason == "stop", (i, temperature, choice.message.content)
        _valid(json.loads(choice.message.content), ENGINE_SCHEMAS[i])


@slow
def test_regex_and_choice_hold_on_64_samples(served):
    c = served.client()
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{3}"
    options = ["red", "green", "light blue"]
    texts, picks = [], []
    for seed in range(4):  # n is at most 16 per request
        r = c.completions.create(
            model=served.model,
            prompt="A product code:",
            temperature=1.0,
            seed=seed,
            n=16,
            max_tokens=24,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        texts += [ch.text for ch in r.choices]
        r = c.chat.completions.create(
            model=served.model,
            temperature=1.0,
            seed=seed,
            n=16,
            max_tokens=10,
            messages=[{"role": "user", "content": "Name a color."}],
            extra_body={"structured_outputs": {"choice": options}},
        )
        picks += [ch.message.content for ch in r.choices]
    assert len(texts) == len(picks) == 64
    assert all(re.fullmatch(pattern, t) for t in texts), [t for t in texts if not re.fullmatch(pattern, t)]
    assert all(p in options for p in picks), picks


@slow
def test_json_object_and_streamed_json_schema(served):
    c = served.client()
    r = c.chat.completions.create(
        model=served.model,
        temperature=0,
        max_tokens=120,
        messages=[{"role": "user", "content": 'Answer in JSON: {"capital of France": ...}'}],
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = JSON_SCHEMAS["person"]
    chunks = list(
        c.chat.completions.create(
            model=served.model,
            temperature=1.0,
            seed=3,
            max_tokens=120,
            stream=True,
            messages=[{"role": "user", "content": "A person, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
    )
    _valid(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), schema)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12, description="first name")
    age: int = Field(ge=0, le=120)


@slow
def test_openai_parse_returns_the_pydantic_object(served):
    c = served.client()
    parse = c.chat.completions.parse if hasattr(c.chat.completions, "parse") else c.beta.chat.completions.parse
    r = parse(
        model=served.model,
        temperature=0,
        max_tokens=80,
        response_format=Person,
        messages=[{"role": "user", "content": "Invent a person."}],
    )
    assert isinstance(r.choices[0].message.parsed, Person)


@slow
def test_regex_choice_and_legacy_guided_fields(served):
    c = served.client()
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    r = c.completions.create(
        model=served.model,
        prompt="A name and an age:",
        temperature=1.0,
        seed=1,
        max_tokens=30,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    options = ["yes", "no", "maybe"]
    r = c.chat.completions.create(
        model=served.model,
        temperature=1.0,
        seed=2,
        max_tokens=10,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        extra_body={"structured_outputs": {"choice": options}},
    )
    assert r.choices[0].message.content in options
    r = c.completions.create(
        model=served.model,
        prompt="Pick a color:",
        temperature=1.0,
        seed=3,
        max_tokens=10,
        extra_body={"guided_choice": ["red", "green"], "guided_decoding_backend": "llguidance"},
    )
    assert r.choices[0].text in ("red", "green")
    r = c.completions.create(
        model=served.model,
        prompt="A year:",
        temperature=1.0,
        seed=4,
        max_tokens=10,
        extra_body={"guided_regex": "(19|20)[0-9]{2}"},
    )
    assert re.fullmatch("(19|20)[0-9]{2}", r.choices[0].text)
    r = c.completions.create(
        model=served.model,
        prompt="Answer:",
        temperature=0,
        max_tokens=10,
        extra_body={"guided_grammar": 'root ::= "A" | "B"'},
    )
    assert r.choices[0].text in ("A", "B")


def _stream_calls(chunks) -> tuple[str, dict[int, dict], str | None]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) of a streamed chat answer, checking the
    stream's shape: a call's first delta carries id, type and name; later ones only arguments."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and not (tc.function and tc.function.name)
            calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_calls_are_valid(served, stream):
    c = served.client()
    cases = [
        ("required", True, None),
        ("required", False, None),
        ({"type": "function", "function": {"name": "get_time"}}, True, "get_time"),
    ]

    def ask(case):
        choice, parallel, named = case
        kw = dict(
            model=served.model,
            temperature=1.0,
            seed=11,
            max_tokens=200,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=parallel,
            messages=[{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}],
        )
        if not stream:
            r = c.chat.completions.create(**kw).choices[0]
            calls = [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for t in r.message.tool_calls or []
            ]
            assert all(t.type == "function" for t in r.message.tool_calls or [])
            return case, r.message.content, calls, r.finish_reason
        content, calls, finish = _stream_calls(c.chat.completions.create(stream=True, **kw))
        return case, content or None, [calls[i] for i in sorted(calls)], finish

    for (choice, parallel, named), content, calls, finish in _parallel(ask, cases):
        assert finish == "tool_calls" and calls, (choice, content)
        assert not content  # the answer is only the calls: no markup as content
        if named or not parallel:
            assert len(calls) == 1
        for call in calls:
            assert call["id"].startswith("call_")
            assert call["name"] == named if named else call["name"] in SCHEMAS
            _valid(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_reads_the_calls_the_model_writes(served, stream):
    """With tool_choice auto the model's own text is parsed; here a choice constraint makes it write a call in the
    Hermes format (the default template's), after a sentence."""
    written = (
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>'
    )
    kw = dict(
        model=served.model,
        temperature=0,
        max_tokens=80,
        tools=[WEATHER],
        tool_choice="auto",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"structured_outputs": {"choice": [written]}},
    )
    c = served.client()
    if stream:
        content, calls, finish = _stream_calls(c.chat.completions.create(stream=True, **kw))
        calls = [calls[i] for i in sorted(calls)]
    else:
        r = c.chat.completions.create(**kw).choices[0]
        content, finish = r.message.content, r.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in r.message.tool_calls]
    assert content == "Let me look that up." and finish == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    kw["tool_choice"] = "none"  # not offered: the same text is content
    r = c.chat.completions.create(**kw).choices[0]
    assert r.message.content == written and not r.message.tool_calls and r.finish_reason == "stop"


@slow
def test_legacy_functions_and_tool_call_replay(served):
    r = served.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "temperature": 0,
            "max_tokens": 100,
            "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"},
        },
    ).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather"
    _valid(json.loads(call["arguments"]), WEATHER_PARAMS)
    # the second turn, as clients send it: the assistant's calls with null content, then the tool's result
    r = served.post(
        "/v1/chat/completions", {"messages": REPLAY, "tools": [WEATHER], "temperature": 0, "max_tokens": 12}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@slow
@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": 5}}}}, "guided_json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_choice": ["yes", "x\U000a87a0"]}, "guided_choice"),  # no token of this vocabulary starts with 0xF2
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"function_call": {"name": ""}}, "function_call"),  # a named (if empty) function and no functions
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [WEATHER], "functions": [TIME["function"]]}, "functions"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_bad_constraints_and_tool_choices_are_400_naming_the_field(served, body, param):
    r = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param != "structured_outputs":
        assert param.split(".")[-1] in err["message"], err


@slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_vocabulary_cannot_follow_is_a_400_and_the_server_serves_on(served, stream):
    """A regex forcing a character no token spells (found mid-generation, not at compile time): the request fails
    with a 400 naming structured_outputs (not a 500), streamed or not, and the next request is served."""
    body = {"prompt": "hi", "max_tokens": 8, "stream": stream, "structured_outputs": {"regex": "ab\U000a87a0c"}}
    r = served.post("/v1/completions", body)
    if stream:
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        err = events[-1]["error"]
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    assert "structured_outputs.regex" in err["message"] and "vocabulary" in err["message"], err
    r = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"regex": "ab+"}})
    assert r.status_code == 200 and re.fullmatch("ab+", r.json()["choices"][0]["text"]), r.text


@slow
def test_completions_and_chat_name_a_bad_type_or_schema(served):
    for path, extra in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = served.post(path, {**extra, "max_tokens": 4, "response_format": {"type": "yaml"}})
        assert r.status_code == 400 and "response_format.type" in r.json()["error"]["message"], r.text
        r = served.post(path, {**extra, "max_tokens": 4, "guided_json": {"type": "object", "required": "a"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text


# ---------------------------------------------------------------------------------------------------- frameworks
@pytest.fixture(scope="module")
def chat_model(served):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        base_url=served.url + "/v1",
        api_key="x",
        model=served.model,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=300,
    )


@slow
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(chat_model, method):
    prompt = (
        'Invent a person. Answer with a JSON object with the keys "name" (a first name) and "age" (a number), '
        'for example {"name": "Ann", "age": 31}.'
    )
    out = chat_model.with_structured_output(Person, method=method).invoke(prompt)
    assert isinstance(out, Person)


@slow
def test_langchain_tool_loop(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is 18 degrees and sunny in {city}."

    messages = [HumanMessage("What is the weather in Paris?")]
    ai = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"] and isinstance(ai.tool_calls[0]["args"]["city"], str)
    streamed = None
    for chunk in chat_model.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).stream(
        messages
    ):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    assert isinstance(streamed.tool_calls[0]["args"]["city"], str)
    messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = chat_model.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(final.content, str) and final.content.strip() and not final.tool_calls


@slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models warn as they are built
def test_litellm_response_format(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(
        model=f"openai/{served.model}",
        api_base=served.url + "/v1",
        api_key="x",
        temperature=0,
        max_tokens=80,
        response_format=Person,
        messages=[{"role": "user", "content": "Invent a person."}],
    )
    Person.model_validate_json(r.choices[0].message.content)
