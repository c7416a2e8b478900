"""AsyncEngine: the LLMEngine (not thread-safe) in one background thread, streamed to asyncio handlers.

The engine thread owns the engine: it drains an inbox of add/abort commands between steps, runs ``step()``
while there is work, and hands each step's outputs to the event loop in one ``call_soon_threadsafe``. The event
loop side keeps one mailbox per request (its newest output: outputs are cumulative, so a slow reader skips
ahead and holds one output, not a backlog), the admission limit and the latency metrics. Nothing but the inbox
and those callbacks crosses between the two threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

from jaxserve.core.kv_events import make_publisher
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.exceptions import EngineDeadError, EngineStepError, ServerBusyError
from jaxserve.sampling.structured import ConstraintUnsatisfiable
from jaxserve.server.errors import APIError
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger("jaxserve.server")

_ABORTED = object()  # the end of a stream the engine aborted (shutdown, drain)
MAX_STEP_FAILURES = 3  # consecutive failed engine steps after which the engine is declared dead


@dataclasses.dataclass
class _Stream:
    request_id: str
    num_prompt_tokens: int
    n: int  # sequences
    arrival: float
    added: asyncio.Future
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None  # the newest output not yet read
    end: object = None  # _ABORTED or an exception, after ``latest``
    waiting: bool = True  # admitted, no token yet: what the admission limit counts
    first_token: float | None = None
    last_token: float = 0.0
    num_tokens: int = 0


class RequestStream:
    """Async iterator over one request's cumulative ``RequestOutput``s; the last one is ``finished``.

    A reader that falls behind skips to the newest output (each holds all text so far). ``close()`` aborts
    the request in the engine unless it finished; callers put it in a ``finally``.
    """

    def __init__(self, engine: AsyncEngine, stream: _Stream):
        self._engine, self._stream = engine, stream
        self.request_id = stream.request_id
        self.done = False
        self.last: RequestOutput | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        st = self._stream
        if st.latest is None and st.end is None:
            await st.ready.wait()
        st.ready.clear()
        item, st.latest = st.latest, None
        if item is None:  # nothing new: the stream ended
            if isinstance(st.end, BaseException):
                self.done = True
                raise st.end
            item = _aborted(self.last, self.request_id, st.n)
        self.last = item
        self.done = item.finished
        return item

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._engine.abort(self.request_id)


def _aborted(last: RequestOutput | None, request_id: str, n: int) -> RequestOutput:
    """The final output of a request the engine aborted: what it had, each unfinished sequence ``abort``."""
    if last is None:
        outs = [CompletionOutput(i, "", [], None, None, "abort") for i in range(n)]
        return RequestOutput(request_id, None, [], outs, True)
    outs = [o if o.finish_reason else dataclasses.replace(o, finish_reason="abort") for o in last.outputs]
    return dataclasses.replace(last, outputs=outs, finished=True)


class AsyncEngine:
    """Serves an ``LLMEngine`` to coroutines.

    Args:
        engine: the engine; from ``start()`` on only the engine thread touches it.
        model_name: the name metrics are labeled with.
        max_waiting: admitted requests without a first token beyond which new ones get ``ServerBusyError``.
        kv_events: a ``jaxserve.core.kv_events.KVEventsConfig`` (or its dict / JSON): when enabled, the engine records
            its prefix cache's changes and the engine thread hands each step's to a ZMQ publisher, which
            ``start()`` opens and ``shutdown()`` closes.

    Raises:
        ValueError: a bad ``kv_events``, or an engine that cannot record KV events.
        ImportError: ``kv_events`` is enabled but pyzmq or msgpack is missing.
    """

    def __init__(self, engine, model_name: str | None = None, max_waiting: int = 256, kv_events=None):
        self.kv_publisher = make_publisher(kv_events)
        if self.kv_publisher is not None:
            if not hasattr(engine, "enable_kv_events"):
                raise ValueError(f"{type(engine).__name__} does not record KV-cache events")
            engine.enable_kv_events()
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats: dict = engine.get_stats()  # the engine thread replaces it after every step
        self.metrics = ServerMetrics(
            model_name or engine.model_name, lambda: self.stats, _cache_info(engine, self.stats)
        )
        self.draining = False
        self.dead: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0
        self._step_failures = 0  # consecutive
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle (event loop)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts what is left in the engine and stops its thread."""
        self.draining = True
        if self._thread is None:
            return
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)
        if self.kv_publisher is not None:
            await asyncio.to_thread(self.kv_publisher.close)

    def begin_drain(self, grace: float) -> None:
        """Thread-safe (a signal handler calls it): new requests are refused from now on, and those still running
        after ``grace`` seconds are aborted, so their streams end with ``finish_reason: "abort"``."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, max(grace, 0.0), self.abort_all)

    def abort_all(self) -> None:
        """Aborts every request; each stream ends with ``finish_reason: "abort"``."""
        self._inbox.put(("abort_all",))

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    # ------------------------------------------------------------------ requests (event loop)
    async def add_requests(
        self,
        items: Sequence[tuple[str, Sequence[int]]],
        params: SamplingParams,
        priority: int = 0,
        arrival: float | None = None,
    ) -> list[RequestStream]:
        """Queues the ``(request_id, prompt_ids)`` of one client request as one command: the engine admits them
        all between two steps (so the next step can schedule them all), or none. Returns their streams.

        Raises:
            ServerBusyError: too many requests waiting, or shutting down.
            EngineDeadError: the engine thread has failed.
            ValueError: the engine rejected one of them (then none is queued), or an id is in use.
        """
        if self.dead is not None or not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.dead!r})")
        if self.draining:
            raise ServerBusyError("the server is shutting down", retry_after=5)
        if self._num_waiting >= self.max_waiting:
            raise ServerBusyError(
                f"{self._num_waiting} requests are already waiting (limit {self.max_waiting}); retry later"
            )
        structured = getattr(self.engine, "structured", None)
        if params.structured_outputs is not None and structured is not None:
            # Compile the grammar here, in a worker thread (cached by the engine), so the engine thread, which
            # compiles it again when it admits the request, finds it ready and the steps do not wait for it. A
            # grammar that does not compile is a ValueError (400) before anything is queued.
            await asyncio.get_running_loop().run_in_executor(None, structured.compile, params.structured_outputs)
        ids = [rid for rid, _ in items]
        in_use = next((rid for k, rid in enumerate(ids) if rid in self._streams or rid in ids[:k]), None)
        if in_use is not None:
            raise ValueError(f"request id {in_use!r} is already in use")
        added = self._loop.create_future()  # one answer for all of them
        arrival = arrival or time.perf_counter()
        streams = [_Stream(rid, len(prompt), params.n, arrival, added) for rid, prompt in items]
        for st in streams:
            self._streams[st.request_id] = st
        self._num_waiting += len(streams)
        self._inbox.put(("add", [(rid, list(prompt), params, priority) for rid, prompt in items]))
        if self.dead is not None:  # the engine thread died after the check above: it may never read the inbox
            self._fail_all(EngineDeadError(f"the engine is not running ({self.dead!r})"))
        try:
            await added
        except BaseException:  # rejected by the engine, or the caller was cancelled meanwhile
            for rid in ids:
                self.abort(rid, count=False)
            raise
        return [RequestStream(self, st) for st in streams]

    def abort(self, request_id: str, count: bool = True) -> None:
        """Stops a request (e.g. its client went away); the engine frees its pages at its next command drain."""
        st = self._streams.pop(request_id, None)
        if st is None:
            return
        self._unwait(st)
        if count:
            self.metrics.finished("abort")
        self._inbox.put(("abort", request_id))

    def _unwait(self, st: _Stream) -> None:
        if st.waiting:
            st.waiting = False
            self._num_waiting -= 1

    # ------------------------------------------------------------------ callbacks from the engine thread
    def _acked(self, acks: list[tuple[str, BaseException | None]]) -> None:
        for rid, err in acks:
            st = self._streams.get(rid)
            if st is None or st.added.done():
                if err is None and st is None:
                    self._inbox.put(("abort", rid))  # its caller is gone (aborted, or failed by abort_all)
                continue
            if err is None:
                st.added.set_result(None)
            else:
                st.added.set_exception(err)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        for out in outputs:
            st = self._streams.get(out.request_id)
            if st is None:
                continue  # aborted meanwhile
            ntok = sum(len(o.token_ids) for o in out.outputs)
            if ntok > st.num_tokens:
                if st.first_token is None:
                    st.first_token = now
                    m.first_token(now - st.arrival, st.num_prompt_tokens, ntok)
                    self._unwait(st)
                else:
                    m.more_tokens(now - st.last_token, ntok - st.num_tokens)
                st.num_tokens, st.last_token = ntok, now
            st.latest = out
            st.ready.set()
            if out.finished:
                del self._streams[out.request_id]
                self._unwait(st)
                m.request_done(now - st.arrival, st.last_token - (st.first_token or st.last_token), st.num_tokens)
                m.finished((out.outputs[0].finish_reason or "stop") if out.outputs else "abort")

    def _fail_all(self, err: BaseException | None) -> None:
        """The engine aborted (err None: shutdown) or lost (err: it died) every request it had or was sent."""
        self._fail(list(self._streams), err)

    def _fail(self, request_ids, err: BaseException | None) -> None:
        """These requests end: aborted (err None) or failed with ``err``, which their readers get."""
        for rid in request_ids:
            st = self._streams.pop(rid, None)
            if st is None:
                continue
            self._unwait(st)
            if not st.added.done():
                st.added.set_exception(err or ServerBusyError("the server is shutting down", retry_after=5))
            st.end = _ABORTED if err is None else err
            st.ready.set()
            self.metrics.finished("error" if isinstance(err, (EngineStepError, APIError)) else "abort")

    # ------------------------------------------------------------------ the engine thread
    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        live: set[str] = set()  # requests the engine holds
        try:
            self._serve(live)
        except BaseException as e:  # whatever broke the loop, no request may wait forever
            logger.exception("the engine loop failed; the engine is dead")
            self.dead = e
            self._call(self._fail_all, EngineDeadError(f"the engine failed: {e!r}"))

    def _serve(self, live: set[str]) -> None:
        engine = self.engine
        while True:
            cmds = [self._inbox.get()] if not engine.has_unfinished_requests() else []
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            acks, stop = [], False
            for cmd in cmds:
                if cmd[0] == "add":
                    batch = cmd[1]
                    try:
                        _admit(engine, batch)
                        live.update(item[0] for item in batch)
                        acks += [(item[0], None) for item in batch]
                    except Exception as e:  # noqa: BLE001 - every rejection goes back to its caller
                        acks += [(item[0], e) for item in batch]
                elif cmd[0] == "abort":
                    if cmd[1] in live:
                        engine.abort_request(cmd[1])
                        live.discard(cmd[1])
                elif cmd[0] == "abort_all":
                    for rid in live:
                        engine.abort_request(rid)
                    live.clear()
                    self._call(self._fail_all, None)
                else:
                    stop = True
            if acks:
                self._call(self._acked, acks)
            if stop:
                for rid in live:
                    engine.abort_request(rid)
                self.stats = engine.get_stats()
                self._publish_kv_events()
                self._call(self._fail_all, None)
                return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                    self._step_failures = 0
                except Exception as e:
                    outputs = self._step_failed(e, live)
                now = time.perf_counter()
                for out in outputs:
                    if out.finished:
                        live.discard(out.request_id)
                # the stats first: a client that has its response and then scrapes /metrics sees this step's state
                self.stats = engine.get_stats()
                if outputs:
                    self._call(self._dispatch, outputs, now)
            else:
                self.stats = engine.get_stats()
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The step's KV-cache events, one batch per replica that has any."""
        if self.kv_publisher is not None:
            for rank, events in self.engine.drain_kv_events():
                self.kv_publisher.publish(events, rank)

    def _step_failed(self, e: Exception, live: set[str]) -> list[RequestOutput]:
        """A step raised. If the engine confined the failure to some requests (its ``StepFailed``: they are aborted,
        their pages freed), those fail with a 500 naming the cause and the step's other outputs are returned;
        anything else, or ``MAX_STEP_FAILURES`` steps in a row that failed with nothing to show, kills the thread."""
        failed, outputs = getattr(e, "request_ids", None), getattr(e, "outputs", None)
        if failed is None or outputs is None:
            raise e  # not confined: the engine's state is unknown
        self._step_failures = 0 if outputs else self._step_failures + 1
        if self._step_failures >= MAX_STEP_FAILURES:
            raise e
        cause = getattr(e, "cause", None) or e.__cause__ or e
        if isinstance(cause, ConstraintUnsatisfiable):  # the request asked for what cannot be generated: a 400
            err = APIError(400, str(cause), param="structured_outputs", code="invalid_request")
        else:
            logger.error("an engine step failed for %d request(s); the engine serves on", len(failed), exc_info=cause)
            err = EngineStepError(f"the engine step failed: {type(cause).__name__}: {cause}")
        live.difference_update(failed)
        self._call(self._fail, list(failed), err)
        return outputs


def _cache_info(engine, stats: dict) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` (vLLM's CacheConfig fields that jaxserve has), or None for an engine
    without a page pool (a test's fake)."""
    config = getattr(engine, "config", None)
    if config is None or not hasattr(config, "page_size"):
        return None
    return {
        "block_size": str(config.page_size),
        "num_gpu_blocks": str(stats.get("num_usable_pages", 0)),
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "cache_dtype": str(getattr(config, "kv_cache_dtype", None) or "auto"),
    }


def _admit(engine, batch: list[tuple]) -> None:
    """Adds ``(request_id, prompt_ids, params, priority)`` items to the engine, all of them or (ValueError) none."""
    add_requests = getattr(engine, "add_requests", None)
    if add_requests is not None:
        add_requests(batch)
        return
    added = []
    try:
        for rid, ids, params, priority in batch:
            engine.add_request(rid, ids, params, priority=priority)
            added.append(rid)
    except Exception:
        for rid in added:
            engine.abort_request(rid)
        raise
