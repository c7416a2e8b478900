"""Process 0's host time per step: data-parallel replicas in one process or a process each; one replica over processes.

One process, DP 1 / 2 / 4 (simulated CPU devices, async scheduling): process 0 schedules, packs, launches and reads
back every replica from one thread, one replica after another; a replica's device step overlaps the host work on
the next replica, but the host work itself adds up. A process per replica, DP 2 / 4 (``jax.distributed`` on
localhost, one device each, ``jaxserve.engine.remote_replica``): process 0 still schedules every replica, but packs and reads back
only its own; for the others it encodes their changes and decodes their results. One replica over 2 / 4
processes (TP 2 / 4, one device each): process 0 also sends its changes to the followers (``jaxserve.parallel.step_wire``).

Accounting, per ``engine.step()`` of process 0: its host time is the step's wall time minus the time it blocked,
waiting for a device's results (``runner._fetch``) or for a remote replica's (the result channel's ``recv``); its
main thread's CPU time (``time.thread_time``) is the host work alone, without the simulated devices' compute,
which XLA runs on threads of its own (but on the same cores); "of which runners" is the part spent in the
replicas' runners: packing, launching and reading back, or for a remote replica encoding its changes and decoding
its results. Every layout runs the same requests; tokens are compared with one device's. Plumbing, not speed:
wall times here say little; host CPU per step and its ratios do.

    python bench/dp_overlap.py [--requests 128] [--output-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def _model():
    import dataclasses

    import numpy as np

    from jaxserve.config import load_preset
    from jaxserve.defaults import default_model_path
    from jaxserve.loading import LoadedModel
    from jaxserve.models.schema import random_params

    # SmolLM2's vocabulary (the sampler's width), 8 query and 4 KV heads (for TP 2 and 4), 2 layers.
    cfg = dataclasses.replace(load_preset("smollm2-135m"), num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=4)
    return LoadedModel(
        "smollm2-2-layers", cfg, random_params(cfg, 0.02, np.random.default_rng(0)), default_model_path()
    )


def measure(tp: int, dp: int, requests: int, output_len: int) -> dict | None:
    """Runs the workload at TP ``tp`` x DP ``dp`` in this process (or its share of a group); process 0's numbers."""
    import jax
    import numpy as np

    from jaxserve import LLM, SamplingParams, distributed, remote, runner

    llm = LLM(
        _model(),
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        max_num_seqs=max(requests // dp, 1),
        max_num_batched_tokens=512,
        max_model_len=2048,
        num_pages=requests // dp * 4 + 1,
        async_scheduling=True,
        compilation_cache=False,
    )
    llm.engine.warmup()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49000, size=32).tolist() for _ in range(requests)]
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:dp], greedy, use_tqdm=False)  # the first steps' one-off costs
    if jax.process_index() != 0:
        llm.generate(prompts, greedy, use_tqdm=False)
        return None
    blocked = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                blocked[0] += time.perf_counter() - t

        return wrapper

    runner._fetch = timed(runner._fetch)
    distributed.StepChannel.recv = timed(distributed.StepChannel.recv)
    runner_cpu = [0.0]  # process 0's CPU in the replicas' runners: packing, launching, reading back (or encoding)

    def cpu_timed(fn):
        def wrapper(*args, **kwargs):
            c = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                runner_cpu[0] += time.thread_time() - c

        return wrapper

    for cls in (runner.ModelRunner, remote.RemoteRunner):
        cls.launch, cls.collect = cpu_timed(cls.launch), cpu_timed(cls.collect)
    engine, steps, stepping, cpu = llm.engine, [0], [0.0], [0.0]
    step = engine.step

    def counted_step():
        t, c = time.perf_counter(), time.thread_time()
        try:
            return step()
        finally:
            steps[0] += 1
            stepping[0] += time.perf_counter() - t
            cpu[0] += time.thread_time() - c

    engine.step = counted_step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {
        "steps": steps[0],
        "wall": wall,
        "host_ms": 1e3 * (stepping[0] - blocked[0]) / steps[0],
        "cpu_ms": 1e3 * cpu[0] / steps[0],
        "runner_cpu_ms": 1e3 * runner_cpu[0] / steps[0],
        "blocked_ms": 1e3 * blocked[0] / steps[0],
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(processes: int, tp: int, dp: int, args) -> dict:
    """Runs ``measure`` in ``processes`` fresh processes with TP x DP / processes devices each; process 0's numbers."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp * dp // processes}",
    }
    cmd = [sys.executable, __file__, "--worker", str(tp), str(dp), "--requests", str(args.requests)]
    cmd += ["--output-len", str(args.output_len)]
    procs = [
        subprocess.Popen(
            cmd + ["--group", coordinator, str(processes), str(i)], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{processes} x DP {dp}: exit codes {[p.returncode for p in procs]}")
    (line,) = [x for x in outs[0].splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--worker", type=int, nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--group", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        coordinator, n, i = args.group
        if int(n) > 1:
            from jaxserve.parallel.distributed import initialize

            initialize(coordinator, int(n), int(i))
        result = measure(*args.worker, args.requests, args.output_len)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return
    import platform

    print(
        f"# bench/dp_overlap.py on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {args.requests} requests of 32 tokens, {args.output_len} output tokens\n"
    )
    print(
        "| layout | engine steps | process 0 main-thread CPU ms / step | of which runners | host ms / step "
        "| blocked ms / step | wall (s) | tokens = 1 device |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for processes, tp, dp in [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (4, 1, 4), (2, 2, 1), (4, 4, 1)]:
        r = run_layout(processes, tp, dp, args)
        base = base or r
        name = f"{processes} process{'es' if processes > 1 else ''}, TP {tp} x DP {dp}"
        print(
            f"| {name} | {r['steps']} | {r['cpu_ms']:.2f} | {r['runner_cpu_ms']:.2f} | {r['host_ms']:.2f} | {r['blocked_ms']:.2f} | {r['wall']:.1f} | "
            f"{'yes' if r['tokens'] == base['tokens'] else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
