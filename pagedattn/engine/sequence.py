"""A sequence: the unit the scheduler batches, and a request (SequenceGroup): the user's prompt.

A sequence is tracked by two counters only:

    num_tokens           tokens known (prompt + generated so far, including one still on the device)
    num_computed_tokens  tokens whose K/V is in the cache

and the scheduler's job each step is to move some sequences' `num_computed_tokens` toward
`num_tokens`. A fresh prompt, a prompt half prefilled in chunks, a prompt whose head came from the
prefix cache and a sequence resumed after preemption (computed reset to 0, or to its cache hit) are
all the same case: compute tokens [num_computed_tokens, num_tokens). When computed catches up with
known, the step's logits for the last token give the next token.

With asynchronous scheduling the next step is scheduled before the host has seen the token the running
step samples: that token is *in flight* (`num_inflight` = 1). It counts in num_tokens, its id is read on
the device from the row `inflight_row` of the step's sampled tokens, and it joins `token_ids` when the
step's results reach the host.
"""
import enum


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # no blocks; in the scheduler's waiting queue
    RUNNING = "running"      # holds blocks; in the running list
    FINISHED = "finished"    # blocks freed; finish_reason set


class Sequence:
    """One token stream with its own blocks (a block table in the BlockManager under `seq_id`).

    token_ids: prompt followed by the generated ids the host has; num_prompt_tokens: how many are the prompt.
    params: SamplingParams (or None for beam search, whose driver picks tokens itself).
    index: which of the request's n completions (or beams) this is; with the request's `key` it keys the
        random numbers of every token this completion samples (pagedattn.layers.sampler).
    """

    def __init__(self, seq_id, request_id, token_ids, num_prompt_tokens, params=None, index=0,
                 arrival_time=0.0, key=0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_inflight = 0            # sampled on the device, not yet in token_ids (0 or 1)
        self.inflight_row = -1           # its row in the sampled tokens of the step that made it
        self.last_token_inflight = False  # the in-flight token is the last one (length): schedule no more
        self.params = params
        self.index = index
        self.key = key
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason = None        # "stop" | "length" | "abort"
        self.detokenizer = None          # IncrementalDetokenizer when streamed or with stop strings
        self.text = None                 # final text, set when finished
        self.num_sent_tokens = 0         # token ids already reported (streaming)
        self.num_sent_chars = 0          # characters of text already reported (streaming)
        self.token_logprobs = None       # [float] when params.logprobs
        self.cumulative_logprob = 0.0
        self.beam_candidates = None      # beam search: (logprobs [K], token ids [K]) of the next token
        self.num_preemptions = 0
        self.num_pending_forks = 0       # siblings this sequence will fork into (n > 1, beams) once prefilled
        self.num_cached_tokens = 0       # prompt tokens served by the prefix cache at the last admission
        self.first_token_time = None
        self.last_token_time = None
        self.token_latencies = []        # seconds between consecutive generated tokens

    @property
    def num_tokens(self):
        return len(self.token_ids) + self.num_inflight

    @property
    def num_new_tokens(self):
        """Tokens still to compute before this sequence can produce its next token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_output_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self):
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self):
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id, now=None):
        self.token_ids.append(int(token_id))
        if now is not None:
            if self.first_token_time is None:
                self.first_token_time = now
            else:
                self.token_latencies.append(now - self.last_token_time)
            self.last_token_time = now

    def fork(self, seq_id, index):
        """A child with the same known tokens (its blocks are shared by the caller)."""
        child = Sequence(seq_id, self.request_id, self.token_ids, self.num_prompt_tokens, self.params,
                         index, self.arrival_time, self.key)
        child.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.num_cached_tokens = self.num_cached_tokens
        child.first_token_time, child.last_token_time = self.first_token_time, self.last_token_time
        child.token_latencies = list(self.token_latencies)
        if self.token_logprobs is not None:
            child.token_logprobs = list(self.token_logprobs)
        return child

    def __repr__(self):
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, prompt={self.num_prompt_tokens})")


class SequenceGroup:
    """One request: a prompt and the n sequences (completions, or beams) grown from it.

    Starts with one sequence; with params.n > 1 the step that finishes the prompt samples n tokens from
    its last position and the engine forks the others from it, so the prompt is computed once and its
    blocks are shared.
    """

    def __init__(self, request_id, prompt, prompt_token_ids, params, arrival_time, key=0, stream=False):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.key = key
        self.stream = stream
        self.seqs = []
        self.forked = params is None or params.n == 1
        self.beam = None                 # beam search state (pagedattn.engine.beam_search.BeamState)

    @property
    def is_finished(self):
        if self.beam is not None:
            return self.beam.done
        if not self.forked:
            return False
        for s in self.seqs:             # (a loop, not all(): this runs for every streamed request every step)
            if s.status != SequenceStatus.FINISHED:
                return False
        return True

    @property
    def first_token_time(self):
        times = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        return min(times) if times else None
