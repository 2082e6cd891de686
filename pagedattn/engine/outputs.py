"""What the engine hands back: one RequestOutput per request, one CompletionOutput per completion.

A finished request's outputs are final. A request added with `stream=True` also gets a RequestOutput
after every step that added to it (`finished=False`), where `delta_text` / `delta_token_ids` are what the
step added: concatenating a completion's deltas gives exactly its final `text` / `token_ids`.

A request that failed inside the engine (its row alone: see LLMEngine.fail_request) finishes with
`error` set to the reason and finish_reason "error" on its completions (text empty); the others in its
batch are not affected.
"""
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int                     # which of the request's n completions
    text: str                      # detokenized so far (special tokens skipped, stop string removed)
    token_ids: list                # generated ids so far (an EOS / stop token id that ended it included)
    finish_reason: str | None      # None while running, then "stop" | "length" | "abort" | "error"
    cumulative_logprob: float | None = None
    logprobs: list | None = None   # the chosen tokens' log-probabilities (SamplingParams(logprobs=True))
    delta_text: str = ""           # what the last step added to text
    delta_token_ids: list = field(default_factory=list)

    @property
    def finished(self):
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: object
    prompt: object                 # the string given, or None for token ids
    prompt_token_ids: list
    outputs: list                  # [CompletionOutput], ordered by index
    finished: bool = True
    metrics: object = None         # RequestMetrics (set when finished)
    num_cached_tokens: int = 0     # prompt tokens served by the prefix cache
    prompt_index: int | None = None  # LLM.stream: the prompt's position in the list given
    error: str | None = None       # set when the request failed in the engine (finish_reason "error")


class StepDeltas:
    """The progress of a step's running streamed requests, as the engine returns it with an
    OutputProcessor(deltas_only=True) (the engine core, which ships token ids only): one row per completion
    that advanced, (request_id, index, new token ids, their logprobs or None, cumulative logprob, finish
    reason or None); nothing cumulative, no text, no object per request. At most one per step, after the
    step's final RequestOutputs."""
    __slots__ = ("rows",)
    finished = False
    error = None

    def __init__(self, rows):
        self.rows = rows
