"""LLMEngine: requests in, streamed outputs out; one ``step()`` at a time.

Each step: the scheduler (host) picks the work, the runner (device) computes it and samples, the scheduler
appends the tokens and applies token-level stops, and the engine detokenizes incrementally, applies stop
strings, and reports every request that made progress.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core import kv_events
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.exceptions import StepFailed
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.remote_replica import GroupLink, follow_group
from jaxserve.engine.replica import Placement, Replica, ReplicaBuilder, load_draft, load_target, weights_dtype
from jaxserve.engine.request_state import Sequence, TrackedRequest
from jaxserve.loading import LoadedModel
from jaxserve.parallel.distributed import StepChannel, agree, multi_process
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling.structured import StructuredOutputs
from jaxserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048


def enable_compilation_cache(path: str | None = None) -> None:
    """JAX's persistent compilation cache, so a second process skips compiling the same step."""
    path = path or os.environ.get("JAXSERVE_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxserve" / "xla"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def warn_memory_maps(share: float = 0.7) -> int | None:
    """Warns when this process holds more than ``share`` of the memory mappings Linux allows it: XLA:CPU keeps ~350
    per compiled step, and past ``vm.max_map_count`` (65,530 by default) compiling or loading one more crashes the
    process. Returns the mappings in use (None where /proc does not say)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    if used > share * limit:
        logger.warning(
            "this process holds %d of the %d memory mappings Linux allows it (vm.max_map_count); each "
            "compiled step takes ~350 on the CPU, and one past the limit crashes the process: build fewer "
            "engines or replicas in one process, or raise it (sysctl -w vm.max_map_count=262144)",
            used,
            limit,
        )
    return used


def device_memory() -> int | None:
    """Bytes of memory of one of this process' devices (None where JAX does not say, as on the CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return (stats or {}).get("bytes_limit")


def _settings_of(*configs) -> dict:
    """Every field of these dataclasses, prefixed by its class: what every process of a group must share."""
    return {f"{type(c).__name__}.{f.name}": getattr(c, f.name) for c in configs for f in dataclasses.fields(c)}


class LLMEngine:
    """The serving engine: requests in (``add_request``), one ``step()`` at a time, streamed outputs out. ``LLM`` is
    the offline batch API over it; the HTTP server drives it from a thread of its own.

    Args:
        model: GGUF file, HF directory, orbax directory, preset name or hub id; a ``LoadedModel`` already in host
            memory (several engines can share one load); None = the default model.
        config: the engine's settings (``jaxserve.config.EngineConfig``: dtypes, quantization, KV pool, batching,
            attention kernels ("auto", "xla", "reference", "pallas", "pallas-tpu"), tensor / data parallelism); default: the
            defaults.
        **settings: fields of ``EngineConfig`` that replace ``config``'s (``max_num_seqs=8``,
            ``tensor_parallel_size=4`` ...).

    Raises:
        TypeError: an unknown setting.
        ValueError: a bad setting, or a parallel layout the devices or the model cannot take (before the
            weights are read).
        FileNotFoundError: the model cannot be found (or fetched from the hub).
    """

    def __init__(self, model: str | Path | LoadedModel | None = None, config: EngineConfig | None = None, **settings):
        config = self.config = EngineConfig.from_settings(config, **settings)
        # An engine holds reference cycles, so a dropped one (and its compiled steps: on XLA:CPU ~350 memory mappings
        # each, of 65,530 a process may have) lingers until the cycle collector runs: run it before building another.
        gc.collect()
        if config.compilation_cache:
            enable_compilation_cache()
        t0 = time.perf_counter()
        placement = Placement.plan(config)
        dtype = weights_dtype(config)
        loaded = load_target(model, config, placement, dtype)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = load_tokenizer(loaded.tokenizer_path)
        self.structured = StructuredOutputs(self.tokenizer.to_json(), loaded.config.vocab_size, self.eos_token_ids)
        max_model_len = config.max_model_len or min(loaded.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{loaded.config.max_position_embeddings}"
            )
        self.scheduler_config = config.scheduler_config(max_model_len, jax.default_backend(), device_memory())
        if multi_process():  # every process runs the steps process 0 schedules: the same program, same shapes
            agree("settings", _settings_of(config, self.scheduler_config, loaded.config))
        draft = load_draft(self.scheduler_config.speculative, loaded, dtype, config.tensor_parallel_size)
        builder = ReplicaBuilder(config, self.scheduler_config, loaded, draft)
        self.replicas: list[Replica] = [builder.local(placement.meshes[i]) for i in placement.local]
        self._links: list[GroupLink] = []  # process 0 of several: its links to the other groups' replicas
        self._link: GroupLink | None = None  # a process of another group than process 0's: its link to process 0
        if multi_process():
            self._connect(placement, builder)
        self.load_seconds = time.perf_counter() - t0
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_config.vocab_size,
            self.scheduler_config.max_model_len,
            self.runner.num_pages,
            self.structured,
            self.eos_token_ids,
            config.seed,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tracked: dict[str, TrackedRequest] = {}
        self._seq_owner: dict[str, tuple[TrackedRequest, Sequence]] = {}  # scheduler request id -> owner

    @property
    def runner(self) -> ModelRunner:
        """The first replica's runner (the only one unless ``data_parallel_size`` > 1)."""
        return self.replicas[0].runner

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one unless ``data_parallel_size`` > 1)."""
        return self.replicas[0].scheduler

    # ------------------------------------------------------------------ several processes
    def _connect(self, placement: Placement, builder: ReplicaBuilder) -> None:
        """Several processes: the channels from process 0 to the others, and on process 0 a replica standing in for
        each replica of another group (``jaxserve.engine.remote_replica``)."""
        me, groups, home = jax.process_index(), placement.groups, placement.home
        procs, _ = groups[0]  # process 0's group: the other processes of its replica follow its steps
        if len(procs) > 1 and home == 0:
            self.runner.channel = StepChannel("g0", 0, list(procs[1:]))
        for g, (procs, indices) in enumerate(groups[1:], 1):
            if g == home:
                self._link = GroupLink(g, procs)
            elif me == 0:
                link = GroupLink(g, procs)
                self._links.append(link)
                for k, i in enumerate(indices):
                    self.replicas.insert(i, builder.remote(link, k, self.runner.num_pages))

    @property
    def is_follower(self) -> bool:
        """True on processes other than 0 of a multi-process runtime: they run the steps process 0 schedules."""
        return multi_process() and jax.process_index() != 0

    def follow(self):
        """A follower's loop: runs process 0's steps until it releases the followers; returns what it sent.

        Raises:
            jaxserve.parallel.distributed.FollowerLost: process 0 died or became unreachable.
        """
        if self._link is not None:
            return follow_group([r.runner for r in self.replicas], self._link)
        return self.runner.follow()

    def release_followers(self, payload=None) -> None:
        """Process 0: ends the followers' ``follow()``, which returns ``payload``; a no-op on one process."""
        own = self.runner.channel  # to the other processes of process 0's replica
        channels = ([own] if own is not None and own.leader else []) + [link.steps for link in self._links]
        for channel in channels:
            channel.send(("end", payload))
        for channel in channels:
            channel.flush()

    def lead_or_follow(self, fn, *args):
        """``fn(*args)`` on process 0, its result (or its error) handed to every follower, which returns it too
        (or raises RuntimeError naming the error); plain ``fn(*args)`` on one process."""
        if self.is_follower:
            ok, value = self.follow()
            if not ok:
                raise RuntimeError(f"process 0 failed: {value}")
            return value
        try:
            result = fn(*args)
        except BaseException as e:
            self.release_followers((False, f"{type(e).__name__}: {e}"))
            raise
        self.release_followers((True, result))
        return result

    def warmup(self) -> int:
        """Compiles every step variant (shape bucket) of every replica ahead of traffic, running none.

        Returns:
            The number of step variants traced (those found in the persistent compilation cache count too).
        """
        n = sum(r.runner.warmup() for r in self.replicas)
        warn_memory_maps()
        return n

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence (unless ``ignore_eos``): the tokenizer's and the model config's."""
        return tuple(dict.fromkeys(self.tokenizer.eos_token_ids + self.model_config.eos_token_ids))

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a prompt; its outputs come from the following ``step()`` calls.

        Args:
            request_id: unique among unfinished requests; with ``n > 1`` the sequences are ``id#0``, ``id#1`` ...
                inside the engine, and outputs carry ``request_id``.
            prompt: text, or token ids (a list, tuple or 1-D integer numpy array).
            sampling_params: default ``SamplingParams()``.
            priority: lower is served first under ``policy="priority"``.
            arrival_time: ``time.monotonic()`` of arrival (default: now); orders the queue.

        Raises:
            ValueError: an id in use (or one of its ``#k`` children's, for ``n > 1``), an empty prompt or one
                of the wrong type, token ids out of the vocabulary (in the prompt, ``logit_bias`` or
                ``stop_token_ids``), a prompt that leaves no room to generate within max_model_len (naming both
                lengths; ``jaxserve.core.request.check_prompt``), a grammar that does not compile, or a request that
                cannot fit the page pool.
        """
        self.add_requests([(request_id, prompt, sampling_params, priority)], arrival_time=arrival_time)

    def add_requests(self, items: Iterable[tuple], *, arrival_time: float | None = None) -> None:
        """Queues several prompts at once, atomically: all are validated before any is queued, so either all
        are admitted or, if one is bad, none. The next step can admit them all, within its token budget.

        Args:
            items: ``(request_id, prompt, sampling_params)`` or ``(request_id, prompt, sampling_params,
                priority)``; ``sampling_params`` may be None (the defaults).

        Raises:
            ValueError: as ``add_request``, naming the bad item's request id (and its index in ``items``).
        """
        items = list(items)
        prepared: list[TrackedRequest] = []
        taken: set[str] = set()  # ids (and children's ids) of the items before this one
        for k, item in enumerate(items):
            try:
                if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
                    raise ValueError(
                        f"an item must be (request_id, prompt, sampling_params[, priority]), got {type(item).__name__}"
                    )
                prepared.append(
                    self.input_processor.prepare(*item, arrival_time=arrival_time, taken=taken, in_use=self._in_use)
                )
            except ValueError as e:
                raise ValueError(str(e) if len(items) == 1 else f"item {k} of {len(items)}: {e}") from None
        self._dispatch(prepared)
        for tracked in prepared:
            tracked.pending_forks = tracked.seqs[1:]
            self._tracked[tracked.request_id] = tracked
            for seq in tracked.seqs:
                self._seq_owner[seq.request.request_id] = (tracked, seq)

    def _in_use(self, request_id: str) -> bool:
        """Whether a request or sequence of this id is live (a new one may not take it)."""
        return request_id in self._tracked or request_id in self._seq_owner

    def _dispatch(self, prepared: list[TrackedRequest]) -> None:
        """Queues each request on the least loaded replica, all or none (each scheduler validates all of its
        share before queueing any)."""
        loads = [r.load() for r in self.replicas]
        shares: dict[int, list[TrackedRequest]] = {}
        for tracked in prepared:
            i = min(range(len(loads)), key=loads.__getitem__)
            loads[i] += len(tracked.seqs)
            tracked.replica = self.replicas[i]
            shares.setdefault(i, []).append(tracked)
        queued: list[TrackedRequest] = []
        try:
            for i, share in shares.items():
                self.replicas[i].scheduler.add_requests([t.seqs[0].request for t in share])
                queued += share
        except Exception:
            for tracked in queued:
                tracked.replica.scheduler.abort_request(tracked.seqs[0].request.request_id)
            raise

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request (all its sequences) and frees its pages at once; it produces no further output.

        Returns:
            True if the request was unfinished, False if unknown (finished already, or never added).
        """
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False
        for seq in tracked.seqs:
            tracked.replica.scheduler.abort_request(seq.request.request_id)
            seq.request.status = RequestStatus.FINISHED_ABORTED
        self._forget(tracked)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while some added request has not finished, or a step is in flight (``step()`` has work)."""
        return bool(self._tracked) or any(r.in_flight is not None or r.pipeline for r in self.replicas)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler + device step on every replica.

        Returns:
            A ``RequestOutput`` for every request that progressed (cumulative: text and tokens so far;
            ``finished`` on its last one, after which the request is forgotten).

        Raises:
            StepFailed: the device step, or a request's own processing, raised. The requests concerned are
                aborted (pages freed); the exception carries every other request's outputs of this step.
        """
        outputs: list[RequestOutput] = []
        failures: list[StepFailed] = []
        for replica in self.replicas:
            try:
                outputs += self._step_replica(replica)
            except StepFailed as e:
                failures.append(e)
                outputs += e.outputs
        if failures:
            raise StepFailed([r for f in failures for r in f.request_ids], outputs, failures[0].cause) from failures[
                0
            ].cause
        return outputs

    def _step_replica(self, replica: Replica) -> list[RequestOutput]:
        """One step of a replica. With async scheduling the step is scheduled and launched while the previous one
        runs, and the outputs returned are the previous step's; otherwise this step's, after it ran."""
        if replica.scheduler.config.pipeline_stages > 1:
            return self._step_pipeline(replica)
        if not replica.scheduler.config.async_scheduling:
            return self._finish(replica, *self._launch(replica))
        outputs: list[RequestOutput] = []
        previous, replica.in_flight = replica.in_flight, None
        if previous is not None and self._must_wait(replica):
            outputs, previous = self._finish(replica, *previous), None
        try:
            launched = self._launch(replica)
            replica.in_flight = launched if launched[1] is not None else None  # None: nothing scheduled
        except StepFailed as e:
            if previous is not None:
                e.outputs.extend(self._finish(replica, *previous))
            raise
        if previous is not None:
            outputs += self._finish(replica, *previous)
        return outputs

    def _step_pipeline(self, replica: Replica) -> list[RequestOutput]:
        """One step of a replica over S pipeline stages: a step is scheduled and launched (one tick of the
        pipeline: each step in it moves one stage on), and once S steps are in flight, or none could be scheduled
        (every running request waits for a token in flight), the oldest one's outputs are read: with S in flight,
        the one that just left the last stage; otherwise the pipeline drains until it does."""
        launched = self._launch(replica)
        if launched[1] is not None:
            replica.pipeline.append(launched)
        if replica.pipeline and (
            len(replica.pipeline) >= replica.scheduler.config.pipeline_stages or launched[1] is None
        ):
            return self._finish(replica, *replica.pipeline.popleft())
        return []

    def _must_wait(self, replica: Replica) -> bool:
        """Whether the next step needs the step in flight's tokens on the host: a request with a pending token
        has penalties (the sampler reads its token history) or a grammar (its next allowed tokens)."""
        for request in replica.scheduler.running:
            if request.num_pending:
                if request.sampling_params.penalized:
                    return True
                owner = self._seq_owner.get(request.request_id)
                if owner is not None and owner[1].matcher is not None:
                    return True
        return False

    def _launch(self, replica: Replica) -> tuple:
        """Schedules a step and hands it to the device; (SchedulerOutput, the runner's InFlight)."""
        scheduler, runner = replica.scheduler, replica.runner
        sched = scheduler.schedule()
        try:
            if replica.drafter is not None:
                sched = replica.drafter.fill(sched, scheduler)
            return sched, runner.launch(sched, self._token_masks(sched))
        except Exception as e:
            self._fail(replica, sched, e)

    def _fail(self, replica: Replica, sched, e: Exception):
        drafter, runner = replica.drafter, replica.runner
        if runner.pool_donated() or (drafter is not None and drafter.runner.pool_donated()):
            # a pool was donated to the failed step: nothing can go on
            raise e
        failed = {self._seq_owner[s.req_id][0].request_id for s in sched.scheduled if s.req_id in self._seq_owner}
        self._abort_failed(failed)
        raise StepFailed(sorted(failed), [], e) from e

    def _finish(self, replica: Replica, sched, flight) -> list[RequestOutput]:
        """Reads a launched step's results and turns them into the requests' outputs."""
        scheduler = replica.scheduler
        try:
            result = replica.runner.collect(flight)
        except Exception as e:
            self._fail(replica, sched, e)
        sampled = result.sampled
        for rid, entries in result.prompt_logprobs.items():
            owner = self._seq_owner.get(rid)
            if owner is not None and owner[1].index == 0:  # the request's prompt logprobs are its first sequence's
                owner[0].prompt_logprobs.update(entries)
        # Output tokens before and after the scheduler takes this step's (tokens of steps in flight are only counted).
        before = {
            rid: len(owner[1].request.output_token_ids)
            for rid in sampled
            if (owner := self._seq_owner.get(rid)) is not None
        }
        emitted = {rid: [t.token_id for t in toks] for rid, toks in sampled.items()}
        scheduler.update_from_output(sched, emitted)
        if replica.drafter is not None:
            replica.drafter.update(sched, emitted)
        touched: dict[str, TrackedRequest] = {}
        errors: dict[str, Exception] = {}
        for rid, toks in sampled.items():
            owner = self._seq_owner.get(rid)
            if owner is None or owner[0].request_id in errors:
                continue
            tracked, seq = owner
            out_ids = seq.request.output_token_ids
            # The scheduler stops at the first stop token, and keeps none of a request finished before this step.
            kept = toks[: len(out_ids) - before[rid]]
            if not kept:
                continue
            try:
                for j, tok in enumerate(kept):
                    if self.output_processor.append(
                        tracked, seq, tok, last=j == len(kept) - 1
                    ):  # a stop string or the grammar
                        del out_ids[before[rid] + j + 1 :]  # ended it: the confirmed tokens after it are dropped
                        break
            except Exception as e:  # noqa: BLE001 - e.g. detokenization: only this request fails
                errors[tracked.request_id] = e
            touched[tracked.request_id] = tracked
        self._start_forks(replica)
        outputs = []
        for tracked in touched.values():
            if tracked.request_id in errors:
                continue
            out = self.output_processor.output(tracked)
            outputs.append(out)
            if out.finished:
                self._forget(tracked)
        if errors:
            self._abort_failed(errors)
            raise StepFailed(sorted(errors), outputs, next(iter(errors.values())))
        return outputs

    def _token_masks(self, sched) -> dict[str, np.ndarray] | None:
        """Structured outputs: the allowed next tokens of every sampling sequence under a grammar (packed rows)."""
        constrained = []
        for s in sched.scheduled:
            owner = self._seq_owner.get(s.req_id) if s.sample else None
            if owner is not None and owner[1].matcher is not None:
                constrained.append((s.req_id, owner[1].matcher))
        if not constrained:
            return None
        rows = self.structured.fill_bitmask([m for _, m in constrained])
        return {rid: row for (rid, _), row in zip(constrained, rows)}

    def _abort_failed(self, request_ids) -> None:
        for rid in request_ids:
            self.abort_request(rid)

    def _forget(self, tracked: TrackedRequest) -> None:
        self._tracked.pop(tracked.request_id, None)
        for seq in tracked.seqs:
            self._seq_owner.pop(seq.request.request_id, None)

    def _start_forks(self, replica: Replica) -> None:
        """n > 1: the other sequences share the first one's prompt pages once its prefill is done."""
        for tracked in list(self._tracked.values()):
            if not tracked.pending_forks or tracked.replica is not replica:
                continue
            first = tracked.seqs[0].request
            if first.status is RequestStatus.RUNNING and first.num_computed_tokens >= len(tracked.prompt_token_ids):
                for seq in tracked.pending_forks:
                    replica.scheduler.fork_request(first.request_id, seq.request)
            elif first.is_finished or first.status is not RequestStatus.RUNNING:
                for seq in tracked.pending_forks:
                    replica.scheduler.add_request(seq.request)
            else:
                continue
            tracked.pending_forks = []

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> None:
        """Every replica's block manager records its prefix cache's changes from now on (``jaxserve.core.kv_events``)."""
        for r in self.replicas:
            r.scheduler.block_manager.enable_kv_events()

    def drain_kv_events(self) -> list[tuple[int, list]]:
        """The KV events recorded since the last drain, as ``(replica index, events)`` for replicas that have any."""
        return kv_events.drain([r.scheduler.block_manager for r in self.replicas])

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict:
        """Scheduler and runner counters, summed over the data-parallel replicas.

        Returns:
            A dict: ``num_running``, ``num_waiting``, ``num_preemptions``, ``num_used_pages``,
            ``num_usable_pages``, ``kv_usage``, ``prefix_cache_queries``, ``prefix_cache_hits``,
            ``prefix_cache_hit_rate``, ``spec_draft_tokens`` and ``spec_accepted_tokens`` (speculative decoding),
            ``num_compilations``, ``num_pages``, ``num_tokens_computed`` and ``num_steps`` (what ``/metrics``
            reports).
        """
        per = [dataclasses.asdict(r.scheduler.stats()) for r in self.replicas]
        stats = {k: sum(p[k] for p in per) for k in per[0]}
        stats["kv_usage"] = stats["num_used_pages"] / max(stats["num_usable_pages"], 1)
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
        for name in ("num_compilations", "num_pages", "num_tokens_computed", "num_steps"):
            stats[name] = sum(getattr(r.runner, name) for r in self.replicas)
        stats["num_compilations"] += sum(r.drafter.runner.num_compilations for r in self.replicas if r.drafter)
        return stats
