"""The seam between the engine and the model: `execute(step_inputs) -> StepResult`, on one rank or many.

    executor = make_executor(config)      # UniprocExecutor, or MultiprocExecutor when tensor_parallel_size > 1
    executor.num_blocks                   # the KV pool every rank holds (block ids mean the same everywhere)
    result = executor.execute(step)       # launched; result.wait() -> the sampled tokens on the host
    executor.shutdown()

UniprocExecutor owns one ModelRunner. MultiprocExecutor is rank 0 of a tensor-parallel group: it starts
ranks 1..P-1 (each runs worker_main below), owns rank 0's ModelRunner, and broadcasts each step (send)
before running it itself. The engine above cannot tell them apart. The ranks' devices and process groups
are pagedattn/distributed/worker.py's.
"""
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedattn.distributed.parallel import check_tensor_parallel_size, free_port
from pagedattn.distributed.worker import (OP_STEP, OP_STOP, TensorParallelError, agree_num_blocks,
                                          cpu_threads_per_rank, join_group, rank_device)
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.step_inputs import HEADER_LEN, StepInputs
from pagedattn.models.loader import read_config


def make_executor(config):
    """config: an EngineConfig whose `model` is a directory."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    return MultiprocExecutor(config)


class UniprocExecutor:
    world_size = 1

    def __init__(self, config):
        self.runner = ModelRunner(config)
        self.runner.allocate_kv_cache(self.runner.available_blocks())
        self.model_config = self.runner.model_config
        self.num_blocks = self.runner.kv_cache.num_blocks

    def execute(self, step):
        return self.runner.execute(step)

    def check_alive(self):
        pass

    def shutdown(self):
        pass


class MultiprocExecutor:
    """Rank 0 of `config.tensor_parallel_size` ranks (device "cpu" or "cuda" = cuda:0..P-1).
    Stops the workers on shutdown() (idempotent), after a failed step, and at interpreter exit
    (the LLM class registers shutdown with weakref.finalize)."""

    def __init__(self, config):
        P = self.world_size = config.tensor_parallel_size
        check_tensor_parallel_size(read_config(config.model), P)       # before any process starts
        self.device_type = config.device_type
        if self.device_type == "cuda" and torch.cuda.device_count() < P:
            raise TensorParallelError(f"tensor_parallel_size={P} needs {P} GPUs, {torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise TensorParallelError("a torch.distributed default process group already exists in this process; "
                                      "tensor_parallel_size > 1 creates its own")
        self.closed, self.healthy = False, True
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.context = mp.start_processes(worker_main, args=(P, init_method, config), nprocs=P - 1, join=False,
                                          daemon=True, start_method="spawn")
        try:
            device = rank_device(self.device_type, 0)
            if self.device_type == "cpu":
                torch.set_num_threads(cpu_threads_per_rank(P))
            self.ctrl = join_group(0, P, init_method, device)
            self.runner = ModelRunner(config, 0, P, device)
            self.num_blocks = agree_num_blocks(self.runner, self.ctrl)
            self.runner.allocate_kv_cache(self.num_blocks)
        except BaseException as e:
            self.fail(e)
        self.model_config = self.runner.model_config

    @property
    def pids(self):
        return [p.pid for p in self.context.processes]

    def execute(self, step):
        self.check_alive()
        try:
            send(OP_STEP, step, self.ctrl)
            return self.runner.execute(step)
        except BaseException as e:
            self.fail(e)

    def check_alive(self):
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers have been shut down (close() or an earlier failure)")
        if any(not p.is_alive() for p in self.context.processes):
            self.fail(None)

    def fail(self, cause):
        """Shut down and raise TensorParallelError, with the failed worker's traceback when there is one."""
        self.healthy = False
        worker_error = None
        if not isinstance(cause, KeyboardInterrupt):   # on Ctrl-C the workers are fine: just stop them
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
        """Stop every worker: a clean OP_STOP when healthy, then join, terminate, kill; destroy the group."""
        if self.closed:
            return
        self.closed = True
        procs = self.context.processes
        if self.healthy and dist.is_initialized() and all(p.is_alive() for p in procs):
            try:
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
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


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


def worker_main(index, world_size, init_method, config):
    """Entry point of rank index + 1 (torch.multiprocessing passes `index`). Returns on OP_STOP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the parent's to handle
    rank = index + 1
    device = rank_device(config.device_type, rank)
    if config.device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    ctrl = join_group(rank, world_size, init_method, device)
    try:
        runner = ModelRunner(config, rank, world_size, device)
        runner.allocate_kv_cache(agree_num_blocks(runner, ctrl))
        while True:
            op, step = recv(ctrl)
            if op == OP_STOP:
                break
            if op != OP_STEP:
                raise RuntimeError(f"rank {rank}: unknown op {op} from rank 0")
            runner.execute(step, want_results=False)
    finally:
        dist.destroy_process_group()
    # A clean stop leaves no work behind; skip interpreter teardown, where a C++ thread left over by
    # the communication library can abort the process (exit code -6) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
