"""The OpenAI-compatible server against the official ``openai`` client, raw HTTP and a schema fuzzer.

One server (the default model's first two layers, small batching settings) is started in-process for the whole
module, on a free loopback port; before it starts, the same engine generates the reference outputs of the
concurrency test offline, so the comparison is against ``LLMEngine`` run directly on the same weights and settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import first_layers

from jaxserve import LLMEngine, SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.launch import ServerThread
from jaxserve.server.metrics import parse_metrics

pytestmark = pytest.mark.slow  # loads the default model

NUM_CONCURRENT = 64
CONCURRENT_MAX_TOKENS = 16
TOPICS = [
    "rivers",
    "cities",
    "light",
    "stone",
    "gardens",
    "music",
    "paper",
    "windows",
    "markets",
    "winter",
    "history",
    "engines",
    "forests",
    "oceans",
]


def _concurrent_prompts() -> list[str]:
    return [f"Write a short note about {TOPICS[i % len(TOPICS)]}, item {i}:" for i in range(NUM_CONCURRENT)]


class Served:
    def __init__(self, thread: ServerThread, app, reference: dict[str, tuple[str, list[int]]]):
        self.thread, self.url, self.app = thread, thread.url, app
        self.state = app.state.server
        self.reference = reference  # prompt -> (text, token ids) generated offline

    @property
    def model(self) -> str:
        return self.state.model_name

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw
        )

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)


@pytest.fixture(scope="module")
def served(default_loaded):
    # The server's contract, not the model's: the default model's first two layers (its tokenizer, chat template and
    # text-like output at a quarter of the cost a token), as the reference below is the same engine offline.
    engine = LLMEngine(first_layers(default_loaded), max_num_seqs=64, max_num_batched_tokens=256, max_model_len=512)
    # Offline reference for the concurrency test: the same engine, before the server owns it.
    params = SamplingParams(temperature=0.0, max_tokens=CONCURRENT_MAX_TOKENS)
    prompts = _concurrent_prompts()
    for i, p in enumerate(prompts):
        engine.add_request(f"ref-{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    reference = {p: (done[f"ref-{i}"].text, done[f"ref-{i}"].token_ids) for i, p in enumerate(prompts)}
    app = build_app(engine, max_waiting=256, shutdown_timeout=5)
    with ServerThread(app) as thread:
        yield Served(thread, app, reference)


def wait_idle(served: Served, timeout: float = 20.0) -> dict:
    """Metrics once no request is running or waiting and no KV page is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = served.metrics()
        idle = (
            m["jaxserve:num_requests_running"] == 0
            and m["jaxserve:num_requests_waiting"] == 0
            and m["jaxserve:kv_cache_used_pages"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------- basics
def test_models_health_version(served):
    assert [m.id for m in served.client().models.list().data] == [served.model]
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/version").json()["version"]
    r = httpx.get(f"{served.url}/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_completion_usage_and_length(served):
    c = served.client()
    r = c.completions.create(model=served.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    n_prompt = len(httpx.post(served.url + "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 8 and r.usage.total_tokens == n_prompt + 8
    assert r.choices[0].text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_equals_non_streamed(served, endpoint):
    c = served.client()
    kw = {"model": served.model, "max_tokens": 24, "temperature": 0}
    if endpoint == "chat":
        kw["messages"] = [{"role": "user", "content": "Name three colors."}]
        whole = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        expected = whole.choices[0].message.content
    else:
        kw["prompt"] = "Once upon a time"
        whole = c.completions.create(**kw)
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expected = whole.choices[0].text
    assert text == expected and text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n2_streamed_and_not(served):
    c = served.client()
    kw = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 12,
        "temperature": 0.9,
        "seed": 7,
        "n": 2,
    }
    whole = c.chat.completions.create(**kw)
    assert sorted(ch.index for ch in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 24 or all(ch.finish_reason for ch in whole.choices)
    texts = {0: "", 1: ""}
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {ch.index: ch.message.content for ch in whole.choices}  # the same seed, the same samples
    r = c.completions.create(model=served.model, prompt=["One", "Two"], n=2, max_tokens=4, temperature=1, seed=1)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]


def test_stop_strings(served):
    c = served.client()
    kw = {"model": served.model, "prompt": "List the numbers: 1, 2, 3,", "max_tokens": 24, "temperature": 0}
    full = c.completions.create(**kw).choices[0].text
    stop = full.strip()[2:5]  # a piece of what greedy decoding writes anyway
    assert stop and stop in full
    r = c.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stop=stop, stream=True, **kw))
    assert streamed == r.choices[0].text
    r = c.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw)
    assert r.choices[0].text == full[: full.index(stop) + len(stop)]


def test_logprobs(served):
    c = served.client()
    r = c.completions.create(model=served.model, prompt="Hello, my name is", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for p, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert p <= 0 and len(top) >= 3 and max(top.values()) == pytest.approx(p)  # greedy picks the top token
    chat = c.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = [
        e
        for ch in c.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        for choice in ch.choices
        if choice.logprobs
        for e in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_echo_with_prompt_logprobs(served):
    c = served.client()
    prompt = "The sky is blue and"
    r = c.completions.create(model=served.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    choice, usage = r.choices[0], r.usage
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(p <= 0 for p in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=served.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == choice.text


def test_sampling_extras_and_seed(served):
    c = served.client()
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6, "ignore_eos": True}
    kw = {
        "model": served.model,
        "prompt": "In the forest",
        "max_tokens": 10,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 1234,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "logit_bias": {"13": -100},
        "extra_body": extra,
    }
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 10
    chat = c.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens <= 3


def test_tokenize_detokenize(served):
    ids = httpx.post(served.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 512
    assert httpx.post(served.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
    msgs = [{"role": "user", "content": "Hi"}]
    chat_ids = httpx.post(served.url + "/tokenize", json={"messages": msgs}).json()
    r = served.client().chat.completions.create(model=served.model, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == chat_ids["count"]


# ---------------------------------------------------------------------------------------------------- bad input
LONG = "word " * 600  # > 512 tokens

BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400),
    ("not an object", "/v1/completions", b"[1, 2]", 400),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
    ("fraction for int", "/v1/completions", {"prompt": "x", "n": 1.5}, 400),
    ("string for int", "/v1/completions", {"prompt": "x", "n": "1"}, 400),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("absurd max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("n zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
    ("too many logprobs", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("token out of vocab", "/v1/completions", {"prompt": [1, 10**7]}, 400),
    ("logit_bias out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400),
    ("min_tokens > max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400),
    ("prompt too long", "/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "word " * 300, "max_tokens": 400}, 400),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    (
        "image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
    ),
    (
        "unknown response format",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        400,
    ),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-1]}, 400),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input(served, name, path, body, status):
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kw = {"json": body}
    r = httpx.post(served.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if name == "prompt too long" or name == "prompt + max_tokens too long":
        assert "512" in err["message"] and re.search(r"\b(6\d\d|7\d\d|30\d)\b", err["message"]), err["message"]


def test_body_limit_method_and_oversize(served):
    r = httpx.post(
        served.url + "/v1/completions",
        content=b"x" * (served.state.max_body_bytes + 1),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(served.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(served):
    served.state.api_key = "sekret"
    try:
        with pytest.raises(openai.AuthenticationError):
            served.client(api_key="wrong").models.list()
        r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert served.client(api_key="sekret").models.list().data
        assert httpx.get(served.url + "/health").status_code == 200  # probes need no key
    finally:
        served.state.api_key = None


def test_overload_answers_503_with_retry_after(served):
    engine = served.state.engine
    engine.max_waiting = 2

    async def burst():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(
                *[client.post("/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 4}) for i in range(24)]
            )

    try:
        responses = asyncio.run(burst())
    finally:
        engine.max_waiting = 256
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert int(busy.headers["retry-after"]) >= 1 and busy.json()["error"]["code"] == "server_busy"
    wait_idle(served)


# ---------------------------------------------------------------------------------------------------- load
def test_64_concurrent_streams_match_offline_and_are_counted(served):
    before = served.metrics()
    prompts = _concurrent_prompts()

    async def one(client: openai.AsyncOpenAI, prompt: str):
        text, usage, reason = "", None, None
        stream = await client.completions.create(
            model=served.model,
            prompt=prompt,
            max_tokens=CONCURRENT_MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for ch in stream:
            for choice in ch.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            usage = ch.usage or usage
        return text, usage, reason

    async def run():
        client = openai.AsyncOpenAI(
            base_url=served.url + "/v1",
            api_key="none",
            max_retries=0,
            timeout=300,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=NUM_CONCURRENT * 2)),
        )
        async with client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    results = asyncio.run(run())
    for prompt, (text, usage, reason) in zip(prompts, results):
        ref_text, ref_ids = served.reference[prompt]
        assert text == ref_text, prompt
        assert usage.completion_tokens == len(ref_ids) and reason in ("stop", "length")
    after = wait_idle(served)
    finished = sum(v - before.get(k, 0) for k, v in after.items() if k.startswith("jaxserve:request_success_total"))
    assert finished == NUM_CONCURRENT
    generated = sum(len(served.reference[p][1]) for p in prompts)
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] == generated
    assert (
        after["jaxserve:time_to_first_token_seconds_count"] - before["jaxserve:time_to_first_token_seconds_count"]
        == NUM_CONCURRENT
    )
    assert after["jaxserve:kv_cache_used_pages"] == 0


def test_disconnect_mid_stream_aborts_and_frees_pages(served):
    before = served.metrics()
    body = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                break  # leaving the block closes the connection mid-stream
    # A non-streaming request whose client gives up (times out) is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    after = wait_idle(served)
    assert after["jaxserve:kv_cache_used_pages"] == 0 and after["jaxserve:num_requests_running"] == 0
    key = "jaxserve:request_success_total|abort"
    aborted = after.get(key, 0) - before.get(key, 0)
    assert aborted == 2
    assert served.state.engine.num_in_flight == 0


def _steps_for(served, monkeypatch, send) -> int:
    """Engine steps taken by the requests ``send()`` makes. The first step waits until all of them are in the
    server, so that separate requests, which reach it one by one, are not spread over extra steps by their arrival
    (the batch, admitted at once, needs no such help)."""
    engine = served.state.engine
    wait_idle(served)
    before = engine.stats["num_steps"]
    gate = threading.Event()
    step = engine.engine.step

    def gated():
        gate.wait(60)
        return step()

    monkeypatch.setattr(engine.engine, "step", gated)
    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 60
    while engine.num_in_flight < NUM_CONCURRENT and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    sender.join(120)
    monkeypatch.undo()
    wait_idle(served)
    return engine.stats["num_steps"] - before


def test_64_prompt_request_takes_the_steps_of_64_requests(served, monkeypatch):
    prompts = _concurrent_prompts()
    body = {"model": served.model, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    results: dict = {}

    def batch():
        results["batch"] = httpx.post(served.url + "/v1/completions", json={**body, "prompt": prompts}, timeout=120)

    async def separate():
        async with httpx.AsyncClient(
            base_url=served.url, timeout=120, limits=httpx.Limits(max_connections=NUM_CONCURRENT)
        ) as client:
            results["separate"] = await asyncio.gather(
                *[client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts]
            )

    batch_steps = _steps_for(served, monkeypatch, batch)
    separate_steps = _steps_for(served, monkeypatch, lambda: asyncio.run(separate()))
    r = results["batch"]
    assert r.status_code == 200 and len(r.json()["choices"]) == NUM_CONCURRENT
    assert all(x.status_code == 200 for x in results["separate"])
    print(f"steps: one 64-prompt request {batch_steps}, 64 requests {separate_steps}")
    # one admission per step took 65 steps here; now both take the prefill's steps plus the decode's
    assert abs(batch_steps - separate_steps) <= 2 and batch_steps < NUM_CONCURRENT // 4, (batch_steps, separate_steps)


def test_failed_device_step_fails_its_request_frees_its_pages_and_serving_goes_on(served, monkeypatch):
    runner = served.state.engine.engine.runner
    launch = runner.launch
    calls = {"n": 0}

    def faulty(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return launch(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", faulty)
    body = {"model": served.model, "prompt": "Tell me about the sea.", "max_tokens": 4, "temperature": 0}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "engine_step_failed", r.text
    assert "RuntimeError: injected device fault" in err["message"]
    after = wait_idle(served)
    assert after["jaxserve:kv_cache_used_pages"] == 0
    bm = served.state.engine.engine.scheduler.block_manager
    assert bm.num_free_pages == bm.num_usable_pages
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(served.url + "/health").status_code == 200


def test_chat_reply_cut_inside_an_emoji_has_no_replacement_char(served):
    first = httpx.post(served.url + "/tokenize", json={"prompt": "😀", "add_special_tokens": False}).json()["tokens"]
    assert len(first) > 1  # the emoji takes several byte-level tokens
    kw = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Smile!"}],
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {str(first[0]): 100},
    }
    c = served.client()
    whole = c.chat.completions.create(**kw)
    assert whole.usage.completion_tokens == 1 and whole.choices[0].finish_reason == "length"
    assert "\ufffd" not in whole.choices[0].message.content
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices
    )
    assert streamed == whole.choices[0].message.content


def test_bench_serve_cli_reports_and_plots(served, tmp_path):
    from jaxserve.cli import build_parser

    png, js = tmp_path / "latency.png", tmp_path / "bench.json"
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--base-url",
            served.url,
            "--num-prompts",
            "6",
            "--request-rate",
            "inf",
            "20",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--plot",
            str(png),
            "--result-json",
            str(js),
        ]
    )
    assert args.func(args) == 0
    results = json.loads(js.read_text())["results"]
    assert [r["completed"] for r in results] == [6, 6] and all(r["output_tokens"] == 48 for r in results)
    for r in results:
        assert 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] and r["tpot_ms"]["mean"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------- fuzz
FUZZ_MAX_TOKENS = 4
FUZZ_EXAMPLES = int(os.environ.get("JAXSERVE_FUZZ_EXAMPLES", 30))  # per operation and mode (more: a deeper local run)


def _cheap(body) -> None:
    """Keeps a generated request cheap, valid values staying valid and invalid ones invalid: at most 4 tokens and 2
    choices. A value past its field's schema maximum is left as it is (a negative case: capping it would make the
    request valid while schemathesis still expects it rejected)."""
    from jaxserve.server.protocol import INT32_MAX, MAX_N

    if not isinstance(body, dict):
        return
    maximum = {
        "max_tokens": None,
        "max_completion_tokens": None,
        "max_output_tokens": None,
        "n": MAX_N,
        "min_tokens": INT32_MAX,
    }
    for key, top in maximum.items():
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 2 < v <= (top or v):
            body[key] = 2 if key == "n" else FUZZ_MAX_TOKENS
    if "input" in body:  # /v1/responses
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = FUZZ_MAX_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = FUZZ_MAX_TOKENS  # null: up to the context length


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_openapi_no_server_errors(served, mode):
    """Schema-derived requests, valid (positive) and not (negative), for every operation in /openapi.json: each
    answer conforms to the schema, schema-invalid data is rejected, and nothing is a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
    statuses: dict[int, int] = {}
    for op in ops:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy(GenerationMode(mode)))
        def check(case):
            _cheap(case.body)
            # Checked: no 5xx, documented status, content type and body (streamed events too), schema-invalid
            # data rejected. Not checked: that every schema-valid body is accepted, since some limits are
            # semantic (prompt + max_tokens within the context, min_tokens <= max_tokens): those are 400s.
            response = case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, response.text

        try:
            check()
        except Unsatisfiable:
            assert mode == "negative"  # an operation without inputs (GET /health) has no invalid requests
    print(f"fuzz {mode}: answers by status {dict(sorted(statuses.items()))}")
    assert statuses and max(statuses) < 500, statuses
    wait_idle(served)
