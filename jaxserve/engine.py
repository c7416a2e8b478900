"""LLMEngine: requests in, streamed outputs out; one ``step()`` at a time.

Each step: the scheduler (host) picks the work, the runner (device) computes it and samples, the scheduler
appends the tokens and applies token-level stops, and the engine detokenizes incrementally, applies stop
strings, and reports every request that made progress.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import jax

from jaxserve.block_manager import BlockManager
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.loading import LoadedModel, load_model
from jaxserve.loading.weights import cast_params
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner import ModelRunner, default_dtype
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

DEFAULT_MAX_MODEL_LEN = 2048


def enable_compilation_cache(path: str | None = None) -> None:
    """JAX's persistent compilation cache, so a second process skips compiling the same step."""
    path = path or os.environ.get("JAXSERVE_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxserve" / "xla"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass
class _Sequence:
    """Engine-side state of one of a prompt's ``n`` sequences."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    pending_forks: list[_Sequence]  # n > 1: children waiting for the first sequence's prompt pages


class LLMEngine:
    """The serving engine. See ``LLM`` for the offline batch API.

    Args:
        model: GGUF file, HF directory, orbax directory, preset name or hub id; None = the default model.
        dtype: weights/activations dtype; None = float32 on CPU, bfloat16 on GPU/TPU.
        matmul_dtype: None (= ``dtype``) or "bfloat16": dtype of the weights in the matrix products. "bfloat16"
            with float32 ``dtype`` on the CPU about doubles the matmul rate at bfloat16 input precision.
        num_pages, page_size, kv_cache_memory_fraction, kv_cache_dtype: the KV page pool.
        max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, policy: batching.
        attention_impl: "auto" | "reference" | "pallas".
        seed: seeds the per-request seeds of requests that give none.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        dtype: str | None = None,
        matmul_dtype: str | None = None,
        num_pages: int | None = None,
        page_size: int = 16,
        kv_cache_memory_fraction: float = 0.9,
        kv_cache_dtype: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        attention_impl: str = "auto",
        seed: int = 0,
        compilation_cache: bool = True,
    ):
        if compilation_cache:
            enable_compilation_cache()
        t0 = time.perf_counter()
        dtype = dtype or default_dtype()
        if matmul_dtype not in (None, dtype, "bfloat16"):
            raise ValueError(f"matmul_dtype must be None, the weights' dtype ({dtype}) or 'bfloat16', "
                             f"got {matmul_dtype!r}")
        if isinstance(model, LoadedModel):  # already in host memory: several engines can share one load
            loaded = dataclasses.replace(model, params=cast_params(model.params, dtype))
        else:
            loaded = load_model(model, dtype)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = load_tokenizer(loaded.tokenizer_path)
        max_model_len = max_model_len or min(loaded.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{loaded.config.max_position_embeddings}")
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                                enable_prefix_caching, policy)
        cache_cfg = CacheConfig(page_size, num_pages, kv_cache_memory_fraction, kv_cache_dtype)
        self.runner = ModelRunner(loaded.config, loaded.params, cache_cfg, self.scheduler_config, attention_impl,
                                  matmul_dtype)
        self.scheduler = Scheduler(self.scheduler_config,
                                   BlockManager(self.runner.num_pages, page_size, enable_prefix_caching))
        self.load_seconds = time.perf_counter() - t0
        self._rng = random.Random(seed)
        self._tracked: dict[str, _Tracked] = {}
        self._seq_owner: dict[str, tuple[_Tracked, _Sequence]] = {}  # scheduler request id -> owner

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
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
        """Queues a prompt (text or token ids).

        Raises:
            ValueError: duplicate id, empty prompt, token ids out of the vocabulary, a prompt longer than
                max_model_len (naming both lengths), or a request that cannot fit the page pool.
        """
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        if isinstance(prompt, str):
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_ids = None, [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                                 f"{self.model_config.vocab_size})")
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        max_len = self.scheduler_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(f"request {request_id!r}: the prompt has {len(prompt_ids)} tokens, which leaves no room "
                             f"to generate within max_model_len={max_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(prompt_ids)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        tracked = _Tracked(request_id, prompt_text, prompt_ids, params, [], [])
        for i in range(params.n):
            child_params = dataclasses.replace(params, n=1, max_tokens=max_tokens,
                                               seed=base_seed if i == 0 else hash((base_seed, i)) & (2**63 - 1))
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, prompt_ids, child_params, self.eos_token_ids, arrival_time, priority)
            seq = _Sequence(i, req, IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                            logprobs=[] if params.logprobs is not None else None)
            tracked.seqs.append(seq)
        self.scheduler.add_request(tracked.seqs[0].request)  # validates before anything is recorded
        tracked.pending_forks = tracked.seqs[1:]
        self._tracked[request_id] = tracked
        for seq in tracked.seqs:
            self._seq_owner[seq.request.request_id] = (tracked, seq)

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request (all its sequences) and frees its pages at once. Returns False if unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return False
        for seq in tracked.seqs:
            self.scheduler.abort_request(seq.request.request_id)
            seq.request.status = RequestStatus.FINISHED_ABORTED
            self._seq_owner.pop(seq.request.request_id, None)
            self.runner.prompt_logprobs.pop(seq.request.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler + device step. Returns an output for every request that progressed."""
        sched = self.scheduler.schedule()
        sampled = self.runner.execute(sched, self.scheduler.requests)
        self.scheduler.update_from_output(sched, {rid: [s.token_id] for rid, s in sampled.items()})
        touched: dict[str, _Tracked] = {}
        for rid, tok in sampled.items():
            owner = self._seq_owner.get(rid)
            if owner is None:
                continue
            tracked, seq = owner
            self._append(tracked, seq, tok)
            touched[tracked.request_id] = tracked
        self._start_forks()
        outputs = []
        for tracked in touched.values():
            out = self._output(tracked)
            outputs.append(out)
            if out.finished:
                self._tracked.pop(tracked.request_id, None)
                for seq in tracked.seqs:
                    self._seq_owner.pop(seq.request.request_id, None)
                    self.runner.prompt_logprobs.pop(seq.request.request_id, None)
        return outputs

    def _append(self, tracked: _Tracked, seq: _Sequence, tok) -> None:
        params = seq.request.sampling_params
        req = seq.request
        if seq.logprobs is not None:
            entry = {tok.token_id: Logprob(tok.logprob, self.tokenizer.decode([tok.token_id], False))}
            for tid, lp in zip(tok.top_ids, tok.top_logprobs):
                entry.setdefault(tid, Logprob(lp, self.tokenizer.decode([tid], False)))
            seq.logprobs.append(entry)
        seq.cumulative_logprob += tok.logprob
        stopped_by_token = req.is_finished and req.finish_reason == "stop"
        if stopped_by_token:
            seq.stop_reason = tok.token_id if tok.token_id in (params.stop_token_ids or ()) else None
            return  # the stop token's text is not part of the output
        seq.text += seq.detok.add(tok.token_id)
        if req.is_finished:
            seq.text += seq.detok.flush()
        for stop in params.stop or ():
            # Only the tail can hold a new match: the new text plus len(stop) - 1 characters before it.
            at = seq.text.find(stop, max(0, len(seq.text) - len(stop) - 64))
            if at >= 0:
                seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.stop_reason = stop
                self.scheduler.finish_request(req.request_id, "stop")
                req.status = RequestStatus.FINISHED_STOPPED
                break

    def _start_forks(self) -> None:
        """n > 1: the other sequences share the first one's prompt pages once its prefill is done."""
        for tracked in list(self._tracked.values()):
            if not tracked.pending_forks:
                continue
            first = tracked.seqs[0].request
            if first.status is RequestStatus.RUNNING and first.num_computed_tokens >= len(tracked.prompt_token_ids):
                for seq in tracked.pending_forks:
                    self.scheduler.fork_request(first.request_id, seq.request)
            elif first.is_finished or first.status is not RequestStatus.RUNNING:
                for seq in tracked.pending_forks:
                    self.scheduler.add_request(seq.request)
            else:
                continue
            tracked.pending_forks = []

    def _output(self, tracked: _Tracked) -> RequestOutput:
        outs = []
        hold = max((len(s) for s in tracked.params.stop or ()), default=1) - 1
        for seq in tracked.seqs:
            req = seq.request
            text = seq.text
            if not req.is_finished and hold:
                text = text[: max(0, len(text) - hold)]  # a stop string may still be forming
            outs.append(CompletionOutput(
                seq.index, text, list(req.output_token_ids),
                seq.cumulative_logprob if seq.logprobs is not None else None, seq.logprobs,
                req.finish_reason, seq.stop_reason,
            ))
        finished = all(s.request.is_finished for s in tracked.seqs) and not tracked.pending_forks
        return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids, outs, finished,
                             tracked.seqs[0].request.num_cached_tokens, self._prompt_logprobs(tracked))

    def _prompt_logprobs(self, tracked: _Tracked) -> list[dict[int, Logprob] | None] | None:
        if tracked.params.prompt_logprobs is None:
            return None
        entries = self.runner.prompt_logprobs.get(tracked.seqs[0].request.request_id, {})
        out: list[dict[int, Logprob] | None] = [None]
        for pos in range(1, len(tracked.prompt_token_ids)):
            e = entries.get(pos)
            if e is None:
                out.append(None)
                continue
            d = {e.token_id: Logprob(e.logprob, self.tokenizer.decode([e.token_id], False))}
            for tid, lp in zip(e.top_ids, e.top_logprobs):
                d.setdefault(tid, Logprob(lp, self.tokenizer.decode([tid], False)))
            out.append(d)
        return out

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict:
        s = self.scheduler.stats()
        r = self.runner
        return {**dataclasses.asdict(s), "num_compilations": r.num_compilations, "num_pages": r.num_pages,
                "num_tokens_computed": r.num_tokens_computed, "num_steps": r.num_steps}
