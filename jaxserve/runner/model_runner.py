"""The device side: weights, the KV page pool, and the step that runs a batch.

The runner receives a :class:`~jaxserve.core.sched.output.SchedulerOutput`, packs it into padded arrays of a
bucketed shape (tokens in the step, sequences, pages per sequence) and calls

    step(state, matmul_weights, k_cache, v_cache, host, fed) -> (sampler_output, prompt_logprobs, fed, k_cache, v_cache)

where ``host`` is ``(tokens, fed_index, batch, logits_indices, sampling, next_tokens)`` (on GPUs and TPUs its numpy
arrays uploaded as one buffer, ``jaxserve.runner.host_pack``: one transfer a step, not one per array), and both
caches donated, so the pool is updated in place. ``state`` is the model's weights (flax NNX state),
``matmul_weights`` the optional bfloat16 copies for ``matmul_dtype``, ``tokens`` [T] and ``batch``
(``AttentionBatch``: positions, slot mapping, kv lens, page table, cu_q_lens, num_seqs) the step's tokens,
``logits_indices`` [R] the positions sampled (each sequence's last; with speculative decoding also those
of its proposals), ``sampling`` the sampler's fixed-width arrays
(``SamplingMetadata``) and ``next_tokens`` [T] the targets of prompt logprobs (-1: none). ``fed`` holds the previous
step's sampled tokens, on the device, and ``fed_index`` [T] the row of ``fed`` whose token goes at each position
instead of ``tokens``' (-1: none): async scheduling launches a step before the host has read the previous one's
tokens. The step returns its own samples as the next step's ``fed``. Everything the step
reads is an argument: no Python value is frozen into a trace except the static shapes (and the ``decode_only``
variant), so one compilation serves every mix of requests of the same bucket. The buckets are
``jaxserve.runner.buckets``'; the jitted step of each variant, warm-up and ahead-of-time lowering are
``jaxserve.runner.compilation``'s (``ModelRunner.compiler``, given ``step_program()``).

The step is one SPMD program over the runner's mesh (``jaxserve.parallel.sharding``): weights placed shard by shard by
their logical axes, the pool split over KV heads, the kernels under ``shard_map``, the logits left in
their vocabulary shards for the sampler. With one device the mesh has one device and nothing else changes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import kernels
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig, kv_dtype
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sched.output import SchedulerOutput
from jaxserve.kernels.attention import cpu as attention_cpu
from jaxserve.kernels.cpu import ffi as cpu_ffi
from jaxserve.kernels.matmul import cpu as matmul_cpu
from jaxserve.kernels.matmul import gpu as matmul_gpu
from jaxserve.layers.linear import MatmulPolicy
from jaxserve.parallel.pipeline import PipelineTick
from jaxserve.parallel.sharding import (
    VOCAB_SPEC,
    ShardedRows,
    make_mesh,
    shard_kernels,
    shard_moe,
    stages,
)
from jaxserve.parallel.step_wire import StepDecoder, StepEncoder, has_changes
from jaxserve.runner.buckets import StepBuckets, padded_batch
from jaxserve.runner.compilation import StepCompiler, StepProgram
from jaxserve.runner.host_pack import pack, unpack
from jaxserve.runner.input_batch import CachedRequest, InputBatch, targets
from jaxserve.runner.kv_pool import KVPool
from jaxserve.runner.weights import prepare_weights
from jaxserve.sampling.sampler import (
    FULL,
    MAX_LOGPROBS,
    PROMPT,
    SAMPLED,
    SamplingMetadata,
    bias_width,
    compute_logprobs,
    sample,
    variants_for,
)
from jaxserve.sampling.structured import bitmask_width
from jaxserve.spec_decode.ngram import accepted

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    """What one step computed: the sampled tokens of each request that asked for them (one; with proposals, the
    confirmed ones and the token after them), and the prompt logprobs (request id -> prompt position -> entry) of
    the positions this step computed for requests that want them."""

    sampled: dict[str, list[SampledToken]]
    prompt_logprobs: dict[str, dict[int, SampledToken]]


@dataclasses.dataclass
class InFlight:
    """A launched step whose results the host has not read yet (``ModelRunner.launch`` -> ``collect``)."""

    sched: SchedulerOutput
    reqs: list[CachedRequest]
    want_plp: list[bool]
    next_tokens: np.ndarray
    decode_only: bool
    out: object  # the sampler's output, on the device
    plp: object  # prompt logprobs, on the device (None when no position wanted them)
    started: float  # perf_counter() when the step was handed to the device
    # Pipeline stages: (tokens, batch, logits_indices, sampling metadata maker) as packed, for the ticks that take
    # it through the stages; ``out`` is set by the tick that takes it out of the last one.
    packed: tuple | None = None


# The sampler arrays as wide as the vocabulary or the history; the others are a few words a row.
_WIDE_SAMPLER_ARRAYS = ("history", "bias_ids", "bias_values", "token_mask")


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


class ModelRunner:
    """Owns the parameters, the page pool, the live requests' state, and the running of steps (``launch`` /
    ``collect``); its ``compiler`` (``jaxserve.runner.compilation.StepCompiler``) owns the compiled steps.

    Args:
        model_cfg: the model.
        params: stacked parameter arrays (see ``jaxserve.loading.weights.param_shapes``).
        cache_cfg / sched_cfg: pool size and batching limits (they fix the bucket set).
        attention_impl: "auto" | "xla" | "reference" | "pallas" (see ``jaxserve.kernels``) | "pallas-tpu" (the TPU
            kernels and pool layout: interpreted off a TPU, to check the TPU's path on a CPU).
        matmul_dtype: None or "bfloat16": dtype of the weights in the matrix products (None: the weights'
            own). On the CPU, "bfloat16" with float32 weights runs the products of steps of 8 rows or more on
            bfloat16 inputs with float32 accumulation (about 2x faster); norms, residuals, attention, the KV
            cache and the sampler stay float32. Quantized weights are not copied: the products that dequantize
            whole matrices do it to bfloat16 (``QArray.dot_dtype``).
        mesh: the ("stage", "data", "model") mesh the step runs over (default: the first device); its "model" size
            is the tensor-parallel degree, its "stage" size the pipeline stages (``pipeline.PipelineTick``).
        platform: None (the platform JAX runs on), or "tpu" / "gpu" to build the steps for that platform without
            running them (``jaxserve.aot``; then ``params`` may be ``jax.ShapeDtypeStruct``s).
        quantization: None, or "int8" / "int4" / "w8a8" / "fp8" to quantize the float weights on their devices,
            or "gguf" for weights that came quantized (``jaxserve.quant``).
        one_token_buckets: a token bucket of 1 besides those from 8 (default: on the CPU, when the mesh is one
            device); the engine turns it off for data-parallel replicas.
        expert_parallel: a MoE model's whole experts on each device of the mesh's "model" axis instead of every
            expert split over them (``jaxserve.parallel.sharding.shard_moe``).

    Raises:
        ValueError: a quantization the backend cannot run, or a KV pool that does not fit the memory.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        params: dict,
        cache_cfg: CacheConfig,
        sched_cfg: SchedulerConfig,
        attention_impl: str = "auto",
        matmul_dtype: str | None = None,
        mesh: Mesh | None = None,
        platform: str | None = None,
        quantization: str | None = None,
        one_token_buckets: bool | None = None,
        expert_parallel: bool = False,
    ):
        self.mesh = mesh or make_mesh(1)
        self.expert_parallel = expert_parallel
        self.platform = platform  # None: the one JAX runs on; "tpu" / "gpu": compile for it (jaxserve.aot)
        self.target = platform or jax.default_backend()  # the platform the steps are built for, either way
        # ShapeDtypeStruct params (jaxserve.aot): nothing is allocated; the state and the pool are abstract too.
        self.abstract = isinstance(params["final_norm"], jax.ShapeDtypeStruct)
        dtype = params["final_norm"].dtype  # the float weights' (a quantized model's norms stay float)
        self.channel = None  # under several processes: the StepChannel to the other processes (set by the engine)
        self._encoder, self._decoder = StepEncoder(), StepDecoder()  # the steps' changes on that channel
        self._uncollected = 0  # steps launched whose results were not read yet (async scheduling: at most 1)
        self.page_size = cache_cfg.page_size
        self.replicated = NamedSharding(self.mesh, P())
        weights = prepare_weights(
            model_cfg,
            params,
            self.mesh,
            quantization=quantization,
            matmul_dtype=matmul_dtype,
            expert_parallel=expert_parallel,
            platform=platform,
        )
        self.cfg, self.param_shardings = weights.cfg, weights.param_shardings
        self.graphdef, self.state, self.matmul_weights = weights.graphdef, weights.state, weights.matmul_weights
        cpp = (
            attention_impl in ("auto", "xla")
            and attention_cpu.serves(kv_dtype(cache_cfg.dtype, dtype))
            and cpu_ffi.available()
        )
        on_cpu = self.target == "cpu"
        self.pool = KVPool(self.cfg, cache_cfg, sched_cfg, self.mesh, dtype, platform, cpp, attention_impl)
        self.num_pages = self.pool.num_pages
        self.k_cache, self.v_cache = self.pool.allocate(self.abstract)
        buckets = StepBuckets.choose(
            sched_cfg.max_num_batched_tokens,
            sched_cfg.max_num_seqs,
            sched_cfg.max_model_len,
            self.page_size,
            one_token_bucket=on_cpu and self.mesh.size == 1 if one_token_buckets is None else one_token_buckets,
            one_page_bucket=on_cpu and cpp,
        )
        self.token_buckets, self.page_buckets = buckets.token_buckets, buckets.page_buckets
        self.max_seqs = buckets.max_seqs
        self.num_speculative_tokens = sched_cfg.num_speculative_tokens  # rows sampled per sequence: up to 1 + this
        # The last step's sampled tokens, kept on the device at a fixed width (every bucket samples at most this
        # many rows): async scheduling feeds them into the next step before the host has read them.
        # Pipeline stages: ``fed`` is instead the hidden states each stage passes the next ([S, T, D], split over
        # "stage"), and ``_stages`` the launched steps in each stage (``_tick``).
        self.num_stages, self.dtype = stages(self.mesh), dtype
        self.fed_sharding = NamedSharding(self.mesh, P("stage")) if self.num_stages > 1 else self.replicated
        fed = jax.ShapeDtypeStruct(
            (self.max_seqs * (1 + self.num_speculative_tokens),), jnp.int32, sharding=self.replicated
        )
        if self.num_stages > 1:
            fed = self.stage_buffer_struct(buckets.token_buckets[0])
        self.fed = fed if self.abstract else jax.device_put(np.zeros(fed.shape, fed.dtype), self.fed_sharding)
        self._stages: list[InFlight | None] = [None] * self.num_stages
        self._fed_rows: dict[str, int] = {}  # request id -> its row in ``fed``
        self._constants: dict[tuple, jax.Array] = {}  # ``_on_device``'s copies of constant sampler arrays
        self.attention_impl = attention_impl
        # the sampler's variants this runner compiles (and its batches pick from)
        self.sampler_variants = variants_for(self.target)
        # The step's host arrays as one buffer (``host_pack``) where they cross to a device; on the CPU nothing
        # crosses (the device is the host's memory), and packed arrays changed how XLA:CPU splits the LM head's
        # product over threads (3.9 -> 8.4 ms a one-request step of the default model), so there they go as they are.
        self.pack_host = self.target != "cpu"
        self.reset_timers()
        self.buckets = buckets
        self.compiler = StepCompiler(self.step_program(), buckets)  # jitted step variants; warm-up, AOT lowering
        # What the runner holds of each live request (started by the scheduler's NewRequestData), and the
        # standing page table: one row per live request, updated by each step's page-table changes.
        self.inputs = InputBatch(
            self.page_size, self.token_buckets, self.page_buckets, self.max_seqs, self.num_speculative_tokens
        )

    def reset_timers(self) -> None:
        self.num_tokens_computed = 0  # real (unpadded) tokens run through the model
        self.num_steps = 0
        self.num_ticks = 0  # pipeline stages: ticks run (each moves every step in the pipeline one stage on)
        self.pack_seconds = 0.0  # host: building the padded arrays and sampling metadata
        self.device_seconds = 0.0  # dispatch to results back on the host
        self.decode_steps = 0  # steps where every sequence computes one token, and their device seconds
        self.decode_device_seconds = 0.0

    @property
    def num_compilations(self) -> int:
        """Traces of the step (``StepCompiler``); a test asserts it stays flat in steady state."""
        return self.compiler.num_compilations

    # ------------------------------------------------------------------ the step
    def step_function(self, decode_only: bool):
        """What one step computes (the module docstring's ``step``): a pure function of its arguments, which
        ``self.compiler`` jits; ``decode_only`` (every sequence computes one token) picks the attention's variant."""
        attention, write = shard_kernels(
            *_attention_fns(self.attention_impl, decode_only, self.platform, self.pool.layout),
            self.mesh,
            self.pool.spec_of,
        )
        graphdef = self.graphdef
        policy = MatmulPolicy(rows=self._rows_fn(), pinned=("wq",) if self.target == "tpu" else ())
        moe = None
        if self.cfg.is_moe:  # megablox compiled for a TPU (jaxserve.aot), ragged_dot on a GPU, "auto" where it runs
            impl = {"tpu": "megablox", "gpu": "ragged"}.get(self.platform, "auto")
            interpret = False if self.platform == "tpu" else None
            moe = shard_moe(self.cfg, self.mesh, expert_parallel=self.expert_parallel, impl=impl, interpret=interpret)
        pipelined = self.num_stages > 1

        def logits(model, hidden, mm):
            """Computed and left in their vocabulary shards: the sampler reduces them (argmax, logsumexp, top-k and
            the top-p bisection per chip; the bias, penalties and masks are elementwise or scatter into each chip's
            own shard), so only [B] values or each chip's top candidates cross, never the vocabulary."""
            return jax.lax.with_sharding_constraint(
                model.logits(hidden, policy, mm), NamedSharding(self.mesh, VOCAB_SPEC)
            )

        def step(state, mm, k_cache, v_cache, host, fed):
            # the step's host arrays, uploaded as one buffer (``host_pack``)
            tokens, fed_index, batch, logits_indices, meta, next_tokens = unpack(host)
            scan = None
            if pipelined:  # one tick (``_tick``): ``fed`` the hidden states passed between stages, not tokens
                scan = PipelineTick(self.mesh, fed)
            else:  # async scheduling: a position with fed_index r >= 0 takes row r of the previous step's samples
                # (``fed``), still on the device when this step was packed.
                tokens = jnp.where(fed_index >= 0, fed[jnp.clip(fed_index, 0, fed.shape[0] - 1)], tokens)
            model = nnx.merge(graphdef, state)
            hidden, k_cache, v_cache = model(tokens, batch, k_cache, v_cache, attention, write, policy, mm, moe, scan)
            out = sample(logits(model, hidden[logits_indices], mm), meta, max_logprobs=MAX_LOGPROBS)
            # prompt_logprobs: every position's logprob of the token after it (the whole [T, V] logits), in the
            # sampler's "prompt" variant (the host picks it for a step with targets), or in "full" where that skips
            # them under a conditional (the CPU's).
            when = {PROMPT: "always", FULL: "never" if meta.branchless else "asked"}.get(meta.variant, "never")
            plp = _prompt_logprobs(lambda h: logits(model, h, mm), hidden, next_tokens, when)
            if pipelined:
                return out, plp, scan.passed, k_cache, v_cache
            feed = jnp.zeros_like(fed).at[: out.tokens.shape[0]].set(out.tokens)  # the next step's ``fed``
            return out, plp, feed, k_cache, v_cache

        return step

    def step_program(self) -> StepProgram:
        """The step as the compiler takes it: ``step_function``, placed where this runner's weights, pool and
        fed-forward samples live (host arrays replicated), with the pool donated."""
        kv, gathered, fed = self.pool.format, self.replicated, self.fed_sharding
        placed = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        return StepProgram(
            compute=self.step_function,
            in_shardings=(placed(self.state), placed(self.matmul_weights), kv, kv, gathered, fed),
            out_shardings=(gathered, gathered, fed, kv, kv),
            donate_argnums=(2, 3),  # the KV pool, updated in place
            example_args=self.example_args,
            host_sharding=gathered,
            lower_copy=lambda src, dst: self.pool.copy.lower(self.k_cache, self.v_cache, src, dst),
            variants=self.sampler_variants,
            # where "sampled" serves temperature sampling, warm-up leaves "full" (top-p, penalties, logprobs, ...)
            # and "prompt" to the background: serving starts after greedy's and sampled's compiles
            deferred=(FULL, PROMPT) if SAMPLED in self.sampler_variants else (),
        )

    def example_args(self, tokens: int, pages: int, variant: str = FULL) -> tuple:
        """Arguments of a step of an empty batch in the (tokens, pages) bucket (every token is padding), for the
        sampler's ``variant`` (``jaxserve.sampling.sampler.VARIANTS``)."""
        sb = min(tokens, self.buckets.max_seqs)
        batch = padded_batch(None, tokens, sb, pages)
        fed = self.fed
        if self.num_stages > 1:  # a batch for each stage, and the hidden states passed between them
            batch = jax.tree.map(lambda a: np.stack([a] * self.num_stages), batch)
            fed = self.stage_buffer_struct(tokens)
        rows = max(self.inputs.sample_rows(tokens), sb)
        meta = dataclasses.replace(
            self.sampling_metadata([SamplingParams(temperature=0.0)], pad_to=rows), variant=variant
        )
        host = (
            np.zeros(tokens, np.int32),  # tokens
            np.full(tokens, -1, np.int32),  # fed_index: none
            batch,
            np.zeros(rows, np.int32),  # logits_indices
            meta,
            np.full(tokens, -1, np.int32),  # next_tokens: no prompt logprobs
        )
        return (self.state, self.matmul_weights, self.k_cache, self.v_cache, self._host(host), fed)

    def _rows_fn(self):
        """The C++ products for steps of fewer than 8 rows on bfloat16 matmul weights (XLA:CPU's own is ~15x slower
        than float32 there, so without it such steps keep the float32 weights) and float32 layer stacks (read in
        place, where XLA copies the scan's slices), and of up to 8 on quantized weights (read packed, never
        dequantized to a float copy): on one CPU device, when built (``matmul_cpu.RowsProduct`` says which weights it
        takes). On one GPU, the Pallas product that reads each layer's matrix in place for decode batches, where
        XLA:GPU copies the scan's slice of every weight stack first (``kernels/matmul/gpu.py``); under tensor
        parallelism on GPUs the same, each device on its shard of each stack (``ShardedRows``, one per matrix)."""
        if self.mesh.size != 1:
            if self.target != "gpu" or stages(self.mesh) > 1:
                return None
            return {n: ShardedRows(matmul_gpu.ROWS, self.mesh, s.spec) for n, s in self.param_shardings.items()}
        if self.target == "cpu":
            return matmul_cpu.ROWS if cpu_ffi.available() else None
        return matmul_gpu.ROWS if self.target == "gpu" else None

    # ------------------------------------------------------------------ execution
    def execute(self, sched: SchedulerOutput, token_masks: dict[str, np.ndarray] | None = None) -> RunnerOutput:
        """Runs one step: the sampled token of every scheduled request whose chunk asks for one, and the prompt
        logprobs this step computed.

        Args:
            sched: the scheduler's decisions.
            token_masks: structured outputs: request id -> packed allowed-token row ([W] int32, see
                ``jaxserve.sampling.structured``) for the sampling requests under a grammar; the others are unconstrained.
        """
        return self.collect(self.launch(sched, token_masks))

    def launch(self, sched: SchedulerOutput, token_masks: dict[str, np.ndarray] | None = None) -> InFlight | None:
        """Hands one step to the device and returns without waiting for it (``collect`` reads its results).

        A chunk ``from_previous_step`` starts with the token the previous launched step sampled for that request: the
        step reads it on the device (async scheduling), so this may run before the previous step's ``collect``.
        """
        self.inputs.update(sched)
        copy = self.buckets.copy_chunks(sched.copy_ops)
        if not sched.scheduled:
            self._publish(sched, token_masks)
            self._launch(copy, None)
            return None
        t0 = time.perf_counter()
        tokens, fed_index, batch, logits_indices, rows = self.inputs.pack(sched, self._fed_rows)
        self.num_tokens_computed += sched.num_scheduled_tokens
        self.num_steps += 1
        reqs = [self.inputs.requests[s.req_id] for s in sched.scheduled]
        params = [r.params for r in reqs]
        mask = None
        if token_masks:
            mask = np.full((len(rows), self.token_mask_width), -1, np.int32)
            for k, (i, _) in enumerate(rows):
                row = token_masks.get(sched.scheduled[i].req_id)
                if row is not None:
                    mask[k] = row
        for i, _ in rows:
            if reqs[i].pending and params[i].penalized:
                raise ValueError(
                    f"request {sched.scheduled[i].req_id!r} has penalties, which need its latest token "
                    "on the host: it cannot be scheduled before the previous step's results are read"
                )
        # A proposal's row samples as plain decoding would at that output index (its own draw, its min_tokens).
        meta = functools.partial(  # of pad_to, the rows the step samples
            self.sampling_metadata,
            [params[i] for i, _ in rows],
            steps=[reqs[i].num_output_tokens + reqs[i].pending + j for i, j in rows],
            prompt_ids=[reqs[i].prompt_token_ids for i, _ in rows],
            output_ids=[reqs[i].output_token_ids for i, _ in rows],
            token_mask=mask,
        )
        want_plp = [
            p.prompt_logprobs is not None and s.start_pos < r.num_prompt_tokens - 1
            for p, s, r in zip(params, sched.scheduled, reqs)
        ]
        if any(want_plp):  # prompt logprobs: only the sampler's "prompt" variant (the CPU's "full") computes them
            meta = functools.partial(meta, full=True)
        # -1: no position has a target, and the step skips the prompt logprobs.
        next_tokens = targets(sched, reqs, len(tokens)) if any(want_plp) else _no_targets(len(tokens))
        t1 = time.perf_counter()
        decode_only = all(s.num_tokens == 1 for s in sched.scheduled)
        self._publish(sched, token_masks)
        flight = InFlight(sched, reqs, want_plp, next_tokens, decode_only, None, None, t1)
        if self.num_stages > 1:
            flight.packed = (tokens, batch, logits_indices, meta)
            self._launch(copy, None)
            self._tick(flight)
        else:
            meta = meta(pad_to=len(logits_indices))
            step = (decode_only, tokens, fed_index, batch, logits_indices, meta, next_tokens)
            flight.out, plp = self._launch(copy, step)
            flight.plp = plp if any(want_plp) else None
        self.pack_seconds += t1 - t0
        self._fed_rows = {}  # where each request's sample of this step is in the step's fed-forward tokens
        for k, (i, j) in enumerate(rows):
            if j == 0 and sched.scheduled[i].sample:
                reqs[i].pending += 1
                self._fed_rows[sched.scheduled[i].req_id] = k
        self._uncollected += 1
        return flight

    def _tick(self, entering: InFlight | None) -> None:
        """Pipeline stages: one tick. Every launched step in the pipeline moves one stage on, ``entering`` (None: an
        empty step, to drain it) into the first; each stage computes its step's layers (``pipeline.PipelineTick``),
        and the step leaving the last one samples: its ``out`` is set. The stages' batches are padded to one bucket,
        the largest of theirs."""
        self._stages = [entering, *self._stages[:-1]]
        self.num_ticks += 1
        live = [f for f in self._stages if f is not None]
        tb = max(len(f.packed[0]) for f in live)
        sb = max(min(tb, self.max_seqs), *(len(f.packed[1].kv_lens) for f in live))
        pb = max(f.packed[1].page_indices.shape[1] for f in live)
        batches = [padded_batch(None if f is None else f.packed[1], tb, sb, pb) for f in self._stages]
        batch = jax.tree.map(lambda *a: np.stack(a), *batches)
        tokens = np.zeros(tb, np.int32)
        if entering is not None:
            tokens[: len(entering.packed[0])] = entering.packed[0]
        rows = max(self.inputs.sample_rows(tb), sb)
        leaving = self._stages[-1]
        logits_indices, next_tokens = np.zeros(rows, np.int32), _no_targets(tb)
        if leaving is None:
            meta = self.sampling_metadata([SamplingParams(temperature=0.0)], pad_to=rows)
        else:
            _, _, indices, make_meta = leaving.packed
            logits_indices[: len(indices)] = indices
            next_tokens[: len(leaving.next_tokens)] = leaving.next_tokens
            meta = make_meta(pad_to=rows)
        if self.fed.shape[1] != tb:  # the passed hidden states to this tick's bucket (their tokens all fit it)
            self.fed = self._resize_passed(self.fed, tb)
        decode_only = all(f.decode_only for f in live)
        out, plp = self._launch(None, (decode_only, tokens, _no_targets(tb), batch, logits_indices, meta, next_tokens))
        if leaving is not None:
            leaving.out, leaving.plp = out, plp if any(leaving.want_plp) else None

    @functools.cached_property
    def _resize_passed(self):
        def resize(passed, tokens):
            keep = min(tokens, passed.shape[1])
            return jnp.pad(passed[:, :keep], ((0, 0), (0, tokens - keep), (0, 0)))

        return jax.jit(resize, static_argnums=1, out_shardings=self.fed_sharding)

    def stage_buffer_struct(self, tokens: int) -> jax.ShapeDtypeStruct:
        """Pipeline stages: the hidden states the stages pass on, for a bucket of ``tokens``."""
        shape = (self.num_stages, tokens, self.cfg.hidden_size)
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.fed_sharding)

    def collect(self, flight: InFlight | None) -> RunnerOutput:
        """Waits for a launched step and reads its results (``launch``). Pipeline stages: a step still in the
        pipeline is first taken out of it, by ticks that take in no new step."""
        result = RunnerOutput({}, {})
        if flight is None:
            return result
        if flight.out is None and self.channel is not None and self.channel.leader:
            # The ticks that drain it are programs over every process' devices: the others run them now too.
            self.channel.send(("collect", self._uncollected - 1))
        while flight.out is None:
            self._tick(None)
        self._uncollected -= 1
        out, plp = _fetch((flight.out, flight.plp))
        t2 = time.perf_counter()
        self.device_seconds += t2 - flight.started
        if flight.decode_only:
            self.decode_steps += 1
            self.decode_device_seconds += t2 - flight.started
        sched, reqs, next_tokens = flight.sched, flight.reqs, flight.next_tokens
        offset = k0 = 0  # k0: the sequence's first row (each has 1 + len(draft_token_ids) of them, in order)
        for i, (s, r) in enumerate(zip(sched.scheduled, reqs)):
            n, offset = s.num_tokens, offset + s.num_tokens
            if flight.want_plp[i]:  # positions of this chunk whose next token is still in the prompt
                k = r.params.prompt_logprobs
                last = min(s.start_pos + n, r.num_prompt_tokens - 1)
                entries = result.prompt_logprobs.setdefault(s.req_id, {})
                for j, pos in enumerate(range(s.start_pos, last)):
                    t = offset - n + j
                    entries[pos + 1] = _sampled(int(next_tokens[t]), plp[0][t], plp[1][t], plp[2][t], k)
            d = len(s.draft_token_ids)
            if s.sample:
                drawn = [int(t) for t in out.tokens[k0 : k0 + d + 1]]
                keep = accepted(s.draft_token_ids, drawn) + 1
                result.sampled[s.req_id] = [
                    _sampled(
                        drawn[j],
                        out.logprobs[k0 + j],
                        out.top_logprob_ids[k0 + j],
                        out.top_logprobs[k0 + j],
                        r.params.logprobs or 0,
                    )
                    for j in range(keep)
                ]
                r.pending -= 1
                r.token_ids.extend(drawn[:keep])
            k0 += 1 + d
        return result

    def _publish(self, sched: SchedulerOutput, token_masks) -> None:
        """Process 0 of several: sends the step's changes to the others (``jaxserve.parallel.step_wire``), once it is known to be
        valid and before its own dispatch; each of them packs the same arrays from them (``follow``)."""
        if self.channel is None or not self.channel.leader:
            return
        if has_changes(sched):
            # With the number of steps in flight here: a follower reads back all but that many before it launches
            # this one, as process 0 did (async scheduling launches a step before reading the previous one's).
            self.channel.send(("step", self._encoder.encode(sched, token_masks), self._uncollected))

    def _launch(self, copy: list[tuple] | None, step: tuple | None):
        """Runs a step's page copies (``[(src, dst), ...]``, see ``StepBuckets.copy_chunks``) and its step
        (``(decode_only, *packed inputs)``); returns the step's (sampler output, prompt logprobs) as device arrays."""
        if copy is None and step is None:
            return None
        for src, dst in copy or ():
            self.k_cache, self.v_cache = self.pool.copy(self.k_cache, self.v_cache, src, dst)
        if step is None:
            return None
        decode_only, *inputs = step
        self.compiler.ready(inputs[4].variant)  # a variant warm-up left to the background: compiled by now
        out, plp, self.fed, self.k_cache, self.v_cache = self.compiler.step(decode_only)(
            self.state, self.matmul_weights, self.k_cache, self.v_cache, self._host(tuple(inputs)), self.fed
        )
        return out, plp

    def follow(self):
        """A follower's loop (processes other than 0): applies every step's changes process 0 publishes, in order,
        to its own requests, and runs the same step (packed here), until process 0 sends an end; returns the end's
        payload. Each step's results are read back when process 0 read them (the requests' tokens feed later
        steps), so under async scheduling a follower too launches a step before it waits for the previous one."""
        in_flight: collections.deque[InFlight] = collections.deque()
        while True:
            kind, *payload = self.channel.recv()
            if kind == "end":
                while in_flight:
                    self.collect(in_flight.popleft())
                return payload[0]
            if kind == "collect":  # pipeline stages: process 0 drains the pipeline down to this many steps
                while len(in_flight) > payload[0]:
                    self.collect(in_flight.popleft())
                continue
            wire, leader_in_flight = payload
            while len(in_flight) > leader_in_flight:
                self.collect(in_flight.popleft())
            flight = self.launch_wire(wire)
            if flight is not None:
                in_flight.append(flight)

    def launch_wire(self, wire: tuple) -> InFlight | None:
        """``launch`` of a step process 0 sent (``jaxserve.parallel.step_wire``), in the order it sent them."""
        return self.launch(*self._decoder.decode(wire))

    def pool_donated(self) -> bool:
        """Whether the KV pool was donated to a step that failed (then nothing can run on this replica)."""
        return self.k_cache.is_deleted()

    def _host(self, inputs: tuple):
        """A step's host inputs as the step takes them: packed into one buffer (``pack_host``) or as they are."""
        return pack(inputs) if self.pack_host else inputs

    def sampling_metadata(self, params: list[SamplingParams], **kwargs) -> SamplingMetadata:
        """The batch's sampler arrays at the fixed widths every step uses (bias entries, token history).

        The wide ones (``_WIDE_SAMPLER_ARRAYS``) are device arrays. Those no row of the batch uses (the history
        without penalties, the bias entries without a logit bias or min_tokens, the mask without a grammar:
        ``from_params``' read-only constants) are placed once per shape, so they do not go host to device every
        step: at 128 rows and a 2,048-token history, 1.8 MB of a step's 1.8 MB. The others are placed here, so
        every step passes the jitted step the same kinds of arguments (one trace per bucket)."""
        meta = SamplingMetadata.from_params(
            params,
            variants=self.sampler_variants,
            eos_token_ids=self.cfg.eos_token_ids,
            bias_width=bias_width(len(self.cfg.eos_token_ids)),
            history_width=self.page_buckets[-1] * self.page_size,  # >= max_model_len
            token_mask_width=self.token_mask_width,
            **kwargs,
        )
        place = self._abstract_on_device if self.abstract else self._on_device
        return dataclasses.replace(meta, **{name: place(getattr(meta, name)) for name in _WIDE_SAMPLER_ARRAYS})

    def _abstract_on_device(self, x: np.ndarray) -> jax.ShapeDtypeStruct:
        """An abstract runner's stand-in for ``_on_device``: where the array would be, not packed with the step's
        host arrays (so that the program lowered for another chip is the one this runner would run)."""
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated)

    def _on_device(self, x: np.ndarray) -> jax.Array:
        """A wide sampler array on the step's devices; a read-only constant (one value throughout) as the copy
        placed for its shape and value."""
        if x.flags.writeable:
            return self._replicate(x)
        key = (x.shape, x.dtype.str, x.flat[0].item())
        placed = self._constants.get(key)
        if placed is None:
            placed = self._constants[key] = self._replicate(x)
        return placed

    def _replicate(self, x: np.ndarray) -> jax.Array:
        """A host array onto every device of the mesh. Under several processes, from this process' copy alone:
        ``jax.device_put`` would first check that every process has the same value, a collective that process 0
        would enter before publishing the step its followers need to reach it."""
        if self.replicated.is_fully_addressable:
            return jax.device_put(x, self.replicated)
        return jax.make_array_from_callback(x.shape, self.replicated, lambda index: x[index])

    @property
    def token_mask_width(self) -> int:
        """Words of a packed allowed-token row: every step carries [rows, this] (all ones when unconstrained)."""
        return bitmask_width(self.cfg.vocab_size)

    def warmup(self, workers: int | None = None) -> int:
        """Compiles every step variant ahead of traffic, without running any (``StepCompiler.warmup``); returns the
        number of compilations."""
        return self.compiler.warmup(workers)


def _no_targets(tokens: int) -> np.ndarray:
    return np.full(tokens, -1, np.int32)


# Rows of the step's [T, V] logits a prompt-logprobs block computes at once: float32 logits of the whole step are
# T x V x 4 bytes (Llama-3's 128K vocabulary: 1 GB at 2,048 tokens, 4.2 GB at 8,192), which every mixed step would
# hold as temporaries, taken from the KV pool.
PROMPT_LOGPROBS_ROWS = 256


def _prompt_logprobs(logits_fn, hidden: jax.Array, next_tokens: jax.Array, when: str = "asked"):
    """Logprobs of ``next_tokens`` under ``logits_fn(hidden)`` [T, V] and the top MAX_LOGPROBS (zeros where not
    computed). ``when``: ``"asked"``, under a conditional, only when some position has a target (>= 0), so one
    compile serves steps with and without them; ``"always"``, no conditional (the sampler's "prompt" variant);
    ``"never"``, the work left out of the program. The logits are computed ``PROMPT_LOGPROBS_ROWS`` rows at a time
    (``lax.map``), never all T rows at once."""
    T = hidden.shape[0]
    rows = PROMPT_LOGPROBS_ROWS if T % PROMPT_LOGPROBS_ROWS == 0 else T

    def block(args):
        h, targets = args
        return compute_logprobs(logits_fn(h), jnp.maximum(targets, 0), MAX_LOGPROBS)

    def run(_):
        out = jax.lax.map(block, (hidden.reshape(T // rows, rows, -1), next_tokens.reshape(T // rows, rows)))
        return jax.tree.map(lambda x: x.reshape(T, *x.shape[2:]), out)

    shapes = jax.eval_shape(run, None)
    skip = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    if when not in ("asked", "always", "never"):
        raise ValueError(f"when must be 'asked', 'always' or 'never', got {when!r}")
    if when == "never":
        return skip(None)
    if when == "always":
        return run(None)
    return jax.lax.cond(jnp.any(next_tokens >= 0), run, skip, None)


def _fetch(tree):
    """Device arrays -> host numpy. The step's outputs are replicated, so each process reads its own copy (under
    several processes the arrays also span other hosts' devices, which ``jax.device_get`` refuses)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)


def _sampled(token: int, logprob, top_ids, top_logprobs, k: int) -> SampledToken:
    return SampledToken(
        token, float(logprob), tuple(int(x) for x in top_ids[:k]), tuple(float(x) for x in top_logprobs[:k])
    )


def _attention_fns(impl: str, decode_only: bool, platform: str | None = None, layout: str = "tokens_heads"):
    """(attention, write_kv) for the model: Pallas kernels on GPU/TPU, XLA on the CPU (see jaxserve.kernels).

    ``decode_only`` (every sequence computes one token) is a static hint: the CPU path then gathers each
    sequence's context once instead of blocking queries. Otherwise the hint is the token bucket itself.
    ``platform`` ("tpu" / "gpu"): the kernels compiled for that platform, whatever JAX runs on (jaxserve.aot).
    ``layout``: the pool's (``KVPool.layout``).
    """
    target = {} if platform in (None, "cpu") else dict(impl="pallas", backend=platform, interpret=False)
    if impl == "pallas-tpu":
        impl, target = "pallas", dict(backend="tpu") | target
    kw = dict(impl=impl, layout=layout) | target

    def attention(q, *args, **kwargs):
        return kernels.ragged_paged_attention(q, *args, max_q_len=1 if decode_only else q.shape[0], **kw, **kwargs)

    return attention, functools.partial(kernels.write_kv, **kw)
