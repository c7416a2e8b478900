"""OpenAI/vLLM API surface that real clients rely on, against the default model served in-process:

* lm-eval's ``local-completions`` with its tokenizer auto-detected from the server (/tokenizer_info, /tokenize,
  /detokenize), offline: its loglikelihoods and greedy generations against ``LLM.generate`` on the same tokens;
* ``echo`` with ``max_tokens=0``: the prompt's logprobs, against ``LLM.generate``'s ``prompt_logprobs``;
* ``/v1/responses`` through the openai client, whole and streamed;
* request fields the server does not implement (400 naming them) and harmless metadata (accepted).

The reference ``LLM`` (the session's ``default_llm``) is a separate engine on the same weights, so the comparisons
are between two runs of the model, not a path compared with itself. Logprobs agree to ``LOGPROB_TOL`` (two
engines batch differently, so float32 sums may round differently).
"""

from __future__ import annotations

import json

import pytest
from helpers import DEFAULT_ENGINE

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from jaxserve import LLMEngine, SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.launch import ServerThread
from jaxserve.server.protocol import IGNORED_FIELDS

pytestmark = pytest.mark.slow  # loads the default model

LOGPROB_TOL = 1e-4  # absolute, per token logprob (and per summed loglikelihood)
MAX_MODEL_LEN = DEFAULT_ENGINE["max_model_len"]


class Served:
    def __init__(self, thread: ServerThread, app):
        self.url, self.state = thread.url, app.state.server

    @property
    def model(self) -> str:
        return self.state.model_name

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def served(default_loaded):
    engine = LLMEngine(default_loaded, **DEFAULT_ENGINE)  # default_llm's steps, compiled already
    app = build_app(engine, shutdown_timeout=5)
    with ServerThread(app) as thread:
        yield Served(thread, app)


def _prompt_logprobs(llm, ids: list[int], k: int) -> list:
    """``LLM.generate``'s prompt_logprobs of these token ids (one token generated, as the engine needs)."""
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    return out.prompt_logprobs


# ---------------------------------------------------------------------------------------------------- lm-eval
LL_REQUESTS = [
    ("The capital of France is", " Paris"),
    ("Water boils at a temperature of", " 100 degrees Celsius."),
    ("", "Hello world"),
]  # an empty context: lm-eval puts its prefix token (the server's BOS) first


def test_lm_eval_local_completions_offline(served, default_llm, monkeypatch):
    """lm-eval's local-completions, its tokenizer detected as the server's ("remote"): no hub access, and its
    loglikelihoods (echo + logprobs over token ids) and greedy generations equal the LLM's."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=served.url + "/v1/completions",
        model=served.model,
        max_retries=1,
        max_length=MAX_MODEL_LEN,
        timeout=120,
    )
    assert lm.tokenizer_backend == "remote"  # auto-detected through /tokenizer_info and /tokenize
    tok = default_llm.tokenizer
    assert lm.eot_token_id == tok.eos_token_ids[0]
    assert lm.prefix_token_id == tok.bos_token_id

    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(LL_REQUESTS)]
    results = lm.loglikelihood(instances, disable_tqdm=True)
    assert len(results) == len(LL_REQUESTS)
    for (context, continuation), (ll, greedy) in zip(LL_REQUESTS, results):
        # what lm-eval scores: the continuation's tokens after the context's (the BOS for an empty context)
        if context:
            whole = tok.encode(context + continuation, add_special_tokens=False)
            head = len(tok.encode(context, add_special_tokens=False))
        else:
            whole, head = [tok.bos_token_id] + tok.encode(continuation, add_special_tokens=False), 1
        plp = _prompt_logprobs(default_llm, whole, 1)
        scored = [plp[i] for i in range(head, len(whole))]
        ref = sum(e[t].logprob for e, t in zip(scored, whole[head:]))
        ref_greedy = all(e[t].logprob >= max(lp.logprob for lp in e.values()) for e, t in zip(scored, whole[head:]))
        assert ll == pytest.approx(ref, abs=LOGPROB_TOL * len(scored)), (context, continuation)
        assert greedy == ref_greedy, (context, continuation)

    gen = [Instance("generate_until", {}, ("Q: What is two plus two?\nA:", {"until": ["\n"], "max_gen_toks": 8}), 0)]
    (text,) = lm.generate_until(gen, disable_tqdm=True)
    ids = tok.encode("Q: What is two plus two?\nA:", add_special_tokens=False)
    ref = (
        default_llm.generate(
            [ids], SamplingParams(temperature=0.0, max_tokens=8, stop=["\n", tok.eos_token]), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert text == ref


def test_tokenizer_info(served, default_llm):
    """/tokenizer_info has vLLM's shape and the model's template: lm-eval's own jinja rendering of it equals the
    server's chat template rendering (/tokenize of the messages)."""
    pytest.importorskip("lm_eval")
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    info = httpx.get(served.url + "/tokenizer_info", timeout=30).json()
    tok = default_llm.tokenizer
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (tok.bos_token, tok.eos_token)
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["added_tokens_decoder"][str(tok.eos_token_ids[0])]["content"] == tok.eos_token
    assert info["add_bos_token"] == (tok.encode("a")[:1] == [tok.bos_token_id])
    assert check_remote_tokenizer_support(served.url + "/v1/completions")

    remote = RemoteTokenizer(served.url)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    text = remote.apply_chat_template(messages, add_generation_prompt=True)
    ids = served.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert remote.encode(text) == ids
    assert remote.decode(ids) == tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------- echo
ECHO_PROMPT = "The quick brown fox jumps over the lazy dog, then"
ECHO_K = 3


def _check_echo(choice: dict, ids: list[int], plp: list, tok) -> None:
    lp = choice["logprobs"]
    tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert choice["text"] == ECHO_PROMPT and choice["finish_reason"] == "length"
    assert lp["tokens"] == tokens
    assert lp["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert lp["token_logprobs"][i] == pytest.approx(entry[ids[i]].logprob, abs=LOGPROB_TOL)
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:ECHO_K]
        want = {tokens[i]: entry[ids[i]].logprob}  # the chosen token keeps its text; alike ones go by id
        for t, x in top:
            if t != ids[i]:
                text = tok.decode([t], skip_special_tokens=False)
                want[f"token_id:{t}" if text in want else text] = x.logprob
        got = lp["top_logprobs"][i]
        assert set(got) == set(want), i
        assert all(got[s] == pytest.approx(want[s], abs=LOGPROB_TOL) for s in want), i


def test_echo_max_tokens_zero(served, default_llm):
    """echo + max_tokens=0: the prompt alone, its logprobs equal to LLM.generate's prompt_logprobs, no token
    generated (whole and streamed); max_tokens=0 without echo is a 400."""
    tok = default_llm.tokenizer
    ids = tok.encode(ECHO_PROMPT)
    plp = _prompt_logprobs(default_llm, ids, ECHO_K)
    body = {"model": served.model, "prompt": ECHO_PROMPT, "max_tokens": 0, "echo": True, "logprobs": ECHO_K}

    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    _check_echo(out["choices"][0], ids, plp, tok)

    streamed = openai.OpenAI(base_url=served.url + "/v1", api_key="none").completions.create(**body, stream=True)
    chunks = [c.choices[0].model_dump() for c in streamed if c.choices]
    assert len(chunks) == 1  # the prompt, finished at once
    _check_echo(chunks[0], ids, plp, tok)

    r = served.post("/v1/completions", {**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------------------------------------------- responses
QUESTION = "What is the capital of France? Answer in one short sentence."
INSTRUCTIONS = "You are a concise assistant."
RESPONSE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]


def test_responses_plain_and_streamed(served, default_llm):
    """/v1/responses: output_text equals the chat endpoint's and LLM.chat's answer to the same conversation;
    input as text parts answers the same; the stream's deltas join to the same text, in OpenAI's event order."""
    client = served.client()
    kw = {"model": served.model, "instructions": INSTRUCTIONS, "max_output_tokens": 48, "temperature": 0}
    r = client.responses.create(input=QUESTION, **kw)
    assert r.object == "response" and r.status == "completed" and r.output_text
    msg = r.output[0]
    assert (msg.type, msg.role, msg.status, msg.content[0].type) == ("message", "assistant", "completed", "output_text")
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    ref = default_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=48))[0]
    assert r.output_text == ref.outputs[0].text
    assert r.usage.input_tokens == len(ref.prompt_token_ids)
    assert r.usage.output_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    chat = client.chat.completions.create(model=served.model, messages=messages, max_tokens=48, temperature=0)
    assert chat.choices[0].message.content == r.output_text

    parts = client.responses.create(
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}], **kw
    )
    assert parts.output_text == r.output_text

    events = list(client.responses.create(input=QUESTION, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == RESPONSE_EVENTS
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    joined = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert joined == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens

    with client.responses.stream(input=QUESTION, **kw) as stream:  # the client's helper
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_responses_cut_and_refused(served):
    """An answer cut by max_output_tokens is ``incomplete`` (and its stream ends in response.incomplete);
    fields of the Responses API not implemented are 400s naming them."""
    client = served.client()
    kw = {
        "model": served.model,
        "input": "Tell me a long story about the sea.",
        "max_output_tokens": 3,
        "temperature": 0,
    }
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text

    for field, value in [
        ("previous_response_id", "resp_123"),
        ("background", True),
        ("reasoning", {"effort": "low"}),
        ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
        ("n", 2),
        ("include", ["message.output_text.logprobs"]),
    ]:
        r = served.post("/v1/responses", {"input": "Hi", "max_output_tokens": 2, field: value})
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "not supported" in err["message"], err


def test_responses_text_format_json_schema(served):
    """``text.format`` json_schema through the openai client: the answer validates with jsonschema; a bad schema
    is a 400 naming text.format.schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    client = served.client()
    for temperature in (0.0, 1.0):
        r = client.responses.create(
            model=served.model,
            input="The largest city in Japan, as JSON.",
            max_output_tokens=60,
            temperature=temperature,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        )
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
    obj = client.responses.create(
        model=served.model,
        input="A person's name and age as a JSON object.",
        max_output_tokens=120,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert obj.status == "completed", obj.output_text
    assert isinstance(json.loads(obj.output_text), dict)
    bad = served.post(
        "/v1/responses",
        {
            "input": "Hi",
            "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text


# ---------------------------------------------------------------------------------------------------- constraints
def test_grammars_past_llguidance_limits_are_a_400_naming_the_size_limit(served):
    """A choice of 10,000 items and the regex ``a{1000000}`` outgrow llguidance's limits (items in a parser row,
    the lexer's budget): the 400 says the grammar is too large, not that the vocabulary lacks tokens."""
    body = {"model": served.model, "prompt": "Hi", "max_tokens": 4}
    for constraint in ({"choice": [f"item{i}" for i in range(10_000)]}, {"regex": "a{1000000}"}):
        r = served.post("/v1/completions", {**body, "structured_outputs": constraint})
        assert r.status_code == 400, (list(constraint), r.text[:300])
        message = r.json()["error"]["message"]
        assert "too large" in message and "limit" in message and "vocabulary" not in message, message
        assert r.json()["error"]["param"].startswith("structured_outputs")


SELF_REFS = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
]


def test_a_schema_whose_ref_refers_to_itself_is_a_400(served):
    """A ``$ref`` that only points back to itself admits no JSON value (it used to be served as empty content with
    finish ``stop``): 400 naming the $ref, in the field the schema came in."""
    for schema in SELF_REFS:
        body = {
            "model": served.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
        r = served.post("/v1/chat/completions", body)
        assert r.status_code == 400, (schema, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema.schema", error
        assert "$ref" in error["message"] and "itself" in error["message"], error


# ---------------------------------------------------------------------------------------------------- fields
def test_unimplemented_fields_are_refused(served):
    """A field that would change the output and is not implemented: 400 naming it (nested ones by their path),
    through raw HTTP and the openai client alike."""
    chat = {"model": served.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "suffix": " end"}, "suffix"),
        ("/v1/chat/completions", {**chat, "modalities": ["text", "audio"]}, "modalities"),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "Hi", "audio": {"id": "a"}}]},
            "messages.0.audio",
        ),
        (
            "/v1/chat/completions",
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
                    }
                ],
            },
            "messages.0.content.0.cache_control",
        ),
        (
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"chunk_size": 4}},
            "stream_options.chunk_size",
        ),
        ("/tokenize", {"prompt": "Hi", "return_token_strs": True}, "return_token_strs"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "Hi"}], "mm_processor_kwargs": {"a": 1}},
            "mm_processor_kwargs",
        ),
    ]
    for path, body, param in cases:
        r = served.post(path, body)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "not supported" in err["message"] and param in err["message"], err

    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(
            model=served.model, prompt="Hi", max_tokens=2, extra_body={"use_beam_search": True}
        )
    assert e.value.param == "use_beam_search"


def test_metadata_and_unset_fields_are_accepted(served):
    """The IGNORED_FIELDS (any value) and unknown fields set to null/[]/{} change nothing: the same greedy answer
    as without them."""
    base = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    plain = served.post("/v1/chat/completions", base)
    assert plain.status_code == 200, plain.text
    metadata = {
        "user": "u-1",
        "metadata": {"run": "a"},
        "store": True,
        "service_tier": "auto",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "parallel_tool_calls": False,
    }
    assert set(metadata) == set(IGNORED_FIELDS)
    unset = {"audio": None, "prediction": {}, "web_search_options": None, "modalities": []}
    nested = [{"role": "user", "content": "Name a color.", "refusal": None, "annotations": []}]
    for extra in (metadata, unset, {"messages": nested}):
        r = served.post("/v1/chat/completions", {**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]

    body = {"model": served.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0, **metadata}
    assert served.post("/v1/completions", body).status_code == 200
    r = served.post("/v1/responses", {"model": served.model, "input": "Hi", "max_output_tokens": 2, **metadata})
    assert r.status_code == 200, r.text
    r = served.post(
        "/v1/chat/completions",
        {**base, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    usage = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]["usage"]
    assert usage["completion_tokens"] == plain.json()["usage"]["completion_tokens"]
