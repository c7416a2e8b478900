"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes each sequence's next k
tokens, greedily, and the target verifies them as with n-gram proposals (``jaxserve.spec_decode.ngram``).

The draft model runs in a ``ModelRunner`` of its own, on the target's devices, with its own KV pool indexed by the
same page ids: the target's block manager allocates for both, so a sequence's page table serves the two pools, and
the step's copy-on-write copies are applied to both. The draft's pool is filled lazily: per sequence the proposer
knows up to which position its draft KV is valid, and a proposal first computes the positions from there to the
sequence's next token (the whole prompt the first time, in budget-sized chunks), then decodes k - 1 more tokens one
at a time. After verification the valid length moves to the last confirmed position the draft computed; rejected
positions are overwritten later. A sequence preempted, finished or newly admitted starts from nothing.

The scheduler reserves the tokens (``Scheduler._propose`` returns placeholders), so pages for the proposals are
allocated before the draft writes its KV into them; ``fill`` then replaces the placeholders with the proposals.
"""

from __future__ import annotations

import dataclasses

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from jaxserve.core.sched.scheduler import Scheduler

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer:
    """Runs the draft model of one replica.

    Args:
        runner_cls: ``jaxserve.runner.model_runner.ModelRunner`` (passed in to keep this module free of jax at import).
        draft: the draft model (``LoadedModel``), of the target's vocabulary size.
        num_pages, page_size: the target pool's (the draft pool has as many pages, of its own shape).
        sched_cfg: the target's scheduler settings (the draft's steps use the same budgets).
        mesh, attention_impl: the target runner's.
    """

    def __init__(
        self,
        runner_cls,
        draft,
        num_pages: int,
        page_size: int,
        sched_cfg: SchedulerConfig,
        mesh,
        attention_impl: str = "auto",
    ):
        cfg = SchedulerConfig(
            sched_cfg.max_num_seqs,
            sched_cfg.max_num_batched_tokens,
            sched_cfg.max_model_len,
            sched_cfg.enable_prefix_caching,
            sched_cfg.policy,
        )
        self.runner = runner_cls(
            draft.config, draft.params, CacheConfig(page_size, num_pages), cfg, attention_impl, mesh=mesh
        )
        self.budget = cfg.max_num_batched_tokens
        self.max_seqs = cfg.max_num_seqs
        self.valid: dict[str, int] = {}  # request id -> positions [0, valid) hold the draft's KV for its tokens
        self._started: list[str] = []  # ids the draft runner holds since its last call
        self.num_steps = 0

    def fill(self, sched: SchedulerOutput, scheduler: Scheduler) -> SchedulerOutput:
        """``sched`` with its placeholder proposals replaced by the draft model's (run now)."""
        for rid in (*sched.finished_req_ids, *sched.preempted_req_ids):
            self.valid.pop(rid, None)
        if sched.copy_ops:  # the target's copy-on-write: the draft pool's pages must follow
            self.runner.execute(SchedulerOutput([], list(sched.copy_ops), [], [], 0))
        jobs = [s for s in sched.scheduled if s.draft_token_ids]
        if not jobs:
            return sched
        tables = scheduler.block_manager.page_tables
        tokens = {
            s.req_id: scheduler.requests[s.req_id].prompt_token_ids + scheduler.requests[s.req_id].output_token_ids
            for s in jobs
        }
        proposals: dict[str, list[int]] = {s.req_id: [] for s in jobs}
        # 1. Catch up to each sequence's next token (at s.start_pos), in budget-sized chunks; its sample is d1.
        pending = {s.req_id: (self.valid.get(s.req_id, 0), s.start_pos) for s in jobs}
        while pending:
            chunks, budget = [], self.budget
            for rid, (start, end) in list(pending.items()):
                if budget == 0 or len(chunks) == self.max_seqs:
                    break
                n = min(end + 1 - start, budget)
                chunks.append((rid, tokens[rid][start : start + n], start, start + n == end + 1))
                budget -= n
                if start + n == end + 1:
                    del pending[rid]
                else:
                    pending[rid] = (start + n, end)
            for rid, token in self._run(chunks, tables).items():
                proposals[rid].append(token)
        # 2. Decode the other proposals one position at a time.
        wanted = {s.req_id: len(s.draft_token_ids) for s in jobs}
        pos = {s.req_id: s.start_pos for s in jobs}
        for j in range(1, max(wanted.values())):
            live = [rid for rid in wanted if wanted[rid] > j]
            for i in range(0, len(live), self.max_seqs):
                part = live[i : i + self.max_seqs]
                chunks = [(rid, [proposals[rid][-1]], pos[rid] + j, True) for rid in part]
                for rid, token in self._run(chunks, tables).items():
                    proposals[rid].append(token)
        by_id = {s.req_id: s for s in jobs}
        scheduled = []
        for s in sched.scheduled:
            if s.req_id in by_id:
                d = proposals[s.req_id][: len(s.draft_token_ids)]
                s = dataclasses.replace(
                    s, token_ids=s.token_ids[: len(s.token_ids) - len(d)] + d, draft_token_ids=tuple(d)
                )
            scheduled.append(s)
        return dataclasses.replace(sched, scheduled=scheduled)

    def _run(self, chunks: list[tuple[str, list[int], int, bool]], tables: dict) -> dict[str, int]:
        """One draft step over (request id, tokens, start position, sample) chunks; the greedy samples."""
        scheduled = [
            ScheduledRequest(
                rid, list(toks), start, sample, 0, list(tables[rid]), NewRequestData(list(toks), [], _GREEDY)
            )
            for rid, toks, start, sample in chunks
        ]
        out = self.runner.execute(
            SchedulerOutput(scheduled, [], self._started, [], sum(len(t) for _, t, _, _ in chunks))
        )
        self._started = [rid for rid, _, _, _ in chunks]
        self.num_steps += 1
        return {rid: toks[0].token_id for rid, toks in out.sampled.items()}

    def update(self, sched: SchedulerOutput, emitted: dict[str, list[int]]) -> None:
        """After verification: each proposed-for sequence's draft KV is valid up to its last confirmed position
        the draft computed (its next token and the proposals it fed back: all but the last)."""
        for s in sched.scheduled:
            if s.draft_token_ids and s.req_id in emitted:
                accepted = len(emitted[s.req_id]) - 1
                self.valid[s.req_id] = s.start_pos + min(accepted, len(s.draft_token_ids) - 1) + 1
