"""The shapes a step is padded to, and the arithmetic of padding.

XLA compiles one program per shape, so a step's arrays are padded to a bucket (``StepBuckets``): its tokens to a
power of two (from 8, and 1 on one CPU device), its page tables' width to a power of two up to what
``max_model_len`` needs (one width on the CPU, whose C++ attention reads only each sequence's own pages), and its
page copies to a power of two up to ``max_seqs``; besides the shapes, a decode-only variant (every sequence computes
one token) serves batches of at most ``max_seqs`` tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.block_manager import NULL_PAGE
from jaxserve.models.decoder import AttentionBatch
from jaxserve.utils import cdiv, next_pow2


def next_pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` up to the first that holds ``hi``."""
    out, b = [], next_pow2(lo)
    while b < hi:
        out.append(b)
        b *= 2
    return out + [next_pow2(hi)]


def pick(buckets: list[int], n: int) -> int:
    """The smallest bucket that holds ``n``."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def padded_batch(batch: AttentionBatch | None, tokens: int, seqs: int, pages: int) -> AttentionBatch:
    """A packed step's ``AttentionBatch`` (host arrays) padded to a larger bucket, as ``InputBatch.pack`` pads:
    padding tokens at position 0 writing no K/V (slot -1), padding sequences empty, page tables widened with the
    null page. ``batch`` None: an empty step (every token padding)."""
    if batch is None:
        batch = AttentionBatch(
            np.zeros(0, np.int32),
            np.zeros(0, np.int32),
            np.zeros(0, np.int32),
            np.zeros((0, 0), np.int32),
            np.zeros(1, np.int32),
            np.int32(0),
        )
    t, n = len(batch.positions), len(batch.kv_lens)
    page_indices = np.full((seqs, pages), NULL_PAGE, np.int32)
    page_indices[:n, : batch.page_indices.shape[1]] = batch.page_indices
    return AttentionBatch(
        positions=np.pad(batch.positions, (0, tokens - t)),
        slot_mapping=np.pad(batch.slot_mapping, (0, tokens - t), constant_values=-1),
        kv_lens=np.pad(batch.kv_lens, (0, seqs - n)),
        page_indices=page_indices,
        cu_q_lens=np.pad(batch.cu_q_lens, (0, seqs - n), mode="edge"),
        num_seqs=batch.num_seqs,
    )


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The padded shapes of a runner's steps.

    Attributes:
        token_buckets: the widths of a step's tokens.
        page_buckets: the widths of its page tables.
        max_seqs: the most sequences a step holds (a power of two): also the longest run of page copies.
    """

    token_buckets: list[int]
    page_buckets: list[int]
    max_seqs: int

    @classmethod
    def choose(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        *,
        one_token_bucket: bool,
        one_page_bucket: bool,
    ) -> StepBuckets:
        """The buckets of a runner's budgets.

        Args:
            one_token_bucket: a token bucket of 1 besides those from 8. On one CPU device a one-request decode step
                costs its rows (SmolLM2's dense part 15.3 ms at 1 row against 19.4 at 8, so one request decodes
                ~1.45x faster); elsewhere matrix units pad rows to 8 anyway, and data-parallel replicas compile every
                variant once per replica. Only 1, not 2 and 4: each compiled step holds ~350 memory mappings on
                XLA:CPU (one object per kernel), and a process may have 65,530 (vm.max_map_count).
            one_page_bucket: only the widest page table (what ``max_model_len`` needs). The C++ attention of the CPU
                walks each sequence's own pages (its kv_lens), never the padding, so there the widest table serves
                every step: a third to a fifth of the variants to compile (a 2,048-token max_model_len: 5 widths).
        """
        tokens = set(next_pow2_buckets(8, max_num_batched_tokens))
        max_pages = cdiv(max_model_len, page_size)
        return cls(
            sorted(tokens | {1} if one_token_bucket else tokens),
            [next_pow2(max_pages)] if one_page_bucket else next_pow2_buckets(min(8, max_pages), max_pages),
            next_pow2(max_num_seqs),
        )

    def shapes(self) -> list[tuple[int, int, bool]]:
        """(token bucket, page bucket, decode_only) of every step variant traffic can need: decode-only steps (one
        token a sequence, at most max_seqs of them) in every token bucket up to the first that holds max_seqs."""
        holds_all = min((tb for tb in self.token_buckets if tb >= self.max_seqs), default=self.token_buckets[-1])
        return [
            (tb, pb, decode)
            for tb in self.token_buckets
            for pb in self.page_buckets
            for decode in ((False, True) if tb <= holds_all else (False,))
        ]

    def copy_chunks(self, ops: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Copy-on-write ops as (src, dst) arrays of power-of-two lengths up to max_seqs, padded with copies of the
        null page onto itself: every length is compiled at warm-up, however many pages a step copies. None: no op."""
        if not ops:
            return None
        chunks = []
        for i in range(0, len(ops), self.max_seqs):
            part = ops[i : i + self.max_seqs]
            src, dst = np.full((2, next_pow2(len(part))), NULL_PAGE, np.int32)
            src[: len(part)], dst[: len(part)] = zip(*part)
            chunks.append((src, dst))
        return chunks
