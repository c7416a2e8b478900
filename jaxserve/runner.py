"""The device side: weights, the KV page pool, and one jitted step per shape bucket.

The runner receives a :class:`~jaxserve.scheduler.SchedulerOutput`, packs it into padded arrays of a
bucketed shape (tokens in the step, sequences, pages per sequence) and calls

    step(state, k_cache, v_cache, tokens, batch, logits_indices, sampling) -> (sampled, k_cache, v_cache)

with both caches donated, so the pool is updated in place. Everything the step reads is an argument: no
Python value is frozen into a trace except the static shapes, so one compilation serves every mix of
requests of the same bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import kernels
from jaxserve.block_manager import NULL_PAGE
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.kernels import cpu_ffi
from jaxserve.models.llama import AttentionBatch, model_from_params
from jaxserve.request import Request
from jaxserve.sampling import MAX_LOGPROBS, SamplingMetadata, compute_logprobs, sample
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import SchedulerOutput

_CPU_KV_CAP_BYTES = 4 << 30  # on the CPU the pool defaults to at most this, or what the workload needs


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _buckets(lo: int, hi: int) -> list[int]:
    out, b = [], _pow2_at_least(lo)
    while b < hi:
        out.append(b)
        b *= 2
    return out + [_pow2_at_least(hi)]


def _pick(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


class ModelRunner:
    """Owns the parameters, the page pool and the compiled steps.

    Args:
        model_cfg: the model.
        params: stacked parameter arrays (see ``jaxserve.loading.weights.param_shapes``).
        cache_cfg / sched_cfg: pool size and batching limits (they fix the bucket set).
        attention_impl: "auto" | "reference" | "pallas".
        matmul_dtype: None or "bfloat16": dtype of the weights in the matrix products (None: the weights'
            own). On the CPU, "bfloat16" with float32 weights runs the products of steps of 8 rows or more on
            bfloat16 inputs with float32 accumulation (about 2x faster); norms, residuals, attention, the KV
            cache and the sampler stay float32.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        params: dict,
        cache_cfg: CacheConfig,
        sched_cfg: SchedulerConfig,
        attention_impl: str = "auto",
        matmul_dtype: str | None = None,
    ):
        self.cfg = model_cfg
        self.page_size = cache_cfg.page_size
        self.graphdef, state = model_from_params(model_cfg, params)
        self.state = jax.device_put(state)
        self.matmul_weights = None
        if matmul_dtype is not None and jnp.dtype(matmul_dtype) != params["embed"].dtype:
            self.matmul_weights = jax.jit(lambda s: nnx.merge(self.graphdef, s).matmul_weights())(self.state)
        self.kv_dtype = jnp.dtype(cache_cfg.dtype or params["embed"].dtype)  # default: the weights' dtype
        cpp = attention_impl in ("auto", "xla") and cpu_ffi.serves(self.kv_dtype) and cpu_ffi.available()
        if self.kv_dtype != jnp.float32 and jax.default_backend() == "cpu" and attention_impl != "pallas" and not cpp:
            warnings.warn(f"a {self.kv_dtype} KV cache on the CPU is slow without the C++ attention: XLA:CPU converts "
                          "the whole pool to float32 for every K/V write (seconds per step for a GiB pool); "
                          "kv_cache_dtype='float32' is the CPU default", RuntimeWarning, stacklevel=3)
        self.num_pages = cache_cfg.num_pages or self._pages_from_memory(cache_cfg, sched_cfg)
        shape = (model_cfg.num_layers, self.num_pages, self.page_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.k_cache = jnp.zeros(shape, self.kv_dtype)
        self.v_cache = jnp.zeros(shape, self.kv_dtype)
        self.token_buckets = _buckets(8, sched_cfg.max_num_batched_tokens)
        self.max_seqs = _pow2_at_least(sched_cfg.max_num_seqs)
        self.page_buckets = _buckets(min(8, math.ceil(sched_cfg.max_model_len / self.page_size)),
                                     math.ceil(sched_cfg.max_model_len / self.page_size))
        self.attention_impl = attention_impl
        self.num_compilations = 0  # traces of the step; a test asserts it stays flat in steady state
        self.reset_timers()
        self._steps: dict[tuple, object] = {}
        self.prompt_logprobs: dict[str, dict[int, SampledToken]] = {}  # req -> position -> entry; engine pops
        self._copy = jax.jit(_copy_pages, donate_argnums=(0, 1))

    def reset_timers(self) -> None:
        self.num_tokens_computed = 0  # real (unpadded) tokens run through the model
        self.num_steps = 0
        self.pack_seconds = 0.0  # host: building the padded arrays and sampling metadata
        self.device_seconds = 0.0  # dispatch to results back on the host
        self.decode_steps = 0  # steps where every sequence computes one token, and their device seconds
        self.decode_device_seconds = 0.0

    # ------------------------------------------------------------------ sizing
    def _page_bytes(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * self.page_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize

    def _pages_from_memory(self, cache_cfg: CacheConfig, sched_cfg: SchedulerConfig) -> int:
        device = jax.devices()[0]
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] * cache_cfg.kv_cache_memory_fraction - stats.get("bytes_in_use", 0)
            pages = int(free // self._page_bytes())
        else:  # CPU: enough for every sequence at full length, within a share of host memory
            want = sched_cfg.max_num_seqs * math.ceil(sched_cfg.max_model_len / self.page_size) + 1
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * cache_cfg.kv_cache_memory_fraction
            pages = min(want, int(min(_CPU_KV_CAP_BYTES, host / 4) // self._page_bytes()))
        if pages < 2:
            raise ValueError(f"not enough memory for a KV cache: {pages} pages of {self._page_bytes()} bytes")
        return pages

    # ------------------------------------------------------------------ compiled functions
    def _step_fn(self, max_logprobs: int, prompt_logprobs: bool, decode_only: bool):
        key = (max_logprobs, prompt_logprobs, decode_only)
        if key in self._steps:
            return self._steps[key]
        attention, write = _attention_fns(self.attention_impl, decode_only)
        graphdef = self.graphdef

        def step(state, mm, k_cache, v_cache, tokens, batch, logits_indices, meta, next_tokens):
            self.num_compilations += 1  # runs once per trace
            model = nnx.merge(graphdef, state)
            hidden, k_cache, v_cache = model(tokens, batch, k_cache, v_cache, attention, write, mm)
            out = sample(model.logits(hidden[logits_indices], mm), meta, max_logprobs=max_logprobs)
            # prompt_logprobs: every position's logprob of the token after it (the whole [T, V] logits).
            plp = compute_logprobs(model.logits(hidden, mm), next_tokens, MAX_LOGPROBS) if prompt_logprobs else None
            return out, plp, k_cache, v_cache

        fn = jax.jit(step, donate_argnums=(2, 3))
        self._steps[key] = fn
        return fn

    # ------------------------------------------------------------------ packing
    def pack(self, sched: SchedulerOutput) -> tuple[np.ndarray, AttentionBatch, np.ndarray]:
        """SchedulerOutput -> (tokens [Tb], AttentionBatch, logits_indices [Sb]) as padded host arrays."""
        seqs = sched.scheduled
        num_tokens = sum(len(s.token_ids) for s in seqs)
        tb = _pick(self.token_buckets, num_tokens)
        sb = max(min(tb, self.max_seqs), len(seqs))
        kv_lens = np.zeros(sb, np.int32)
        for i, s in enumerate(seqs):
            kv_lens[i] = s.start_pos + len(s.token_ids)
        pb = _pick(self.page_buckets, -(-int(kv_lens.max()) // self.page_size))
        tokens = np.zeros(tb, np.int32)
        positions = np.zeros(tb, np.int32)
        slots = np.full(tb, -1, np.int32)
        page_indices = np.full((sb, pb), NULL_PAGE, np.int32)
        cu = np.zeros(sb + 1, np.int32)
        t = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            table = np.asarray(s.page_table[: -(-int(kv_lens[i]) // self.page_size)], np.int32)
            page_indices[i, : len(table)] = table
            pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int32)
            tokens[t: t + n] = s.token_ids
            positions[t: t + n] = pos
            slots[t: t + n] = table[pos // self.page_size] * self.page_size + pos % self.page_size
            t += n
            cu[i + 1] = t
        cu[len(seqs) + 1:] = t
        logits_indices = np.maximum(cu[1:] - 1, 0)
        batch = AttentionBatch(positions=positions, slot_mapping=slots, kv_lens=kv_lens,
                               page_indices=page_indices, cu_q_lens=cu, num_seqs=np.int32(len(seqs)))
        return tokens, batch, logits_indices

    # ------------------------------------------------------------------ execution
    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, SampledToken]:
        """Runs one step; returns the sampled token of every scheduled request whose chunk asks for one."""
        if sched.copy_ops:
            src, dst = (np.asarray(x, np.int32) for x in zip(*sched.copy_ops))
            self.k_cache, self.v_cache = self._copy(self.k_cache, self.v_cache, src, dst)
        if not sched.scheduled:
            return {}
        t0 = time.perf_counter()
        tokens, batch, logits_indices = self.pack(sched)
        self.num_tokens_computed += sched.num_scheduled_tokens
        self.num_steps += 1
        reqs = [requests[s.req_id] for s in sched.scheduled]
        params = [r.sampling_params for r in reqs]
        meta = SamplingMetadata.from_params(
            params, steps=[r.num_output_tokens for r in reqs],
            prompt_ids=[r.prompt_token_ids for r in reqs], output_ids=[r.output_token_ids for r in reqs],
            pad_to=len(logits_indices), eos_token_ids=self.cfg.eos_token_ids,
        )
        max_logprobs = MAX_LOGPROBS if any(p.logprobs for p in params) else 0
        want_plp = [p.prompt_logprobs is not None and s.start_pos < r.num_prompt_tokens - 1
                    for p, s, r in zip(params, sched.scheduled, reqs)]
        next_tokens = self._next_tokens(sched, reqs, len(tokens)) if any(want_plp) else None
        t1 = time.perf_counter()
        decode_only = all(len(s.token_ids) == 1 for s in sched.scheduled)
        out, plp, self.k_cache, self.v_cache = self._step_fn(max_logprobs, any(want_plp), decode_only)(
            self.state, self.matmul_weights, self.k_cache, self.v_cache, tokens, batch, logits_indices, meta,
            next_tokens)
        out, plp = jax.device_get((out, plp))
        t2 = time.perf_counter()
        self.pack_seconds += t1 - t0
        self.device_seconds += t2 - t1
        if decode_only:
            self.decode_steps += 1
            self.decode_device_seconds += t2 - t1
        result = {}
        offset = 0
        for i, (s, r) in enumerate(zip(sched.scheduled, reqs)):
            n, offset = len(s.token_ids), offset + len(s.token_ids)
            if want_plp[i]:  # positions of this chunk whose next token is still in the prompt
                k = params[i].prompt_logprobs
                last = min(s.start_pos + n, r.num_prompt_tokens - 1)
                for j, pos in enumerate(range(s.start_pos, last)):
                    t = offset - n + j
                    entry = _sampled(int(next_tokens[t]), plp[0][t], plp[1][t], plp[2][t], k)
                    self.prompt_logprobs.setdefault(s.req_id, {})[pos + 1] = entry
            if s.sample:
                result[s.req_id] = _sampled(int(out.tokens[i]), out.logprobs[i], out.top_logprob_ids[i],
                                            out.top_logprobs[i], params[i].logprobs or 0)
        return result

    @staticmethod
    def _next_tokens(sched: SchedulerOutput, reqs: list[Request], padded: int) -> np.ndarray:
        """[Tb] the token that follows each position of the step (prompt_logprobs' targets; 0 past the end)."""
        out = np.zeros(padded, np.int32)
        t = 0
        for s, r in zip(sched.scheduled, reqs):
            n = len(s.token_ids)
            nxt = r.token_slice(s.start_pos + 1, min(s.start_pos + n + 1, r.num_tokens))
            out[t: t + len(nxt)] = nxt
            t += n
        return out

    def warmup_shapes(self, max_logprobs: tuple[int, ...] = (0,)) -> list[tuple[int, int, int, bool]]:
        """(max_logprobs, token bucket, page bucket, decode_only) of every step variant traffic can need."""
        return [(lp, tb, pb, decode) for lp in max_logprobs for tb in self.token_buckets for pb in self.page_buckets
                for decode in ((False, True) if tb <= self.max_seqs else (False,))]

    def warmup(self, max_logprobs: tuple[int, ...] = (0,)) -> int:
        """Compiles every step variant ahead of traffic. Returns the number of compilations."""
        before = self.num_compilations
        for lp, tb, pb, decode in self.warmup_shapes(max_logprobs):
            sb = min(tb, self.max_seqs)
            batch = AttentionBatch(
                positions=np.zeros(tb, np.int32), slot_mapping=np.full(tb, -1, np.int32),
                kv_lens=np.zeros(sb, np.int32), page_indices=np.zeros((sb, pb), np.int32),
                cu_q_lens=np.zeros(sb + 1, np.int32), num_seqs=np.int32(0))
            meta = SamplingMetadata.from_params([SamplingParams(temperature=0.0)], pad_to=sb)
            _, _, self.k_cache, self.v_cache = self._step_fn(lp, False, decode)(
                self.state, self.matmul_weights, self.k_cache, self.v_cache, np.zeros(tb, np.int32), batch,
                np.zeros(sb, np.int32), meta, None)
        return self.num_compilations - before


def _sampled(token: int, logprob, top_ids, top_logprobs, k: int) -> SampledToken:
    return SampledToken(token, float(logprob), tuple(int(x) for x in top_ids[:k]),
                        tuple(float(x) for x in top_logprobs[:k]))


def _attention_fns(impl: str, decode_only: bool):
    """(attention, write_kv) for the model: Pallas kernels on GPU/TPU, XLA on the CPU (see jaxserve.kernels).

    ``decode_only`` (every sequence computes one token) is a static hint: the CPU path then gathers each
    sequence's context once instead of blocking queries. Otherwise the hint is the token bucket itself.
    """
    def attention(q, *args, **kwargs):
        return kernels.ragged_paged_attention(q, *args, impl=impl, max_q_len=1 if decode_only else q.shape[0],
                                              **kwargs)

    return attention, functools.partial(kernels.write_kv, impl=impl)


def _copy_pages(k_cache, v_cache, src, dst):
    """Copy-on-write: pages ``src`` -> ``dst`` in every layer."""
    return k_cache.at[:, dst].set(k_cache[:, src]), v_cache.at[:, dst].set(v_cache[:, src])
