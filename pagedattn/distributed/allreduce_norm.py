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
Using it in the model means carrying the residual as rows between layers (Qwen2DecoderLayer.forward, the
first layer's input and the final norm): the model code's change, not made here.
"""
import torch
import torch.distributed as dist

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
