"""One rank's model: its shard of the weights, its KV pool, its CUDA graphs; runs one step at a time.

    runner = start_runner(config)                             # rank 0 (and, with P > 1, ranks 1..P-1 started)
    result = runner.execute(step_inputs)                      # launches the step (asynchronously on CUDA)
    tokens, logprobs, beams = result.wait()                   # host numpy arrays
    runner.close()                                            # weights, pool, graphs, workers: given back

Every rank runs the same ModelRunner on the same StepInputs (pagedattn.engine.step_inputs); with tensor
parallelism (P = config.tensor_parallel_size > 1) rank r loads query/KV heads [r*H/P, (r+1)*H/P) of every
layer, holds only its KV heads of every block in its pool (so one block id means the same tokens on every
rank), and the model's collectives join the ranks inside the forward. Rank 0 drives the others: its runner
holds the Workers (pagedattn.distributed.worker) and broadcasts each step before running it; ranks 1..P-1
run `serve_steps` below, the same runner in a loop. Rank 0's results are the engine's.

A step: copy-on-write block copies -> one host-to-device copy of the packed inputs -> the ids of
in-flight tokens read from the previous step's sampled tokens -> forward -> logits of the sampling rows ->
sampling on the device (pagedattn.layers.sampler) into the shared sampled-token buffer -> an asynchronous
copy of the sampled tokens to pinned host memory. Pure-decode steps on CUDA replay a captured graph of
all of it (pagedattn.engine.cuda_graph) unless enforce_eager or the attention backend cannot be captured;
steps with prompt tokens replay the forward's pieces between attentions (pagedattn.engine.piecewise_graph).
"""
import contextlib

import numpy as np
import torch
import torch.distributed as dist

from pagedattn.config import kv_pool_blocks
from pagedattn.distributed.worker import (OP_PING, OP_STEP, OP_STOP, TensorParallelError, Workers, agree_num_blocks,
                                          cpu_threads_per_rank, exit_cleanly, join_group, rank_device, recv,
                                          torchrun_launch)
from pagedattn.engine.cuda_graph import bound_for, graph_batch_sizes, padded_batch_size
from pagedattn.engine.step_inputs import HEADER_LEN, StepInputs
from pagedattn.errors import InvalidRequestError, KernelLaunchError
from pagedattn.kv_cache import AttentionMetadata, KVCache
from pagedattn.layers import sampler
from pagedattn.layers.attention import NumbaBackend, get_backend
from pagedattn.models.loader import read_config


class StepResult:
    """A launched step's outputs on their way to the host. wait() -> (tokens [N] int32, logprobs [N]
    float32, beams (logprobs [Nb, K] float32, ids [Nb, K] int64) or None), numpy."""

    def __init__(self, tokens, logprobs, beams, event=None):
        self._tokens, self._logprobs, self._beams, self._event = tokens, logprobs, beams, event

    def wait(self):
        if self._event is not None:
            self._event.synchronize()
        beams = None if self._beams is None else (self._beams[0].numpy(), self._beams[1].numpy())
        return self._tokens.numpy(), self._logprobs.numpy(), beams


class _Staging:
    """A pinned host int32 buffer and a device buffer, grown on demand, for one copy per step (CUDA)."""

    def __init__(self, device, size=1 << 16):
        self.device = device
        self.copied = None
        self._alloc(size)

    def _alloc(self, size):
        if self.copied is not None:
            self.copied.synchronize()
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.copied = torch.cuda.Event()

    def upload(self, data):
        """data: int32 numpy array -> a device view holding it (valid until the next upload)."""
        n = data.shape[0]
        if n > self.host.shape[0]:
            self._alloc(max(n, 2 * self.host.shape[0]))
        else:
            self.copied.synchronize()                 # the previous copy has left the pinned buffer
        self.host[:n].numpy()[:] = data
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self.copied.record()
        return self.dev[:n]


def load_shard(config, rank, world_size, device):
    """(model, model_config) of rank `rank`: the checkpoint's shard for world_size ranks, its attention
    backend's host-side checks off (each step's metadata is checked once on the host: ModelRunner._run).
    config.weights "quantized": the GGUF file's blocks (config.gguf_file; CPU, one rank), config.activations their
    activations ("float32" or "int8")."""
    from pagedattn.models.loader import load_gguf_model, load_model

    backend = get_backend(config.attn_backend, device)
    if hasattr(backend, "validate"):
        backend.validate = False
    if config.batch_invariant:                   # EngineConfig allows it with the numba backends only
        backend.batch_invariant = True
        if str(device).startswith("cuda"):
            from pagedattn.layers.ops import no_split_k
            no_split_k()
    if config.weights == "quantized":
        return load_gguf_model(config.model, config.gguf_file, backend, config.activations)
    return load_model(config.model, device, config.dtype, backend, tp_rank=rank, tp_size=world_size,
                      fused_allreduce=config.fused_allreduce)


# The decode step as one kernel (kernels_numba/step.py; EngineConfig.step_kernel). STEP_CONTEXT: the context bound
# of the steps it takes (its attention reads a sequence's keys with one CTA per q head, without a split: the
# model's split-KV kernel is the one for long contexts); STEP_KERNEL_AUTO: (sequences, context bound) up to which it
# measured faster than the model's graphs on the H200, None until measured (docs/kernels.md, "The step family").
STEP_VERSION = 5
STEP_MAX_SEQS = 8
STEP_CONTEXT = 1024
STEP_KERNEL_AUTO = None


def step_kernel_limits(config, world_size):
    """(sequences, context bound) of the pure-decode steps the step kernel takes under `config`, or None."""
    if config.step_kernel == "off" or torch.device(config.device).type != "cuda" or world_size > 1 \
            or config.batch_invariant or config.dtype not in (torch.float16, torch.float32):
        return None
    return (STEP_MAX_SEQS, STEP_CONTEXT) if config.step_kernel == "on" else STEP_KERNEL_AUTO


def share_step_kernels(model, version, num_ctas=132, max_positions=4096, **kwargs):
    """kernels_numba.step.StepKernels over `model`'s weights (a Qwen2ForCausalLM of one rank, float16 or float32),
    held once: the kernels stack each kind of weight over the layers (q/k/v and gate/up in the model's merged
    layouts), then the model's parameters are re-pointed at views of those stacks, the same values. On CUDA
    torch tensors; on the CPU numpy views of them (numba's CUDA simulator). kwargs: StepKernels'."""
    from kernels_numba.step import StepKernels

    c, m = model.config, model.model
    on_gpu = m.embed_tokens.weight.is_cuda
    arr = (lambda t: t.detach()) if on_gpu else (lambda t: t.detach().numpy())       # noqa: E731
    back = (lambda a: a) if on_gpu else torch.from_numpy                             # noqa: E731
    weights = {"model.embed_tokens.weight": arr(m.embed_tokens.weight), "model.norm.weight": arr(m.norm.weight)}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = arr(model.lm_head.weight)
    for i, layer in enumerate(m.layers):
        p, attn, mlp = f"model.layers.{i}", layer.self_attn, layer.mlp
        qkv_w, qkv_b, q, kv = arr(attn.qkv_proj.weight), arr(attn.qkv_proj.bias), attn.qkv_proj.q_size, \
            attn.qkv_proj.kv_size
        gate_up, I = arr(mlp.gate_up_proj.weight), mlp.gate_up_proj.weight.shape[0] // 2
        for n, rows in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
            weights[f"{p}.self_attn.{n}_proj.weight"] = qkv_w[rows[0]:rows[1]]
            weights[f"{p}.self_attn.{n}_proj.bias"] = qkv_b[rows[0]:rows[1]]
        weights.update({f"{p}.input_layernorm.weight": arr(layer.input_layernorm.weight),
                        f"{p}.self_attn.o_proj.weight": arr(attn.o_proj.weight),
                        f"{p}.post_attention_layernorm.weight": arr(layer.post_attention_layernorm.weight),
                        f"{p}.mlp.gate_proj.weight": gate_up[:I], f"{p}.mlp.up_proj.weight": gate_up[I:],
                        f"{p}.mlp.down_proj.weight": arr(mlp.down_proj.weight)})
    config = {"num_layers": c.num_hidden_layers, "num_heads": c.num_attention_heads,
              "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "eps": c.rms_norm_eps,
              "theta": c.rope_theta, "tied": c.tie_word_embeddings}
    kernels = StepKernels(weights, config, num_ctas=num_ctas, on_gpu=on_gpu, max_positions=max_positions,
                          version=version, **kwargs)
    del weights
    stacked = kernels.stacked
    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for param, name in ((layer.input_layernorm.weight, "ln1"), (attn.qkv_proj.weight, "qkv_w"),
                            (attn.qkv_proj.bias, "qkv_b"), (attn.o_proj.weight, "o"),
                            (layer.post_attention_layernorm.weight, "ln2"), (mlp.gate_up_proj.weight, "gate_up"),
                            (mlp.down_proj.weight, "down")):
            param.data = back(stacked[name][i])
    return kernels


_ALONE = contextlib.nullcontext()       # a step of one rank: nothing to broadcast


def kernel_cache_owner():
    """A context manager factory making the numba CUDA kernels' cached views and scratch buffers made inside it
    one runner's (kernels_numba.bridge.owner), and a function releasing them: (owned, release)."""
    from kernels_numba import bridge

    token = object()               # plain: the caches' owner sets must not keep the runner alive
    return (lambda: bridge.owner(token)), (lambda: bridge.release(token))


def start_runner(config):
    """The engine's ModelRunner (rank 0). Under torchrun with tensor_parallel_size > 1, on ranks other than 0
    this runs the worker loop and exits the process when rank 0 closes (never returning)."""
    launch = torchrun_launch() if config.tensor_parallel_size > 1 else None
    if launch is not None:
        if launch.world_size != config.tensor_parallel_size:
            raise InvalidRequestError(f"tensor_parallel_size={config.tensor_parallel_size} but torchrun started "
                                      f"WORLD_SIZE={launch.world_size} ranks: they must be equal")
        if launch.rank != 0:
            run_torchrun_worker(config, launch)
    return ModelRunner(config, launch=launch)


class ModelRunner:
    """config: an EngineConfig whose `model` is a directory; rank: this rank of config.tensor_parallel_size;
    device: this rank's device (default: config.device, or cuda:<local rank> with tensor parallelism on CUDA).
    Rank 0 of several starts (or, under torchrun `launch`, joins) the other ranks and the process group
    first; ranks 1..P-1 are built by serve_steps, in a group already joined. The pool size is settled here:
    config.num_blocks, or what this rank can hold (with P ranks: the least any rank can)."""

    _open_on_cuda = 0                       # runners on CUDA not yet closed, in this process

    def __init__(self, config, rank=0, device=None, launch=None):
        P = self.world_size = config.tensor_parallel_size
        self.config, self.rank = config, rank
        self.workers = None
        if rank == 0 and P > 1:
            from pagedattn.distributed.parallel import check_tensor_parallel_size

            check_tensor_parallel_size(read_config(config.model), P)       # before any process starts
            self.workers = Workers(config, worker_main, HEADER_LEN, launch)
            device = self.workers.device
        if device is None:
            device = config.device
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.owned, self.release_caches = contextlib.nullcontext, lambda: None
        self.model = self.kv_cache = self.graphs = self.piecewise = None
        self._closed = False
        if self.cuda:
            ModelRunner._open_on_cuda += 1
        try:
            self._build(config)
        except BaseException as e:
            workers, self.workers = self.workers, None
            self.close()
            if workers is not None:
                workers.fail(e)           # stops them; raises TensorParallelError (a worker's traceback if one failed)
            raise

    def _build(self, config):
        self.model, self.model_config = load_shard(config, self.rank, self.world_size, self.device)
        backend = self.model.attn_backend
        self.step_limits = step_kernel_limits(config, self.world_size)
        self.step_kernels = None
        if self.step_limits is not None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.step_kernels = share_step_kernels(self.model, STEP_VERSION, num_ctas=sms,
                                                   max_positions=min(config.max_model_len,
                                                                     self.model_config.max_position_embeddings))
            self.step_kernels.check_positions = False      # (the scheduler keeps positions below max_model_len)
        if isinstance(backend, NumbaBackend):      # its kernels keep cached views and scratch: this runner's share
            self.owned, self.release_caches = kernel_cache_owner()
        mc = self.model_config
        self.num_kv_heads = mc.num_key_value_heads // self.world_size
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len, mc.max_position_embeddings)
        self.graph_width = -(-self.max_model_len // self.block_size)      # block-table columns of a graph
        # CUDA: the LM head of an eager step runs on its sampling rows padded to the decode graphs' ladder
        # (1, 2, 4, ..., max_num_seqs), row counts the graph captures met already: every other count was a
        # cuBLAS shape of its own, whose first use cost ~4 ms of host time (a prefill-heavy workload's
        # first run: each step a new count)
        self.logit_rows = graph_batch_sizes(config.max_num_seqs) if self.cuda else None
        capturable = self.cuda and backend.can_capture(config.dtype, mc.head_dim, config.block_size)
        self.use_graphs = capturable and not config.enforce_eager
        self.use_piecewise = self.use_graphs and config.piecewise_graphs and self.world_size == 1
        # Where graphs can run, every step plans the decode kernel for a context bound of the graphs (plan_len_of):
        # the same split and float32 sums whether a step replays a graph or runs eagerly (enforce_eager
        # included), so a request's tokens do not depend on the path its steps took.
        self.plan_len = self.graph_width * self.block_size if capturable else None
        self._bounds = {}
        rows = config.max_num_seqs
        self.sampled_tokens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.sampled_logprobs = torch.zeros(rows, dtype=torch.float32, device=self.device)
        if self.cuda:
            self.staging = _Staging(self.device)
            self._host_out = [(torch.zeros(rows, dtype=torch.int32, pin_memory=True),
                               torch.zeros(rows, dtype=torch.float32, pin_memory=True)) for _ in range(2)]
            self._flip = 0
        self.num_blocks = self.available_blocks() if self.world_size == 1 else agree_num_blocks(self)
        # the step kernel writes every row's K/V, a decode graph's padding rows too: they get a block of their own,
        # one past the blocks the engine hands out (the model's kernels skip a padding row's write: block 0)
        self.pad_block = self.num_blocks if self.step_kernels is not None else 0
        self.kv_cache = KVCache(mc.num_hidden_layers, self.num_blocks + (self.step_kernels is not None),
                                self.num_kv_heads, self.block_size, mc.head_dim, dtype=config.dtype,
                                device=str(self.device))
        self.num_slots = self.num_blocks * self.block_size
        if self.use_piecewise:
            from pagedattn.engine.piecewise_graph import PiecewiseGraphs
            self.piecewise = PiecewiseGraphs(self.model, self.kv_cache, config.max_num_batched_tokens)

    # ---- the KV pool ------------------------------------------------------------------------------
    @property
    def bytes_per_block(self):
        mc = self.model_config
        return KVCache.bytes_per_block_of(mc.num_hidden_layers, self.num_kv_heads, self.block_size, mc.head_dim,
                                          self.config.dtype)

    def available_blocks(self):
        """KV blocks this rank can hold (pagedattn.config.kv_pool_blocks, with this rank's share of heads)."""
        return kv_pool_blocks(self.config, self.model_config, self.bytes_per_block, self.max_model_len,
                              self.device)

    # ---- graphs ---------------------------------------------------------------------------------
    def context_bounds(self, num_seqs):
        """The context bounds a decode of num_seqs sequences is planned for, ascending, the last plan_len: the
        backend's (its decode kernel may plan short contexts otherwise); each is a decode graph of its own."""
        if num_seqs not in self._bounds:
            mc = self.model_config
            bounds = self.model.attn_backend.decode_context_bounds(
                num_seqs, self.num_kv_heads, mc.num_attention_heads // mc.num_key_value_heads, self.plan_len,
                self.device)
            if self.step_limits is not None and num_seqs <= self.step_limits[0]:    # the step kernel's bound too
                bounds = sorted({*bounds, min(self.step_limits[1], self.plan_len or self.step_limits[1])})
            self._bounds[num_seqs] = bounds
        return self._bounds[num_seqs]

    def takes_step_kernel(self, step, max_context_len):
        """Whether the step kernel runs this step (planned for contexts up to max_context_len)."""
        return (self.step_kernels is not None and step.pure_decode and step.num_seqs <= self.step_limits[0]
                and max_context_len is not None and max_context_len <= self.step_limits[1])

    def plan_len_of(self, num_seqs, max_context_len):
        """The bound a decode of num_seqs sequences whose longest context is max_context_len plans for: the
        smallest of context_bounds(num_seqs) that holds it (a graph of that batch would take the same)."""
        return bound_for(self.context_bounds(num_seqs), max_context_len)

    def capture_graphs(self):
        """Capture the decode graphs now (otherwise before the first pure-decode step)."""
        if self.graphs is None and self.use_graphs:
            from pagedattn.engine.cuda_graph import CudaGraphRunner
            graphs = CudaGraphRunner(self, self.config.max_num_seqs, self.graph_width)
            graphs.capture()
            self.graphs = graphs
        return self.graphs

    def drop_graphs(self):
        """Forget the captured graphs (and their memory pools); the next steps capture anew."""
        self.graphs = None
        if self.piecewise is not None:
            self.piecewise.drop()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self):
        """Give everything back (the executor's shutdown, once): the workers stop, the graphs, pool and model
        go with this object, and this runner's share of the kernels' cached views and scratch. When no other
        runner on CUDA is open, torch's cuBLAS workspaces (32 MiB per stream the GEMMs ran on, kept by torch
        for the process's life) go too, so memory_allocated() returns to what it was before the first
        engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.workers is not None:
            self.workers.shutdown()
        self.graphs = self.piecewise = self.model = self.kv_cache = self.staging = None
        self.sampled_tokens = self.sampled_logprobs = self._host_out = None
        self.release_caches()
        if self.cuda:
            ModelRunner._open_on_cuda -= 1
            if ModelRunner._open_on_cuda == 0:
                torch.cuda.synchronize(self.device)
                clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
                if clear is not None:
                    clear()

    # ---- a step -----------------------------------------------------------------------------------
    def run_step(self, step, dev, max_context_len=None, gather=True, piecewise=None):
        """The capturable core: forward + logits + sampling of `step` whose packed inputs are the int32
        tensor `dev` on this rank's device. gather: read in-flight ids from the sampled-token buffer.
        piecewise: a PiecewiseGraphs to run the forward through (eager steps with prompt tokens).
        Sampled tokens go to sampled_tokens[:N]. Returns (hidden states [T, hidden], logits of the
        sampling rows [N, V] in the model's dtype, or None); a step the step kernel takes (takes_step_kernel):
        (None, its float32 logits)."""
        f = step.fields(dev)
        ids, src = f["input_ids"], f["input_src"]
        if gather:
            ids = torch.where(src >= 0, self.sampled_tokens[src.clamp(min=0)], ids)     # (T,) int32
        N, logits, hidden = step.num_samples, None, None
        if self.takes_step_kernel(step, max_context_len):      # the whole forward and the LM head in one kernel
            logits = torch.as_tensor(self.step_kernels.decode_step(   # (N, V) float32 (as_tensor: the simulator's)
                ids, f["positions"], self.kv_cache.k_caches, self.kv_cache.v_caches, f["block_tables"])[0])
        else:
            meta = AttentionMetadata(
                num_prefills=step.num_prefills, num_prefill_tokens=step.num_prefill_tokens,
                num_decode_tokens=step.num_seqs - step.num_prefills, slot_mapping=f["slot_mapping"],
                context_lens=f["context_lens"], block_tables=f["block_tables"], cu_seqlens_q=f["cu_seqlens_q"],
                max_context_len=max_context_len)
            forward = piecewise.forward if piecewise is not None else self.model.forward
            hidden = forward(ids, f["positions"], self.kv_cache, meta)                      # (T, hidden)
        if N and hidden is not None:
            rows = f["sample_rows"]
            padded = padded_batch_size(N, self.logit_rows) if self.logit_rows else None
            if padded is not None and padded > N:       # (the last row again; its logits are dropped)
                rows = torch.cat([rows, rows[-1:].expand(padded - N)])
            logits = self.model.compute_logits(hidden[rows], float32=False)[:N]   # (N, V), the model's dtype
        if N:
            st = sampler.SamplingTensors(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                                         seed=f["seed"], index=f["comp_index"], position=f["position"])
            sampler.sample(logits, st, out_tokens=self.sampled_tokens[:N], out_logprobs=self.sampled_logprobs[:N],
                           validate=False,                  # the step's arrays were checked when packed
                           batch_invariant=self.config.batch_invariant)
        return hidden, logits

    @torch.inference_mode()
    def execute(self, step, want_results=True):
        """Launch one step (on rank 0 of several: broadcast it to the others first). Returns a StepResult
        (None when want_results is False: workers)."""
        with _ALONE if self.workers is None else self.workers.step(step.header_array(), step.data):
            if self._closed:
                raise RuntimeError("the engine is closed: its model and KV pool were released")
            assert step.num_samples <= self.sampled_tokens.shape[0], "more sampling rows than max_num_seqs"
            host = step.fields()
            # the host-side checks that replace the kernels' per-call ones (host data: no sync)
            slots, tables, copies = host["slot_mapping"], host["block_tables"], host["block_copies"]
            if len(slots) and (int(slots.max()) >= self.num_slots or int(slots.min()) < 0):
                raise KernelLaunchError(f"slot_mapping has slots outside [0, {self.num_slots})")
            if tables.size and (int(tables.max()) >= self.num_blocks or int(tables.min()) < 0):
                raise KernelLaunchError(f"block table entry outside the pool of {self.num_blocks} blocks")
            beams = None
            with self.owned():
                if len(copies):                           # copy-on-write: (src, dst) in every layer, before the writes
                    self.model.attn_backend.copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches,
                                                        np.asarray(copies, dtype=np.int64))
                # the decode graphs are captured at the runner's first step, before any sampled token is in flight:
                # a capture's warm-up samples its padding rows into the buffer the next step reads ids from
                graphs = self.capture_graphs() if self.use_graphs else None
                if graphs is not None and graphs.can_run(step):
                    graphs.run(step)
                else:
                    dev = self.staging.upload(step.data) if self.cuda else torch.from_numpy(step.data)
                    piecewise = self.piecewise if self.piecewise is not None and self.piecewise.can_run(step) else None
                    plan_len = (self.plan_len_of(step.num_seqs - step.num_prefills, step.max_context_len)
                                if self.plan_len else step.max_context_len)
                    with self.model.ops.step_scope(len(host["input_ids"])):   # a small CPU step: its kernels' threads
                        hidden, _ = self.run_step(step, dev, max_context_len=plan_len,
                                                  gather=bool((host["input_src"] >= 0).any()), piecewise=piecewise)
                        if step.num_beams:
                            rows = step.fields(dev)["beam_rows"]
                            logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)   # (Nb, V)
                            beams = logprobs.topk(step.beam_k, dim=-1)
            if not want_results:
                return None
            N = step.num_samples
            if not self.cuda:
                return StepResult(self.sampled_tokens[:N].clone(), self.sampled_logprobs[:N].clone(),
                                  None if beams is None else (beams.values.clone(), beams.indices.clone()))
            tok_h, lp_h = self._host_out[self._flip]
            self._flip ^= 1
            tok_h[:N].copy_(self.sampled_tokens[:N], non_blocking=True)
            lp_h[:N].copy_(self.sampled_logprobs[:N], non_blocking=True)
            beams_h = None
            if beams is not None:
                beams_h = (beams.values.to("cpu", non_blocking=True), beams.indices.to("cpu", non_blocking=True))
            event = torch.cuda.Event()
            event.record()
            return StepResult(tok_h[:N], lp_h[:N], beams_h, event)


# ---- ranks 1..P-1 ----------------------------------------------------------------------------------
def serve_steps(rank, config, device, ctrl):
    """A worker's life after joining the group: build its ModelRunner (the ranks agree on the pool), then run
    every step rank 0 broadcasts until OP_STOP."""
    runner = ModelRunner(config, rank, device)
    try:
        while True:
            op, header, data = recv(ctrl, HEADER_LEN)
            if op == OP_STOP:
                return
            if op == OP_STEP:
                runner.execute(StepInputs.from_header_array(header, data), want_results=False)
            elif op != OP_PING:
                raise RuntimeError(f"rank {rank}: unknown op {op} from rank 0")
    finally:
        runner.close()


def worker_main(index, world_size, init_method, config, ctrl_timeout_s):
    """Entry point of spawned rank index + 1 (torch.multiprocessing passes `index`). Exits on OP_STOP."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is the parent's to handle
    rank = index + 1
    device = rank_device(config.device_type, rank)
    if config.device_type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    ctrl = join_group(rank, world_size, init_method, device, ctrl_timeout_s)
    try:
        serve_steps(rank, config, device, ctrl)
    finally:
        dist.destroy_process_group()
    exit_cleanly()


def run_torchrun_worker(config, launch):
    """Rank launch.rank (> 0) of a torchrun launch: join torchrun's group, serve rank 0's steps until it
    stops them, then exit the process with code 0. Any failure (rank 0 or a peer gone, a collective timed
    out) raises TensorParallelError out of the caller's LLM(...), whose process then exits with an error."""
    from pagedattn.distributed.parallel import check_tensor_parallel_size

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
        serve_steps(launch.rank, config, device, ctrl)
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
