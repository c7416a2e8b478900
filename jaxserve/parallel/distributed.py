"""Several hosts, one SPMD program: ``jax.distributed`` and the step channel from process 0 to the others.

Every process builds the same global mesh (over every host's devices) and runs the same jitted step on the same
inputs; only process 0 runs the scheduler (and the HTTP server). Process 0 publishes each step's packed inputs
on JAX's coordination service (the key-value store ``jax.distributed`` starts; no RPC of our own), and the other
processes ("followers") replay them in order, so every process launches the same collectives in the same order.

Faults end the group, always, and fast. A process that fails (an uncaught exception, a start-up error, a
signal) calls ``fatal``: it posts "process N: what went wrong" under one key of the coordination service and
leaves at once with ``os._exit`` (a normal exit would wait in ``jax.distributed``'s shutdown barrier for processes
that never come). Every process runs a watchdog thread blocked on that key; when it appears, the process prints
the message and exits non-zero too, wherever its main thread is stuck (a collective, a key-value wait). Process 0,
which hosts the coordination service, leaves last: it waits (a few seconds at most) until the others have read
the message, so that every log names the cause. A process
killed outright (SIGKILL, a lost host) posts nothing: every follower counts a heartbeat of its own under a key, and
process 0 ends the group when one has not moved for ``heartbeat_timeout`` (exit status ``PROCESS_LOST_EXIT``); a
follower whose process 0 stops answering ends itself the same way, and one that loses process 0's connections
exits at once. jax's own heartbeat check, which would abort every process (SIGABRT), is the backstop.
SIGTERM and SIGINT end the group the same way, except on process 0 while it serves HTTP: there the server drains
its requests first, then releases the followers, and every process exits 0.

Agreement: every process must run the same program on the same shapes, so ``agree`` checks that each process'
settings (model, pool, scheduler) equal process 0's before anything is allocated, and names the first difference.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import zlib

import jax

logger = logging.getLogger("jaxserve.parallel.distributed")

_ACK_EVERY = 16
DEFAULT_HEARTBEAT_TIMEOUT_S = int(os.environ.get("JAXSERVE_HEARTBEAT_TIMEOUT_S", 20))
# Process 0's exit status when it finds another process lost (no heartbeat for the timeout: killed, hung or
# unreachable); docs/parallelism.md.
PROCESS_LOST_EXIT = 3


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
    before process 0 gives it up and ends the group (exit status ``PROCESS_LOST_EXIT`` on process 0).

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
    timeout = heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S
    # jax's own heartbeat check aborts every process (SIGABRT and a C++ stack dump: its client's callback cannot be
    # replaced from Python) when a process goes silent; ours (_watch_heartbeats) ends the group first, cleanly, so
    # jax's is a backstop given twice the time and 30 s more. With twice the time alone, a busy host lost the race:
    # our check restarts its count when its own thread was held up (to blame no follower for it), and on two loaded
    # cores jax's 10 s check aborted process 0 (SIGABRT) before ours, at 5 s, had named the lost process.
    jax.distributed.initialize(coordinator, num_processes, process_id, heartbeat_timeout_seconds=_backstop_s(timeout))
    logger.info(
        "process %d of %d; %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    if jax.process_count() > 1:
        _install_fault_handlers(timeout)


def _backstop_s(timeout: float) -> int:
    """jax's own heartbeat timeout for ours of ``timeout`` seconds: late enough that ours always ends the group first."""
    return int(2 * timeout + 30)


def multi_process() -> bool:
    return jax.process_count() > 1


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def _timed_out(e: Exception) -> bool:
    """Whether a key-value wait ended because its time ran out (the key is not there yet), not on an error."""
    return "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower()


def _wait_for(get, key: str, poll_ms: int):
    """``get(key, poll_ms)`` (a blocking key-value get) again until the key is there; other errors propagate."""
    while True:
        try:
            return get(key, poll_ms)
        except Exception as e:  # noqa: BLE001 - the client raises a plain XlaRuntimeError
            if not _timed_out(e):
                raise


class StepChannel:
    """One process -> some others: an ordered stream of small Python messages (pickled, compressed).

    Process 0 -> the others by default; a data-parallel group's results come back on one the other way
    (``jaxserve.engine.remote_replica``). Each stream has its own keys, under ``name``.

    The sender's ``send`` only queues the message: a sender thread stores it under its own key, off the step's
    critical path. Each receiver says how far it has read every ``_ACK_EVERY`` messages, and the sender deletes
    only what every receiver has read, so a receiver that lags (behind messages that run no collective, such as
    an end or a copy-only step) never finds its next message gone.
    """

    def __init__(self, name: str = "g0", sender: int = 0, receivers: list[int] | None = None, poll_s: float = 1.0):
        me = jax.process_index()
        self.sender = sender
        self.receivers = [p for p in range(jax.process_count()) if p != sender] if receivers is None else receivers
        self.leader = me == sender
        if not self.leader and me not in self.receivers:
            raise ValueError(f"process {me} neither sends nor receives on step channel {name!r}")
        self._prefix, self._read_prefix = f"jaxserve/{name}/step/", f"jaxserve/{name}/read/"
        self.poll_ms = int(poll_s * 1000)
        self._next = 0
        if self.leader:
            self._queue: queue.Queue[bytes] = queue.Queue()
            threading.Thread(target=self._send_loop, name=f"jaxserve-send-{name}", daemon=True).start()

    def send(self, message) -> None:
        self._queue.put(zlib.compress(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), 1))

    def flush(self) -> None:
        """Returns once every message sent is stored (before process 0 exits, so its last one is not lost)."""
        self._queue.join()

    def _send_loop(self) -> None:
        client = _client()
        stored = deleted = 0
        while True:
            data = self._queue.get()
            try:
                client.key_value_set_bytes(f"{self._prefix}{stored}", data)
                stored += 1
                if stored % _ACK_EVERY == 0:
                    read = [int(v) for _, v in client.key_value_dir_get(self._read_prefix)]
                    upto = min(read) if len(read) == len(self.receivers) else 0
                    for n in range(deleted, upto):
                        client.key_value_delete(f"{self._prefix}{n}")
                    deleted = max(deleted, upto)
            except Exception as e:  # noqa: BLE001 - the service is gone: nothing can follow any more
                if not (_state["exiting"] or _state["ending"]):
                    fatal(f"cannot publish message {stored}: {str(e).splitlines()[0][:300]}")
                return
            finally:
                self._queue.task_done()

    def recv(self):
        """The next message; waits as long as the sender is alive (idle servers send nothing for hours)."""
        client = _client()
        try:
            data = _wait_for(client.blocking_key_value_get_bytes, f"{self._prefix}{self._next}", self.poll_ms)
        except Exception as e:  # noqa: BLE001 - the client raises a plain XlaRuntimeError
            raise FollowerLost(
                f"process {jax.process_index()} lost process {self.sender} while waiting for message {self._next}: {e}"
            ) from e
        self._next += 1
        if self._next % _ACK_EVERY == 0:
            client.key_value_set(f"{self._read_prefix}{jax.process_index()}", str(self._next), allow_overwrite=True)
        return pickle.loads(zlib.decompress(data))


def replica_groups(meshes) -> list[tuple[tuple[int, ...], list[int]]]:
    """Data-parallel replicas over processes: ``[(processes, replica indices), ...]``, one entry per group of
    processes whose replicas are theirs alone, process 0's first. A replica spans whole processes (one replica per
    group) or lies in one process (a group of one process, one replica or more).

    Raises:
        ValueError: a replica shares a process with another one that spans other processes too.
    """
    procs = [tuple(sorted({d.process_index for d in m.devices.flat})) for m in meshes]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(procs):
        groups.setdefault(p, []).append(i)
    seen: dict[int, tuple[int, ...]] = {}
    for p in groups:
        for q in p:
            if q in seen:
                i, j = groups[seen[q]][0], groups[p][0]
                raise ValueError(
                    f"replica {i} spans processes {list(seen[q])} and replica {j} processes {list(p)}: each "
                    f"data-parallel replica must span whole processes or lie in one (make tensor_parallel_size a "
                    f"multiple or a divisor of the {jax.local_device_count()} devices each process has)"
                )
            seen[q] = p
    return sorted(groups.items(), key=lambda g: g[0][0])


# ------------------------------------------------------------------ faults end the group
_FATAL_KEY = "jaxserve/fatal"
_state = {"ending": False, "exiting": False, "agree_round": 0, "answered": 0.0}


def fatal(message: str, code: int = 1, lost: tuple[int, ...] = ()) -> None:
    """Ends every process of the group: posts ``message`` (naming this process) for the others' watchdogs, logs it
    and leaves at once with ``code`` (process 0 first waits, briefly, until the others but ``lost`` have read it).
    Never returns."""
    _state["ending"] = True
    text = f"process {jax.process_index()}: {message}"
    print(f"jaxserve: ending every process: {text}", file=sys.stderr, flush=True)

    def post():
        try:
            _client().key_value_set(_FATAL_KEY, text)
        except Exception:  # noqa: BLE001 - another process posted first, or the service is gone: exit anyway
            pass

    if 0 not in lost:  # the service is process 0's: nothing to post to when it is the one lost
        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        poster.join(5.0)  # the service may be unreachable: never wait long for it
    _linger_for_the_others(text, lost)
    logging.shutdown()
    os._exit(code)


_SEEN_KEY = "jaxserve/fatal_seen/"
_LINGER_S = 5.0


def _linger_for_the_others(text: str, lost: tuple[int, ...] = ()) -> None:
    """On process 0, which hosts the coordination service: waits (at most ``_LINGER_S``) until every other live
    process (not the culprit, not those ``lost``) has read the fatal message, so that each of them names the cause
    instead of a lost service (their own clients may also abort the process when the service goes first). A no-op
    on the other processes."""
    if jax.process_index() != 0 or jax.process_count() < 2:
        return
    culprit = text.split(":", 1)[0].removeprefix("process ")

    def wait():
        client = _client()
        for i in range(1, jax.process_count()):
            if str(i) != culprit and i not in lost:
                try:
                    client.blocking_key_value_get(f"{_SEEN_KEY}{i}", int(_LINGER_S * 1000))
                except Exception:  # noqa: BLE001 - timed out (a dead or hung process): leave anyway
                    return

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(_LINGER_S)


def _watch() -> None:
    """Every process' watchdog: waits for another process' ``fatal`` and ends this one too."""
    client = _client()
    while True:
        # Short waits: the thread must be out of the C++ call before the interpreter exits (see
        # _install_fault_handlers), and a wait cannot be cancelled.
        if _state["exiting"] or _state["ending"]:
            return
        try:
            text = client.blocking_key_value_get(_FATAL_KEY, 1000)
            break
        except Exception as e:  # noqa: BLE001 - a plain XlaRuntimeError
            if _state["exiting"] or _state["ending"]:
                return  # our own shutdown cancels the wait
            if _timed_out(e):
                continue
            # The coordination service is gone (process 0 died): nothing can run a collective any more.
            text = f"lost the coordination service: {str(e).splitlines()[0][:300]}"
            break
    if _state["ending"]:
        return
    _state["ending"] = True  # the other threads stand down (no second cause named)
    print(f"jaxserve: process {jax.process_index()} ends: {text}", file=sys.stderr, flush=True)
    if not text.startswith("lost the coordination service"):
        try:  # tell process 0 this one has read the cause (it waits for that before taking the service down)
            client.key_value_set(f"{_SEEN_KEY}{jax.process_index()}", "1")
        except Exception:  # noqa: BLE001 - the service is gone: nothing to tell
            pass
        _linger_for_the_others(text)
    os._exit(1)


_ALIVE_KEY = "jaxserve/alive/"
_LEFT = "left"
_stop_beating = threading.Event()


def _beat(interval: float) -> None:
    """A follower's heartbeat for process 0: a counter under its own key, every ``interval`` seconds; "left" once
    it exits on its own (``_install_fault_handlers``). Each answer of the service (process 0's) is noted for
    ``_watch_process_0``."""
    client, me, n = _client(), jax.process_index(), 0
    while not (_stop_beating.is_set() or _state["ending"]):
        try:
            client.key_value_set(f"{_ALIVE_KEY}{me}", str(n), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service is gone: the watchdog ends this process
            return
        _state["answered"] = time.monotonic()
        n += 1
        _stop_beating.wait(interval)


def _watch_process_0(timeout: float, interval: float) -> None:
    """A follower's check of process 0: its coordination service has not answered a heartbeat (``_beat``) for
    ``timeout`` seconds (process 0 stopped, or its host unreachable) ends this process with ``PROCESS_LOST_EXIT``,
    before jax's own check (``_backstop_s``) would abort it. A process 0 that dies outright closes its connections:
    jax's client then aborts this process at once (a C++ thread of its own, which no Python thread outruns)."""
    _state["answered"] = before = time.monotonic()
    while not _stop_beating.wait(interval):
        if _state["ending"] or _state["exiting"]:
            return
        now = time.monotonic()
        if now - before > max(2 * interval, timeout / 2):  # this process was held up, not process 0
            _state["answered"] = now
        before = now
        if now - _state["answered"] > timeout:
            fatal(f"lost process 0: no answer for {timeout:g} s (stopped, or unreachable)", PROCESS_LOST_EXIT, (0,))


def _watch_heartbeats(timeout: float, interval: float) -> None:
    """Process 0's check of its followers' heartbeats (``_beat``): a follower whose counter has not moved for
    ``timeout`` seconds (killed, hung, unreachable) ends the group, naming it, with ``PROCESS_LOST_EXIT``. jax's
    own heartbeat check would end it too, later, by aborting every process. A pause of this thread itself (an
    interpreter held up) restarts the count rather than blaming the followers."""
    client = _client()
    start = time.monotonic()
    seen = {i: (None, start) for i in range(1, jax.process_count())}  # process -> (its counter, when it moved)
    before = start
    while seen and not _stop_beating.wait(interval):
        if _state["ending"] or _state["exiting"]:
            return
        try:
            beats = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(_ALIVE_KEY)}
        except Exception:  # noqa: BLE001 - the service is shutting down with this process
            return
        now = time.monotonic()
        held_up = now - before > max(2 * interval, timeout / 2)
        before = now
        for i, (count, moved) in list(seen.items()):
            beat = beats.get(str(i))
            if beat == _LEFT:
                del seen[i]  # it exits on its own
            elif beat != count or held_up:
                seen[i] = (beat, now)
            elif now - moved > timeout:
                if _state["ending"] or _state["exiting"]:
                    return
                fatal(
                    f"lost process {i}: no heartbeat for {timeout:g} s (killed, hung or unreachable)",
                    PROCESS_LOST_EXIT,
                    lost=(i,),
                )


def _install_fault_handlers(heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
    """The watchdog thread, the heartbeat threads (a follower's beat, process 0's check of them), an excepthook
    and SIGTERM / SIGINT handlers that end the whole group (see the module's docstring). They replace the handler
    ``jax.distributed`` installs for SIGTERM (a preemption notice)."""
    import atexit

    watchdog = threading.Thread(target=_watch, name="jaxserve-fault-watch", daemon=True)
    watchdog.start()
    interval = max(0.2, heartbeat_timeout_s / 5)
    timing = (heartbeat_timeout_s, interval)
    if jax.process_index() == 0:
        hearts = [threading.Thread(target=_watch_heartbeats, args=timing, name="jaxserve-heartbeats", daemon=True)]
    else:
        hearts = [
            threading.Thread(target=_beat, args=(interval,), name="jaxserve-heartbeat", daemon=True),
            threading.Thread(target=_watch_process_0, args=timing, name="jaxserve-process-0", daemon=True),
        ]
    for heart in hearts:
        heart.start()

    def stop_watching():  # runs before jax.distributed's shutdown (atexit is last in, first out)
        # A daemon thread still inside a C++ call when the interpreter finalizes aborts the process (SIGABRT).
        _state["exiting"] = True
        _stop_beating.set()
        for heart in hearts:
            heart.join(5.0)
        if jax.process_index() != 0 and not _state["ending"]:
            try:  # process 0 stops counting this one's heartbeats
                _client().key_value_set(f"{_ALIVE_KEY}{jax.process_index()}", _LEFT, allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service is gone: nobody counts
                pass
        watchdog.join(5.0)

    atexit.register(stop_watching)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)
        fatal(f"{kind.__name__}: {value}")

    sys.excepthook = excepthook
    if threading.current_thread() is threading.main_thread():  # only the main thread may set signal handlers
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    fatal(f"received {signal.Signals(signum).name}", 128 + signum)


def exit_group(code: int, message: str = "") -> int:
    """``code`` for a process leaving on its own; under several processes a non-zero ``code`` ends them all
    (``fatal``) instead of waiting in the shutdown barrier."""
    if code and multi_process():
        fatal(message or f"exited with status {code}", code)
    return code


# ------------------------------------------------------------------ agreement
def agree(what: str, settings: dict) -> None:
    """Checks that this process' ``settings`` (name -> value) equal process 0's; a no-op on one process.

    Process 0 posts its settings; every other process compares its own with them, field by field.

    Raises:
        ValueError: this process' settings differ from process 0's (the first few differences named).
    """
    if not multi_process():
        return
    text = {k: repr(v) for k, v in settings.items()}
    key = f"jaxserve/agree/{_state['agree_round']}/{what}"
    _state["agree_round"] += 1
    client = _client()
    if jax.process_index() == 0:
        client.key_value_set(key, json.dumps(text))
        return
    theirs = json.loads(_wait_for(client.blocking_key_value_get, key, 60_000))  # process 0 may load for minutes
    diff = [
        f"{k}={text.get(k)} (process 0: {theirs.get(k)})"
        for k in sorted(set(text) | set(theirs))
        if text.get(k) != theirs.get(k)
    ]
    if diff:
        raise ValueError(
            f"process {jax.process_index()}'s {what} differ from process 0's: {', '.join(diff[:6])}"
            f"{' ...' if len(diff) > 6 else ''}; every process must be started with the same settings"
        )
