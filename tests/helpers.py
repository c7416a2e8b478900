"""Helpers shared by several test modules (``conftest.py`` puts this folder on ``sys.path``: ``import helpers``).

Importing this module imports neither jax nor torch: the host-side tests (scheduler, block manager) use it too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


# ---------------------------------------------------------------------------------------------------- host side
@dataclasses.dataclass
class SP:
    """The sampling parameters the scheduler and block manager read (``jaxserve.core.request.Request`` treats the rest
    as opaque), without importing the real ``SamplingParams``."""

    max_tokens: int = 8
    min_tokens: int = 0
    stop_token_ids: list = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int = 0


class CharTokenizer:
    """One token per character (ids 1..999), for servers over fake engines."""

    eos_token_ids = (0,)

    def encode(self, text, add_special_tokens=True):
        return [1 + ord(c) % 999 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" t{i}" for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return self.encode(text) if tokenize else text


class SchedulerEngine:
    """A fake engine over the real host-side ``Scheduler`` and ``BlockManager`` (no model, no jax), for servers whose
    engine state must move: each step is scheduled as ``LLMEngine`` schedules it and every sequence due a sample
    gets token 7, so page tables, prefix-cache hits, preemptions and evictions (and their KV events) are real.
    ``step_s`` sleeps in each step (a slower engine, to look at it mid-request)."""

    def __init__(self, num_pages=64, page_size=4, max_model_len=256, max_num_seqs=8, step_s=0.0):
        from types import SimpleNamespace

        from jaxserve.config import SchedulerConfig
        from jaxserve.core import kv_events
        from jaxserve.core.block_manager import BlockManager
        from jaxserve.core.sched.async_scheduler import make_scheduler

        self._drain = kv_events.drain
        self.model_name = "fake-scheduler"
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=max_model_len
        )
        self.config = SimpleNamespace(page_size=page_size, enable_prefix_caching=True, kv_cache_dtype=None)
        self.tokenizer = CharTokenizer()
        self.scheduler = make_scheduler(self.scheduler_config, BlockManager(num_pages, page_size))
        self.step_s, self.num_steps = step_s, 0

    def add_request(self, rid, prompt, params, priority=0):
        from jaxserve.core.request import Request

        self.scheduler.add_request(Request(rid, list(prompt), params, self.tokenizer.eos_token_ids, priority=priority))

    def abort_request(self, rid):
        return self.scheduler.abort_request(rid) is not None

    def has_unfinished_requests(self):
        return self.scheduler.has_unfinished_requests()

    def enable_kv_events(self):
        self.scheduler.block_manager.enable_kv_events()

    def drain_kv_events(self):
        return self._drain([self.scheduler.block_manager])

    def get_stats(self):
        stats = dataclasses.asdict(self.scheduler.stats())
        stats["num_steps"] = self.num_steps
        return stats

    def step(self):
        import time

        from jaxserve.core.outputs import CompletionOutput, RequestOutput

        if self.step_s:
            time.sleep(self.step_s)
        self.num_steps += 1
        sched = self.scheduler.schedule()
        sampled = {s.req_id: [7] for s in sched.scheduled if s.sample}
        finished = {r.request_id: r for r in self.scheduler.update_from_output(sched, sampled)}
        outs = []
        for rid in sampled:
            r = finished.get(rid) or self.scheduler.requests.get(rid)
            if r is None:
                continue
            toks = list(r.output_token_ids)
            comp = CompletionOutput(0, " t7" * len(toks), toks, None, None, r.finish_reason)
            outs.append(RequestOutput(rid, None, r.prompt_token_ids, [comp], rid in finished))
        return outs


# The session's shared engine (conftest's default_llm) and the engines that serve the same traffic (the OpenAI
# servers of test_server_api and test_server_tools): one setting, so their steps are compiled once per run.
DEFAULT_ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=2048, num_pages=1024)
# Settings of the engines that warm up every step variant (tests/engine/test_engine.py, tests/engine/test_reliability.py, both on
# the default model's first two layers): one setting, so whichever runs second loads the variants from the run's
# compilation cache.
WARMUP_ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, num_pages=300)
# A pool of 24 pages (384 tokens) for 12 sequences: the preemption tests of several files share its programs.
SMALL_POOL_ENGINE = dict(max_num_seqs=12, max_num_batched_tokens=256, max_model_len=1024, num_pages=24)


def assert_same_completions(got, want, atol: float) -> None:
    """Completions (``CompletionOutput``s sampled with ``logprobs=0``) of the same requests in two layouts or modes:
    the same tokens, and each chosen token's logprob within ``atol``."""
    import numpy as np

    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
        np.testing.assert_allclose(
            [lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)],
            [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)],
            atol=atol,
        )


def first_layers(loaded, num_layers: int = 2):
    """The loaded default model cut to its first ``num_layers`` layers (embedding, final norm and tied output kept):
    real tokens and text-like output (common words, punctuation: stop strings are hit) at about a quarter of the
    30 layers' cost a token. For engine mechanics whose reference is the same engine in another mode (scheduling,
    preemption, aborts, async steps), never for fidelity against HF transformers or llama.cpp."""
    from jaxserve.loading.weights import param_shapes

    config = dataclasses.replace(loaded.config, num_layers=num_layers)
    shapes = param_shapes(config)  # the model's schema: the layer stacks lead with the layer axis
    params = {name: v if v.shape == shapes[name] else v[:num_layers] for name, v in loaded.params.items()}
    return dataclasses.replace(loaded, name=f"{loaded.name}-first-{num_layers}", config=config, params=params)


def tiny_model(
    tokenizer_path, num_heads: int = 8, num_kv_heads: int = 2, intermediate_size: int = 96, num_layers: int = 2, **cfg
):
    """A 2-layer (``num_layers``) random model (hidden 64, head_dim 16) with SmolLM2's vocabulary, for tests of the machinery around
    the model (sharding, several processes, the step wire): norms 1, other weights N(0, 0.1), seed 0. The default
    intermediate size divides over 2, 3 and 4 devices."""
    import numpy as np

    from jaxserve.config import ModelConfig
    from jaxserve.loading import LoadedModel
    from jaxserve.models.schema import random_params

    config = ModelConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=256,
        **cfg,
    )
    return LoadedModel("tiny", config, random_params(config, 0.1, np.random.default_rng(0)), tokenizer_path)


# ---------------------------------------------------------------------------------------------------- kernels
@dataclasses.dataclass
class Batch:
    """The inputs of ``ragged_paged_attention`` for one ragged batch (jax arrays), built by :func:`make_batch`; the
    metadata is that of a ``jaxserve.kernels.AttentionBatch`` (``meta``)."""

    q: Any
    k_cache: Any
    v_cache: Any
    kv_lens: Any
    page_indices: Any
    cu_q_lens: Any
    num_seqs: Any

    @property
    def meta(self):
        """The batch's ``AttentionBatch`` (what attention reads)."""
        from jaxserve.kernels import AttentionBatch

        return AttentionBatch(
            kv_lens=self.kv_lens, page_indices=self.page_indices, cu_q_lens=self.cu_q_lens, num_seqs=self.num_seqs
        )

    def args(self, layer=1) -> tuple:
        return (self.q, self.k_cache, self.v_cache, layer, self.meta)

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs)])


def make_batch(
    q_lens, kv_lens, *, hq=8, hk=2, d=64, pad_seqs=2, pad_tokens=5, layers=2, dtype=None, seed=0, extra_pages=4, page=16
) -> Batch:
    """A random ragged batch over a scrambled page pool, poisoned so that reading what the contract calls junk fails:
    cache pages no sequence owns and slots past a sequence's kv_len are NaN, page-table entries past a sequence's
    pages point out of range (-1 for the ``pad_seqs`` padding sequences), every row of the table has a spare column,
    and there are ``pad_tokens`` padding query tokens. Sequence i has ``q_lens[i]`` query tokens at the end of its
    ``kv_lens[i]``-token context; ``dtype`` (default float32) is q's and the caches'."""
    import jax.numpy as jnp
    import numpy as np

    dtype = dtype or jnp.float32
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    need = [-(-k // page) for k in kv_lens]
    pages_per_seq = max(max(need), 1) + 1  # one spare column of junk in every row
    num_pages = sum(need) + extra_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((num_seqs + pad_seqs, pages_per_seq), -1, np.int32)
    k_cache = rng.standard_normal((layers, num_pages, page, hk, d)).astype(np.float32)
    v_cache = rng.standard_normal((layers, num_pages, page, hk, d)).astype(np.float32)
    owned = np.zeros(num_pages, bool)
    start = 0
    for s in range(num_seqs):
        table[s, :] = num_pages + 1000 + s  # out of range: a kernel that follows it would fail
        table[s, : need[s]] = perm[start : start + need[s]]
        owned[perm[start : start + need[s]]] = True
        start += need[s]
        for p in range(kv_lens[s], need[s] * page):  # slots past kv_len inside owned pages
            k_cache[:, table[s, p // page], p % page] = np.nan
            v_cache[:, table[s, p // page], p % page] = np.nan
    k_cache[:, ~owned] = np.nan
    v_cache[:, ~owned] = np.nan
    q = rng.standard_normal((sum(q_lens) + pad_tokens, hq, d)).astype(np.float32)
    cu = np.full(num_seqs + pad_seqs + 1, sum(q_lens), np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(num_seqs + pad_seqs, np.int32)
    kv[:num_seqs] = kv_lens
    return Batch(
        jnp.asarray(q, dtype),
        jnp.asarray(k_cache, dtype),
        jnp.asarray(v_cache, dtype),
        jnp.asarray(kv),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.int32(num_seqs),
    )


# ---------------------------------------------------------------------------------------------------- HF reference
def hf_greedy(model, ids: list[int], n: int, *, logprobs: bool = False):
    """HF transformers' greedy continuation of ``ids`` by ``n`` tokens (no EOS stop): the token ids, or with
    ``logprobs`` (token ids, the chosen tokens' logprobs)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=logprobs,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    if not logprobs:
        return tokens
    # scores are the raw logits here (greedy, no processors): logprob of each chosen token
    return tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]


def hf_greedy_choices(model, ids: list[int], tokens: list[int]) -> list[int]:
    """HF transformers' greedy choice after ``ids`` + each prefix of ``tokens`` (teacher-forced, one forward pass):
    equal to ``tokens`` exactly when HF's greedy continuation of ``ids`` is ``tokens``, since both first differ at
    the same step (the histories before it are the same). The cheap form of ``hf_greedy(model, ids, len(tokens))
    == tokens``."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
    return logits.argmax(-1).tolist()


def sized_copies(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """The ``copy`` instructions of an optimized HLO module's text that copy as many elements as ``shape`` holds
    (a K/V pool, in any of its views): a compiled step that updates a donated pool in place has none."""
    import re

    size = math.prod(shape)
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", line)  # any layout: a TPU's has tiles
        if m and math.prod(int(d) for d in m.group(1).split(",")) == size:
            found.append(line.strip()[:120])
    return found


def hlo_ops(hlo: str, opcode: str) -> list[str]:
    """The instructions of an optimized HLO module's text with ``opcode`` (``conditional``, ``while``, ...): the
    first 120 characters of each line."""
    import re

    pattern = re.compile(rf" = .*\s{re.escape(opcode)}\(")  # after the result's type (which may hold "/*index=5*/")
    return [line.strip()[:120] for line in hlo.splitlines() if pattern.search(line)]


def longrope(short_factor: list[float], long_factor: list[float], original: int = 64, **extra) -> dict:
    """A transformers-5 ``rope_parameters`` dict for longrope (Phi-3): a factor per rotated frequency, the original
    context above the tests' sequences (so that the short factors apply), base 10,000."""
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        original_max_position_embeddings=original,
        short_factor=short_factor,
        long_factor=long_factor,
        **extra,
    )


# Tiny random HF checkpoints served with the default model's tokenizer (tests/models/test_moe_models.py, test_deepseek.py).
TINY_VOCAB = 49152  # SmolLM2's tokenizer
TINY_ENGINE = dict(num_pages=64, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=32, dtype="float32")


def tiny_prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    """Random token prompts of 5, 40, 11 and 23 tokens: one over TINY_ENGINE's 32-token budget (chunked prefill,
    mixed steps)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY_VOCAB - 100, size=int(k)).tolist() for k in (5, 40, 11, 23)[:n]]


def assert_matches_hf(hf, prompts, outputs, atol: float = 1e-3) -> None:
    """Our greedy completions (with logprobs) against HF transformers teacher-forced on our tokens: every greedy
    choice identical, each chosen token's logprob within ``atol``."""
    import numpy as np
    import torch

    for ids, out in zip(prompts, outputs):
        tokens = list(out.token_ids)
        assert hf_greedy_choices(hf, ids, tokens) == tokens
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
        ref = torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
        ours = np.array([lp[t].logprob for lp, t in zip(out.logprobs, tokens)])
        np.testing.assert_allclose(ours, ref, atol=atol, rtol=0)
