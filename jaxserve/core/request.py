"""One generation request as the host sees it: token ids, progress, and status.

Plain Python, no tensor library. A request's tokens only ever grow (prompt, then sampled output), so
everything derived from a token prefix (page hashes, computed KV) stays valid as it grows; preemption
drops the KV but keeps every token.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

# Tie-breaker for requests that arrive in the same clock tick.
_ARRIVAL_SEQ = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISH_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


class Request:
    """A single sequence to generate (the engine turns ``n > 1`` into ``n`` requests).

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, never truncated; must not be empty.
        sampling_params: opaque to the scheduler except ``max_tokens``, ``min_tokens``, ``stop_token_ids``
            and ``ignore_eos``; handed to the runner unchanged.
        eos_token_ids: the model's end-of-sequence ids (ignored if ``sampling_params.ignore_eos``).
        arrival_time: ``time.monotonic()`` at creation unless given.
        priority: lower is served first under the "priority" policy.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        arrival_time: float | None = None,
        priority: int = 0,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_ARRIVAL_SEQ)
        self.priority = priority
        self.output_token_ids: list[int] = []  # sampled tokens whose values are known, and only those
        # Async scheduling: tokens that steps in flight sample, after ``output_token_ids``, counted and never written
        # there before their values are known (``jaxserve.core.sched.async_scheduler.AsyncScheduler``).
        self.num_pending = 0
        # KV of positions [0, num_computed_tokens) is in the page pool.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission, in tokens
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        # Chained hashes of this request's full pages (see block_manager); grows with the tokens.
        self.page_hashes: list[bytes] = []

    # ------------------------------------------------------------------ tokens
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens whose values are known."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose values are known: the prompt and ``output_token_ids``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Where the sequence ends once the steps in flight are read: ``num_tokens`` and the pending tokens, which
        take positions ``[num_tokens, num_tokens_with_pending)``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output, without concatenating the two lists."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    # ------------------------------------------------------------------ status
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length", "abort", or None while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def stop_reason(self, token: int, max_model_len: int) -> str | None:
        """Why generation ends after ``token`` was appended to ``output_token_ids``: "stop" (a stop token, or EOS
        unless ``ignore_eos``; neither before ``min_tokens`` outputs), "length" (``max_tokens`` or
        ``max_model_len`` reached), or None to go on."""
        sp = self.sampling_params
        n = self.num_output_tokens
        if n >= sp.min_tokens:
            if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in self.eos_token_ids):
                return "stop"
        if n >= sp.max_tokens or self.num_prompt_tokens + n >= max_model_len:
            return "length"
        return None

    def sort_key(self, policy: str) -> tuple:
        """Smaller is served first: arrival order ("fcfs"), or (priority, arrival) ("priority")."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_seq)
        return (self.arrival_time, self.arrival_seq)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}"
            + (f", pending={self.num_pending})" if self.num_pending else ")")
        )


# ---------------------------------------------------------------------------------------------------- validation
# The rules a prompt obeys, in one place: the engine (``LLMEngine.add_request``), the scheduler and the server all
# check them here (the server words its answers the OpenAI way, but decides with these functions).


def out_of_vocabulary(token_ids, vocab_size: int) -> list[int]:
    """The first (at most five) ids of ``token_ids`` outside ``[0, vocab_size)``; empty when all are inside."""
    if not len(token_ids) or 0 <= min(token_ids) and max(token_ids) < vocab_size:  # C loops: fast on long prompts
        return []
    return [t for t in token_ids if not 0 <= t < vocab_size][:5]


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one generated token: prompt + output is at most ``max_model_len``.

    Raises:
        ValueError: ``num_prompt_tokens >= max_model_len`` (the message names both lengths).
    """
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )


def check_prompt(token_ids, vocab_size: int, max_model_len: int) -> None:
    """Every rule of a prompt's token ids: not empty, inside the vocabulary, and within ``check_prompt_length``.

    Raises:
        ValueError: the first rule broken, named.
    """
    if not len(token_ids):
        raise ValueError("the prompt is empty")
    bad = out_of_vocabulary(token_ids, vocab_size)
    if bad:
        raise ValueError(f"prompt token ids {bad} are outside the vocabulary [0, {vocab_size})")
    check_prompt_length(len(token_ids), max_model_len)


def max_computed_tokens(request: Request, max_model_len: int) -> int:
    """Most KV positions this request can ever need.

    The last token of a finished request is sampled but never fed back, so a request that ends with
    ``T`` tokens computes ``T - 1`` of them, and never fewer than its whole prompt (``check_prompt_length``
    holds).
    """
    final = min(request.num_prompt_tokens + request.sampling_params.max_tokens, max_model_len)
    return max(request.num_prompt_tokens, final - 1)
