"""How a step's results reach the scheduler: after the step (``SyncPolicy``), or while the next one runs
(``AsyncPolicy``, async scheduling). The ``Scheduler`` picks one from ``SchedulerConfig.async_scheduling`` and asks it
at the few points where the two differ; everything else (budgets, chunking, admission, preemption) is shared.

Async scheduling in one paragraph: step N + 1 is scheduled and launched before step N's sampled tokens are read. A
request whose chunk of step N samples is counted as computed through that chunk as soon as it is scheduled, and gains
a *pending* token: ``Request.num_pending`` counts them, and nothing is written into ``output_token_ids`` until the
value arrives. The pending token takes position ``num_tokens`` (then ``num_tokens + 1`` ...), so the request's next
chunk is that one token, scheduled with ``ScheduledRequest.from_previous_step``: the runner reads its value on the
device, from step N's samples. Everything that needs token values waits for them: the prefix cache hashes
``num_tokens`` (known) tokens only, a preempted request resumes once its pending tokens are read (they are kept, not
lost), and stops are checked as tokens are confirmed, one step late: a request that stops then drops the token its
next step (already in flight) samples. Limits (``max_tokens``, ``max_model_len``) count the pending tokens, so no
step is ever scheduled past them.

Plain Python, no tensor library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.core.sched.output import ScheduledRequest, SchedulerOutput
    from jaxserve.core.sched.scheduler import Scheduler


class SyncPolicy:
    """Steps one after the other: a step is scheduled once the previous one's tokens reached the scheduler, so no
    token is ever pending."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def is_ending(self, request: Request) -> bool:
        """A running request that must not be scheduled again: its last token is already in flight."""
        return False

    def may_resume(self, request: Request) -> bool:
        """Whether a waiting (preempted) request may be admitted now."""
        return True

    def is_busy(self, request: Request) -> bool:
        """A running request that sits this step out (pipeline stages: its next token is still in flight)."""
        return False

    def scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        """Bookkeeping once a step is scheduled, before it runs."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """``Scheduler.update_from_output``: advances the scheduled requests, appends their sampled tokens and
        finishes the ones that stop."""
        sched = self.scheduler
        live = []
        for s in scheduler_output.scheduled:
            request = sched.requests.get(s.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since schedule()
            if s.sample and not sampled_token_ids.get(s.req_id):
                raise ValueError(f"update_from_output: no sampled token for request {s.req_id!r}")
            live.append((s, request))
        finished = []
        for s, request in live:
            # With proposals, only the positions up to the next token are computed for sure; the accepted
            # proposals' positions count once they are appended (their KV is already written).
            request.num_computed_tokens = s.start_pos + s.num_tokens - len(s.draft_token_ids)
            sched.block_manager.commit(request)
            if not s.sample:
                continue
            tokens = sampled_token_ids[s.req_id]
            if s.draft_token_ids:
                sched.num_draft_tokens += len(s.draft_token_ids)
                sched.num_accepted_tokens += len(tokens) - 1
            for token in tokens:
                request.output_token_ids.append(token)
                reason = request.stop_reason(token, sched.config.max_model_len)
                if reason is not None:
                    finished.append(sched.finish_request(request.request_id, reason))
                    break
            if s.draft_token_ids and request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += len(tokens) - 1  # the accepted proposals
                sched.block_manager.commit(request)
        return finished


class AsyncPolicy(SyncPolicy):
    """Async scheduling (see the module docstring): a step is scheduled while the previous one runs; the tokens of
    steps in flight are counted in ``Request.num_pending`` until ``update_from_output`` confirms them."""

    def is_ending(self, request: Request) -> bool:
        # Its tokens, pending ones included, reach max_tokens or the model length: its pending token is its last.
        return request.num_pending > 0 and (
            request.num_output_tokens_with_pending >= request.sampling_params.max_tokens
            or request.num_tokens_with_pending >= self.scheduler.config.max_model_len
        )

    def may_resume(self, request: Request) -> bool:
        # Preempted with a token in flight: it restarts from its tokens, so once that token is known.
        return request.num_pending == 0

    def scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        """Counts each chunk as computed as soon as it is scheduled, and each sampling chunk's token as pending, so
        that the next step can be scheduled before this one's results."""
        requests = self.scheduler.requests
        for s in scheduled:  # never with proposals (SchedulerConfig rules them out)
            request = requests[s.req_id]
            request.num_computed_tokens = s.start_pos + s.num_tokens
            if s.sample:
                request.num_pending += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Each sampled token is its request's oldest pending one: it is appended to ``output_token_ids`` and
        checked for a stop. A request that stops is finished, and the tokens of its steps still in flight are
        dropped. A preempted request keeps its token (it resumes from it)."""
        sched = self.scheduler
        finished = []
        for s in scheduler_output.scheduled:
            request = sched.requests.get(s.req_id)
            if request is None:
                continue  # finished or aborted since schedule(): its token is dropped
            if s.sample:
                tokens = sampled_token_ids.get(s.req_id)
                if not tokens:
                    raise ValueError(f"update_from_output: no sampled token for request {s.req_id!r}")
                if not request.num_pending:
                    raise ValueError(f"request {s.req_id!r} has no pending token to confirm")
                request.num_pending -= 1
                request.output_token_ids.append(tokens[0])
                reason = request.stop_reason(tokens[0], sched.config.max_model_len)
                if reason is not None:
                    finished.append(sched.finish_request(request.request_id, reason))
                    continue
            if request.status is RequestStatus.RUNNING:
                sched.block_manager.commit(request)
        return finished


class PipelinePolicy(AsyncPolicy):
    """Pipeline parallelism (``SchedulerConfig.pipeline_stages`` S): up to S steps in flight, one per stage, each a
    batch of at most ``max_num_seqs`` sequences; the running requests, up to S times that, take turns. A request
    whose sampled token is in flight is not scheduled again until that token is read (its next chunk needs the
    value: unlike async scheduling, the token leaves the last stage S - 1 steps later than the next step starts).
    A prompt's chunks that sample nothing follow one another step by step: a stage writes one chunk's KV before the
    next chunk reaches it. Tokens are counted pending and confirmed as async scheduling's are."""

    def is_busy(self, request: Request) -> bool:
        return request.num_pending > 0


def step_policy(scheduler: Scheduler) -> SyncPolicy:
    """The policy the scheduler's config asks for."""
    if scheduler.config.pipeline_stages > 1:
        return PipelinePolicy(scheduler)
    return AsyncPolicy(scheduler) if scheduler.config.async_scheduling else SyncPolicy(scheduler)
