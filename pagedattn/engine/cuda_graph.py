"""CUDA-graph decode: one captured forward (+ logits) per padded batch size.

A pure-decode step (every scheduled sequence computes one token) runs the same kernels every time,
only on different data, so its ~24 x 10 launches (numba kernels included: they launch on torch's
current stream through `cuda.external_stream`, which a capture records) are captured once per batch
size of a ladder 1, 2, 4, 8, 16, 32, 64, ... up to max_num_seqs, and replayed. The graphs read
persistent device buffers that each step overwrites in place:

    input_ids     [Bmax] int32       positions    [Bmax] int32     slot_mapping [Bmax] int32
    context_lens  [Bmax] int32       block_tables [Bmax, W] int32  (W = ceil(max_model_len / block_size))

A batch of n sequences runs the graph of the smallest ladder size B >= n. Rows n..B-1 are padding:
slot -1 (the write kernel skips them: nothing is written), context_len 1 and block table row
[0, 0, ...] (attention reads one slot of block 0, a valid block, and the result is discarded:
every op outside attention is row-wise, so a padding row cannot reach a real one). The split-KV
plan of the decode kernel is fixed at capture from W * block_size, the largest context a graph can
see, so the same graph serves every context length.

All five buffers live in one int32 device tensor, filled from one pinned host tensor with one
non-blocking copy per step (`DecodeBuffers`). `fill_decode_rows` is the host-side packing, a plain
numpy function so it is tested without a GPU.
"""
import numpy as np
import torch

from pagedattn.layers.attention import AttentionMetadata


def graph_batch_sizes(max_num_seqs):
    """The ladder 1, 2, 4, 8, ... (< max_num_seqs), then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(n, sizes):
    """The smallest ladder size >= n, or None when n exceeds the ladder."""
    for b in sizes:
        if b >= n:
            return b
    return None


class DecodeLayout:
    """Offsets of the five fields in the packed int32 buffer for batches up to `max_batch` rows."""

    def __init__(self, max_batch, max_blocks):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        B = max_batch
        self.ids = slice(0, B)
        self.pos = slice(B, 2 * B)
        self.slots = slice(2 * B, 3 * B)
        self.ctx = slice(3 * B, 4 * B)
        self.tables = slice(4 * B, 4 * B + B * max_blocks)
        self.size = 4 * B + B * max_blocks


def fill_decode_rows(buf, layout, tokens, positions, tables, block_size, batch):
    """Pack n decode rows, padded to `batch` rows, into `buf` (int32 numpy, layout.size).

    tokens, positions: n ints (each sequence's last token and its position); tables: n block-id
    lists (each long enough for position + 1 tokens, at most layout.max_blocks). Padding rows
    n..batch-1 get token 0, position 0, slot -1, context_len 1, block table [0, 0, ...].
    Rows past `batch` are left as they are (the graph of size `batch` does not read them).
    Returns n.
    """
    n = len(tokens)
    if n > batch or batch > layout.max_batch:
        raise ValueError(f"{n} rows do not fit a padded batch of {batch} (buffers hold {layout.max_batch})")
    L = layout
    ids, pos, slots, ctx = buf[L.ids], buf[L.pos], buf[L.slots], buf[L.ctx]
    bt = buf[L.tables].reshape(L.max_batch, L.max_blocks)
    p = np.asarray(positions, dtype=np.int64)
    ids[:n] = tokens
    pos[:n] = p
    ctx[:n] = p + 1
    bt[:batch] = 0
    for i, t in enumerate(tables):           # the one per-sequence loop: copying the block lists
        bt[i, :len(t)] = t
    if n:
        rows = np.arange(n)
        slots[:n] = bt[rows, p // block_size] * block_size + p % block_size
    ids[n:batch] = 0
    pos[n:batch] = 0
    slots[n:batch] = -1
    ctx[n:batch] = 1
    return n


class DecodeBuffers:
    """The pinned host staging buffer and the persistent device buffer (same layout), plus views."""

    def __init__(self, max_batch, max_blocks, device):
        self.layout = L = DecodeLayout(max_batch, max_blocks)
        pin = torch.device(device).type == "cuda"
        self.host = torch.zeros(L.size, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(L.size, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if pin else None
        self.input_ids = self.dev[L.ids]
        self.positions = self.dev[L.pos]
        self.slot_mapping = self.dev[L.slots]
        self.context_lens = self.dev[L.ctx]
        self.block_tables = self.dev[L.tables].view(max_batch, max_blocks)
        self.cu_seqlens_q = torch.zeros(1, dtype=torch.int32, device=device)

    def fill(self, tokens, positions, tables, block_size, batch):
        """Pack on the host, then one non-blocking copy of the rows the graph reads."""
        if self.copied is not None:
            self.copied.synchronize()         # the previous step's copy has left the pinned buffer
        fill_decode_rows(self.host_np, self.layout, tokens, positions, tables, block_size, batch)
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def metadata(self, batch):
        """AttentionMetadata over the first `batch` rows (views: no device allocation)."""
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=batch,
            slot_mapping=self.slot_mapping[:batch], context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch], cu_seqlens_q=self.cu_seqlens_q)


class CudaGraphDecoder:
    """Captures model forward + logits for each ladder size; `run` replays the right one.

    model: Qwen2ForCausalLM on CUDA; kv_cache: KVCache; max_num_seqs, max_model_len, block_size
    fix the buffers. Capture happens in `capture()` (a few seconds); graphs share one memory pool.
    """

    def __init__(self, model, kv_cache, max_num_seqs, max_model_len, block_size, device):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers(self.sizes[-1], self.max_blocks, device)
        self.graphs, self.logits = {}, {}
        self.pool = None

    def can_run(self, n):
        return padded_batch_size(n, self.sizes) is not None

    def _forward(self, batch):
        b = self.buffers
        hidden = self.model.forward(b.input_ids[:batch], b.positions[:batch], self.kv_cache, b.metadata(batch))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self):
        """Capture every ladder size, largest first (the pool then fits the smaller ones)."""
        b = self.buffers
        b.fill([], [], [], self.block_size, b.layout.max_batch)      # all rows padding: writes nowhere
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                                 # warm-up: compiles every kernel variant
            for batch in self.sizes:
                self._forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for batch in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[batch] = self._forward(batch)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[batch] = g
        torch.cuda.synchronize()

    def run(self, tokens, positions, tables):
        """Fill the buffers for these n decode rows and replay; returns logits [n, vocab] (a view)."""
        n = len(tokens)
        batch = padded_batch_size(n, self.sizes)
        self.buffers.fill(tokens, positions, tables, self.block_size, batch)
        self.graphs[batch].replay()
        return self.logits[batch][:n]
