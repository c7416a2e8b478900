"""LLM: the offline batch API (``LLM().generate(prompts)``), shaped like vLLM's."""

from __future__ import annotations

import itertools
import numbers
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxserve.engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """Loads a model and generates for batches of prompts with continuous batching.

    Args:
        model: GGUF file, HF directory, orbax directory, preset name or hub id; None = the embedded default
            model (SmolLM2-135M-Instruct).
        **engine_kwargs: see ``LLMEngine`` (num_pages, page_size, max_num_seqs, max_num_batched_tokens,
            max_model_len, enable_prefix_caching, attention_impl, dtype, seed, ...).
    """

    def __init__(self, model: str | Path | None = None, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string or a list of token ids); outputs come back in prompt order.

        Under several processes (``jax.distributed``) every process calls this with the same arguments: process
        0 schedules and every process runs the steps; all return process 0's outputs (or raise its error).

        Raises:
            ValueError: a bad prompt or parameter; nothing is queued in that case.
        """
        return self.engine.lead_or_follow(self._generate, prompts, sampling_params, use_tqdm, priority)

    def _generate(self, prompts, sampling_params, use_tqdm, priority) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        self.engine.add_requests(zip(ids, prompts, params, priorities))  # all queued, or none
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt, tokenize=True,
                                               **template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, leave=False)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (a string, a list of token ids, a 1-D int array) or a list of them, as a list; the engine
    checks each prompt's type and contents."""
    if isinstance(prompts, (str, np.ndarray)) and np.ndim(prompts) < 2:
        return [prompts]
    if not isinstance(prompts, (list, tuple, np.ndarray)):
        raise ValueError(f"prompts must be a string, a list of token ids or a list of prompts, got "
                         f"{type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
