"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or not; with tools,
the model's tool calls are read out of its answer (``jaxserve.server.tools``)."""

from __future__ import annotations

import json
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from jaxserve.core.outputs import RequestOutput
from jaxserve.server.errors import APIError
from jaxserve.server.params import (
    Constraint,
    chat_logprobs,
    check_context,
    prompt_logprobs,
    renamed_constraint_error,
    request_constraint,
    sampling_params,
)
from jaxserve.server.protocol import ChatCompletionRequest, ChatMessage
from jaxserve.server.serving import (
    ServerState,
    merge,
    off_loop,
    respond,
    sse,
    sse_error,
)
from jaxserve.server.tools import (
    PARSERS,
    ArgsDelta,
    CallStart,
    ContentDelta,
    ToolPlan,
    get_parser,
    parser_for_template,
    plan_tools,
    tool_call_grammar,
    tools_system_prompt,
)


def _args_value(arguments):
    """A replayed call's arguments as chat templates expect them: an object (a JSON text that is not one stays
    text)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _message(m: ChatMessage) -> dict:
    """A message as chat templates read it: text parts joined, null content as "", replayed calls with their
    arguments as objects, a legacy ``function`` result as a ``tool`` message."""
    content = m.content
    if isinstance(content, list):  # text parts, joined as vLLM does
        content = "\n".join(part.text for part in content)
    msg = {"role": "tool" if m.role == "function" else m.role, "content": content or "", "name": m.name}
    calls = [(c.id, c.function) for c in m.tool_calls or []]
    if m.function_call is not None and not calls:
        calls = [(None, m.function_call)]
    if calls:
        msg["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": f.name, "arguments": _args_value(f.arguments)}}
            for cid, f in calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _calls_as_text(msgs: list[dict], parser: str | None, results_as_user: bool) -> list[dict]:
    """The conversation with replayed calls written into the assistant's content in the parser's format (for
    templates that do not render ``tool_calls``); ``results_as_user``: tool results also become user messages
    wrapped in ``<tool_response>`` (for templates that refuse the ``tool`` role)."""
    out = []
    for m in msgs:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            fmt = PARSERS[parser or "hermes"]()
            text = "\n".join(fmt.format_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if results_as_user and m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def _with_tools_prompt(msgs: list[dict], tools: list[dict], parser: str) -> list[dict]:
    """The tools as a system prompt (appended to the first system message, or a new one first)."""
    prompt = tools_system_prompt(tools, parser)
    if msgs and msgs[0]["role"] in ("system", "developer"):
        first = dict(msgs[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first] + msgs[1:]
    return [{"role": "system", "content": prompt}] + msgs


def _render(
    tokenizer, msgs: list[dict], add_generation_prompt: bool, kwargs: dict, tools: list[dict] | None, parser: str | None
) -> str:
    """The conversation in the chat template. Tools go to the template when it renders them, else into a system
    prompt; replayed tool calls likewise (else written as text). If the template refuses the conversation and it
    holds tool messages, they are retried as text (calls in the assistant's content, results as user messages)."""
    has_calls = any("tool_calls" in m for m in msgs)
    if tools or has_calls:  # does the template render them?
        try:
            source = tokenizer.chat_template_source(None, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        if tools and not re.search(r"\btools\b", source):
            msgs = _with_tools_prompt(msgs, tools, parser)
            tools = None
        if has_calls and "tool_calls" not in source:
            msgs = _calls_as_text(msgs, parser, results_as_user=False)
    try:
        return tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools, **kwargs
        )
    except Exception as e:
        first = e
    if has_calls or any(m["role"] == "tool" for m in msgs):
        try:
            return tokenizer.apply_chat_template(
                _calls_as_text(msgs, parser, results_as_user=True),
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=tools,
                **kwargs,
            )
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
    raise APIError(
        400, f"the chat template could not render these messages: {type(first).__name__}: {first}", param="messages"
    ) from first


def tool_parser_name(state: ServerState, configured: str | None, tools: list[dict] | None = None) -> str:
    """The tool-call format: the server's ``--tool-call-parser``, else the one the chat template calls for."""
    if configured:
        return configured
    try:
        return parser_for_template(state.tokenizer.chat_template_source(None, tools))
    except ValueError:
        return "hermes"


async def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    template_kwargs: dict | None,
    *,
    tools: list[dict] | None = None,
    parser: str | None = None,
) -> list[int]:
    """Token ids of the conversation in the model's chat template (400 if the template refuses it).

    ``tools``: OpenAI tool definitions to offer the model; ``parser``: the tool-call format replayed calls and
    the tools prompt are written in when the template does not render them (default: the template's own).
    """
    msgs = [_message(m) for m in messages]
    size = sum(len(m["content"]) + (len(json.dumps(m["tool_calls"])) if "tool_calls" in m else 0) for m in msgs)
    size += len(json.dumps(tools)) if tools else 0
    state.check_prompt_chars(size, "messages")
    cont = bool(continue_final_message)
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize"):
        kwargs.pop(reserved, None)
    if not parser and (tools or any("tool_calls" in m for m in msgs)):
        parser = tool_parser_name(state, None, tools)
    text = await off_loop(
        size,
        _render,
        state.tokenizer,
        msgs,
        not cont and add_generation_prompt is not False,
        kwargs,
        tools or None,
        parser,
    )
    if cont:  # end the text right after the last message's content, so the model carries on from there
        last = msgs[-1]["content"]
        at = text.rfind(last) if last else -1
        if at < 0:
            raise APIError(
                400,
                "continue_final_message: the final message's content is not in the rendered template",
                param="continue_final_message",
            )
        text = text[: at + len(last)]
    ids = await state.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the conversation renders to no tokens", param="messages")
    return ids


def _special_marker(tokenizer, parser: str) -> int | None:
    """The token id of the parser's call marker when the tokenizer has it as one special token, else None."""
    for marker in PARSERS[parser].markers:
        tid = tokenizer.token_to_id(marker)
        if tid is not None and tokenizer.is_special(tid):
            return tid
    return None


def _tool_constraint(req: ChatCompletionRequest, plan: ToolPlan, parser: str, tokenizer) -> Constraint | None:
    """The output's constraint: the request's own, or, when a tool call is forced (tool_choice "required" or a
    named function), a grammar that admits only calls of the allowed functions."""
    own = request_constraint(req)
    if plan.forced is None:
        return own
    choice = "function_call" if plan.legacy else "tool_choice"
    if own is not None:
        raise APIError(
            400,
            f"{choice} forces a tool call, so {own.source.split('.')[0]} cannot constrain the "
            "output too; leave one of them out",
            param=own.source.split(".")[0],
        )
    grammar = tool_call_grammar(parser, plan.forced, plan.max_calls, _special_marker(tokenizer, parser))
    return Constraint({"grammar": grammar}, "functions" if plan.legacy else "tools")  # their schemas are in it


async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = raw.app.state.server
    model = state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    plan = plan_tools(req)
    configured = getattr(raw.app.state, "tool_call_parser", None)
    parser = tool_parser_name(state, configured, plan.tools or None) if plan.parse else configured
    ids = await render_chat(
        state,
        req.messages,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
        tools=plan.tools,
        parser=parser,
    )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_context(
        len(ids),
        max_tokens,
        state.max_model_len,
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    )
    k = (req.top_logprobs or 0) if req.logprobs else None
    constraint = _tool_constraint(req, plan, parser, state.tokenizer)
    if plan.parse and _special_marker(state.tokenizer, parser) is not None:
        req = req.model_copy(update={"skip_special_tokens": False})  # the parser must see the call marker
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, vocab_size=state.vocab_size, constraint=constraint)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        streams = await state.add_all(rid, [ids], params, req.priority or 0, arrival)
    except APIError as e:
        raise renamed_constraint_error(e, constraint) from e
    ctx = _Ctx(req, rid, model, len(ids), k, plan, parser)
    return await respond(raw, streams, bool(req.stream), ctx.events, lambda finals: ctx.response(finals[0]))


class _Ctx:
    def __init__(
        self,
        req: ChatCompletionRequest,
        rid: str,
        model: str,
        num_prompt: int,
        k: int | None,
        plan: ToolPlan,
        parser: str,
    ):
        self.req, self.rid, self.model, self.num_prompt, self.k = req, rid, model, num_prompt, k
        self.plan, self.parser = plan, parser
        self.created = int(time.time())

    def usage(self, generated: int) -> dict:
        return {
            "prompt_tokens": self.num_prompt,
            "completion_tokens": generated,
            "total_tokens": self.num_prompt + generated,
        }

    def _logprobs(self, c, lo: int) -> dict | None:
        if self.k is None or c.logprobs is None:
            return None
        return {"content": chat_logprobs(c.token_ids[lo:], c.logprobs[lo : len(c.token_ids)], self.k)}

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" ("function_call" for legacy functions) when the answer made calls and ended by itself."""
        if called and reason == "stop":
            return "function_call" if self.plan.legacy else "tool_calls"
        return reason

    def _message(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a finished answer, and whether it made calls."""
        if not self.plan.parse:
            return {"role": "assistant", "content": text}, False
        parsed = get_parser(self.parser).parse(text)
        msg = {"role": "assistant", "content": parsed.content}
        if not parsed.calls:
            return msg, False
        if self.plan.legacy:
            msg["function_call"] = {"name": parsed.calls[0].name, "arguments": parsed.calls[0].arguments}
        else:
            msg["tool_calls"] = [call.to_openai() for call in parsed.calls]
        return msg, True

    def response(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            msg, called = self._message(c.text)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": self._logprobs(c, 0),
                    "finish_reason": self._finish_reason(c.finish_reason, called),
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(sum(len(c.token_ids) for c in out.outputs)),
        }
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(getattr(out, "prompt_logprobs", None))
        return body

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _delta(self, events: list) -> dict:
        """A stream delta from parser events: content, and per call its first piece (index, id, type, name) and
        then its arguments as they come (legacy functions: ``function_call`` of the first call only)."""
        delta: dict = {}
        calls: dict[int, dict] = {}
        for e in events:
            if isinstance(e, ContentDelta):
                delta["content"] = delta.get("content", "") + e.text
            elif isinstance(e, CallStart):
                calls[e.index] = {
                    "index": e.index,
                    "id": e.id,
                    "type": "function",
                    "function": {"name": e.name, "arguments": ""},
                }
            elif isinstance(e, ArgsDelta):
                entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += e.text
        if calls and self.plan.legacy:
            first = calls.get(0)
            if first is not None:
                delta["function_call"] = {k: v for k, v in first["function"].items() if k == "arguments" or v}
        elif calls:
            delta["tool_calls"] = list(calls.values())
        return delta

    async def events(self, streams):
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        n = self.req.n or 1
        for i in range(n):  # the role first, as OpenAI does
            yield sse(
                self._chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    self.usage(0) if continuous else None,
                )
            )
        parsers = [get_parser(self.parser) for _ in range(n)] if self.plan.parse else None
        sent_text = [0] * n
        sent_tok = [0] * n
        finished = [False] * n
        generated = [0] * n
        try:
            async for _, out in merge(streams):
                for c in out.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    new = c.text[sent_text[i] :]
                    generated[i] = len(c.token_ids)
                    if parsers is not None:
                        events = parsers[i].feed(new) if new else []
                        if c.finish_reason is not None:
                            events += parsers[i].finish()
                        delta = self._delta(events)
                    else:
                        delta = {"content": new} if new else {}
                    sent_text[i] = len(c.text)
                    if not delta and c.finish_reason is None:
                        continue
                    called = parsers is not None and bool(parsers[i].calls)
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": self._logprobs(c, sent_tok[i]),
                        "finish_reason": self._finish_reason(c.finish_reason, called),
                    }
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    sent_tok[i], finished[i] = len(c.token_ids), c.finished
                    yield sse(self._chunk([choice], self.usage(sum(generated)) if continuous else None))
            if include_usage:
                yield sse(self._chunk([], self.usage(sum(generated))))
        except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse_error(e)
        yield sse("[DONE]")
