"""The FastAPI application: routes, the auth and body-size guard, the engine's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxserve
from jaxserve.server import DEFAULT_MAX_PROMPT_CHARS
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.chat import create_chat_completion, render_chat
from jaxserve.server.completions import create_completion
from jaxserve.server.errors import JSONResponse, error_response, install_error_handlers
from jaxserve.server.params import check_token_ids
from jaxserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseObject,
    ResponseStreamEvent,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from jaxserve.server.responses import create_response
from jaxserve.server.serving import LONG_INPUT, ServerState
from jaxserve.server.tools import PARSERS

_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def _errors(*codes: int) -> dict:
    return {c: {"model": ErrorResponse} for c in codes}


def _streamed(model) -> dict:
    """200 of an endpoint that answers JSON, or server-sent events with ``stream: true`` (their schema is filled
    in by ``_tidy_openapi``)."""
    return {200: {"model": model, "content": {"text/event-stream": {}}}}


def _event_schema(chunk_ref: str) -> dict:
    """One server-sent event: ``data`` is a JSON chunk (or an error) or the final ``[DONE]``."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": chunk_ref}, {"$ref": "#/components/schemas/ErrorResponse"}]},
    }
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [{"const": "[DONE]"}, json_data]},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


class _Guard:
    """Pure ASGI: the API key (401) and the body size limit (413) before any route sees the request."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.state.api_key
        if key and scope["path"].startswith(_PROTECTED):
            given = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
            if len(given) > 1:  # which one to believe? (a proxy may have added one) Neither.
                return await error_response(400, "More than one Authorization header.", code="invalid_api_key")(
                    scope, receive, send
                )
            if not secrets.compare_digest(given[0] if given else b"", f"Bearer {key}".encode()):
                return await error_response(
                    401,
                    "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.state.max_body_bytes
        too_large = error_response(
            413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large"
        )
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            if not length.isdigit():
                return await error_response(400, "bad Content-Length header")(scope, receive, send)
            return await too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # buffer the body (it is small) so a chunked upload is held to the limit too
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await too_large(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel: http.disconnect when the client goes

        await self.app(scope, replay, send)


class _CountRejections:
    """Pure ASGI, outermost: each request answered with a refusal (4xx but 499, a client that left; 503) is counted in
    ``jaxserve:request_rejected_total`` by status, wherever it was refused: the guard (401, 413), validation and
    the handlers (400, 404), admission (503). /health's 503 reports the server's state and is not counted."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status != 499 or status == 503:
                    self.state.engine.metrics.rejected(status)
            await send(message)

        await self.app(scope, receive, counted)


def build_app(
    engine,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    max_waiting: int = 256,
    shutdown_timeout: float = 30.0,
    max_prompt_chars: int | None = DEFAULT_MAX_PROMPT_CHARS,
    tool_call_parser: str | None = None,
    kv_events=None,
) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``LLMEngine``); the engine thread runs while the app does.

    Args:
        served_model_names: names clients may send as ``model`` (default: the engine's model name).
        api_key: when set, /v1/*, /tokenize and /detokenize need ``Authorization: Bearer <api_key>``.
        max_body_bytes: larger request bodies are answered 413.
        max_waiting: admitted requests without a first token beyond which new ones are answered 503.
        max_prompt_chars: a longer prompt (or chat messages' content, all together) is answered 400 before it is
            tokenized; None: no limit.
        tool_call_parser: the format tool calls are read in (``jaxserve.server.tools.PARSERS``: hermes,
            llama3_json, mistral); None: the one the chat template calls for.
        kv_events: ``--kv-events-config`` (a ``jaxserve.core.kv_events.KVEventsConfig``, its dict or JSON): publish the
            engine's KV-cache events for prefix-aware routers; None: none.
    """
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)} or None, got {tool_call_parser!r}")
    names = list(served_model_names or [engine.model_name])
    state = ServerState(
        AsyncEngine(engine, names[0], max_waiting, kv_events), names, api_key, max_body_bytes, max_prompt_chars
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.shutdown(shutdown_timeout)

    app = FastAPI(
        title="jaxserve",
        version=jaxserve.__version__,
        lifespan=lifespan,
        default_response_class=JSONResponse,
        description="OpenAI-compatible API of the jaxserve JAX inference engine.",
    )
    app.state.server = state
    app.state.tool_call_parser = tool_call_parser
    install_error_handlers(app)
    app.add_middleware(_Guard, state=state)
    app.add_middleware(_CountRejections, state=state)  # added last: outside the guard, so its refusals count
    _add_routes(app, state)
    _tidy_openapi(app, bool(api_key), state.vocab_size)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    common = _errors(400, 401, 404, 413, 503)
    app.post("/v1/completions", responses={**_streamed(CompletionResponse), **common})(create_completion)
    app.post("/v1/chat/completions", responses={**_streamed(ChatCompletionResponse), **common})(create_chat_completion)
    app.post("/v1/responses", responses={**_streamed(ResponseObject), **common})(create_response)

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401))
    async def list_models():
        return ModelList(data=[_card(state, n) for n in state.served_model_names])

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses=_errors(401, 404))
    async def get_model(model_id: str):
        return _card(state, state.check_model(model_id))

    @app.get("/health", responses={200: {"description": "serving"}, **_errors(503)})
    async def health() -> dict[str, str]:
        e = state.engine
        if not e.alive or e.draining:
            return error_response(503, "shutting down" if e.draining else f"the engine is not running ({e.dead!r})")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": jaxserve.__version__}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics():
        return Response(generate_latest(state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 413))
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await render_chat(
                state,
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                parser=app.state.tool_call_parser,
            )
        else:
            state.check_prompt_chars(len(req.prompt))
            ids = await state.encode(req.prompt, req.add_special_tokens is not False)
        if len(ids) <= LONG_INPUT:
            return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)
        # ~1M ids: validating and dumping them would hold the GIL ~80 ms in one go; written piecewise in a thread
        # instead, the event loop gets the GIL between the pieces
        body = await asyncio.to_thread(_tokens_body, ids, state.max_model_len)
        return Response(body, media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404, 413))
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        check_token_ids(req.tokens, state.vocab_size, "tokens")
        return DetokenizeResponse(prompt=await state.decode(req.tokens))

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=_errors(401))
    async def tokenizer_info():
        if state.tokenizer_info is None:
            state.tokenizer_info = _tokenizer_info(state.tokenizer, state.max_model_len)
        return state.tokenizer_info


def _tokenizer_info(tok, max_model_len: int) -> dict:
    """The tokenizer's configuration as vLLM's /tokenizer_info answers it: ``tokenizer_config.json``'s keys (named
    special tokens, whether encoding adds BOS/EOS, the chat template, the added tokens) and ``tokenizer_class``
    (``PreTrainedTokenizerFast``: every vocabulary is served by a ``tokenizers`` tokenizer)."""
    plain, full = tok.encode("a", add_special_tokens=False), tok.encode("a", add_special_tokens=True)
    extra = len(full) - len(plain)
    add_bos = extra > 0 and tok.bos_token_id is not None and full[0] == tok.bos_token_id
    added = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.added_tokens.items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tok.special_tokens,
        "add_bos_token": add_bos,
        "add_eos_token": extra > int(add_bos),
        "model_max_length": max_model_len,
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }


def _tokens_body(ids: list[int], max_model_len: int, piece: int = 32 * 1024) -> bytes:
    """A TokenizeResponse's JSON, written in pieces."""
    tokens = ",".join([",".join(map(str, ids[i : i + piece])) for i in range(0, len(ids), piece)])
    return f'{{"count":{len(ids)},"max_model_len":{max_model_len},"tokens":[{tokens}]}}'.encode()


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(
        id=name, created=state.created, root=state.engine.engine.model_name, max_model_len=state.max_model_len
    )


def below_pattern(n: int) -> str:
    """A regex of the decimal integers in [0, n), without leading zeros (n >= 1)."""
    m = str(n - 1)
    alts = ["0"]
    if len(m) > 1:
        alts.append(f"[1-9][0-9]{{0,{len(m) - 2}}}")
    for i, ch in enumerate(m):  # m's digits up to i - 1, then a smaller digit, then anything
        lo = 1 if i == 0 else 0
        if int(ch) > lo:
            alts.append(f"{m[:i]}[{lo}-{int(ch) - 1}]" + (f"[0-9]{{{len(m) - i - 1}}}" if i < len(m) - 1 else ""))
    alts.append(m)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


def _bound_token_ids(node, vocab_size: int) -> None:
    """Token ids (marked "x-token-id") get the vocabulary's bound: a maximum, or a pattern for JSON keys."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            if node.get("type") == "integer":
                node["maximum"] = vocab_size - 1
            else:
                node["pattern"] = below_pattern(vocab_size)
        for v in node.values():
            _bound_token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab_size)


def _tidy_openapi(app: FastAPI, with_auth: bool, vocab_size: int) -> None:
    """The schema says what the server accepts: validation errors are 400 (as OpenAI answers), not FastAPI's 422;
    token ids are bounded by the vocabulary; streamed answers document their events."""
    build = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = build()
            _bound_token_ids(schema, vocab_size)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for path, chunk in (
                ("/v1/completions", CompletionStreamResponse),
                ("/v1/chat/completions", ChatCompletionChunk),
                ("/v1/responses", ResponseStreamEvent),
            ):
                chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(chunk_schema.pop("$defs", {}))
                components[chunk.__name__] = chunk_schema
                content = schema["paths"][path]["post"]["responses"]["200"]["content"]
                content["text/event-stream"] = {"schema": _event_schema(f"#/components/schemas/{chunk.__name__}")}
            if with_auth:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}
                }
                for route, path in schema["paths"].items():
                    if route.startswith(_PROTECTED):
                        for op in path.values():
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
