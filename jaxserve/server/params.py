"""From OpenAI request fields to ``SamplingParams``, and from engine logprobs back to OpenAI's shapes."""

from __future__ import annotations

import dataclasses
import re

from jaxserve.core.outputs import Logprob
from jaxserve.core.request import check_prompt_length, out_of_vocabulary
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import _SamplingRequest

_FIELD = re.compile(r"SamplingParams\.(\w+)")


_CONSTRAINT_KIND = re.compile(r"structured_outputs(\.\w+)?")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A constraint on the output: ``StructuredOutputsParams``' fields, and the request field they came from
    (named in errors: ``response_format.json_schema.schema``, ``guided_regex``, ``tool_choice``, ...)."""

    fields: dict
    source: str


def request_constraint(req: _SamplingRequest) -> Constraint | None:
    """The constraint ``req`` sets through ``response_format``, ``structured_outputs`` or a ``guided_*`` field.

    ``response_format``: ``text`` (none), ``json_object`` (any JSON object), ``json_schema`` (valid under
    ``json_schema.schema``; a missing schema: any object). ``structured_outputs`` (vLLM's): exactly one of
    json, regex, choice, grammar, json_object. ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``: vLLM's older names of those.

    Raises:
        APIError: 400 naming the fields when more than one is set, or ``response_format.json_schema`` when
            ``type`` is json_schema without it.
    """
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(Constraint({"json_object": True}, "response_format"))
        elif rf.json_schema is None:
            raise APIError(
                400,
                "response_format.type is json_schema but response_format.json_schema is missing",
                param="response_format.json_schema",
            )
        elif rf.json_schema.schema_ is None:
            found.append(Constraint({"json_object": True}, "response_format.json_schema"))
        else:
            found.append(Constraint({"json": rf.json_schema.schema_}, "response_format.json_schema.schema"))
    if req.structured_outputs is not None and req.structured_outputs.model_fields_set:  # {}: nothing asked
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(Constraint(fields, "structured_outputs"))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append(Constraint({kind: value}, name))
    if len(found) > 1:
        names = [c.source.split(".")[0] for c in found]
        raise APIError(
            400,
            f"a request may set one constraint on its output, this one sets {len(found)}: {', '.join(names)}",
            param=names[1],
        )
    return found[0] if found else None


def renamed_constraint_error(e: APIError, constraint: Constraint | None) -> APIError:
    """An engine refusal of a constraint (a ValueError naming ``structured_outputs.<kind>``), reworded to name
    the request field it came from; other errors unchanged."""
    m = None if constraint is None or e.status != 400 else _CONSTRAINT_KIND.search(e.message)
    if m is None:
        return e
    if constraint.source == "structured_outputs":  # the request's own words: name the member
        return APIError(400, e.message, param=m.group(0), code=e.code)
    message = e.message[: m.start()] + constraint.source + e.message[m.end() :]
    return APIError(400, message, param=constraint.source, code=e.code)


def sampling_params(
    req: _SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    constraint: Constraint | None | bool = True,
) -> SamplingParams:
    """The engine's parameters for ``req`` (max_tokens and logprobs resolved by the endpoint).

    ``constraint``: the output's constraint; True (the default): the one the request's fields set
    (``request_constraint``).

    Raises:
        APIError: 400 for a token id past the vocabulary or a combination the engine rejects (min_tokens >
            max_tokens, ...); the message names the field.
    """
    if constraint is True:
        constraint = request_constraint(req)
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(
            400,
            f"best_of={req.best_of} is not supported: this server does not rank candidates, so "
            f"best_of must equal n ({n}) or be left out",
            param="best_of",
        )
    bias = None
    if req.logit_bias:
        bias = {int(k): v for k, v in req.logit_bias.items()}
        check_token_ids(bias, vocab_size, "logit_bias")
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    try:
        return SamplingParams(
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            structured_outputs=constraint.fields if constraint else None,
        )
    except ValueError as e:
        if constraint and _CONSTRAINT_KIND.search(str(e)):
            raise renamed_constraint_error(APIError(400, str(e).replace("SamplingParams.", "")), constraint) from e
        m = _FIELD.search(str(e))
        raise APIError(400, str(e).replace("SamplingParams.", ""), param=m.group(1) if m else None) from e


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """400 naming ``param`` if any id is outside the vocabulary (``jaxserve.core.request.out_of_vocabulary``)."""
    bad = out_of_vocabulary(ids, vocab_size)
    if bad:
        raise APIError(400, f"{param}: token ids {bad} are outside the vocabulary [0, {vocab_size})", param=param)


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """400 (naming both lengths) unless the prompt, plus max_tokens when given, fits the context; the prompt alone
    by the engine's rule (``jaxserve.core.request.check_prompt_length``), in OpenAI's words."""
    try:
        check_prompt_length(num_prompt, max_model_len)
    except ValueError:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens, which leaves no room for a completion. Shorten the prompt.",
            param="prompt",
            code="context_length_exceeded",
        ) from None
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
            f"completion). Shorten the prompt or reduce {param}.",
            param=param,
            code="context_length_exceeded",
        )


# ---------------------------------------------------------------------------------------------------- logprobs
def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def _lp(x: float) -> float:
    return max(float(x), -9999.0)  # JSON has no -Infinity (a masked token's logprob), as vLLM clamps


def _text(lp: Logprob | None) -> str:
    return (lp.decoded_token if lp is not None else None) or ""


def token_id_key(token_id: int) -> str:
    """vLLM's name of a token by its id (``token_id:N``, what its ``return_tokens_as_token_ids`` answers)."""
    return f"token_id:{token_id}"


def _top_by_text(tid: int, entry: dict[int, Logprob], k: int) -> dict[str, float]:
    """The legacy ``top_logprobs`` of one position: the ``k`` likeliest tokens and the chosen one ``tid``, most
    likely first, keyed by their text. Distinct tokens can print alike (byte tokens that are pieces of a UTF-8
    character all print U+FFFD), and one key would hide the others: the chosen token keeps its text (so
    ``top_logprobs[i][tokens[i]]`` is its logprob), then each other token its text unless taken, else
    ``token_id:N``."""
    listed = _top(entry, k)
    if tid in entry and all(t != tid for t, _ in listed):
        listed.append((tid, entry[tid]))  # the chosen token is always listed
    keys = {tid: _text(entry[tid])} if tid in entry else {}
    taken = set(keys.values())
    for t, lp in listed:
        if t not in keys:
            text = _text(lp)
            keys[t] = text if text not in taken else token_id_key(t)
            taken.add(keys[t])
    return {keys[t]: _lp(lp.logprob) for t, lp in listed}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int, offset: int) -> dict:
    """/v1/completions ``logprobs`` of these tokens; ``offset`` is the text offset of the first one."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        tok = _text(chosen)
        tokens.append(tok)
        token_lps.append(_lp(chosen.logprob) if chosen is not None else None)
        tops.append(_top_by_text(tid, entry, k))
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> list[dict]:
    """/v1/chat/completions ``logprobs.content`` entries of these tokens (top ``k`` alternatives each)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        tok = _text(chosen)
        content.append(
            {
                "token": tok,
                "logprob": _lp(chosen.logprob) if chosen is not None else -9999.0,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": _text(lp), "logprob": _lp(lp.logprob), "bytes": list(_text(lp).encode())}
                    for _, lp in _top(entry, k)
                ],
            }
        )
    return content


def prompt_logprobs(entries) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``{token_id: {logprob, decoded_token}}`` (None first)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {str(t): {"logprob": _lp(lp.logprob), "decoded_token": lp.decoded_token} for t, lp in e.items()}
        for e in entries
    ]
