"""What the endpoint handlers share: the served model, tokenizing, admission, SSE and client disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.exceptions import EngineDeadError, EngineStepError, ServerBusyError
from jaxserve.server import DEFAULT_MAX_PROMPT_CHARS
from jaxserve.server.async_engine import AsyncEngine, RequestStream
from jaxserve.server.errors import APIError, JSONResponse, error_body

# Inputs (characters or token ids) beyond which tokenizing, rendering and detokenizing run in a worker thread. The
# tokenizer lets go of the GIL for such inputs (jaxserve.tokenizer), so the event loop keeps answering meanwhile.
LONG_INPUT = 16 * 1024


async def off_loop(size: int, fn: Callable, *args):
    """``fn(*args)``, in a worker thread when ``size`` (the input's length) is large, else right here."""
    if size > LONG_INPUT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


@dataclasses.dataclass
class ServerState:
    """One server's engine and settings (``app.state.server``)."""

    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    tokenizer_info: dict | None = None  # GET /tokenizer_info's answer, made on first use

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name ``name`` asks for (None: the first); 404 for any other."""
        if name is None or name in self.served_model_names:
            return name or self.model_name
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {self.served_model_names}.",
            param="model",
            code="model_not_found",
        )

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """400 naming the limit when a prompt is longer than ``max_prompt_chars`` (checked before any tokenizing)."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise APIError(
                400,
                f"The {param} has {num_chars} characters, more than this server's limit of {limit} "
                "(--max-prompt-chars).",
                param=param,
                code="prompt_too_long",
            )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a long text is tokenized in a worker thread, the event loop free meanwhile."""
        try:
            text.encode()
        except UnicodeEncodeError as e:  # JSON can carry a lone surrogate ("\\ud800"); no tokenizer can
            raise APIError(400, f"the text is not valid Unicode: {e.reason} at character {e.start}") from e
        return await off_loop(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        return await off_loop(len(ids), self.tokenizer.decode, ids, False)

    async def add_all(
        self, base_id: str, prompts: list[list[int]], params: SamplingParams, priority: int, arrival: float
    ) -> list[RequestStream]:
        """Admits every prompt of a request at once, or none, mapping refusals to HTTP errors (503 + Retry-After
        when busy, 400 naming the bad prompt when invalid)."""
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{k}" for k in range(len(prompts))]
        try:
            return await self.engine.add_requests(list(zip(ids, prompts)), params, priority, arrival)
        except ServerBusyError as e:
            raise APIError(503, str(e), code="server_busy", headers={"Retry-After": str(e.retry_after)}) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead", headers={"Retry-After": "30"}) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: RequestStream):
        try:
            async for out in s:
                q.put_nowait((k, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            q.put_nowait((k, e))
        finally:
            q.put_nowait((k, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for k, out in merge(streams):
        finals[k] = out
    return finals


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"  # ASCII: see errors.JSONResponse


def sse_error(e: BaseException) -> str:
    status = 503 if isinstance(e, (EngineDeadError, ServerBusyError)) else 400
    if isinstance(e, EngineStepError):
        status = 500
    return sse(error_body(status, str(e)))


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that runs ``on_close`` however it ends (done, client gone, cancelled), so a
    request whose client disconnected is aborted even if its body iterator never started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable):
    """Runs ``work`` unless the client goes away first; then cancels it (its ``finally`` aborts its requests)
    and returns None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


def close_all(streams: list[RequestStream]) -> Callable[[], None]:
    def close():
        for s in streams:
            s.close()

    return close


async def respond(
    raw: Request,
    streams: list[RequestStream],
    stream: bool,
    events: Callable[[list[RequestStream]], AsyncIterator[str]],
    body: Callable[[list[RequestOutput]], dict],
) -> Response:
    """A handler's answer: the SSE ``events`` when ``stream``, else ``body`` of every stream's final output as
    JSON (499 when the client left first). However it ends, the streams are closed: unfinished requests abort."""
    if stream:
        return SSEResponse(events(streams), on_close=close_all(streams))

    async def wait():
        try:
            return await final_outputs(streams)
        finally:
            close_all(streams)()

    finals = await until_disconnect(raw, wait())
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(body(finals))
