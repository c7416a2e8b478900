"""At the HTTP level: no request can stall the other streams.

One long greedy stream runs on a warmed-up server while 20 short requests arrive, between them every sampling
option at varied sizes (logit_bias of 33-1024 keys, penalties over prompts of 40-300 words, logprobs 1-20, prompt
logprobs through echo, n=2, seeds, stop strings, min_tokens). Before the fix, each new size compiled a new step
variant and froze every stream for seconds. Now: the engine compiles nothing after warm-up, and at most one token gap
of the long stream (a pause of the shared host) exceeds 5x its median, none 2 s. The step budget is small (32 tokens)
so that a step prefilling a chunk beside the decode costs at most a few decode steps (about one on an AVX-512 CPU,
3-3.5 on an AVX2 one); a larger budget makes such steps legitimately slower still.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from jaxserve import LLMEngine  # noqa: E402
from jaxserve.server.app import build_app  # noqa: E402
from jaxserve.server.launch import ServerThread  # noqa: E402

# serial: token gaps are timed, so ``make test`` runs this file alone, after the two workers are done
pytestmark = [pytest.mark.slow, pytest.mark.serial]

WORDS = "river city light north stone garden music paper window seven quiet market winter".split()


def _side_requests(vocab: int) -> list[dict]:
    rng = random.Random(5)

    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def bias(n):
        return {str(t): rng.uniform(-2, 2) for t in rng.sample(range(vocab), n)}

    reqs = [{"prompt": text(8), "logit_bias": bias(n)} for n in (33, 65, 129, 257, 513, 1024)]
    reqs += [{"prompt": text(n), "repetition_penalty": 1.1} for n in (40, 100, 300)]
    reqs += [{"prompt": text(20), "logprobs": k} for k in (1, 5, 20)]
    reqs += [
        {"prompt": text(30), "echo": True, "logprobs": 2, "max_tokens": 1},
        {"prompt": text(12), "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"prompt": text(12), "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 7},
        {"prompt": text(12), "n": 2, "temperature": 1.0, "seed": 3},
        {"prompt": text(12), "stop": ["river", "city"]},
        {"prompt": text(12), "min_tokens": 3, "stop_token_ids": [2]},
        {"prompt": text(250), "temperature": 0.5, "repetition_penalty": 1.3, "logprobs": 3},
        {"prompt": text(5), "logit_bias": bias(7), "presence_penalty": -0.5},
    ]
    assert len(reqs) == 20
    return [{"max_tokens": 4, **r} for r in reqs]


@pytest.fixture(scope="module")
def warm_server(default_loaded):
    engine = LLMEngine(default_loaded, max_num_seqs=16, max_num_batched_tokens=32, max_model_len=512, num_pages=256)
    engine.warmup()
    with ServerThread(build_app(engine, max_waiting=256, shutdown_timeout=5)) as thread:
        yield thread, engine


def test_no_request_stalls_a_running_stream(warm_server):
    thread, engine = warm_server
    url = thread.url + "/v1/completions"
    model = httpx.get(thread.url + "/v1/models").json()["data"][0]["id"]
    compiled = engine.get_stats()["num_compilations"]
    side = _side_requests(engine.model_config.vocab_size)
    errors: list[str] = []
    arrivals: list[float] = []
    started = threading.Event()

    def send_side():
        started.wait(60)
        time.sleep(0.3)
        with httpx.Client(timeout=120) as client:
            for body in side:
                r = client.post(url, json={"model": model, **body})
                if r.status_code != 200:
                    errors.append(f"{body}: {r.status_code} {r.text[:200]}")

    sender = threading.Thread(target=send_side)
    sender.start()
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"] is not None:
                    arrivals.append(time.perf_counter())
                    started.set()
    sender.join(300)
    assert not errors, errors
    assert engine.get_stats()["num_compilations"] == compiled  # nothing a request asked for compiled anything
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # after the first token
    assert len(gaps) > 150
    median = statistics.median(gaps)
    # A stall caused by requests repeats (20 side requests, most of them of new sizes); a pause of the shared host
    # happens once (seen: one 1.35 s gap against a 38 ms median, in one full-suite run of many). A step that
    # prefills a 32-token chunk beside the decode legitimately costs more than a decode alone: about as much on an
    # AVX-512 CPU, 3-3.5x on an AVX2 one (seen: ten gaps of 250-286 ms against an 83 ms median, the long prompts'
    # chunks). So: at most one gap over 5x the median, and none over 2 s. A compile (the cause this test was written
    # for) is caught above.
    slow = sorted(g for g in gaps if g > 5 * median)
    assert len(slow) <= 1 and max(gaps) <= 2.0, (
        f"gaps over 5x the {median * 1e3:.0f} ms median: {[round(g * 1e3) for g in slow]} ms"
    )
