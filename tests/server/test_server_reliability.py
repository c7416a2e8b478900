"""Server reliability over a fake engine (fast): the event loop stays free while a 4 MB prompt is tokenized,
the prompt-size limit, atomic batch admission, a failed engine step that fails only its own requests, the header
deadline, duplicate Authorization headers, best_of, strict prompt types and seeds, SIGINT's exit status and the
drain's 503s."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.server.app import build_app
from jaxserve.server.async_engine import MAX_STEP_FAILURES
from jaxserve.server.launch import ServerThread, free_port

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # the fake engine's module (pytest imports test modules by path, not by name)
from test_server_fake_engine import FakeEngine  # noqa: E402

HEALTH_LIMIT_S = 0.2


# ---------------------------------------------------------------------------------------------------- event loop
# Probes /health from another process, so the probes do not share the server's GIL: they measure the server alone.
# It probes until its stdin closes, then prints (start, latency) of every probe.
PROBER = textwrap.dedent("""
    import json, sys, threading, time, httpx
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    lat = []
    with httpx.Client(base_url=sys.argv[1], timeout=30) as c:
        c.get("/health")
        print("ready", flush=True)
        while not done.is_set():
            t0 = time.monotonic()
            c.get("/health").raise_for_status()
            lat.append((t0, time.monotonic() - t0))
            time.sleep(0.01)
    print(json.dumps(lat), flush=True)
""")


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from jaxserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def tokenizing_server(tokenizer):
    """A fake engine with the default model's real tokenizer; no prompt limit, a body limit past 4 MB."""
    engine = FakeEngine()
    engine.tokenizer = tokenizer
    engine.model_config.vocab_size = engine.tokenizer.vocab_size
    with ServerThread(build_app(engine, max_body_bytes=5 * 1024 * 1024, max_prompt_chars=None)) as srv:
        yield srv


FOUR_MB = ("The quick brown fox jumps over the lazy dog; " * 100_000)[:4_000_000]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": FOUR_MB, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": FOUR_MB}]}),
        ("/tokenize", {"prompt": FOUR_MB}),
    ],
    ids=["completions", "chat", "tokenize"],
)
def test_health_answers_while_a_4mb_prompt_is_tokenized(tokenizing_server, path, body):
    url = tokenizing_server.url
    content = json.dumps(body).encode()
    prober = subprocess.Popen(
        [sys.executable, "-c", PROBER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert prober.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=120)
        t1 = time.monotonic()
    finally:
        out, _ = prober.communicate(timeout=60)  # closes its stdin: it stops and reports
    assert r.status_code in (200, 400), r.text
    assert re.search(r"\b\d{6}\b", r.text), r.text[:200]  # it was tokenized: the answer counts its ~900K tokens
    if path == "/tokenize":
        assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 256
    lat = [(s, d) for s, d in json.loads(out) if s < t1 and s + d > t0]  # the probes during the request
    assert len(lat) >= 5, f"too few probes during the {t1 - t0:.1f}s request: {lat}"
    assert max(d for _, d in lat) < HEALTH_LIMIT_S, sorted(d for _, d in lat)[-5:]


def test_prompt_char_limit_is_answered_before_tokenizing():
    engine = FakeEngine()
    encoded = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, *a: encoded.append(text) or encode(text, *a)
    with TestClient(build_app(engine, max_prompt_chars=10)) as client:
        for path, body, param in [
            ("/v1/completions", {"prompt": "x" * 11}, "prompt"),
            ("/v1/completions", {"prompt": ["short", "x" * 11]}, "prompt"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "system", "content": "x" * 6}, {"role": "user", "content": "y" * 6}]},
                "messages",
            ),
            ("/tokenize", {"prompt": "x" * 11}, "prompt"),
        ]:
            r = client.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["code"] == "prompt_too_long", r.text
            assert "limit of 10" in err["message"] and "--max-prompt-chars" in err["message"]
        assert encoded == []
        assert client.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------------------------------------- admission
class RecordingEngine(FakeEngine):
    """Remembers at which step each request was added; refuses prompts holding token id ``BAD``."""

    BAD = 999

    def __init__(self, **kw):
        super().__init__(**kw)
        self.added_at: dict[str, int] = {}

    def add_request(self, rid, prompt, params, priority=0):
        if self.BAD in prompt:
            raise ValueError(f"request {rid!r}: token {self.BAD} refused")
        super().add_request(rid, prompt, params, priority)
        self.added_at[rid] = self.steps


def test_multi_prompt_request_is_admitted_at_once():
    engine = RecordingEngine(step_s=0.02)
    with TestClient(build_app(engine)) as client:
        prompts = [[1 + k, 2, 3] for k in range(64)]
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 64
        assert len(engine.added_at) == 64 and len(set(engine.added_at.values())) == 1  # all between two steps
        assert engine.steps == 2  # max_tokens steps, not one admission per step


def test_multi_prompt_request_is_admitted_all_or_none():
    engine = RecordingEngine()
    with TestClient(build_app(engine)) as client:
        prompts = [[1, 2]] * 10 + [[1, RecordingEngine.BAD]] + [[3]] * 5
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 2})
        assert r.status_code == 400 and "refused" in r.json()["error"]["message"], r.text
        assert engine.requests == {} and engine.steps == 0  # the 10 added before it were taken back
        assert client.app.state.server.engine.num_in_flight == 0
        assert client.post("/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------------------------------------- step faults
class OneByOneEngine(FakeEngine):
    """Steps the oldest request alone (a batch of one: the others wait, as behind a full batch); once
    ``fail_next`` is set, its next step fails as LLMEngine's does: ``StepFailed`` after aborting the step's
    requests."""

    def __init__(self):
        super().__init__(step_s=0.01)
        self.fail_next = self.fail_always = False

    def step(self):
        from jaxserve.engine.exceptions import StepFailed

        self.steps += 1
        time.sleep(self.step_s)
        rid = next(iter(self.requests))
        if self.fail_next or self.fail_always:
            self.fail_next = False
            self.abort_request(rid)
            raise StepFailed([rid], [], RuntimeError("injected device fault"))
        prompt, params, toks = self.requests[rid]
        toks.append(7)
        done = len(toks) >= params.max_tokens
        if done:
            del self.requests[rid]
        comp = CompletionOutput(0, " t7" * len(toks), list(toks), None, None, "length" if done else None)
        return [RequestOutput(rid, None, prompt, [comp], done)]


def test_a_failed_step_fails_only_its_requests_and_the_server_serves_on():
    engine = OneByOneEngine()
    with ServerThread(build_app(engine)) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}) as a:
            lines = a.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # A is running
            with httpx.Client(base_url=srv.url, timeout=60) as client_b:
                import threading

                b: dict = {}
                tb = threading.Thread(
                    target=lambda: b.update(r=client_b.post("/v1/completions", json={"prompt": "b", "max_tokens": 3}))
                )
                tb.start()
                deadline = time.monotonic() + 10
                while len(engine.requests) < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)  # B is waiting behind A
                engine.fail_next = True
                events = [line[6:] for line in lines if line.startswith("data: ")]
                tb.join(30)
        err = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and err["type"] == "server_error"
        assert "RuntimeError: injected device fault" in err["message"]
        assert b["r"].status_code == 200 and b["r"].json()["choices"][0]["text"] == " t7" * 3  # not in that step
        # a non-streamed request whose step fails gets a 500 naming the cause
        engine.fail_next = True
        r = client.post("/v1/completions", json={"prompt": "c", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_step_failed"
        assert "injected device fault" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "d", "max_tokens": 2}).status_code == 200
        assert client.get("/health").status_code == 200
        assert engine.requests == {} and srv.server.config.app.state.server.engine.num_in_flight == 0
        metrics = client.get("/metrics").text
        assert re.search(r'request_success_total\{[^}]*finished_reason="error"[^}]*\} 2\.0', metrics), metrics


def test_steps_failing_in_a_row_kill_the_engine():
    engine = OneByOneEngine()
    engine.fail_always = True
    with TestClient(build_app(engine)) as client:
        codes = [
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
            for _ in range(MAX_STEP_FAILURES + 1)
        ]
        assert codes == [500] * (MAX_STEP_FAILURES - 1) + [503, 503]
        assert client.get("/health").status_code == 503


# ---------------------------------------------------------------------------------------------------- HTTP details
def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed it."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data, time.monotonic()


def test_slow_headers_are_timed_out():
    with ServerThread(build_app(FakeEngine()), header_timeout=0.5) as srv:
        # trickling headers: one header line every 0.1 s, forever; the server cuts it off at the deadline
        with socket.create_connection((srv.host, srv.port)) as sock:
            t0 = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            closed = None
            sock.settimeout(0.1)
            while closed is None and time.monotonic() - t0 < 5:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                    data = sock.recv(4096)
                    if data.startswith(b"HTTP/1.1 408") or not data:
                        closed = time.monotonic() - t0
                except TimeoutError:
                    continue
                except OSError:  # reset: it was closed
                    closed = time.monotonic() - t0
            assert closed is not None and 0.4 < closed < 2.0, closed
        # a connection that never says anything
        with socket.create_connection((srv.host, srv.port)) as sock:
            t0 = time.monotonic()
            _, t1 = _read_all(sock, 5)
            assert 0.4 < t1 - t0 < 2.0
        # a kept-alive connection may idle past the header deadline between requests (keep-alive rules there)
        with socket.create_connection((srv.host, srv.port)) as sock:
            request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            for _ in range(2):
                sock.sendall(request)
                sock.settimeout(5)
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
                time.sleep(0.8)


def test_duplicate_authorization_headers_are_refused():
    with TestClient(build_app(FakeEngine(), api_key="k")) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"}).status_code == 401
        for second in ("Bearer k", "Bearer x"):
            r = client.post(
                "/v1/completions", json=body, headers=[("Authorization", "Bearer k"), ("Authorization", second)]
            )
            assert r.status_code == 400 and "more than one authorization" in r.json()["error"]["message"].lower()


BAD_FIELDS = [
    ("best_of above n", "/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("best_of below n", "/v1/completions", {"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
    ("chat best_of", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ("object prompt", "/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("boolean token ids", "/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("boolean in a batch", "/v1/completions", {"prompt": [[1, 2], [3, True]]}, "prompt"),
    ("boolean detokenize", "/detokenize", {"tokens": [1, True]}, "tokens"),
    ("seed 2**64", "/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("seed 2**63", "/v1/completions", {"prompt": "hi", "seed": 2**63}, "seed"),
    ("seed below int64", "/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
]


@pytest.mark.parametrize("name,path,body,param", BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
def test_rejected_fields(name, path, body, param):
    with TestClient(build_app(FakeEngine())) as client:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_accepted_edge_fields():
    with TestClient(build_app(FakeEngine())) as client:
        for body in ({"best_of": 2, "n": 2}, {"best_of": 1}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": -1}):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
            assert r.status_code == 200, (body, r.text)


# ---------------------------------------------------------------------------------------------------- signals
SERVE = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # the fake engine's folder, and tests/ (helpers)
    from test_server_fake_engine import FakeEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import serve
    step_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.002
    app = build_app(FakeEngine(step_s=step_s))
    sys.exit(serve(app, port=int(sys.argv[2]), log_level="warning", shutdown_timeout=1))
""")


def _start(port: int, *args: str) -> subprocess.Popen:
    """SERVE on ``port``, once /health answers 200."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(TESTS), str(port), *args], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate()[1])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_exit_status_after_a_signal(sig, status):
    port = free_port()
    proc = _start(port)
    try:
        proc.send_signal(sig)
        assert proc.wait(30) == status, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_draining_server_answers_health_503_until_its_streams_end():
    """After SIGTERM the server keeps its port open while a stream drains: /health and new requests, on new
    connections and on a keep-alive one opened before, are answered 503; the stream is aborted after the grace
    (1 s) and ends cleanly, and only then does the process stop listening and exit 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port, "0.05")  # 20 tokens a second: 200 tokens outlast the grace
    try:
        with (
            httpx.Client(base_url=url, timeout=10) as kept,
            httpx.stream(
                "POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 200, "stream": True}, timeout=30
            ) as r,
        ):
            assert kept.get("/health").status_code == 200  # the keep-alive connection, opened before the signal
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            health = httpx.get(url + "/health", timeout=5)
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
            assert kept.get("/health").status_code == 503
            busy = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
            assert busy.status_code == 503 and int(busy.headers["retry-after"]) > 0
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(30) == 0, proc.stderr.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------------- detokenizing
def test_reply_cut_inside_a_character_does_not_end_in_replacement_char(tokenizer):
    from jaxserve.tokenizer import IncrementalDetokenizer

    ids = tokenizer.encode("Hi 😀", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(ids[:-1])  # the emoji's bytes span tokens: cut, it decodes to U+FFFD
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(i) for i in ids[:-1]) + detok.flush()
    assert text == "Hi "
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "Hi 😀"
