"""One scheduled step as flat int32 arrays: what every rank's ModelRunner needs, and nothing else.

For a step whose sequences s (prefill chunks first, then decodes) compute tokens [start_s, end_s):

    input_ids     [T] int32   token_ids[start_s:end_s], concatenated (0 where the id is still in flight)
    input_src     [T] int32   -1, or the row of the previous step's sampled tokens that holds this id
    positions     [T] int32   start_s .. end_s - 1, concatenated
    slot_mapping  [T] int32   slots_for(block_tables, rows, positions) (pagedattn.kv_cache)
    context_lens  [S] int32   end_s (tokens in the cache after this step's write)
    block_tables  [S, W] int32, padded with 0
    cu_seqlens_q  [P + 1] int32, the prefill chunks' boundaries
  sampling rows (one per completion that samples a token this step; n rows at the end of an n > 1 prompt):
    sample_rows   [N] int32   the row of the step's hidden states whose logits they sample
    seed          [N] int64   the request's 64-bit random key (two int32 words, low word first)
    temperature   [N] float32 (bit pattern in the int32 array)   top_k [N] int32 (0 = off)
    top_p         [N] float32                                      comp_index [N] int32, position [N] int32
  beam rows (beam search: the runner returns the top beam_k log-probabilities of these rows):
    beam_rows     [Nb] int32
  block_copies    [C, 2] int32 (src, dst) copy-on-write copies, done in every layer before the step

`StepInputs` holds them in one array behind a small header, so a step travels to the device in one
copy and to tensor-parallel workers in one broadcast; `fields()` gives every rank the same views.
"""
import itertools
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from pagedattn.kv_cache import slots_for

HEADER = ("num_tokens", "num_seqs", "width", "num_prefills", "num_prefill_tokens", "num_samples",
          "num_beams", "beam_k", "num_copies", "max_context_len")
HEADER_LEN = len(HEADER)


def layout(h):
    """{field: (offset, length)} in int32 words for header values h (a dict); seed starts 8-byte aligned."""
    T, S, W, P = h["num_tokens"], h["num_seqs"], h["width"], h["num_prefills"]
    N, Nb, C = h["num_samples"], h["num_beams"], h["num_copies"]
    sizes = [("input_ids", T), ("input_src", T), ("positions", T), ("slot_mapping", T), ("context_lens", S),
             ("block_tables", S * W), ("cu_seqlens_q", P + 1), ("sample_rows", N), ("temperature", N),
             ("top_k", N), ("top_p", N), ("comp_index", N), ("position", N), ("beam_rows", Nb),
             ("block_copies", 2 * C)]
    out, o = {}, 0
    for name, n in sizes:
        out[name] = (o, n)
        o += n
    o += o % 2                                      # the int64 seeds need an even word offset
    out["seed"] = (o, 2 * N)
    out["_size"] = (0, o + 2 * N)
    return out


@dataclass
class SampleRow:
    """A completion sampling one token this step."""
    seq: object                 # the Sequence whose logits row is sampled
    index: int                  # its completion index (a new child's index when fork is True)
    fork: bool = False          # n > 1: a new completion forked from seq with this token


class StepInputs:
    """The packed step: `header` (dict of ints, also attributes: step.num_tokens, ...) and `data` (int32
    numpy array, layout(header))."""

    def __init__(self, header, data):
        self.header, self.data = header, data
        self.__dict__.update(header)
        self.layout = layout(header)

    @classmethod
    def from_header_array(cls, header_arr, data):
        return cls(dict(zip(HEADER, (int(x) for x in header_arr))), data)

    def header_array(self):
        return np.array([self.header[k] for k in HEADER], dtype=np.int64)

    @property
    def pure_decode(self):
        """Every sequence computes one token and samples it (the CUDA-graph shape)."""
        return (self.num_prefills == 0 and self.num_tokens == self.num_seqs == self.num_samples
                and self.num_beams == 0)

    def fields(self, arr=None):
        """{name: view} of `arr` (default: data; a torch tensor works too): int32 views, and float32 /
        int64 views for temperature, top_p and seed."""
        arr = self.data if arr is None else arr
        f32, i64 = (np.float32, np.int64) if isinstance(arr, np.ndarray) else (torch.float32, torch.int64)
        out = {}
        for name, (o, n) in self.layout.items():
            if name.startswith("_"):
                continue
            v = arr[o:o + n]
            if name in ("temperature", "top_p"):
                v = v.view(f32)
            elif name == "seed":
                v = v.view(i64)
            out[name] = v
        out["block_tables"] = out["block_tables"].reshape(self.num_seqs, self.width)
        out["block_copies"] = out["block_copies"].reshape(self.num_copies, 2)
        return out


def _padded_tables(tables):
    """[S] block tables (array('i'), the BlockManager's own) -> (S, W) int32, each row padded with 0 to the
    longest. One bytes join of the tables' buffers and the padding: the tables are read where they are, not
    element by element (at 256 sequences of ~64 blocks that is ~20 us instead of ~0.7 ms)."""
    W = max(map(len, tables))
    zeros = bytes(4 * W)
    parts = []
    for t in tables:
        parts.append(t if type(t) is array else array("i", t))
        if len(t) < W:
            parts.append(zeros[:4 * (W - len(t))])
    return np.frombuffer(b"".join(parts), dtype=np.int32).reshape(len(tables), W)


def build_step_inputs(sched_out, block_manager, sample_rows, beam_rows, beam_k):
    """Pack a SchedulerOutput into StepInputs.

    sample_rows: [SampleRow] in the order their tokens come back; beam_rows: [Sequence] (beam search);
    beam_k: candidates per beam row. The sampling row of a sequence is its last token of the step.
    """
    bs = block_manager.block_size
    tables, q_lens, starts, pieces, inflight = [], [], [], [], []
    last_row = {}
    offset = 0
    for seq, n in sched_out.scheduled:
        start = seq.num_computed_tokens
        known = seq.token_ids[start:start + n]                      # (the in-flight token is not there)
        pieces.append(known)
        if len(known) < n:                                          # decode of an in-flight token
            pieces.append((0,))
            inflight.append((offset + n - 1, seq.inflight_row))
        starts.append(start)
        q_lens.append(n)
        tables.append(block_manager.sequence_blocks[seq.seq_id])                 # read only
        offset += n
        last_row[seq.seq_id] = offset - 1
    S, T, P = len(q_lens), offset, sched_out.num_prefills
    table_np = _padded_tables(tables)                                          # (S, W)
    W = table_np.shape[1]
    q_np = np.asarray(q_lens, dtype=np.int64)                                  # (S,)
    starts_np = np.asarray(starts, dtype=np.int64)                             # (S,)
    cu = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(q_np, out=cu[1:])                                                # (S+1,)
    seq_of_token = np.repeat(np.arange(S), q_np)                               # (T,)
    positions = np.arange(T) - cu[seq_of_token] + starts_np[seq_of_token]      # (T,)
    ctx = starts_np + q_np
    header = dict(num_tokens=T, num_seqs=S, width=W, num_prefills=P, num_prefill_tokens=int(cu[P]),
                  num_samples=len(sample_rows), num_beams=len(beam_rows), beam_k=beam_k,
                  num_copies=len(sched_out.block_copies), max_context_len=int(ctx.max()))
    step = StepInputs(header, None)
    step.data = np.zeros(step.layout["_size"][1], dtype=np.int32)
    f = step.fields()
    f["input_ids"][:] = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32, count=T)
    f["input_src"][:] = -1
    if inflight:
        rows, src = zip(*inflight)
        f["input_src"][list(rows)] = src
    f["positions"][:] = positions
    f["slot_mapping"][:] = slots_for(table_np, seq_of_token, positions, bs)
    f["context_lens"][:] = ctx
    f["block_tables"][:] = table_np
    f["cu_seqlens_q"][:] = cu[:P + 1]
    if sample_rows:                                  # one list per field, filled in one pass, one assignment each
        rows, temperature, top_k, top_p, index, position, seed = [], [], [], [], [], [], []
        for r in sample_rows:
            seq, p = r.seq, r.seq.params
            rows.append(last_row[seq.seq_id])
            temperature.append(p.temperature)
            top_k.append(p.top_k if p.top_k > 0 else 0)
            top_p.append(p.top_p)
            index.append(r.index)
            position.append(0 if r.fork else seq.num_output_tokens)
            seed.append(seq.key & 0xFFFFFFFFFFFFFFFF)
        f["sample_rows"][:], f["temperature"][:], f["top_k"][:], f["top_p"][:] = rows, temperature, top_k, top_p
        f["comp_index"][:], f["position"][:], f["seed"].view(np.uint64)[:] = index, position, seed
    if beam_rows:
        f["beam_rows"][:] = [last_row[s.seq_id] for s in beam_rows]
    if sched_out.block_copies:
        f["block_copies"][:] = np.asarray(sched_out.block_copies, dtype=np.int32)
    return step
