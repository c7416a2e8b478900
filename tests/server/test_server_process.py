"""``jaxserve serve`` as a process: it serves, and on SIGTERM answers new requests and /health 503, finishes what it
can within the grace period, aborts the rest (their streams end with ``finish_reason: "abort"``) and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from jaxserve.server.launch import free_port

pytestmark = pytest.mark.slow  # loads the default model in a subprocess

GRACE_S = 4


def _stream(url: str, body: dict, out: dict) -> None:
    """Reads one streamed completion; records its text, finish reason, whether [DONE] came, and errors."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                for choice in json.loads(line[6:])["choices"]:
                    out["text"] += choice["text"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
                out["first"].set()
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = repr(e)
    finally:
        out["first"].set()


def test_serve_sigterm_drains_then_exits_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxserve",
                "serve",
                "--port",
                str(port),
                "--max-model-len",
                "512",
                "--max-num-seqs",
                "8",
                "--max-num-batched-tokens",
                "128",
                "--no-warmup",
                "--shutdown-timeout",
                str(GRACE_S),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        # Compile the shapes the two requests need before timing anything.
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=120)

        short, long = (
            {"text": "", "finish": None, "done": False, "error": None, "first": threading.Event()} for _ in range(2)
        )
        body = {"prompt": "Tell me about the sea.", "temperature": 0, "ignore_eos": True}
        threads = [
            threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 8}, short)),
            threading.Thread(target=_stream, args=(url, {**body, "max_tokens": 480}, long)),
        ]
        for t in threads:
            t.start()
        assert long["first"].wait(60) and short["first"].wait(60)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(url + "/health", timeout=2).status_code == 503  # still listening while draining
        for t in threads:
            t.join(60)
        code = proc.wait(60)
        took = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log_path.read_text()
    assert short["error"] is None and short["finish"] == "length" and short["done"]  # finished within the grace
    assert long["error"] is None and long["finish"] == "abort" and long["done"]  # aborted after it, cleanly
    assert GRACE_S - 0.5 <= took < GRACE_S + 20
