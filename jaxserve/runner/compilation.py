"""Step compilation: one jitted step per variant, compiled ahead of traffic or lowered for another chip.

``StepCompiler`` jits a runner's ``StepProgram`` once per variant (jit keys the shapes itself: one compile per
bucket of ``jaxserve.runner.buckets``, and no request parameter changes a shape), compiles every bucket before
traffic (``warmup``), and lowers one on abstract arguments, for this machine's devices or for a chip this process
does not have (``lower_step``: ``jaxserve.aot`` and ``jaxserve plan``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxserve.core.block_manager import NULL_PAGE
from jaxserve.runner.buckets import StepBuckets, next_pow2_buckets
from jaxserve.sampling.sampler import FULL, VARIANTS

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a runner hands its compiler: the step, where its arguments and results live, and arguments to trace it on.

    Attributes:
        compute: ``compute(decode_only)`` is what a step computes, a pure function of its arguments (see
            ``jaxserve.runner.model_runner``); ``decode_only`` picks the attention's variant.
        in_shardings / out_shardings: of the step's arguments (weights, KV pool, host arrays, fed-forward samples)
            and results; ``donate_argnums``: the arguments updated in place (the KV pool).
        example_args: ``example_args(tokens, pages, variant)``, the arguments of a step of an empty batch in that
            bucket, for one of the sampler's variants (``jaxserve.sampling.sampler.VARIANTS``).
        host_sharding: where host (numpy) arguments go; ``lower_step`` gives them that sharding.
        lower_copy: ``lower_copy(src, dst)``, the pool's page copy lowered for those index arrays (warm-up).
        variants: the sampler's variants the steps serve (warm-up compiles each).
    """

    compute: Callable[[bool], Callable]
    in_shardings: tuple
    out_shardings: tuple
    donate_argnums: tuple[int, ...]
    example_args: Callable[[int, int], tuple]
    host_sharding: Any
    lower_copy: Callable[[np.ndarray, np.ndarray], Any]
    variants: tuple[str, ...] = VARIANTS


class StepCompiler:
    """The jitted steps of one runner, and their compilation ahead of traffic.

    Args:
        program: the step and how it is placed (``StepProgram``).
        buckets: the shapes.
    """

    def __init__(self, program: StepProgram, buckets: StepBuckets):
        self.program, self.buckets = program, buckets
        self.num_compilations = 0  # traces of the step; a test asserts it stays flat in steady state
        self._steps: dict[bool, Callable] = {}

    def step(self, decode_only: bool) -> Callable:
        """The jitted step of every bucket and sampler variant; ``decode_only`` picks the attention's variant.

        Request parameters change no shape (fixed-width sampler arrays, top logprobs always [B, K]); what they
        ask for picks one of the sampler's variants (``SamplingMetadata.variant``, static: one trace each), which
        warm-up compiles, so nothing a request asks for triggers a compile after warm-up.
        """
        fn = self._steps.get(decode_only)
        if fn is not None:
            return fn
        program = self.program
        compute = program.compute(decode_only)

        def step(*args):
            self.num_compilations += 1  # runs once per trace
            return compute(*args)

        fn = self._steps[decode_only] = jax.jit(
            step,
            donate_argnums=program.donate_argnums,
            out_shardings=program.out_shardings,
            in_shardings=program.in_shardings,
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
        program, buckets = self.program, self.buckets
        t0, before = time.perf_counter(), self.num_compilations
        lowered = [
            self.step(decode).trace(*program.example_args(tb, pb, variant)).lower()
            for tb, pb, decode in buckets.shapes()
            for variant in program.variants
        ]
        copies = [buckets.copy_chunks([(NULL_PAGE, NULL_PAGE)] * n)[0] for n in next_pow2_buckets(1, buckets.max_seqs)]
        lowered += [program.lower_copy(src, dst) for src, dst in copies]
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(workers or max(1, (os.cpu_count() or 1) // 4)) as pool:
            list(pool.map(lambda x: x.compile(), lowered))
        n = self.num_compilations - before
        logger.info(
            "warm-up: %d step variants (%d token x %d page buckets, decode-only for batches <= %d, %d sampler "
            "variants) and %d page-copy lengths in %.1fs (%.1fs tracing and lowering)",
            n,
            len(buckets.token_buckets),
            len(buckets.page_buckets),
            buckets.max_seqs,
            len(program.variants),
            len(copies),
            time.perf_counter() - t0,
            t1 - t0,
        )
        return n

    def lower_step(self, tokens: int, pages: int, decode_only: bool = False, variant: str = FULL):
        """The step of one bucket lowered on abstract arguments (``.compile()`` then gives the partitioned HLO and
        what a device needs), with the sampler's ``variant`` (the default, ``"full"``, holds every other's work);
        runs nothing, and works for a topology's devices too (``jaxserve.aot``)."""
        host = self.program.host_sharding

        def abstract(x):
            if isinstance(x, np.ndarray | np.generic):
                return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=host)
            return x

        args = self.program.example_args(tokens, pages, variant)
        return self.step(decode_only).lower(*jax.tree.map(abstract, args))
