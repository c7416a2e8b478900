"""SamplingParams: what a request asks of the sampler, validated on the host.

Plain Python (no jax), so the scheduler side can read a request's parameters without importing jax.
"""

from __future__ import annotations

import dataclasses
import json
import numbers

import numpy as np

MAX_LOGPROBS = 20  # Most top logprobs a request may ask for (OpenAI's limit); the static K of ``sample``.
GREEDY_EPS = 1e-5  # Temperatures below this are greedy (argmax), as in vLLM.
TOP_K_CAP = 256  # Top-k/top-p read the top this-many logits (lax.top_k); a full vocabulary sort is the fallback.
PAD_ID = -1  # Pad value of the token-history arrays.
MAX_LOGIT_BIAS = 1024  # Most logit_bias entries per request: the sampler's bias arrays have a fixed width.
MAX_STOP_TOKEN_IDS = 256  # Most stop_token_ids per request (banned through the same arrays under min_tokens).
INT32_MAX = 2**31 - 1  # Every int the device sees (token ids, top_k, counts) is an int32.
SEED_RANGE = (-(2**63), 2**63 - 1)  # seeds are 64-bit signed ints, as in vLLM
_MAX_ABS_PENALTY = 2.0
_MAX_ABS_BIAS = 100.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and np.isfinite(float(x))


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's ``StructuredOutputsParams``); set exactly one of:

    Args:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid under it.
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: a list of strings; the output is exactly one of them.
        grammar: a context-free grammar: Lark (llguidance's dialect, ``start: ...``) or GBNF/EBNF
            (llama.cpp's, ``root ::= ...``).
        json_object: True: the output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without optional whitespace (compact); default: one space after ``:`` and
            ``,`` and no other free whitespace, so a model cannot spin in whitespace forever.

    The grammar itself is checked when the engine compiles it (``LLMEngine.add_request``): a schema, regex or
    grammar it cannot compile is a ValueError naming ``structured_outputs.<kind>``.

    Raises:
        ValueError: none or several kinds set, or a value of the wrong type.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        def fail(name: str, why: str):
            got = repr(getattr(self, name))
            raise ValueError(f"structured_outputs.{name} {why}, got {got if len(got) <= 200 else got[:200] + '...'}")

        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                f"got {', '.join(set_kinds) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            fail("json", "must be a JSON schema (a dict or its JSON text)")
        if isinstance(self.json, dict):  # frozen and hashable: keep the schema as JSON text
            object.__setattr__(self, "json", json.dumps(self.json))  # property order kept: it is the output order
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            fail("regex", "must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                fail("choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            fail("grammar", "must be a non-empty grammar text (Lark or GBNF)")
        if self.json_object not in (None, True):
            fail("json_object", "must be True or None")
        if not isinstance(self.disable_any_whitespace, bool):
            fail("disable_any_whitespace", "must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (the vLLM / OpenAI knobs). Validated at construction; frozen.

    Args:
        n: sequences to generate for the prompt (>= 1); they share the prompt's KV pages.
        temperature: >= 0; below 1e-5 sampling is greedy (argmax). Default 1.0.
        top_p: nucleus sampling, in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; 0 or -1 is off.
        min_p: drop tokens below ``min_p`` times the top token's probability, in [0, 1]; 0 is off.
        repetition_penalty: > 0; divides positive (multiplies negative) logits of tokens seen in the prompt or
            output; 1 is off.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token the output already holds; 0 is off.
        frequency_penalty: in [-2, 2]; subtracted as many times as the output holds the token; 0 is off.
        logit_bias: ``{token id: bias}``, biases in [-100, 100] added to the logits, at most 1024 entries;
            string keys (as OpenAI JSON sends them) are accepted. Normalized to ``dict[int, float]``.
        seed: a 64-bit signed int for reproducible sampling; None: the engine draws one (from its ``seed``).
        max_tokens: most tokens to generate (>= 1); None: up to ``max_model_len``. Default 16.
        min_tokens: EOS and ``stop_token_ids`` are banned until this many tokens are generated (<= max_tokens).
        stop: a string or list of strings; the output ends before the first one generated (with it, if
            ``include_stop_str_in_output``). Normalized to a list.
        stop_token_ids: at most 256 token ids that end the output (not included in its text).
        ignore_eos: go on past the model's end-of-sequence tokens.
        logprobs: 0..20 or None: each generated token's logprob plus the top ``logprobs`` alternatives (0: the
            chosen token only).
        prompt_logprobs: 0..20 or None: the same for every prompt position after the first.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        structured_outputs: a ``StructuredOutputsParams``, or a dict of its fields (``{"json": schema}``,
            ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": True}``).

    Raises:
        ValueError: a field has a wrong type or an out-of-range value; the message names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | dict | None = None

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on (the sampler then reads the token history)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self):
        def fail(name: str, why: str):
            got = repr(getattr(self, name))
            raise ValueError(f"SamplingParams.{name} {why}, got {got if len(got) <= 200 else got[:200] + '...'}")

        def check_real(name, lo, hi, lo_open=False):
            v = getattr(self, name)
            if not _is_real(v):
                fail(name, "must be a finite number")
            if v < lo or v > hi or (lo_open and v == lo):
                fail(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")
            object.__setattr__(self, name, float(v))  # numpy scalars become plain floats

        def check_int(name, lo, optional=False, hi=INT32_MAX):
            v = getattr(self, name)
            if v is None and optional:
                return
            if not _is_int(v) or not lo <= v <= hi:
                fail(name, f"must be an int in [{lo}, {hi}]" + (" or None" if optional else ""))
            object.__setattr__(self, name, int(v))

        check_int("n", 1)
        check_real("temperature", 0.0, float("inf"))
        check_real("top_p", 0.0, 1.0, lo_open=True)
        check_int("top_k", -1)
        check_real("min_p", 0.0, 1.0)
        check_real("repetition_penalty", 0.0, float("inf"), lo_open=True)
        check_real("presence_penalty", -_MAX_ABS_PENALTY, _MAX_ABS_PENALTY)
        check_real("frequency_penalty", -_MAX_ABS_PENALTY, _MAX_ABS_PENALTY)
        check_int("seed", SEED_RANGE[0], optional=True, hi=SEED_RANGE[1])  # a 64-bit signed int
        check_int("max_tokens", 1, optional=True)
        check_int("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            check_int(name, 0, optional=True, hi=MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a bool")

        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            fail("stop", "must be a non-empty string, a list of them, or None")
        object.__setattr__(self, "stop", list(stop))

        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = sorted(set(so) - {f.name for f in dataclasses.fields(StructuredOutputsParams)})
            if unknown:
                fail("structured_outputs", f"has unknown keys {unknown}")
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams, a dict of its fields, or None")

        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            fail("stop_token_ids", f"must be a list of token ids in [0, {INT32_MAX}] or None")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids (got {len(ids)})")
        object.__setattr__(self, "stop_token_ids", [int(t) for t in ids])

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a dict {token_id: bias} or None")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                fail("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})")
            bias = {}
            for key, value in self.logit_bias.items():
                tok = int(key) if isinstance(key, str) and key.strip().isdigit() else key
                if not _is_int(tok) or not 0 <= tok <= INT32_MAX:
                    fail("logit_bias", f"keys must be token ids in [0, {INT32_MAX}] (bad key {key!r})")
                if not _is_real(value) or abs(value) > _MAX_ABS_BIAS:
                    fail("logit_bias", f"values must be numbers in [-100, 100] (bad value {value!r})")
                bias[int(tok)] = float(value)
            object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS
