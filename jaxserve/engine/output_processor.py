"""Output processing: a step's sampled tokens become each request's text, logprobs and stops.

The engine hands every confirmed token to :meth:`OutputProcessor.append`, which feeds the request's grammar, its
incremental detokenizer and its stop strings, and :meth:`OutputProcessor.output` builds the ``RequestOutput`` that
streams back. Host code: no jax here.
"""

from __future__ import annotations

from jaxserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.core.request import RequestStatus
from jaxserve.engine.request_state import Sequence, TrackedRequest
from jaxserve.tokenizer import Tokenizer


class OutputProcessor:
    """Turns sampled tokens into text, logprobs and stops, with the model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def logprob_entry(self, tok) -> dict[int, Logprob]:
        """A sampled token's (or a prompt position's) logprob entry: the token first, then its top alternatives, each
        with its text."""
        entry = {tok.token_id: Logprob(tok.logprob, self.tokenizer.decode([tok.token_id], False))}
        for tid, lp in zip(tok.top_ids, tok.top_logprobs):
            entry.setdefault(tid, Logprob(lp, self.tokenizer.decode([tid], False)))
        return entry

    def append(self, tracked: TrackedRequest, seq: Sequence, tok, last: bool = True) -> bool:
        """Adds one sampled token to a sequence's text, logprobs and grammar; ``last``: the last of the step's
        tokens for it (only then can the scheduler have finished it). True if this token ended the sequence here
        (a stop string, or the grammar's end)."""
        params = seq.request.sampling_params
        req = seq.request
        finished_before = req.is_finished and last  # by the scheduler: a stop token, max_tokens, the model length
        if seq.logprobs is not None:
            seq.logprobs.append(self.logprob_entry(tok))
        seq.cumulative_logprob += tok.logprob
        stopped_by_token = finished_before and req.finish_reason == "stop"
        if stopped_by_token:
            if seq.matcher is not None:
                seq.matcher.check()  # a grammar past llguidance's limits allows only the end: not a finished output
            seq.stop_reason = tok.token_id if tok.token_id in (params.stop_token_ids or ()) else None
            return False  # the stop token's text is not part of the output
        ended = False
        if seq.matcher is not None:
            seq.matcher.advance(tok.token_id)
            if seq.matcher.done and not req.is_finished:  # the grammar is complete: nothing more may follow
                tracked.replica.scheduler.finish_request(req.request_id, "stop")
                req.status = RequestStatus.FINISHED_STOPPED
                ended = True
        seq.text += seq.detok.add(tok.token_id)
        if finished_before or ended:
            seq.text += seq.detok.flush()
        for stop in params.stop or ():
            # Only the tail can hold a new match: the new text plus len(stop) - 1 characters before it.
            at = seq.text.find(stop, max(0, len(seq.text) - len(stop) - 64))
            if at >= 0:
                seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                seq.stop_reason = stop
                tracked.replica.scheduler.finish_request(req.request_id, "stop")
                req.status = RequestStatus.FINISHED_STOPPED
                ended = True
                break
        return ended

    def output(self, tracked: TrackedRequest) -> RequestOutput:
        """The request's output so far: each sequence's text (less what may still become a stop string), tokens and
        logprobs, and the prompt logprobs."""
        outs = []
        hold = max((len(s) for s in tracked.params.stop or ()), default=1) - 1
        for seq in tracked.seqs:
            req = seq.request
            text = seq.text
            if not req.is_finished and hold:
                text = text[: max(0, len(text) - hold)]  # a stop string may still be forming
            outs.append(
                CompletionOutput(
                    seq.index,
                    text,
                    list(req.output_token_ids),
                    seq.cumulative_logprob if seq.logprobs is not None else None,
                    seq.logprobs,
                    req.finish_reason,
                    seq.stop_reason,
                )
            )
        finished = all(s.request.is_finished for s in tracked.seqs) and not tracked.pending_forks
        return RequestOutput(
            tracked.request_id,
            tracked.prompt,
            tracked.prompt_token_ids,
            outs,
            finished,
            tracked.seqs[0].request.num_cached_tokens,
            self.prompt_logprobs(tracked),
        )

    def prompt_logprobs(self, tracked: TrackedRequest) -> list[dict[int, Logprob] | None] | None:
        """Per prompt position (the first: None) the logprob entry of its token, as the steps computed them."""
        if tracked.params.prompt_logprobs is None:
            return None
        entries = tracked.prompt_logprobs
        out: list[dict[int, Logprob] | None] = [None]
        for pos in range(1, len(tracked.prompt_token_ids)):
            e = entries.get(pos)
            out.append(None if e is None else self.logprob_entry(e))
        return out
