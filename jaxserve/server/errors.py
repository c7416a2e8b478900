"""OpenAI-style JSON errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as _StarletteJSON
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.engine.exceptions import EngineDeadError, EngineStepError, ServerBusyError

logger = logging.getLogger("jaxserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class JSONResponse(_StarletteJSON):
    """JSON with non-ASCII characters escaped: a lone surrogate a client sent (JSON allows ``"\\ud800"``) and
    that comes back in an answer or an error message cannot make the UTF-8 encoding fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class APIError(Exception):
    """An error answered to the client with its HTTP status (raise it anywhere in a handler)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _path(loc, body) -> list[str]:
    """The JSON path of an error's location: the keys and indexes found in the body, without the labels pydantic
    adds for a union's members ("str", "list[TextPart]", a tag); the last element (a missing field) always."""
    path, node = [], body
    for i, x in enumerate(loc):
        if isinstance(node, dict) and isinstance(x, str) and x in node:
            node = node[x]
        elif isinstance(node, list) and isinstance(x, int) and 0 <= x < len(node):
            node = node[x]
        elif i < len(loc) - 1:
            continue
        path.append(str(x))
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        why = (errors[0].get("ctx") or {}).get("error", "")
        return f"The body is not valid JSON ({why} at character {errors[0]['loc'][-1]}).", None
    unsupported = [e for e in errors if e.get("type") == "extra_forbidden"]
    errors = unsupported or errors  # an unsupported field is the reason (the rest: other members of a union)
    parts, param = [], None
    for e in errors[:5]:
        loc = e.get("loc", ())
        path = _path(loc[1:], getattr(exc, "body", None)) if loc[:1] == ("body",) else [str(x) for x in loc]
        where = ".".join(path) or "body"
        if e.get("type") == "extra_forbidden":  # a field no model declares: named, its whole path the param
            param = param or where
            parts.append(f"'{where}' is not supported by this server")
        else:
            param = param or (path[0] if path else None)
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(dict.fromkeys(parts)) + more, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(ServerBusyError)
    async def _busy(request: Request, exc: ServerBusyError):
        return error_response(503, str(exc), code="server_busy", headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), code="engine_dead", headers={"Retry-After": "30"})

    @app.exception_handler(EngineStepError)
    async def _step_failed(request: Request, exc: EngineStepError):
        return error_response(500, str(exc), code="engine_step_failed")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)  # malformed JSON lands here too (type json_invalid)
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
