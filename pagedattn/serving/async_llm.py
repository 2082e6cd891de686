"""AsyncLLM: the engine on one background thread, an asyncio face that streams each request's increments.

    llm = AsyncLLM(LLM(model_dir))
    async for out in llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32)):
        print(out.outputs[0].delta_text, end="")
    llm.shutdown()

Threads. One thread, the engine thread, owns the engine: it is the only code that calls into it after
start-up. It loops: take every command waiting in the inbox (add a request, abort one), run one
`engine.step()`, hand each request's output to that request's stream; it sleeps on the inbox while the
engine has no work. Any number of asyncio event loops (normally the HTTP server's one) talk to it
through the inbox (a thread-safe queue) one way and the streams the other way, so a step is never
interrupted: requests join and leave between steps, which is what continuous batching wants anyway.

Requests. `add_request` validates on the caller's thread (tokenizing with its own copy of the tokenizer
and reusing `engine.validate_request`), so a bad request raises InvalidRequestError at once, before a
byte of a response is sent; it changes nothing in the engine. The returned RequestStream is an async
iterator of RequestOutputs whose CompletionOutputs carry `delta_text` / `delta_token_ids`: concatenated,
they are exactly the final text and token ids. When the consumer falls behind, the outputs waiting for
it are merged into one (deltas joined), so a slow client costs the engine nothing. Closing the stream
early (`aclose()`, `abort()`, or cancelling the task that iterates it: a client that went away) aborts
the request: its blocks are freed before the next step.

Errors. A request the engine refuses when it is added (say a duplicate request id) gets the error on its
own stream only, and so does a request the engine failed alone (RequestOutput.error: RequestFailedError on
its stream; the others in the batch go on). A step that raises fails the requests in flight (each stream raises EngineStepError
with the cause attached), they are aborted, and the loop goes on serving new requests; only if the
engine cannot even abort them is it declared dead (`AsyncLLM.error`), and then every call raises.
"""
import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time

from pagedattn.engine.requests import InputProcessor
from pagedattn.errors import InvalidRequestError, PagedAttnError
from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger("pagedattn.serving")
now = time.perf_counter

# A metrics snapshot costs a pass over the running sequences; at most this often while busy (and once
# every time the engine goes idle, so an idle engine's snapshot is exact).
_SNAPSHOT_INTERVAL_S = 0.05


class EngineStepError(PagedAttnError, RuntimeError):
    """An engine step raised while this request was in flight; `__cause__` is the original exception."""


class RequestFailedError(EngineStepError):
    """This request alone failed inside the engine (its row: a token outside the vocabulary, its
    detokenizer); the rest of the batch went on. The message says why."""


class EngineDeadError(PagedAttnError, RuntimeError):
    """The engine thread has stopped (shut down, or the engine could not recover from an error)."""


def engine_dead(error):
    """The EngineDeadError a front raises once its engine stopped with `error` (its `error` attribute): an
    EngineDeadError's message as it is (it already says the engine stopped, and why), anything else as the
    cause after "the engine has stopped: ". A fresh exception each time: it is raised in many requests."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error))
    return EngineDeadError("the engine has stopped" + ("" if error is None else f": {error!r}"))


def merge_outputs(old, new):
    """`new` updated in place to stand for `old` followed by `new` (same request): `new`'s cumulative
    fields, deltas joined per completion index; returns it. (The engine builds fresh output objects every
    step and hands each over once, so the newer one is ours to update.)"""
    old_by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        o = old_by_index.pop(c.index, None)
        if o is not None:
            c.delta_text = o.delta_text + c.delta_text
            c.delta_token_ids = o.delta_token_ids + c.delta_token_ids
    if old_by_index:                    # a completion the newer output left out
        new.outputs = sorted(new.outputs + list(old_by_index.values()), key=lambda c: c.index)
    return new


def _bind_device(engine):
    """Make the engine's GPU this thread's current device (torch keeps the current device per thread, and
    a new thread starts on cuda:0)."""
    device = str(getattr(getattr(engine, "config", None), "device", "cpu"))
    if device.startswith("cuda"):
        import torch
        index = torch.device(device).index
        if index is not None:
            torch.cuda.set_device(index)


def _set_ready(streams):
    """On the consumers' loop: wake each stream's reader."""
    for stream in streams:
        stream._ready.set()


class RequestStream:
    """The async iterator of one request's outputs (see the module docstring).

    request_id: the engine's id. prompt_token_ids: list[int], the tokenized prompt. params: SamplingParams.
    arrival_time: perf_counter seconds when add_request accepted it (TTFT and e2e latency start here).
    """

    def __init__(self, owner, request_id, prompt, prompt_token_ids, params, loop):
        self.owner = owner
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.loop = loop
        self.arrival_time = now()
        self.finished = False           # the consumer has seen the final output (or an error)
        self._lock = threading.Lock()   # guards _pending / _error between the engine thread and the loop
        self._pending = None            # RequestOutput waiting for the consumer (merged when it lags)
        self._pending_tokens = 0        # tokens in _pending (all completions)
        self._sent_any = False          # the consumer has taken an output
        self._error = None
        self._ready = asyncio.Event()
        # engine-thread bookkeeping for the latency metrics
        self._first_token_time = None
        self._counted = False           # counted in the finished-requests metrics (exactly once)
        self._last_token_time = {}      # completion index -> perf_counter of its latest token

    # ---- engine thread side ----------------------------------------------------------------------
    def _put(self, out=None, error=None):
        """Hand over an output (merged into any the consumer has not taken yet) or an error. Returns True
        when the consumer must be woken: its event is clear, and this is an error, the final output, the
        first tokens, or at least stream_interval tokens since the consumer last took (the caller wakes
        it, see AsyncLLM._wake)."""
        with self._lock:
            if error is not None:
                self._error = error
                return not self._ready.is_set()
            for c in out.outputs:       # (before the merge joins the waiting deltas into out's)
                self._pending_tokens += len(c.delta_token_ids)
            if self._pending is None:
                self._pending = out
            else:
                self._pending = merge_outputs(self._pending, out)
            due = out.finished or not self._sent_any or self._pending_tokens >= self.owner.stream_interval
            return due and not self._ready.is_set()

    # ---- consumer side ---------------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        try:
            while True:
                await self._ready.wait()
                with self._lock:
                    out, error = self._pending, self._error
                    self._pending, self._pending_tokens = None, 0
                    self._sent_any = self._sent_any or out is not None
                    self._ready.clear()
                if error is not None:
                    self.finished = True
                    raise error
                if out is not None:
                    out = self._take(out)
                    break
        except BaseException:
            if not self.finished:       # cancelled while waiting: the client is gone
                self.abort()
            raise
        if out.finished:
            self.finished = True
        return out

    def _take(self, pending):
        """The RequestOutput the consumer gets for what was left waiting for it: here the merged output
        itself; a front that builds outputs only when they are taken (CoreClient) overrides it."""
        return pending

    def abort(self):
        """Stop the request (a no-op once it finished): its blocks are freed before the next step."""
        if not self.finished:
            self.finished = True
            self.owner._abort(self)

    async def aclose(self):
        self.abort()

    def fail(self, error):
        """End the request on the front's side: its consumer's next read raises `error`, and the request is
        aborted in the engine as abort() does (a no-op once it finished). Call on the stream's loop. (A
        stopping server ends the requests still open this way: pagedattn.serving.api_server.Server.)"""
        if self.finished:
            return
        with self._lock:
            self._error = error
        self.owner._abort(self)         # (finished stays False until the consumer has read the error)
        self._ready.set()


class StreamingFront:
    """What every asyncio face of the engine shares (AsyncLLM here, the engine core's CoreClient): a
    `generate` over the subclass's `add_request`, and `abort` by request id over its `_streams` dict."""

    async def generate(self, prompt, params=None, request_id=None):
        """Async iterator of the request's RequestOutputs (see add_request for the arguments); leaving
        the loop early, or cancelling the task running it, aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id):
        """Abort a request by id (False if it is not running)."""
        stream = self._streams.get(request_id)          # one dict read: no lock needed
        if stream is None:
            return False
        stream.abort()
        return True


class AsyncLLM(StreamingFront):
    """An LLM (or a bare LLMEngine) driven by a background thread, with an asyncio front.

    llm: pagedattn.LLM or LLMEngine; the engine must not be stepped by anything else while this runs
    (LLM.generate on the same object included). metrics: an object with the recording methods of
    pagedattn.serving.metrics.ServingMetrics (first_token, inter_token, generated, finished), or None.
    stream_interval: wake a stream's reader once at least this many new tokens are waiting for it (the
    first tokens and the final output always at once): fewer, larger increments for the HTTP layer to
    send when many streams share one event loop.
    """

    def __init__(self, llm, metrics=None, stream_interval=1):
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise InvalidRequestError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.engine = getattr(llm, "engine", llm)
        self.llm = llm
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.tokenizer = self._own_tokenizer(self.engine)
        e = self.engine                 # the engine's request checks, with the request threads' tokenizer
        self._inputs = InputProcessor(self.tokenizer, e.vocab_size, e.max_model_len, e.config.max_num_seqs,
                                      e.config.block_size, e.num_blocks, e.model_path)
        self.error = None               # set when the engine thread died
        self._inbox = queue.SimpleQueue()
        self._streams = {}              # request_id -> RequestStream, accepted and not yet forgotten
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._snapshot = (now(), self.engine.metrics())    # (perf_counter when taken, engine.metrics())
        self.num_step_errors = 0
        self._thread = threading.Thread(target=self._run, name="pagedattn-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def _own_tokenizer(engine):
        """A second copy of the checkpoint's tokenizer for the request threads: the engine thread's one is
        busy detokenizing, and a HF fast tokenizer must not be used by two threads at once. The engine's
        kind (pagedattn.engine.tokenizer), as the engine core's client uses: its encode releases the GIL, so
        a long prompt tokenizing on the server's worker thread leaves the event loop free."""
        if engine.tokenizer is None:
            return None
        from pagedattn.engine.tokenizer import load_tokenizer
        return load_tokenizer(engine.model_path)

    # ---- the front (any asyncio loop) --------------------------------------------------------------
    @property
    def max_model_len(self):
        return self.engine.max_model_len

    @property
    def max_request_tokens(self):
        """The most tokens (prompt + generated) one request can ever hold: max_model_len, or less when the
        KV pool is smaller than one max_model_len sequence."""
        cfg = self.engine.config
        return min(self.engine.max_model_len, self.engine.num_blocks * cfg.block_size)

    def tokenize(self, prompt):
        """prompt: str -> list[int], encoded without special tokens as LLM.generate does (token ids pass
        through unchanged: validate_request checks them). A prompt over max_model_len tokens raises
        InvalidRequestError here (InputProcessor.tokenize)."""
        if not isinstance(prompt, str):
            return prompt
        return self._inputs.tokenize(prompt)

    def add_request(self, prompt, params=None, request_id=None):
        """Validate and queue one request; returns its RequestStream. Call from a coroutine.

        prompt: str or list[int]. params: SamplingParams (default SamplingParams()). request_id: any
        hashable, unique among running requests (default: "req-<counter>"). Raises InvalidRequestError
        naming the field (nothing is queued then), EngineDeadError when the engine thread has stopped."""
        if self.error is not None:
            raise engine_dead(self.error) from self.error
        params = SamplingParams() if params is None else params
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        ids = self.engine.validate_request(self.tokenize(prompt), params)
        stream = RequestStream(self, request_id, prompt, ids, params, asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._inbox.put(("add", stream))
        return stream

    def engine_metrics(self):
        """The engine's metrics() dict as of the last snapshot the engine thread took (at most
        _SNAPSHOT_INTERVAL_S old while busy; exact while idle). Safe from any thread."""
        return self._snapshot[1]

    def wait_until_idle(self, timeout=60.0):
        """Block (a plain thread, not a coroutine) until no request is in flight and the engine holds no
        sequence: every finish and abort has been applied, so its blocks are free. Returns the engine's
        metrics then; raises TimeoutError."""
        deadline = now() + timeout
        while self.num_requests_in_flight:
            if now() > deadline:
                raise TimeoutError(f"{self.num_requests_in_flight} request(s) still in flight")
            time.sleep(0.005)
        t = now()
        self._inbox.put(("snapshot", None))        # the engine thread snapshots after every command it drains
        while True:
            taken, snap = self._snapshot
            if taken > t and not snap.get("num_running") and not snap.get("num_waiting"):
                return snap
            if now() > deadline or not self._thread.is_alive():
                raise TimeoutError(f"the engine is still busy: {snap}")
            time.sleep(0.005)

    @property
    def num_requests_in_flight(self):
        with self._streams_lock:
            return len(self._streams)

    @property
    def is_alive(self):
        return self._thread.is_alive() and self.error is None

    def shutdown(self, timeout=30.0):
        """Stop the engine thread (requests in flight get EngineDeadError); idempotent."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    def _abort(self, stream):
        self._forget(stream)
        self._inbox.put(("abort", stream))

    def _forget(self, stream):
        """Drop a request from the front's table (it finished, failed or was aborted); any thread."""
        with self._streams_lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self):
        engine = self.engine
        live = {}                       # request_id -> RequestStream, as the engine thread sees them
        try:
            _bind_device(engine)
            while True:
                busy = engine.has_unfinished_requests()
                if not busy:
                    self._take_snapshot()
                if not self._drain(live, block=not busy):
                    break
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outs = engine.step()
                except Exception as e:  # noqa: BLE001 (any failure: fail the requests in flight, keep going)
                    self._fail_in_flight(live, e)
                    continue
                t = now()
                woken = {}              # event loop -> streams to wake there: one wake-up per loop per step
                for out in outs:
                    self._deliver(live, out, t, woken)
                for loop, streams in woken.items():
                    self._wake(live, loop, streams)
                if t - self._snapshot[0] >= _SNAPSHOT_INTERVAL_S:
                    self._take_snapshot()
        except BaseException as e:      # noqa: BLE001 (the thread must report, not vanish)
            logger.exception("engine thread died")
            self.error = e
        finally:
            if self.error is None:
                self.error = EngineDeadError("the engine thread has been shut down")
            dead = engine_dead(self.error)
            for rid, stream in list(live.items()):
                with contextlib.suppress(Exception):   # leave the engine clean for whoever uses it next
                    engine.abort_request(rid)
                self._record_finished(stream, "error", None, now())
                self._put_quietly(stream, error=dead)
            self._drain_after_death(dead)
            self._take_snapshot()

    def _drain(self, live, block):
        """Apply every queued command (waiting for the first one when `block`). False on "stop"."""
        try:
            cmd, arg = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd == "stop":
                return False
            if cmd == "add":
                self._add(live, arg)
            elif cmd == "abort":
                if live.get(arg.request_id) is arg:
                    del live[arg.request_id]
                    self.engine.abort_request(arg.request_id)
                    self._record_finished(arg, "abort", None, now())
            # ("snapshot", None) needs nothing here: an idle loop snapshots after draining the inbox
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, live, stream):
        if stream.finished:             # aborted before the engine saw it (still an accepted request)
            self._record_finished(stream, "abort", None, now())
            return
        try:
            self.engine.add_request(stream.request_id, stream.prompt, stream.params,
                                    prompt_token_ids=stream.prompt_token_ids, stream=True)
        except Exception as e:          # noqa: BLE001 (this request's error, on this request's stream)
            self._record_finished(stream, "error", None, now())
            self._put_quietly(stream, error=e)
            return
        live[stream.request_id] = stream

    def _deliver(self, live, out, t, woken):
        stream = live.get(out.request_id)
        if stream is None:              # aborted meanwhile, or not ours
            return
        if out.error is not None:       # failed alone in the engine (its blocks are already free)
            del live[out.request_id]
            self._record_finished(stream, "error", None, t)
            self._put_quietly(stream, error=RequestFailedError(out.error))
            return
        try:
            self._record_tokens(stream, out, t)
            if out.finished:
                del live[out.request_id]
                self._forget(stream)
                self._record_finished(stream, None, out, t)
            if stream._put(out):
                woken.setdefault(stream.loop, []).append(stream)
        except Exception as e:          # noqa: BLE001 (this request's failure, on this request's stream)
            live.pop(out.request_id, None)
            if not out.finished:
                self.engine.abort_request(out.request_id)
            self._record_finished(stream, "error", None, t)
            self._put_quietly(stream, error=e)

    def _wake(self, live, loop, streams):
        try:
            loop.call_soon_threadsafe(_set_ready, streams)
        except RuntimeError:            # that loop is closed: nobody will read these streams any more
            for stream in streams:
                if live.get(stream.request_id) is stream:
                    del live[stream.request_id]
                    self.engine.abort_request(stream.request_id)
                self._record_finished(stream, "abort", None, now())
                self._forget(stream)

    def _fail_in_flight(self, live, exc):
        """A step raised: abort every request in flight and tell each of them why."""
        self.num_step_errors += 1
        logger.error("engine step failed; aborting %d request(s): %r", len(live), exc)
        for rid, stream in list(live.items()):
            self.engine.abort_request(rid)          # if this raises too, the thread dies (see _run)
            del live[rid]
            self._record_finished(stream, "error", None, now())
            err = EngineStepError(f"the engine step failed while this request was running: {exc!r}")
            err.__cause__ = exc
            self._put_quietly(stream, error=err)

    def _drain_after_death(self, error):
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                self._record_finished(arg, "error", None, now())
                self._put_quietly(arg, error=error)

    def _put_quietly(self, stream, error):
        """Fail one stream with `error` (waking its consumer if its loop still runs)."""
        self._forget(stream)
        if stream._put(error=error):
            try:
                stream.loop.call_soon_threadsafe(_set_ready, [stream])
            except RuntimeError:        # its event loop is closed: nobody is listening any more
                pass

    def _take_snapshot(self):
        try:
            self._snapshot = (now(), self.engine.metrics())    # one tuple: readers see time and dict together
        except Exception:               # noqa: BLE001 (metrics must never stop the loop)
            logger.exception("engine.metrics() failed")

    # ---- latency metrics (engine thread) -------------------------------------------------------------
    def _record_tokens(self, stream, out, t):
        m = self.metrics
        if m is None:
            return
        for c in out.outputs:
            k = len(c.delta_token_ids)
            if not k:
                continue
            if stream._first_token_time is None:
                stream._first_token_time = t
                m.first_token(t - stream.arrival_time, len(stream.prompt_token_ids))
            last = stream._last_token_time.get(c.index)
            if last is not None:        # k tokens since `last`: k gaps of (t - last) / k each
                m.inter_token((t - last) / k, k)
            stream._last_token_time[c.index] = t
            m.generated(k)

    def _record_finished(self, stream, reason, out, t):
        """Count a request that ended (finished, aborted, failed) in the metrics: once, whichever path
        ends it."""
        if self.metrics is None or stream._counted:
            return
        stream._counted = True
        if out is not None:
            reasons = [c.finish_reason for c in out.outputs]
            reason = reasons[0] if len(set(reasons)) == 1 else "mixed"
        self.metrics.finished(reason, t - stream.arrival_time)
