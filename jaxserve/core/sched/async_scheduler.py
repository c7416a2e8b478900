"""Schedulers that read a step's results while later steps run: ``AsyncScheduler`` (async scheduling) and
``PipelineScheduler`` (pipeline stages), and ``make_scheduler``, which picks the class a ``SchedulerConfig`` asks for.
They override the few ``Scheduler`` methods where they differ from steps one after the other; everything else
(budgets, chunking, admission, preemption) is shared.

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

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched.output import ScheduledRequest, SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """Async scheduling (see the module docstring): a step is scheduled while the previous one runs; the tokens of
    steps in flight are counted in ``Request.num_pending`` until ``update_from_output`` confirms them."""

    def _is_ending(self, request: Request) -> bool:
        # Its tokens, pending ones included, reach max_tokens or the model length: its pending token is its last.
        return request.num_pending > 0 and (
            request.num_output_tokens_with_pending >= request.sampling_params.max_tokens
            or request.num_tokens_with_pending >= self.config.max_model_len
        )

    def _may_resume(self, request: Request) -> bool:
        # Preempted with a token in flight: it restarts from its tokens, so once that token is known.
        return request.num_pending == 0

    def _update_after_schedule(self, scheduled: list[ScheduledRequest]) -> None:
        """Counts each chunk as computed as soon as it is scheduled, and each sampling chunk's token as pending, so
        that the next step can be scheduled before this one's results."""
        for s in scheduled:  # never with proposals (SchedulerConfig rules them out)
            request = self.requests[s.req_id]
            request.num_computed_tokens = s.start_pos + s.num_tokens
            if s.sample:
                request.num_pending += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Each sampled token is its request's oldest pending one: it is appended to ``output_token_ids`` and
        checked for a stop. A request that stops is finished, and the tokens of its steps still in flight are
        dropped. A preempted request keeps its token (it resumes from it)."""
        finished = []
        for s in scheduler_output.scheduled:
            request = self.requests.get(s.req_id)
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
                reason = request.stop_reason(tokens[0], self.config.max_model_len)
                if reason is not None:
                    finished.append(self.finish_request(request.request_id, reason))
                    continue
            if request.status is RequestStatus.RUNNING:
                self.block_manager.commit(request)
        return finished


class PipelineScheduler(AsyncScheduler):
    """Pipeline parallelism (``SchedulerConfig.pipeline_stages`` S): up to S steps in flight, one per stage, each a
    batch of at most ``max_num_seqs`` sequences; the running requests, up to S times that, take turns. A request
    whose sampled token is in flight is not scheduled again until that token is read (its next chunk needs the
    value: unlike async scheduling, the token leaves the last stage S - 1 steps later than the next step starts).
    A prompt's chunks that sample nothing follow one another step by step: a stage writes one chunk's KV before the
    next chunk reaches it. Tokens are counted pending and confirmed as async scheduling's are."""

    def _is_busy(self, request: Request) -> bool:
        return request.num_pending > 0


def make_scheduler(scheduler_config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    """The scheduler the config asks for: ``PipelineScheduler`` with ``pipeline_stages`` > 1, ``AsyncScheduler``
    with ``async_scheduling``, else ``Scheduler`` (steps one after the other)."""
    if scheduler_config.pipeline_stages > 1:
        return PipelineScheduler(scheduler_config, block_manager)
    if scheduler_config.async_scheduling:
        return AsyncScheduler(scheduler_config, block_manager)
    return Scheduler(scheduler_config, block_manager)
