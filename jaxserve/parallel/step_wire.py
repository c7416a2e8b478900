"""What process 0 sends the other processes each step: the scheduler's changes, in a few bytes.

A ``SchedulerOutput`` is already a list of changes (vLLM v1's contract: a request's prompt and sampling parameters
come once, when it starts; then each step says which requests run, how many tokens, which pages they gained).
Every follower applies them to its own ``ModelRunner``, which packs its own step arrays, exactly as process 0's
did: the fixed-width sampler arrays ([B, V/32] token masks, [B, max_model_len] histories, ...) never travel.

Encoding: a request is named by a small integer handle from the step it starts (its id travels once); the
per-request fields of a step are int32 columns, and the token ids, new pages and proposals are flat int32 arrays
they index. A decode step of 128 requests with no new one is about 4.2 KB pickled, 1.3 KB compressed
(``tests/parallel/test_wire.py`` bounds it at 4 KB; ``bench/step_bytes.py`` compares it with the packed arrays).
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.sched.output import ScheduledRequest, SchedulerOutput

# Per scheduled request: handle, start_pos, tokens, flags, pages_from, new pages, proposals.
_COLUMNS = 7
_SAMPLE, _FROM_PREVIOUS_STEP = 1, 2  # flags


def has_changes(sched: SchedulerOutput) -> bool:
    """Whether a step has anything for the other processes: requests to run, pages to copy, requests to forget."""
    return bool(sched.scheduled or sched.copy_ops or sched.finished_req_ids or sched.preempted_req_ids)


class StepEncoder:
    """Process 0's side: ``SchedulerOutput`` (+ structured-output token masks) -> a small picklable tuple."""

    def __init__(self):
        self._handles: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0

    def _handle(self, req_id: str) -> int:
        if self._free:
            h = self._free.pop()
        else:
            h, self._next = self._next, self._next + 1
        self._handles[req_id] = h
        return h

    def _drop(self, ids: list[str]) -> tuple[list[int], list[str]]:
        """Handles of the ids this encoder named (and forgets them); the ids it never named, as they are."""
        handles, unknown = [], []
        for rid in ids:
            h = self._handles.pop(rid, None)
            if h is None:
                unknown.append(rid)
            else:
                handles.append(h)
                self._free.append(h)
        return handles, unknown

    def encode(self, sched: SchedulerOutput, token_masks: dict[str, np.ndarray] | None = None) -> tuple:
        finished, preempted = self._drop(sched.finished_req_ids), self._drop(sched.preempted_req_ids)
        n = len(sched.scheduled)
        cols = np.empty((_COLUMNS, n), np.int32)
        new, tokens, pages, drafts = [], [], [], []
        for i, s in enumerate(sched.scheduled):
            if s.new is not None:
                h = self._handle(s.req_id)
                new.append((i, s.req_id, s.new))
            else:
                h = self._handles[s.req_id]
            cols[:, i] = (
                h,
                s.start_pos,
                len(s.token_ids),
                s.sample * _SAMPLE | s.from_previous_step * _FROM_PREVIOUS_STEP,
                s.pages_from,
                len(s.new_page_ids),
                len(s.draft_token_ids),
            )
            tokens.extend(s.token_ids)
            pages.extend(s.new_page_ids)
            drafts.extend(s.draft_token_ids)
        flat = np.asarray(tokens + pages + drafts, np.int32)
        copies = np.asarray(sched.copy_ops, np.int32).reshape(-1)
        masks = None
        if token_masks:
            masks = {self._handles[rid]: row for rid, row in token_masks.items() if rid in self._handles}
        return (
            cols.tobytes(),
            flat.tobytes(),
            copies.tobytes(),
            finished,
            preempted,
            new,
            sched.num_scheduled_tokens,
            masks,
        )


class StepDecoder:
    """A follower's side: the tuple back to the ``SchedulerOutput`` (and token masks) process 0 scheduled."""

    def __init__(self):
        self._ids: dict[int, str] = {}

    def decode(self, message: tuple) -> tuple[SchedulerOutput, dict[str, np.ndarray] | None]:
        cols, flat, copies, finished, preempted, new, num_tokens, masks = message
        (finished_h, finished_ids), (preempted_h, preempted_ids) = finished, preempted
        finished_req_ids = [self._ids.pop(h) for h in finished_h] + finished_ids
        preempted_req_ids = [self._ids.pop(h) for h in preempted_h] + preempted_ids
        cols = np.frombuffer(cols, np.int32).reshape(_COLUMNS, -1)
        flat = np.frombuffer(flat, np.int32).tolist()
        starts = {i: (rid, data) for i, rid, data in new}
        n = cols.shape[1]
        t = 0
        p = int(cols[2].sum())
        d = p + int(cols[5].sum())
        scheduled = []
        for i in range(n):
            h, start_pos, nt, flags, pages_from, npg, nd = (int(x) for x in cols[:, i])
            data = None
            if i in starts:
                rid, data = starts[i]
                self._ids[h] = rid
            scheduled.append(
                ScheduledRequest(
                    self._ids[h],
                    flat[t : t + nt],
                    start_pos,
                    bool(flags & _SAMPLE),
                    pages_from,
                    flat[p : p + npg],
                    data,
                    tuple(flat[d : d + nd]),
                    bool(flags & _FROM_PREVIOUS_STEP),
                )
            )
            t, p, d = t + nt, p + npg, d + nd
        pairs = np.frombuffer(copies, np.int32).reshape(-1, 2)
        sched = SchedulerOutput(
            scheduled,
            [(int(a), int(b)) for a, b in pairs],
            finished_req_ids,
            preempted_req_ids,
            num_tokens,
        )
        token_masks = {self._ids[h]: row for h, row in masks.items()} if masks else None
        return sched, token_masks
