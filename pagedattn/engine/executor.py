"""The seam between the engine and the model: `execute(step_inputs) -> StepResult`, on one rank or many.

    executor = make_executor(config)      # UniprocExecutor, or MultiprocExecutor when tensor_parallel_size > 1
    executor.num_blocks                   # the KV pool every rank holds (block ids mean the same everywhere)
    result = executor.execute(step)       # launched; result.wait() -> the sampled tokens on the host
    executor.shutdown()                   # gives the runner back: weights, KV pool, graphs, kernel scratch

UniprocExecutor owns one ModelRunner. MultiprocExecutor is rank 0 of a tensor-parallel group: it starts
ranks 1..P-1 (each runs worker_main below) or, under torchrun, joins the ranks torchrun started; it owns
rank 0's ModelRunner and broadcasts each step (send) before running it itself. The engine above cannot
tell them apart. Under torchrun, make_executor on a rank other than 0 does not return: the process runs
the worker loop (run_worker) until rank 0 stops it, then exits. The ranks' devices and process groups are
pagedattn/distributed/worker.py's.
"""
import os
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedattn.distributed import worker as tp
from pagedattn.distributed.parallel import check_tensor_parallel_size, free_port
from pagedattn.distributed.worker import (OP_PING, OP_STEP, OP_STOP, TensorParallelError, agree_num_blocks,
                                          cpu_threads_per_rank, join_group, rank_device, torchrun_launch)
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.step_inputs import HEADER_LEN, StepInputs
from pagedattn.errors import InvalidRequestError
from pagedattn.models.loader import read_config


def make_executor(config):
    """config: an EngineConfig whose `model` is a directory. Under torchrun with tensor_parallel_size > 1,
    ranks other than 0 run the worker loop here and exit the process when rank 0 closes (never returning)."""
    launch = torchrun_launch()
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    if launch is not None:
        if launch.world_size != config.tensor_parallel_size:
            raise InvalidRequestError(f"tensor_parallel_size={config.tensor_parallel_size} but torchrun started "
                                      f"WORLD_SIZE={launch.world_size} ranks: they must be equal")
        if launch.rank != 0:
            run_torchrun_worker(config, launch)
    return MultiprocExecutor(config, launch)


def kernel_cache_owner():
    """A context manager that makes the numba kernels' cached views and scratch buffers this block's
    (kernels_numba.bridge.owner), and a release function for them: (owner_cm, release). Without the
    numba kernels both do nothing."""
    token = object()               # plain: the caches' owner sets must not keep the executor alive
    try:
        from kernels_numba import bridge
    except ImportError:
        import contextlib
        return lambda: contextlib.nullcontext(), lambda: None
    return (lambda: bridge.owner(token)), (lambda: bridge.release(token))


class ClosedError(RuntimeError):
    """A step asked of an executor after shutdown() gave its model back."""


class UniprocExecutor:
    """One ModelRunner in this process. shutdown() drops it (weights, KV pool, CUDA graphs and their pool,
    staging buffers) and this engine's share of the kernels' cached views and scratch buffers, so the memory
    goes back as soon as nothing else holds the runner (docs/memory.md)."""

    world_size = 1

    def __init__(self, config):
        self.owned, self.release_caches = kernel_cache_owner()
        self.runner = ModelRunner(config)
        self.runner.allocate_kv_cache(self.runner.available_blocks())
        self.model_config = self.runner.model_config
        self.num_blocks = self.runner.kv_cache.num_blocks

    def execute(self, step):
        if self.runner is None:
            raise ClosedError("the engine is closed: its model and KV pool were released")
        with self.owned():
            return self.runner.execute(step)

    def check_alive(self):
        pass

    def shutdown(self):
        """Give everything back; idempotent."""
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        self.release_caches()


class MultiprocExecutor:
    """Rank 0 of `config.tensor_parallel_size` ranks (device "cpu" or "cuda" = cuda:0..P-1 of each host).
    launch: torchrun's placement of this process (then the other ranks exist already), or None (then this
    process starts ranks 1..P-1 on this host). Stops the workers on shutdown() (idempotent), after a failed
    step, and at interpreter exit (the LLM class registers shutdown with weakref.finalize). A heartbeat
    thread keeps idle workers waiting (worker.py: CTRL_TIMEOUT_S, HEARTBEAT_S)."""

    def __init__(self, config, launch=None):
        P = self.world_size = config.tensor_parallel_size
        check_tensor_parallel_size(read_config(config.model), P)       # before any process starts
        self.device_type, self.launch = config.device_type, launch
        ranks_here = P if launch is None else launch.local_world_size
        if self.device_type == "cuda" and torch.cuda.device_count() < ranks_here:
            raise TensorParallelError(f"{ranks_here} ranks on this host need {ranks_here} GPUs, "
                                      f"{torch.cuda.device_count()} visible")
        if launch is None and dist.is_initialized():
            raise TensorParallelError("a torch.distributed default process group already exists in this process; "
                                      "tensor_parallel_size > 1 creates its own (or launch with torchrun)")
        self.owns_group = not dist.is_initialized()
        self.owned, self.release_caches = kernel_cache_owner()
        self.runner = None
        self.closed, self.healthy = False, True
        self.lock, self.stopping, self.heartbeat_error = threading.Lock(), threading.Event(), None
        self.last_send = time.monotonic()
        self.context, self.heartbeat = None, None
        ctrl_timeout = tp.CTRL_TIMEOUT_S
        if launch is None:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self.context = mp.start_processes(worker_main, args=(P, init_method, config, ctrl_timeout), nprocs=P - 1,
                                              join=False, daemon=True, start_method="spawn")
        else:
            init_method = "env://"
        try:
            device = rank_device(self.device_type, 0 if launch is None else launch.local_rank)
            if self.device_type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(ranks_here))
            self.ctrl = join_group(0, P, init_method, device, ctrl_timeout)
            self.runner = ModelRunner(config, 0, P, device)
            self.num_blocks = agree_num_blocks(self.runner)
            self.runner.allocate_kv_cache(self.num_blocks)
        except BaseException as e:
            self.fail(e)
        self.model_config = self.runner.model_config
        self.heartbeat = threading.Thread(target=self._heartbeat, args=(tp.HEARTBEAT_S,), daemon=True,
                                          name="tp-heartbeat")
        self.heartbeat.start()

    @property
    def pids(self):
        """The worker processes this rank started (empty under torchrun)."""
        return [] if self.context is None else [p.pid for p in self.context.processes]

    def execute(self, step):
        self.check_alive()
        try:
            with self.lock:            # no heartbeat between a step's broadcast and rank 0's share of it
                send(OP_STEP, step, self.ctrl)
                with self.owned():
                    result = self.runner.execute(step)
                self.last_send = time.monotonic()
            return result
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
                    send(OP_PING, None, self.ctrl)
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
                    send(OP_STOP, None, self.ctrl)
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
        if self.runner is not None:
            self.runner.close()
        self.runner = None                    # rank 0's model, KV pool and graphs (see UniprocExecutor)
        self.release_caches()


# ---- the step on the wire -------------------------------------------------------------------------
def send(op, step, ctrl):
    """Rank 0: broadcast an op, and for OP_STEP the step's header and data."""
    header = torch.zeros(2 + HEADER_LEN, dtype=torch.int64)
    header[0] = op
    if op == OP_STEP:
        header[1] = step.data.shape[0]
        header[2:] = torch.from_numpy(step.header_array())
    dist.broadcast(header, src=0, group=ctrl)
    if op == OP_STEP:
        dist.broadcast(torch.from_numpy(step.data), src=0, group=ctrl)


def recv(ctrl):
    """Workers: (op, StepInputs or None)."""
    header = torch.empty(2 + HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=ctrl)
    op = int(header[0])
    if op != OP_STEP:
        return op, None
    data = torch.empty(int(header[1]), dtype=torch.int32)
    dist.broadcast(data, src=0, group=ctrl)
    return op, StepInputs.from_header_array(header[2:].numpy(), np.ascontiguousarray(data.numpy()))


def serve_steps(rank, world_size, config, device, ctrl):
    """A worker's life after joining the group: build the ModelRunner, agree on the pool, then run every
    step rank 0 broadcasts until OP_STOP."""
    runner = ModelRunner(config, rank, world_size, device)
    runner.allocate_kv_cache(agree_num_blocks(runner))
    while True:
        op, step = recv(ctrl)
        if op == OP_STOP:
            return
        if op == OP_STEP:
            runner.execute(step, want_results=False)
        elif op != OP_PING:
            raise RuntimeError(f"rank {rank}: unknown op {op} from rank 0")


def exit_cleanly():
    """A clean stop leaves no work behind; skip interpreter teardown, where a C++ thread left over by the
    communication library can abort the process (exit code -6) after the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_main(index, world_size, init_method, config, ctrl_timeout_s):
    """Entry point of spawned rank index + 1 (torch.multiprocessing passes `index`). Exits on OP_STOP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the parent's to handle
    rank = index + 1
    device = rank_device(config.device_type, rank)
    if config.device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    ctrl = join_group(rank, world_size, init_method, device, ctrl_timeout_s)
    try:
        serve_steps(rank, world_size, config, device, ctrl)
    finally:
        dist.destroy_process_group()
    exit_cleanly()


def run_torchrun_worker(config, launch):
    """Rank launch.rank (> 0) of a torchrun launch: join torchrun's group, serve rank 0's steps until it
    stops them, then exit the process with code 0. Any failure (rank 0 or a peer gone, a collective timed
    out) raises TensorParallelError out of the caller's LLM(...), whose process then exits with an error."""
    check_tensor_parallel_size(read_config(config.model), launch.world_size)
    device = rank_device(config.device_type, launch.local_rank)
    if config.device_type == "cuda" and torch.cuda.device_count() <= launch.local_rank:
        raise TensorParallelError(f"rank {launch.rank} runs on {device}, but {torch.cuda.device_count()} GPUs "
                                  "are visible")
    if config.device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(launch.local_world_size))
    owns_group = not dist.is_initialized()
    ctrl = join_group(launch.rank, launch.world_size, "env://", device)
    try:
        serve_steps(launch.rank, launch.world_size, config, device, ctrl)
    except Exception as e:
        raise TensorParallelError(f"tensor-parallel rank {launch.rank} of {launch.world_size} failed: {e!r} "
                                  "(rank 0 or a peer gone, or a collective timed out)") from e
    finally:
        if owns_group:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    exit_cleanly()
