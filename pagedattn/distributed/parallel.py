"""Tensor parallelism for Qwen2 over torch.distributed: the process group and its checks.

The sharded layers live in pagedattn/layers/linear.py and a rank loads its shard directly:
load_model(path, device, dtype, attn_backend, tp_rank=r, tp_size=P). With world size P, rank r holds

    qkv_proj                   column-parallel: its H/P query heads, then its Hkv/P key and value heads
    gate_up_proj               column-parallel: rows [r*I/P, (r+1)*I/P) of gate, then of up
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
