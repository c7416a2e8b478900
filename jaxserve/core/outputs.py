"""What generation returns, shaped like vLLM's outputs (what users already know)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` sequences generated for a prompt.

    ``logprobs`` (when asked for) has one dict per generated token: token id -> Logprob, holding the
    chosen token and the requested number of most likely tokens.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt position, token id -> Logprob (None for the first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
