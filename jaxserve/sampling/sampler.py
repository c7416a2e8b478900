"""Sampling: user-facing ``SamplingParams`` and a jitted, batched sampler driven by per-row arrays.

Host side, ``SamplingParams`` validates one request's settings and ``SamplingMetadata.from_params`` packs a
batch of them into padded arrays. Device side, ``sample`` reads only those arrays and the batch's ``variant``,
which the host picks from them: ``"greedy"`` when every row is greedy with nothing else asked (an argmax and the
chosen tokens' logprobs: no conditional, no pass over the vocabulary greedy decoding does not need), else
``"sampled"`` when rows sample with temperature, min-p, top-k up to TOP_K_CAP and seeds and ask for nothing else
(no conditional either; GPU and TPU runners compile it), else ``"full"``, which serves every mix of temperatures,
top-k/top-p/min-p, penalties, biases, structured-output masks, logprobs and seeds (on the CPU what no row asks
for is skipped at run time, under ``lax.cond``; on GPUs and TPUs every row computes it all, neutral where unused,
and a step with prompt logprobs is the "prompt" variant: no step has a conditional). One compile per variant
serves a shape. The runner asks for fixed widths (bias
entries and token history), so no request parameter can change a shape; without them the widths are bucketed to
what the batch needs.

The order follows vLLM v1: logit bias (and the ``min_tokens`` ban on stop tokens), penalties, the
structured-output token mask (last of the three, so no extreme penalty can lift a ban), then temperature, min-p,
top-k, top-p and a Gumbel-max draw; greedy rows (temperature < 1e-5) take the argmax of the biased, penalized and
masked logits. Returned logprobs are those of the raw model logits (vLLM's
default ``raw_logprobs``). Each row draws with ``fold_in(key(seed), step)``, so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import (  # noqa: F401
    GREEDY_EPS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    PAD_ID,
    TOP_K_CAP,
    SamplingParams,
)
from jaxserve.utils import next_pow2

_F32_MAX = float(np.finfo(np.float32).max)


def _f32_positive(x: float) -> float:
    """A positive float within float32's normal range (a penalty of 1e-320 would be 0 on the device)."""
    return min(max(float(x), float(np.finfo(np.float32).tiny)), _F32_MAX)


def _bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return next_pow2(max(n, minimum))


def bias_width(num_eos_tokens: int) -> int:
    """Fixed bias width that holds any valid request: its logit_bias plus, under min_tokens, the ban on its
    stop_token_ids and the model's EOS tokens."""
    return MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + num_eos_tokens


@functools.lru_cache(maxsize=64)
def _constant(shape: tuple[int, ...], dtype: str, fill) -> np.ndarray:
    """A read-only array of one value, shared by every batch that needs no per-row data in it."""
    out = np.full(shape, fill, dtype)
    out.flags.writeable = False
    return out


def _width(name: str, need: int, fixed: int | None, minimum: int) -> int:
    if fixed is None:
        return _bucket(need, minimum)
    if need > fixed:
        raise ValueError(f"a row needs {need} {name} entries, more than the fixed width {fixed}")
    return fixed


# The sampler's compiled variants (``SamplingMetadata.variant``): "full" serves every batch, "greedy" the batches of
# greedy rows that ask for nothing else (on the CPU it compiles in a third of the time), "sampled" those that sample
# with temperature, min-p, top-k up to TOP_K_CAP and seeds (greedy rows beside them) and ask for nothing else: no
# top-p, whose nucleus can reach past the top TOP_K_CAP logits (a bisection then, under a conditional). Neither of
# these two has a conditional: on a GPU, XLA's conditional blocks the host until the device is idle (the jitted call
# then returns only when the step is done), so every common step is free of them there. "prompt" is "full" and the
# step's prompt logprobs (the runner's): where it is compiled (GPUs, TPUs), "full" leaves them out and both are
# branchless (``SamplingMetadata.branchless``): no conditional in any step.
GREEDY, SAMPLED, FULL, PROMPT = "greedy", "sampled", "full", "prompt"
VARIANTS = (GREEDY, SAMPLED, FULL, PROMPT)


def variants_for(platform: str) -> tuple[str, ...]:
    """The variants a runner compiles on ``platform``: on the CPU greedy and full, full skipping the work no row asks
    for under conditionals, prompt logprobs included (a conditional costs nothing there, and each variant more would
    lengthen every warm-up); on GPUs and TPUs all four, none with a conditional."""
    return (GREEDY, FULL) if platform == "cpu" else VARIANTS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling arrays for a batch of B rows (a pytree: every leaf an array, and the static ``variant``).

    Built on the host by ``from_params``; padding rows are greedy and neutral.
    """

    temperature: jax.Array  # [B] float32; < GREEDY_EPS means greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1 = off
    min_p: jax.Array  # [B] float32; 0 = off
    repetition_penalty: jax.Array  # [B] float32; 1 = off
    presence_penalty: jax.Array  # [B] float32; 0 = off
    frequency_penalty: jax.Array  # [B] float32; 0 = off
    seed: jax.Array  # [B, 2] uint32; threefry key data (hi, lo) of the 64-bit seed, = PRNGKey(seed)
    step: jax.Array  # [B] int32; folded into the key: the number of tokens the request generated so far
    num_logprobs: jax.Array  # [B] int32; top logprobs the row asks for (the top-K runs only if some row does)
    bias_ids: jax.Array  # [B, Nb] int32; pads are id 0 with value 0 (a no-op add)
    bias_values: jax.Array  # [B, Nb] float32; -inf bans a token (min_tokens)
    # [B, H] int32, PAD_ID padded: the prompt (rows with a repetition penalty) then the outputs (rows with any
    # penalty); the first num_prompt[i] entries of row i are prompt tokens.
    history: jax.Array
    num_prompt: jax.Array  # [B] int32
    # [B, W] int32 packed allowed tokens (bit t % 32 of word t // 32; tokens past 32 W are allowed): structured
    # outputs' grammar masks. All ones (-1) = no constraint; the unpacking runs only when some row has one.
    token_mask: jax.Array
    # Which of the sampler's programs runs (``VARIANTS``): static, so each is its own compile, chosen on the host by
    # ``from_params``. The default serves any batch.
    variant: str = dataclasses.field(default=FULL, metadata=dict(static=True))
    # Static too: the full variant computes every feature for every row (neutral where a row does not use it)
    # instead of skipping what no row asks for under ``lax.cond``; ``from_params`` sets it where the caller
    # compiled the "prompt" variant (GPU and TPU runners).
    branchless: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int | None] | None = None,
        steps: Sequence[int] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        *,
        pad_to: int | None = None,
        eos_token_ids: Sequence[int] = (),
        min_history: int = 16,
        min_bias: int = 4,
        history_width: int | None = None,
        bias_width: int | None = None,
        token_mask: np.ndarray | None = None,
        token_mask_width: int = 1,
        full: bool = False,
        variants: tuple[str, ...] = (GREEDY, FULL),
    ) -> SamplingMetadata:
        """Pack a batch of requests into padded numpy-backed arrays of bucketed or fixed shapes.

        Args:
            params: one ``SamplingParams`` per live row.
            seeds: per-row seed overriding ``params[i].seed`` (e.g. distinct seeds for the n children of a
                request). A row with neither gets a fresh random seed each call, so the engine should assign
                a seed per request once if it wants unseeded requests to be reproducible within a run.
            steps: per-row count of tokens generated so far (folded into the key; also gates min_tokens).
                Defaults to ``len(output_ids[i])``, or 0.
            prompt_ids, output_ids: per-row token histories, needed only by rows with penalties.
            pad_to: batch bucket; rows beyond ``len(params)`` are greedy padding. Defaults to ``len(params)``.
            eos_token_ids: banned, with ``stop_token_ids``, while a row has fewer than ``min_tokens`` outputs
                (EOS is not banned when ``ignore_eos``).
            min_history, min_bias: smallest buckets of the history and bias widths (powers of two).
            history_width, bias_width: fixed widths instead of buckets (the runner's: every step then has the
                same shapes). A batch that needs no history or bias gets shared constant arrays.
            token_mask: [len(params) or pad_to, W] int32 packed allowed-token masks (see ``token_mask``); rows
                past it are unconstrained. None: no row is constrained (a shared constant [B, token_mask_width]
                of ones).
            full: the ``"full"`` variant whatever the rows ask (the runner's steps with prompt logprobs), or
                ``"prompt"`` where it is among ``variants``.
            variants: the variants the caller compiled (``variants_for``); the batch gets the leanest that serves it.
                With ``"prompt"`` among them the batch is branchless.

        The variant is ``"greedy"`` when every row is greedy (temperature < GREEDY_EPS) with no logit bias (nor
        ``min_tokens`` ban), no penalty, no constraining token mask and no top logprobs; ``"sampled"`` (where it is
        among ``variants``) when some rows sample but none asks for any of those; ``"full"`` otherwise.

        Raises:
            ValueError: ``pad_to`` is smaller than the batch, a per-row list has the wrong length, or a row
                needs more than a fixed width.
        """
        n = len(params)
        b = n if pad_to is None else pad_to
        if b < n or b < 1:
            raise ValueError(f"pad_to must be >= len(params) ({n}) and >= 1, got {pad_to!r}")
        for name, seq in (("seeds", seeds), ("steps", steps), ("prompt_ids", prompt_ids), ("output_ids", output_ids)):
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name} must have one entry per row ({n}), got {len(seq)}")
        if steps is None:
            steps = [len(output_ids[i]) for i in range(n)] if output_ids is not None else [0] * n

        temperature = np.zeros(b, np.float32)
        top_k, step = np.zeros(b, np.int32), np.zeros(b, np.int32)
        top_p, min_p = np.ones(b, np.float32), np.zeros(b, np.float32)
        rep, pres, freq = np.ones(b, np.float32), np.zeros(b, np.float32), np.zeros(b, np.float32)
        seed, num_logprobs, num_prompt = np.zeros((b, 2), np.uint32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        biases: list[list[tuple[int, float]]] = [[] for _ in range(b)]
        prompts: list[Sequence[int]] = [()] * b
        outputs: list[Sequence[int]] = [()] * b
        for i, p in enumerate(params):
            temperature[i], top_k[i], top_p[i], min_p[i] = (
                min(p.temperature, _F32_MAX),
                max(p.top_k, 0),
                p.top_p,
                p.min_p,
            )
            rep[i], pres[i], freq[i] = _f32_positive(p.repetition_penalty), p.presence_penalty, p.frequency_penalty
            step[i], num_logprobs[i] = steps[i], p.logprobs or 0
            s = seeds[i] if seeds is not None and seeds[i] is not None else p.seed
            if s is None:
                s = int(np.random.default_rng().integers(0, 2**63))
            s = int(s) & ((1 << 64) - 1)
            seed[i] = (s >> 32, s & 0xFFFFFFFF)
            biases[i] = list((p.logit_bias or {}).items())
            if steps[i] < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                biases[i] += [(t, -np.inf) for t in dict.fromkeys(banned)]
            if p.repetition_penalty != 1.0 and prompt_ids is not None:
                prompts[i] = prompt_ids[i]
                num_prompt[i] = len(prompts[i])
            if p.penalized and output_ids is not None:
                outputs[i] = output_ids[i]

        nb = _width("bias", max(map(len, biases)), bias_width, min_bias)
        if any(biases):
            bias_ids, bias_values = np.zeros((b, nb), np.int32), np.zeros((b, nb), np.float32)
            for i, pairs in enumerate(biases):
                if pairs:
                    bias_ids[i, : len(pairs)], bias_values[i, : len(pairs)] = zip(*pairs)
        else:
            bias_ids, bias_values = _constant((b, nb), "int32", 0), _constant((b, nb), "float32", 0.0)

        lengths = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        h = _width("history", max(lengths), history_width, min_history)
        if any(lengths):
            history = np.full((b, h), PAD_ID, np.int32)
            for i, (ids, out) in enumerate(zip(prompts, outputs)):
                history[i, : len(ids)] = ids
                history[i, len(ids) : lengths[i]] = out
        else:
            history = _constant((b, h), "int32", PAD_ID)

        if token_mask is None:
            mask = _constant((b, token_mask_width), "int32", -1)
        else:
            if token_mask.ndim != 2 or token_mask.shape[0] > b:
                raise ValueError(f"token_mask must be [rows <= {b}, W], got shape {token_mask.shape}")
            mask = np.full((b, token_mask.shape[1]), -1, np.int32)
            mask[: len(token_mask)] = token_mask
        extras = (
            full
            or any(biases)
            or np.any((rep != 1.0) | (pres != 0.0) | (freq != 0.0))
            or (token_mask is not None and np.any(mask != -1))
            or np.any(num_logprobs > 0)
        )
        sampled = temperature >= GREEDY_EPS
        wide = np.any(sampled & ((top_p < 1.0) | (top_k > TOP_K_CAP)))  # a nucleus or a top-k past the cap
        if full and PROMPT in variants:
            variant = PROMPT
        elif extras or (np.any(sampled) and (SAMPLED not in variants or wide)):
            variant = FULL
        else:
            variant = SAMPLED if np.any(sampled) else GREEDY
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
            presence_penalty=pres, frequency_penalty=freq, seed=seed, step=step, num_logprobs=num_logprobs,
            bias_ids=bias_ids, bias_values=bias_values, history=history, num_prompt=num_prompt, token_mask=mask,
            variant=variant, branchless=PROMPT in variants,
        )  # fmt: skip


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32; log-softmax of the raw logits at the chosen token
    top_logprob_ids: jax.Array  # [B, K] int32; the K most likely tokens under the raw logits
    top_logprobs: jax.Array  # [B, K] float32


def _cond(branchless: bool, pred, true_fn, false_fn, *operands):
    """``lax.cond(pred, true_fn, false_fn, *operands)``, or ``true_fn`` alone in a branchless batch. Every use below
    skips work whose result equals ``false_fn``'s wherever ``pred`` is false (a zero bias added, a neutral penalty,
    an all-ones mask, filters off): computing it anyway changes no token."""
    if branchless:
        return true_fn(*operands)
    return jax.lax.cond(pred, true_fn, false_fn, *operands)


def _apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """vLLM's penalties: repetition on tokens seen in prompt or output; presence/frequency on output counts."""
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]  # [B, 1]
    in_output = jnp.arange(meta.history.shape[1])[None, :] >= meta.num_prompt[:, None]  # [B, H]
    # Pads and the other part point one past the vocabulary so mode="drop" discards them (negative ids
    # would wrap instead).
    ids = jnp.where(meta.history < 0, v, meta.history)  # [B, H]
    out_ids, prompt_ids = jnp.where(in_output, ids, v), jnp.where(in_output, v, ids)
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, out_ids].add(1.0, mode="drop")  # [B, V]
    in_prompt = jnp.zeros((b, v), jnp.bool_).at[rows, prompt_ids].set(True, mode="drop")  # [B, V]
    seen = in_prompt | (out_counts > 0)
    rep = meta.repetition_penalty[:, None]
    out = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    out = out - meta.frequency_penalty[:, None] * out_counts - meta.presence_penalty[:, None] * (out_counts > 0)
    # Extreme penalties can overflow (or make 0 * inf = nan): every token not already banned stays finite, so
    # the bans and the grammar's mask still decide what may be drawn.
    big = jnp.finfo(jnp.float32).max
    return jnp.where(jnp.isneginf(logits), -jnp.inf, jnp.clip(jnp.nan_to_num(out, nan=-big), -big, big))


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, branchless: bool = False) -> jax.Array:
    """Mask to -inf every token outside the row's top-k, then outside the top-p nucleus of what is left.

    top_k: [B] int32 in [1, V] (V = off); top_p: [B] float32 (1 = off). Tokens are kept by threshold, so only
    sorted values are needed, and ties at the threshold are all kept (as in vLLM's top-k). The values come
    from ``lax.top_k`` with the static cap TOP_K_CAP, which is exact for rows with top_k <= cap and for
    top-p rows whose nucleus ends inside the top cap (the usual, peaked case); only when some row is not
    covered does the threshold come from a search over the whole vocabulary (``_threshold_by_search``:
    no sort, whose TPU compile took 10 of a step's 25 s). ``branchless`` (GPUs and TPUs): both always computed, the
    search's taken when some row needs it, as the conditional does; its two searches then take 15 candidates a pass
    (16 passes over the rows in all, where bisecting took 64: those chips are bound by memory, the CPU by arithmetic).
    """
    v = logits.shape[-1]
    cap = min(TOP_K_CAP, v)
    off = (top_k >= v) & (top_p >= 1.0)  # [B]

    def threshold(sorted_desc, lse_all):  # [B, W] the W largest logits, descending
        w = sorted_desc.shape[-1]
        in_k = jnp.arange(w)[None, :] < top_k[:, None]  # [B, W]
        masked = jnp.where(in_k, sorted_desc, -jnp.inf)
        # Top-p acts on the top-k distribution renormalized (as in vLLM); with top-k off that is the whole
        # vocabulary, which a truncated W < V does not hold, so normalize by the full logsumexp.
        lse = jnp.where((top_k <= w)[:, None], jax.nn.logsumexp(masked, -1, keepdims=True), lse_all)  # [B, 1]
        probs = jnp.exp(masked - lse)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, W]
        keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))  # a prefix, never empty
        n_keep = jnp.maximum(keep.sum(-1), 1)  # [B]
        thresh = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)  # [B, 1] smallest kept
        exact = off | (top_k <= w) | ((top_k >= v) & (n_keep < w))  # [B] the true threshold is inside W
        return jnp.where(off[:, None], -jnp.inf, thresh), exact

    def apply(x):
        lse_all = jax.nn.logsumexp(x, axis=-1, keepdims=True)  # [B, 1]
        thresh, exact = threshold(jax.lax.top_k(x, cap)[0], lse_all)
        if cap < v:
            ways = 16 if branchless else 2
            full = lambda: jnp.where(off[:, None], -jnp.inf, _threshold_by_search(x, top_k, top_p, lse_all, ways))  # noqa: E731
            thresh = (
                jnp.where(jnp.all(exact), thresh, full())
                if branchless
                else jax.lax.cond(jnp.all(exact), lambda: thresh, full)
            )
        return jnp.where(x >= thresh, x, -jnp.inf)

    return _cond(branchless, jnp.any(~off), apply, lambda x: x, logits)


def _smallest_value_where(x: jax.Array, pred, ways: int = 2) -> jax.Array:
    """[B, 1]: per row, the smallest value c of x with ``pred(c)`` true, for a ``pred`` that holds on an upper set of
    values and changes only at values of x (true at the row's maximum). A search over the 2^32 ordered float keys,
    exact: each pass evaluates ``pred`` at ``ways - 1`` candidates [B, ways - 1] spread over what is left (one pass
    over the row for all of them) and keeps the part between the last false and the first true; 32 / log2(ways)
    passes (2: a bisection, 32 passes; 16: 8 passes of 15 candidates)."""
    if ways not in _SEARCH_PASSES:
        raise ValueError(f"ways must be one of {sorted(_SEARCH_PASSES)}, got {ways}")
    # unsigned keys (the sign bit flipped): one order, and a span hi - lo of up to 2^32 - 1 without overflow
    lo = _unsigned_key(jnp.min(x, axis=-1, keepdims=True))
    hi = _unsigned_key(jnp.max(x, axis=-1, keepdims=True))
    k = ways - 1
    j = jnp.arange(1, ways, dtype=jnp.uint32)[None, :]  # [1, K]

    def step(_, bounds):
        lo, hi = bounds  # [B, 1]: the answer is in [lo, hi], pred(hi) holds
        span = hi - lo
        candidates = lo + (span // ways) * j + ((span % ways) * j) // ways  # lo + floor(span j / ways), ascending
        below = (~pred(_unsigned_float(candidates))).sum(-1, keepdims=True)  # [B, 1] candidates left of the answer
        if k == 1:  # a bisection: the one candidate is both
            return jnp.where(below > 0, candidates + 1, lo), jnp.where(below > 0, hi, candidates)
        last_false = jnp.take_along_axis(candidates, jnp.maximum(below - 1, 0), axis=-1)
        first_true = jnp.take_along_axis(candidates, jnp.minimum(below, k - 1), axis=-1)
        return jnp.where(below > 0, last_false + 1, lo), jnp.where(below < k, first_true, hi)

    return _unsigned_float(jax.lax.fori_loop(0, _SEARCH_PASSES[ways], step, (lo, hi))[1])


# Passes of ``_smallest_value_where`` over the 2^32 keys by its ways: the span after a pass is at most
# ceil(span / ways) - 1, so from 2^32 - 1 (ways^n - 1) to 0 in n passes.
_SEARCH_PASSES = {2: 32, 4: 16, 16: 8}
_SIGN = np.uint32(0x80000000)


def _unsigned_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order: a negative float's bits all flipped, a positive one's sign bit set."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _unsigned_float(key: jax.Array) -> jax.Array:
    """The inverse of ``_unsigned_key``."""
    return jax.lax.bitcast_convert_type(jnp.where(key >= _SIGN, key ^ _SIGN, ~key), jnp.float32)


def _threshold_by_search(
    x: jax.Array, top_k: jax.Array, top_p: jax.Array, lse_all: jax.Array, ways: int = 2
) -> jax.Array:
    """[B, 1] the smallest kept logit of each row under top-k then top-p, as the sorted computation defines it
    (the value at index n_keep - 1 of the row sorted descending), without a sort. With G(c) the count of logits
    above c and M(c) their top-k probability mass, that value is the smallest logit c with G(c) < top_k and
    M(c) < top_p; both predicates hold on an upper set, so a search finds it (``_smallest_value_where``, ``ways``:
    candidates of a pass plus one)."""
    k = top_k[:, None]
    above = lambda c: x > c  # noqa: E731  c [B, 1]

    def total_above(c, w=None):  # c [B, K] candidates -> [B, K]: the count (or the sum of w [B, V]) of logits above
        if c.shape[-1] == 1:  # one candidate (a bisection): no candidate axis
            return above(c).sum(-1, keepdims=True) if w is None else jnp.where(above(c), w, 0.0).sum(-1, keepdims=True)
        over = x[:, None, :] > c[..., None]  # [B, K, V]
        return over.sum(-1) if w is None else jnp.where(over, w[:, None, :], 0.0).sum(-1)

    t_k = _smallest_value_where(x, lambda c: total_above(c) < k, ways)  # the k-th largest logit
    # The top-k distribution's normalizer: the logits above t_k plus as many copies of t_k as complete k.
    mx = jnp.max(x, axis=-1, keepdims=True)
    n_above = above(t_k).sum(-1, keepdims=True)
    total = jnp.where(above(t_k), jnp.exp(x - mx), 0.0).sum(-1, keepdims=True) + (k - n_above) * jnp.exp(t_k - mx)
    lse = jnp.where(k >= x.shape[-1], lse_all, mx + jnp.log(total))
    probs = jnp.exp(x - lse)  # [B, V], once: each pass reads it, no exponential per candidate

    def nucleus(c):  # G(c) < top_k is c >= t_k: t_k is the smallest value where it holds
        return (c >= t_k) & (total_above(c, probs) < top_p[:, None])

    return jnp.where(top_p[:, None] >= 1.0, t_k, _smallest_value_where(x, nucleus, ways))


def _apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """-inf on every token whose bit in the packed [B, W] mask is 0 (tokens past 32 W stay)."""
    b, v = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(b, -1)[:, :v] != 0  # [B, min(32 W, V)]
    if allowed.shape[1] < v:
        allowed = jnp.pad(allowed, ((0, 0), (0, v - allowed.shape[1])), constant_values=True)
    return jnp.where(allowed, logits, -jnp.inf)


def _process(logits: jax.Array, meta: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """Logits to draw from, and the greedy mask. Greedy rows get the biased, penalized logits unfiltered.

    The ``"full"`` variant skips the work no row asks for at run time (``lax.cond``), or, branchless, does it all;
    ``"greedy"`` (no row asks for any) returns the logits as they are."""
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    greedy = meta.temperature < GREEDY_EPS  # [B]
    if meta.variant == GREEDY:
        return logits, greedy
    if meta.variant == SAMPLED:  # nothing to bias, penalize or mask; greedy rows pass the filters unchanged
        return _filtered(logits, meta, greedy, capped=True), greedy
    rows = jnp.arange(b)[:, None]
    biased = jnp.any(meta.bias_values != 0.0)  # a scatter over [B, V] only when some row has a bias
    cond = functools.partial(_cond, meta.branchless)
    logits = cond(biased, lambda x: x.at[rows, meta.bias_ids].add(meta.bias_values, mode="drop"), lambda x: x, logits)
    penalized = (meta.repetition_penalty != 1.0) | (meta.presence_penalty != 0.0) | (meta.frequency_penalty != 0.0)
    logits = cond(jnp.any(penalized), _apply_penalties, lambda x, _: x, logits, meta)
    constrained = jnp.any(meta.token_mask != -1)  # structured outputs: only then is the mask unpacked
    logits = cond(constrained, _apply_token_mask, lambda x, _: x, logits, meta.token_mask)

    filtered = functools.partial(_filtered, meta=meta, greedy=greedy)
    return cond(jnp.any(~greedy), filtered, lambda x: x, logits), greedy


def _filtered(x: jax.Array, meta: SamplingMetadata, greedy: jax.Array, capped: bool = False) -> jax.Array:
    """Temperature, min-p, top-k and top-p on the sampled rows (greedy rows unchanged). ``capped``: no row has top-p
    or a top-k past TOP_K_CAP (the "sampled" variant), so the top-k threshold is one ``lax.top_k`` and no
    conditional."""
    v = x.shape[-1]
    # Banned tokens stay -inf: a huge temperature's reciprocal flushes to 0, and -inf * 0 is nan.
    x = jnp.where(x == -jnp.inf, x, x / jnp.where(greedy, 1.0, meta.temperature)[:, None])
    # min-p: keep p >= min_p * p_max, i.e. logit >= max logit + log(min_p); log(0) = -inf keeps all.
    log_min_p = jnp.log(jnp.where(greedy, 0.0, meta.min_p))[:, None]
    x = jnp.where(x >= x.max(-1, keepdims=True) + log_min_p, x, -jnp.inf)
    top_k = jnp.where(greedy | (meta.top_k <= 0), v, jnp.minimum(meta.top_k, v))
    if capped:
        cap = min(TOP_K_CAP, v)
        kth = jnp.take_along_axis(jax.lax.top_k(x, cap)[0], jnp.minimum(top_k, cap)[:, None] - 1, axis=-1)  # [B, 1]
        return jnp.where((top_k[:, None] >= v) | (x >= kth), x, -jnp.inf)  # ties at the k-th all kept, as above
    return _top_k_top_p(x, top_k, jnp.where(greedy, 1.0, meta.top_p), meta.branchless)


@jax.jit
def process_logits(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """The logits ``sample`` draws from: [B, V] float32, -inf for every filtered-out token.

    Sampled rows are biased, penalized, divided by temperature and filtered (min-p, top-k, top-p); greedy
    rows are biased and penalized only. Useful for tests and for rejection sampling.
    """
    return _process(logits, meta)[0]


def _top_logprobs(logits: jax.Array, tokens: jax.Array, k: int, wanted: jax.Array | bool | None = None):
    """Chosen tokens' logprobs [T] and the top-k [T, K]; the top-k runs only when ``wanted`` (zeros else: False
    leaves it out of the program, an array skips it at run time)."""
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [T, 1]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]  # [T]
    n, k = logits.shape[0], min(k, logits.shape[-1])

    def top(x):
        top_values, top_ids = jax.lax.top_k(x, k)  # [T, K]
        return top_ids.astype(jnp.int32), top_values - lse

    def skipped(_):
        return jnp.zeros((n, k), jnp.int32), jnp.zeros((n, k), jnp.float32)

    if k == 0 or wanted is False:
        return (chosen, *skipped(logits))
    if wanted is None:
        return (chosen, *top(logits))
    return (chosen, *jax.lax.cond(wanted, top, skipped, logits))


def argmax_rows(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` as two plain reductions (the row's max, then the first position holding it): XLA:CPU
    runs argmax's paired (value, index) reduction element by element, 3.5-6x slower (7.4 ms for 64 rows of
    SmolLM2's 49,152 logits, against 2.1). Ties go to the first position, as argmax; in a row with a NaN the result
    is the first position holding a NaN or the row's largest number (argmax: the first NaN). [..., V] -> [...]
    int32."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where((x == top) | jnp.isnan(x), _positions(x), x.shape[-1]), axis=-1)


def _positions(x: jax.Array) -> jax.Array:
    """Each element's position along the last axis (int32, x's shape)."""
    return jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)


@functools.partial(jax.jit, static_argnames=("max_logprobs",))
def sample(logits: jax.Array, meta: SamplingMetadata, max_logprobs: int = MAX_LOGPROBS) -> SamplerOutput:
    """Draw one token per row.

    Args:
        logits: [B, V] model logits (cast to float32).
        meta: the batch's ``SamplingMetadata`` with B rows.
        max_logprobs: static K of the top-logprob outputs, capped at V (0 skips them; the host slices
            per request). The top-K runs only when some row's ``num_logprobs`` is positive (zeros else; a
            branchless batch always runs it), which only ``meta``'s ``"full"`` and ``"prompt"`` variants compute
            (the others return zeros).

    Returns:
        ``SamplerOutput`` with tokens [B], their raw logprobs [B] and the top-K raw logprobs [B, K].
    """
    logits = logits.astype(jnp.float32)
    processed, greedy = _process(logits, meta)
    argmax = argmax_rows(processed)  # [B]

    def draw(x):
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.wrap_key_data(s, impl="threefry2x32"), t))(
            meta.seed, meta.step
        )  # [B] keys: a row's draw depends only on its own seed, step and logits
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)  # [B]
        return jnp.where(greedy, argmax, drawn)

    if meta.variant in (GREEDY, SAMPLED):
        # Reductions only (no gather by token id), so that logits sharded over the vocabulary stay in their shards
        # (the sampled variant's top-k too: XLA partitions it, each chip's top candidates then the whole's).
        tokens = argmax if meta.variant == GREEDY else draw(processed)
        chosen = jnp.sum(jnp.where(_positions(logits) == tokens[:, None], logits, 0.0), axis=-1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        no_top = jnp.zeros((logits.shape[0], min(max_logprobs, logits.shape[-1])))  # none asked
        return SamplerOutput(tokens, chosen - lse, no_top.astype(jnp.int32), no_top)
    tokens = _cond(meta.branchless, jnp.any(~greedy), draw, lambda _: argmax, processed)
    wanted = None if meta.branchless else jnp.any(meta.num_logprobs > 0)  # branchless: computed for every batch
    chosen, top_ids, top_values = _top_logprobs(logits, tokens, max_logprobs, wanted)
    return SamplerOutput(tokens=tokens, logprobs=chosen, top_logprob_ids=top_ids, top_logprobs=top_values)


@functools.partial(jax.jit, static_argnames=("max_logprobs",))
def compute_logprobs(
    logits: jax.Array, token_ids: jax.Array, max_logprobs: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of given tokens under raw logits (prompt_logprobs: logits at position t, token t + 1).

    Args:
        logits: [T, V] raw logits.
        token_ids: [T] int tokens to score.
        max_logprobs: static K of the top-logprob outputs.

    Returns:
        (logprobs [T] float32, top_ids [T, K] int32, top_logprobs [T, K] float32).
    """
    return _top_logprobs(logits.astype(jnp.float32), token_ids.astype(jnp.int32), max_logprobs)
