"""What process 0 sends its followers per decode step, before and after ``jaxserve.parallel.step_wire``, measured in one process.

Before (up to fdc36f5) process 0 pickled and compressed each step's packed arrays, the fixed-width sampler arrays
included; now it sends the scheduler's changes (``jaxserve.parallel.step_wire``). Both are measured on the same steps: the run's
runner publishes the new message on a recording channel, and the packed arrays the old code sent are pickled and
compressed beside it, as the old ``StepChannel.send`` did. Host time is what process 0 spends building the message
(encode, pickle, zlib); the old code also made two synchronous key-value RPCs a step, not counted here.

Model: a 2-layer model with SmolLM2-135M's vocabulary (49,152) and random weights; the message depends on the
batch, the vocabulary and max_model_len, not on the layers. Defaults as a v5e's: max_model_len 2048, 2048 tokens a
step.

    python bench/step_bytes.py [--batches 32,128] [--output-len 16]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
import zlib

import numpy as np


def wire(message) -> bytes:
    return zlib.compress(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), 1)


class Recorder:
    """Process 0's channel in one process: times and sizes each message as ``StepChannel.send`` would send it."""

    leader = True

    def __init__(self):
        self.sizes: list[int] = []
        self.seconds: list[float] = []

    def send(self, message) -> None:
        t = time.perf_counter()
        self.sizes.append(len(wire(message)))
        self.seconds.append(time.perf_counter() - t)

    def flush(self) -> None:
        pass


def run(batch: int, penalties: bool, out_len: int) -> dict:
    import dataclasses

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import load_preset
    from jaxserve.defaults import default_model_path
    from jaxserve.loading import LoadedModel
    from jaxserve.models.schema import random_params

    cfg = dataclasses.replace(load_preset("smollm2-135m"), num_layers=2)
    rng = np.random.default_rng(0)
    params = random_params(cfg, 0.02, rng)
    model = LoadedModel("smollm2-2-layers", cfg, params, default_model_path())
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=2048, num_pages=batch * 8 + 1)
    runner = llm.engine.runner
    runner.channel = rec = Recorder()
    old: list[tuple[int, float, bool]] = []
    launch = runner._launch

    def recording_launch(copy, step):  # what the old StepChannel.send made of the same step
        if step is not None:
            t = time.perf_counter()
            size = len(wire(("step", copy, step)))
            old.append((size, time.perf_counter() - t, bool(step[0])))
        return launch(copy, step)

    runner._launch = recording_launch
    new: list[tuple[int, float, bool]] = []
    publish = runner._publish

    def recording_publish(sched, token_masks):  # the new message: encoded, pickled, compressed
        t = time.perf_counter()
        publish(sched, token_masks)
        if sched.scheduled:
            decode = all(len(s.token_ids) == 1 for s in sched.scheduled)
            new.append((rec.sizes[-1], time.perf_counter() - t, decode))

    runner._publish = recording_publish
    sp = dict(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    if penalties:
        sp.update(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)
    prompts = [rng.integers(3, 49000, size=int(n)).tolist() for n in rng.integers(32, 96, size=batch)]
    llm.generate(prompts, SamplingParams(**sp), use_tqdm=False)
    assert len(new) == len(old) and all(a[2] == b[2] for a, b in zip(old, new))
    decode = [i for i, step in enumerate(old) if step[2]]
    return {
        "decode steps": len(decode),
        "old bytes": statistics.median(old[i][0] for i in decode),
        "new bytes": statistics.median(new[i][0] for i in decode),
        "old ms": 1e3 * statistics.median(old[i][1] for i in decode),
        "new ms": 1e3 * statistics.median(new[i][1] for i in decode),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--output-len", type=int, default=16)
    a = ap.parse_args()
    print("| batch | penalties | decode steps | before: bytes | after: bytes | before: host ms | after: host ms |")
    print("|---|---|---|---|---|---|---|")
    for b in (int(x) for x in a.batches.split(",")):
        for pen in (False, True):
            r = run(b, pen, a.output_len)
            print(
                f"| {b} | {'yes' if pen else 'no'} | {r['decode steps']} | {r['old bytes']:,.0f} | "
                f"{r['new bytes']:,.0f} | {r['old ms']:.2f} | {r['new ms']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
