"""RequestStream: one request's outputs as an async iterator, and the errors a stream raises.

    stream = client.add_request("def fib(n):", SamplingParams(temperature=0, max_tokens=32))
    async for out in stream:                    # RequestOutputs; each completion has delta_text / delta_token_ids
        print(out.outputs[0].delta_text, end="")

The front (CoreClient) processes each step's tokens and tells the stream it has news; the RequestOutput
(token ids and text so far, the deltas since the reader's last one) is built only when the reader takes
it. So a reader that lags costs nothing per step and never grows a queue: it gets one output holding
everything it missed. Concatenated, the deltas are exactly the final text and token ids.

Closing the stream early (`aclose()`, `abort()`, leaving the `async for`, or cancelling the task that
iterates it: a client that went away) aborts the request; its blocks are freed before the next step.
"""
import asyncio
import threading
import time

from pagedattn.errors import PagedAttnError

now = time.perf_counter


class EngineStepError(PagedAttnError, RuntimeError):
    """An engine step raised while this request was in flight; the message names the cause."""


class RequestFailedError(EngineStepError):
    """This request alone failed inside the engine (its row: a token outside the vocabulary, its output
    processing) or in the front (its text); the rest of the batch went on. The message says why."""


class EngineDeadError(PagedAttnError, RuntimeError):
    """The engine has stopped (shut down, or a core died or could not recover from an error)."""


def engine_dead(error):
    """The EngineDeadError a front raises once its engine stopped with `error` (its `error` attribute): an
    EngineDeadError's message as it is (it already says the engine stopped, and why), anything else as the
    cause after "the engine has stopped: ". A fresh exception each time: it is raised in many requests."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error))
    return EngineDeadError("the engine has stopped" + ("" if error is None else f": {error!r}"))


def set_ready(streams):
    """On the streams' event loop: wake each stream's reader."""
    for stream in streams:
        stream._ready.set()


class RequestStream:
    """The async iterator of one request's outputs (see the module docstring).

    owner: the front (its stream_interval, _abort and _output_of). request_id: the caller's id.
    prompt_token_ids: list[int], the tokenized prompt. params: SamplingParams. loop: the event loop of the
    reader. arrival_time: perf_counter seconds when the front accepted it (TTFT and e2e latency start here).
    deltas_only: set it before reading for outputs whose completions hold only what is new (token_ids,
    logprobs and text equal to the delta_ fields): a streamed HTTP response needs no more.
    final_only: set it before reading to be woken for the final output (or an error) alone: a non-streamed
    HTTP response reads one output, not a copy of the completion at every step.
    """

    def __init__(self, owner, request_id, prompt, prompt_token_ids, params, loop):
        self.owner = owner
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.loop = loop
        self.arrival_time = now()
        self.deltas_only = False
        self.final_only = False
        self._wire_id = None            # the front's number for the request on the wire
        self.finished = False           # the reader has seen the final output (or an error)
        self._lock = threading.Lock()   # guards the fields below between the front's threads and the reader
        self._pending = None            # the front's state of the request, when it has news for the reader
        self._pending_tokens = 0        # tokens the reader has not taken yet (all completions)
        self._sent_any = False          # the reader has taken an output
        self._error = None
        self._ready = asyncio.Event()

    # ---- the front's side ------------------------------------------------------------------------
    def _put(self, request=None, num_tokens=0, finished=False, error=None):
        """News for the reader: `request` (the front's state, which _output_of turns into a RequestOutput)
        advanced by num_tokens tokens, finished or not; or an error. Returns True when the reader must be
        woken: it is not already, and this is an error, the final output, the first tokens, or at least
        stream_interval tokens since it last took one (final_only: an error or the final output); the caller
        wakes it, once per loop per step."""
        with self._lock:
            if error is not None:
                self._error = error
                return not self._ready.is_set()
            self._pending = request
            self._pending_tokens += num_tokens
            if self.final_only:
                due = finished
            else:
                due = finished or not self._sent_any or self._pending_tokens >= self.owner.stream_interval
            return due and not self._ready.is_set()

    # ---- the reader's side -----------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        try:
            while True:
                await self._ready.wait()
                with self._lock:
                    request, error = self._pending, self._error
                    self._pending, self._pending_tokens = None, 0
                    self._sent_any = self._sent_any or request is not None
                    self._ready.clear()
                if error is not None:
                    self.finished = True
                    raise error
                if request is not None:
                    out = self.owner._output_of(request)
                    break
        except BaseException:
            if not self.finished:       # cancelled while waiting: the client is gone
                self.abort()
            raise
        if out.finished:
            self.finished = True
        return out

    def abort(self):
        """Stop the request (a no-op once it finished): its blocks are freed before the next step."""
        if not self.finished:
            self.finished = True
            self.owner._abort(self)

    async def aclose(self):
        self.abort()

    def fail(self, error):
        """End the request on the front's side: its reader's next read raises `error`, and the request is
        aborted in the engine as abort() does (a no-op once it finished). Call on the stream's loop. (A
        stopping server ends the requests still open this way: pagedattn.serving.http_server.Server.)"""
        if self.finished:
            return
        with self._lock:
            self._error = error
        self.owner._abort(self)         # (finished stays False until the reader has read the error)
        self._ready.set()
