"""Data-parallel replicas on other processes: process 0's stand-in for each, and the loop those processes run.

Under several processes with ``data_parallel_size`` > 1, each replica spans a group of processes or lies in one
(``distributed.replica_groups``). Process 0 schedules every replica, so one HTTP front and one ``LLM`` see them
all. The replicas of process 0's own group run in process 0, their other processes following as on one replica
(``ModelRunner.follow``). For every other group, process 0 holds a ``RemoteRunner`` per replica:

- ``launch`` sends the step's changes (``jaxserve.parallel.step_wire``: bytes, not arrays) on the group's step channel and
  returns at once;
- ``collect`` asks the group to read that replica's oldest step back, and waits for its results, which the
  group's first process sends on a channel of its own.

A group does exactly what process 0 asks, in process 0's order (``follow_group``), so every process of a replica
packs the same arrays, and with async scheduling each replica keeps a step in flight while process 0 schedules
the next one. The replicas' host work (packing, sampling, reading results back) runs in their own processes, in
parallel; process 0's share of a remote replica's step is encoding its changes and decoding its results.
"""

from __future__ import annotations

import collections
import dataclasses

import jax

from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.parallel.distributed import StepChannel
from jaxserve.parallel.step_wire import StepEncoder, has_changes
from jaxserve.runner.model_runner import ModelRunner, RunnerOutput


class GroupLink:
    """Process 0 <-> a group of processes serving replicas: steps out, results back."""

    def __init__(self, index: int, processes: tuple[int, ...]):
        self.processes = processes
        self.steps = StepChannel(f"g{index}", 0, list(processes))
        # The group's first process sends its replicas' results; the group's other processes only follow.
        results = jax.process_index() in (0, processes[0])
        self.results = StepChannel(f"g{index}-out", processes[0], [0]) if results else None


@dataclasses.dataclass(frozen=True)
class RemoteFlight:
    """A step launched on a remote replica: its results come back on ``collect``."""

    num_tokens: int


class RemoteRunner:
    """Process 0's stand-in for a replica whose devices other processes own (the runner interface the engine
    uses: ``launch``, ``collect``, ``warmup``, ``pool_donated`` and the counters ``get_stats`` sums)."""

    def __init__(self, link: GroupLink, index: int, num_pages: int):
        self.link, self.index, self.num_pages = link, index, num_pages
        self.num_compilations = self.num_tokens_computed = self.num_steps = 0
        self._encoder = StepEncoder()

    def launch(self, sched: SchedulerOutput, token_masks=None) -> RemoteFlight | None:
        if has_changes(sched):
            self.link.steps.send(("step", self.index, self._encoder.encode(sched, token_masks)))
        if not sched.scheduled:
            return None
        self.num_steps += 1
        self.num_tokens_computed += sched.num_scheduled_tokens
        return RemoteFlight(sched.num_scheduled_tokens)

    def collect(self, flight: RemoteFlight | None) -> RunnerOutput:
        if flight is None:
            return RunnerOutput({}, {})
        self.link.steps.send(("collect", self.index))
        result, self.num_compilations = self.link.results.recv()
        return result

    def warmup(self) -> int:
        return 0  # the group's processes warm their replicas up themselves

    def pool_donated(self) -> bool:
        return False  # a failed step on the group ends every process (jaxserve.parallel.distributed)


def follow_group(runners: list[ModelRunner], link: GroupLink):
    """A process of a remote group: runs process 0's steps on this group's replicas, and reads their results back
    when process 0 asks (the group's first process sends them), until process 0 sends an end; returns its payload.

    Raises:
        jaxserve.parallel.distributed.FollowerLost: process 0 died or became unreachable.
    """
    in_flight = [collections.deque() for _ in runners]
    while True:
        kind, *payload = link.steps.recv()
        if kind == "end":
            for runner, flights in zip(runners, in_flight):
                while flights:
                    runner.collect(flights.popleft())
            return payload[0]
        runner, flights = runners[payload[0]], in_flight[payload[0]]
        if kind == "step":
            flight = runner.launch_wire(payload[1])
            if flight is not None:
                flights.append(flight)
        else:  # "collect": process 0 reads this replica's oldest step
            result = runner.collect(flights.popleft())
            if link.results is not None:
                link.results.send((result, runner.num_compilations))
