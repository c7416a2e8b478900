"""Several hosts, one SPMD program: ``jax.distributed`` and the step channel from process 0 to the others.

Every process builds the same global mesh (over every host's devices) and runs the same jitted step on the same
inputs; only process 0 runs the scheduler (and the HTTP server). Process 0 publishes each step's packed inputs
on JAX's coordination service (the key-value store ``jax.distributed`` starts; no RPC of our own), and the other
processes ("followers") replay them in order, so every process launches the same collectives in the same order.

Failure: the coordination service watches every process' heartbeat. A dead follower makes process 0's next
collective fail or its heartbeat check abort it; a dead process 0 takes the coordination service with it, and a
follower waiting for a step gets an error within ``heartbeat_timeout`` and exits non-zero with a message naming
the cause (``FollowerLost``).
"""

from __future__ import annotations

import logging
import os
import pickle
import zlib

import jax

logger = logging.getLogger("jaxserve.distributed")

_PREFIX = "jaxserve/step/"
DEFAULT_HEARTBEAT_TIMEOUT_S = int(os.environ.get("JAXSERVE_HEARTBEAT_TIMEOUT_S", 20))


class FollowerLost(RuntimeError):
    """A follower lost process 0 (dead, hung or unreachable)."""


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int | None = None,
) -> None:
    """Joins this process to a multi-process JAX runtime (before any other JAX call).

    With ``coordinator``, ``num_processes`` and ``process_id`` given, it joins that group (process 0 hosts the
    coordination service at ``coordinator``); with none of them, ``jax.distributed.initialize()`` detects the
    group itself (Cloud TPU VMs of a multi-host slice, SLURM, ...). On the CPU, collectives go over gloo.

    ``heartbeat_timeout_s`` (default: $JAXSERVE_HEARTBEAT_TIMEOUT_S, else 20): how long a silent process may take
    before the others give it up and exit.

    Raises:
        ValueError: only some of the three are given, or they are inconsistent.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together (or none, to auto-detect)")
    if all(given) and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    if jax.config.jax_platforms in (None, "", "cpu") and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S,
    )
    logger.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def multi_process() -> bool:
    return jax.process_count() > 1


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class StepChannel:
    """Process 0 -> every other process: an ordered stream of small Python messages (pickled, compressed).

    Message ``n`` lives under its own key until every process has run step ``n + 1`` (the step's collectives
    prove they read it), so the store holds at most a few messages.
    """

    def __init__(self, poll_s: float = 1.0):
        self.leader = jax.process_index() == 0
        self.poll_ms = int(poll_s * 1000)
        self._next = 0

    def send(self, message) -> None:
        client = _client()
        client.key_value_set_bytes(f"{_PREFIX}{self._next}", zlib.compress(pickle.dumps(message), 1))
        if self._next >= 2:
            client.key_value_delete(f"{_PREFIX}{self._next - 2}")
        self._next += 1

    def recv(self):
        """The next message; waits as long as process 0 is alive (idle servers send nothing for hours)."""
        key = f"{_PREFIX}{self._next}"
        client = _client()
        while True:
            try:
                data = client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # noqa: BLE001 - the client raises a plain XlaRuntimeError
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise FollowerLost(
                        f"process {jax.process_index()} lost process 0 while waiting for step {self._next}: {e}"
                    ) from e
        self._next += 1
        return pickle.loads(zlib.decompress(data))
