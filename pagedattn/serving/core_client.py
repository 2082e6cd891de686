"""CoreClient: the one front of the engine, the API side of the engine cores, wherever they run.

    client = CoreClient.start(config)          # ServeConfig: a core thread (in_process) or core processes
    client = CoreClient.in_thread(LLM(model_dir))                  # a core thread on an LLM built here
    async for out in client.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32)):
        print(out.outputs[0].delta_text, end="")
    client.shutdown()

or, when the cores were started elsewhere (the launcher, another node): CoreClient(["ipc://...", ...]).

Work split. The core (pagedattn.serving.engine_core) schedules, runs steps and sends token ids. Here, on
the API side: tokenizing and validating a request (InvalidRequestError at once, before a byte of a
response is sent), choosing a core for it, and turning each step's token ids into text: incremental
detokenization (pagedattn.engine.detokenizer, the same code LLM.generate uses) and stop strings. A stop
string ends its completion here; the token ids after it are dropped and the core is told to stop
computing it. So the text, token ids, logprobs and finish reasons are exactly those of LLM.generate.

Threads. One receiver thread waits on every core's socket (its Python runs only when a message came):
metrics snapshots and deaths it applies itself; step messages it hands, raw, to the event loop that
serves the requests (one wake-up for every message waiting), and that loop walks the entries (one per
completion that advanced), detokenizes and marks each request's stream as having news; then, once for
all the messages it processed, it wakes the streams' readers, or pushes to the streams that have a writer
(a streamed HTTP response writes its bytes right there: RequestStream.push_to). The RequestOutput (token
ids, text, deltas since the reader last took one) is built only when the reader takes it (or it is
pushed: pagedattn.serving.stream), so a stream that lags costs nothing per step. All the Python of a
step's outputs thus runs on the thread that writes the responses: no second thread competes with it for
the GIL (a thread that has to win the GIL back after every socket write would wait up to the
interpreter's switch interval each time). Without a running loop (the one that added the requests
closed) the receiver thread does that work itself. Commands go out from the callers' threads on one PUSH
socket per core (under a lock). Closing a stream early aborts its request in its core, which frees the
blocks before the next step.

Routing (data parallelism): a request goes to the live core with the least load, running + waiting
sequences from that core's latest snapshot plus what this client sent it since, ties broken by KV usage.

Faults. A core whose connection drops (the process died, or a peer silent past the ZMTP heartbeat
timeout), a local core (process or thread) that ended, or a core that says it is Dead: every stream it
was serving ends with EngineDeadError, `is_alive` turns False (so /health fails) and new requests are
refused. Nothing is restarted behind the caller's back.
"""
import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
import uuid

import msgspec
import zmq

from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.outputs import CompletionOutput, RequestOutput
from pagedattn.engine.requests import InputProcessor
from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import SamplingParams
from pagedattn.serving import engine_core as ec
from pagedattn.serving import messages as m
from pagedattn.serving.metrics import aggregate_metrics
from pagedattn.serving.processes import stop_processes
from pagedattn.serving.stream import (EngineDeadError, EngineStepError, RequestFailedError, RequestStream,
                                      engine_dead, set_ready)

logger = logging.getLogger("pagedattn.serving")
now = time.perf_counter


class _Completion:
    """The API side's state of one completion: its token ids, logprobs, text (changed only by the thread
    that processes step messages, under the client's _proc_lock)."""
    __slots__ = ("index", "token_ids", "logprobs", "cumulative", "detok", "finish_reason", "text",
                 "num_sent_tokens", "num_sent_chars", "last_token_time")

    def __init__(self, index, tokenizer, params):
        self.index = index
        self.token_ids = []
        self.logprobs = [] if params.logprobs else None
        self.cumulative = 0.0
        self.detok = IncrementalDetokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.finish_reason = None
        self.text = None                # final text
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.last_token_time = None

    def output(self, full=True):
        """The CompletionOutput of what is known, with the delta since the last call. full=False: token_ids,
        logprobs and text hold the delta alone (a streamed response sends no more; copying the whole
        completion into every output made a long stream's cost per token grow with its length)."""
        if self.finish_reason is not None and self.text is None:
            self.text = self.detok.finish() if self.detok is not None else ""
        if self.text is not None:
            text = self.text
        else:
            text = self.detok.releasable if self.detok is not None else ""
        sent_tokens, sent_chars = self.num_sent_tokens, self.num_sent_chars
        delta_ids, delta_text = self.token_ids[sent_tokens:], text[sent_chars:]
        self.num_sent_tokens, self.num_sent_chars = len(self.token_ids), max(sent_chars, len(text))
        if full:
            return CompletionOutput(self.index, text, list(self.token_ids), self.finish_reason, self.cumulative,
                                    None if self.logprobs is None else list(self.logprobs), delta_text, delta_ids)
        return CompletionOutput(self.index, delta_text, delta_ids, self.finish_reason, self.cumulative,
                                None if self.logprobs is None else self.logprobs[sent_tokens:], delta_text, delta_ids)


class _Request:
    """One request in flight: its stream, core, wire id and completions."""
    __slots__ = ("stream", "core", "wire_id", "completions", "n", "num_finished", "first_token_time")

    def __init__(self, stream, core, wire_id, tokenizer):
        params = stream.params
        self.stream, self.core, self.wire_id, self.n = stream, core, wire_id, params.n
        self.completions = [_Completion(i, tokenizer, params) for i in range(params.n)]
        self.num_finished = 0
        self.first_token_time = None


class _Core:
    """The client's view of one engine core: its sockets, what it reported, its load. runner: the local
    process or CoreThread that runs it, when this client owns it."""

    def __init__(self, rank, address, ctx, identity, runner=None):
        self.rank, self.address, self.runner = rank, address, runner
        in_ep, out_ep = m.core_endpoints(address)
        self.push = m.configure(ctx.socket(zmq.PUSH))
        self.dealer = m.configure(ctx.socket(zmq.DEALER))
        self.dealer.setsockopt(zmq.ROUTING_ID, identity)
        self.monitor = self.dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.push.connect(in_ep)
        self.dealer.connect(out_ep)
        self.lock = threading.Lock()    # guards `push` (any thread sends)
        self.info = None                # Ready.info
        self.snapshot = {}              # its latest engine.metrics()
        self.snapshot_token = 0
        self.sent_since_snapshot = 0
        self.error = None               # set when it died

    def ended(self):
        """Why the local core is gone ("" while it runs, or when this client does not own it)."""
        r = self.runner
        if r is None or r.is_alive():
            return ""
        if isinstance(r, ec.CoreThread):
            return "the engine core thread ended"
        return f"the engine core process exited (exit code {r.exitcode})"

    @property
    def load(self):
        s = self.snapshot
        return (s.get("num_running", 0) + s.get("num_waiting", 0) + self.sent_since_snapshot,
                s.get("kv_cache_usage", 0.0), self.rank)

    def close(self):
        for s in (self.monitor, self.push, self.dealer):
            s.close(0)


class CoreClient:
    """A client of one or more engine cores (data-parallel ranks): what build_app serves.

    addresses: the cores' addresses (messages.core_endpoints). runners: the local cores this client owns,
    stopped by shutdown() (core processes, or a CoreThread), in the order of `addresses`, or None.
    metrics: ServingMetrics-like recorder or None (build_app attaches one). stream_interval: wake a
    stream's reader once at least this many new tokens wait (the first tokens and the final output at
    once). ready_timeout_s: how long to wait for every core to answer (loading a model takes a while).
    ctx: the ZMQ context (an inproc:// core's: its sockets live in it), or None for a new one.
    """

    def __init__(self, addresses, runners=None, metrics=None, stream_interval=1, ready_timeout_s=600.0, ctx=None):
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise InvalidRequestError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.metrics = metrics
        self.stream_interval = stream_interval
        self.runners = list(runners or [])
        self.error = None
        self.num_step_errors = 0
        self._identity = uuid.uuid4().bytes
        self._ctx = zmq.Context() if ctx is None else ctx
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(m.CoreMessage)
        runners = self.runners + [None] * (len(addresses) - len(self.runners))
        self._cores = [_Core(r, a, self._ctx, self._identity, p) for r, (a, p) in enumerate(zip(addresses, runners))]
        self._streams = {}              # request_id -> RequestStream, accepted and not yet forgotten
        self._live = {}                 # wire id -> _Request, as the receiver thread serves them
        self._lock = threading.Lock()   # guards _streams / _live changes and the metrics recorder
        self._wire_ids = itertools.count(1)
        self._request_ids = itertools.count()
        self._snapshot_tokens = itertools.count(1)
        self._stopping = False
        self._socket_addresses = None   # local core addresses whose directory shutdown() removes (start())
        # Step messages on their way from the receiver thread to the loop that processes them.
        self._loop = None               # the event loop of the latest request (processes step messages)
        self._inbox = collections.deque()
        self._inbox_lock = threading.Lock()
        self._scheduled = False         # a _process_inbox call is queued on _loop
        self._proc_lock = threading.RLock()     # one thread at a time processes outputs or builds them
        try:
            self._handshake(ready_timeout_s)
        except BaseException:
            self._close_sockets()
            if ctx is None:             # (a context given to it is its giver's to end)
                self._ctx.term()
            raise
        info = [c.info for c in self._cores]
        self.model_path = info[0]["model_path"]
        self.info = info
        from pagedattn.engine.llm_engine import load_tokenizer
        self.tokenizer = load_tokenizer(self.model_path)            # the request threads' copy
        self._detok_tokenizer = load_tokenizer(self.model_path)     # the receiver thread's own copy
        small = min(info, key=lambda i: i["num_blocks"] * i["block_size"])
        self._inputs = InputProcessor(self.tokenizer, min(i["vocab_size"] for i in info),
                                      min(i["max_model_len"] for i in info), min(i["max_num_seqs"] for i in info),
                                      small["block_size"], small["num_blocks"], self.model_path)
        self._thread = threading.Thread(target=self._run, name="pagedattn-core-client", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config, addresses=None):
        """A client owning the cores `config` (ServeConfig) asks for: with config.in_process, one core on a
        thread of this process (its LLM built here, engine_hook applied); else config.data_parallel_size
        core processes listening on `addresses` (default: private ipc:// paths, removed by shutdown())."""
        if config.in_process:
            return cls.in_thread(ec.build_llm(config), config.prefill_delay_factor,
                                 stream_interval=config.stream_interval, ready_timeout_s=config.startup_timeout_s)
        own_addresses = addresses is None
        procs, addresses = ec.start_engine_cores(config, addresses)
        try:
            client = cls(addresses, procs, stream_interval=config.stream_interval,
                         ready_timeout_s=config.startup_timeout_s)
        except BaseException:
            stop_processes(procs)
            if own_addresses:
                ec.remove_socket_dir(addresses)
            raise
        client._socket_addresses = addresses if own_addresses else None    # removed by shutdown()
        return client

    @classmethod
    def in_thread(cls, llm, prefill_delay_factor=ec.PREFILL_DELAY_FACTOR, **kwargs):
        """A client owning one engine core on `llm` (a pagedattn.LLM, owned by the core from now on: closed
        at shutdown()) that runs on a thread of this process, over inproc:// sockets. kwargs: __init__'s."""
        ctx = zmq.Context()
        thread, address = ec.start_core_thread(llm, ctx, prefill_delay_factor)
        try:
            return cls([address], [thread], ctx=ctx, **kwargs)
        except BaseException:
            thread.stop()
            thread.join(30)
            if not thread.is_alive():
                ctx.term()
            raise

    @property
    def engine_core(self):
        """The EngineCore when this client's core runs on a thread of this process (None otherwise): its
        `engine` may be read once wait_until_idle() returned (the tests check its blocks that way)."""
        runner = self.runners[0] if len(self.runners) == 1 else None
        return runner.core if isinstance(runner, ec.CoreThread) else None

    @property
    def processes(self):
        """The local core processes this client owns."""
        return [r for r in self.runners if not isinstance(r, ec.CoreThread)]

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

    def _handshake(self, timeout):
        """Say Hello to every core and wait for each one's Ready and first metrics snapshot (the core sends
        both at once), so engine_metrics() has every core's figures from the start (a local core that
        exits first fails it)."""
        for core in self._cores:
            core.dealer.send(self._encoder.encode(m.Hello(self._identity)))
        deadline = now() + timeout
        by_socket = {id(c.dealer): c for c in self._cores}
        pending = dict(by_socket)
        poller = zmq.Poller()
        for c in self._cores:
            poller.register(c.dealer, zmq.POLLIN)
        while pending:
            for sock, _ in poller.poll(100):
                core = by_socket[id(sock)]
                msg = self._decoder.decode(sock.recv())
                if isinstance(msg, m.Ready):
                    core.info = msg.info
                elif isinstance(msg, m.Stats):
                    core.snapshot = msg.metrics
                elif isinstance(msg, m.Dead):
                    raise EngineDeadError(f"engine core {msg.rank} failed to start: {msg.reason}")
                if core.info is not None and core.snapshot:
                    pending.pop(id(sock), None)
            for core in pending.values():
                if core.ended():
                    raise EngineDeadError(f"engine core {core.rank} did not start: {core.ended()}; see its log above")
            if pending and now() > deadline:
                raise TimeoutError(f"engine core(s) {sorted(c.rank for c in pending.values())} did not answer "
                                   f"within {timeout} s")

    # ---- what build_app uses -------------------------------------------------------------------
    @property
    def max_model_len(self):
        return self._inputs.max_model_len

    @property
    def max_request_tokens(self):
        """The most tokens (prompt + generated) one request can ever hold on any core."""
        return min(self._inputs.max_model_len, self._inputs.num_blocks * self._inputs.block_size)

    @property
    def data_parallel_size(self):
        return len(self._cores)

    def tokenize(self, prompt):
        """prompt: str -> list[int] without special tokens (token ids pass through: validation checks them).
        A prompt over max_model_len tokens raises InvalidRequestError here (InputProcessor.tokenize)."""
        if not isinstance(prompt, str):
            return prompt
        return self._inputs.tokenize(prompt)

    def add_request(self, prompt, params=None, request_id=None):
        """Validate and send one request to the least-loaded core; returns its RequestStream. Call from a
        coroutine. Raises InvalidRequestError naming the field, EngineDeadError once a core has died."""
        if self.error is not None:
            raise engine_dead(self.error) from self.error
        params = SamplingParams() if params is None else params
        request_id = f"req-{next(self._request_ids)}" if request_id is None else request_id
        ids = self._inputs.validate(self.tokenize(prompt), params)
        stream = RequestStream(self, request_id, prompt, ids, params, asyncio.get_running_loop())
        self._loop = stream.loop
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already running")
            core = min((c for c in self._cores if c.error is None), key=lambda c: c.load)
            core.sent_since_snapshot += params.n
            wire_id = next(self._wire_ids)
            stream._wire_id = wire_id
            self._streams[request_id] = stream
            self._live[wire_id] = _Request(stream, core, wire_id, self._detok_tokenizer)
        self._send(core, m.AddRequest(self._identity, wire_id, ids, params))
        return stream

    def engine_metrics(self):
        """engine.metrics() summed over the cores (aggregate_metrics), from their latest snapshots."""
        return aggregate_metrics([c.snapshot for c in self._cores])

    def engine_metrics_per_rank(self):
        """Each core's latest engine.metrics() snapshot, in rank order."""
        return [dict(c.snapshot) for c in self._cores]

    def wait_until_idle(self, timeout=60.0):
        """Block (a plain thread) until no request is in flight here and every live core holds no sequence
        (every finish and abort applied, blocks free). Returns engine_metrics() then; raises TimeoutError.
        Never call it on the loop that serves the requests: that loop processes the step messages."""
        deadline = now() + timeout
        while self.num_requests_in_flight:
            if now() > deadline:
                raise TimeoutError(f"{self.num_requests_in_flight} request(s) still in flight")
            time.sleep(0.005)
        while True:
            token = next(self._snapshot_tokens)
            live = [c for c in self._cores if c.error is None]
            for core in live:
                self._send(core, m.TakeSnapshot(self._identity, token))
            while any(c.snapshot_token < token for c in live if c.error is None):
                if now() > deadline:
                    raise TimeoutError("an engine core did not answer a snapshot request")
                time.sleep(0.005)
            if all(not c.snapshot.get("num_running") and not c.snapshot.get("num_waiting") for c in live):
                return self.engine_metrics()
            if now() > deadline:
                raise TimeoutError(f"the engine is still busy: {self.engine_metrics()}")
            time.sleep(0.01)

    @property
    def num_requests_in_flight(self):
        with self._lock:
            return len(self._streams)

    @property
    def is_alive(self):
        return self.error is None and self._thread.is_alive()

    def shutdown(self, timeout=30.0):
        """Stop the receiver thread and the cores this client owns (a core thread closes its LLM); open
        streams get EngineDeadError. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for core in self._cores:
            if core.runner is not None and core.error is None:
                with contextlib.suppress(Exception):
                    self._send(core, m.Shutdown())
        self._thread.join(timeout)
        deadline = now() + timeout
        for r in self.runners:
            r.join(max(0.0, deadline - now()))
        stop_processes(self.processes, timeout=5.0)
        self._close_sockets()
        if any(r.is_alive() for r in self.runners):
            # a core thread stuck in a step still has sockets in this context: term() would wait for it
            logger.error("the engine core thread did not stop within %s s; leaving its ZMQ context open", timeout)
        else:
            self._ctx.term()
        if self._socket_addresses:      # (start() made them)
            ec.remove_socket_dir(self._socket_addresses)

    def _close_sockets(self):
        for core in self._cores:
            core.close()

    # ---- stream callbacks (RequestStream calls these) -------------------------------------------------
    def _abort(self, stream):
        """The consumer closed the stream early: stop the request in its core."""
        with self._lock:
            self._forget(stream)
            req = self._live.pop(stream._wire_id, None)
            if req is not None and self.metrics is not None:
                self.metrics.finished("abort", now() - stream.arrival_time)
        if req is not None and req.core.error is None:
            self._send(req.core, m.AbortRequests(self._identity, [req.wire_id]))

    def _forget(self, stream):
        """Drop a request from the table of accepted ones (call with _lock held)."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _send(self, core, msg):
        data = self._encoder.encode(msg)
        with core.lock:
            core.push.send(data, zmq.NOBLOCK)

    # ---- the receiver thread -------------------------------------------------------------------------
    def _run(self):
        poller = zmq.Poller()
        by_socket = {}
        for core in self._cores:
            poller.register(core.dealer, zmq.POLLIN)
            poller.register(core.monitor, zmq.POLLIN)
            by_socket[core.dealer] = (core, False)
            by_socket[core.monitor] = (core, True)
        try:
            while not self._stopping:
                for sock, _ in poller.poll(100):
                    core, is_monitor = by_socket[sock]
                    if is_monitor:
                        self._monitor_event(core)
                    else:
                        self._drain(core)
                if self._inbox and (self._loop is None or self._loop.is_closed()):
                    self._process_inbox()           # the loop that was to process them is gone
                for core in self._cores:
                    # ended, and (read after that) no stop was asked for: a stop sets _stopping before it asks
                    if core.error is None and core.ended() and not self._stopping:
                        self._drain(core)           # (a core that failed said why before it ended)
                        if core.error is None:
                            self._core_died(core, core.ended())
        except BaseException as e:  # noqa: BLE001 (report, do not vanish)
            logger.exception("the core client's receiver thread died")
            self.error = self.error or e
        finally:
            if self.error is None:
                self.error = EngineDeadError("the engine has been shut down")
            with self._proc_lock:
                self._inbox.clear()
            self._fail_streams(list(self._live.values()), self.error)

    def _monitor_event(self, core):
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(core.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED and core.error is None and not self._stopping:
                self._core_died(core, "lost the connection to the engine core (it exited or stopped answering)")

    def _drain(self, core):
        while True:
            try:
                data = core.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decoder.decode(data)
            if isinstance(msg, m.StepOutputs):
                self._dispatch(core, msg)
            elif isinstance(msg, m.Stats):
                core.snapshot = msg.metrics
                core.sent_since_snapshot = 0
                if msg.token:
                    core.snapshot_token = max(core.snapshot_token, msg.token)
            elif isinstance(msg, m.Dead):
                self._core_died(core, f"engine core {core.rank} died: {msg.reason}")

    def _dispatch(self, core, msg):
        """(receiver thread) A step message to process on the requests' event loop, in arrival order; on
        this thread when there is no loop to run it."""
        self._inbox.append((core, msg))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with self._inbox_lock:
                if self._scheduled:
                    return
                self._scheduled = True
            try:
                loop.call_soon_threadsafe(self._process_inbox)
                return
            except RuntimeError:            # closed meanwhile
                with self._inbox_lock:
                    self._scheduled = False
        self._process_inbox()

    def _process_inbox(self):
        """Process every step message waiting, oldest first (on the loop, or the receiver thread), then wake
        the streams they brought news to: a stream behind by several steps is woken (written) once."""
        with self._inbox_lock:
            self._scheduled = False
        woken = {}                      # loop -> streams due: woken once, after every message waiting
        with self._proc_lock:
            while self._inbox:
                core, msg = self._inbox.popleft()
                try:
                    self._on_step(core, msg, woken)
                except Exception as e:  # noqa: BLE001 (a bug here: fail loudly, never silently stall streams)
                    logger.exception("processing a step message failed")
                    self.error = self.error or EngineDeadError(f"the engine client failed: {e!r}")
                    self._fail_streams(list(self._live.values()), self.error)
            self._wake(woken)

    def _output_of(self, req):
        """The RequestOutput of `req` as it stands (deltas since the consumer's last one; only those where the
        stream asks for deltas_only)."""
        stream = req.stream
        full = not stream.deltas_only
        with self._proc_lock:
            return RequestOutput(stream.request_id, stream.prompt, stream.prompt_token_ids,
                                 [c.output(full) for c in req.completions], req.num_finished == req.n)

    def _core_died(self, core, reason):
        logger.error("engine core %d: %s", core.rank, reason)
        err = EngineDeadError(f"the engine has stopped: {reason}")
        core.error = err
        self.error = self.error or err
        with self._proc_lock:
            self._fail_streams([r for r in list(self._live.values()) if r.core is core], err)

    def _fail_streams(self, requests, error):
        woken = {}
        for req in requests:
            with self._lock:
                if self._live.pop(req.wire_id, None) is None:
                    continue
                self._forget(req.stream)
            if req.stream._put(error=error):
                woken.setdefault(req.stream.loop, []).append(req.stream)
        self._wake(woken)

    def _on_step(self, core, msg, woken):
        """One step's outputs from `core`: detokenize, stop strings, news for each request's stream (the
        streams due added to woken: loop -> streams)."""
        t = now()
        step = m.decode_step(msg)
        wire_ids, index, counts = step["wire_ids"].tolist(), step["index"].tolist(), step["num_tokens"].tolist()
        tokens, finish = step["token_ids"].tolist(), step["finish"].tolist()
        logprobs, cumulative = step["logprobs"], step["cumulative"].tolist()
        touched, failed, recorded = {}, [], []
        live, offset = self._live, 0
        for wid, i, k, cum, code in zip(wire_ids, index, counts, cumulative, finish):
            start, offset = offset, offset + k
            req = live.get(wid)
            if req is None:                         # aborted meanwhile
                continue
            comp = req.completions[i]
            if comp.finish_reason is not None:      # ended here (a stop string) before the core knew
                continue
            new = tokens[start:offset]
            stopped_at = None
            if comp.detok is not None:
                try:
                    for j, tok in enumerate(new):
                        if comp.detok.add(tok):
                            stopped_at = j
                            break
                except Exception as e:  # noqa: BLE001 (this request's text failed: it ends alone)
                    touched.pop(wid, None)
                    failed.append((req, f"detokenizing completion {comp.index} failed: {e!r}"))
                    continue
            if stopped_at is not None:
                new = new[:stopped_at + 1]
            n_new = len(new)
            touched[wid] = (req, touched[wid][1] + n_new) if wid in touched else (req, n_new)
            comp.token_ids += new
            if comp.logprobs is not None:
                comp.logprobs += logprobs[start:start + n_new].tolist()
            # the core's cumulative log-probability counts the tokens dropped after a stop string too
            comp.cumulative = cum if n_new == k else cum - float(logprobs[start + n_new:offset].sum())
            if n_new:
                recorded.append((req, comp, n_new))
            if stopped_at is not None:
                comp.finish_reason = "stop"
                if code == 0:                       # the core still runs it
                    self._send(core, m.StopCompletion(self._identity, wid, comp.index))
            elif code:
                comp.finish_reason = m.FINISH_REASONS[code]
            if comp.finish_reason is not None:
                req.num_finished += 1
        self._record_tokens(recorded, t)
        for req, n_new in touched.values():
            self._deliver(req, n_new, t, woken)
        errors = [(req.wire_id, "failed", message) for req, message in failed]
        for req, _ in failed:
            self._send(core, m.AbortRequests(self._identity, [req.wire_id]))      # the core frees its blocks
        if any(kind == "step" for _, kind, _ in step["errors"]):
            self.num_step_errors += 1               # (one failed step: every request it was running)
        for wid, kind, message in errors + list(step["errors"]):
            req = self._live.get(wid)
            if req is None:
                continue
            if kind == "step":
                err = EngineStepError(f"the engine step failed while this request was running: {message}")
                reason = "error"
            elif kind == "failed":
                err = RequestFailedError(message)
                reason = "error"
            else:
                err = InvalidRequestError(message)
                reason = None
            with self._lock:
                self._live.pop(wid, None)
                self._forget(req.stream)
                if reason is not None and self.metrics is not None:
                    self.metrics.finished(reason, t - req.stream.arrival_time)
            if req.stream._put(error=err):
                woken.setdefault(req.stream.loop, []).append(req.stream)

    def _deliver(self, req, num_tokens, t, woken):
        stream = req.stream
        finished = req.num_finished == req.n
        if finished:
            with self._lock:
                self._live.pop(req.wire_id, None)
                self._forget(stream)
                if self.metrics is not None:
                    reasons = {c.finish_reason for c in req.completions}
                    self.metrics.finished(reasons.pop() if len(reasons) == 1 else "mixed", t - stream.arrival_time)
        if stream._put(req, num_tokens, finished):
            woken.setdefault(stream.loop, []).append(stream)

    def _wake(self, woken):
        here = asyncio._get_running_loop()
        for loop, streams in woken.items():
            if loop is here:                    # processing on the streams' own loop: wake them directly
                set_ready(streams)
                continue
            try:
                loop.call_soon_threadsafe(set_ready, streams)
            except RuntimeError:                # that loop is closed: nobody reads these streams any more
                for stream in streams:
                    stream.abort()

    def _record_tokens(self, recorded, t):
        """The latency metrics of one step's tokens: recorded = [(request, completion, new tokens)]."""
        m = self.metrics
        if m is None or not recorded:
            return
        with self._lock:
            total, gaps = 0, {}         # (previous token's time, tokens) -> completions: mostly one key a step
            for req, comp, k in recorded:
                if req.first_token_time is None:
                    req.first_token_time = t
                    m.first_token(t - req.stream.arrival_time, len(req.stream.prompt_token_ids))
                if comp.last_token_time is not None:
                    key = (comp.last_token_time, k)
                    gaps[key] = gaps.get(key, 0) + 1
                comp.last_token_time = t
                total += k
            for (last, k), n in gaps.items():
                m.inter_token((t - last) / k, k * n)
            m.generated(total)
