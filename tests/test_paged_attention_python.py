"""Validation layer 1: paged attention (walking the block table) == naive attention.

Both references compute in float64, so they must agree to rounding (1e-12). The pool is
filled with NaN everywhere a sequence does not own a slot, and block tables are random
permutations, so reading one slot past a sequence's end, or through the wrong block,
turns the output into NaN or garbage and fails the test.
"""
import numpy as np
import pytest
import torch

from pagedattn.kv_cache import KVCache, copy_blocks, gather_kv, write_kv
from reference import (
    gather_paged_kv,
    naive_decode_attention,
    naive_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
)

# (num_heads, num_kv_heads, head_dim): Qwen2-0.5B's 14/2 GQA, MHA, and MQA
HEADS = [(14, 2, 64), (4, 4, 32), (8, 1, 16)]
BLOCK_SIZES = [16, 8, 32]
CONTEXT_LENS = [1, 15, 16, 17, 97, 1025]
TOL = 1e-12  # float64 vs float64: only summation order differs


def make_paged_batch(rng, context_lens, num_kv_heads, head_dim, block_size, spare_blocks=3):
    """Random K/V histories scattered over a NaN-poisoned pool through shuffled block tables.

    Returns (k_cache, v_cache [num_blocks, kvh, bs, d] float64, block_tables [B, max_blocks],
    dense list of (k, v) per sequence, each [ctx, kvh, d]).
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = np.full((num_blocks, num_kv_heads, block_size, head_dim), np.nan)
    v_cache = np.full_like(k_cache, np.nan)
    perm = rng.permutation(num_blocks)  # physical ids handed out in random order
    block_tables = np.zeros((len(context_lens), max(blocks_per_seq)), dtype=np.int64)
    dense, used = [], 0
    for s, n in enumerate(context_lens):
        table = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, : len(table)] = table
        k = rng.standard_normal((n, num_kv_heads, head_dim))
        v = rng.standard_normal((n, num_kv_heads, head_dim))
        for j in range(n):
            k_cache[table[j // block_size], :, j % block_size] = k[j]
            v_cache[table[j // block_size], :, j % block_size] = v[j]
        dense.append((k, v))
    return k_cache, v_cache, block_tables, dense


def assert_close(out, ref, tol=TOL):
    err = np.abs(out - ref)
    assert np.isfinite(out).all(), "output has NaN/inf: a poisoned slot was read"
    assert err.max() <= tol, f"max err {err.max():.3e}, mean err {err.mean():.3e}"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_decode_equals_naive(num_heads, num_kv_heads, head_dim, block_size):
    rng = np.random.default_rng(0)
    k_cache, v_cache, tables, dense = make_paged_batch(rng, CONTEXT_LENS, num_kv_heads, head_dim, block_size)
    q = rng.standard_normal((len(CONTEXT_LENS), num_heads, head_dim))
    out = paged_decode_attention(q, k_cache, v_cache, tables, CONTEXT_LENS)
    ref = np.stack([naive_decode_attention(q[s], k, v) for s, (k, v) in enumerate(dense)])
    assert_close(out, ref)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_paged_prefill_equals_naive(num_heads, num_kv_heads, head_dim):
    """Chunks of new tokens after a cached prefix: (cached, new) pairs incl. no prefix."""
    rng = np.random.default_rng(1)
    cached_new = [(0, 1), (0, 17), (15, 2), (16, 16), (40, 57)]
    context_lens = [c + n for c, n in cached_new]
    k_cache, v_cache, tables, dense = make_paged_batch(rng, context_lens, num_kv_heads, head_dim, 16)
    cu = np.cumsum([0] + [n for _, n in cached_new])
    q = rng.standard_normal((cu[-1], num_heads, head_dim))
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, context_lens)
    ref = np.concatenate([naive_prefill_attention(q[cu[s] : cu[s + 1]], k, v) for s, (k, v) in enumerate(dense)])
    assert_close(out, ref)


def test_naive_matches_softmax_formula():
    """The naive reference itself against torch's SDPA in float64 (an independent implementation)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((6, 3, 8))  # (q_len, H, D)
    k = rng.standard_normal((10, 3, 8))  # (kv_len, H, D)
    v = rng.standard_normal((10, 3, 8))
    ours = naive_prefill_attention(q, k, v)
    # SDPA's causal mask is aligned to the top-left; ours puts the queries at the end.
    mask = torch.ones(6, 10, dtype=torch.bool).tril(diagonal=10 - 6)
    t = lambda x: torch.from_numpy(x).transpose(0, 1)  # (H, L, D)
    ref = torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask).transpose(0, 1)
    assert_close(ours, ref.numpy(), tol=1e-12)


def test_gqa_head_mapping():
    """Query head h must read KV head h // group: give each KV head a distinct constant V."""
    q = np.zeros((14, 4))
    k = np.zeros((5, 2, 4))
    v = np.zeros((5, 2, 4))
    v[:, 1] = 1.0  # KV head 1 -> output 1, KV head 0 -> output 0
    out = naive_decode_attention(q, k, v)
    assert (out[:7] == 0).all() and (out[7:] == 1).all()


def test_torch_pool_roundtrip_matches_reference_gather():
    """write_kv scatters through slots, gather_kv / gather_paged_kv read the same tokens back."""
    rng = np.random.default_rng(3)
    bs, n = 8, 21
    cache = KVCache(num_layers=1, num_blocks=6, num_kv_heads=2, block_size=bs, head_dim=4, dtype=torch.float32)
    cache.k_caches[0].fill_(float("nan"))             # the CPU pool is not zeroed: mark every slot unwritten
    table = [4, 0, 5]
    slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)] + [-1])  # last token: padding
    k = torch.from_numpy(rng.standard_normal((n + 1, 2, 4))).float()
    v = torch.from_numpy(rng.standard_normal((n + 1, 2, 4))).float()
    cache.write(0, k, v, slots)
    k_t, v_t = cache.gather(0, table, n)
    assert torch.equal(k_t, k[:n]) and torch.equal(v_t, v[:n])
    k_np, v_np = gather_paged_kv(cache.k_caches[0], cache.v_caches[0], table, n)
    assert np.array_equal(k_np, k[:n].double().numpy()) and np.array_equal(v_np, v[:n].double().numpy())
    # padding wrote nowhere: blocks outside the table are still unwritten
    assert cache.k_caches[0][[1, 2, 3]].isnan().all()


def test_copy_blocks_all_layers():
    caches = KVCache(num_layers=3, num_blocks=4, num_kv_heads=1, block_size=2, head_dim=2, dtype=torch.float32)
    for layer in range(3):
        caches.k_caches[layer].copy_(torch.randn(4, 1, 2, 2))
        caches.v_caches[layer].copy_(torch.randn(4, 1, 2, 2))
    before = [c.clone() for c in caches.k_caches + caches.v_caches]
    copy_blocks(caches.k_caches, caches.v_caches, [[0, 3], [1, 2]])
    for b, after in zip(before, caches.k_caches + caches.v_caches):
        assert torch.equal(after[3], b[0]) and torch.equal(after[2], b[1])
        assert torch.equal(after[:2], b[:2])  # sources untouched


def test_kv_cache_size_and_validation():
    cache = KVCache(num_layers=24, num_blocks=10, num_kv_heads=2, block_size=16, head_dim=64, dtype=torch.float16)
    assert cache.bytes_per_block == 2 * 24 * 2 * 16 * 64 * 2  # K and V, 24 layers, fp16
    assert cache.nbytes == 10 * cache.bytes_per_block
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(num_layers=1, num_blocks=0, num_kv_heads=1, block_size=16, head_dim=8)
    with pytest.raises(ValueError, match="dtype"):
        KVCache(num_layers=1, num_blocks=1, num_kv_heads=1, block_size=16, head_dim=8, dtype=torch.int8)


def test_kv_cache_layers_are_views_of_one_allocation():
    """K (and V) of every layer lie in one allocation at equal spacing, as the one-launch step kernels read them
    (layer i at an offset from layer 0); a write to one layer stays in that layer."""
    from kernels_numba.step import StepKernels

    cache = KVCache(num_layers=3, num_blocks=4, num_kv_heads=2, block_size=8, head_dim=16, dtype=torch.float16)
    for pools in (cache.k_caches, cache.v_caches):
        nbytes = pools[0].numel() * pools[0].element_size()
        assert [p.data_ptr() - pools[0].data_ptr() for p in pools] == [0, nbytes, 2 * nbytes]
        assert all(p.is_contiguous() and p.shape == (4, 2, 8, 16) for p in pools)
    assert cache.k_caches[0].data_ptr() + 3 * nbytes <= cache.v_caches[0].data_ptr() or \
        cache.v_caches[0].data_ptr() + 3 * nbytes <= cache.k_caches[0].data_ptr()
    cache.k_caches[1].fill_(1.0)
    cache.k_caches[0].zero_(), cache.k_caches[2].zero_()
    cache.k_caches[1][2].fill_(7.0)
    assert cache.k_caches[0].abs().sum() == 0 and cache.k_caches[2].abs().sum() == 0
    assert int((cache.k_caches[1] == 7).sum()) == 2 * 8 * 16
    words, per_layer = StepKernels._stacked_pool_words(None, cache.k_caches)      # v4's check accepts them
    assert per_layer == 4 * 2 * 8 * 16 // 2


def test_gather_kv_torch_equals_reference_on_shuffled_pool():
    rng = np.random.default_rng(4)
    k_cache, v_cache, tables, dense = make_paged_batch(rng, [97, 5], 2, 8, 16)
    for s, n in enumerate([97, 5]):
        k, v = gather_kv(torch.from_numpy(k_cache), torch.from_numpy(v_cache), tables[s], n)
        assert torch.equal(k, torch.from_numpy(dense[s][0])) and torch.equal(v, torch.from_numpy(dense[s][1]))


def test_write_kv_skips_padding_and_casts():
    k_cache = torch.zeros(2, 1, 4, 2, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    write_kv(k_cache, v_cache, key, -key, torch.tensor([5, -1]))
    assert k_cache.dtype == torch.float16
    assert torch.equal(k_cache[1, 0, 1], torch.tensor([1.0, 2.0], dtype=torch.float16))
    assert k_cache.abs().sum() == 3 and v_cache.abs().sum() == 3  # only one token written
