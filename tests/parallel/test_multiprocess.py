"""Several processes on localhost, one jax.distributed group over gloo, with default engine options: one
tensor-parallel replica over every device (2 processes x 2 CPU devices, and 3 x 1), or data-parallel replicas over
groups of processes (4 x 1 as DP 2 x TP 2, 2 x 2 as DP 2 x TP 2), or pipeline stages over processes (2 x 2 as
PP 2 x TP 2); process 0 scheduling, the others following its steps. The reference is one process on one device. And
every fault ends the whole group, non-zero and in bounded time: a process that raises, one started with other
settings, a signal to a follower, a process lost.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import tiny_model

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("multiprocess_worker.py")
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 1000, 10)), [7] * 70]
HEARTBEAT_S = 5  # how long a silent process may take before the other gives it up (the loss tests' own setting)
# The tests that expect no loss take a longer one: with the suite's other worker compiling beside them on two cores,
# both processes once went 5 s without a heartbeat and the coordination service ended the pair.
BUSY_HEARTBEAT_S = 60
FAULT_S = 60  # a fault ends every process within this


def _tiny_ckpt(tmp_path_factory, default_model_path, num_heads: int, num_kv_heads: int) -> Path:
    """A tiny random model (``helpers.tiny_model``) as an orbax checkpoint, which every process restores."""
    from jaxserve.loading import orbax_ckpt

    model = tiny_model(default_model_path, num_heads, num_kv_heads)
    path = tmp_path_factory.mktemp(f"tiny_ckpt_{num_heads}_{num_kv_heads}")
    orbax_ckpt.save(path, model.config, model.params, "float32")
    orbax_ckpt.copy_tokenizer(default_model_path, path)
    return path


def _reference(ckpt: Path):
    llm = LLM(str(ckpt), num_pages=64, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, default_model_path):
    """8 query heads, 2 KV heads: tensor parallelism 4 replicates each KV head twice."""
    return _tiny_ckpt(tmp_path_factory, default_model_path, 8, 2)


@pytest.fixture(scope="module")
def tiny3_ckpt(tmp_path_factory, default_model_path):
    """6 query heads, 3 KV heads: tensor parallelism 3 splits them."""
    return _tiny_ckpt(tmp_path_factory, default_model_path, 6, 3)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return _reference(tiny_ckpt)


@pytest.fixture(scope="module")
def reference3(tiny3_ckpt):
    return _reference(tiny3_ckpt)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(heartbeat_s: int, devices: int, extra: dict | None = None) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "JAXSERVE_TEST_PROMPTS": json.dumps(PROMPTS),
        "JAXSERVE_HEARTBEAT_TIMEOUT_S": str(heartbeat_s),
        **(extra or {}),
    }


def _group(make_cmd, n: int, tmp_path: Path, name: str, heartbeat_s: int = BUSY_HEARTBEAT_S, extra_env=None):
    """``n`` processes of one group, 2 devices each when n is 2, else 1; their logs are tmp_path/name{i}.log."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = _env(heartbeat_s, 2 if n == 2 else 1, extra_env)
    return [
        subprocess.Popen(
            make_cmd(coordinator, i), stdout=(tmp_path / f"{name}{i}.log").open("w"), stderr=subprocess.STDOUT, env=env
        )
        for i in range(n)
    ]


def _worker(ckpt: Path, n: int, tp: int, dp: int = 1):
    return lambda c, i: [sys.executable, str(WORKER), c, str(n), str(i), str(ckpt), str(tp), str(dp)]


def _wait(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"process did not exit within {timeout} s; log:\n{log.read_text()[-3000:]}")


def _tokens(log: Path):
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("TOKENS ")]
    return json.loads(line[len("TOKENS ") :])


def _all_end(procs, tmp_path: Path, name: str, cause: str, t0: float) -> list[int]:
    """Waits for every process; each must end within FAULT_S of ``t0``, and every log but the culprit's names the
    ``cause``. Returns the exit codes."""
    codes = []
    for i, p in enumerate(procs):
        log = tmp_path / f"{name}{i}.log"
        codes.append(_wait(p, max(1.0, t0 + FAULT_S - time.time()), log))
        assert cause in log.read_text(), f"process {i}'s log does not name the cause:\n{log.read_text()[-3000:]}"
    return codes


def test_four_processes_as_two_replicas_generate_like_one(tiny_ckpt, reference, tmp_path):
    """4 processes x 1 device as data parallelism 2 x tensor parallelism 2: process 0 schedules both replicas; the
    second runs on processes 2 and 3, which send its results back. With async scheduling, as on GPUs and TPUs: every
    process launches a step before it reads the previous one back."""
    procs = _group(_worker(tiny_ckpt, 4, 2, dp=2), 4, tmp_path, "dp", extra_env={"JAXSERVE_TEST_ASYNC": "1"})
    for i, p in enumerate(procs):
        log = tmp_path / f"dp{i}.log"
        assert _wait(p, 300, log) == 0, log.read_text()[-3000:]
        assert _tokens(log) == reference[0], f"process {i}"
    steps = json.loads(next(x for x in (tmp_path / "dp0.log").read_text().splitlines() if x.startswith("STEPS "))[6:])
    assert len(steps) == 2 and min(steps) > 0, steps  # the requests went to both replicas


def test_three_processes_generate_like_one_and_one_raising_ends_them_all(tiny3_ckpt, reference3, tmp_path):
    """3 processes x 1 device, tensor parallelism 3. Process 1 raises after the first generation while the others
    start a second one: all three end non-zero, naming process 1's error."""
    procs = _group(_worker(tiny3_ckpt, 3, 3), 3, tmp_path, "raise", extra_env={"JAXSERVE_TEST_RAISE_ON": "1"})
    logs = [tmp_path / f"raise{i}.log" for i in range(3)]
    _wait(procs[1], 300, logs[1])  # it raises once the first generation is done
    t0 = time.time()
    codes = _all_end(procs, tmp_path, "raise", "process 1: RuntimeError: injected after the first generation", t0)
    assert all(c != 0 for c in codes), codes
    for i, log in enumerate(logs):
        assert _tokens(log) == reference3[0], f"process {i}"


def test_a_process_started_with_other_settings_ends_every_process(tiny_ckpt, tmp_path):
    t0 = time.time()
    procs = _group(_worker(tiny_ckpt, 2, 4), 2, tmp_path, "settings", extra_env={"JAXSERVE_TEST_MAX_NUM_SEQS_ON": "1"})
    # Loading and importing take their time before the check; the bound counts from the start here.
    codes = [_wait(p, 300, tmp_path / f"settings{i}.log") for i, p in enumerate(procs)]
    assert all(c != 0 for c in codes), codes
    for i in range(2):
        text = (tmp_path / f"settings{i}.log").read_text()
        assert "process 1's settings differ from process 0's: EngineConfig.max_num_seqs=4 (process 0: None)" in text
        assert "TOKENS " not in text
    assert time.time() - t0 < 300


def _serve_cmd(ckpt, port, n: int, tp: int, *extra: str):
    """``jaxserve serve`` for process i of n, with default options but the model, the port and ``extra``."""

    def make(coordinator, i):
        return [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "serve",
            "--model",
            str(ckpt),
            "--port",
            str(port),
            "--coordinator",
            coordinator,
            "--num-processes",
            str(n),
            "--process-id",
            str(i),
            "--served-model-name",
            "tiny",
            "--tensor-parallel-size",
            str(tp),
            *extra,
        ]

    return make


def test_process_0_failing_at_start_up_ends_the_followers(tiny_ckpt, tmp_path):
    """``jaxserve serve`` where process 0 alone asks for more than the model takes: it exits 2 with the usage
    error, and the follower, waiting for process 0's settings, ends too, naming it."""
    port = _free_port()
    make = _serve_cmd(tiny_ckpt, port, 2, 4, "--no-warmup")
    procs = _group(lambda c, i: make(c, i) + (["--max-model-len", "4096"] if i == 0 else []), 2, tmp_path, "bad0")
    codes = [_wait(p, 300, tmp_path / f"bad0{i}.log") for i, p in enumerate(procs)]
    assert codes[0] == 2 and codes[1] != 0, codes
    for i in range(2):
        text = (tmp_path / f"bad0{i}.log").read_text()
        assert "process 0: ValueError: max_model_len=4096 exceeds the model's max_position_embeddings=256" in text


def _wait_healthy(port: int, procs, tmp_path: Path, name: str) -> None:
    deadline = time.time() + 300
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(
                "a process exited during start-up:\n"
                + "\n".join((tmp_path / f"{name}{i}.log").read_text()[-2000:] for i in range(len(procs)))
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the server did not become healthy")


def _served_texts(port: int) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def test_two_replicas_on_two_processes_serve_like_one_and_shut_down_together(tiny_ckpt, reference, tmp_path):
    """2 processes x 2 devices as data parallelism 2 x tensor parallelism 2: process 0's HTTP front dispatches to
    its own replica and to process 1's."""
    port = _free_port()
    procs = _group(_serve_cmd(tiny_ckpt, port, 2, 2, "--no-warmup", "--data-parallel-size", "2"), 2, tmp_path, "serve")
    try:
        _wait_healthy(port, procs, tmp_path, "serve")
        assert _served_texts(port) == reference[1]
        procs[0].send_signal(signal.SIGTERM)  # process 0 drains, then releases process 1
        assert _wait(procs[0], 60, tmp_path / "serve0.log") == 0
        assert _wait(procs[1], 60, tmp_path / "serve1.log") == 0
    finally:
        for p in procs:
            p.kill()


def test_three_processes_default_command_serves_and_a_signalled_follower_ends_all(tiny3_ckpt, reference3, tmp_path):
    """The default multi-host command (3 processes x 1 device, nothing but the parallel layout given), then SIGTERM to process
    2: all three end non-zero within FAULT_S, naming it. Without the warm-up, which compiles the same variants
    on every process and runs nothing (test_engine covers it): it took 60 of this test's 100 s in CI."""
    port = _free_port()
    procs = _group(_serve_cmd(tiny3_ckpt, port, 3, 3, "--no-warmup"), 3, tmp_path, "serve3")
    try:
        _wait_healthy(port, procs, tmp_path, "serve3")
        assert _served_texts(port) == reference3[1]
        t0 = time.time()
        procs[2].send_signal(signal.SIGTERM)
        codes = _all_end(procs, tmp_path, "serve3", "process 2: received SIGTERM", t0)
        assert codes[2] == 128 + signal.SIGTERM and codes[0] != 0 and codes[1] != 0, codes
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("victim", [1, 0])
def test_two_pipeline_stages_serve_like_one_and_losing_either_ends_the_other(tiny_ckpt, reference, tmp_path, victim):
    """2 processes x 2 devices as pipeline parallelism 2 x tensor parallelism 2: each process holds one stage (one
    of the 2 layers, its half of the pool); the hidden states cross from process 0's devices to process 1's every
    step. Then a process is killed: the other ends non-zero. Process 0, losing its follower, finds it lost itself
    within the heartbeat timeout and exits PROCESS_LOST_EXIT naming it, before jax's coordination service would
    abort it (SIGABRT, exit 134, a C++ stack dump)."""
    from jaxserve.parallel.distributed import PROCESS_LOST_EXIT

    port = _free_port()
    serve = _serve_cmd(tiny_ckpt, port, 2, 2, "--no-warmup", "--pipeline-parallel-size", "2")
    procs = _group(serve, 2, tmp_path, "kill", HEARTBEAT_S)
    try:
        _wait_healthy(port, procs, tmp_path, "kill")
        assert _served_texts(port) == reference[1]
        time.sleep(1)  # process 1 is following by now (it announced it in its log before /health came up)
        procs[victim].send_signal(signal.SIGKILL)
        survivor = 1 - victim
        t0 = time.time()
        rc = _wait(procs[survivor], 6 * HEARTBEAT_S + 30, tmp_path / f"kill{survivor}.log")
        log = (tmp_path / f"kill{survivor}.log").read_text()
        assert rc != 0, log[-3000:]
        assert time.time() - t0 < 6 * HEARTBEAT_S + 30
        if victim == 1:
            line = f"jaxserve: ending every process: process 0: lost process 1: no heartbeat for {HEARTBEAT_S} s"
            assert rc == PROCESS_LOST_EXIT and line in log, (rc, log[-3000:])
            assert "Terminating process because the JAX distributed service" not in log, log[-3000:]
    finally:
        for p in procs:
            p.kill()
