"""The CPU paged-attention kernels (kernels_numba.cpu_attention) and CpuNumbaBackend against the float64
numpy reference (reference/attention.py).

Pools are NaN-poisoned everywhere a sequence owns no slot and block tables are shuffled, so reading
past a sequence's end or through the wrong block shows up as NaN or a large error.

Tolerance, from a baseline: the kernels compute in float32, so their error against the float64
reference is compared with that of a float32 numpy evaluation of the same attention (dense K/V,
np.exp, float32 matmuls) on the same inputs. Ours may be up to BASELINE_FACTOR times that (a
different summation order and a polynomial exp with ~1e-7 relative error), with an absolute floor
of ABS_FLOOR for cases where the baseline happens to be almost exact.
"""
import numpy as np
import pytest
import torch

from kernels_numba import cpu_attention as ca
from pagedattn.errors import KernelLaunchError
from pagedattn.kv_cache import write_kv as torch_write_kv
from pagedattn.layers.attention import AttentionMetadata, TorchPagedBackend
from pagedattn.layers.cpu import CpuNumbaBackend
from reference import paged_decode_attention, paged_prefill_attention

HEADS = [(14, 2, 64), (4, 4, 32)]            # Qwen2-0.5B's GQA 7, and MHA
BLOCK_SIZES = [16, 8]
CONTEXT_LENS = [1, 15, 17, 97]
# (cached prefix, new tokens) per prefill chunk: no prefix, a chunk ending / starting inside a block,
# a chunk of exactly one block, a long chunk after a prefix that ends mid-block.
CHUNKS = [(0, 1), (0, 17), (15, 2), (16, 16), (40, 57), (3, 97)]
POOL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BASELINE_FACTOR = 8.0
ABS_FLOOR = 2e-6


def make_pool(rng, context_lens, num_kv_heads, head_dim, block_size, dtype=torch.float32, spare=3):
    """NaN-poisoned pool with each sequence's K/V scattered through a shuffled block table.

    Returns k_cache, v_cache [num_blocks, kvh, bs, d] (torch, `dtype`), block_tables [S, max_blocks]
    int32 (unused entries point at a poisoned spare block), per-sequence dense (k, v) float64 [ctx, kvh, d]
    holding the values as stored (rounded to `dtype`).
    """
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + spare
    k_cache = torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = rng.permutation(num_blocks)
    tables = np.full((len(context_lens), max(per_seq) + 1), perm[-1], dtype=np.int32)
    dense, used = [], 0
    for s, n in enumerate(context_lens):
        table = perm[used:used + per_seq[s]]
        used += per_seq[s]
        tables[s, :len(table)] = table
        k = torch.from_numpy(rng.standard_normal((n, num_kv_heads, head_dim))).to(dtype)
        v = torch.from_numpy(rng.standard_normal((n, num_kv_heads, head_dim))).to(dtype)
        for j in range(n):
            k_cache[table[j // block_size], :, j % block_size] = k[j]
            v_cache[table[j // block_size], :, j % block_size] = v[j]
        dense.append((k.double().numpy(), v.double().numpy()))
    return k_cache, v_cache, torch.from_numpy(tables), dense


def float32_baseline(q, dense, cu, context_lens):
    """Causal attention in plain float32 numpy (dense K/V, np.exp): the error yardstick."""
    out = np.empty(q.shape, dtype=np.float32)
    q32 = q.astype(np.float32)
    H, D = q.shape[1], q.shape[2]
    for s, (k, v) in enumerate(dense):
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
        G = H // k.shape[1]
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            pos = context_lens[s] - q_len + i
            for h in range(H):
                sc = (k32[:pos + 1, h // G] @ q32[cu[s] + i, h]) * np.float32(1 / np.sqrt(D))  # (pos+1,)
                p = np.exp(sc - sc.max())
                out[cu[s] + i, h] = (p / p.sum()) @ v32[:pos + 1, h // G]
    return out


def assert_close(out, ref, baseline):
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all(), "output has NaN/inf: a poisoned slot was read"
    err, base = np.abs(out - ref), np.abs(baseline - ref).max()
    tol = max(BASELINE_FACTOR * base, ABS_FLOOR)
    assert err.max() <= tol, (f"max err {err.max():.3e} (mean {err.mean():.3e}) > {tol:.3e} "
                              f"= max({BASELINE_FACTOR} x float32 baseline {base:.3e}, {ABS_FLOOR})")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    rng = np.random.default_rng(0)
    k_cache, v_cache, tables, dense = make_pool(rng, CONTEXT_LENS, num_kv_heads, head_dim, block_size)
    q = rng.standard_normal((len(CONTEXT_LENS), num_heads, head_dim))
    out = ca.paged_decode_attention(torch.from_numpy(q).float(), k_cache, v_cache, tables,
                                    torch.tensor(CONTEXT_LENS))
    ref = paged_decode_attention(q, k_cache, v_cache, tables, CONTEXT_LENS)
    cu = np.arange(len(CONTEXT_LENS) + 1)
    assert_close(out, ref, float32_baseline(q, dense, cu, CONTEXT_LENS))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, pool_dtype):
    """Chunks after cached prefixes, ragged lengths, block size 16, every pool dtype."""
    rng = np.random.default_rng(1)
    context_lens = [c + n for c, n in CHUNKS]
    k_cache, v_cache, tables, dense = make_pool(rng, context_lens, num_kv_heads, head_dim, 16, pool_dtype)
    cu = np.cumsum([0] + [n for _, n in CHUNKS])
    q = rng.standard_normal((cu[-1], num_heads, head_dim))
    out = torch.empty(cu[-1], num_heads, head_dim)
    res = ca.paged_prefill_attention(torch.from_numpy(q).float(), k_cache, v_cache, tables, torch.from_numpy(cu),
                                     torch.tensor(context_lens), out=out)
    assert res is out
    ref = paged_prefill_attention(q, k_cache, v_cache, tables, cu, context_lens)
    assert_close(out.numpy(), ref, float32_baseline(q, dense, cu, context_lens))


def test_chunked_prefill_equals_one_pass():
    """A 57-token prompt prefilled in chunks of 20 + 5 + 32 (boundaries inside blocks of 16) gives the
    rows of one 57-token pass: each row reads the same keys in the same order; only which rows share a
    pass of the kernel differs, which may change the last bit (float32 rounding, 1e-6)."""
    rng = np.random.default_rng(2)
    k_cache, v_cache, tables, _ = make_pool(rng, [57], 2, 64, 16)
    q = torch.from_numpy(rng.standard_normal((57, 14, 64))).float()
    whole = ca.paged_prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 57]), torch.tensor([57]))
    parts, start = [], 0
    for n in (20, 5, 32):
        parts.append(ca.paged_prefill_attention(q[start:start + n], k_cache, v_cache, tables, torch.tensor([0, n]),
                                                torch.tensor([start + n])))
        start += n
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-6, atol=1e-6)


def test_parallel_equals_serial(monkeypatch):
    """The work split over threads changes nothing: every item is computed the same way on any thread,
    Python's or numba's."""
    rng = np.random.default_rng(3)
    context_lens = [c + n for c, n in CHUNKS]
    k_cache, v_cache, tables, _ = make_pool(rng, context_lens, 2, 64, 16)
    cu = torch.from_numpy(np.cumsum([0] + [n for _, n in CHUNKS]))
    q = torch.from_numpy(rng.standard_normal((int(cu[-1]), 14, 64))).float()
    args = (q, k_cache, v_cache, tables, cu, torch.tensor(context_lens))
    serial = ca.paged_prefill_attention(*args, num_threads=1)
    monkeypatch.setattr(ca, "PARALLEL_MIN_WORK", 0)
    for threads in (2, 3):
        np.testing.assert_array_equal(ca.paged_prefill_attention(*args, num_threads=threads), serial)
    plan = ca.make_plan(tables, cu, torch.tensor(context_lens), *k_cache.shape[:3])
    for threads in (2, 3):
        np.testing.assert_array_equal(ca.attention(q, k_cache, v_cache, plan, num_threads=threads,
                                                   numba_threads=True), serial)


def test_exp_polynomial():
    x = np.concatenate([-np.geomspace(1e-8, 87, 5000), [0.0, -87.5, -100.0, -np.inf]]).astype(np.float32)
    y = x.copy()
    ca._exp_inplace(y, len(y), np.empty(len(y), np.uint32))
    ref = np.exp(x.astype(np.float64))
    ok = x >= ca.MIN_EXP_ARG                         # below: flushed to 0
    rel = np.abs(y[ok] - ref[ok]) / ref[ok]
    assert rel.max() <= 5e-7, f"max relative error {rel.max():.2e}"
    assert y[-4] == 1.0 and (y[-3:] == 0.0).all(), y[-4:]


def test_write_kv_equals_torch():
    rng = np.random.default_rng(4)
    k_cache = torch.full((6, 2, 8, 16), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([17, -1, 0, 47, 9])
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    ca.write_kv(key, value, ours_k, ours_v, slots)
    torch_write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(ours_k.nan_to_num(-7), k_cache.nan_to_num(-7))
    assert torch.equal(ours_v.nan_to_num(-7), v_cache.nan_to_num(-7))
    del rng


def test_bad_metadata_raises_before_reading():
    rng = np.random.default_rng(5)
    k_cache, v_cache, tables, _ = make_pool(rng, [20, 5], 2, 16, 8)
    q = torch.randn(2, 4, 16)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]                     # a block id one past the pool
    with pytest.raises(KernelLaunchError, match="block id outside"):
        ca.paged_decode_attention(q, k_cache, v_cache, bad, torch.tensor([20, 5]))
    with pytest.raises(KernelLaunchError, match="inconsistent"):  # needs more table columns than exist
        ca.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([8 * tables.shape[1] + 1, 5]))
    with pytest.raises(KernelLaunchError, match="inconsistent"):  # q_len > context_len
        ca.paged_prefill_attention(torch.randn(9, 4, 16), k_cache, v_cache, tables[:1], torch.tensor([0, 9]),
                                   torch.tensor([8]))
    with pytest.raises(KernelLaunchError, match="slot outside"):
        ca.write_kv(torch.randn(1, 2, 16), torch.randn(1, 2, 16), k_cache, v_cache, torch.tensor([k_cache.shape[0] * 8]))
    with pytest.raises(KernelLaunchError, match="q has shape"):
        ca.paged_decode_attention(torch.randn(2, 4, 32), k_cache, v_cache, tables, torch.tensor([20, 5]))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_mixed_step_matches_torch_backend(pool_dtype):
    """One step with two prefill chunks (one after a cached prefix) and three decodes through
    CpuNumbaBackend and TorchPagedBackend: same pool contents after the write, outputs within the
    float32 tolerance of each other (both compute in float32)."""
    rng = np.random.default_rng(6)
    H, Hkv, D, bs = 14, 2, 64, 16
    query_lens, context_lens = [17, 9, 1, 1, 1], [17, 40, 1, 33, 97]
    pool = torch.from_numpy(rng.standard_normal((24, Hkv, bs, D))).to(pool_dtype)
    tables = [list(t) for t in np.split(rng.permutation(24)[:2 + 3 + 1 + 3 + 7], [2, 5, 6, 9])]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, num_prefills=2)
    T = sum(query_lens)
    q = torch.randn(T, H, D)
    k, v = torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    outs, pools = [], []
    for backend in (CpuNumbaBackend(), TorchPagedBackend()):
        k_cache, v_cache = pool.clone(), pool.clone() * 0.5
        outs.append(backend(q, k, v, k_cache, v_cache, meta))
        pools.append((k_cache, v_cache))
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    err = (outs[0] - outs[1]).abs().max().item()
    assert err <= 1e-5, f"max |cpu-numba - torch| = {err:.2e}"


def test_backend_plan_is_made_once_per_step():
    """Every layer of a step reuses the first layer's plan, kept in the step's metadata; the next step (a new
    metadata object) gets its own, and a pool of another geometry gets its own."""
    rng = np.random.default_rng(7)
    k_cache, v_cache, tables, _ = make_pool(rng, [20, 33], 2, 16, 8)
    args = ([4, 1], [20, 33], [list(t[:3]) for t in tables.tolist()[:1]] + [list(tables[1, :5].tolist())], 8)
    meta = AttentionMetadata.build(*args, num_prefills=1)
    backend = CpuNumbaBackend()
    q = torch.randn(5, 4, 16)
    with torch.inference_mode():
        first = backend.attend(q, k_cache, v_cache, meta)
        plan = meta.cpu_plan[1]
        again = backend.attend(q, k_cache, v_cache, meta)
        assert meta.cpu_plan[1] is plan and torch.equal(first, again)
        step2 = AttentionMetadata.build(*args[:1], [20, 32], *args[2:], num_prefills=1)
        backend.attend(q, k_cache, v_cache, step2)
        assert step2.cpu_plan[1] is not plan and step2.cpu_plan[1].context_lens[1] == 32
        assert backend.plan(meta, torch.cat([k_cache, k_cache[:1]])) is not plan          # another pool geometry