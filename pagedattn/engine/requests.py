"""Request intake: prompts to token ids, every request checked against the model and the pool.

`InputProcessor.validate(prompt, params)` returns the prompt's token ids or raises InvalidRequestError
naming the field and its allowed range; it changes nothing, so a bad request never disturbs the running
ones. (SamplingParams validates its own fields on construction; here are the checks that need the model:
token ids against the vocabulary, lengths against max_model_len and the KV pool.)
"""
import torch

from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import BeamSearchParams, SamplingParams


class InputProcessor:
    """tokenizer: HF tokenizer or None; vocab_size, max_model_len, max_num_seqs, block_size, num_blocks: ints."""

    def __init__(self, tokenizer, vocab_size, max_model_len, max_num_seqs, block_size, num_blocks, model_path=""):
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len, self.max_num_seqs = vocab_size, max_model_len, max_num_seqs
        self.block_size, self.num_blocks, self.model_path = block_size, num_blocks, model_path

    def tokenize(self, prompt):
        """prompt: str (encoded without special tokens) or token ids -> list[int]. A prompt longer than
        max_model_len is refused here, from its length, before anything that costs per token (the ids of a
        long text are not even made into a list: Tokenizer.encode_bounded)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"prompt is a string but {self.model_path!r} has no tokenizer: pass token ids")
            bounded = getattr(self.tokenizer, "encode_bounded", None)
            if bounded is None:         # transformers' own tokenizer (a checkpoint without a fast one)
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
                self.check_prompt_length(len(ids))
                return ids
            n, ids = bounded(prompt, self.max_model_len, add_special_tokens=False)
            self.check_prompt_length(n)
            return ids
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            self.check_prompt_length(len(ids))
            if set(map(type, ids)) != {int}:   # (a scan in C; the loop below only to name what is wrong)
                for i, t in enumerate(ids):
                    if isinstance(t, bool) or not isinstance(t, int):
                        raise InvalidRequestError(f"prompt token ids must be ints, got {t!r} at position {i}")
            return ids
        raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def check_prompt_length(self, n_prompt):
        """The checks a prompt's length alone decides (InvalidRequestError): at least one token, and room
        within max_model_len for at least one generated token."""
        if n_prompt == 0:
            raise InvalidRequestError("prompt is empty: it must have at least 1 token")
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {n_prompt} tokens, which leaves no room to generate: the "
                                      f"prompt length must be < max_model_len={self.max_model_len}")

    def validate(self, prompt, params):
        """Token ids of `prompt` after checking it and `params` (SamplingParams or BeamSearchParams)."""
        if isinstance(params, (BeamSearchParams, SamplingParams)):
            params.validate()           # again: a dataclass can be changed after it was constructed
        if isinstance(params, BeamSearchParams):
            width, max_tokens = params.beam_width, params.max_tokens
        elif isinstance(params, SamplingParams):
            width, max_tokens = 1, params.max_tokens
            if params.n > self.max_num_seqs:
                raise InvalidRequestError(f"n={params.n} must be in [1, max_num_seqs={self.max_num_seqs}]")
        else:
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)     # (its length checked: the per-token scan below costs <= max_model_len)
        n_prompt, max_len = len(ids), self.max_model_len
        bad = None
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {ids[bad]} at position {bad} is outside the vocabulary: "
                                      f"token ids must be in [0, {self.vocab_size})")
        if width > self.max_num_seqs:
            raise InvalidRequestError(f"beam_width={width} must be in [1, max_num_seqs={self.max_num_seqs}]")
        room = self.num_blocks // width * self.block_size       # tokens each of the request's sequences can hold
        if 1 < room <= n_prompt:        # (the prompt alone fills the pool: no max_tokens can help)
            beams = f" shared by {width} beams" if width > 1 else ""
            raise InvalidRequestError(
                f"prompt has {n_prompt} tokens, which leaves no room to generate in the KV pool (num_blocks="
                f"{self.num_blocks} x block_size={self.block_size}{beams}): the prompt length must be < {room}")
        if n_prompt + max_tokens > max_len:
            raise InvalidRequestError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                                      f"max_model_len={max_len}: max_tokens must be in [1, {max_len - n_prompt}]")
        blocks = -(-(n_prompt + max_tokens) // self.block_size) * width
        if blocks > self.num_blocks:
            what = f"{width} beams x " if width > 1 else ""
            raise InvalidRequestError(
                f"request can never fit the KV pool: prompt ({n_prompt}) + max_tokens ({max_tokens}) needs "
                f"{what}{blocks // width} blocks of {self.block_size} tokens but num_blocks={self.num_blocks}; "
                f"max_tokens must be <= {self.num_blocks // width * self.block_size - n_prompt}")
        return ids
