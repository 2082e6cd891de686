"""The all-reduce of a row-parallel layer fused with the residual add and RMSNorm that follow it.

Unfused, each decoder layer does twice (after o_proj, after down_proj), on every rank:

    y = all_reduce(partial)                          # [T, hidden]: 2 (P-1)/P T·hidden elements over the wire
    x, residual = add_rms_norm(y, residual, w, eps)  # every rank adds and norms all T rows (the same work P times)

RMSNorm works row by row, so the rows can be split over the ranks instead (Megatron's sequence parallelism,
TensorRT-LLM's reduce-scatter + norm):

    rows = reduce_scatter(partial)                   # [T/P, hidden]: rank r gets its rows of the sum
    x_rows, residual_rows = add_rms_norm(rows, residual_rows, w, eps)     # 1/P of the work
    x = all_gather(x_rows)                           # [T, hidden] for the next column-parallel GEMM

The same bytes cross the wire as one ring all-reduce (a reduce-scatter then an all-gather), the add and the
norm cost 1/P, and the residual stream lives as each rank's T/P rows only (it is read by nothing but the next
add): `residual_rows` goes in and comes out sharded. T is padded with zero rows to a multiple of P (a zero
row norms to zero and is dropped from x). The values equal the unfused path's: the same sums of the same P
partials, the same row-wise norm (tests/test_tensor_parallel.py checks it on gloo, bit for bit in float32).

    rows = token_rows(T, P)                          # rows per rank (T padded up to rows * P)
    residual_rows = shard_rows(residual, rank, P)    # [rows, hidden]: rank's rows of a replicated tensor
    x, residual_rows = all_reduce_add_rms_norm(partial, residual_rows, weight, eps, ops.add_rms_norm)
    residual = gather_rows(residual_rows, T)         # the whole stream again (the final norm, tests)

On gloo (CPU) the collectives are torch.distributed's; on NCCL they are the same calls, so the path runs
unchanged on GPUs, where the model's fused add-norm kernel runs on the rank's rows.

In the model (pagedattn/models/qwen2.py) a FusedAllReduceNorm, made once at build by fused_allreduce_for(),
says which steps take the path: those of at least `min_tokens` rows. The modules it is handed to decide
from the step's row count alone, so every module of a step, and every rank, decides the same way:
o_proj / down_proj (RowParallelLinear) leave their partial sums un-reduced, the norms after them
(RMSNorm with a residual) run all_reduce_add_rms_norm, the first layer keeps its rows of the embedding
(shard_rows) and the final norm's all-gather returns the whole normed hidden state.

The default threshold (auto) comes from a cost model, not yet from a GPU measurement. Both paths move the
same bytes over the wire; the fused one adds a second collective (several microseconds of NCCL latency
and launch) and saves (P-1)/P of the add-norm's memory traffic (it reads x and the residual and writes
both: 4 messages of [T, hidden]), 2 messages at P = 2: ~8 us for a 16 MiB message at ~4 TB/s. So on CUDA
the path pays only for messages of FUSED_MIN_BYTES or more: T >= 16 MiB / (hidden · itemsize), 2341 rows
for Qwen2-7B in fp16 (large prompt steps), 9363 for the 0.5B (beyond the 8192-token budget: never). Decode
steps (at most max_num_seqs = 256 rows by default: < 2 MB) keep the one all-reduce. On gloo (CPU) two
collectives cost more than one at every size measured (docs/tensor_parallel.md), so auto is off there. The
engine's `fused_allreduce` option (auto | on | off | N: steps of >= N rows) chooses otherwise when the model
is built. A CUDA graph's capture (decode steps) always keeps the all-reduce.
"""
import torch
import torch.distributed as dist

FUSED_MIN_BYTES = 16 << 20          # auto on CUDA: steps whose [T, hidden] message is at least this big

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def token_rows(num_tokens, world_size):
    """Rows each rank holds when num_tokens rows are split over world_size ranks (the last ones padded)."""
    return -(-num_tokens // world_size)


def _padded(x, rows, world_size):
    """x [T, hidden] -> [rows * world_size, hidden], zero rows appended (x itself when no padding is needed)."""
    T = x.shape[0]
    if T == rows * world_size:
        return x
    out = x.new_zeros(rows * world_size, x.shape[1])
    out[:T] = x
    return out


def shard_rows(x, rank, world_size):
    """This rank's rows of a replicated [T, hidden] tensor: [token_rows(T, P), hidden] (zero-padded)."""
    rows = token_rows(x.shape[0], world_size)
    return _padded(x, rows, world_size)[rank * rows:(rank + 1) * rows].contiguous()


def gather_rows(x_rows, num_tokens, group=None):
    """Every rank's rows [rows, hidden] -> the whole [num_tokens, hidden] on every rank (one all-gather)."""
    P = dist.get_world_size(group)
    out = x_rows.new_empty(x_rows.shape[0] * P, x_rows.shape[1])
    _all_gather(out, x_rows.contiguous(), group=group)
    return out[:num_tokens]


def all_reduce_add_rms_norm(partial, residual_rows, weight, eps, add_norm, group=None):
    """partial: [T, hidden] this rank's partial sum of a row-parallel layer (before any all-reduce);
    residual_rows: [token_rows(T, P), hidden] this rank's rows of the residual stream (shard_rows);
    weight: [hidden] the norm's weight; eps: float; add_norm(x, residual, weight, eps) -> (normed,
    x + residual): the model's fused op (its ops table's add_rms_norm). Returns (normed [T, hidden] on every
    rank, the new residual rows [token_rows(T, P), hidden]): add_norm(all_reduce(partial), residual, weight,
    eps), the residual restricted to this rank's rows. Same dtype as partial."""
    P = dist.get_world_size(group)
    T = partial.shape[0]
    rows = token_rows(T, P)
    assert residual_rows.shape == (rows, partial.shape[1]), (residual_rows.shape, rows, partial.shape)
    summed = partial.new_empty(rows, partial.shape[1])                        # (rows, hidden)
    _reduce_scatter(summed, _padded(partial, rows, P).contiguous(), group=group)
    normed_rows, residual_rows = add_norm(summed, residual_rows, weight, eps)   # (rows, hidden) each
    return gather_rows(normed_rows, T, group), residual_rows


class FusedAllReduceNorm:
    """Which steps run a row-parallel layer's all-reduce fused with the add + RMSNorm after it: those of at
    least min_tokens rows (>= 1), except inside a CUDA graph's capture (cuda: the model is on a GPU).
    One object is shared by a model's RowParallelLinear and RMSNorm modules (see the module docstring)."""

    def __init__(self, min_tokens, cuda=False):
        assert min_tokens >= 1, min_tokens
        self.min_tokens, self.cuda = min_tokens, cuda

    def takes(self, num_tokens):
        """Whether a step of num_tokens rows runs fused (the same answer on every rank and in every module)."""
        if num_tokens < self.min_tokens:
            return False
        return not (self.cuda and torch.cuda.is_current_stream_capturing())

    def __repr__(self):
        return f"FusedAllReduceNorm(min_tokens={self.min_tokens})"


def default_min_tokens(hidden_size, itemsize, device_type):
    """auto's threshold: rows of a FUSED_MIN_BYTES message on CUDA; 0 (off) elsewhere (gloo)."""
    if device_type != "cuda":
        return 0
    return -(-FUSED_MIN_BYTES // (hidden_size * itemsize))


def min_tokens_of(setting, default):
    """The `fused_allreduce` option as a row threshold: "auto" -> default, "on" -> 1, "off" -> 0, N -> N."""
    if setting == "auto":
        return default
    if setting in ("on", "off"):
        return 1 if setting == "on" else 0
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ValueError(f"fused_allreduce must be 'auto', 'on', 'off' or a row count >= 0, got {setting!r}")
    return setting


def fused_allreduce_for(tp_size, device, dtype, hidden_size, setting="auto"):
    """The FusedAllReduceNorm of a model of tp_size ranks on `device` in `dtype`, or None where no step
    fuses (tp_size 1, a threshold of 0). setting: "auto" (default_min_tokens), "on", "off" or a row count."""
    if tp_size == 1:
        return None
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    min_tokens = min_tokens_of(setting, default_min_tokens(hidden_size, itemsize, device.type))
    return FusedAllReduceNorm(min_tokens, cuda=device.type == "cuda") if min_tokens > 0 else None
