"""Continuous batching on the host: which requests compute how many tokens each step.

The rule (vLLM v1): every request has ``num_computed_tokens`` catching up to ``num_tokens``. Each step has
a budget of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences. Running requests go first
(a decode needs 1 token, a partly prefilled prompt gets ``min(remaining, budget)``: chunked prefill), then
waiting ones (after a prefix-cache lookup) while budget, sequences and pages last. Prefill, decode and
mixed batches all come out of that one rule. When a running request cannot get a page, the newest running
request (lowest priority under "priority") is preempted: its pages are freed, its tokens kept, and it is
recomputed later.

``Scheduler`` reads a step's results after the step. ``AsyncScheduler`` (async scheduling) and ``PipelineScheduler``
(pipeline stages) read them while later steps run (``jaxserve.core.sched.async_scheduler``); they override the few
methods where that differs (``_is_ending``, ``_is_busy``, ``_may_resume``, ``_update_after_schedule`` and
``update_from_output``), and ``make_scheduler`` picks the class a config asks for. Plain Python, no tensor library;
``SchedulerOutput`` (``jaxserve.core.sched.output``) is the one contract to the runner.
"""

from __future__ import annotations

from collections import deque

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import (
    FINISH_STATUS,
    Request,
    RequestStatus,
    check_prompt_length,
    max_computed_tokens,
)
from jaxserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput, SchedulerStats
from jaxserve.spec_decode.ngram import PLACEHOLDER, propose_ngram, speculates


def _priority(request: Request) -> tuple:
    return request.sort_key("priority")


class Scheduler:
    """Waiting and running queues over a ``BlockManager``. Steps run one after the other: a step is scheduled once
    the previous one's tokens reached the scheduler (``update_from_output``), so no token is ever pending.

    Args:
        scheduler_config: budgets, ``max_model_len`` and policy ("fcfs" or "priority").
        block_manager: the page allocator; its ``enable_prefix_caching`` must match the config's.
    """

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager):
        if scheduler_config.enable_prefix_caching != block_manager.enable_prefix_caching:
            raise ValueError(
                f"SchedulerConfig.enable_prefix_caching={scheduler_config.enable_prefix_caching} but the block "
                f"manager has enable_prefix_caching={block_manager.enable_prefix_caching}"
            )
        self.config = scheduler_config
        self.block_manager = block_manager
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()  # fcfs: arrival order, preempted in front; priority: sorted
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding
        self._finished_ids: list[str] = []
        self._known: set[str] = set()  # requests the runner holds state for (sent since admission / resume)

    # ------------------------------------------------------------------ requests in and out
    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_len = self.config.max_model_len
        try:
            check_prompt_length(request.num_prompt_tokens, max_len)
        except ValueError as e:
            raise ValueError(f"request {request.request_id!r}: {e}") from None
        bm = self.block_manager
        tokens = max_computed_tokens(request, max_len)
        if bm.pages_needed(tokens) > bm.num_usable_pages:
            raise ValueError(
                f"request {request.request_id!r} may need {tokens} tokens of KV "
                f"({bm.pages_needed(tokens)} pages of {bm.page_size}), but the pool has only "
                f"{bm.num_usable_pages} pages; lower max_tokens or grow the pool"
            )

    def add_request(self, request: Request) -> None:
        """Queues a new request.

        Raises:
            ValueError: the id is in use, the prompt leaves no room to generate within ``max_model_len``
                (``jaxserve.core.request.check_prompt_length``), or the request may need more pages than the whole
                pool.
        """
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """Queues new requests atomically: every one is validated (ids unique among them too) before any is
        queued. The next ``schedule`` admits as many as its token budget, sequences and pages allow.

        Raises:
            ValueError: as ``add_request``, for the first bad request; nothing is queued then.
        """
        ids: set[str] = set()
        for request in requests:
            self._validate(request)
            if request.request_id in ids:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            ids.add(request.request_id)
        for request in requests:
            self.requests[request.request_id] = request
            self._push_waiting(request)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Adds ``child`` sharing the running parent's computed pages (``n > 1`` over one prompt).

        The child's tokens must start with the parent's computed tokens (e.g. the same prompt). It shares
        the pages of ``min(parent.num_computed_tokens, child.num_tokens - 1)`` tokens and recomputes the
        rest; a write into a shared page becomes a copy-on-write. Without a free sequence slot it is queued
        as a plain request.
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"fork_request: parent {parent_id!r} is not running")
        self._validate(child)
        shared = min(parent.num_computed_tokens, child.num_tokens - 1)
        if child.token_slice(0, shared) != parent.token_slice(0, shared):
            raise ValueError(f"fork_request: {child.request_id!r} does not start with the tokens of {parent_id!r}")
        self.requests[child.request_id] = child
        if shared <= 0 or len(self.running) >= self.config.max_num_seqs:
            self._push_waiting(child)
            return
        self.block_manager.fork(parent_id, child.request_id, shared)
        child.num_computed_tokens = child.num_cached_tokens = shared
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """Finishes a waiting or running request ("stop", "length" or "abort") and frees its pages at once.

        Returns the request, or None if it is unknown or already finished.
        """
        if reason not in FINISH_STATUS:
            raise ValueError(f"finish_request: reason must be one of {sorted(FINISH_STATUS)}, got {reason!r}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.num_pending = 0  # tokens of steps in flight (async scheduling): never confirmed now, never shown
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = FINISH_STATUS[reason]
        self.block_manager.free(request_id)
        self._finished_ids.append(request_id)
        self._known.discard(request_id)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _push_waiting(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            key = _priority(request)
            index = next((i for i, r in enumerate(self.waiting) if key < _priority(r)), len(self.waiting))
            self.waiting.insert(index, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self._known.discard(request.request_id)  # the runner drops it (preempted_req_ids); resumed as new
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request, front=True)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and chunks, allocating (or preempting for) their pages."""
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        chunks: dict[str, tuple[Request, int, int, list[tuple[int, int]]]] = {}  # id -> (req, start, n, copies)
        drafts: dict[str, list[int]] = {}
        preempted: list[str] = []

        order = self.running if self.policy == "fcfs" else sorted(self.running, key=_priority)
        ending = 0  # running requests whose pending token is their last: they take no sequence slot any more
        for request in list(order):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._is_ending(request):
                ending += 1
                continue
            if self._is_busy(request) or len(chunks) >= self.config.max_num_seqs:
                continue
            n = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if n <= 0:
                continue
            proposed = self._propose(request, budget) if n == 1 else []
            n += len(proposed)
            while (copies := bm.allocate(request, n)) is None:
                victim = self.running[-1] if self.policy == "fcfs" else max(self.running, key=_priority)
                # Victims come after `request` in `order`, so none holds a chunk of this step yet.
                assert victim.request_id not in chunks
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                chunks[request.request_id] = (request, request.num_computed_tokens, n, copies)
                if proposed:
                    drafts[request.request_id] = proposed
                budget -= n

        # Admit waiting requests, unless memory was so tight that someone was just preempted.
        seqs = self.config.max_num_seqs
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(chunks) < seqs
            and len(self.running) - ending < seqs * self.config.pipeline_stages
        ):
            request = self.waiting[0]
            if not self._may_resume(request):
                break
            # prompt_logprobs need every prompt position computed, so such requests skip the prefix cache.
            wants_prompt_logprobs = getattr(request.sampling_params, "prompt_logprobs", None) is not None
            cached = [] if wants_prompt_logprobs else bm.get_cached_prefix(request)
            num_cached = len(cached) * bm.page_size
            n = min(request.num_tokens - num_cached, budget)
            copies = bm.allocate(request, n, cached)
            if copies is None:
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks[request.request_id] = (request, num_cached, n, copies)
            budget -= n

        scheduled = []
        for rid, (req, start, n, _) in chunks.items():
            table = bm.page_tables[rid]
            new = None
            if rid not in self._known:
                self._known.add(rid)
                new = NewRequestData(list(req.prompt_token_ids), list(req.output_token_ids), req.sampling_params)
            # Entries before the page holding `start` never change while the request runs (copy-on-write only
            # replaces pages this step writes); the rest is re-sent: new pages, and at most one replaced.
            pages_from = 0 if new else start // bm.page_size
            proposed = drafts.get(rid, ())
            end = start + n - len(proposed)
            # Async scheduling: a chunk past the known tokens is the one token the step in flight samples.
            fed = end > req.num_tokens
            assert not fed or start == req.num_tokens == end - 1, (req, start, end)
            scheduled.append(
                ScheduledRequest(
                    req_id=rid,
                    token_ids=req.token_slice(start, min(end, req.num_tokens)) + list(proposed),
                    start_pos=start,
                    sample=end == req.num_tokens_with_pending,
                    pages_from=pages_from,
                    new_page_ids=table[pages_from:],
                    new=new,
                    draft_token_ids=tuple(proposed),
                    from_previous_step=fed,
                )
            )
        self._update_after_schedule(scheduled)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            copy_ops=[op for (_, _, _, copies) in chunks.values() for op in copies],
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            num_scheduled_tokens=sum(s.num_tokens for s in scheduled),
        )

    # What sets a scheduler that reads results while later steps run apart (``jaxserve.core.sched.async_scheduler``).
    def _is_ending(self, request: Request) -> bool:
        """A running request that must not be scheduled again: its last token is already in flight."""
        return False

    def _is_busy(self, request: Request) -> bool:
        """A running request that sits this step out (pipeline stages: its next token is still in flight)."""
        return False

    def _may_resume(self, request: Request) -> bool:
        """Whether a waiting (preempted) request may be admitted now."""
        return True

    def _update_after_schedule(self, scheduled: list[ScheduledRequest]) -> None:
        """Bookkeeping once a step is scheduled, before it runs."""

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Speculative decoding: n-gram proposals for a decoding request, as many as fit its budget, its
        ``max_tokens`` and the model length (none when it is off or the request's parameters rule it out)."""
        spec = self.config.speculative
        if spec is None or not speculates(request.sampling_params):
            return []
        k = min(
            spec.num_speculative_tokens,
            budget - 1,
            self.config.max_model_len - request.num_tokens,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
        )
        if k <= 0:
            return []
        if spec.method == "draft_model":  # reserved now, proposed by the draft model before the step runs
            return [PLACEHOLDER] * k
        tokens = request.prompt_token_ids + request.output_token_ids
        return propose_ngram(tokens, k, spec.prompt_lookup_max, spec.prompt_lookup_min)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[Request]:
        """Advances the scheduled requests, appends sampled tokens and finishes stopped requests.

        Args:
            scheduler_output: what ``schedule`` returned for this step.
            sampled_token_ids: request id -> sampled tokens, for every scheduled request with ``sample``.

        Returns:
            The requests this step finished ("stop" or "length"); their pages are already free.

        Raises:
            ValueError: a request that was due a sample has none.
        """
        live = []
        for s in scheduler_output.scheduled:
            request = self.requests.get(s.req_id)
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
            self.block_manager.commit(request)
            if not s.sample:
                continue
            tokens = sampled_token_ids[s.req_id]
            if s.draft_token_ids:
                self.num_draft_tokens += len(s.draft_token_ids)
                self.num_accepted_tokens += len(tokens) - 1
            for token in tokens:
                request.output_token_ids.append(token)
                reason = request.stop_reason(token, self.config.max_model_len)
                if reason is not None:
                    finished.append(self.finish_request(request.request_id, reason))
                    break
            if s.draft_token_ids and request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += len(tokens) - 1  # the accepted proposals
                self.block_manager.commit(request)
        return finished

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_used_pages=bm.num_used_pages,
            num_usable_pages=bm.num_usable_pages,
            kv_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
        )
