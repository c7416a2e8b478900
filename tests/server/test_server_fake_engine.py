"""The server's failure paths over a fake engine (no model, no jax): an engine that dies, a drain that aborts,
the admission limit, and the schema's token-id bounds. Fast: these run in every test pass."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from helpers import CharTokenizer, SchedulerEngine

from jaxserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.server.app import below_pattern, build_app
from jaxserve.server.metrics import parse_metrics
from jaxserve.server.params import completion_logprobs

VOCAB = 1000


class FakeEngine:
    """Generates token ``7`` forever (until max_tokens) for each request; ``fail_at_step`` makes a step raise."""

    def __init__(self, fail_at_step: int | None = None, step_s: float = 0.002, silent_steps: int = 0):
        self.model_name = "fake"
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.scheduler_config = SimpleNamespace(max_model_len=256)
        self.tokenizer = CharTokenizer()
        self.fail_at_step, self.step_s, self.silent_steps = fail_at_step, step_s, silent_steps
        self.requests: dict[str, tuple[list[int], object, list[int]]] = {}
        self.steps = 0

    def add_request(self, rid, prompt, params, priority=0):
        if rid in self.requests:
            raise ValueError("duplicate")
        self.requests[rid] = (list(prompt), params, [])

    def abort_request(self, rid):
        return self.requests.pop(rid, None) is not None

    def has_unfinished_requests(self):
        return bool(self.requests)

    def get_stats(self):
        return {"num_running": len(self.requests), "num_waiting": 0, "num_used_pages": len(self.requests)}

    def step(self):
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device lost")
        time.sleep(self.step_s)
        if self.steps <= self.silent_steps:  # a long prefill: no token yet
            return []
        outs = []
        for rid, (prompt, params, toks) in list(self.requests.items()):
            toks.append(7)
            done = len(toks) >= params.max_tokens
            comp = CompletionOutput(0, " t7" * len(toks), list(toks), None, None, "length" if done else None)
            outs.append(RequestOutput(rid, None, prompt, [comp], done))
            if done:
                del self.requests[rid]
        return outs


def _events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_fake_engine_serves():
    with TestClient(build_app(FakeEngine())) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t7 t7 t7"
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
            events = _events(r)
        assert (
            events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == " t7 t7 t7"
        )


def test_engine_death_answers_503_not_a_hang():
    with TestClient(build_app(FakeEngine(fail_at_step=5))) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True}) as r:
            events = _events(r)
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])  # the stream says why it ended
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead" and "retry-after" in r.headers
        assert client.get("/health").status_code == 503


def test_drain_aborts_running_streams_and_refuses_new_requests():
    app = build_app(FakeEngine(step_s=0.01))
    with TestClient(app) as client:
        engine = app.state.server.engine
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 10_000 // 100, "stream": True}
        ) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            engine.begin_drain(0.0)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        assert client.get("/health").status_code == 503
        assert engine.num_in_flight == 0 and not app.state.server.engine.engine.requests


def test_drain_before_the_first_token_still_ends_every_choice():
    app = build_app(FakeEngine(step_s=0.01, silent_steps=10**6))
    with TestClient(app) as client:
        body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the role chunks come first
            app.state.server.engine.begin_drain(0.0)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        finals = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
        assert sorted((c["index"], c["finish_reason"]) for c in finals if c["finish_reason"]) == [
            (0, "abort"),
            (1, "abort"),
        ]
        assert events[-1] == "[DONE]"


def test_admission_limit_counts_waiting_requests():
    app = build_app(FakeEngine(), max_waiting=0)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert "jaxserve:request_rejected_total" in client.get("/metrics").text


def test_every_turned_away_request_is_counted_by_status():
    """``jaxserve:request_rejected_total`` counts each request answered with a refusal, by status, wherever it was
    refused: the API key and body-size guard, body validation, the handlers' checks, admission (503)."""
    app = build_app(FakeEngine(), api_key="k", max_body_bytes=2000, max_waiting=0)
    auth = {"Authorization": "Bearer k"}
    chat = {"messages": [{"role": "user", "content": "x"}]}
    with TestClient(app) as client:
        before = parse_metrics(client.get("/metrics").text)
        answers = [
            client.post("/v1/completions", json={"prompt": "hi"}),  # no key: 401
            client.post("/v1/completions", headers=auth, json={"prompt": "x" * 3000}),  # 413
            client.post("/v1/completions", headers={**auth, "Content-Type": "application/json"}, content=b"{"),  # 400
            client.post("/v1/completions", headers=auth, json={"prompt": "hi", "frobnicate": 1}),  # unknown field
            client.post("/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": 10_000}),  # context
            client.post("/v1/completions", headers=auth, json={"prompt": "hi", "model": "other"}),  # 404
            client.post("/v1/chat/completions", headers=auth, json=chat),  # max_waiting=0: 503
            client.post("/tokenize", headers=auth, json={"prompt": "hi"}),  # served: 200
            client.get("/v1/models", headers=auth),  # 200
        ]
        after = parse_metrics(client.get("/metrics").text)
    statuses = [r.status_code for r in answers]
    assert statuses == [401, 413, 400, 400, 400, 404, 503, 200, 200]
    counted = {
        int(k.split("|")[1]): v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("jaxserve:request_rejected_total|")
    }
    assert {s: n for s, n in counted.items() if n} == {401: 1, 413: 1, 400: 3, 404: 1, 503: 1}


def test_vllm_metric_names_move_with_the_engine():
    """Routers written for vLLM read its names: each moves with the engine's real scheduler and page pool (8 pages
    of 4 tokens here, so two requests of 24 tokens preempt one another), with the value of its jaxserve twin."""
    engine = SchedulerEngine(num_pages=9, page_size=4, step_s=0.01)
    with TestClient(build_app(engine)) as client:

        def scrape():
            text = client.get("/metrics").text
            return parse_metrics(text, "vllm"), parse_metrics(text)

        text = client.get("/metrics").text
        for name in ("num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total", "num_preemptions_total"):
            labels = re.search(rf"^vllm:{name}{{(.*)}} 0\.0$", text, re.M).group(1)
            assert sorted(labels.split(",")) == ['engine="0"', 'model_name="fake-scheduler"'], name
        info = re.search(r"^vllm:cache_config_info{(.*)} 1\.0$", text, re.M).group(1).split(",")
        assert {'block_size="4"', 'num_gpu_blocks="8"', 'enable_prefix_caching="True"', 'engine="0"'} <= set(info)
        before, _ = scrape()
        assert [before[f"vllm:request_success_total|{r}"] for r in ("abort", "error", "length", "stop")] == [0] * 4

        body = {"prompt": "abcdefghij", "max_tokens": 20, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            mid, mid_ours = scrape()  # the request is decoding
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert mid["vllm:num_requests_running"] == 1 and mid["vllm:num_requests_waiting"] == 0
        assert 0 < mid["vllm:kv_cache_usage_perc"] == mid_ours["jaxserve:kv_cache_usage_perc"]
        assert mid["vllm:gpu_cache_usage_perc"] == mid["vllm:kv_cache_usage_perc"]
        client.post("/v1/completions", json={"prompt": "abcdefghij", "max_tokens": 12})  # its two full pages hit
        client.post("/v1/completions", json={"prompt": ["klmnopqrstuv", "wxyzABCDEFGH"], "max_tokens": 12})
        after, ours = scrape()

    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert delta["vllm:request_success_total|length"] == 4
    assert delta["vllm:prompt_tokens_total"] == 10 + 10 + 12 + 12
    assert delta["vllm:generation_tokens_total"] == 20 + 3 * 12
    for name in ("time_to_first_token", "e2e_request_latency", "request_time_per_output_token"):
        assert delta[f"vllm:{name}_seconds_count"] == 4, name
    assert delta["vllm:inter_token_latency_seconds_count"] == delta["vllm:time_per_output_token_seconds_count"] == 52
    assert after["vllm:num_preemptions_total"] >= 1 and after["vllm:prefix_cache_hits_total"] >= 8
    assert after["vllm:prefix_cache_queries_total"] >= 44 and after["vllm:num_requests_running"] == 0
    assert after["vllm:num_preemptions_total"] == ours["jaxserve:num_preemptions_total"]
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert after[f"vllm:{name}"] == after[f"vllm:gpu_{name}"] == ours[f"jaxserve:{name}"], name
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count"):
        assert after[f"vllm:{name}"] == ours[f"jaxserve:{name}"], name


class ByteTokensEngine(FakeEngine):
    """FakeEngine whose every token comes with logprobs: token 7 chosen, and byte tokens 200..205, which each print
    as U+FFFD alone (a piece of a UTF-8 character), as alternatives; token 205 ranks above the chosen one."""

    LOGPROBS = {7: -0.5, 205: -0.25, 200: -1.0, 201: -2.0, 202: -3.0, 203: -4.0, 204: -5.0}

    def step(self):
        outs = super().step()
        for out in outs:
            c = out.outputs[0]
            entry = {t: Logprob(lp, " t7" if t == 7 else "\ufffd") for t, lp in self.LOGPROBS.items()}
            c.logprobs = [dict(entry) for _ in c.token_ids]
        return outs


def test_completion_top_logprobs_keep_tokens_that_print_alike():
    """Legacy ``top_logprobs`` are keyed by token text: tokens that print alike (byte tokens, all U+FFFD) must not
    collapse into one entry. The chosen token keeps its text; the others that collide are keyed ``token_id:N``
    (vLLM's placeholder for a token by id)."""
    with TestClient(build_app(ByteTokensEngine())) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 5})
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 5, "stream": True}
        ) as sr:
            streamed = [json.loads(e)["choices"][0]["logprobs"] for e in _events(sr)[:-1]]
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    want = {"\ufffd": -0.25, " t7": -0.5, "token_id:200": -1.0, "token_id:201": -2.0, "token_id:202": -3.0}
    assert lp["tokens"] == [" t7", " t7"] and lp["top_logprobs"] == [want, want]
    assert [list(top) for top in lp["top_logprobs"]] == [list(want)] * 2  # most likely first
    assert [top for chunk in streamed for top in chunk["top_logprobs"]] == [want, want]
    # a chosen token that prints like a likelier one keeps its text, so top_logprobs[i][tokens[i]] is its logprob
    entry = {201: Logprob(-0.5, "\ufffd"), 200: Logprob(-1.0, "\ufffd"), 202: Logprob(-2.0, "\ufffd")}
    lp = completion_logprobs([200], [entry], 2, 0)
    assert lp["tokens"] == ["\ufffd"] and lp["top_logprobs"] == [{"token_id:201": -0.5, "\ufffd": -1.0}]


def test_schema_bounds_token_ids_by_the_vocabulary():
    with TestClient(build_app(FakeEngine())) as client:
        schema = client.get("/openapi.json").json()
        text = json.dumps(schema)
        assert '"maximum": 999' in text and "x-token-id" not in text and '"422"' not in text
        bias = schema["components"]["schemas"]["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]
        assert bias["propertyNames"]["pattern"] == below_pattern(VOCAB)
        r = client.post("/v1/completions", json={"prompt": [5, VOCAB]})
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 100, 101, 999, 1000, 49152, 151936])
def test_below_pattern(n):
    p = re.compile(below_pattern(n))
    probe = list(range(min(n + 50, 3000))) + [n - 1, n, n + 1, 10 * n]
    assert all(bool(p.match(str(i))) == (i < n) for i in probe)
    assert not p.match("01") and not p.match("-1") and not p.match("")


def test_server_layer_imports_no_jax():
    """The HTTP layer is host code: it gets an engine and never touches jax itself."""
    code = (
        "import sys, jaxserve.server.app, jaxserve.server.launch, jaxserve.server.cli, jaxserve.benchmarks.serve; "
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]; assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
