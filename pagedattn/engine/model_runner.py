"""One rank's model: its shard of the weights, its KV pool, its CUDA graphs; runs one step at a time.

    runner = ModelRunner(config, rank=0, world_size=1)        # loads the (shard of the) checkpoint
    runner.allocate_kv_cache(num_blocks)                      # after the engine settles the pool size
    result = runner.execute(step_inputs)                      # launches the step (asynchronously on CUDA)
    tokens, logprobs, beams = result.wait()                   # host numpy arrays

Every rank runs the same ModelRunner on the same StepInputs (pagedattn.engine.step_inputs); with tensor
parallelism (world_size P > 1) rank r loads query/KV heads [r*H/P, (r+1)*H/P) of every layer, holds only
its KV heads of every block in its pool (so one block id means the same tokens on every rank), and the
model's collectives join the ranks inside the forward. Rank 0's results are the engine's.

A step: copy-on-write block copies -> one host-to-device copy of the packed inputs -> the ids of
in-flight tokens read from the previous step's sampled tokens -> forward -> logits of the sampling rows ->
sampling on the device (pagedattn.layers.sampler) into the shared sampled-token buffer -> an asynchronous
copy of the sampled tokens to pinned host memory. Pure-decode steps on CUDA replay a captured graph of
all of it (pagedattn.engine.cuda_graph) unless enforce_eager or the attention backend cannot be captured.
"""
import numpy as np
import torch

from pagedattn.config import kv_pool_blocks
from pagedattn.engine.cuda_graph import bound_for, graph_batch_sizes, padded_batch_size
from pagedattn.errors import KernelLaunchError
from pagedattn.kv_cache import KVCache
from pagedattn.layers.attention import AttentionMetadata, get_backend
from pagedattn.layers import sampler


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
    backend's host-side checks off (each step's metadata is checked once on the host: ModelRunner._check).
    config.weights "quantized": the GGUF file's blocks (config.gguf_file; CPU, one rank), config.activations their
    activations ("float32" or "int8")."""
    from pagedattn.models.loader import load_gguf_model, load_model

    backend = get_backend(config.attn_backend, device)
    if hasattr(backend, "validate"):
        backend.validate = False
    if config.weights == "quantized":
        return load_gguf_model(config.model, config.gguf_file, backend, config.activations)
    return load_model(config.model, device, config.dtype, backend, tp_rank=rank, tp_size=world_size)


class ModelRunner:
    """config: an EngineConfig whose `model` is a directory; rank / world_size: tensor-parallel position;
    device: this rank's device (default: config.device, or cuda:rank for tensor parallelism on CUDA)."""

    def __init__(self, config, rank=0, world_size=1, device=None):
        if device is None:
            device = f"cuda:{rank}" if config.device_type == "cuda" and world_size > 1 else config.device
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # CUDA: the LM head of an eager step runs on its sampling rows padded to the decode graphs' ladder
        # (1, 2, 4, ..., max_num_seqs), row counts the graph captures met already: every other count was a
        # cuBLAS shape of its own, whose first use cost ~4 ms of host time (a prefill-heavy workload's
        # first run: each step a new count)
        self.logit_rows = graph_batch_sizes(config.max_num_seqs) if self.cuda else None
        self._closed = False
        if self.cuda:
            ModelRunner._open_on_cuda += 1
        self.model, self.model_config = load_shard(config, rank, world_size, self.device)
        backend = self.model.attn_backend
        mc = self.model_config
        self.num_kv_heads = mc.num_key_value_heads // world_size
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len, mc.max_position_embeddings)
        self.graph_width = -(-self.max_model_len // self.block_size)      # block-table columns of a graph
        self.kv_cache = None
        self.graphs = None
        self.piecewise = None
        capturable = self.cuda and backend.can_capture(config.dtype, mc.head_dim, config.block_size)
        self.use_graphs = capturable and not config.enforce_eager
        self.use_piecewise = self.use_graphs and config.piecewise_graphs and world_size == 1
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

    def allocate_kv_cache(self, num_blocks):
        mc = self.model_config
        self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, self.num_kv_heads, self.block_size, mc.head_dim,
                                dtype=self.config.dtype, device=str(self.device))
        self.num_slots = num_blocks * self.block_size

    def context_bounds(self, num_seqs):
        """The context bounds of the decode graphs of num_seqs sequences, ascending, the last plan_len: the
        backend's bounds where its decode kernel plans short contexts otherwise (decode_context_bounds)."""
        if num_seqs not in self._bounds:
            mc = self.model_config
            self._bounds[num_seqs] = self.model.attn_backend.decode_context_bounds(
                num_seqs, self.num_kv_heads, mc.num_attention_heads // mc.num_key_value_heads, self.plan_len,
                self.device)
        return self._bounds[num_seqs]

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

    _open_on_cuda = 0                       # runners on CUDA not yet closed, in this process

    def close(self):
        """Called once by the executor's shutdown. When no other runner on CUDA is open, torch's cuBLAS
        workspaces (32 MiB per stream the GEMMs ran on, kept by torch for the process's life) go too,
        so memory_allocated() returns to what it was before the first engine."""
        if not self.cuda or self._closed:
            return
        self._closed = True
        self.graphs = None
        self.piecewise = None
        ModelRunner._open_on_cuda -= 1
        if ModelRunner._open_on_cuda == 0:
            torch.cuda.synchronize(self.device)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()

    def piecewise_graphs(self):
        """The piecewise graphs of steps with prompt tokens (made on first use; each size captured when a step
        first needs it)."""
        if self.piecewise is None and self.use_piecewise:
            from pagedattn.engine.piecewise_graph import PiecewiseGraphs
            self.piecewise = PiecewiseGraphs(self, self.config.max_num_batched_tokens)
        return self.piecewise

    def drop_graphs(self):
        """Forget the captured graphs (and their memory pools); the next steps capture anew."""
        self.graphs = None
        self.piecewise = None
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- a step -----------------------------------------------------------------------------------
    def copy_blocks(self, copies):
        """Copy-on-write: copies [C, 2] (src, dst) in every layer before the step writes into dst."""
        if len(copies) == 0:
            return
        self.model.attn_backend.copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches,
                                            np.asarray(copies, dtype=np.int64))

    def _check(self, f):
        """The host-side checks that replace the kernels' per-call ones (host data: no sync)."""
        slots = f["slot_mapping"]
        if len(slots) and (int(slots.max()) >= self.num_slots or int(slots.min()) < 0):
            raise KernelLaunchError(f"slot_mapping has slots outside [0, {self.num_slots})")
        tables = f["block_tables"]
        if tables.size and (int(tables.max()) >= self.kv_cache.num_blocks or int(tables.min()) < 0):
            raise KernelLaunchError(f"block table entry outside the pool of {self.kv_cache.num_blocks} blocks")

    def run_step(self, step, dev, max_context_len=None, gather=True, piecewise=None):
        """The capturable core: forward + logits + sampling of `step` whose packed inputs are the int32
        tensor `dev` on this rank's device. gather: read in-flight ids from the sampled-token buffer.
        piecewise: a PiecewiseGraphs to run the forward through (eager steps with prompt tokens).
        Sampled tokens go to sampled_tokens[:N]. Returns (hidden states [T, hidden], logits of the
        sampling rows [N, V] in the model's dtype, or None)."""
        f = step.fields(dev)
        ids, src = f["input_ids"], f["input_src"]
        if gather:
            ids = torch.where(src >= 0, self.sampled_tokens[src.clamp(min=0)], ids)     # (T,) int32
        meta = AttentionMetadata(
            num_prefills=step.num_prefills, num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_seqs - step.num_prefills, slot_mapping=f["slot_mapping"],
            context_lens=f["context_lens"], block_tables=f["block_tables"], cu_seqlens_q=f["cu_seqlens_q"],
            max_context_len=max_context_len)
        if piecewise is not None:
            hidden = piecewise.forward(ids, f["positions"], f["slot_mapping"], meta)     # (T, hidden)
        else:
            hidden = self.model.forward(ids, f["positions"], self.kv_cache, meta)      # (T, hidden)
        N, logits = step.num_samples, None
        if N:
            rows = f["sample_rows"]
            padded = padded_batch_size(N, self.logit_rows) if self.logit_rows else None
            if padded is not None and padded > N:       # (the last row again; its logits are dropped)
                rows = torch.cat([rows, rows[-1:].expand(padded - N)])
            logits = self.model.compute_logits(hidden[rows], float32=False)[:N]   # (N, V), the model's dtype
            st = sampler.SamplingTensors(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                                 seed=f["seed"], index=f["comp_index"], position=f["position"])
            sampler.sample(logits, st, out_tokens=self.sampled_tokens[:N], out_logprobs=self.sampled_logprobs[:N])
        return hidden, logits

    @torch.inference_mode()
    def execute(self, step, want_results=True):
        """Launch one step. Returns a StepResult (None when want_results is False: workers)."""
        assert step.num_samples <= self.sampled_tokens.shape[0], "more sampling rows than max_num_seqs"
        host = step.fields()
        self._check(host)
        self.copy_blocks(host["block_copies"])
        beams = None
        if self.use_graphs and self.capture_graphs().can_run(step):
            self.graphs.run(step)
        else:
            dev = self.staging.upload(step.data) if self.cuda else torch.from_numpy(step.data)
            # a small CPU step: the sampler's torch ops on one thread too (CpuStep.scope)
            piecewise = self.piecewise_graphs()
            if piecewise is not None and not piecewise.can_run(step):
                piecewise = None
            with self.model.ops.step_scope(len(host["input_ids"])):
                plan_len = (self.plan_len_of(step.num_seqs - step.num_prefills, step.max_context_len)
                            if self.plan_len else step.max_context_len)
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

