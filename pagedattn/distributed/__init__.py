"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU); see docs/tensor_parallel.md.

parallel.py: the process group and the checks; the sharded layers themselves are pagedattn/layers/linear.py,
    loaded rank by rank by pagedattn.models.loader.load_model(..., tp_rank, tp_size).
worker.py: the ranks' devices, thread counts and process groups, torchrun's placement of this process
    (torchrun_launch), rank 0's handle on the others (Workers: start, broadcast a step, heartbeat, stop), the
    pool size the ranks agree on, and TensorParallelError. The worker loop is pagedattn/engine/model_runner.py's
    (distributed imports nothing of the engine).
allreduce_norm.py: a row-parallel layer's all-reduce fused with the residual add and RMSNorm that follow
    (reduce-scatter over tokens, the add-norm on each rank's rows, all-gather), equal to the unfused path.
"""
from pagedattn.distributed.parallel import check_tensor_parallel_size

__all__ = ["check_tensor_parallel_size"]
