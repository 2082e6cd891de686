"""Worker processes for tensor parallelism, and the rank-0 model runner that drives them.

Rank 0 is the user's process: it runs LLMEngine as usual (scheduler, block manager, sampling), with its
own shard of the model and a KV cache of Hkv/P heads per block. Ranks 1..P-1 are worker processes
started by TensorParallelGroup (torch.multiprocessing, spawn). Each step:

    rank 0: scheduler.schedule() -> ModelRunner.prepare() -> broadcast(header), broadcast(payload)
    every rank: copy-on-write block copies, model forward on its shard (2 all-reduces per layer),
                lm_head slice + all-gather -> logits [N, V]; rank 0 samples, workers drop them.

The broadcast carries the step's tensors, not Python objects:

    header  [8] int64: op, T, S, W, num_prefills, num_prefill_tokens, N, C
    payload [3T + S + S*W + (num_prefills + 1) + N + 2C] int64:
            input_ids, positions, slot_mapping, context_lens, block_tables (S x W), cu_seqlens_q,
            logits_indices, block copies (C x (src, dst))

Block ids are the same on every rank (one block manager, on rank 0); each rank's pool holds only its
KV heads of every block, so a block id addresses the same tokens everywhere.

Failure handling: before a step rank 0 checks that every worker is alive; any exception (or Ctrl-C)
inside a step shuts the workers down and raises TensorParallelError carrying the worker's traceback
when one failed. A worker whose peer dies sees its collective fail (gloo: the socket closes; NCCL:
the process-group timeout) and exits. Workers ignore SIGINT: Ctrl-C reaches the parent, which stops them.
"""
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedattn.layers.attention import AttentionMetadata
from pagedattn.engine.model_runner import ModelRunner, PreparedStep
from pagedattn.errors import PagedAttnError
from pagedattn.distributed.parallel import free_port, init_process_group, shard_qwen2

OP_STOP, OP_STEP, OP_INIT = 0, 1, 2
HEADER_LEN = 8
TIMEOUT_S = 300          # a collective that waits longer than this fails (a hung or lost peer)


class TensorParallelError(PagedAttnError, RuntimeError):
    """A tensor-parallel worker failed (or a step was interrupted); the workers have been shut down."""


def rank_device(device_type, rank):
    """Rank r's device: cuda:r on CUDA, cpu otherwise."""
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


# ---- the step on the wire ---------------------------------------------------------------------------
def send_step(step, block_copies, device):
    """Rank 0: broadcast a PreparedStep and its block copies (see the module docstring)."""
    m = step.attn_metadata
    T, S, W = step.input_ids.shape[0], m.block_tables.shape[0], m.block_tables.shape[1]
    copies = torch.tensor(block_copies, dtype=torch.int64, device=device).view(-1)       # (2C,)
    header = torch.tensor([OP_STEP, T, S, W, m.num_prefills, m.num_prefill_tokens,
                           step.logits_indices.shape[0], copies.shape[0] // 2], dtype=torch.int64, device=device)
    payload = torch.cat([t.to(device=device, dtype=torch.int64).reshape(-1) for t in (
        step.input_ids, step.positions, m.slot_mapping, m.context_lens, m.block_tables, m.cu_seqlens_q,
        step.logits_indices, copies)])
    dist.broadcast(header, src=0)
    dist.broadcast(payload, src=0)


def send_op(op, value, device):
    """Rank 0: broadcast a header with no payload (OP_INIT carries num_blocks in slot 1; OP_STOP nothing)."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0], header[1] = op, value
    dist.broadcast(header, src=0)


def recv(device):
    """Workers: the next (op, value) or (OP_STEP, (PreparedStep, block_copies [C, 2] int64 on cpu))."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    op, T, S, W, num_prefills, num_prefill_tokens, N, C = header.tolist()
    if op != OP_STEP:
        return op, T
    sizes = [T, T, T, S, S * W, num_prefills + 1, N, 2 * C]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    ids, pos, slots, ctx, tables, cu, logits_idx, copies = payload.split(sizes)
    meta = AttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens, num_decode_tokens=S - num_prefills,
        slot_mapping=slots, context_lens=ctx.to(torch.int32), block_tables=tables.view(S, W).to(torch.int32),
        cu_seqlens_q=cu.to(torch.int32))
    step = PreparedStep(input_ids=ids, positions=pos, attn_metadata=meta, logits_indices=logits_idx,
                        sampling_seqs=[None] * N)
    return op, (step, copies.view(C, 2).cpu().tolist())


def run_step(runner, step, block_copies):
    """Every rank: copies, forward on the shard, logits [N, V] (None when no sequence samples)."""
    runner.copy_blocks(block_copies)
    hidden = runner.model.forward(step.input_ids, step.positions, runner.kv_cache, step.attn_metadata)
    if step.logits_indices.shape[0] == 0:
        return None
    return runner.model.compute_logits(hidden[step.logits_indices])          # all-gather inside


def cpu_threads_per_rank(world_size):
    """On CPU the ranks share the cores: P processes each using every core would oversubscribe them
    (OpenMP threads spin at each collective) and run many times slower."""
    return max(1, (os.cpu_count() or 1) // world_size)


# ---- worker processes -----------------------------------------------------------------------------
def worker_main(index, world_size, init_method, model_path, device_type, dtype, block_size, attn_backend):
    """Entry point of rank index + 1 (torch.multiprocessing passes `index`). Returns on OP_STOP."""
    from pagedattn.kv_cache import KVCache
    from pagedattn.models.loader import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the parent's to handle
    rank = index + 1
    device = rank_device(device_type, rank)
    if device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    init_process_group(rank, world_size, init_method, device, TIMEOUT_S)
    try:
        model, config = load_model(model_path, device, dtype, attn_backend)
        shard_qwen2(model, rank, world_size)
        op, num_blocks = recv(device)                  # OP_STOP here: rank 0 failed building its engine
        if op == OP_INIT:
            kv_cache = KVCache(config.num_hidden_layers, num_blocks, config.num_key_value_heads // world_size,
                               block_size, config.head_dim, dtype=dtype, device=str(device))
            runner = ModelRunner(model, kv_cache, None, device)
            with torch.inference_mode():
                while True:
                    op, msg = recv(device)
                    if op == OP_STOP:
                        break
                    if op != OP_STEP:
                        raise RuntimeError(f"rank {rank}: unknown op {op} from rank 0")
                    run_step(runner, *msg)
    finally:
        dist.destroy_process_group()
    # A clean stop leaves no work behind; skip interpreter teardown, where a C++ thread left over by
    # the communication library can abort the process (exit code -6) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TensorParallelGroup:
    """Rank 0's side: starts ranks 1..world_size-1, joins the process group with them, turns the
    engine into rank 0 (`attach`), and stops the workers (`shutdown`, idempotent).

    config: a validated EngineConfig (device "cpu" or "cuda"/"cuda:0"; dtype resolved);
    model_path: the checkpoint directory every rank loads.
    """

    def __init__(self, world_size, config, model_path):
        self.world_size = world_size
        self.device_type = torch.device(config.device).type
        self.device = rank_device(self.device_type, 0)
        if self.device_type == "cuda" and torch.cuda.device_count() < world_size:
            raise TensorParallelError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                                      f"{torch.cuda.device_count()} visible")
        if dist.is_initialized():
            raise TensorParallelError("a torch.distributed default process group already exists in this process; "
                                      "tensor_parallel_size > 1 creates its own")
        self.closed, self.healthy = False, True
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.context = mp.start_processes(
            worker_main, args=(world_size, init_method, model_path, self.device_type, config.dtype,
                               config.block_size, config.attn_backend),
            nprocs=world_size - 1, join=False, daemon=True, start_method="spawn")
        try:
            init_process_group(0, world_size, init_method, self.device, TIMEOUT_S)
        except BaseException:
            self.healthy = False
            self.shutdown()
            raise

    @property
    def pids(self):
        return [p.pid for p in self.context.processes]

    def attach(self, engine):
        """Make a freshly built LLMEngine rank 0 of this group, in place: shard its model, swap its KV
        pool for one of Hkv/P heads per block (the same num_blocks, so block ids match the block
        manager's), wrap its runner, and tell the workers the pool size."""
        from pagedattn.kv_cache import KVCache

        shard_qwen2(engine.model, 0, self.world_size)
        if self.device_type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(self.world_size))
        mc, cfg, num_blocks = engine.model_config, engine.config, engine.kv_cache.num_blocks
        engine.kv_cache = engine.runner = None             # free the full-head pool before allocating
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
        engine.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, mc.num_key_value_heads // self.world_size,
                                  cfg.block_size, mc.head_dim, dtype=cfg.dtype, device=str(engine.device))
        engine.bytes_per_block //= self.world_size
        runner = ModelRunner(engine.model, engine.kv_cache, engine.block_manager, engine.device)
        send_op(OP_INIT, num_blocks, self.device)
        engine.runner = TensorParallelRunner(runner, self)
        return engine

    def check_alive(self):
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers have been shut down (close() or an earlier failure)")
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.context.processes) if not p.is_alive()]
        if dead:
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
                send_op(OP_STOP, 0, self.device)
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


class TensorParallelRunner:
    """ModelRunner's interface (execute, copy_blocks, prepare, model, kv_cache) at tensor parallelism:
    rank 0 prepares the step, broadcasts it, and runs its shard alongside the workers."""

    def __init__(self, runner, group):
        self.runner, self.group = runner, group
        self.model, self.kv_cache, self.device = runner.model, runner.kv_cache, runner.device

    def prepare(self, sched_out):
        return self.runner.prepare(sched_out)

    def copy_blocks(self, block_copies):
        raise NotImplementedError("at tensor parallelism block copies travel with the step (execute)")

    @torch.inference_mode()
    def execute(self, sched_out):
        """Run one step on every rank. Returns (logits [N, vocab] float32, the N sequences that sample)."""
        self.group.check_alive()
        try:
            step = self.runner.prepare(sched_out)
            copies = list(sched_out.block_copies or [])
            send_step(step, copies, self.device)
            logits = run_step(self.runner, step, copies)
        except BaseException as e:
            self.group.fail(e)
        if logits is None:
            return None, []
        return logits, step.sampling_seqs
