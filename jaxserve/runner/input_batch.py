"""The runner's record of the live requests and the packing of a step into arrays of a bucketed shape.

``InputBatch.update`` applies a ``SchedulerOutput``'s changes (requests started, finished, preempted; new pages) to
a standing page table, one row per live request; ``InputBatch.pack`` turns the step into padded host arrays whose
shapes come from a few buckets (tokens in the step, sequences, pages per sequence), so that one compiled step
serves every mix of requests of the same bucket. Host code: numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.block_manager import NULL_PAGE
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.models.decoder import AttentionBatch
from jaxserve.runner.buckets import pick
from jaxserve.utils import cdiv


@dataclasses.dataclass
class CachedRequest:
    """The runner's own record of a live request: its row of the standing page table and its tokens (prompt,
    then every token the runner sampled for it), for the sampler's penalties and the prompt logprobs."""

    row: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    pending: int = 0  # async scheduling: tokens sampled by steps in flight, not yet in token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class InputBatch:
    """The live requests (id -> ``CachedRequest``), the standing page table, and the step's packing.

    Args:
        page_size: tokens per KV page.
        token_buckets, page_buckets: the padded widths of a step's tokens and of its page tables.
        max_seqs: the most sequences a step holds (a power of two).
        num_speculative_tokens: proposals per sequence (each one more sampled row).
    """

    def __init__(
        self,
        page_size: int,
        token_buckets: list[int],
        page_buckets: list[int],
        max_seqs: int,
        num_speculative_tokens: int = 0,
    ):
        self.page_size, self.token_buckets, self.page_buckets = page_size, token_buckets, page_buckets
        self.max_seqs, self.num_speculative_tokens = max_seqs, num_speculative_tokens
        self.requests: dict[str, CachedRequest] = {}
        self.page_table = np.full((2 * max_seqs, page_buckets[-1]), NULL_PAGE, np.int32)
        self._free_rows = list(range(len(self.page_table) - 1, -1, -1))

    def update(self, sched: SchedulerOutput) -> None:
        """Applies a step's changes to the requests the runner holds: drops finished and preempted ones, starts
        new ones, writes page-table changes into the standing table."""
        for rid in (*sched.finished_req_ids, *sched.preempted_req_ids):
            gone = self.requests.pop(rid, None)
            if gone is not None:
                self._free_rows.append(gone.row)
        for s in sched.scheduled:
            if s.new is not None:
                if s.req_id in self.requests:
                    raise ValueError(f"request {s.req_id!r} is started twice")
                if not self._free_rows:  # more live requests than rows: double the table
                    n = len(self.page_table)
                    self.page_table = np.concatenate([self.page_table, np.full_like(self.page_table, NULL_PAGE)])
                    self._free_rows = list(range(2 * n - 1, n - 1, -1))
                row = self._free_rows.pop()
                self.page_table[row] = NULL_PAGE
                new = s.new
                self.requests[s.req_id] = CachedRequest(
                    row,
                    list(new.prompt_token_ids) + list(new.output_token_ids),
                    len(new.prompt_token_ids),
                    new.sampling_params,
                )
            row = self.requests[s.req_id].row
            self.page_table[row, s.pages_from : s.pages_from + len(s.new_page_ids)] = s.new_page_ids

    def sample_rows(self, token_bucket: int) -> int:
        """Rows the step samples in a token bucket: one per sequence, and with speculative decoding one more per
        proposed token (never more than the bucket's tokens)."""
        return min(token_bucket, self.max_seqs * (1 + self.num_speculative_tokens))

    def pack(
        self, sched: SchedulerOutput, fed_rows: dict[str, int]
    ) -> tuple[np.ndarray, np.ndarray, AttentionBatch, np.ndarray, list[tuple[int, int]]]:
        """SchedulerOutput -> (tokens [Tb], fed_index [Tb], AttentionBatch, logits_indices [Rb], rows) as padded
        host arrays (after ``update``: the page tables come from the standing table).

        ``fed_index`` says which positions take a token the previous step sampled, still on the device (async
        scheduling: a chunk ``from_previous_step``): the row of that step's samples (``fed_rows``: request id ->
        row), -1 elsewhere; ``tokens`` holds 0 there. ``logits_indices`` are the positions sampled: each sequence's
        last, and the positions of its proposals' predecessors before it; ``rows`` says whose (sequence index, index
        among its sampled positions) each is."""
        seqs = sched.scheduled
        num_tokens = sum(s.num_tokens for s in seqs)
        tb = pick(self.token_buckets, num_tokens)
        sb = max(min(tb, self.max_seqs), len(seqs))
        kv_lens = np.zeros(sb, np.int32)
        for i, s in enumerate(seqs):
            kv_lens[i] = s.start_pos + s.num_tokens
        pb = pick(self.page_buckets, cdiv(int(kv_lens.max()), self.page_size))
        rows = np.array([self.requests[s.req_id].row for s in seqs], np.int32)
        page_indices = np.full((sb, pb), NULL_PAGE, np.int32)
        page_indices[: len(seqs)] = self.page_table[rows, :pb]
        tokens = np.zeros(tb, np.int32)
        fed_index = np.full(tb, -1, np.int32)
        positions = np.zeros(tb, np.int32)
        slots = np.full(tb, -1, np.int32)
        cu = np.zeros(sb + 1, np.int32)
        t = 0
        for i, s in enumerate(seqs):
            n = s.num_tokens
            pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int32)
            if s.from_previous_step:  # sampled by the step in flight: read on the device (see the step)
                if s.req_id not in fed_rows:
                    raise ValueError(f"request {s.req_id!r} is fed a token the previous step did not sample")
                fed_index[t] = fed_rows[s.req_id]
            tokens[t + s.from_previous_step : t + n] = s.token_ids
            positions[t : t + n] = pos
            slots[t : t + n] = page_indices[i, pos // self.page_size] * self.page_size + pos % self.page_size
            t += n
            cu[i + 1] = t
        cu[len(seqs) + 1 :] = t
        if tokens.min() < 0:  # e.g. a draft model's PLACEHOLDER proposal left unfilled
            raise ValueError(f"a scheduled token id is negative: {sorted(set(tokens[tokens < 0].tolist()))}")
        logits_indices = np.zeros(max(self.sample_rows(tb), sb), np.int32)
        rows = []
        for i, s in enumerate(seqs):
            d = len(s.draft_token_ids)
            for j in range(d + 1):
                logits_indices[len(rows)] = cu[i + 1] - 1 - d + j
                rows.append((i, j))
        batch = AttentionBatch(
            positions=positions,
            slot_mapping=slots,
            kv_lens=kv_lens,
            page_indices=page_indices,
            cu_q_lens=cu,
            num_seqs=np.int32(len(seqs)),
        )
        return tokens, fed_index, batch, logits_indices, rows


def targets(sched: SchedulerOutput, reqs: list[CachedRequest], padded: int) -> np.ndarray:
    """[Tb] the token that follows each position of the step (prompt_logprobs' targets; 0 past the end)."""
    out = np.zeros(padded, np.int32)
    t = 0
    for s, r in zip(sched.scheduled, reqs):
        n = s.num_tokens
        nxt = r.token_ids[s.start_pos + 1 : s.start_pos + n + 1]
        out[t : t + len(nxt)] = nxt
        t += n
    return out
