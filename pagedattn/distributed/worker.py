"""Tensor-parallel ranks: their devices, their process groups, and how rank 0 reaches them (Workers).

The worker loop itself (build the ModelRunner, receive each step, run it) is the engine's:
pagedattn/engine/model_runner.py (worker_main, serve_steps); what travels is a step's header and int32 data
(pagedattn/engine/step_inputs.py), which this module sends and receives as arrays, knowing nothing of the
engine. What follows describes them together.

Rank 0 is the process that owns the scheduler (LLMEngine, whose ModelRunner holds the Workers). Ranks 1..P-1 are
either processes it starts itself with torch.multiprocessing (spawn, one host), or, when the script was
launched by torchrun (`torchrun_launch()` finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
in the environment), the launcher's other ranks on any number of hosts, which join the process group
torchrun set up (init_method "env://") and run the same worker loop. Every rank builds
`ModelRunner(config, rank, P)`, which loads only its shard; the ranks agree on the KV pool size (the
smallest any rank can hold: one all-reduce MIN), and then each step is

    rank 0: broadcast(header), broadcast(StepInputs data)       on the control group (its own gloo group)
    every rank: runner.execute(step): forward on its shard (2 all-reduces per layer on the model's group:
                NCCL on CUDA, gloo on CPU), sampling; rank 0 keeps the results, workers drop them.

The step travels as the int32 array StepInputs packs it into (a few KB), on CPU tensors over gloo, so a
worker learns the step's shape without a device sync and the model's NCCL stream carries only the model's
collectives. CUDA graphs are captured on every rank at the same step (their all-reduces inside).

Failure handling: before a step rank 0 checks that every worker is alive (the processes it started; a
failed heartbeat under torchrun); any exception (or Ctrl-C) inside a step shuts the workers down and raises
TensorParallelError carrying the worker's traceback when one failed. A worker whose peer dies sees its
collective fail (gloo: the socket closes; NCCL: the process-group timeout) and exits with an error.
Spawned workers ignore SIGINT: Ctrl-C reaches the parent, which stops them.

Idle time: a worker waits for the next step on the control group, whose timeout is CTRL_TIMEOUT_S; while
no step is sent, rank 0 broadcasts a heartbeat every HEARTBEAT_S, so an idle engine (a server without
requests) keeps its workers, and a worker whose rank 0 vanished without closing its sockets (a host lost)
gives up within CTRL_TIMEOUT_S. The model's collectives keep the longer TIMEOUT_S (a first step may
compile kernels).
"""
import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedattn.distributed.parallel import free_port, init_process_group
from pagedattn.errors import PagedAttnError

OP_STOP, OP_STEP, OP_PING = 0, 1, 2
TIMEOUT_S = 300          # a model collective that waits longer than this fails (a hung or lost peer)
CTRL_TIMEOUT_S = 60      # a worker waiting this long for rank 0's next message gives up
HEARTBEAT_S = 5.0        # rank 0 sends OP_PING when it has sent nothing for this long
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """Where torchrun placed this process: global rank, world size, rank and process count on this host."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_launch(environ=None):
    """The Launch torchrun's environment describes, or None outside torchrun (or with a world of one)."""
    env = os.environ if environ is None else environ
    if not all(env.get(k) for k in TORCHRUN_VARS):
        return None
    launch = Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                    int(env.get("LOCAL_WORLD_SIZE") or env["WORLD_SIZE"]))
    return launch if launch.world_size > 1 else None


class TensorParallelError(PagedAttnError, RuntimeError):
    """A tensor-parallel worker failed (or a step was interrupted); the workers have been shut down."""


def rank_device(device_type, local_rank):
    """A rank's device: cuda:<its rank on this host> on CUDA, cpu otherwise."""
    return torch.device(f"cuda:{local_rank}") if device_type == "cuda" else torch.device("cpu")


def cpu_threads_per_rank(ranks_on_host):
    """On CPU the ranks of one host share its cores: P processes each using every core would oversubscribe
    them (OpenMP threads spin at each collective) and run many times slower."""
    return max(1, (os.cpu_count() or 1) // ranks_on_host)


def join_group(rank, world_size, init_method, device, ctrl_timeout_s=None):
    """Join the model's process group (NCCL on CUDA, gloo on CPU; init_method "env://" under torchrun)
    unless this process already has one of `world_size` ranks, and make the gloo control group (its own
    group even on CPU: rank 0's heartbeat thread uses it while the main thread runs the model's
    collectives). Returns the control group."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise TensorParallelError(f"this process's torch.distributed group has {dist.get_world_size()} ranks, "
                                      f"tensor_parallel_size is {world_size}")
    else:
        init_process_group(rank, world_size, init_method, device, TIMEOUT_S)
    timeout = timedelta(seconds=CTRL_TIMEOUT_S if ctrl_timeout_s is None else ctrl_timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout)


def agree_num_blocks(runner):
    """The KV pool size every rank can hold: the minimum of each rank's own estimate. On the model's group
    (its long TIMEOUT_S), not the control group: the ranks get here when each has loaded its shard, and
    one may load minutes after another (a slower disk on another host)."""
    n = torch.tensor([runner.available_blocks()], dtype=torch.int64, device=runner.device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return int(n.item())


def send(op, header, data, ctrl):
    """Rank 0: broadcast an op, and for OP_STEP a step's header (int64 [header_len]) and data (int32 [n])."""
    head = torch.zeros(2 + (0 if header is None else len(header)), dtype=torch.int64)
    head[0] = op
    if op == OP_STEP:
        head[1] = data.shape[0]
        head[2:] = torch.from_numpy(header)
    dist.broadcast(head, src=0, group=ctrl)
    if op == OP_STEP:
        dist.broadcast(torch.from_numpy(data), src=0, group=ctrl)


def recv(ctrl, header_len):
    """Ranks 1..P-1: (op, header int64 [header_len] or None, data int32 [n] or None) of rank 0's next send."""
    head = torch.empty(2 + header_len, dtype=torch.int64)
    dist.broadcast(head, src=0, group=ctrl)
    op = int(head[0])
    if op != OP_STEP:
        return op, None, None
    data = torch.empty(int(head[1]), dtype=torch.int32)
    dist.broadcast(data, src=0, group=ctrl)
    return op, head[2:].numpy(), np.ascontiguousarray(data.numpy())


def exit_cleanly():
    """A clean stop leaves no work behind; skip interpreter teardown, where a C++ thread left over by the
    communication library can abort the process (exit code -6) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Workers:
    """Rank 0's handle on ranks 1..P-1 of `config.tensor_parallel_size` (device "cpu" or "cuda" =
    cuda:0..P-1 of each host). launch: torchrun's placement of this process (then the other ranks exist
    already), or None (then this process starts ranks 1..P-1 on this host, each running
    entry(index, P, init_method, config, ctrl_timeout_s)). Joins the process group; `device` is rank 0's.
    Stops the workers on shutdown() (idempotent) and after a failed step. A heartbeat thread keeps idle
    workers waiting (CTRL_TIMEOUT_S, HEARTBEAT_S)."""

    def __init__(self, config, entry, header_len, launch=None):
        P = self.world_size = config.tensor_parallel_size
        self.launch, self.header_len = launch, header_len
        ranks_here = P if launch is None else launch.local_world_size
        if config.device_type == "cuda" and torch.cuda.device_count() < ranks_here:
            raise TensorParallelError(f"{ranks_here} ranks on this host need {ranks_here} GPUs, "
                                      f"{torch.cuda.device_count()} visible")
        if launch is None and dist.is_initialized():
            raise TensorParallelError("a torch.distributed default process group already exists in this process; "
                                      "tensor_parallel_size > 1 creates its own (or launch with torchrun)")
        self.owns_group = not dist.is_initialized()
        self.closed, self.healthy = False, True
        self.lock, self.stopping, self.heartbeat_error = threading.Lock(), threading.Event(), None
        self.last_send = time.monotonic()
        self.context, self.heartbeat = None, None
        if launch is None:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self.context = mp.start_processes(entry, args=(P, init_method, config, CTRL_TIMEOUT_S), nprocs=P - 1,
                                              join=False, daemon=True, start_method="spawn")
        else:
            init_method = "env://"
        try:
            self.device = rank_device(config.device_type, 0 if launch is None else launch.local_rank)
            if config.device_type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(ranks_here))
            self.ctrl = join_group(0, P, init_method, self.device, CTRL_TIMEOUT_S)
        except BaseException as e:
            self.fail(e)
        self.heartbeat = threading.Thread(target=self._heartbeat, args=(HEARTBEAT_S,), daemon=True,
                                          name="tp-heartbeat")
        self.heartbeat.start()

    @property
    def pids(self):
        """The worker processes this rank started (empty under torchrun)."""
        return [] if self.context is None else [p.pid for p in self.context.processes]

    @contextlib.contextmanager
    def step(self, header, data):
        """Around rank 0's share of a step: the step broadcast first (header int64, data int32 arrays); any
        failure, here or inside the block, stops the workers and raises TensorParallelError."""
        self.check_alive()
        try:
            with self.lock:            # no heartbeat between a step's broadcast and rank 0's share of it
                send(OP_STEP, header, data, self.ctrl)
                yield
                self.last_send = time.monotonic()
        except BaseException as e:
            self.fail(e)

    def _heartbeat(self, period):
        """Rank 0's thread: OP_PING when nothing was sent for `period` seconds; a failed send is kept for
        the next check_alive (a worker that died while the engine was idle)."""
        while not self.stopping.wait(period / 4):
            with self.lock:
                if self.stopping.is_set() or time.monotonic() - self.last_send < period:
                    continue
                try:
                    send(OP_PING, None, None, self.ctrl)
                except Exception as e:
                    self.heartbeat_error = e
                    return
                self.last_send = time.monotonic()

    def check_alive(self):
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers have been shut down (close() or an earlier failure)")
        if self.heartbeat_error is not None:
            self.fail(self.heartbeat_error)
        if self.context is not None and any(not p.is_alive() for p in self.context.processes):
            self.fail(None)

    def fail(self, cause):
        """Shut down and raise TensorParallelError, with the failed worker's traceback when there is one."""
        self.healthy = False
        worker_error = None
        if self.context is not None and not isinstance(cause, KeyboardInterrupt):   # on Ctrl-C: just stop them
            try:
                self.context.join(timeout=5)      # raises if a worker exited with an error or a signal
            except Exception as e:                 # ProcessRaisedException / ProcessExitedException
                worker_error = e
        self.shutdown()
        if worker_error is not None:
            raise TensorParallelError(f"a tensor-parallel worker failed (spawn process i is rank i + 1):\n"
                                      f"{worker_error}") from cause
        if isinstance(cause, KeyboardInterrupt):
            raise cause
        raise TensorParallelError(f"tensor-parallel step failed on rank 0: {cause!r}; workers shut down") from cause

    def shutdown(self):
        """Stop every worker: a clean OP_STOP when healthy, then (the processes this rank started) join,
        terminate, kill; destroy the process group. Under torchrun, a worker that gets no OP_STOP sees the
        group close and exits with an error."""
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        if self.heartbeat is not None:
            self.heartbeat.join(timeout=10)
        procs = [] if self.context is None else self.context.processes
        if self.healthy and dist.is_initialized() and all(p.is_alive() for p in procs):
            try:
                with self.lock:
                    send(OP_STOP, None, None, self.ctrl)
            except Exception:
                pass
        for p in procs:
            p.join(timeout=10 if self.healthy else 1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
