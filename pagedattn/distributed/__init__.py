"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU); see docs/tensor_parallel.md.

parallel.py: the process group and the Megatron-style sharded layers (`shard_qwen2`).
worker.py: the worker processes and the rank-0 model runner that broadcasts each step to them.
"""
from pagedattn.distributed.parallel import check_tensor_parallel_size, shard_qwen2

__all__ = ["check_tensor_parallel_size", "shard_qwen2"]
