"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or not."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from jaxserve.outputs import RequestOutput
from jaxserve.server.errors import APIError
from jaxserve.server.params import chat_logprobs, check_context, prompt_logprobs, sampling_params
from jaxserve.server.protocol import ChatCompletionRequest, ChatMessage
from jaxserve.server.serving import (
    ServerState,
    merge,
    off_loop,
    respond,
    sse,
    sse_error,
)


def _message(m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):  # text parts, joined as vLLM does
        content = "\n".join(part.text for part in content)
    return {"role": m.role, "content": content, "name": m.name}


def _render(tokenizer, msgs: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except Exception as e:
        raise APIError(400, f"the chat template could not render these messages: {type(e).__name__}: {e}",
                       param="messages") from e


async def render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool | None,
                      continue_final_message: bool | None, template_kwargs: dict | None) -> list[int]:
    """Token ids of the conversation in the model's chat template (400 if the template refuses it)."""
    msgs = [_message(m) for m in messages]
    size = sum(len(m["content"] or "") for m in msgs)
    state.check_prompt_chars(size, "messages")
    cont = bool(continue_final_message)
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "tools", "documents", "chat_template", "tokenize"):
        kwargs.pop(reserved, None)
    text = await off_loop(size, _render, state.tokenizer, msgs, not cont and add_generation_prompt is not False,
                          kwargs)
    if cont:  # end the text right after the last message's content, so the model carries on from there
        last = msgs[-1]["content"] or ""
        at = text.rfind(last) if last else -1
        if at < 0:
            raise APIError(400, "continue_final_message: the final message's content is not in the rendered "
                                "template", param="continue_final_message")
        text = text[: at + len(last)]
    ids = await state.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "the conversation renders to no tokens", param="messages")
    return ids


async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = raw.app.state.server
    model = state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    ids = await render_chat(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                            req.chat_template_kwargs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_context(len(ids), max_tokens, state.max_model_len,
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=k, vocab_size=state.vocab_size)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await state.add_all(rid, [ids], params, req.priority or 0, arrival)
    ctx = _Ctx(req, rid, model, len(ids), k)
    return await respond(raw, streams, bool(req.stream), ctx.events, lambda finals: ctx.response(finals[0]))


class _Ctx:
    def __init__(self, req: ChatCompletionRequest, rid: str, model: str, num_prompt: int, k: int | None):
        self.req, self.rid, self.model, self.num_prompt, self.k = req, rid, model, num_prompt, k
        self.created = int(time.time())

    def usage(self, generated: int) -> dict:
        return {"prompt_tokens": self.num_prompt, "completion_tokens": generated,
                "total_tokens": self.num_prompt + generated}

    def _logprobs(self, c, lo: int) -> dict | None:
        if self.k is None or c.logprobs is None:
            return None
        return {"content": chat_logprobs(c.token_ids[lo:], c.logprobs[lo:len(c.token_ids)], self.k)}

    def response(self, out: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        body = {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(sum(len(c.token_ids) for c in out.outputs))}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(getattr(out, "prompt_logprobs", None))
        return body

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    async def events(self, streams):
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        n = self.req.n or 1
        for i in range(n):  # the role first, as OpenAI does
            yield sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], self.usage(0) if continuous else None))
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
                    delta = c.text[sent_text[i]:]
                    generated[i] = len(c.token_ids)
                    if not delta and c.finish_reason is None:
                        continue
                    choice = {"index": i, "delta": {"content": delta} if delta else {},
                              "logprobs": self._logprobs(c, sent_tok[i]), "finish_reason": c.finish_reason}
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    sent_text[i], sent_tok[i], finished[i] = len(c.text), len(c.token_ids), c.finished
                    yield sse(self._chunk([choice], self.usage(sum(generated)) if continuous else None))
            if include_usage:
                yield sse(self._chunk([], self.usage(sum(generated))))
        except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse_error(e)
        yield sse("[DONE]")
