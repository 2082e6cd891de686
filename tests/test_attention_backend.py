"""TorchPagedBackend against the float64 numpy references (reference/attention.py).

Tolerance: the backend computes in float32 (eps 1.2e-7). With unit-normal q/k/v, scores are sums of
head_dim <= 128 products (|score| ~ 1) and the output is a convex mix of |v| <= ~5 values, so the
float32 rounding error is a few hundred eps at most: atol = rtol = 1e-5 leaves ~10x headroom while a
wrong mask, a wrong block or a wrong KV head changes outputs by O(0.1).
"""
import numpy as np
import pytest
import torch

from pagedattn.layers.attention import AttentionMetadata, NumbaBackend, TorchPagedBackend, get_backend
from pagedattn.errors import KernelLaunchError
from reference.attention import paged_decode_attention, paged_prefill_attention

ATOL = RTOL = 1e-5

# (num_heads, num_kv_heads, head_dim): Qwen2.5-0.5B's GQA 14/2, and plain MHA.
HEAD_CONFIGS = [(14, 2, 64), (4, 4, 32)]
BLOCK_SIZES = [16, 8]
# Each batch: (query_lens, context_lens, num_prefills). Prefills first (some after a cached prefix),
# then decodes. Lengths deliberately not multiples of the block size.
BATCHES = [
    ([17, 5, 1, 1, 1], [17, 40, 33, 1, 97], 2),      # mixed: whole prompt, chunk after prefix, decodes
    ([1, 15, 3], [1, 15, 50], 3),                   # prefill only, incl. a one-token prompt
    ([1, 1, 1, 1], [2, 16, 17, 65], 0),             # decode only
    ([97], [120], 1),                               # one long chunk after a 23-token prefix
]


def make_step(query_lens, context_lens, num_prefills, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A pool poisoned with NaN, each sequence's cached prefix written at shuffled blocks, and the step's q/k/v."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [(c + block_size - 1) // block_size for c in context_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in blocks_needed:
        tables.append(perm[i:i + n])
        i += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for table, q_len, ctx in zip(tables, query_lens, context_lens):
        for p in range(ctx - q_len):  # the cached prefix, before this step
            b, o = table[p // block_size], p % block_size
            k_cache[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g)
            v_cache[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, num_prefills)
    T = meta.num_tokens
    q = torch.randn(T, num_heads, head_dim, generator=g)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    return q, k, v, k_cache, v_cache, meta


def reference_step(q, k_cache, v_cache, meta):
    """float64 reference output of a whole step (after the write)."""
    P, Np = meta.num_prefills, meta.num_prefill_tokens
    parts = []
    if P:
        parts.append(paged_prefill_attention(q[:Np], k_cache, v_cache, meta.block_tables[:P],
                                             meta.cu_seqlens_q, meta.context_lens[:P]))
    if meta.num_decode_tokens:
        parts.append(paged_decode_attention(q[Np:], k_cache, v_cache, meta.block_tables[P:], meta.context_lens[P:]))
    return np.concatenate(parts)


def assert_close(out, ref):
    err = np.abs(out.double().numpy() - ref)
    ok = np.all(err <= ATOL + RTOL * np.abs(ref))
    assert ok, f"max err {err.max():.3e}, mean err {err.mean():.3e}"


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_torch_backend_matches_reference(heads, block_size, batch):
    query_lens, context_lens, num_prefills = batch
    q, k, v, k_cache, v_cache, meta = make_step(query_lens, context_lens, num_prefills, *heads, block_size)
    out = TorchPagedBackend()(q, k, v, k_cache, v_cache, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    # The write happened: every new token's K/V is at its slot.
    blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
    assert torch.equal(k_cache[blocks, :, offsets], k) and torch.equal(v_cache[blocks, :, offsets], v)
    assert_close(out, reference_step(q, k_cache, v_cache, meta))


def test_padding_slot_is_not_written():
    q, k, v, k_cache, v_cache, meta = make_step([3], [3], 1, 4, 2, 16, 16)
    meta.slot_mapping[1] = -1  # the engine's padding marker
    before = k_cache.clone()
    TorchPagedBackend()(q, k, v, k_cache, v_cache, meta)
    b = int(meta.block_tables[0, 0])
    assert torch.isnan(k_cache[b, :, 1]).all() and torch.isnan(before[b, :, 1]).all()
    assert torch.equal(k_cache[b, :, 0], k[0])


def test_fp16_inputs_give_fp16_output_close_to_reference():
    q, k, v, k_cache, v_cache, meta = make_step(*BATCHES[0], 14, 2, 64, 16)
    q, k, v = q.half(), k.half(), v.half()
    k_cache, v_cache = k_cache.half(), v_cache.half()
    out = TorchPagedBackend()(q, k, v, k_cache, v_cache, meta)
    assert out.dtype == torch.float16
    ref = reference_step(q, k_cache, v_cache, meta)
    # fp32 math on fp16 inputs: only the final rounding to fp16 (rel 2^-11) remains.
    assert np.abs(out.double().numpy() - ref).max() <= 4e-3


def test_metadata_build_and_properties():
    # Position 4 of sequence 0 needs a second block of 4: a one-block table is inconsistent.
    with pytest.raises(ValueError):
        AttentionMetadata.build([3], [5], [[4]], 4, num_prefills=1)
    meta = AttentionMetadata.build([3, 1], [5, 9], [[4, 6], [2, 7, 1]], 4, num_prefills=1)
    assert meta.num_prefill_tokens == 3 and meta.num_decode_tokens == 1 and meta.num_tokens == 4
    # new tokens: positions 2, 3, 4 of sequence 0 and position 8 of sequence 1
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0, 1 * 4 + 0]
    assert meta.block_tables.tolist() == [[4, 6, 0], [2, 7, 1]]
    assert meta.cu_seqlens_q.tolist() == [0, 3]
    assert meta.context_lens.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert not meta.decode_only and not meta.prefill_only
    with pytest.raises(KernelLaunchError, match="slot_mapping"):
        AttentionMetadata(1, 3, 1, meta.slot_mapping[:3], meta.context_lens, meta.block_tables, meta.cu_seqlens_q)


def test_mismatched_inputs_raise():
    q, k, v, k_cache, v_cache, meta = make_step([3], [3], 1, 4, 2, 16, 16)
    with pytest.raises(KernelLaunchError, match="tokens"):
        TorchPagedBackend()(q[:2], k[:2], v[:2], k_cache, v_cache, meta)
    with pytest.raises(KernelLaunchError, match="k/v"):
        TorchPagedBackend()(q, k[:, :1], v[:, :1], k_cache, v_cache, meta)


def test_write_then_attend_equals_call():
    """The model writes K/V (or has the rotary kernel write them) and then only attends: the same output
    as the one-call path, also with the decode bound given on the host (no device read of the lengths)."""
    q, k, v, k_cache, v_cache, meta = make_step(*BATCHES[0], 14, 2, 64, 16)
    backend = TorchPagedBackend()
    want = backend(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    backend.write(k, v, k_cache, v_cache, meta.slot_mapping)
    assert meta.max_context_len == max(BATCHES[0][1])
    out = torch.full_like(q, float("nan"))
    assert backend.attend(q, k_cache, v_cache, meta, out=out) is out
    assert torch.equal(out, want)
    meta.max_context_len = None                                   # read from the device instead
    assert torch.equal(backend.attend(q, k_cache, v_cache, meta), want)


def test_copy_blocks_copies_every_layer():
    pools = [torch.randn(4, 2, 8, 16) for _ in range(4)]
    before = [p.clone() for p in pools]
    TorchPagedBackend().copy_blocks(pools[:2], pools[2:], [[1, 3], [0, 2]])
    for p, b in zip(pools, before):
        assert torch.equal(p[3], b[1]) and torch.equal(p[2], b[0]) and torch.equal(p[:2], b[:2])


def test_can_capture_and_fused():
    """Only the numba kernels at fp16/bf16 with a supported head_dim and block_size can be captured in
    a CUDA graph; the torch backend sizes its gather on the host, so it never can."""
    numba = NumbaBackend()
    assert numba.validate and numba.can_capture(torch.float16, 64, 16) and numba.can_capture("bfloat16", 128, 8)
    for args in ((torch.float32, 64, 16), (torch.float16, 96, 16), (torch.float16, 64, 64)):
        assert not numba.can_capture(*args)
    assert not TorchPagedBackend().can_capture(torch.float16, 64, 16)
    assert numba.glue_kernels_for(NUMBA_DEVICE, torch.bfloat16) and numba.glue_kernels_for(NUMBA_DEVICE, "float16")
    assert not numba.glue_kernels_for(NUMBA_DEVICE, torch.float32)


def test_get_backend(monkeypatch):
    assert isinstance(get_backend("auto", "cpu"), TorchPagedBackend)
    assert get_backend("torch", "cpu").name == "torch"
    assert isinstance(get_backend("auto", "cuda"), NumbaBackend)
    backend = TorchPagedBackend()
    assert get_backend(backend) is backend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash", "cpu")
    # the numba CPU backend (pagedattn.layers.cpu) is "auto" on CPU when it imports
    import pagedattn.layers.attention as attention

    class CpuBackend(TorchPagedBackend):
        name = "cpu"

    monkeypatch.setattr(attention, "_cpu_backend_class", lambda: None)
    assert type(get_backend("auto", "cpu")) is TorchPagedBackend
    with pytest.raises(ValueError, match="'cpu' needs pagedattn.layers.cpu"):
        get_backend("cpu", "cpu")
    monkeypatch.setattr(attention, "_cpu_backend_class", lambda: CpuBackend)
    assert type(get_backend("auto", "cpu")) is CpuBackend and type(get_backend("cpu", "cpu")) is CpuBackend


def test_numba_backend_falls_back_to_torch_for_missing_kernels(monkeypatch):
    monkeypatch.setattr(NumbaBackend, "_load", staticmethod(lambda name: None))
    with pytest.warns(UserWarning, match="not available"):
        backend = NumbaBackend()
    assert backend.fallbacks == ["cache_ops", "paged_attention", "paged_prefill"]
    q, k, v, k_cache, v_cache, meta = make_step(*BATCHES[0], 14, 2, 64, 16)
    assert_close(backend(q, k, v, k_cache, v_cache, meta), reference_step(q, k_cache, v_cache, meta))


NUMBA_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: numba's CUDA simulator (conftest)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_numba_backend_matches_reference(dtype, validate):
    """The kernels_numba pieces wired through NumbaBackend (float32 attention takes the torch path), with
    the kernels' host checks on and off (the engine's setting). Kept tiny: without a GPU every kernel
    thread runs in the simulator."""
    q, k, v, k_cache, v_cache, meta = make_step([3, 1], [5, 18], 1, 2, 1, 64, 16)
    q, k, v, k_cache, v_cache = (t.to(NUMBA_DEVICE, dtype) for t in (q, k, v, k_cache, v_cache))
    meta = AttentionMetadata.build([3, 1], [5, 18], meta.block_tables.tolist(), 16, 1, device=NUMBA_DEVICE)
    backend = NumbaBackend(validate=validate)
    out = backend(q, k, v, k_cache, v_cache, meta)
    assert out.dtype == dtype
    ref = reference_step(q.cpu(), k_cache.cpu(), v_cache.cpu(), meta)
    err = np.abs(out.double().cpu().numpy() - ref).max()
    # fp16: fp32 accumulation then one rounding of |out| <~ 2 to fp16 (2^-10 relative): 2e-3.
    assert err <= (2e-3 if dtype == torch.float16 else ATOL), f"max err {err:.3e}"
