"""The engine core: the scheduler and the model behind the wire of pagedattn.serving.messages, on a thread
of the API process or in a process of its own; CoreClient (pagedattn.serving.core_client) is its only front.

    client = CoreClient.start(config)          # config.in_process: a core thread; else core processes
    client = CoreClient.in_thread(llm)         # a core thread on an LLM built here (the tests)

The core only schedules, runs steps and ships the sampled token ids; text (incremental detokenization,
stop strings) is made by the client, on the API side. Both places it runs speak the same messages over
the same kind of socket, so the client cannot tell them apart:

  * its own process (`serve`'s default; start_engine_cores, run_engine_core): the HTTP side spends Python
    time on every token of every stream (JSON, SSE framing, a socket write); in the engine's interpreter
    it would take the GIL the engine needs between two GPU launches, and the GPU would idle. Here the
    engine loop owns an interpreter. One process per data-parallel rank, each on its own GPUs.
  * a thread of the API process (`serve --in-process`, the tests; start_core_thread): one process, the
    sockets inproc:// in the client's ZMQ context. Simpler to run and to reach into (the tests read its
    engine), slower under load: the HTTP side's Python shares the GIL with the engine's.

The loop: take every command waiting (add, abort, stop a completion, snapshot, shutdown; ZMQ queues them
while a step runs, so requests join and leave between steps, which is what continuous batching wants),
admit held requests (the admission rule, EngineCore), run one engine.step(), send each client with news
one StepOutputs, and a metrics snapshot every 50 ms while busy and once each time it goes idle. An API
process that went away is noticed on the next send to it (ROUTER_MANDATORY: EHOSTUNREACH) and its
requests are aborted, so their blocks free.

Faults. A step that raises fails the requests in flight (each gets a "step" error) and the loop goes on.
If even aborting them fails, the core tells every client it is Dead and stops; a core process that is
killed says nothing, and the clients see the connection drop (pagedattn.serving.core_client).
"""
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid

import msgspec
import zmq

from pagedattn.engine.outputs import StepDeltas
from pagedattn.serving.config import PREFILL_DELAY_FACTOR
from pagedattn.serving.messages import (AbortRequests, AddRequest, ClientMessage, Dead, Hello, Ready, Shutdown,
                                        Stats, StopCompletion, TakeSnapshot, configure, core_endpoints, encode_step)
from pagedattn.serving.processes import die_with_parent, name_process, run_profiled, signal_handlers

logger = logging.getLogger("pagedattn.serving")
now = time.perf_counter

# A metrics snapshot costs a pass over the running sequences: at most this often while busy, and once
# each time the core goes idle (so an idle core's snapshot is exact).
SNAPSHOT_INTERVAL_S = 0.05
# While idle the loop wakes this often to check for a stop request or a parent that is gone.
IDLE_POLL_MS = 100
# Admission (see EngineCore): while sequences decode, new requests wait until prefill_delay_factor times
# the last prefill step's duration has passed since it ended. A step that holds a prompt chunk costs far
# more than a decode step on a GPU (it runs eagerly, a decode step replays a CUDA graph) and every running
# stream waits for it; requests arriving one by one would otherwise make nearly every step such a step.
# With factor f, prefill steps take at most about 1 / (1 + f) of the time while streams decode.
MAX_HOLD_S = 0.2            # never longer than this (a prefill timed during a host hiccup)


# ---- the core ----------------------------------------------------------------------------------------------
class EngineCore:
    """One engine (an LLM, which may itself be tensor-parallel) behind a core address.

    llm: pagedattn.LLM, owned from now on (closed when the loop ends). address: see core_endpoints;
    the core binds it. rank: this core's data-parallel rank (reported in every message). ctx: the ZMQ
    context to bind in (an inproc:// address: the client's), or None for one of its own.

    Admission: a request that arrives while sequences decode (and none waits in the engine) is held
    here until prefill_delay_factor x the last prefill's duration has passed since that prefill ended,
    then every held request joins the engine at once: arrivals share one prefill step instead of making
    one each. An idle engine, one with requests already waiting, or held prompts that fill half a step's
    token budget (a crowd: its prefill step is efficient as it is) take them at once; 0 turns the
    holding off. Held requests count as waiting in the metrics (routing, wait_until_idle).
    """

    def __init__(self, llm, address, rank=0, prefill_delay_factor=PREFILL_DELAY_FACTOR, ctx=None):
        from pagedattn.engine.output_processor import OutputProcessor

        self.llm, self.engine, self.rank = llm, llm.engine, rank
        engine = self.engine
        # No text in the core: the API side detokenizes and checks stop strings. An output processor
        # without a tokenizer still applies EOS, stop token ids and the length limits; deltas_only: a
        # step's outputs hold its new tokens only (no cumulative list is copied per step).
        engine.outputs = OutputProcessor(None, engine.eos_token_ids, engine.max_model_len, deltas_only=True)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.own_ctx = ctx is None      # (an inproc:// core shares its client's context)
        self.ctx = zmq.Context() if ctx is None else ctx
        in_ep, out_ep = core_endpoints(address)
        self.input = configure(self.ctx.socket(zmq.PULL))
        self.output = configure(self.ctx.socket(zmq.ROUTER))
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
    def run(self, parent_pid=None):
        """Serve until Shutdown (or stop()); closes the engine on the way out. parent_pid: stop once this
        process's parent is no longer that process (a core process whose launcher is gone)."""
        engine = self.engine
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(self.output, zmq.POLLIN)
        try:
            _bind_device(engine)
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
                    if parent_pid is not None and os.getppid() != parent_pid:     # our launcher is gone
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
        if self.own_ctx:
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
                errors.setdefault(rid[0], []).append((rid[1], "step", repr(e)))
            for client, errs in errors.items():
                self._send(client, encode_step(self.rank, [], [], errs))
            return
        for client, (entries, finished, errors) in pack_outputs(outs).items():
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


def pack_outputs(outs):
    """One step's engine outputs (request ids (client, wire id)) by client: {client: (entries, finished wire ids,
    errors)}, entries as encode_step takes them: (wire id, index, new token ids, logprobs or None, cumulative,
    finish reason) per completion with news."""
    per_client = {}

    def columns(client):
        cols = per_client.get(client)
        if cols is None:
            cols = per_client[client] = ([], [], [])
        return cols

    for out in outs:
        if type(out) is StepDeltas:             # the running streamed requests: a row per completion
            last = None
            for (client, wid), index, ids, lps, cumulative, finish in out.rows:
                if client != last:              # consecutive rows mostly share a client
                    add, last = columns(client)[0].append, client
                if ids or finish is not None:
                    add((wid, index, ids, lps, cumulative, finish))
            continue
        client, wid = out.request_id
        entries, finished, errors = columns(client)
        if out.error is not None:               # failed alone in the engine (its blocks are already free)
            errors.append((wid, "failed", out.error))
            continue
        for c in out.outputs:                   # a final output: the last delta of each completion
            d = c.delta_token_ids
            if not d and c.finish_reason is None:
                continue
            lps = c.logprobs[len(c.logprobs) - len(d):] if c.logprobs is not None else None
            entries.append((wid, c.index, d, lps, c.cumulative_logprob, c.finish_reason))
        if out.finished:
            finished.append(wid)
    return per_client


def _bind_device(engine):
    """Make the engine's GPU the current device of the thread that runs the loop (torch keeps the current
    device per thread, and a new thread starts on cuda:0)."""
    device = str(getattr(getattr(engine, "config", None), "device", "cpu"))
    if device.startswith("cuda"):
        import torch
        index = torch.device(device).index
        if index is not None:
            torch.cuda.set_device(index)


def build_llm(config, device=None):
    """The LLM an engine core serves: LLM(**config.engine) (`device` in place of the engine's, when given),
    then config's engine_hook called on it. config: ServeConfig."""
    from pagedattn import LLM

    hook = config.hook()                # (a hook that cannot be loaded fails before the model loads)
    llm = LLM(**(config.engine if device is None else {**config.engine, "device": device}))
    if hook is not None:
        hook(llm, **config.engine_hook_args)
    return llm


# ---- a core on a thread of this process -------------------------------------------------------------------
class CoreThread(threading.Thread):
    """The loop of `core` on a thread of this process. A failure the core could not recover from has been
    logged and sent to its clients (Dead) by EngineCore.run before the thread ends."""

    def __init__(self, core):
        super().__init__(name=f"pagedattn-core{core.rank}", daemon=True)
        self.core = core

    def run(self):
        with contextlib.suppress(Exception):
            self.core.run()

    def stop(self):
        self.core.stop()


def start_core_thread(llm, ctx, prefill_delay_factor=PREFILL_DELAY_FACTOR):
    """An EngineCore on `llm` (owned from now on) at a fresh inproc:// address in `ctx` (the client's ZMQ
    context: inproc sockets only meet within one), its loop on a new thread. Returns (CoreThread, address)."""
    address = f"inproc://pagedattn-core-{uuid.uuid4().hex}"
    thread = CoreThread(EngineCore(llm, address, 0, prefill_delay_factor, ctx=ctx))
    thread.start()
    return thread, address


# ---- cores in processes of their own ----------------------------------------------------------------------
def run_engine_core(config, address, rank=0, visible_devices=None):
    """A core process's body (a spawn target): build the LLM of `config` (ServeConfig), serve `address`
    until stopped. visible_devices: "2,3" makes those GPUs this process's cuda:0, cuda:1 (a data-parallel
    rank on its own GPUs; its tensor-parallel workers inherit it)."""
    die_with_parent()
    name_process(f"pagedattn-core{rank}")
    # Ctrl-C reaches every process of the terminal's group; the launcher decides when a core stops.
    with signal_handlers({signal.SIGINT: signal.SIG_IGN}):
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s engine-core-{rank} %(levelname)s %(message)s")
        llm = build_llm(config, device=None if visible_devices is None else "cuda")
        core = EngineCore(llm, address, rank, config.prefill_delay_factor)
        parent = os.getppid()
        with signal_handlers({signal.SIGTERM: lambda *_: core.stop()}):     # stop between two steps
            run_profiled(f"core{rank}", lambda: core.run(parent_pid=parent))


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


def start_engine_cores(config, addresses=None):
    """Start config.data_parallel_size core processes (spawn) on `config` (ServeConfig). Returns (processes,
    addresses). Without addresses, the cores listen on local_addresses (the caller removes their directory
    when it stops them: remove_socket_dir).

    On CUDA with several ranks each gets its own GPUs: rank r sees devices r*P .. r*P + P - 1
    (P = tensor_parallel_size)."""
    import multiprocessing as mp

    from pagedattn.config import EngineConfig

    count = config.data_parallel_size
    addresses = addresses or local_addresses(count)
    engine = EngineConfig(**config.engine)
    split = engine.device_type == "cuda" and count > 1
    ctx = mp.get_context("spawn")
    procs = []
    for r, address in enumerate(addresses):
        tp = engine.tensor_parallel_size
        devices = ",".join(str(r * tp + i) for i in range(tp)) if split else None
        p = ctx.Process(target=run_engine_core, args=(config, address, r, devices), name=f"pagedattn-core-{r}",
                        daemon=False)
        p.start()
        procs.append(p)
    return procs, addresses


def main(argv=None):
    """A headless engine core (another node's engine) on `python -m pagedattn serve`'s options:
        python -m pagedattn.serving.engine_core --bind tcp://0.0.0.0:5550 [--rank R] --model DIR --device cuda"""
    import argparse

    from pagedattn.serving.cli import parse_config

    ap = argparse.ArgumentParser(prog="python -m pagedattn.serving.engine_core", description=main.__doc__,
                                 epilog="every other option is `python -m pagedattn serve`'s (its engine options "
                                        "and --prefill-delay-factor, --engine-hook apply here)")
    ap.add_argument("--bind", required=True, help="tcp://IFACE:PORT (uses PORT and PORT + 1) or ipc://PATH")
    ap.add_argument("--rank", type=int, default=0, help="this core's data-parallel rank (in its messages)")
    a, rest = ap.parse_known_args(argv)
    run_engine_core(parse_config(rest), a.bind, a.rank)


if __name__ == "__main__":
    main()
