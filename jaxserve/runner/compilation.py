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
import threading
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
        deferred: those of ``variants`` that warm-up compiles in the background once it has returned (a step that
            picks one waits for it: ``ready``), so that serving starts after the common variants' compiles alone.
    """

    compute: Callable[[bool], Callable]
    in_shardings: tuple
    out_shardings: tuple
    donate_argnums: tuple[int, ...]
    example_args: Callable[[int, int], tuple]
    host_sharding: Any
    lower_copy: Callable[[np.ndarray, np.ndarray], Any]
    variants: tuple[str, ...] = VARIANTS
    deferred: tuple[str, ...] = ()


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
        self._deferred: concurrent.futures.Future | None = None  # the background compile of program.deferred

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
        how long. The sampler's ``program.deferred`` variants are compiled after this returns, by a background
        thread (``ready`` waits for them).

        Variants are traced and lowered one by one (Python), then compiled by ``workers`` threads at once
        (XLA compiles outside the GIL, but each compile is itself multi-threaded, so parallel compiles compete for
        the same cores: the default is a quarter of the CPUs, at least one). The jitted step finds them in JAX's
        caches on first use (no trace, no compile), and a second process in the persistent compilation
        cache. Returns the number of compilations (traces: a variant found in the persistent cache still
        counts).
        """
        program, buckets = self.program, self.buckets
        workers = workers or max(1, (os.cpu_count() or 1) // 4)
        t0, before = time.perf_counter(), self.num_compilations
        now = [v for v in program.variants if v not in program.deferred]
        lowered = self._lower(now)
        copies = [buckets.copy_chunks([(NULL_PAGE, NULL_PAGE)] * n)[0] for n in next_pow2_buckets(1, buckets.max_seqs)]
        lowered += [program.lower_copy(src, dst) for src, dst in copies]
        t1 = time.perf_counter()
        _compile(lowered, workers)
        n = self.num_compilations - before
        logger.info(
            "warm-up: %d step variants (%d token x %d page buckets, decode-only for batches <= %d, sampler "
            "variants %s) and %d page-copy lengths in %.1fs (%.1fs tracing and lowering)",
            n,
            len(buckets.token_buckets),
            len(buckets.page_buckets),
            buckets.max_seqs,
            "/".join(now),
            len(copies),
            time.perf_counter() - t0,
            t1 - t0,
        )
        later = [v for v in program.variants if v in program.deferred]
        if later:
            self._deferred = concurrent.futures.Future()
            threading.Thread(target=self._compile_later, args=(later, workers), daemon=True).start()
        return n

    def _lower(self, variants: list[str]) -> list:
        return [
            self.step(decode).trace(*self.program.example_args(tb, pb, variant)).lower()
            for tb, pb, decode in self.buckets.shapes()
            for variant in variants
        ]

    def _compile_later(self, variants: list[str], workers: int) -> None:
        """The background thread of ``warmup``: compiles ``variants`` of every bucket, then resolves ``ready``'s wait
        (with the compiler's error, if one failed: the step that needs it raises it)."""
        t0 = time.perf_counter()
        try:
            _compile(self._lower(variants), workers)
        except Exception as e:  # handed to the step that waits for it
            self._deferred.set_exception(e)
            logger.error("warm-up in the background: the sampler's %s variant failed to compile: %s", variants, e)
            return
        self._deferred.set_result(None)
        logger.info(
            "warm-up in the background: sampler variants %s in %.1fs", "/".join(variants), time.perf_counter() - t0
        )

    def ready(self, variant: str) -> None:
        """Waits until the step of the sampler's ``variant`` is compiled, where warm-up left it to the background."""
        future = self._deferred
        if future is None or variant not in self.program.deferred:
            return
        waited, t0 = not future.done(), time.perf_counter()
        future.result()  # the compiler's error, if it failed
        if waited:
            logger.info(
                "a step waited %.1fs for the sampler's %s variant to compile", time.perf_counter() - t0, variant
            )

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


def _compile(lowered: list, workers: int) -> None:
    """Compiles lowered programs, ``workers`` at a time (XLA compiles outside the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda x: x.compile(), lowered))
