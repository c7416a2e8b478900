"""The OpenAI-compatible HTTP server (``jaxserve serve``).

    jaxserve serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key K] [--served-model-name N]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses`` (``stream: true``
answers server-sent events; ``stream_options.include_usage`` adds a usage event), ``GET /v1/models``, ``GET
/health``, ``GET /version``, ``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``, ``GET
/tokenizer_info`` and ``GET /openapi.json`` (``/docs`` renders it). Errors are OpenAI-style JSON: ``{"error":
{"message", "type", "param", "code"}}`` with 400 (invalid request, prompt longer than the context), 401 (API key),
404 (unknown model or route), 413 (body too large) or 503 + Retry-After (too many requests waiting, shutting
down).

Layout: ``protocol`` (request/response models, hence the schema), ``params`` (to ``SamplingParams`` and back),
``async_engine`` (the engine in its own thread, one mailbox per request), ``completions`` / ``chat`` /
``responses`` (the handlers), ``tools`` (tool-call parsers and grammars, the tools system prompt), ``serving``
(what they share), ``app`` (routes, auth and body limit, the OpenAPI schema), ``metrics``, ``launch`` (uvicorn,
graceful SIGTERM) and ``cli`` (what ``jaxserve serve`` runs; its flags are defined in ``jaxserve.cli``). The
benchmark client ``jaxserve bench serve`` lives outside the server, in ``jaxserve.benchmarks.serve``.

In Python::

    from jaxserve import LLMEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import ServerThread

    with ServerThread(build_app(LLMEngine())) as server:  # a free loopback port: server.url
        ...
"""

DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # ~250K tokens of English: twice the longest prompt of a 128K-context model
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a client may take to send a request's line and headers
