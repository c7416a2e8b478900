"""Speculative decoding: n-gram (prompt lookup) proposals, and the verification of a step's guesses.

A decoding sequence whose recent tokens occurred before in its prompt or output probably goes on as it did then
(code, quotes, lists, retrieval answers). Its next token is computed together with up to k proposed tokens, as one
ragged chunk of the same jitted step: the step samples after every position of the chunk, with each position's own
per-request draw (``fold_in(key(seed), output index)``, the draw plain decoding makes there). Row 0 is the token
plain decoding would emit next; row j is the one it would emit after proposal j if the proposals before it were
right. So the sequence keeps row 0, then row j for as long as proposal j equals row j - 1's token: the output is
the one plain decoding gives, token for token, greedy or sampled with a seed. (For a proposal that is a single
token, accepting it when an exact draw of the target equals it accepts with probability p(token), what rejection
sampling would; so sampled outputs keep the target distribution, not an approximation of it.)

The KV the step wrote for rejected proposals sits past the sequence's computed length and is overwritten when it
moves on (the scheduler counts only accepted positions as computed); prefix-cache pages are registered from
accepted tokens only.

Not speculated (they decode one token a step, unchanged): sequences with repetition / presence / frequency
penalties (the penalty of row j would need the proposals in its history) and sequences under a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PLACEHOLDER = -1  # a token the scheduler reserves for a draft model's proposal, before it is made


def propose_ngram(tokens: Sequence[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of ``tokens``, for the
    longest n in ``[n_min, n_max]`` that occurred before; [] when none did."""
    if k <= 0 or len(tokens) < n_min + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        # windows starting at 0 .. len - n - 1: every occurrence but the suffix itself, each with a follower
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def accepted(proposed: Sequence[int], sampled: Sequence[int]) -> int:
    """How many proposals the step's samples confirm: ``sampled[j]`` (the token after proposal j's position)
    verifies ``proposed[j]`` until the first mismatch. The sequence then emits ``sampled[:accepted + 1]``."""
    a = 0
    while a < len(proposed) and sampled[a] == proposed[a]:
        a += 1
    return a


def speculates(params) -> bool:
    """Whether a request's sampling parameters allow proposals (see the module docstring)."""
    return not params.penalized and params.structured_outputs is None
