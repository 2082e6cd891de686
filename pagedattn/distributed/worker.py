"""Tensor-parallel ranks: their devices, their process groups, and how rank 0 reaches them.

The worker loop itself (build the ModelRunner, receive each step, run it) and the step's wire format are
the engine's: pagedattn/engine/executor.py (worker_main, send, recv). What follows describes them together.

Rank 0 is the process that owns the scheduler (LLMEngine with a MultiprocExecutor). Ranks 1..P-1 are
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
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedattn.distributed.parallel import init_process_group
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
