"""Linear layers, the embedding and the LM head, split for tensor parallelism (Megatron style).

With P = tp_size ranks, rank r = tp_rank holds (P = 1: the whole layer, no communication):

    ColumnParallelLinear         rows [r out/P, (r+1) out/P) of the weight and bias: its slice of the outputs
    MergedColumnParallelLinear   several column-parallel weights in one GEMM (gate_up_proj = [gate; up]),
                                 each sliced per rank: rank r holds [gate_r; up_r]
    QKVParallelLinear            the same for q, k, v: [q heads of rank r; its k heads; its v heads]
    RowParallelLinear            columns [r in/P, (r+1) in/P): partial sums all-reduced over the default
                                 process group (the bias, if any, added once, by rank 0), or, in a step
                                 that fuses the all-reduce with the norm after it, left un-reduced
    VocabParallelEmbedding       vocab rows [r V/P, (r+1) V/P): other ids give 0 and the all-reduce fills them
    ParallelLMHead               the same rows: [N, V/P] logits all-gathered into [N, V]

So a decoder layer costs two all-reduces of [T, hidden] (after o_proj and after down_proj; in a large step
each may be a reduce-scatter and an all-gather around the add + RMSNorm after it instead:
pagedattn/distributed/allreduce_norm.py); attention needs none, because a rank's query heads read only its
own KV heads (GQA groups never straddle ranks when H/P and Hkv/P are whole).

Loading: `weight_loader(param, loaded, shard_id=None)` copies this rank's part of ONE checkpoint tensor
into `param` (`shard_id` names the part of a merged layer: "q"/"k"/"v", or 0/1 for gate/up). `loaded` is a
torch tensor or a safetensors slice; both are indexed with [a:b] / [:, a:b], so from a safetensors file a
rank reads only its own bytes. Parameters are created uninitialised (torch.empty): the loader fills them.

Every GEMM is the model's ops table's `linear` (pagedattn/layers/ops.py: torch's, or in a small float32
CPU step kernels_numba/cpu_linear.py), passed at construction as `ops`. A model loaded from a GGUF file
(pagedattn/models/loader.py: load_gguf_model) holds its matrices as GGUF blocks instead: each layer's
`weight` is a pagedattn.models.gguf_weights.QuantWeight (a fused layer's parts in output order), the bias
stays a float32 Parameter, and the table's `linear` / `embedding` read the blocks.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def divide(n, parts, what):
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by tp_size={parts}")
    return n // parts


def _param(*shape):
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(dst, src, name=""):
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: slice of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)                                      # casts to the parameter's dtype and device


class LinearBase(nn.Module):
    """y = x W^T + b on this rank's [output_size, input_size] weight (already divided by tp_size)."""

    def __init__(self, input_size, output_size, bias, tp_rank, tp_size, ops):
        super().__init__()
        self.tp_rank, self.tp_size, self.ops = tp_rank, tp_size, ops
        self.weight = _param(output_size, input_size)
        self.bias = _param(output_size) if bias else None

    def forward(self, x):                                                     # (T, in) -> (T, out)
        return self.ops.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """input_size -> output_size / tp_size features of the output (no communication)."""

    def __init__(self, input_size, output_size, bias, tp_rank, tp_size, ops):
        super().__init__(input_size, divide(output_size, tp_size, "output_size"), bias, tp_rank, tp_size, ops)

    def _rank_rows(self, loaded, size):
        return loaded[self.tp_rank * size:(self.tp_rank + 1) * size]

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param.data, self._rank_rows(loaded, param.shape[0]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel weights of `output_sizes` stacked into one GEMM; shard_id i is the i-th weight."""

    def __init__(self, input_size, output_sizes, bias, tp_rank, tp_size, ops):
        self.output_sizes = [divide(n, tp_size, "output size") for n in output_sizes]   # per rank
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size, ops)

    def weight_loader(self, param, loaded, shard_id):
        size, offset = self.output_sizes[shard_id], sum(self.output_sizes[:shard_id])
        _copy(param.data[offset:offset + size], self._rank_rows(loaded, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections in one GEMM; rank r's output is [its H/P q heads | Hkv/P k heads | Hkv/P v heads]."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias, tp_rank, tp_size, ops):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")            # per rank
        self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp_rank, tp_size, ops)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim

    def weight_loader(self, param, loaded, shard_id):
        size, offset = {"q": (self.q_size, 0), "k": (self.kv_size, self.q_size),
                        "v": (self.kv_size, self.q_size + self.kv_size)}[shard_id]
        _copy(param.data[offset:offset + size], self._rank_rows(loaded, size))


class RowParallelLinear(LinearBase):
    """input_size / tp_size features of the input -> all output features, summed over ranks.

    fused: None, or the model's FusedAllReduceNorm (pagedattn/distributed/allreduce_norm.py): in a step it
    takes, the output is this rank's partial sum, un-reduced, for the RMSNorm after this layer to reduce
    (all_reduce_add_rms_norm); give it only to a layer whose every output goes to such a norm."""

    def __init__(self, input_size, output_size, bias, tp_rank, tp_size, ops, fused=None):
        super().__init__(divide(input_size, tp_size, "input_size"), output_size, bias, tp_rank, tp_size, ops)
        self.fused = fused

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:                                                  # the bias: whole on every rank
            return _copy(param.data, loaded[:])
        n = param.shape[1]
        _copy(param.data, loaded[:, self.tp_rank * n:(self.tp_rank + 1) * n])

    def forward(self, x):                                                     # (T, in/P) -> (T, out)
        y = self.ops.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and not (self.fused is not None and self.fused.takes(x.shape[0])):
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank V/P, (tp_rank + 1) V/P) of the [V, hidden] embedding."""

    def __init__(self, num_embeddings, embedding_dim, tp_rank, tp_size, ops):
        super().__init__()
        self.tp_rank, self.tp_size, self.ops = tp_rank, tp_size, ops
        self.rows = divide(num_embeddings, tp_size, "vocab_size")
        self.start = tp_rank * self.rows
        self.weight = _param(self.rows, embedding_dim)

    def weight_loader(self, param, loaded, shard_id=None):
        _copy(param.data, loaded[self.start:self.start + self.rows])

    def forward(self, ids):                                                   # (T,) int -> (T, hidden)
        if self.tp_size == 1:
            return self.ops.embedding(ids, self.weight)                      # F.embedding, or GGUF rows
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)                           # (T,)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        x = x * inside[:, None].to(x.dtype)                                   # exact zeros elsewhere
        dist.all_reduce(x)                                                    # one rank contributes each row
        return x


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of this rank's vocab rows, all-gathered (rank order = vocab order)."""

    def forward(self, hidden):                                                # (N, hidden) -> (N, V)
        logits = self.ops.linear(hidden, self.weight, None)                  # (N, V/P)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)
