"""What a request asks for: how to sample (SamplingParams) or how to beam-search (BeamSearchParams).

Both validate themselves on construction (and again when the engine accepts them: `validate()`) and raise
InvalidRequestError naming the field and its allowed range, so a bad value never reaches the engine. This
is the one place that knows what the sampling kernels can represent; LLM.generate and the HTTP server
both build a SamplingParams, so the same request gets the same error from either:

  * integers (n, top_k, seed, max_tokens, stop_token_ids, beam_width) are Python ints (not bools) inside
    the range the step's int32 arrays hold: [low, 2**31 - 1]; seed, a 64-bit key, in [0, 2**63 - 1];
  * floats are finite (no NaN, no inf) and representable in float32: temperature <= float32's largest
    value; temperature below MIN_TEMPERATURE (1e-5) is greedy and stored as 0.0 — the kernels divide the
    logits by it in float32, and below that scale logits saturate to the same largest float, so the
    "sample" would be a tie-break among garbage; top_p must be at least float32's smallest normal
    (a smaller value is 0 in float32, or a subnormal a GPU flushes to 0, and then no token qualifies).

Checks that need the model (token ids against the vocabulary, lengths against max_model_len and the KV
pool) live in the engine (pagedattn.engine.requests).
"""
import math
from dataclasses import dataclass

import numpy as np

from pagedattn.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)            # 3.4028235e38
FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)    # 1.1754944e-38
MIN_TEMPERATURE = 1e-5                                     # below: greedy (see the module docstring)


def _check_int(name, value, low, allowed, high=INT32_MAX):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be {allowed} (at most {high}), got {value!r}")


def _check_number(name, value):
    """A finite int or float (not a bool); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:           # an int beyond float64
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to turn one prompt into `n` completions.

    n: completions per prompt (>= 1); they share the prompt's KV blocks (copy-on-write).
    temperature: >= 0; 0 means greedy (argmax), exactly (as does anything below MIN_TEMPERATURE = 1e-5).
    top_k: -1 (off) or >= 1 most likely tokens kept.
    top_p: nucleus mass in (0, 1] (at least float32's smallest normal); 1 keeps everything.
    seed: in [0, 2**63 - 1]; makes this request's samples reproducible whatever else is in the batch.
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
        self.validate()

    def validate(self):
        """Check every field (and normalise: temperature as a float, below MIN_TEMPERATURE 0.0; stop and
        stop_token_ids as lists). Raises InvalidRequestError naming the field. The engine calls it again
        when it accepts a request, so a SamplingParams changed after construction is checked too."""
        _check_int("n", self.n, 1, "an int >= 1")
        t = _check_number("temperature", self.temperature)
        if t < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if t > FLOAT32_MAX:
            raise InvalidRequestError(f"temperature must be <= {FLOAT32_MAX:.8g} (float32's largest value), "
                                      f"got {self.temperature!r}")
        self.temperature = 0.0 if t < MIN_TEMPERATURE else t
        _check_int("top_k", self.top_k, -1, "-1 (disabled) or an int >= 1")
        if self.top_k == 0:
            raise InvalidRequestError("top_k must be -1 (disabled) or an int >= 1, got 0")
        p = _check_number("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if p < FLOAT32_MIN_NORMAL:
            raise InvalidRequestError(f"top_p must be in (0, 1] and >= {FLOAT32_MIN_NORMAL:.8g} (float32's smallest "
                                      f"normal value; smaller ones are 0 to the kernels), got {self.top_p!r}")
        self.top_p = p
        if self.seed is not None:
            _check_int("seed", self.seed, 0, "None or an int >= 0", high=SEED_MAX)
        _check_int("max_tokens", self.max_tokens, 1, "an int >= 1")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
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
        self.validate()

    def validate(self):
        """Check every field; raises InvalidRequestError naming it."""
        _check_int("beam_width", self.beam_width, 1, "an int >= 1")
        _check_int("max_tokens", self.max_tokens, 1, "an int >= 1")
        self.length_penalty = _check_number("length_penalty", self.length_penalty)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
