"""CUDA-graph decode: one captured step (input ids -> forward -> logits -> sampling) per padded batch size.

A pure-decode step (every scheduled sequence computes one token and samples the next) runs the same
kernels every time, only on different data, so it is captured once per batch size of a ladder 1, 2, 4,
8, 16, 32, 64, ... up to max_num_seqs, and replayed. Numba kernels are captured too: they launch on
torch's current stream through `cuda.external_stream`.

Each ladder size B reads a persistent device buffer holding a StepInputs of a fixed header (B tokens,
B sequences, B sampling rows, W = ceil(max_model_len / block_size) table columns), overwritten in place
by one host-to-device copy per step. A batch of n sequences runs the graph of the smallest B >= n.
Rows n..B-1 are padding: slot -1 (the cache write skips it), context_len 1 and block table row
[0, 0, ...] (attention reads one slot of block 0, a valid block, and the result is discarded: every op
outside attention is row-wise, so a padding row cannot reach a real one), greedy sampling. Where the step
kernel runs (EngineConfig.step_kernel), which writes every row's K/V at its position, the padding rows'
tables name the runner's pad_block instead, a block past those the engine hands out. The
split-KV plan of the decode kernel is fixed at capture from a bound on the contexts: W * block_size (the
largest context a graph can see) and, for the batch sizes where the kernel plans short contexts otherwise
(ModelRunner.context_bounds: one CTA per sequence and head group instead of split partitions and their
merge, v10 up to 512 tokens), a second graph for that short bound. A step replays the graph of the smallest
bound that holds its longest context.

The captured step begins by reading the ids of in-flight tokens from the shared sampled-token buffer
(input_src >= 0) and ends by writing its own sampled tokens into that buffer, so consecutive steps chain
on the device (asynchronous scheduling) without the host in between.
"""
import contextlib
import gc
import weakref

import numpy as np
import torch

from pagedattn.engine.step_inputs import StepInputs, layout


_CAPTURE_STREAMS = {}


_no_collection_depth = 0


@contextlib.contextmanager
def no_collection():
    """Collect garbage now, then none until the block ends. A dead CUDAGraph (the graphs an engine dropped,
    held in reference cycles) freed by Python's cyclic collector in the middle of a capture resets itself
    there, which CUDA refuses and which invalidates the capture; torch no longer collects before a capture
    (torch.compiler.config.force_cudagraph_gc), so every capture here runs inside this. Nested blocks do not
    collect again (a full collection costs ~0.1 s in a process holding torch and transformers, once per
    capture of a ladder otherwise)."""
    global _no_collection_depth
    if _no_collection_depth == 0:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    _no_collection_depth += 1
    try:
        yield
    finally:
        _no_collection_depth -= 1
        if enabled:
            gc.enable()


def capture_stream(device):
    """The side stream the warm-up runs of a capture use, one per device for the process: torch keeps a
    cuBLAS workspace (32 MiB on Hopper) for every stream a GEMM ran on, so a new stream per engine would
    keep 32 MiB per engine ever made."""
    key = torch.device(device).index or 0
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[key]


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


def bound_for(bounds, context_len):
    """The smallest of the ascending context `bounds` that holds context_len (the last when none does)."""
    return next((b for b in bounds if context_len <= b), bounds[-1])


def padded_batch_size(n, sizes):
    """The smallest ladder size >= n, or None when n exceeds the ladder."""
    for b in sizes:
        if b >= n:
            return b
    return None


def decode_header(batch, width):
    return dict(num_tokens=batch, num_seqs=batch, width=width, num_prefills=0, num_prefill_tokens=0,
                num_samples=batch, num_beams=0, beam_k=0, num_copies=0, max_context_len=0)


def pad_decode_step(step, batch, width, pad_block=0):
    """The pure-decode StepInputs `step` (n rows) as a graph's input: `batch` rows (n real + padding) and
    `width` block-table columns; the padding rows' tables read `pad_block` (the runner's: a block no sequence
    holds where the step kernel, which writes every row's K/V, runs). Returns the int32 array in
    layout(decode_header(batch, width))."""
    n = step.num_seqs
    if n > batch or step.width > width:
        raise ValueError(f"a step of {n} rows x {step.width} blocks does not fit a graph of {batch} x {width}")
    padded = StepInputs(decode_header(batch, width), np.zeros(layout(decode_header(batch, width))["_size"][1],
                                                              dtype=np.int32))
    src, dst = step.fields(), padded.fields()
    for name in ("input_ids", "input_src", "positions", "slot_mapping", "context_lens", "sample_rows",
                 "temperature", "top_k", "top_p", "comp_index", "position", "seed"):
        dst[name][:n] = src[name]
    dst["block_tables"][:n, :step.width] = src["block_tables"]
    dst["block_tables"][n:] = pad_block
    dst["input_src"][n:] = -1
    dst["slot_mapping"][n:] = -1
    dst["context_lens"][n:] = 1
    dst["sample_rows"][n:] = np.arange(n, batch)
    dst["top_p"][n:] = 1.0
    return padded.data


class CudaGraphRunner:
    """Captures `runner.run_step` for each ladder size; `run` replays the right one.

    runner: the ModelRunner (its model, KV cache, shared sampled-token buffers); max_num_seqs and the
    block-table width fix the buffers. `capture()` takes a few seconds; the graphs share one memory pool,
    freed with them when the runner drops this object (it holds the runner weakly).
    """

    def __init__(self, runner, max_num_seqs, width):
        self._runner = weakref.ref(runner)        # the runner owns the graphs: no cycle keeps either alive
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.width = width
        size = layout(decode_header(self.sizes[-1], width))["_size"][1]
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.dev = torch.zeros(size, dtype=torch.int32, device=runner.device)
        self.copied = torch.cuda.Event()
        self.bounds = {b: runner.context_bounds(b) for b in self.sizes}     # batch -> its bounds, ascending
        self.graphs = {}                          # (batch, bound) -> CUDAGraph
        self.logits = {}                          # (batch, bound) -> the graph's logits [batch, V] (read after a replay)
        self.pool = None

    @property
    def runner(self):
        return self._runner()

    def can_run(self, step):
        return step.pure_decode and padded_batch_size(step.num_seqs, self.sizes) is not None \
            and step.width <= self.width

    def _fill_padding(self, batch):
        empty = StepInputs(decode_header(0, self.width),
                           np.zeros(layout(decode_header(0, self.width))["_size"][1], dtype=np.int32))
        data = torch.from_numpy(pad_decode_step(empty, batch, self.width, self.runner.pad_block))
        self.dev[:data.shape[0]].copy_(data)

    def _step(self, batch):
        return StepInputs(decode_header(batch, self.width), None)

    @torch.inference_mode()
    def capture(self):
        """Warm up (compiles every kernel variant), then capture every ladder size, largest first
        (the pool then fits the smaller ones). All rows are padding during capture: nothing is written."""
        side = capture_stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream())
        keys = [(batch, bound) for batch in self.sizes for bound in self.bounds[batch]]
        with torch.cuda.stream(side):
            for batch, bound in keys:
                self._fill_padding(batch)
                self.runner.run_step(self._step(batch), self.dev, max_context_len=bound)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with no_collection():
            for batch, bound in reversed(keys):
                self._fill_padding(batch)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=side):
                    _, self.logits[batch, bound] = self.runner.run_step(self._step(batch), self.dev,
                                                                        max_context_len=bound)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[batch, bound] = g
        torch.cuda.synchronize()

    def key(self, step):
        """(batch, bound) of the graph that runs this pure-decode step."""
        batch = padded_batch_size(step.num_seqs, self.sizes)
        return batch, bound_for(self.bounds[batch], step.max_context_len)

    def run(self, step):
        """Replay the graph for this pure-decode step; its sampled tokens land in the runner's buffers.
        Returns the graph's logits [padded batch, V] (valid until the next replay)."""
        key = self.key(step)
        data = pad_decode_step(step, key[0], self.width, self.runner.pad_block)
        self.copied.synchronize()                 # the previous step's copy has left the pinned buffer
        self.host[:data.shape[0]].numpy()[:] = data
        self.dev[:data.shape[0]].copy_(self.host[:data.shape[0]], non_blocking=True)
        self.copied.record()
        self.graphs[key].replay()
        return self.logits[key]
