"""What process 0 sends its followers each step (``jaxserve.parallel.step_wire``): the scheduler's changes, not packed arrays.

The encoding round-trips every field of a ``SchedulerOutput``; a decode step of 128 requests costs at most 4 KB on
the wire; and a follower that packs its own arrays from the messages computes the tokens process 0 computed (one
process here: the leader's messages are recorded, then replayed into a second engine's runner).
"""

from __future__ import annotations

import pickle
import zlib
from collections import defaultdict

import numpy as np
import pytest
from helpers import tiny_model

from jaxserve import LLM, SamplingParams
from jaxserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.parallel.step_wire import StepDecoder, StepEncoder

DECODE_STEP_BYTES = 4096  # the bound for a decode step of 128 requests, none new


def _wire(message) -> bytes:
    """As ``jaxserve.parallel.distributed.StepChannel`` sends it."""
    return zlib.compress(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), 1)


def _new(i: int, n: int = 5) -> NewRequestData:
    return NewRequestData(list(range(i, i + n)), [], SamplingParams(temperature=0.0, max_tokens=8))


def _start(rids, prompt_len=5) -> SchedulerOutput:
    scheduled = [
        ScheduledRequest(r, list(range(prompt_len)), 0, True, 0, [10 + k], _new(k)) for k, r in enumerate(rids)
    ]
    return SchedulerOutput(scheduled, [], [], [], prompt_len * len(rids))


def test_every_field_round_trips_and_handles_are_reused():
    enc, dec = StepEncoder(), StepDecoder()
    steps = [
        _start(["a", "b", "c"]),
        SchedulerOutput(
            [
                ScheduledRequest("a", [7], 5, True, 1, [40, 41]),
                ScheduledRequest("c", [9, 3, 4, 5], 5, True, 0, [], None, (3, 4, 5)),  # three proposals
            ],
            [(2, 8), (3, 9)],
            ["b", "never-scheduled"],  # one the runner knew, one aborted before it ran
            [],
            5,
        ),
        SchedulerOutput(
            [
                ScheduledRequest("d", [1, 2], 0, False, 0, [50], _new(9, 2)),  # takes a's handle, freed last
                ScheduledRequest("c", [], 9, True, 2, [], from_previous_step=True),  # fed the previous step's token
            ],
            [],
            [],
            ["a"],
            3,
        ),
        SchedulerOutput([], [(4, 5)], ["c"], [], 0),  # copy-only, with a finish
    ]
    masks = [None, {"c": np.arange(3, dtype=np.int32)}, None, None]
    for sched, mask in zip(steps, masks):
        got, got_mask = dec.decode(pickle.loads(zlib.decompress(_wire(enc.encode(sched, mask)))))
        assert got == sched
        if mask is None:
            assert got_mask is None
        else:
            assert got_mask.keys() == mask.keys() and all(np.array_equal(got_mask[k], mask[k]) for k in mask)
    assert enc._handles == {"d": 0} and dec._ids == {0: "d"}  # handles are reused: their number stays bounded


def test_a_decode_step_of_128_requests_costs_at_most_4_kb():
    enc = StepEncoder()
    rids = [f"cmpl-{k:032x}-0" for k in range(128)]  # ids as long as the server's
    enc.encode(_start(rids, prompt_len=300))
    rng = np.random.default_rng(0)
    pos = rng.integers(300, 2000, size=128)
    decode = SchedulerOutput(
        [
            ScheduledRequest(
                r, [int(rng.integers(0, 49152))], int(p), True, int(p) // 16, [int(p)] if p % 16 == 0 else []
            )
            for r, p in zip(rids, pos)
        ],
        [],
        [],
        [],
        128,
    )
    size = len(_wire(enc.encode(decode)))
    assert size <= DECODE_STEP_BYTES, size


class _Recorder:
    """Process 0's channel, in one process: keeps each message as it would travel."""

    leader = True

    def __init__(self):
        self.messages: list[bytes] = []

    def send(self, message) -> None:
        self.messages.append(_wire(message))

    def flush(self) -> None:
        pass


class _Replay:
    """A follower's channel: the recorded messages, in order."""

    leader = False

    def __init__(self, messages: list[bytes]):
        self._messages = iter(messages)

    def recv(self):
        return pickle.loads(zlib.decompress(next(self._messages)))


@pytest.mark.slow
def test_a_follower_packing_its_own_steps_computes_process_0s_tokens(default_model_path):
    """128 requests (penalties, a logit bias and seeded sampling among them: the sampler's per-request state must be
    rebuilt from the messages), async scheduling on; the follower's sampled tokens equal process 0's, it launched
    some step before reading the previous one's results, as process 0 did, and no decode step of the run costs more
    than 4 KB on the wire."""
    engine = dict(
        max_num_seqs=128, max_model_len=64, num_pages=128 * 4 + 1, enable_prefix_caching=False, async_scheduling=True
    )
    model = tiny_model(default_model_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 49000, size=int(n)).tolist() for n in rng.integers(3, 20, size=128)]
    # Penalties need each step's tokens on the host: while a penalized request runs, steps go one after the other;
    # once they are done, async scheduling launches each step before reading the previous one's results.
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logit_bias={11: 5.0, 12: -3.0}),
    ]
    leader = LLM(model, **engine)
    leader.engine.runner.channel = recorder = _Recorder()
    outs = leader.generate(prompts, [params[k % 3] for k in range(128)], use_tqdm=False)
    want = sorted(o.outputs[0].token_ids for o in outs)

    follower = LLM(model, **engine)
    runner = follower.engine.runner
    runner.channel = _Replay(recorder.messages)
    got = defaultdict(list)
    collect = runner.collect

    def recording_collect(flight):
        result = collect(flight)
        for rid, toks in result.sampled.items():
            got[rid].extend(t.token_id for t in toks)
        return result

    runner.collect = recording_collect
    ok, _ = follower.engine.follow()
    assert ok
    assert sorted(got.values()) == want

    decode_sizes = []
    decoder = StepDecoder()
    for data in recorder.messages[:-1]:  # the last is the end
        sched, _ = decoder.decode(pickle.loads(zlib.decompress(data))[1])
        if sched.scheduled and all(s.new is None and len(s.token_ids) == 1 for s in sched.scheduled):
            decode_sizes.append((len(sched.scheduled), len(data)))
    assert any(n == 128 for n, _ in decode_sizes), decode_sizes
    ahead = [pickle.loads(zlib.decompress(data))[2] for data in recorder.messages[:-1]]
    assert 0 in ahead and 1 in ahead, ahead  # steps one after the other, and steps launched ahead
    assert max(size for _, size in decode_sizes) <= DECODE_STEP_BYTES, decode_sizes


def _meshes(per_process: int, processes: int, tp: int):
    """Stand-ins for the replicas' meshes: ``processes`` x ``per_process`` devices, in order, ``tp`` per replica."""
    from types import SimpleNamespace

    devices = [SimpleNamespace(process_index=p) for p in range(processes) for _ in range(per_process)]
    return [SimpleNamespace(devices=np.array(devices[i : i + tp])) for i in range(0, len(devices), tp)]


@pytest.mark.parametrize(
    ("per_process", "processes", "tp", "groups"),
    [
        (1, 4, 2, [((0, 1), [0]), ((2, 3), [1])]),  # a replica spans two processes
        (2, 2, 2, [((0,), [0]), ((1,), [1])]),  # a replica per process
        (2, 2, 1, [((0,), [0, 1]), ((1,), [2, 3])]),  # two replicas per process
        (4, 2, 8, [((0, 1), [0])]),  # one replica over everything
    ],
)
def test_replicas_are_grouped_by_the_processes_they_span(per_process, processes, tp, groups):
    from jaxserve.parallel.distributed import replica_groups

    assert replica_groups(_meshes(per_process, processes, tp)) == groups


def test_a_replica_sharing_a_process_with_another_is_refused():
    """3 processes x 2 devices at tensor parallelism 3: replica 0 takes process 1's first device, replica 1 its
    second. Process 1 could not follow two groups' steps in order."""
    from jaxserve.parallel.distributed import replica_groups

    with pytest.raises(ValueError, match=r"replica 0 spans processes \[0, 1\] and replica 1 processes \[1, 2\]"):
        replica_groups(_meshes(2, 3, 3))


@pytest.mark.slow
def test_sampler_arrays_no_row_uses_stay_on_the_device(default_model_path):
    """One process too: the token history, bias entries and token mask of a batch without penalties, biases or
    grammars are device arrays placed once (the same objects step after step), not host arrays sent every step;
    a row with a penalty still gets its own history (placed for that step)."""
    import jax

    runner = LLM(tiny_model(default_model_path), max_num_seqs=32, max_model_len=256).engine.runner
    greedy = [SamplingParams(temperature=0.0)] * 32
    first = runner.sampling_metadata(greedy, pad_to=32)
    second = runner.sampling_metadata(greedy[:5], pad_to=32)
    for name in ("history", "bias_ids", "bias_values", "token_mask"):
        assert isinstance(getattr(first, name), jax.Array), name
        assert getattr(first, name) is getattr(second, name), name
    host = sum(x.nbytes for x in jax.tree.leaves(first) if isinstance(x, np.ndarray))
    assert host <= 2048, host  # the per-row scalars: 32 rows x 12 words, 1,536 B
    penalized = runner.sampling_metadata(
        [SamplingParams(repetition_penalty=1.2)], prompt_ids=[[5, 6]], output_ids=[[7]], pad_to=32
    )
    assert penalized.history is not first.history and np.asarray(penalized.history)[0, :3].tolist() == [5, 6, 7]
