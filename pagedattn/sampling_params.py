"""What a request asks for: how to sample (SamplingParams) or how to beam-search (BeamSearchParams).

Both validate themselves on construction and raise InvalidRequestError naming the field and its
allowed range, so a bad value never reaches the engine. Checks that need the model (token ids
against the vocabulary, lengths against max_model_len and the KV pool) live in the engine.
"""
from dataclasses import dataclass

from pagedattn.errors import InvalidRequestError


def _check_int(name, value, low, allowed):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequestError(f"{name} must be {allowed}, got {value!r}")


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")


@dataclass
class SamplingParams:
    """How to turn one prompt into `n` completions.

    n: completions per prompt (>= 1); they share the prompt's KV blocks (copy-on-write).
    temperature: >= 0; 0 means greedy (argmax), exactly.
    top_k: -1 (off) or >= 1 most likely tokens kept.
    top_p: nucleus mass in (0, 1]; 1 keeps everything.
    seed: makes this request's samples reproducible whatever else is in the batch.
    max_tokens: >= 1 new tokens at most (finish_reason "length").
    stop: strings that end the completion; they are removed from the text (finish_reason "stop").
    stop_token_ids: token ids that end the completion (kept in token_ids, like EOS).
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: report each chosen token's log-probability under the model (raw logits, before
        temperature / top-k / top-p) in CompletionOutput.logprobs.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self):
        _check_int("n", self.n, 1, "an int >= 1")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check_int("top_k", self.top_k, -1, "-1 (disabled) or an int >= 1")
        if self.top_k == 0:
            raise InvalidRequestError("top_k must be -1 (disabled) or an int >= 1, got 0")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, "None or an int >= 0")
        _check_int("max_tokens", self.max_tokens, 1, "an int >= 1")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, "a list of ints >= 0")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self):
        return self.temperature == 0


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's `LLM.beam_search` shape).

    beam_width: beams kept per step (>= 1).
    max_tokens: new tokens per beam (>= 1).
    length_penalty: a finished beam scores cumulative_logprob / generated_len ** length_penalty.
    ignore_eos: never finish a beam on the end-of-sequence token.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        _check_int("beam_width", self.beam_width, 1, "an int >= 1")
        _check_int("max_tokens", self.max_tokens, 1, "an int >= 1")
        _check_number("length_penalty", self.length_penalty)
