"""Sampled tokens in, finish decisions and RequestOutputs out.

`append(seq, token, logprob, now)` adds one token to a completion and says whether it ended it:

    "stop"    the token is an end-of-sequence id (unless ignore_eos) or one of stop_token_ids (both kept
              in token_ids), or the text now contains a stop string (the text is cut before it)
    "length"  max_tokens generated, or max_model_len reached

`request_output(group)` builds what the caller sees: the final outputs of a finished request, or, for a
streamed request, the cumulative outputs with the delta since the last call. Text is only computed
where someone looks at it: incrementally (pagedattn.engine.detokenizer) for streamed requests and for
requests with stop strings, once at the end for the others.

With `deltas_only=True` (the engine core, which ships token ids to another process and keeps no text) the
streamed requests still running get rows of one StepDeltas per step instead (`delta`, `deltas`): per
completion the ids the step added, their log-probabilities, the cumulative logprob and the finish reason;
nothing cumulative is copied and no output object is built per request, so a step costs the same at the
thousandth token as at the first. Final outputs are complete RequestOutputs either way.
"""
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.metrics import request_metrics
from pagedattn.engine.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    """tokenizer: HF tokenizer or None (token ids only); eos_token_ids: set of ids; max_model_len: int;
    deltas_only: streamed progress as deltas alone (see the module docstring)."""

    def __init__(self, tokenizer, eos_token_ids, max_model_len, deltas_only=False):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.deltas_only = deltas_only

    def init_sequence(self, seq, stream):
        """Set up a new completion's text tracking (streamed or with stop strings: incremental)."""
        p = seq.params
        if self.tokenizer is not None and (stream or p.stop):
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, p.stop)
            for t in seq.output_token_ids:                 # a fork starts with its parent's tokens
                seq.detokenizer.add(t)
        if p.logprobs and seq.token_logprobs is None:
            seq.token_logprobs = []

    def append(self, seq, token, logprob, now):
        """Add one sampled token to `seq`; returns its finish reason or None."""
        p = seq.params
        seq.append_token(token, now)
        if seq.token_logprobs is not None:
            seq.token_logprobs.append(float(logprob))
        seq.cumulative_logprob += float(logprob)
        stopped = seq.detokenizer.add(token) if seq.detokenizer is not None else False
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids or stopped:
            return "stop"
        known = len(seq.token_ids)                       # (a later token may already be in flight)
        if known - seq.num_prompt_tokens >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None

    def is_last_token(self, seq):
        """Will the token `seq` samples next (output position num_output_tokens) end it by length?"""
        return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def finish_text(self, seq):
        """The completion's final text (set once it finished)."""
        if seq.detokenizer is not None:
            return seq.detokenizer.finish()
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)

    @staticmethod
    def delta(seq):
        """StepDeltas' row of a streamed completion: (request_id, index, new token ids, their logprobs or None,
        cumulative logprob, finish reason), what it added since the last call, without its cumulative lists."""
        sent = seq.num_sent_tokens
        ids = seq.token_ids[seq.num_prompt_tokens + sent:]
        seq.num_sent_tokens = sent + len(ids)
        lps = None if seq.token_logprobs is None else seq.token_logprobs[sent:]
        return seq.request_id, seq.index, ids, lps, seq.cumulative_logprob, seq.finish_reason

    def _completion(self, seq, stream):
        finished = seq.is_finished
        if finished and seq.text is None:
            seq.text = self.finish_text(seq)
        if finished:
            text = seq.text
        elif seq.detokenizer is not None:
            text = seq.detokenizer.releasable
        else:
            text = ""
        ids = seq.output_token_ids
        out = CompletionOutput(seq.index, text, ids, seq.finish_reason, seq.cumulative_logprob,
                               None if seq.token_logprobs is None else list(seq.token_logprobs))
        if stream:
            out.delta_token_ids = ids[seq.num_sent_tokens:]
            out.delta_text = text[seq.num_sent_chars:] if text.startswith(text[:seq.num_sent_chars]) else ""
            seq.num_sent_tokens, seq.num_sent_chars = len(ids), max(seq.num_sent_chars, len(text))
        return out

    def deltas(self, group):
        """(deltas_only) The StepDeltas rows of a running streamed group, one per completion by index."""
        return [self.delta(s) for s in sorted(group.seqs, key=lambda s: s.index)]

    def request_output(self, group, now):
        """RequestOutput of `group`: final when it finished, else the streamed progress (deltas)."""
        finished = group.is_finished
        seqs = sorted(group.seqs, key=lambda s: s.index)
        outputs = [self._completion(s, group.stream) for s in seqs]
        metrics = request_metrics(group, now) if finished else None
        cached = seqs[0].num_cached_tokens if seqs else 0
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, metrics,
                             cached)
