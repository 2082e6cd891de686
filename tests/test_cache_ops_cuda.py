"""Validation layer 2 for the cache ops: the numba kernels equal the torch versions bit for bit.

Without a GPU the kernels run in numba's CUDA simulator on CPU tensors (tests/conftest.py sets
NUMBA_ENABLE_CUDASIM=1); the `gpu` tests run the same checks on realistic shapes on CUDA.
"""
import pytest
import torch

from kernels_numba import cache_ops
from pagedattn import kv_cache
from pagedattn.errors import KernelLaunchError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (num_blocks, num_kv_heads, block_size, head_dim)
SMALL_GEOMETRIES = [(6, 2, 8, 64), (5, 1, 16, 128), (4, 3, 32, 6)]


def _pool(geometry, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(geometry, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(geometry, generator=g).to(dtype).to(DEVICE)
    return k, v


def _same_bits(a, b):
    """Equal as raw bits (so NaN == NaN and -0 != +0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_write(geometry, dtype, key_dtype, num_tokens, seed):
    num_blocks, num_kv_heads, block_size, head_dim = geometry
    g = torch.Generator().manual_seed(seed)
    k_ref, v_ref = _pool(geometry, dtype, seed)
    k_ref[0, 0, 0, 0] = float("nan")  # a poisoned slot that must survive untouched
    k_out, v_out = k_ref.clone(), v_ref.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(key_dtype).to(DEVICE)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(key_dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size - 1, generator=g)[:num_tokens] + 1  # distinct, never slot 0
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding tokens
    slots = slots.to(DEVICE)
    kv_cache.write_kv(k_ref, v_ref, key, value, slots)
    cache_ops.reshape_and_cache(key, value, k_out, v_out, slots)
    assert _same_bits(k_out, k_ref) and _same_bits(v_out, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", SMALL_GEOMETRIES)
def test_reshape_and_cache_matches_write_kv(geometry, dtype):
    _check_write(geometry, dtype, dtype, num_tokens=11, seed=1)


def test_reshape_and_cache_casts_like_write_kv():
    # fp32 K/V into an fp16 pool: the same rounding as write_kv's .to(fp16)
    _check_write((4, 2, 8, 64), torch.float16, torch.float32, num_tokens=9, seed=2)


def test_reshape_and_cache_all_padding_writes_nothing():
    k, v = _pool((2, 1, 8, 64), torch.float16, 3)
    k0, v0 = k.clone(), v.clone()
    key = torch.randn(3, 1, 64).half().to(DEVICE)
    cache_ops.reshape_and_cache(key, key, k, v, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert _same_bits(k, k0) and _same_bits(v, v0)


def _check_copy(geometry, dtype, num_layers, mapping, seed):
    ks, vs = zip(*(_pool(geometry, dtype, seed + layer) for layer in range(num_layers)))
    k_ref, v_ref = [k.clone() for k in ks], [v.clone() for v in vs]
    k_out, v_out = [k.clone() for k in ks], [v.clone() for v in vs]
    kv_cache.copy_blocks(k_ref, v_ref, mapping)
    cache_ops.copy_blocks(k_out, v_out, mapping)
    for layer in range(num_layers):
        assert _same_bits(k_out[layer], k_ref[layer]), f"k_caches[{layer}] differs"
        assert _same_bits(v_out[layer], v_ref[layer]), f"v_caches[{layer}] differs"


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_torch_multi_layer(dtype):
    _check_copy((6, 2, 8, 64), dtype, num_layers=3, mapping=[[0, 3], [2, 5], [0, 4]], seed=4)


def test_copy_blocks_tensor_mapping_and_odd_geometry():
    mapping = torch.tensor([[3, 1]], dtype=torch.int32, device=DEVICE)
    _check_copy((4, 3, 32, 6), torch.bfloat16, num_layers=2, mapping=mapping, seed=5)


def test_copy_blocks_empty_mapping_is_a_no_op():
    k, v = _pool((2, 1, 8, 64), torch.float16, 6)
    k0 = k.clone()
    cache_ops.copy_blocks([k], [v], [])
    assert _same_bits(k, k0)


def test_reshape_and_cache_rejects_bad_arguments():
    k, v = _pool((2, 1, 8, 64), torch.float16, 7)
    key = torch.zeros(2, 1, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(KernelLaunchError, match="slot_mapping"):
        cache_ops.reshape_and_cache(key, key, k, v, torch.tensor([0, 16], device=DEVICE))
    with pytest.raises(KernelLaunchError, match="key"):
        cache_ops.reshape_and_cache(key[:, :, :32], key, k, v, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(KernelLaunchError, match="slot_mapping"):
        cache_ops.reshape_and_cache(key, key, k, v, torch.tensor([0], device=DEVICE))
    with pytest.raises(KernelLaunchError, match="v_cache"):
        cache_ops.reshape_and_cache(key, key, k, v.float(), torch.tensor([0, 1], device=DEVICE))


def test_copy_blocks_rejects_bad_arguments():
    k, v = _pool((4, 1, 8, 64), torch.float16, 8)
    with pytest.raises(KernelLaunchError, match="block_mapping"):
        cache_ops.copy_blocks([k], [v], [[0, 4]])
    with pytest.raises(KernelLaunchError, match="destination"):
        cache_ops.copy_blocks([k], [v], [[0, 1], [2, 1]])
    with pytest.raises(KernelLaunchError, match="destination"):
        cache_ops.copy_blocks([k], [v], [[0, 1], [1, 2]])
    with pytest.raises(KernelLaunchError, match="v_caches"):
        cache_ops.copy_blocks([k], [v[:2].contiguous()], [[0, 1]])


def test_validate_checks_slots_and_block_ids():
    k, v = _pool((2, 1, 8, 64), torch.float16, 9)
    key = torch.zeros(2, 1, 64, dtype=torch.float16, device=DEVICE)
    outside = torch.tensor([0, 16], device=DEVICE)
    with pytest.raises(KernelLaunchError, match="slot_mapping"):
        cache_ops.reshape_and_cache(key, key, k, v, outside, validate=True)
    with pytest.raises(KernelLaunchError, match="block_mapping"):
        cache_ops.copy_blocks([k], [v], [[0, 2]], validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cache_ops_realistic(dtype):
    # a Qwen2-0.5B step: 24 layers, 2 KV heads, d=64, block 16; 3000 new tokens, CoW of 40 blocks
    geometry = (1024, 2, 16, 64)
    _check_write(geometry, dtype, dtype, num_tokens=3000, seed=10)
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(1024, generator=g)
    mapping = torch.stack([perm[:40], perm[40:80]], dim=1)
    _check_copy(geometry, dtype, num_layers=24, mapping=mapping, seed=12)


@pytest.mark.gpu
def test_gpu_cache_ops_in_cuda_graph():
    geometry = (64, 2, 16, 64)
    k, v = _pool(geometry, torch.float16, 13)
    k_ref, v_ref = k.clone(), v.clone()
    key = torch.randn(20, 2, 64, device=DEVICE).half()
    slots = torch.randperm(64 * 16, device=DEVICE)[:20]
    mapping = torch.tensor([[1, 2], [5, 9]], device=DEVICE)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        cache_ops.reshape_and_cache(key, key, k.clone(), v.clone(), slots)
        cache_ops.copy_blocks([k.clone()], [v.clone()], mapping)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache_ops.reshape_and_cache(key, key, k, v, slots)
        cache_ops.copy_blocks([k], [v], mapping)
    graph.replay()
    torch.cuda.synchronize()
    kv_cache.write_kv(k_ref, v_ref, key, key, slots)
    kv_cache.copy_blocks([k_ref], [v_ref], mapping)
    assert _same_bits(k, k_ref) and _same_bits(v, v_ref)
