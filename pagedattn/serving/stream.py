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

Instead of being read, a stream can push: `stream.push_to(writer)` has the front call `writer(out, error)`
with the same outputs as the front processes each step, on the stream's event loop. A streamed HTTP
response writes its bytes from there (pagedattn.serving.responses): no task is woken per step.
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
    """On the streams' event loop: wake each stream's reader (or push its news to its writer)."""
    for stream in streams:
        stream._wake()


class RequestStream:
    """The async iterator of one request's outputs (see the module docstring).

    owner: the front (its stream_interval, _abort and _output_of). request_id: the caller's id.
    prompt_token_ids: list[int], the tokenized prompt. params: SamplingParams. loop: the event loop of the
    reader. arrival_time: perf_counter seconds when the front accepted it (TTFT and e2e latency start here).
    deltas_only: set it before reading for outputs whose completions hold only what is new (token_ids,
    logprobs and text equal to the delta_ fields): a streamed HTTP response needs no more.
    final_only: set it before reading to be woken for the final output (or an error) alone: a non-streamed
    HTTP response reads one output, not a copy of the completion at every step.
    writer: set by push_to (then the stream is not read).
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
        self.writer = None
        self._wire_id = None            # the front's number for the request on the wire
        self.finished = False           # the reader has seen the final output (or an error)
        self._lock = threading.Lock()   # guards the fields below between the front's threads and the reader
        self._pending = None            # the front's state of the request, when it has news for the reader
        self._pending_tokens = 0        # tokens the reader has not taken yet (all completions)
        self._sent_any = False          # the reader has taken an output
        self._error = None
        self._due = False               # the reader has been woken (or the writer is to be pushed to) for news
        self._ready = asyncio.Event()

    # ---- the front's side ------------------------------------------------------------------------
    def _put(self, request=None, num_tokens=0, finished=False, error=None):
        """News for the reader: `request` (the front's state, which _output_of turns into a RequestOutput)
        advanced by num_tokens tokens, finished or not; or an error. Returns True when the reader must be
        woken: it is not already, and this is an error, the final output, the first tokens, or at least
        stream_interval tokens since it last took one (final_only: an error or the final output); the caller
        wakes it (set_ready), once for all the step messages it processes at a time."""
        with self._lock:
            if error is not None:
                self._error = error
                due = True
            else:
                self._pending = request
                self._pending_tokens += num_tokens
                if self.final_only:
                    due = finished
                else:
                    due = finished or not self._sent_any or self._pending_tokens >= self.owner.stream_interval
            if not due or self._due:
                return False
            self._due = True
            return True

    def _wake(self):
        """(on the stream's loop) The reader is due: wake it, or push to the writer."""
        if self.writer is not None:
            self._push()
        else:
            self._ready.set()

    # ---- the reader's side -----------------------------------------------------------------------
    def push_to(self, writer):
        """Have the front call writer(out, None) with each output (what the reader would have read) and
        writer(None, error) with an error, on the stream's loop, as it processes a step, instead of waking a
        reader. The writer is called until an output is final or an error came; its exceptions are the
        caller's to handle (the front's step processing does not expect any). Call on the stream's loop,
        before any read; what is already waiting is pushed at once."""
        self.writer = writer
        self._push()

    def _take(self):
        """(request state or None, error or None) waiting for the reader or writer, taken: nothing is due any
        more until the front has news again."""
        with self._lock:
            request, error = self._pending, self._error
            self._pending, self._pending_tokens = None, 0
            self._sent_any = self._sent_any or request is not None
            self._due = False
            self._ready.clear()
        return request, error

    def _push(self):
        request, error = self._take()
        if self.finished:
            return
        if error is not None:
            self.finished = True
            self.writer(None, error)
        elif request is not None:
            out = self.owner._output_of(request)
            self.finished = out.finished
            self.writer(out, None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        try:
            while True:
                await self._ready.wait()
                request, error = self._take()
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
        self._wake()
