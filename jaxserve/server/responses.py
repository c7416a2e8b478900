"""POST /v1/responses: OpenAI's Responses API over the chat path (the model's chat template, the same sampling
parameters, the engine), answering one assistant message, whole or as OpenAI's typed stream events.

``text.format`` constrains the answer to any JSON object or to JSON valid under a schema (structured outputs).
Nothing is stored or run in the background, and no tools are called: ``previous_response_id``, ``background``,
``tools``, ``reasoning``, ``include`` and the other fields not declared by ``ResponsesRequest`` are refused (400
naming the field) unless null or empty. An answer cut by ``max_output_tokens`` (or the context) has status
``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``, and its stream ends with
``response.incomplete`` instead of ``response.completed``, as OpenAI's does.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.exceptions import EngineDeadError, EngineStepError, ServerBusyError
from jaxserve.server.chat import render_chat
from jaxserve.server.errors import APIError
from jaxserve.server.params import Constraint, check_context, renamed_constraint_error, sampling_params
from jaxserve.server.protocol import (
    RESPONSES_SAMPLING_FIELDS,
    ChatMessage,
    ResponsesRequest,
    TextPart,
    _is_unset,
    _SamplingRequest,
)
from jaxserve.server.serving import ServerState, merge, respond

# ResponsesRequest's own fields (input, instructions, ...): the inherited ones are served only if listed in
# RESPONSES_SAMPLING_FIELDS
_OWN_FIELDS = frozenset(ResponsesRequest.model_fields) - frozenset(_SamplingRequest.model_fields)


def _check_served(req: ResponsesRequest) -> None:
    """400 naming the first completions-only field (``n``, ``prompt_logprobs``, ...) set to something else than its
    default: the Responses API has no place for what it would change."""
    for name in sorted(req.model_fields_set - _OWN_FIELDS - set(RESPONSES_SAMPLING_FIELDS)):
        value, default = getattr(req, name), type(req).model_fields[name].default
        if not _is_unset(value) and value != default:
            raise APIError(400, f"'{name}' is not supported by /v1/responses", param=name)


def to_chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The conversation ``req`` asks about as chat messages: ``instructions`` as a system message first, then
    ``input`` (a string: one user message; text parts are joined as the chat endpoint joins them)."""
    msgs = []
    if req.instructions:
        msgs.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        msgs.append(ChatMessage(role="user", content=req.input))
        return msgs
    for m in req.input:
        content = m.content if isinstance(m.content, str) else [TextPart(type="text", text=p.text) for p in m.content]
        msgs.append(ChatMessage(role=m.role, content=content))
    return msgs


def text_format_constraint(req: ResponsesRequest) -> Constraint | None:
    """The constraint ``text.format`` sets: none (text), any JSON object, or JSON valid under its ``schema``.

    Raises:
        APIError: 400 naming ``text.format.schema`` when type is json_schema without a schema.
    """
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint({"json_object": True}, "text.format")
    if fmt.schema_ is None:
        raise APIError(
            400, "text.format.type is json_schema but text.format.schema is missing", param="text.format.schema"
        )
    return Constraint({"json": fmt.schema_}, "text.format.schema")


async def create_response(req: ResponsesRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = raw.app.state.server
    model = state.check_model(req.model)
    _check_served(req)
    ids = await render_chat(state, to_chat_messages(req), True, False, None)
    check_context(len(ids), req.max_output_tokens, state.max_model_len, "max_output_tokens")
    constraint = text_format_constraint(req)
    params = sampling_params(
        req, max_tokens=req.max_output_tokens, logprobs=None, vocab_size=state.vocab_size, constraint=constraint
    )
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        streams = await state.add_all(rid, [ids], params, req.priority or 0, arrival)
    except APIError as e:  # a schema the engine cannot compile: name text.format.schema
        raise renamed_constraint_error(e, constraint) from e
    ctx = _Ctx(req, rid, model, len(ids))
    return await respond(raw, streams, bool(req.stream), ctx.events, lambda finals: ctx.response(finals[0]))


_ERROR_CODES = (
    (ServerBusyError, "server_busy"),
    (EngineDeadError, "engine_dead"),
    (EngineStepError, "engine_step_failed"),
    (ValueError, "invalid_request"),
    (APIError, "invalid_request"),
)


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _outcome(c: CompletionOutput) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a finished answer."""
    if c.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if c.finish_reason == "abort":
        return "failed", None, {"code": "server_error", "message": "the request was aborted (the server is stopping)"}
    return "completed", None, None


class _Ctx:
    """One request's answer: the response object and its stream events."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, num_prompt: int):
        self.req, self.rid, self.model, self.num_prompt = req, rid, model, num_prompt
        self.created = int(time.time())
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.seq = 0

    def _usage(self, out: RequestOutput) -> dict:
        generated = len(out.outputs[0].token_ids)
        return {
            "input_tokens": self.num_prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_prompt + generated,
        }

    def _message(self, status: str, content: list[dict]) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def _response(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        incomplete: dict | None = None,
        error: dict | None = None,
    ) -> dict:
        req = self.req
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": self._format()},
            "truncation": "disabled",
            "store": False,
            "metadata": {},
            "usage": usage,
        }

    def _format(self) -> dict:
        fmt = self.req.text.format if self.req.text is not None else None
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)

    def _final(self, out: RequestOutput) -> tuple[dict, dict]:
        """(the output message, the response) of a finished request."""
        c = out.outputs[0]
        status, incomplete, error = _outcome(c)
        message = self._message("incomplete" if status != "completed" else "completed", [_part(c.text)])
        return message, self._response(status, [message], self._usage(out), incomplete, error)

    def response(self, out: RequestOutput) -> dict:
        return self._final(out)[1]

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"  # ASCII: see errors.JSONResponse

    async def events(self, streams):
        """OpenAI's event sequence: response.created, response.in_progress, output_item.added, content_part.added,
        output_text.delta..., output_text.done, content_part.done, output_item.done, then response.completed
        (response.incomplete when cut by the token limit; an error event and response.failed on a failure)."""
        started = self._response("in_progress", [])
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        yield self._event("response.output_item.added", output_index=0, item=self._message("in_progress", []))
        yield self._event("response.content_part.added", **where, part=_part(""))
        sent, last = 0, None
        try:
            async for _, out in merge(streams):
                last = out
                text = out.outputs[0].text
                if len(text) > sent:
                    yield self._event("response.output_text.delta", **where, delta=text[sent:], logprobs=[])
                    sent = len(text)
            if last is None or not last.outputs[0].finished:
                raise RuntimeError("the request ended without an answer")
        except Exception as e:  # noqa: BLE001 - the status line is sent; the failure goes in the stream
            code = next((c for t, c in _ERROR_CODES if isinstance(e, t)), "server_error")
            yield self._event("error", code=code, message=str(e), param=None)
            error = {"code": code, "message": str(e)}
            yield self._event("response.failed", response=self._response("failed", [], error=error))
            return
        message, response = self._final(last)
        text = last.outputs[0].text
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=_part(text))
        yield self._event("response.output_item.done", output_index=0, item=message)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed"
        )
        yield self._event(kind, response=response)
