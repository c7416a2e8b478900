"""LLM: the offline batch API (``LLM().generate(prompts)``), shaped like vLLM's."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """Loads a model and generates for batches of prompts with continuous batching (an ``LLMEngine`` stepped
    until every prompt of a call is done).

    Args:
        model: GGUF file, HF directory, orbax directory (``jaxserve convert``), preset name (``configs/``) or
            Hugging Face hub id; a ``jaxserve.loading.LoadedModel`` already in memory; None = the embedded default
            model (SmolLM2-135M-Instruct).
        **engine_kwargs: the engine's settings, fields of ``jaxserve.config.EngineConfig`` (``max_num_seqs``,
            ``max_model_len``, ``dtype``, ``attention_impl`` ("auto", "xla", "reference", "pallas", "pallas-tpu"),
            ``quantization``, ``tensor_parallel_size`` ...), or ``config=EngineConfig(...)``; see ``LLMEngine``.

    Raises:
        TypeError: an unknown engine setting.
        ValueError: a bad setting, or a parallel layout the devices or the model cannot take.
        FileNotFoundError: the model cannot be found (or fetched from the hub).
    """

    def __init__(self, model: str | Path | None = None, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        """The model's ``jaxserve.tokenizer.Tokenizer`` (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in prompt order, each once finished.

        Under several processes (``jax.distributed``) every process calls this with the same arguments: process
        0 schedules and every process runs the steps; all return process 0's outputs (or raise its error).

        Args:
            prompts: one prompt or a list of them; a prompt is a string or token ids (a list of ints or a 1-D
                integer numpy array).
            sampling_params: one ``SamplingParams`` for every prompt, or one per prompt; None = the defaults.
            use_tqdm: show a progress bar.
            priority: one int per prompt (lower first) under ``policy="priority"``; None = all 0.

        Returns:
            One ``RequestOutput`` per prompt, with ``n`` ``CompletionOutput``s each.

        Raises:
            ValueError: a bad prompt or parameter, or a prompt that leaves no room to generate within
                ``max_model_len``; nothing is queued in that case.
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
        """Renders each conversation with the model's chat template, then generates (as ``generate``).

        Args:
            messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them.
            sampling_params: as in ``generate``.
            use_tqdm: show a progress bar.
            add_generation_prompt: end the rendered prompt with the assistant turn's header.
            **template_kwargs: passed to the chat template (e.g. ``tools=[...]``).

        Returns:
            One ``RequestOutput`` per conversation.

        Raises:
            ValueError: as ``generate``, or the model has no chat template.
            jinja2.TemplateError: the template refused a conversation (e.g. a bad order of roles).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                list(c), add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
            )
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
        raise ValueError(
            f"prompts must be a string, a list of token ids or a list of prompts, got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
