"""CUDA graphs for the steps that hold prompt tokens: the forward captured in pieces, attention between them.

A pure-decode step replays one graph (cuda_graph.py). A step with prompt tokens (a prefill, or prompt chunks
beside decoding sequences) cannot be one graph: its attention's work depends on the step's sequences, how
many and how long. Everything else in the forward works row by row (each token's row goes through the same
norms, projections, rotary, MLP), so it depends only on the number of rows. The forward is cut at each
attention into L + 1 pieces,

    piece 0      ids -> embedding -> layer 0 before its attention (input norm, q/k/v, rotary, K/V write) -> q_0
    piece i      o -> layer i-1 after its attention (o_proj, norm, MLP) -> layer i before its attention -> q_i
    piece L      o -> layer L-1 after its attention -> the final norm -> hidden

(the model states them: Qwen2ForCausalLM.piece(i, ...), the same stages its forward runs), and each piece is
captured once per padded token count T of a ladder (16, 32, 64, ... up to the step's token budget) and
replayed with the attention of layer i launched eagerly after piece i, on the step's own metadata:

    hidden = graphs.forward(ids, positions, kv_cache, attn_metadata)     # [num_tokens, hidden]

So a 24-layer step costs 25 graph launches plus 24 attention launches (each with its plan and merge)
instead of ~200 kernel launches and ~250 torch calls from Python: tens of milliseconds of host time.

Buffers at fixed addresses, per T: ids, positions and slot_mapping [T] (the step's values copied in; rows
past its tokens keep slot -1, so a padding row writes nothing into the pool, and stale valid ids and
positions), the attention's output o [T, H, D] (written by every layer's attention, read by the next piece),
and each piece's outputs (q_i, the residual stream), kept for the graphs' life. Padding rows carry garbage
through the row-wise ops, which never mix rows, and are dropped. The GEMMs run over T rows instead of the
step's, so cuBLAS may pick other kernels than an eager step would: fp16 roundings, and with them near-tie
tokens, can differ from the eager path (as they do between eager steps of different sizes).

A bucket is captured the first time a step needs it (~25 captures, tens of milliseconds), or ahead by
capture(sizes). The graphs share one memory pool, freed with this object.
"""
import torch

from pagedattn.engine.cuda_graph import capture_stream, no_collection

MIN_TOKENS = 16


def token_ladder(max_tokens, min_tokens=MIN_TOKENS):
    """The padded token counts min_tokens, 2 min_tokens, ... (< max_tokens), then max_tokens itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes, t = [], min_tokens
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]


class _Bucket:
    """One padded token count's static inputs, its pieces on them (`piece(i)`, set by PiecewiseGraphs), and once
    captured their graphs and outputs. run(i): piece i -> its q (or, the last, hidden): the graph replayed,
    or (not captured: the CPU, tests) the piece called."""

    def __init__(self, tokens, num_heads, head_dim, dtype, device):
        self.ids = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int32, device=device)
        self.o = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.piece, self.graphs, self.outputs, self.kept = None, [], [], []

    def run(self, i):
        if not self.graphs:
            return self.piece(i)[0]
        self.graphs[i].replay()
        return self.outputs[i]


class PiecewiseGraphs:
    """Captures the model's forward in pieces per padded token count; forward() replays them.

    model: the Qwen2ForCausalLM (its pieces and ops table); kv_cache: the pool its pieces write and its
    attention reads; max_tokens: the largest step (the engine's token budget); graphs=False: no capture,
    each piece a plain call (the same pieces and buffers on the CPU, for tests)."""

    def __init__(self, model, kv_cache, max_tokens, graphs=True):
        self.model, self.kv_cache = model, kv_cache
        self.sizes = token_ladder(max_tokens)
        self.graphs = graphs                              # False: the pieces as plain calls (the CPU, tests)
        self.buckets = {}
        self.pool = None

    def padded(self, num_tokens):
        """The smallest ladder size >= num_tokens, or None."""
        return next((t for t in self.sizes if t >= num_tokens), None)

    def can_run(self, step):
        return step.num_beams == 0 and 0 < step.num_tokens and self.padded(step.num_tokens) is not None

    def drop(self):
        """Forget the captured pieces (and their memory pool); each size is captured again when next needed."""
        self.buckets, self.pool = {}, None

    def _piece_on(self, b):
        """piece(i) on bucket b's buffers, the residual stream carried from one piece to the next."""
        model, kv = self.model, self.kv_cache
        carry = [None]

        def piece(i):
            x = b.ids if i == 0 else b.o
            out, carry[0] = model.piece(i, b.positions, x, carry[0], kv, b.slots)
            return out, carry[0]
        return piece

    def forward(self, ids, positions, kv_cache, attn_metadata):
        """The model's forward of one step (ids, positions: [T] device tensors; kv_cache: the pool it was
        captured on; the step's AttentionMetadata) through the pieces of its padded size. Returns hidden
        [T, hidden] (a view of the graphs' output, valid until the next replay of that size)."""
        T = ids.shape[0]
        b = self.buckets.get(self.padded(T)) or self.capture_size(self.padded(T), self.graphs)
        b.ids[:T].copy_(ids)
        b.positions[:T].copy_(positions)
        b.slots[:T].copy_(attn_metadata.slot_mapping)
        b.slots[T:].fill_(-1)
        attend = self.model.ops.attention
        for i in range(self.model.num_pieces - 1):
            q = b.run(i)
            attend(q[:T], kv_cache.k_caches[i], kv_cache.v_caches[i], attn_metadata, out=b.o[:T])
        return b.run(self.model.num_pieces - 1)[:T]

    @torch.inference_mode()
    def capture_size(self, tokens, graphs=True):
        """Capture the pieces for `tokens` padded rows (all padding: nothing is written into the pool).
        graphs=False (the CPU, tests): the bucket runs its pieces as plain calls."""
        mc, kv = self.model.config, self.kv_cache
        b = _Bucket(tokens, mc.num_attention_heads // self.model.tp_size, mc.head_dim, kv.dtype, kv.k_caches[0].device)
        b.piece = self._piece_on(b)
        if graphs:
            side = capture_stream(b.ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                 # warm-up: kernels loaded, cuBLAS set up for T rows
                for i in range(self.model.num_pieces):
                    b.piece(i)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            # Every piece's outputs are kept: a later piece (or the eager attention) reads them at their
            # capture-time addresses, so the pool must never hand their memory to another piece.
            with no_collection():
                for i in range(self.model.num_pieces):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=side):
                        out, residual = b.piece(i)
                    if self.pool is None:
                        self.pool = g.pool()
                    b.graphs.append(g)
                    b.outputs.append(out)
                    b.kept.append(residual)
            torch.cuda.synchronize()
        self.buckets[tokens] = b
        return b

    def capture(self, sizes=None):
        """Capture these padded sizes now (default: the whole ladder), largest first."""
        with no_collection():                             # one collection for the whole ladder
            for t in sorted(sizes or self.sizes, reverse=True):
                if t not in self.buckets:
                    self.capture_size(t, self.graphs)
