"""Tensor-parallel ranks: their devices, their process groups, and how rank 0 reaches them.

The worker loop itself (build the ModelRunner, receive each step, run it) and the step's wire format are
the engine's: pagedattn/engine/executor.py (worker_main, send, recv). What follows describes them together.

Rank 0 is the user's process (LLMEngine with a MultiprocExecutor); ranks 1..P-1 are processes started
with torch.multiprocessing (spawn). Every rank builds `ModelRunner(config, rank, P)`, which loads only its
shard; the ranks agree on the KV pool size (the smallest any rank can hold: one all-reduce MIN), and then
each step is

    rank 0: broadcast(header), broadcast(StepInputs data)       on the control group (gloo, CPU tensors)
    every rank: runner.execute(step): forward on its shard (2 all-reduces per layer on the model's group:
                NCCL on CUDA, gloo on CPU), sampling; rank 0 keeps the results, workers drop them.

The step travels as the int32 array StepInputs packs it into (a few KB), on CPU tensors over gloo, so a
worker learns the step's shape without a device sync and the model's NCCL stream carries only the model's
collectives. CUDA graphs are captured on every rank at the same step (their all-reduces inside).

Failure handling: before a step rank 0 checks that every worker is alive; any exception (or Ctrl-C) inside
a step shuts the workers down and raises TensorParallelError carrying the worker's traceback when one failed.
A worker whose peer dies sees its collective fail (gloo: the socket closes; NCCL: the process-group timeout)
and exits. Workers ignore SIGINT: Ctrl-C reaches the parent, which stops them.
"""
import os

import torch
import torch.distributed as dist

from pagedattn.distributed.parallel import init_process_group
from pagedattn.errors import PagedAttnError

OP_STOP, OP_STEP = 0, 1
TIMEOUT_S = 300          # a collective that waits longer than this fails (a hung or lost peer)


class TensorParallelError(PagedAttnError, RuntimeError):
    """A tensor-parallel worker failed (or a step was interrupted); the workers have been shut down."""


def rank_device(device_type, rank):
    """Rank r's device: cuda:r on CUDA, cpu otherwise."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def cpu_threads_per_rank(world_size):
    """On CPU the ranks share the cores: P processes each using every core would oversubscribe them
    (OpenMP threads spin at each collective) and run many times slower."""
    return max(1, (os.cpu_count() or 1) // world_size)


def join_group(rank, world_size, init_method, device):
    """Join the model's process group (NCCL on CUDA, gloo on CPU) and make the gloo control group."""
    init_process_group(rank, world_size, init_method, device, TIMEOUT_S)
    return dist.new_group(backend="gloo") if torch.device(device).type == "cuda" else dist.group.WORLD


def agree_num_blocks(runner, ctrl):
    """The KV pool size every rank can hold: the minimum of each rank's own estimate."""
    n = torch.tensor([runner.available_blocks()], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=ctrl)
    return int(n.item())
