"""POST /v1/completions: text (or token) prompts, one or a batch, streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.server.errors import APIError
from jaxserve.server.params import (
    check_context,
    check_token_ids,
    completion_logprobs,
    prompt_logprobs,
    renamed_constraint_error,
    request_constraint,
    sampling_params,
)
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.serving import (
    ServerState,
    merge,
    respond,
    sse,
    sse_error,
)


async def _prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or p and isinstance(p[0], int):
        p = [p]
    add_special = req.add_special_tokens is not False
    for x in p:
        if isinstance(x, str):
            state.check_prompt_chars(len(x))
    prompts = []
    for x in p:
        ids = await state.encode(x, add_special) if isinstance(x, str) else list(x)
        if not ids:
            raise APIError(400, "the prompt is empty (it has no tokens)", param="prompt")
        check_token_ids(ids, state.vocab_size, "prompt")
        prompts.append(ids)
    return prompts


async def create_completion(req: CompletionRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = raw.app.state.server
    model = state.check_model(req.model)
    prompts = await _prompts(state, req)
    for ids in prompts:
        check_context(len(ids), req.max_tokens, state.max_model_len)
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        req = req.model_copy(update={"prompt_logprobs": req.logprobs})  # echo's logprobs cover the prompt too
    max_tokens = req.max_tokens
    if max_tokens == 0:  # the prompt alone: the engine generates one token, which the answer leaves out
        if not req.echo:
            raise APIError(
                400,
                "max_tokens=0 asks for no tokens: it is served only with echo=true, which returns "
                "the prompt (and its logprobs)",
                param="max_tokens",
            )
        if req.min_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} with max_tokens=0", param="min_tokens")
        max_tokens = 1
    constraint = request_constraint(req)
    params = sampling_params(
        req, max_tokens=max_tokens, logprobs=req.logprobs, vocab_size=state.vocab_size, constraint=constraint
    )
    rid = f"cmpl-{uuid.uuid4().hex}"
    try:
        streams = await state.add_all(rid, prompts, params, req.priority or 0, arrival)
    except APIError as e:  # a constraint the engine cannot compile: name the request field it came from
        raise renamed_constraint_error(e, constraint) from e
    ctx = _Ctx(state, req, rid, model, prompts)
    return await respond(raw, streams, bool(req.stream), ctx.events, ctx.response)


class _Ctx:
    def __init__(self, state: ServerState, req: CompletionRequest, rid: str, model: str, prompts: list[list[int]]):
        self.state, self.req, self.rid, self.model, self.prompts = state, req, rid, model, prompts
        self.n = req.n or 1
        self.created = int(time.time())
        self._prompt_texts: dict[int, str] = {}
        self.prompt_only = req.max_tokens == 0

    def _shown(self, c: CompletionOutput) -> CompletionOutput:
        """``c`` as answered: with max_tokens=0, without the one token generated (finish_reason "length")."""
        if not self.prompt_only:
            return c
        return dataclasses.replace(
            c,
            text="",
            token_ids=[],
            cumulative_logprob=None,
            logprobs=None if c.logprobs is None else [],
            finish_reason="length" if c.finished else None,
            stop_reason=None,
        )

    def prompt_text(self, k: int) -> str:
        if k not in self._prompt_texts:
            p = self.req.prompt
            if isinstance(p, str):
                self._prompt_texts[k] = p
            elif isinstance(p, list) and isinstance(p[k], str):
                self._prompt_texts[k] = p[k]
            else:
                self._prompt_texts[k] = self.state.tokenizer.decode(self.prompts[k], skip_special_tokens=False)
        return self._prompt_texts[k]

    def usage(self, num_generated: int) -> dict:
        p = sum(map(len, self.prompts))
        return {"prompt_tokens": p, "completion_tokens": num_generated, "total_tokens": p + num_generated}

    def _echo_logprobs(self, k: int, out: RequestOutput) -> dict | None:
        entries = getattr(out, "prompt_logprobs", None)
        if entries is None:
            return None
        ids = self.prompts[k]
        lp = completion_logprobs(ids[1:], entries[1:], self.req.logprobs, 0)
        first = self.state.tokenizer.decode(ids[:1], skip_special_tokens=False)
        return {
            "tokens": [first] + lp["tokens"],
            "token_logprobs": [None] + lp["token_logprobs"],
            "top_logprobs": [None] + lp["top_logprobs"],
            "text_offset": [0] + [o + len(first) for o in lp["text_offset"]],
        }

    def _choice(self, k: int, out: RequestOutput, c, text: str, tok_lo: int, text_offset: int, echo: bool) -> dict:
        logprobs = None
        if self.req.logprobs is not None and c.logprobs is not None:
            logprobs = completion_logprobs(
                c.token_ids[tok_lo:], c.logprobs[tok_lo : len(c.token_ids)], self.req.logprobs, text_offset
            )
            if echo:
                head = self._echo_logprobs(k, out)
                if head is not None:
                    shift = len(self.prompt_text(k))
                    logprobs = {
                        key: head[key] + ([o + shift for o in logprobs[key]] if key == "text_offset" else logprobs[key])
                        for key in logprobs
                    }
        return {
            "index": k * self.n + c.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def response(self, finals: list[RequestOutput]) -> dict:
        choices, generated = [], 0
        for k, out in enumerate(finals):
            for c in map(self._shown, out.outputs):
                head = self.prompt_text(k) if self.req.echo else ""
                choice = self._choice(k, out, c, head + c.text, 0, 0, bool(self.req.echo))
                if self.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(getattr(out, "prompt_logprobs", None))
                choices.append(choice)
                generated += len(c.token_ids)
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(generated),
        }

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    async def events(self, streams):
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        sent_text: dict[int, int] = {}  # choice -> characters sent
        sent_tok: dict[int, int] = {}  # choice -> tokens whose logprobs were sent
        generated: dict[int, int] = {}
        try:
            async for k, out in merge(streams):
                for c in map(self._shown, out.outputs):
                    idx = k * self.n + c.index
                    if idx in sent_text and sent_text[idx] < 0:
                        continue  # finished already
                    first = idx not in sent_text
                    done = sent_text.get(idx, 0)
                    delta = c.text[done:]
                    generated[idx] = len(c.token_ids)
                    if not delta and c.finish_reason is None and not (first and self.req.echo):
                        continue
                    echo = first and bool(self.req.echo)
                    head = self.prompt_text(k) if echo else ""
                    choice = self._choice(k, out, c, head + delta, sent_tok.get(idx, 0), done, echo)
                    sent_tok[idx] = len(c.token_ids)
                    sent_text[idx] = -1 if c.finish_reason else len(c.text)
                    usage = self.usage(sum(generated.values())) if continuous else None
                    yield sse(self._chunk([choice], usage))
            if include_usage:
                yield sse(self._chunk([], self.usage(sum(generated.values()))))
        except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
            yield sse_error(e)
        yield sse("[DONE]")
