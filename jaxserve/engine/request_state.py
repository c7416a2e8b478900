"""A request as the engine holds it: its ``n`` sequences, their text, logprobs and grammar state, and its replica.

The input processor builds these, the output processor advances them, the engine routes them. Host code: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxserve.core.outputs import Logprob
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.sampling.structured import Matcher
from jaxserve.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from jaxserve.engine.replica import Replica


@dataclasses.dataclass
class Sequence:
    """Engine-side state of one of a prompt's ``n`` sequences."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    matcher: Matcher | None = None  # structured outputs: where the sequence is in its grammar


@dataclasses.dataclass
class TrackedRequest:
    """A request as the engine holds it: its prompt, parameters and ``n`` sequences, and where it runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending_forks: list[Sequence]  # n > 1: children waiting for the first sequence's prompt pages
    replica: Replica | None = None  # where it is queued (set when it is)
    prompt_logprobs: dict = dataclasses.field(default_factory=dict)  # position -> SampledToken, as computed
