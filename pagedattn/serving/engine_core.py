"""The engine core: the scheduler and the model in a process of their own, driven over ZMQ.

    procs, addresses = start_engine_cores(dict(model=path, device="cuda"), data_parallel_size=2)
    client = CoreClient(addresses, processes=procs)            # pagedattn.serving.core_client

Why a process. The HTTP server spends Python time on every token of every stream (JSON, SSE framing, a
socket write); in the same interpreter as the engine it takes the GIL the engine needs between two GPU
launches, and the GPU idles. Here the engine loop owns an interpreter: it only schedules, runs steps
and ships the sampled token ids out. Text (incremental detokenization, stop strings) is made in the
API process(es), which is also where the per-token cost now lives.

Sockets. A core binds two endpoints derived from one address (`core_endpoints`):
  input   PULL  every API process PUSHes its commands here (add, abort, stop a completion, snapshot);
  output  ROUTER every API process connects a DEALER with its own identity and says Hello; the core
                 answers Ready, then sends that client its requests' outputs and the metrics snapshots.
ZMQ queues commands while a step runs; the loop drains them between steps (requests join and leave
between steps, which is what continuous batching wants). An API process that went away is noticed on
the next send to it (ROUTER_MANDATORY: EHOSTUNREACH) and its requests are aborted, so their blocks free.

Messages are msgspec structs (msgpack, tagged unions; `ClientMessage`, `CoreMessage`). Per step, each
client with news gets ONE StepOutputs: one entry per completion that advanced, as flat arrays

    wire_ids     int64  [E]   the client's number for the request
    index        int32  [E]   which of its n completions
    num_tokens   int32  [E]   how many new tokens the entry has (0 for a bare finish)
    token_ids    int32  [T]   every entry's new tokens, back to back (T = sum of num_tokens)
    logprobs     float64[T]   their log-probabilities (0 where the request did not ask)
    cumulative   float64[E]   the completion's cumulative log-probability
    finish       int8   [E]   0 running, else FINISH_REASONS[code]

plus `finished` (requests with every completion done) and `errors` ((wire id, kind, message): a request
refused when added, "invalid"; failed alone in the engine, its row's token outside the vocabulary say,
"failed"; or failed by a raising step, "step"). Nothing is one object per token.

Faults. A step that raises fails the requests in flight (each gets a "step" error) and the loop goes on.
If even aborting them fails, the core tells every client it is Dead and exits; a core that is killed
says nothing, and the clients see the connection drop (pagedattn.serving.core_client).
"""
import contextlib
import ctypes
from array import array
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

import msgspec
import numpy as np
import zmq

from pagedattn.engine.outputs import StepDeltas
from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger("pagedattn.serving")
now = time.perf_counter

FINISH_REASONS = (None, "stop", "length", "abort")
_FINISH_CODE = {r: i for i, r in enumerate(FINISH_REASONS)}

# A metrics snapshot costs a pass over the running sequences: at most this often while busy, and once
# each time the core goes idle (so an idle core's snapshot is exact).
SNAPSHOT_INTERVAL_S = 0.05
# While idle the loop wakes this often to check for a stop request or a parent that is gone.
IDLE_POLL_MS = 100
# Admission (see EngineCore): while sequences decode, new requests wait until this many times the last
# prefill step's duration has passed since it ended. A step that holds a prompt chunk costs far more than
# a decode step on a GPU (it runs eagerly, a decode step replays a CUDA graph) and every running stream
# waits for it; requests arriving one by one would otherwise make nearly every step such a step. With
# factor f, prefill steps take at most about 1 / (1 + f) of the time while streams decode.
PREFILL_DELAY_FACTOR = 2.0
MAX_HOLD_S = 0.2            # never longer than this (a prefill timed during a host hiccup)
# ZMTP heartbeats (the ZMQ I/O thread sends them, whatever Python is doing): a peer silent this long
# (a dead host, a cut network) counts as disconnected.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10000


# ---- messages -----------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True, array_like=True):
    """Client -> core, on the output socket: register `client` (its DEALER identity)."""
    client: bytes


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    client: bytes
    wire_id: int
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    client: bytes
    wire_ids: list[int]


class StopCompletion(msgspec.Struct, tag=True, array_like=True):
    """Completion `index` of a request ended in the API process (a stop string): stop computing it."""
    client: bytes
    wire_id: int
    index: int


class TakeSnapshot(msgspec.Struct, tag=True, array_like=True):
    """Answer with a Stats carrying `token`, taken after every command sent before this one."""
    client: bytes
    token: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Core -> client, the answer to Hello: what the API side needs to validate requests."""
    rank: int
    info: dict


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    rank: int
    wire_ids: bytes
    index: bytes
    num_tokens: bytes
    token_ids: bytes
    logprobs: bytes
    cumulative: bytes
    finish: bytes
    finished: list[int]
    errors: list[tuple[int, str, str]]


class Stats(msgspec.Struct, tag=True, array_like=True):
    rank: int
    token: int              # the TakeSnapshot it answers, 0 when sent unasked
    metrics: dict


class Dead(msgspec.Struct, tag=True, array_like=True):
    rank: int
    reason: str


ClientMessage = Hello | AddRequest | AbortRequests | StopCompletion | TakeSnapshot | Shutdown
CoreMessage = Ready | StepOutputs | Stats | Dead


def core_endpoints(address):
    """The (input, output) ZMQ endpoints of a core address: "tcp://host:P" -> ports P and P + 1,
    "ipc://path" -> "ipc://path-in" and "ipc://path-out"."""
    if address.startswith("tcp://"):
        head, _, port = address.rpartition(":")
        return f"{head}:{int(port)}", f"{head}:{int(port) + 1}"
    if address.startswith("ipc://"):
        return address + "-in", address + "-out"
    raise ValueError(f"engine core address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")


def encode_step(rank, entries, finished, errors):
    """A StepOutputs from entries [(wire id, index, token ids, logprobs or None, cumulative, finish)]."""
    if not entries:
        empty = b""
        return StepOutputs(rank, empty, empty, empty, empty, empty, empty, empty, finished, errors)
    wire_ids, index, toks, lps, cumulative, reasons = zip(*entries)        # one pass per column, in C
    # array.array packs a list of Python numbers in C, several times faster than np.array for a few
    # hundred (native byte order and sizes: what decode_step's np.frombuffer reads on the same machine
    # kind; 'q' int64, 'i' int32, 'd' float64)
    num_tokens = array("i", map(len, toks))
    tokens = array("i", itertools.chain.from_iterable(toks))
    if lps.count(None) != len(lps):
        logprobs = array("d", itertools.chain.from_iterable(
            x if x is not None else [0.0] * n for x, n in zip(lps, num_tokens))).tobytes()
    else:
        logprobs = bytes(8 * len(tokens))           # float64 zeros
    if None in cumulative:
        cumulative = [c or 0.0 for c in cumulative]
    return StepOutputs(rank, array("q", wire_ids).tobytes(), array("i", index).tobytes(), num_tokens.tobytes(),
                       tokens.tobytes(), logprobs, array("d", cumulative).tobytes(),
                       bytes(map(_FINISH_CODE.__getitem__, reasons)), finished, errors)


def decode_step(msg):
    """StepOutputs -> dict of numpy arrays (views of the message's buffers) and the two lists."""
    return dict(wire_ids=np.frombuffer(msg.wire_ids, np.int64), index=np.frombuffer(msg.index, np.int32),
                num_tokens=np.frombuffer(msg.num_tokens, np.int32), token_ids=np.frombuffer(msg.token_ids, np.int32),
                logprobs=np.frombuffer(msg.logprobs, np.float64), cumulative=np.frombuffer(msg.cumulative, np.float64),
                finish=np.frombuffer(msg.finish, np.int8), finished=msg.finished, errors=msg.errors)


# ---- the core ---------------------------------------------------------------------------------------------
class EngineCore:
    """One engine (an LLM, which may itself be tensor-parallel) behind a core address.

    llm: pagedattn.LLM, owned from now on (closed when the loop ends). address: see core_endpoints;
    the core binds it. rank: this core's data-parallel rank (reported in every message).

    Admission: a request that arrives while sequences decode (and none waits in the engine) is held
    here until prefill_delay_factor x the last prefill's duration has passed since that prefill ended,
    then every held request joins the engine at once: arrivals share one prefill step instead of making
    one each. An idle engine, one with requests already waiting, or held prompts that fill half a step's
    token budget (a crowd: its prefill step is efficient as it is) take them at once; 0 turns the
    holding off. Held requests count as waiting in the metrics (routing, wait_until_idle).
    """

    def __init__(self, llm, address, rank=0, prefill_delay_factor=PREFILL_DELAY_FACTOR):
        from pagedattn.engine.output_processor import OutputProcessor

        self.llm, self.engine, self.rank = llm, llm.engine, rank
        engine = self.engine
        # No text in the core: the API side detokenizes and checks stop strings. An output processor
        # without a tokenizer still applies EOS, stop token ids and the length limits; deltas_only: a
        # step's outputs hold its new tokens only (no cumulative list is copied per step).
        engine.outputs = OutputProcessor(None, engine.eos_token_ids, engine.max_model_len, deltas_only=True)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.ctx = zmq.Context()
        in_ep, out_ep = core_endpoints(address)
        self.input = self.ctx.socket(zmq.PULL)
        self.output = self.ctx.socket(zmq.ROUTER)
        for s in (self.input, self.output):
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.output.setsockopt(zmq.ROUTER_MANDATORY, 1)     # a send to a vanished client raises
        self.input.bind(in_ep)
        self.output.bind(out_ep)
        self.clients = set()            # identities that said Hello and are still reachable
        self.stopping = False
        self.last_snapshot = 0.0
        self.idle_snapshot_sent = False
        if not prefill_delay_factor >= 0:
            raise ValueError(f"prefill_delay_factor must be >= 0, got {prefill_delay_factor!r}")
        self.prefill_delay_factor = float(prefill_delay_factor)
        self.held = []                  # AddRequests not yet given to the engine, in arrival order
        self.hold_until = 0.0           # hold new requests until then (while sequences decode)
        self.prefill_s = 0.0            # the latest admission's prefill, as timed over the steps after it
        self.steps_to_time = 0          # step() calls after an admission still to time
        self.num_admissions = 0

    def info(self):
        e, cfg = self.engine, self.engine.config
        return dict(model_path=e.model_path, max_model_len=e.max_model_len, num_blocks=e.num_blocks,
                    block_size=cfg.block_size, vocab_size=e.vocab_size, max_num_seqs=cfg.max_num_seqs,
                    device=str(cfg.device), dtype=str(cfg.dtype).replace("torch.", ""),
                    tensor_parallel_size=cfg.tensor_parallel_size, pid=os.getpid())

    # ---- the loop -------------------------------------------------------------------------------
    def run(self):
        """Serve until Shutdown (or stop()); closes the engine on the way out."""
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(self.output, zmq.POLLIN)
        parent = os.getppid()
        try:
            while not self.stopping:
                busy = engine.has_unfinished_requests()
                for sock, _ in poller.poll(0 if busy else IDLE_POLL_MS):
                    self._receive(sock)
                if self.stopping:
                    break
                if self.held:
                    self._admit_due()
                if not engine.has_unfinished_requests():
                    if not self.idle_snapshot_sent:
                        self._broadcast_stats()
                        self.idle_snapshot_sent = True
                    if os.getppid() != parent:          # the process that started us is gone
                        logger.error("engine core %d: parent process exited; stopping", self.rank)
                        break
                    continue
                self.idle_snapshot_sent = False
                self._step()
                if now() - self.last_snapshot >= SNAPSHOT_INTERVAL_S:
                    self._broadcast_stats()
        except BaseException as e:  # noqa: BLE001 (tell the clients why, then die)
            if not isinstance(e, (KeyboardInterrupt, SystemExit)):
                logger.exception("engine core %d died", self.rank)
                for client in list(self.clients):
                    self._send(client, Dead(self.rank, repr(e)))
            raise
        finally:
            self.close()

    def stop(self):
        self.stopping = True

    def close(self):
        with contextlib.suppress(Exception):
            self.llm.close()
        self.input.close(0)
        self.output.close(0)
        self.ctx.term()

    def _receive(self, sock):
        """Apply every message waiting on `sock`."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decoder.decode(frames[-1])
            if isinstance(msg, Hello):
                self.clients.add(msg.client)
                self._send(msg.client, Ready(self.rank, self.info()))
                self._send(msg.client, Stats(self.rank, 0, self._metrics()))     # /metrics has numbers at once
            elif isinstance(msg, AddRequest):
                self.held.append(msg)
            elif isinstance(msg, AbortRequests):
                if self.held:
                    gone = set(msg.wire_ids)
                    self.held = [m for m in self.held if m.client != msg.client or m.wire_id not in gone]
                for wid in msg.wire_ids:
                    self.engine.abort_request((msg.client, wid))
            elif isinstance(msg, StopCompletion):
                self._stop_completion(msg)
            elif isinstance(msg, TakeSnapshot):
                self._send(msg.client, Stats(self.rank, msg.token, self._metrics()))
            elif isinstance(msg, Shutdown):
                self.stopping = True
                return

    def _admit_due(self):
        """Give the held requests to the engine unless holding them is still worth it (see the class)."""
        sched = self.engine.scheduler
        if (self.prefill_delay_factor and sched.running and not sched.waiting and now() < self.hold_until
                and not self._crowd()):
            return
        held, self.held = self.held, []
        for msg in held:
            self._add(msg)
        self.num_admissions += 1
        if self.prefill_delay_factor:
            self.prefill_s, self.steps_to_time = 0.0, 2

    def _crowd(self):
        """Do the held prompts fill at least half a step's token budget? Then they make an efficient prefill
        step of their own, and holding them longer only delays them."""
        half, tokens = self.engine.config.max_num_batched_tokens / 2, 0
        for msg in self.held:
            tokens += len(msg.prompt_token_ids)
            if tokens >= half:
                return True
        return False

    def _add(self, msg):
        rid = (msg.client, msg.wire_id)        # the engine's request id: unique across clients
        try:
            self.engine.add_request(rid, msg.prompt_token_ids, msg.params, prompt_token_ids=msg.prompt_token_ids,
                                    stream=True)
        except Exception as e:  # noqa: BLE001 (this request's error, on this request's stream)
            self._send(msg.client, encode_step(self.rank, [], [], [(msg.wire_id, "invalid", str(e))]))

    def _stop_completion(self, msg):
        rid = (msg.client, msg.wire_id)
        group = self.engine.groups.get(rid)
        if group is None:
            return
        others = [s for s in group.seqs if s.index != msg.index and not s.is_finished]
        if not others and group.forked:         # its last running completion: the request is over
            self.engine.abort_request(rid)
            return
        for seq in group.seqs:
            if seq.index == msg.index:
                self.engine.free_sequence(seq, "stop")

    def _step(self):
        engine = self.engine
        t0 = now()
        try:
            outs = engine.step()
            if self.steps_to_time:
                # The admission's prefill step: the step() that launches it, or (with async scheduling) the
                # next one, which waits for it; the longer of the two.
                t = now()
                self.prefill_s = max(self.prefill_s, t - t0)
                self.steps_to_time -= 1
                if not self.steps_to_time:
                    self.hold_until = t + min(self.prefill_delay_factor * self.prefill_s, MAX_HOLD_S)
        except Exception as e:  # noqa: BLE001 (fail the requests in flight, keep serving)
            logger.error("engine core %d: step failed; aborting %d request(s): %r", self.rank, len(engine.groups), e)
            errors = {}
            for rid in list(engine.groups):
                engine.abort_request(rid)      # if this raises too, the core dies (see run)
                errors.setdefault(rid[0], []).append((rid[1], "step", f"the engine step failed: {e!r}"))
            for client, errs in errors.items():
                self._send(client, encode_step(self.rank, [], [], errs))
            return
        per_client = {}                         # client -> (entries, finished wire ids, errors)
        last = None
        for out in outs:
            client, wid = out.request_id
            if client != last:                  # consecutive outputs mostly share a client
                cols = per_client.get(client)
                if cols is None:
                    cols = per_client[client] = ([], [], [])
                entries, finished, errors = cols
                add, last = entries.append, client
            if type(out) is StepDeltas:         # a running request: (index, ids, logprobs, cumulative, finish)
                for d in out.deltas:
                    if d[1] or d[4] is not None:
                        add((wid, *d))
                continue
            if out.error is not None:           # failed alone in the engine (its blocks are already free)
                errors.append((wid, "failed", out.error))
                continue
            for c in out.outputs:
                d = c.delta_token_ids
                if not d and c.finish_reason is None:
                    continue
                lps = c.logprobs[len(c.logprobs) - len(d):] if c.logprobs is not None else None
                entries.append((wid, c.index, d, lps, c.cumulative_logprob, c.finish_reason))
            if out.finished:
                finished.append(wid)
        for client, (entries, finished, errors) in per_client.items():
            self._send(client, encode_step(self.rank, entries, finished, errors))

    # ---- sending ----------------------------------------------------------------------------------
    def _send(self, client, msg):
        try:
            self.output.send_multipart([client, self.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._drop_client(client)

    def _drop_client(self, client):
        """A client that cannot be reached any more: forget it and abort its requests."""
        self.clients.discard(client)
        self.held = [m for m in self.held if m.client != client]
        gone = [rid for rid in self.engine.groups if rid[0] == client]
        for rid in gone:
            self.engine.abort_request(rid)
        if gone:
            logger.warning("engine core %d: a client went away; aborted its %d request(s)", self.rank, len(gone))

    def _metrics(self):
        self.last_snapshot = now()
        m = self.engine.metrics()
        m["rank"] = self.rank
        m["num_waiting"] = m.get("num_waiting", 0) + len(self.held)
        m["num_admissions"] = self.num_admissions
        return m

    def _broadcast_stats(self):
        if not self.clients:
            return
        msg = Stats(self.rank, 0, self._metrics())
        for client in list(self.clients):
            self._send(client, msg)


# ---- processes --------------------------------------------------------------------------------------------
def die_with_parent():
    """Ask Linux to SIGTERM this process when its parent exits (no orphan keeps a GPU); elsewhere a no-op
    (the core's idle loop also notices a new parent pid)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)          # PR_SET_PDEATHSIG


def name_process(name):
    """Set this process's name as `ps`, `top` and /proc/PID/comm show it (Linux, 15 bytes); elsewhere a no-op."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, ctypes.create_string_buffer(name.encode()[:15]), 0, 0, 0)      # PR_SET_NAME


def run_profiled(name, fn):
    """fn(), under cProfile when $PAGEDATTN_PROFILE_DIR names a directory: the process's profile goes to
    DIR/<name>.prof when fn returns (a clean stop: SIGTERM to a core, the launcher's shutdown of an API
    server). For studying where a serving process's time goes:
        PAGEDATTN_PROFILE_DIR=/tmp/prof python -m pagedattn serve ...;  python -m pstats /tmp/prof/core0.prof"""
    directory = os.environ.get("PAGEDATTN_PROFILE_DIR")
    if not directory:
        return fn()
    import cProfile

    # A SIGTERM ends fn with SystemExit, so the profile is still written (uvicorn re-raises it); the handler
    # is this call's alone: whatever was there before is back when it returns.
    with _signal_handlers({signal.SIGTERM: lambda *_: sys.exit(0)}
                          if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else {}):
        profile = cProfile.Profile()
        try:
            return profile.runcall(fn)
        finally:
            os.makedirs(directory, exist_ok=True)
            profile.dump_stats(os.path.join(directory, f"{name}.prof"))


@contextlib.contextmanager
def _signal_handlers(handlers):
    """Install {signal: handler} for the block and put the previous handlers back after it: a core or a
    profile run in the calling process (a test, a script) leaves that process's signal handling as it was."""
    old = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_engine_core(address, engine_kwargs, rank=0, visible_devices=None):
    """A core process's body (a spawn target): build the LLM, serve `address` until stopped.

    engine_kwargs: LLM(**engine_kwargs). visible_devices: "2,3" makes those GPUs this process's
    cuda:0, cuda:1 (a data-parallel rank on its own GPUs; its tensor-parallel workers inherit it)."""
    die_with_parent()
    name_process(f"pagedattn-core{rank}")
    # Ctrl-C reaches every process of the terminal's group; the launcher decides when a core stops.
    with _signal_handlers({signal.SIGINT: signal.SIG_IGN}):
        _run_engine_core(address, engine_kwargs, rank, visible_devices)


def _run_engine_core(address, engine_kwargs, rank, visible_devices):
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine-core-{rank} %(levelname)s %(message)s")
    from pagedattn import LLM

    engine_kwargs = dict(engine_kwargs)
    fake_step_ms = engine_kwargs.pop("fake_step_ms", None)     # a synthetic device (benchmarks; fake_engine.py)
    fake_prefill_ms = engine_kwargs.pop("fake_prefill_ms", None) or 0.0
    delay = engine_kwargs.pop("prefill_delay_factor", None)
    llm = LLM(**engine_kwargs)
    if fake_step_ms:
        from pagedattn.serving.fake_engine import install_fake_runner
        install_fake_runner(llm, fake_step_ms, seed=rank, prefill_ms=fake_prefill_ms)
    core = EngineCore(llm, address, rank, PREFILL_DELAY_FACTOR if delay is None else delay)
    with _signal_handlers({signal.SIGTERM: lambda *_: core.stop()}):     # stop between two steps
        run_profiled(f"core{rank}", core.run)


def local_addresses(count, directory=None):
    """`count` fresh ipc:// core addresses in a private directory (one machine); whoever stops the cores
    removes it (remove_socket_dir)."""
    directory = directory or tempfile.mkdtemp(prefix="pagedattn-core-")
    return [f"ipc://{os.path.join(directory, f'core{r}')}" for r in range(count)]


def remove_socket_dir(addresses):
    """Remove the private directory local_addresses made for these ipc:// addresses, with whatever sockets the
    cores left in it (a killed core leaves its own). Only for addresses local_addresses made: it removes the
    directory whole."""
    for directory in {os.path.dirname(a[len("ipc://"):]) for a in addresses if a.startswith("ipc://")}:
        shutil.rmtree(directory, ignore_errors=True)


def start_engine_cores(engine_kwargs, data_parallel_size=1, addresses=None):
    """Start `data_parallel_size` core processes (spawn). Returns (processes, addresses). Without addresses, the
    cores listen on local_addresses (the caller removes their directory when it stops them: remove_socket_dir).

    On CUDA each rank gets its own GPUs: rank r sees devices r*P .. r*P + P - 1 (P = tensor_parallel_size)."""
    import multiprocessing as mp

    addresses = addresses or local_addresses(data_parallel_size)
    tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
    on_cuda = str(engine_kwargs.get("device", "auto")).startswith("cuda") and data_parallel_size > 1
    ctx = mp.get_context("spawn")
    procs = []
    for r, address in enumerate(addresses):
        devices = ",".join(str(r * tp + i) for i in range(tp)) if on_cuda else None
        kwargs = dict(engine_kwargs)
        if on_cuda:
            kwargs["device"] = "cuda"
        p = ctx.Process(target=run_engine_core, args=(address, kwargs, r, devices), name=f"pagedattn-core-{r}",
                        daemon=False)
        p.start()
        procs.append(p)
    return procs, addresses


def stop_processes(procs, timeout=10.0):
    """SIGTERM each live process, wait up to `timeout` in all, SIGKILL what is left, reap everything."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.terminate()
    deadline = now() + timeout
    for p in procs:
        p.join(max(0.0, deadline - now()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def main(argv=None):
    """A headless core (another node's engine): python -m pagedattn.serving.engine_core --bind tcp://0.0.0.0:5550
    --model DIR [--rank R] [LLM options as --key value]."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pagedattn.serving.engine_core", description=main.__doc__)
    ap.add_argument("--bind", required=True, help="tcp://IFACE:PORT (uses PORT and PORT + 1) or ipc://PATH")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--prefill-delay-factor", type=float, default=PREFILL_DELAY_FACTOR)
    a = ap.parse_args(argv)
    run_engine_core(a.bind, dict(model=a.model, device=a.device, dtype=a.dtype,
                                 tensor_parallel_size=a.tensor_parallel_size, max_model_len=a.max_model_len,
                                 max_num_seqs=a.max_num_seqs, num_blocks=a.num_blocks,
                                 prefill_delay_factor=a.prefill_delay_factor), a.rank)


if __name__ == "__main__":
    main()
