"""Input processing: a request as a client sent it becomes the engine's, validated, before anything is queued.

:meth:`InputProcessor.prepare` checks the id, the prompt (text is tokenized; token ids must be in the vocabulary
and fit the model length), the sampling parameters against the model (logit bias and stop ids in the vocabulary,
``n`` within the pool) and the grammar, and builds one ``Request`` per sequence, each with its own seed. A bad
request is a ``ValueError`` naming the request and what is wrong; nothing is queued. Host code: no jax here.
"""

from __future__ import annotations

import dataclasses
import numbers
import random
from collections.abc import Callable

import numpy as np

from jaxserve.core.request import Request, check_prompt, out_of_vocabulary
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.request_state import Sequence, TrackedRequest
from jaxserve.sampling.structured import StructuredOutputs
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer


def is_token_id(t) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


class InputProcessor:
    """Validates and builds requests for one model.

    Args:
        tokenizer: the model's.
        vocab_size, max_model_len: the model's vocabulary and the longest prompt + output.
        num_pages: the KV pool's pages (each of ``n`` sequences needs one).
        structured: the grammar compiler for structured outputs.
        eos_token_ids: the model's end-of-sequence tokens, for each request.
        seed: seeds the per-request seeds of requests that give none.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        num_pages: int,
        structured: StructuredOutputs,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
    ):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.num_pages, self.structured, self.eos_token_ids = num_pages, structured, eos_token_ids
        self._rng = random.Random(seed)

    def prepare(
        self,
        request_id: str,
        prompt,
        sampling_params: SamplingParams | None,
        priority: int = 0,
        *,
        arrival_time: float | None,
        taken: set[str],
        in_use: Callable[[str], bool],
    ) -> TrackedRequest:
        """One request, validated and built, not queued; its ids are added to ``taken``.

        Raises:
            ValueError: a bad id (empty, or ``in_use`` / taken, its children's too), prompt, parameter or grammar,
                naming the request and what is wrong.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"a request id must be a non-empty string, got {request_id!r}")
        where = f"request {request_id!r}"
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not is_token_id(priority):
            raise ValueError(f"{where}: priority must be an int, got {priority!r}")
        ids = [request_id] + ([f"{request_id}#{i}" for i in range(params.n)] if params.n > 1 else [])
        for rid in ids:  # children's ids too: "x#1" and "x" with n=2 would share a sequence id
            if in_use(rid) or rid in taken:
                raise ValueError(
                    f"request id {request_id!r} is already in use"
                    if rid == request_id
                    else f"{where}: its sequence id {rid!r} (n={params.n}) is already in use"
                )
        prompt_text, prompt_ids = self.prompt_ids(where, prompt)
        vocab, max_len = self.vocab_size, self.max_model_len
        try:
            check_prompt(prompt_ids, vocab, max_len)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for name, toks in (("logit_bias", list(params.logit_bias or ())), ("stop_token_ids", params.stop_token_ids)):
            bad = out_of_vocabulary(toks, vocab)
            if bad:
                raise ValueError(
                    f"{where}: SamplingParams.{name} has token ids {bad} outside the vocabulary [0, {vocab})"
                )
        if params.n > self.num_pages:
            raise ValueError(
                f"{where}: SamplingParams.n={params.n} sequences cannot each hold a page of the "
                f"{self.num_pages}-page KV pool"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(prompt_ids)
        so = params.structured_outputs
        matchers = [None] * params.n
        if so is not None:
            try:
                matchers = self.structured.matchers(so, params.n)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        tracked = TrackedRequest(request_id, prompt_text, prompt_ids, params, [], [])
        for i in range(params.n):
            child_params = dataclasses.replace(
                params, n=1, max_tokens=max_tokens, seed=base_seed if i == 0 else hash((base_seed, i)) & (2**63 - 1)
            )
            req = Request(
                ids[i + 1] if params.n > 1 else request_id,
                prompt_ids,
                child_params,
                self.eos_token_ids,
                arrival_time,
                int(priority),
            )
            seq = Sequence(
                i,
                req,
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                matcher=matchers[i],
            )
            tracked.seqs.append(seq)
        taken.update(ids)
        return tracked

    def prompt_ids(self, where: str, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, or token ids as a list, tuple or 1-D int array (their
        values are checked by ``check_prompt``)."""
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except ValueError as e:  # not valid Unicode
                raise ValueError(f"{where}: the prompt is {str(e).removeprefix('the text is ')}") from None
        elif isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)) and all(is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            got = (
                f"an array of {prompt.dtype} with shape {prompt.shape}"
                if isinstance(prompt, np.ndarray)
                else f"a {type(prompt).__name__} holding {sorted({type(t).__name__ for t in prompt})}"
                if isinstance(prompt, (list, tuple))
                else f"a {type(prompt).__name__}"
            )
            raise ValueError(f"{where}: the prompt must be a string or a list of int token ids, got {got}")
        return (prompt if isinstance(prompt, str) else None), ids
