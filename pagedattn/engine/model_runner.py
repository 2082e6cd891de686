"""Pack one scheduled step into tensors, run the model on the paged KV cache, return logits.

For a step with sequences s (prefill chunks first, then decodes), each computing its tokens
[start_s, end_s):

    input_ids     [T] int32   token_ids[start_s:end_s], concatenated
    positions     [T] int32   start_s .. end_s - 1, concatenated
    slot_mapping  [T] int32   block_table_s[pos // block_size] * block_size + pos % block_size
    context_lens  [S] int32   end_s (tokens in the cache after this step's write)
    block_tables  [S, W] int32, padded with 0
    cu_seqlens_q  [P + 1] int32, the prefill chunks' boundaries
    logits rows   [N] int32   the last row of each sequence that samples this step

The step is lean: the host loop over sequences only slices token lists and collects block tables;
every per-token quantity is a numpy op; all of the above is packed into one int32 host buffer
(pinned on CUDA) and moved with one non-blocking copy into a persistent device buffer that grows
only when a step needs more room, so a step allocates no device tensors for its inputs. The one
host-device synchronisation of a step is the engine reading the sampled tokens. The kernels'
own per-call checks (one sync each, per layer) are off; `prepare` checks the packed metadata once
per step on the host instead (slots and block ids inside the pool), which costs no sync.

Pure-decode steps on CUDA replay a captured CUDA graph (pagedattn.engine.cuda_graph) unless
`enforce_eager`; prefill and mixed steps, and batches above the graph ladder, run eagerly.
Logits are computed only for the rows that sample (the graphs compute every padded row).
"""
from dataclasses import dataclass

import numpy as np
import torch

from pagedattn.layers.attention import AttentionMetadata, NumbaBackend, get_backend
from pagedattn.errors import KernelLaunchError


@dataclass
class PreparedStep:
    input_ids: torch.Tensor        # [T] int32
    positions: torch.Tensor        # [T] int32
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor   # [N] int32, rows of the hidden states to turn into logits
    sampling_seqs: list            # the N sequences those rows belong to


class LeanNumbaBackend(NumbaBackend):
    """NumbaBackend without the kernels' per-call host checks (each would sync once per layer).

    The runner validates the step's metadata on the host before the forward. max_context_len (the
    decode kernel's split-KV plan bound) is set by the runner per eager step; None (the graphs)
    means the block-table width times block_size.
    """

    def __init__(self, base=None):
        if base is None:
            super().__init__()
        else:
            self.__dict__.update(base.__dict__)
        self.max_context_len = None

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        if self.cache_ops is None:
            return super().write(k, v, k_cache, v_cache, slot_mapping)
        self.cache_ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, check_bounds=False)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out):
        if self.paged_attention is None or not self._kernel_ok(q, k_cache):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)
        res = self.paged_attention.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                                   out=out, validate=False, max_context_len=self.max_context_len)
        if res is not None and res.data_ptr() != out.data_ptr():
            out.copy_(res)


class StagingBuffer:
    """An int32 pinned host buffer and a device buffer, grown on demand, moved by one copy (CUDA).

    The device views `pack` returns are overwritten by the next step: use them within the step.
    On CPU each step gets fresh tensors (no copy needed; callers may keep them).
    """

    def __init__(self, device, size=1 << 16):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.copied = None
        self._alloc(size)

    def _alloc(self, size):
        if self.copied is not None:
            self.copied.synchronize()
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int32, device=self.device) if self.cuda else self.host
        self.copied = torch.cuda.Event() if self.cuda else None

    def pack(self, parts):
        """parts: 1-D int arrays. Returns their device views (one copy on CUDA; the host views on CPU)."""
        total = sum(len(p) for p in parts)
        if not self.cuda:                           # CPU: a fresh tensor per step (callers may keep it)
            flat = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int32) for p in parts]))
            return list(torch.split(flat, [len(p) for p in parts]))
        if total > self.host.shape[0]:
            self._alloc(max(total, 2 * self.host.shape[0]))
        elif self.copied is not None:
            self.copied.synchronize()               # the previous copy has read the pinned buffer
        offsets, o = [], 0
        for p in parts:
            self.host_np[o:o + len(p)] = p
            offsets.append(o)
            o += len(p)
        if self.cuda:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            self.copied.record()
        return [self.dev[s:s + len(p)] for s, p in zip(offsets, parts)]


class ModelRunner:
    """model: Qwen2ForCausalLM; kv_cache: KVCache; block_manager: for block tables.

    max_num_seqs / max_model_len size the CUDA-graph buffers; enforce_eager (or a CPU device)
    switches the graphs off. Graphs are captured lazily, before the first pure-decode step
    (or explicitly with `capture_graphs()`).
    """

    def __init__(self, model, kv_cache, block_manager, device, max_num_seqs=256, max_model_len=4096,
                 enforce_eager=False):
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.block_size = kv_cache.block_size
        self.device = torch.device(device)
        self.num_slots = kv_cache.k_caches[0].shape[0] * self.block_size
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.staging = StagingBuffer(self.device)
        self.graph_decoder = None
        self._resolve_backend()

    def _resolve_backend(self):
        backend = self.model.attn_backend
        if isinstance(backend, str):
            backend = get_backend(backend, self.device)
        if type(backend) is NumbaBackend:
            backend = LeanNumbaBackend(backend)
        self.model.attn_backend = backend
        self.lean_backend = backend if isinstance(backend, LeanNumbaBackend) else None

    def capture_graphs(self):
        if self.graph_decoder is None and self.use_graphs:
            from pagedattn.engine.cuda_graph import CudaGraphDecoder
            if self.lean_backend is not None:
                self.lean_backend.max_context_len = None
            dec = CudaGraphDecoder(self.model, self.kv_cache, self.max_num_seqs, self.max_model_len,
                                   self.block_size, self.device)
            dec.capture()
            self.graph_decoder = dec
        return self.graph_decoder

    def copy_blocks(self, block_copies):
        """Copy-on-write: copy src -> dst in every layer before the step writes into dst."""
        if not block_copies:
            return
        if self.device.type == "cuda":
            from kernels_numba.cache_ops import copy_blocks
            mapping = torch.tensor(block_copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches, mapping)
        else:
            self.kv_cache.copy_blocks(block_copies)

    def _check(self, slots, tables_np):
        """The host-side replacement for the kernels' per-layer checks (no sync: host data)."""
        if len(slots) and (int(slots.max()) >= self.num_slots or int(slots.min()) < 0):
            raise KernelLaunchError(f"slot_mapping has slots outside [0, {self.num_slots})")
        if tables_np.size and int(tables_np.max()) >= self.num_slots // self.block_size:
            raise KernelLaunchError("block table entry outside the pool")

    def prepare(self, sched_out):
        """Tensors for one SchedulerOutput (see the module docstring)."""
        bs = self.block_size
        input_ids, starts, q_lens, tables, sampling_seqs, last_rows = [], [], [], [], [], []
        offset = 0
        for seq, n in sched_out.scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            q_lens.append(n)
            tables.append(self.block_manager.block_table(seq.seq_id))
            offset += n
            if start + n == seq.num_tokens:          # caught up: this token's logits give the next one
                sampling_seqs.append(seq)
                last_rows.append(offset - 1)
        num_seqs, num_tokens, P = len(q_lens), offset, sched_out.num_prefills
        width = max(len(t) for t in tables)
        table_np = np.zeros((num_seqs, width), dtype=np.int64)
        for i, t in enumerate(tables):
            table_np[i, :len(t)] = t
        q_np = np.asarray(q_lens, dtype=np.int64)                                  # (S,)
        starts_np = np.asarray(starts, dtype=np.int64)                             # (S,)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_np, out=cu[1:])                                                # (S+1,)
        seq_of_token = np.repeat(np.arange(num_seqs), q_np)                        # (T,)
        positions = np.arange(num_tokens) - cu[seq_of_token] + starts_np[seq_of_token]
        slots = table_np[seq_of_token, positions // bs] * bs + positions % bs     # (T,)
        self._check(slots, table_np)
        ids_d, pos_d, slots_d, ctx_d, cu_d, rows_d, tables_d = self.staging.pack(
            [np.asarray(input_ids), positions, slots, starts_np + q_np, cu[:P + 1],
             np.asarray(last_rows, dtype=np.int64), table_np.reshape(-1)])
        if self.lean_backend is not None:
            self.lean_backend.max_context_len = int((starts_np + q_np).max())
        meta = AttentionMetadata(
            num_prefills=P,
            num_prefill_tokens=int(cu[P]),
            num_decode_tokens=num_seqs - P,
            slot_mapping=slots_d,
            context_lens=ctx_d,
            block_tables=tables_d.view(num_seqs, width),
            cu_seqlens_q=cu_d,
        )
        return PreparedStep(input_ids=ids_d, positions=pos_d, attn_metadata=meta, logits_indices=rows_d,
                            sampling_seqs=sampling_seqs)

    def _graph_decode(self, sched_out):
        """Pure-decode step through a CUDA graph, or None when the step does not qualify."""
        if not self.use_graphs or sched_out.num_prefills or not sched_out.scheduled:
            return None
        if len(sched_out.scheduled) > self.max_num_seqs:
            return None
        seqs = []
        for seq, n in sched_out.scheduled:
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                return None
            seqs.append(seq)
        dec = self.capture_graphs()
        tokens = [s.token_ids[-1] for s in seqs]
        positions = [s.num_tokens - 1 for s in seqs]
        tables = [self.block_manager.block_table(s.seq_id) for s in seqs]
        return dec.run(tokens, positions, tables), seqs

    @torch.inference_mode()
    def execute(self, sched_out):
        """Run one step. Returns (logits [N, vocab] float32, the N sequences that sample)."""
        self.copy_blocks(sched_out.block_copies)
        graphed = self._graph_decode(sched_out)
        if graphed is not None:
            return graphed
        step = self.prepare(sched_out)
        hidden = self.model.forward(step.input_ids, step.positions, self.kv_cache, step.attn_metadata)
        if not step.sampling_seqs:
            return None, []
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return logits, step.sampling_seqs
