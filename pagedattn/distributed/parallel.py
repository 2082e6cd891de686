"""Megatron-style tensor parallelism for Qwen2 over torch.distributed.

With world size P, rank r of a layer holds:

    q_proj / k_proj / v_proj   column-parallel: rows of heads [r*H/P, (r+1)*H/P) (K/V: of Hkv/P heads)
    gate_proj / up_proj        column-parallel: rows [r*I/P, (r+1)*I/P) of the intermediate size I
    o_proj / down_proj         row-parallel: the matching input columns; partial sums -> one all-reduce
    embed_tokens               vocab-parallel: rows [r*V/P, (r+1)*V/P); other ids give 0 -> all-reduce
    lm_head                    vocab-parallel: each rank's [N, V/P] logits -> all-gather -> [N, V]

So one decoder layer costs two all-reduces of [T, hidden] (after attention, after the MLP). Attention
needs no communication: a rank's query heads only read its own KV heads (GQA groups never straddle
ranks because H/P and Hkv/P are both whole), so each rank's KV cache holds only its Hkv/P heads of
every block. Norms, rotary embeddings and the residual stream are replicated on every rank.

Numerics: the all-reduce adds the P partial sums of o_proj / down_proj in a different order than one
matmul over the full width, so float32 hidden states differ from TP=1 by ~1e-6 (relative); greedy
token ids agree on the test model (tests/test_tensor_parallel.py), but near-ties could flip.
"""
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedattn.errors import InvalidRequestError


def check_tensor_parallel_size(config, tp):
    """Raise InvalidRequestError naming the field if Qwen2Config `config` cannot be split over `tp` ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name)
        if value % tp:
            raise InvalidRequestError(f"tensor_parallel_size={tp} must divide config.{name}={value} "
                                      "(each rank holds an equal slice)")


def free_port():
    """A TCP port on localhost that was free a moment ago (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank, world_size, init_method, device, timeout_s):
    """Join the default process group: NCCL when `device` is CUDA, else gloo."""
    from datetime import timedelta

    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": torch.device(device)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)


def _shard(t, dim, rank, world_size):
    """The rank's contiguous 1/world_size slice of `t` along `dim`, as its own tensor."""
    size = t.shape[dim] // world_size
    return t.narrow(dim, rank * size, size).clone()


class ColumnParallelLinear(nn.Linear):
    """y_r = x @ W_r.T + b_r: this rank's slice of the output features, no communication."""


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r.T) + b: x_r is this rank's slice of the input features [T, in/P]."""

    def __init__(self, weight, bias, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)          # (out, in/P)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x):                                                  # (T, in/P) -> (T, out)
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/P) of the embedding; ids outside give zeros, the all-reduce fills them in."""

    def __init__(self, weight, start, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)          # (V/P, hidden)
        self.start, self.group = start, group

    def forward(self, ids):                                                # (T,) int64 -> (T, hidden)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])             # (T,)
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x * inside[:, None].to(x.dtype)                                # exact zeros elsewhere
        dist.all_reduce(x, group=self.group)                               # one rank contributes each row
        return x


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocab slice [N, V/P], all-gathered into [N, V] on every rank."""

    def __init__(self, weight, world_size, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)          # (V/P, hidden)
        self.world_size, self.group = world_size, group

    def forward(self, hidden):                                             # (N, hidden) -> (N, V)
        local = F.linear(hidden, self.weight).contiguous()                 # (N, V/P)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)                                    # rank order = vocab order


def _column(linear, rank, world_size):
    out = ColumnParallelLinear(linear.in_features, linear.out_features // world_size,
                               bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(_shard(linear.weight, 0, rank, world_size), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(_shard(linear.bias, 0, rank, world_size), requires_grad=False)
    return out


def _row(linear, rank, world_size, group):
    bias = None if linear.bias is None else linear.bias.detach().clone()  # added once, after the sum
    return RowParallelLinear(_shard(linear.weight, 1, rank, world_size), bias, group)


@torch.no_grad()
def shard_qwen2(model, rank, world_size, group=None):
    """Turn a loaded (full) Qwen2ForCausalLM into rank `rank`'s shard, in place; returns it.

    The full weights are sliced and dropped, so peak memory is one full model per rank while loading.
    Every rank of `group` (default: the default process group of world_size ranks) must run the
    sharded model's forward and compute_logits together, since they communicate.
    """
    config = model.config
    check_tensor_parallel_size(config, world_size)
    if world_size == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (_column(m, rank, world_size)
                                                 for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.o_proj = _row(attn.o_proj, rank, world_size, group)
        attn.num_heads //= world_size                      # the views in Qwen2Attention.forward follow
        attn.num_kv_heads //= world_size
        mlp.gate_proj, mlp.up_proj = _column(mlp.gate_proj, rank, world_size), _column(mlp.up_proj, rank, world_size)
        mlp.down_proj = _row(mlp.down_proj, rank, world_size, group)
    vocab_per_rank = config.vocab_size // world_size
    embed = model.model.embed_tokens.weight
    lm_head = model.lm_head.weight                         # the same tensor when tie_word_embeddings
    model.model.embed_tokens = VocabParallelEmbedding(_shard(embed, 0, rank, world_size),
                                                      rank * vocab_per_rank, group)
    model.lm_head = ParallelLMHead(_shard(lm_head, 0, rank, world_size), world_size, group)
    model.tensor_parallel = (rank, world_size)
    return model
