"""Step compilation: the shapes a step is padded to, one jitted step per variant, and compiling them ahead of time.

XLA compiles one program per shape, so a step's arrays are padded to a bucket (``StepBuckets``): its tokens to a
power of two (from 8, and 1 on one CPU device), its page tables' width to a power of two up to what
``max_model_len`` needs (one width on the CPU, whose C++ attention reads only each sequence's own pages), and its
page copies to a power of two up to ``max_seqs``; besides the shapes, a decode-only variant (every sequence computes
one token) serves batches of at most ``max_seqs`` tokens. ``StepCompiler`` jits a runner's step once per variant
(jit keys the shapes itself: one compile per bucket, and no request parameter changes a shape), compiles every
bucket before traffic (``warmup``), and lowers one on abstract arguments, for this machine's devices or for a chip
this process does not have (``lower_step``: ``jaxserve.aot`` and ``jaxserve plan``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.core.block_manager import NULL_PAGE
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.models.decoder import AttentionBatch
from jaxserve.utils import cdiv, next_pow2

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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
        """(token bucket, page bucket, decode_only) of every step variant traffic can need."""
        return [
            (tb, pb, decode)
            for tb in self.token_buckets
            for pb in self.page_buckets
            for decode in ((False, True) if tb <= self.max_seqs else (False,))
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


class StepCompiler:
    """The jitted steps of one runner, and their compilation ahead of traffic.

    Args:
        runner: the ``ModelRunner`` whose step this is: ``runner.step_function(decode_only)`` is what a step computes
            (a pure function of its arguments, see ``jaxserve.runner.model_runner``); its weights, KV pool and fed-forward
            samples, placed on its mesh, give the arguments' shardings, and with its sampler arrays the example
            arguments of warm-up and lowering.
        buckets: the shapes.
    """

    def __init__(self, runner: ModelRunner, buckets: StepBuckets):
        self.runner, self.buckets = runner, buckets
        self.num_compilations = 0  # traces of the step; a test asserts it stays flat in steady state
        self._steps: dict[bool, Callable] = {}

    def step(self, decode_only: bool) -> Callable:
        """The jitted step of every bucket; ``decode_only`` is the one variant besides the shapes.

        Request parameters change no shape (fixed-width sampler arrays, top logprobs always [B, K]) and the
        optional work (top logprobs, prompt logprobs) runs under ``lax.cond``, so nothing a request asks for can
        trigger a compile after warm-up.
        """
        fn = self._steps.get(decode_only)
        if fn is not None:
            return fn
        runner = self.runner
        compute = runner.step_function(decode_only)

        def step(*args):
            self.num_compilations += 1  # runs once per trace
            return compute(*args)

        kv, gathered, fed = runner.pool.format, runner.replicated, runner.fed_sharding
        placed = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        fn = self._steps[decode_only] = jax.jit(
            step,
            donate_argnums=(2, 3),  # the KV pool, updated in place
            out_shardings=(gathered, gathered, fed, kv, kv),
            in_shardings=(placed(runner.state), placed(runner.matmul_weights), kv, kv) + (gathered,) * 6 + (fed,),
        )
        return fn

    def warmup(self, workers: int | None = None) -> int:
        """Compiles every step variant and page-copy length ahead of traffic, without running any; logs how many and
        how long.

        Variants are traced and lowered one by one (Python), then compiled by ``workers`` threads at once
        (XLA compiles outside the GIL, but each compile is itself multi-threaded, so parallel compiles compete for
        the same cores: the default is a quarter of the CPUs, at least one). The jitted step finds them in JAX's
        caches on first use (no trace, no compile), and a second process in the persistent compilation
        cache. Returns the number of compilations (traces: a variant found in the persistent cache still
        counts).
        """
        runner, buckets = self.runner, self.buckets
        t0, before = time.perf_counter(), self.num_compilations
        lowered = [self.step(decode).trace(*self.example_args(tb, pb)).lower() for tb, pb, decode in buckets.shapes()]
        copies = [buckets.copy_chunks([(NULL_PAGE, NULL_PAGE)] * n)[0] for n in next_pow2_buckets(1, buckets.max_seqs)]
        lowered += [runner.pool.copy.lower(runner.k_cache, runner.v_cache, src, dst) for src, dst in copies]
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers or max(1, (os.cpu_count() or 1) // 4)) as pool:
            list(pool.map(lambda x: x.compile(), lowered))
        n = self.num_compilations - before
        logger.info(
            "warm-up: %d step variants (%d token x %d page buckets, decode-only for batches <= %d) and %d "
            "page-copy lengths in %.1fs (%.1fs tracing and lowering)",
            n,
            len(buckets.token_buckets),
            len(buckets.page_buckets),
            buckets.max_seqs,
            len(copies),
            time.perf_counter() - t0,
            t1 - t0,
        )
        return n

    def example_args(self, tokens: int, pages: int) -> tuple:
        """Arguments of a step of an empty batch in the (tokens, pages) bucket (every token is padding)."""
        runner = self.runner
        sb = min(tokens, self.buckets.max_seqs)
        batch = padded_batch(None, tokens, sb, pages)
        fed = runner.fed
        if runner.num_stages > 1:  # a batch for each stage, and the hidden states passed between them
            batch = jax.tree.map(lambda a: np.stack([a] * runner.num_stages), batch)
            fed = runner.stage_buffer_struct(tokens)
        rows = max(runner.inputs.sample_rows(tokens), sb)
        meta = runner.sampling_metadata([SamplingParams(temperature=0.0)], pad_to=rows)
        return (
            runner.state,
            runner.matmul_weights,
            runner.k_cache,
            runner.v_cache,
            np.zeros(tokens, np.int32),  # tokens
            np.full(tokens, -1, np.int32),  # fed_index: none
            batch,
            np.zeros(rows, np.int32),  # logits_indices
            meta,
            np.full(tokens, -1, np.int32),  # next_tokens: no prompt logprobs
            fed,
        )

    def lower_step(self, tokens: int, pages: int, decode_only: bool = False):
        """The step of one bucket lowered on abstract arguments (``.compile()`` then gives the partitioned HLO and
        what a device needs); runs nothing, and works for a topology's devices too (``jaxserve.aot``)."""
        replicated = self.runner.replicated

        def abstract(x):
            if isinstance(x, np.ndarray | np.generic):
                return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated)
            return x

        return self.step(decode_only).lower(*jax.tree.map(abstract, self.example_args(tokens, pages)))
