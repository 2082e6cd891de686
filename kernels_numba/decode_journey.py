"""The decode journey's versions side by side: {version: launcher} and the entry points that run any one.

v1-v4: the CUDA-core era (decode_journey_cuda_core.py): v1 naive; v2 adds shared-memory KV tiles;
    v3 adds the online softmax, warp reductions and fp16 pair math; v4 adds GQA-grouped CTAs,
    128-bit loads and split-KV.
v5-v9: the tensor-core era (decode_journey_tensor_core.py): v5 adds mma.sync; v6 adds two sub-chunks
    and a wave-sized plan; v7 adds software pipelining; v8 adds the cp.async ring; v9 adds the
    occupancy plan.
v10: the kernel the engine runs (paged_attention.py, which stands alone): v9's kernel for every
    shape with a split-KV merge that is cheap at any batch size.

Every version takes the same arguments in the same order (attention_parts.LaunchArgs, a stream):
    VERSIONS[n](args, stream)
and the entry points below build those arguments as the shipped ones do:
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, version=10,
                    out=None, validate=True, max_context_len=None)       torch tensors
    launch(version, q, k_cache, v_cache, block_tables, context_lens, out, scale=None, ...)
                                                                         raw-bit arrays
Every version is tested (tests/test_paged_attention_cuda.py) and timed (scripts/bench_kernels.py).
"""
from kernels_numba import bridge
from kernels_numba.attention_parts import launch_args, torch_launch_args
from kernels_numba.decode_journey_cuda_core import VERSIONS as CUDA_CORE_VERSIONS
from kernels_numba.decode_journey_tensor_core import VERSIONS as TENSOR_CORE_VERSIONS
from kernels_numba.errors import KernelLaunchError
from kernels_numba.paged_attention import launch_v10

PRODUCTION_VERSION = 10
VERSIONS = {**CUDA_CORE_VERSIONS, **TENSOR_CORE_VERSIONS, PRODUCTION_VERSION: launch_v10}


def launcher(version):
    """VERSIONS[version]; KernelLaunchError for a version the journey does not have."""
    if version not in VERSIONS:
        raise KernelLaunchError(f"version={version!r} is not one of {sorted(VERSIONS)}")
    return VERSIONS[version]


def launch(version, q, k_cache, v_cache, block_tables, context_lens, out, scale=None, is_bf16=False,
           max_context_len=None, stream=0, scratch=None):
    """Version `version` on raw-bit arrays (the arguments of paged_attention.launch, without plan)."""
    run = launcher(version)
    run(launch_args(q, k_cache, v_cache, block_tables, context_lens, out, scale, is_bf16, max_context_len, stream,
                    scratch), stream)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, version=PRODUCTION_VERSION,
                    out=None, validate=True, max_context_len=None):
    """Version `version` (1..10) on torch tensors, on torch's current CUDA stream (the arguments of
    paged_attention.paged_attention, without plan). Returns out."""
    run = launcher(version)
    args, out = torch_launch_args(q, k_cache, v_cache, block_tables, context_lens, scale, out, validate,
                                  max_context_len)
    with bridge.device_guard(q.device):
        run(args, bridge.torch_stream(q.device))
    return out
