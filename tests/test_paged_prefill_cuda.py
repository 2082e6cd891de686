"""Validation layer 2 for the paged prefill kernel: against the float64 reference.

Without a GPU the kernel runs in numba's CUDA simulator on tiny shapes (one Python thread per
CUDA thread, so every case here is a few CTAs). v1 runs every case; v2 and v3 (tens of seconds a case
there) take two each in the slow run (SLOW_SET: both head dims, both dtypes, ragged multi-sequence
chunks), the whole version x case matrix runs with
PAGEDATTN_FULL_MATRIX=1 python -m pytest -m slow tests/test_paged_prefill_cuda.py. The `gpu` tests run
realistic shapes on CUDA and hold the kernel to torch's own fp16/bf16 attention error.
"""
import math
from functools import partial

import numpy as np
import pytest
import torch

from helpers import full_matrix_param
from kernels_numba import prefill_journey as journey
from pagedattn.errors import KernelLaunchError
from reference.attention import gather_paged_kv, paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

# (num_heads, num_kv_heads, head_dim, block_size, dtype, q_lens, cached_lens)
SIM_CASES = [
    # GQA 2:1, several sequences: no prefix / a prefix not a multiple of the block / 1 new token
    (4, 2, 64, 8, torch.float16, [5, 17, 1], [0, 20, 9]),
    # group of 8 -> 8 queries per tile: 19 new tokens span 3 q tiles, the last one partial
    (8, 1, 64, 16, torch.float16, [19], [14]),
    # MHA, bf16, block 32, a chunk longer than one KV tile
    (2, 2, 64, 32, torch.bfloat16, [3, 40], [33, 0]),
    # head_dim 128 (32-row tiles), group 3
    (3, 1, 128, 16, torch.float16, [12, 2], [21, 45]),
]


def make_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, q_lens, cached_lens, seed=0, device=DEVICE):
    """A packed prefill batch over a shuffled pool whose unused slots are NaN.

    Returns q [total_q, H, D], k_cache, v_cache [num_blocks, Hkv, bs, D], block_tables
    [num_seqs, max_blocks] int32, cu_seqlens_q [num_seqs + 1] int32, context_lens [num_seqs] int32.
    """
    g = torch.Generator().manual_seed(seed)
    ctx = [q + c for q, c in zip(q_lens, cached_lens)]
    blocks_of = [math.ceil(c / block_size) for c in ctx]
    num_blocks = sum(blocks_of) + 3  # spare blocks nobody owns
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)  # shuffled physical blocks
    block_tables = torch.zeros(len(ctx), max(blocks_of) + 1, dtype=torch.int32)  # one padding column
    used = 0
    for s, c in enumerate(ctx):
        block_tables[s, : blocks_of[s]] = perm[used : used + blocks_of[s]]
        used += blocks_of[s]
        for j in range(c):  # only live slots get values; the rest of each block stays NaN
            b, o = int(block_tables[s, j // block_size]), j % block_size
            k_cache[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
            v_cache[b, :, o] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g).to(dtype)
    ctx = torch.tensor(ctx, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, cu, ctx))


def sim_tolerance(ref, v_cache, dtype, version):
    """Twice the output's own rounding (2u|ref|) plus 1e-5; v2 also rounds the probabilities P
    to the input dtype before P V (as flash attention does): at most u * sum_j p_j |v_j| <= u max|v|."""
    u = UNIT_ROUNDOFF[dtype]
    tol = 1e-5 + 2 * u * np.abs(ref)
    if version >= 2:
        tol = tol + u * float(np.nanmax(np.abs(v_cache.double().cpu().numpy())))
    return tol


def check_against_reference(out, ref, dtype, tol=None):
    """max |out - ref| <= tol (default: 2u|ref| + 1e-5, twice the output's own rounding)."""
    err = np.abs(out.double().cpu().numpy() - ref)
    if tol is None:
        tol = 1e-5 + 2 * UNIT_ROUNDOFF[dtype] * np.abs(ref)
    bad = err > tol
    assert not np.isnan(err).any(), "NaN in the output (read past a sequence's end?)"
    assert not bad.any(), f"max err {err.max():.3g}, mean err {err.mean():.3g}, {bad.sum()} of {bad.size} over tolerance"
    return err


# the first era, v1-v3 (paged_prefill.py); v4-v9 are tested in test_prefill_fa2.py
VERSIONS = [v for v in sorted(journey.VERSIONS) if v not in journey.FA2_VERSIONS]
LAST = VERSIONS[-1]


def case_id(c):
    return f"H{c[0]}-Hkv{c[1]}-d{c[2]}-bs{c[3]}-{str(c[4])[6:]}-{len(c[5])}seq"


# the cases v2 and v3 (tens of seconds each in the simulator) take in the slow run: both at head_dim 128 (32-row
# tiles); v2 the GQA batch of ragged chunks (a 1-token chunk, a prefix ending mid-block), v3 (compile-time block
# size) MHA bf16 at block 32 with a chunk longer than a KV tile. v1 runs every case.
SLOW_SET = {2: (0, 3), 3: (2, 3)}


def _prefill_cases():
    """v1 on the MHA bf16 case by default (the engine runs v4+, tests/test_prefill_fa2.py); v1's other cases
    and SLOW_SET under `slow`; the rest of the version x case matrix with PAGEDATTN_FULL_MATRIX=1."""
    for i, case in enumerate(SIM_CASES):
        for version in VERSIONS:
            case_name = f"{version}-{case_id(case)}"
            if version == min(VERSIONS):
                marks = [] if case is SIM_CASES[2] else [pytest.mark.slow]
                yield pytest.param(version, case, id=case_name, marks=marks)
            elif i in SLOW_SET.get(version, range(len(SIM_CASES))):
                yield pytest.param(version, case, id=case_name, marks=[pytest.mark.slow])
            else:
                yield full_matrix_param(version, case, id=case_name)


@pytest.mark.parametrize("version, case", _prefill_cases())
def test_paged_prefill_matches_reference(version, case):
    q, k, v, bt, cu, ctx = make_batch(*case, seed=1)
    out = journey.paged_prefill(q, k, v, bt, cu, ctx, version=version, validate=True)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    assert out.shape == q.shape and out.dtype == q.dtype
    check_against_reference(out, ref, q.dtype, sim_tolerance(ref, v, q.dtype, version))


@pytest.mark.slow          # the engine's kernels (v4+) check scale= and out= in test_prefill_fa2.py by default
@pytest.mark.parametrize("version", VERSIONS)
def test_paged_prefill_scale_and_out(version):
    q, k, v, bt, cu, ctx = make_batch(4, 2, 64, 8, torch.float16, [6, 3], [2, 11], seed=2)
    out = torch.full_like(q, float("nan"))
    result = journey.paged_prefill(q, k, v, bt, cu, ctx, scale=0.3, out=out, version=version)
    assert result is out
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx, scale=0.3)
    check_against_reference(out, ref, q.dtype, sim_tolerance(ref, v, q.dtype, version))


def test_paged_prefill_rejects_bad_arguments():
    q, k, v, bt, cu, ctx = make_batch(4, 2, 64, 8, torch.float16, [3], [2], seed=3)
    run = partial(journey.paged_prefill, version=LAST)  # the first era's host checks
    with pytest.raises(KernelLaunchError, match="head_dim"):
        run(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="q.dtype"):
        run(q.float(), k.float(), v.float(), bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="cu_seqlens_q"):
        run(q, k, v, bt, cu[:1], ctx)
    with pytest.raises(KernelLaunchError, match="num_kv_heads"):
        run(q[:, :3].contiguous(), k, v, bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="context_lens"):
        run(q, k, v, bt, cu, torch.tensor([2], dtype=torch.int32, device=DEVICE), validate=True)
    with pytest.raises(KernelLaunchError, match="block_tables"):
        run(q, k, v, bt.long(), cu, ctx)
    with pytest.raises(KernelLaunchError, match="version"):
        journey.paged_prefill(q, k, v, bt, cu, ctx, version=99)


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, tolerance from torch's own attention error

GPU_CASES = [
    # Qwen2-0.5B layer: 14 query heads, 2 KV heads, d=64
    (14, 2, 64, 16, torch.float16, [1, 15, 17, 97, 1025, 300], [0, 16, 100, 3, 500, 0]),
    (14, 2, 64, 8, torch.bfloat16, [2048], [0]),
    (14, 2, 64, 32, torch.float16, [512] * 4, [1024, 7, 0, 333]),
    # MHA and d=128
    (8, 8, 128, 16, torch.float16, [1, 97, 640], [63, 200, 1]),
    (16, 2, 128, 32, torch.bfloat16, [255, 129], [1000, 17]),
]


def sdpa_error(q, k, v, bt, cu, ctx, ref):
    """max |SDPA - ref| of torch's attention in q's dtype on dense per-sequence K/V, bottom-right causal."""
    worst = 0.0
    for s in range(len(ctx)):
        lo, hi, c = int(cu[s]), int(cu[s + 1]), int(ctx[s])
        kd, vd = (torch.from_numpy(x).to(q.dtype).to(q.device) for x in gather_paged_kv(k, v, bt[s], c))
        qs = q[lo:hi].transpose(0, 1)  # (H, q_len, D)
        pos = torch.arange(c - (hi - lo), c, device=q.device)
        mask = torch.arange(c, device=q.device)[None, :] <= pos[:, None]  # (q_len, c)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, kd.transpose(0, 1), vd.transpose(0, 1), attn_mask=mask, enable_gqa=True
        ).transpose(0, 1)
        worst = max(worst, float(np.abs(o.double().cpu().numpy() - ref[lo:hi]).max()))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_paged_prefill_vs_sdpa_error(case):
    q, k, v, bt, cu, ctx = make_batch(*case, seed=4)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    base = sdpa_error(q, k, v, bt, cu, ctx, ref)
    # floor: one unit in the last place of the largest output (both round their result once)
    tol = 2 * base + 2 * UNIT_ROUNDOFF[q.dtype] * float(np.abs(ref).max())
    for version in VERSIONS:
        out = journey.paged_prefill(q, k, v, bt, cu, ctx, version=version, validate=True)
        torch.cuda.synchronize()
        err = check_against_reference(out, ref, q.dtype, tol=tol)
        print(f"v{version}: max err {err.max():.3g} (SDPA {base:.3g}), mean {err.mean():.3g}")


@pytest.mark.gpu
def test_gpu_paged_prefill_in_cuda_graph():
    q, k, v, bt, cu, ctx = make_batch(14, 2, 64, 16, torch.float16, [100, 7], [50, 0], seed=5)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        journey.paged_prefill(q, k, v, bt, cu, ctx, out=out, version=LAST)  # compile outside the capture
    torch.cuda.synchronize()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        journey.paged_prefill(q, k, v, bt, cu, ctx, out=out, version=LAST)
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check_against_reference(out, ref, q.dtype, sim_tolerance(ref, v, q.dtype, LAST))
