"""The step the scheduler hands the runner, and the counters it reports.

``SchedulerOutput`` (with its ``ScheduledRequest`` and ``NewRequestData``) is the one contract from the host to the
device: the runner, the step wire (``jaxserve.parallel.step_wire``) and the draft model
(``jaxserve.spec_decode.draft_model``) read it, none of them the scheduler's own objects. ``SchedulerStats`` is what
the engine reads of a scheduler for its stats. Plain Python, no tensor library.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class NewRequestData:
    """What the runner keeps about a request, sent once: when it is first scheduled after admission, after a
    fork, or after a preemption (the runner dropped it then). The runner appends each token it samples."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption; empty otherwise
    sampling_params: Any


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, and what changed in its page table since the runner last heard of it."""

    req_id: str
    # Tokens to compute this step, at positions start_pos, start_pos + 1, ... (after the previous step's token with
    # ``from_previous_step``).
    token_ids: list[int]
    start_pos: int  # == the request's num_computed_tokens before the step
    sample: bool  # the chunk reaches the end of the request's tokens: sample a token after its last one
    # The page table from index ``pages_from`` on is ``new_page_ids`` (earlier entries are unchanged): the pages
    # added for this step, and the page holding ``start_pos`` when copy-on-write replaced it.
    pages_from: int
    new_page_ids: list[int]
    new: NewRequestData | None = None  # the runner has no state for the request: start it from this
    # Speculative decoding: proposed tokens, the last entries of ``token_ids`` (after the request's next token).
    # The runner samples after each of the chunk's last 1 + len(draft_token_ids) positions and returns the
    # tokens they confirm (``jaxserve.spec_decode.ngram``).
    draft_token_ids: tuple[int, ...] = ()
    # Async scheduling: the chunk's first token, at ``start_pos``, is the one the previous step samples for this
    # request, whose value the scheduler does not know yet (``jaxserve.core.sched.async_scheduler``): the runner
    # reads it on the device. It is not in ``token_ids``.
    from_previous_step: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens the chunk computes: ``token_ids``, and the previous step's with ``from_previous_step``."""
        return len(self.token_ids) + self.from_previous_step


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """Everything the runner needs for one step, as changes to what it already holds (vLLM v1's contract): it
    owns none of the scheduler's objects, and the scheduler never re-sends what the runner has.

    The runner must first drop its state of ``finished_req_ids`` and ``preempted_req_ids``, then start the
    ``new`` requests and apply page-table changes, apply ``copy_ops`` (``pages[dst] = pages[src]``, in order or
    all at once) before it writes this step's KV, and return the sampled token ids of every request with
    ``sample=True``.
    """

    scheduled: list[ScheduledRequest]
    copy_ops: list[tuple[int, int]]  # copy-on-write (src_page, dst_page)
    finished_req_ids: list[str]  # finished or aborted since the previous step: drop any per-request state
    preempted_req_ids: list[str]  # preempted this step: their KV is gone, they restart from position 0
    num_scheduled_tokens: int


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's counters at one moment (``Scheduler.stats``), which the engine sums over its replicas
    (``LLMEngine.get_stats``) for the server's metrics."""

    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    num_used_pages: int
    num_usable_pages: int
    kv_usage: float  # fraction of usable pages held by requests
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found cached
    prefix_cache_hit_rate: float
    spec_draft_tokens: int = 0  # speculative decoding: tokens proposed (total since start)
    spec_accepted_tokens: int = 0  # of them, accepted
