"""The OpenAI wire format (the subset we serve), as pydantic models, and the request -> SamplingParams map.

Requests check types here, strictly where OpenAI's API is strict (pydantic strict mode: "5", true or 2.0
are not a max_tokens, "yes" is not a stream, [true] is not a prompt), and every string is valid Unicode
(a lone surrogate such as "\ud800" is refused naming its field); chat roles are system, user or assistant. value ranges are the engine's (SamplingParams and
LLMEngine.validate_request raise InvalidRequestError naming the field), so the HTTP API and LLM.generate
accept exactly the same values and say the same thing about the rest. Fields OpenAI has and we do not
implement are accepted at their neutral value and refused with a 400 otherwise (`unsupported`), never
silently ignored. Unknown fields are ignored, as OpenAI does.

Extras beyond OpenAI's fields (vLLM's names): top_k, ignore_eos, stream_options.continuous_usage_stats
(usage in every stream chunk: token counts so far).
"""
import os
import random
import re
import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_serializer

from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import SamplingParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _valid_unicode(text):
    """Refuse a string the UTF-8 codec cannot write (a lone surrogate from a JSON escape like "\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the string holds a lone surrogate (U+{ord(text[e.start]):04X} at position {e.start}): "
                         "text must be valid Unicode") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]


# ---- errors ------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests ----------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(OpenAIModel):
    """The fields completions and chat completions share."""
    model: Text | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    def check_limits(self, max_stop_strings, max_stop_chars):
        """Refuse more than max_stop_strings stop strings or one longer than max_stop_chars characters (each
        is searched for after every token)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > max_stop_strings:
            unsupported("stop", f"stop has {len(stop)} strings: at most {max_stop_strings} are allowed")
        for s in stop:
            if len(s) > max_stop_chars:
                unsupported("stop", f"stop string of {len(s)} characters: each must be at most {max_stop_chars}")

    def check_supported(self):
        """Refuse the OpenAI features we do not implement when asked for anything but their neutral value."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                unsupported(name, f"{name} is not supported: leave it out or set it to 0")
        if self.logit_bias:
            unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            unsupported("stream_options", "stream_options is only allowed when stream is true")

    def sampling_params(self, max_tokens, logprobs=False):
        """SamplingParams for this request (OpenAI's defaults: temperature 1, top_p 1). Raises
        InvalidRequestError naming the field (SamplingParams' own checks)."""
        kwargs = dict(n=1 if self.n is None else self.n,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p,
                      top_k=-1 if self.top_k is None else self.top_k, seed=self.seed, max_tokens=max_tokens,
                      stop=self.stop, ignore_eos=self.ignore_eos)
        if logprobs:
            if "logprobs" not in SamplingParams.__dataclass_fields__:
                unsupported("logprobs", "logprobs is not supported by this engine")
            kwargs["logprobs"] = True
        return SamplingParams(**kwargs)

    @property
    def include_usage(self):
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self):
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: Text | None = None
    best_of: int | None = None

    def check_supported(self):
        super().check_supported()
        if self.echo:
            unsupported("echo", "echo is not supported")
        if self.suffix:
            unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            unsupported("best_of", "best_of is not supported (it must be left out or equal n)")
        if self.logprobs is not None and self.logprobs != 0:
            unsupported("logprobs", "logprobs must be 0 (the chosen tokens' log-probabilities); "
                        "top alternatives are not supported")

    def prompts(self):
        """The prompt(s) as a list of str | list[int] (one request per entry)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty: it must have at least 1 token")
        if isinstance(p[0], int):       # (validated as one of the union's lists: all ints, strs or lists)
            return [list(p)]
        return list(p)


class ContentPart(OpenAIModel):
    type: Text
    text: Text | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def text(self):
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                unsupported("messages", f"message content of type {part.type!r} is not supported (text only)")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None               # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None

    def check_supported(self):
        super().check_supported()
        if self.tools:
            unsupported("tools", "tools are not supported")
        if self.top_logprobs:
            unsupported("top_logprobs", "top_logprobs must be 0 or left out: top alternatives are not supported")
        if not self.messages:
            raise InvalidRequestError("messages is empty: give at least one message")

    def chat(self, max_chars=None, control_tokens=()):
        """[{"role", "content"}] for the chat template. Refuses content longer than max_chars in total, and
        content holding one of `control_tokens` (the tokenizer's added tokens, such as <|im_start|>: text
        that became one would let a user forge a turn of another role)."""
        chat = [{"role": m.role, "content": m.text()} for m in self.messages]
        total = sum(len(m["content"]) for m in chat)
        if max_chars is not None and total > max_chars:
            unsupported("messages", f"messages hold {total} characters of content: at most {max_chars} are allowed")
        for i, m in enumerate(chat):
            bad = next((t for t in control_tokens if t in m["content"]), None)
            if bad is not None:
                unsupported("messages", f"messages[{i}].content contains the control token {bad!r}, which the "
                            "chat template reserves: remove it")
        return chat


def unsupported(param, message):
    e = InvalidRequestError(message)
    e.param = param
    raise e


# The engine's InvalidRequestError messages name their field: "temperature must be >= 0 ...",
# "n=3 must be in [1, ...]", "prompt (40 tokens) + max_tokens (300) exceeds ...: max_tokens must be ...",
# "prompt has 300 tokens: ...". The first known field before "must" wins, else the leading word.
_FIELDS = {"n", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "prompt",
           "logprobs", "ignore_eos", "messages"}
_MUST = re.compile(r"\b([a-z_]+)(?:=\S*)? must\b")


def error_param(exc, renames=None):
    """The request field an InvalidRequestError is about (None if it names none), renamed by `renames`
    (e.g. {"prompt": "messages"} for chat)."""
    param = getattr(exc, "param", None)
    if param is None:
        msg = str(exc)
        param = next((m.group(1) for m in _MUST.finditer(msg) if m.group(1) in _FIELDS), None)
        if param is None:
            first = re.match(r"[a-z_]+", msg)
            param = first.group(0) if first and first.group(0) in _FIELDS else None
    return (renames or {}).get(param, param)


# ---- responses ---------------------------------------------------------------------------------------
def random_id(prefix):
    """prefix-<32 hex digits>: 128 random bits from a generator seeded from the OS once per process (uuid4 asks
    the OS for every id: a system call per request)."""
    return f"{prefix}-{_ids.getrandbits(128):032x}"


_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)     # (a forked process draws its own ids)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens, completion_tokens):
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """What a chat stream chunk adds; fields left None are left out (OpenAI sends the role once)."""
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedattn"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
