"""Paged prefill v4-v9 (v7, the engine's, in kernels_numba/paged_prefill_fa2.py; the others in
prefill_journey_fa2.py; all run through prefill_journey.py): layouts, simulator, codegen, GPU.

* The simulator fallbacks of ldmatrix and mma.sync are checked against the PTX ISA's fragment
  layouts written out independently here, so a layout mistake in the kernel fails on the CPU.
* Every version runs in numba's CUDA simulator on tiny shapes against the float64 reference
  (ragged chunks, prefixes ending mid-block, NaN in every unused pool slot, shuffled tables).
  The simulator runs each CUDA thread as a Python thread (~0.3 s of CPU per CTA and KV tile), so
  the default run keeps one case per feature; the fuzz and one case per version and code path of the
  matrix's smaller shapes are `slow` (SLOW_PICKS), all of those shapes with
  PAGEDATTN_FULL_MATRIX=1 python -m pytest -m slow tests/test_prefill_fa2.py; the whole matrix runs on the GPU.
* Codegen: kernels compiled for sm_90 in a subprocess (no simulator), PTX and ptxas -v checked.
* `gpu`: real shapes against 2x torch SDPA's own error, forced splits, CUDA-graph capture.
"""
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from numba import cuda

from kernels_numba import paged_prefill_fa2 as fa, prefill_journey as journey, prefill_journey_fa2 as fj
from kernels_numba import prefill_parts as parts
from pagedattn.errors import KernelLaunchError
from reference.attention import gather_paged_kv, paged_prefill_attention
from helpers import compile_in_subprocesses, full_matrix_param

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
VERSIONS = journey.FA2_VERSIONS  # v4-v9; v1-v3 are tested in test_paged_prefill_cuda.py


def make_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, q_lens, cached_lens, seed=0, device=DEVICE):
    """A packed prefill batch over a shuffled pool whose unused slots (the tail of each last block
    and a few spare blocks) are NaN, and one padding column in the block table.

    Returns q [total_q, H, D], k_cache, v_cache [num_blocks, Hkv, block_size, D] (dtype),
    block_tables [num_seqs, max_blocks] int32, cu_seqlens_q [num_seqs + 1] int32,
    context_lens [num_seqs] int32.
    """
    g = torch.Generator().manual_seed(seed)
    ctx = [q + c for q, c in zip(q_lens, cached_lens)]
    blocks_of = [math.ceil(c / block_size) for c in ctx]
    num_blocks = sum(blocks_of) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.zeros(len(ctx), max(blocks_of) + 1, dtype=torch.int32)
    used = 0
    for s, c in enumerate(ctx):
        block_tables[s, : blocks_of[s]] = perm[used : used + blocks_of[s]]
        used += blocks_of[s]
        pos = torch.arange(c)
        block, offset = block_tables[s, pos // block_size].long(), pos % block_size
        k_cache[block, :, offset] = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)  # (c, Hkv, D)
        v_cache[block, :, offset] = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g).to(dtype)
    ctx = torch.tensor(ctx, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, cu, ctx))


def tolerance(ref, v_cache, dtype):
    """Twice the output's own rounding (2u|ref|), plus u * max|v| for rounding P to the input
    dtype before P V (as flash attention does: the error of sum_j p_j v_j is at most
    u sum_j p_j |v_j| <= u max|v|), plus 1e-5."""
    u = UNIT_ROUNDOFF[dtype]
    v = v_cache.double().cpu().numpy()
    return 1e-5 + 2 * u * np.abs(ref) + u * float(np.nanmax(np.abs(v)))


def check(out, ref, tol):
    err = np.abs(out.double().cpu().numpy() - ref)
    assert not np.isnan(err).any(), f"{int(np.isnan(err).sum())} NaN in the output (a read past a sequence's end?)"
    bad = err > tol
    assert not bad.any(), f"max err {err.max():.3g}, mean err {err.mean():.3g}, {bad.sum()} of {bad.size} over tolerance"
    return err


# ---------------------------------------------------------------------------------------------
# The fallbacks follow the PTX ISA (9.7.14.5.15 ldmatrix, 9.7.14.5.8 mma.m16n8k16 fragments)


def test_ldmatrix_fallback_follows_the_ptx_layout():
    # four 8x8 b16 matrices, element (m, r, c) = 64 m + 8 r + c, each row stored at a scattered
    # 16-byte slot; lane L gives the address of row L % 8 of matrix L // 8
    slot = np.random.default_rng(0).permutation(32)  # slot of (matrix, row) = 8 m + r
    mem = np.zeros(32 * 4, dtype=np.uint32)
    for m in range(4):
        for r in range(8):
            halves = np.arange(8, dtype=np.uint32) + 64 * m + 8 * r
            mem[4 * slot[8 * m + r] : 4 * slot[8 * m + r] + 4] = halves[0::2] | (halves[1::2] << 16)
    addr = (4 * slot).astype(np.int64)
    got = np.zeros((2, 32, 4), dtype=np.uint32)

    @cuda.jit
    def kernel(mem, addr, got):
        sh = cuda.shared.array(128, np.uint32)
        lane = cuda.threadIdx.x
        for i in range(4):
            sh[4 * lane + i] = mem[4 * lane + i]
        cuda.syncthreads()
        w = parts.ldmatrix_x4(sh, addr[lane])
        t = parts.ldmatrix_x4_trans(sh, addr[lane])
        for i in range(4):
            got[0, lane, i] = w[i]
            got[1, lane, i] = t[i]

    kernel[1, 32](mem, addr, got)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):
            # each thread holds two consecutive elements of row g; .trans: of column g
            assert got[0, lane, m] == (64 * m + 8 * g + 2 * t) | ((64 * m + 8 * g + 2 * t + 1) << 16)
            assert got[1, lane, m] == (64 * m + 8 * (2 * t) + g) | ((64 * m + 8 * (2 * t + 1) + g) << 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_fallback_matches_a_matmul(dtype):
    rng = torch.Generator().manual_seed(1)
    a = torch.randn(16, 16, generator=rng).to(dtype)
    b = torch.randn(16, 8, generator=rng).to(dtype)
    c = torch.randn(16, 8, generator=rng)
    words = lambda x: x.contiguous().view(torch.int32).numpy().view(np.uint32)  # noqa: E731 pairs along a row
    a_w = words(a)  # (16, 8): a_w[r, j] = A[r, 2j:2j+2]
    bt_w = words(b.t())  # (8, 8): bt_w[n, j] = B[2j:2j+2, n]
    d = np.zeros((16, 8), dtype=np.float32)
    mma = parts.mma_bf16 if dtype == torch.bfloat16 else parts.mma_f16

    @cuda.jit
    def kernel(a_w, bt_w, c, d):
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        r = mma(a_w[g, t], a_w[g + 8, t], a_w[g, t + 4], a_w[g + 8, t + 4], bt_w[g, t], bt_w[g, t + 4],
                c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = r[0]
        d[g, 2 * t + 1] = r[1]
        d[g + 8, 2 * t] = r[2]
        d[g + 8, 2 * t + 1] = r[3]

    kernel[1, 32](a_w, bt_w, c.numpy(), d)
    want = a.double() @ b.double() + c.double()
    np.testing.assert_allclose(d, want.numpy(), rtol=2**-22, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Simulator: every version on tiny shapes

# (version, forced splits, (num_heads, num_kv_heads, head_dim, block_size, dtype, q_lens, cached_lens))
FAST_CASES = [
    # GQA 7, ragged chunks of 1 and 17 (two q tiles of 9 queries) behind prefixes of 0 and 20:
    # a chunk starting mid-block
    (4, None, (7, 1, 64, 16, torch.float16, [1, 17], [0, 20])),
    # MHA, bf16, block 8: 87 keys in two KV tiles, the chunk starts mid-block
    (5, None, (1, 1, 64, 8, torch.bfloat16, [17], [70])),
    # a 97-query chunk split in 2: rows 0-63 see nothing in the second part (an all -inf part)
    (6, 2, (1, 1, 64, 16, torch.float16, [97], [0])),
    # head_dim 128, GQA 3, block 32
    (6, None, (3, 1, 128, 32, torch.bfloat16, [12], [21])),
    # v7 (the work list): GQA 7, a 1-token chunk and a 3-token chunk after a cached prefix of 61
    # (its keys cross a KV tile; its rows step past the group's end: 16 rows a pass, 7 heads)
    (7, None, (7, 1, 64, 16, torch.float16, [1, 3], [0, 61])),
    # v7 at head_dim 128 (128 rows, tiles of 32 keys): GQA 4, bf16, block 8; a chunk of 18 behind a
    # prefix of 30 (two KV tiles through the ring, the second masked)
    (7, None, (4, 1, 128, 8, torch.bfloat16, [18], [30])),
]

SLOW_SHAPES = [
    (14, 2, 64, 16, torch.float16, [1, 15, 17, 97], [0, 16, 100, 3]),
    (3, 1, 128, 32, torch.bfloat16, [12, 2], [21, 45]),
    (14, 2, 64, 8, torch.bfloat16, [33, 1], [7, 130]),
    (7, 1, 64, 32, torch.float16, [40], [90]),
    (4, 4, 128, 16, torch.float16, [97], [5]),
    (16, 2, 128, 8, torch.bfloat16, [9, 23], [64, 1]),
]


def case_id(c):
    version, splits, (h, hkv, d, bs, dtype, q_lens, cached) = c
    return f"v{version}-s{splits}-H{h}-Hkv{hkv}-d{d}-bs{bs}-{str(dtype)[6:]}-q{'.'.join(map(str, q_lens))}"


def run_case(version, splits, shape, seed=1, **options):
    q, k, v, bt, cu, ctx = make_batch(*shape, seed=seed)
    out = journey.paged_prefill(q, k, v, bt, cu, ctx, version=version, splits=splits, **options)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    assert out.shape == q.shape and out.dtype == q.dtype
    return check(out, ref, tolerance(ref, v, q.dtype))


@pytest.mark.parametrize("case", FAST_CASES, ids=case_id)
def test_matches_reference(case):
    run_case(*case)


ALL_CASES = [(version, None, shape) for version in VERSIONS for shape in SLOW_SHAPES] + [
    (version, splits, shape) for version in journey.SPLITS_KV for splits in (3, 5) for shape in SLOW_SHAPES[:3]]
# The simulator takes the matrix's three smaller shapes (10-90 s each); the three with ~100-query chunks
# over 4-16 heads run minutes each there, so they run on the GPU, with the rest (test_gpu_full_matrix)
SIM_SHAPES = SLOW_SHAPES[1:4]
D128, TWO_KV_HEADS, LONG_CHUNK = SIM_SHAPES  # d=128 GQA 3 bs32 bf16; GQA 7 x 2 KV heads bs8 bf16; 40 new f16 bs32
SIM_MATRIX = [c for c in ALL_CASES if c[2] in SIM_SHAPES]


# v7: ragged short chunks (1, 19: two q tiles of 18 queries, 3) behind prefixes of 0, 20 (mid-block)
# and 61; at d=128 a chunk of two q tiles; a forced split at head_dim 128: 70 keys in 3 parts of one 32-key tile each (20 s each here)
V7_V8_CASES = [(7, None, (7, 1, 64, 16, torch.float16, [1, 19, 3], [0, 20, 61])),
               (7, None, (4, 1, 128, 8, torch.bfloat16, [1, 33], [40, 0])),  # 1 token; two q tiles
               (7, 3, (4, 1, 128, 32, torch.float16, [5], [65]))]


# v8 (block ids a tile ahead, lazy rescale; at d=64 by default in test_v8_lazy_rescale) at head_dim 128:
# GQA 4, bf16, block 8, a 1-token chunk and a chunk of 33 (two q tiles of 32) behind a prefix of 40 (three
# 32-key tiles, blocks loaded ahead); at d=64 GQA 7 ragged chunks of 1, 19 and 3 behind prefixes of 0, 20
# and 61 (as v7's); a split in 3 at d=128
V7_V8_CASES += [(8, None, (4, 1, 128, 8, torch.bfloat16, [1, 33], [40, 0])),
                (8, None, (7, 1, 64, 16, torch.float16, [1, 19, 3], [0, 20, 61])),
                (8, 3, (4, 1, 128, 32, torch.float16, [5], [65]))]

# The slow run takes one simulator case per version and code path from SIM_MATRIX (the whole of it runs
# with PAGEDATTN_FULL_MATRIX=1, and on the GPU): every version at both head dims (v7, v8 at d=128 through
# V7_V8_CASES), both dtypes and block sizes 8, 16 and 32; two KV heads (the grid's KV-head index, Qwen2's
# 14/2 layout) on v7 and v8, the engine's kernels (v5 and v7 also meet two KV heads in test_fuzz_random_lengths'
# seeds 1 and 3; v4 and v6 only in the full matrix); forced splits on each split version: v6 in 5 parts at d=128 (parts with
# no KV tile: all -inf partials; v6's split of a long d=64 chunk runs by default), v7 in 5 at d=128, v8 in 3
# over two KV heads at d=64 (v7's and v8's 3 parts at d=128 in V7_V8_CASES)
SLOW_PICKS = [(4, None, D128), (4, None, LONG_CHUNK), (5, None, D128), (5, None, LONG_CHUNK),
              (6, None, D128), (6, None, LONG_CHUNK), (6, 5, D128),
              (7, None, TWO_KV_HEADS), (7, 5, D128),
              (8, 3, TWO_KV_HEADS)]
SLOW_CASES = ([c if c in SLOW_PICKS else full_matrix_param(c, id=case_id(c)) for c in SIM_MATRIX]
              + V7_V8_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_matches_reference_full_matrix(case):
    run_case(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_gpu_full_matrix(case):
    run_case(*case)


# v9 (v7's kernel looping over the work list; the next item's Q and first KV tile copied during this item's
# last tile, or with prefetch="epilogue" after its math): (CTAs per KV head, prefetch, shape). With few CTAs
# each runs several items of different sequences, its two Q buffers alternating and the ring's stages carried
# from one item to the next; snake order (a CTA's second item is the round's last); a CTA stopping at the
# list's end (-1) or at the bound
V9_FAST = [
    # one CTA for all 3 items: a 1-token sequence, a 19-token chunk behind a prefix of 20 (mid-block; two q
    # tiles of 18 queries, the second with one query), GQA 7, d=64
    (1, None, (7, 1, 64, 16, torch.float16, [1, 19], [0, 20])),
]
V9_SLOW = [
    # d=128 (tiles of 32 keys), GQA 4, bf16, block 8: 3 items on 2 CTAs (the second runs items 1 and 2, the
    # first finds -1 in its second round); the 33-token chunk's first tile sees two KV tiles
    (2, None, (4, 1, 128, 8, torch.bfloat16, [1, 33], [40, 0])),
    (2, "epilogue", (4, 1, 128, 8, torch.bfloat16, [1, 33], [40, 0])),
    # Qwen2's 14/2 layout (CTA x = item * 2 + KV head), bf16, block 8: a 33-token chunk behind 7 cached and a
    # 1-token chunk behind 130 (three KV tiles): one CTA per head runs every item
    (1, "epilogue", (14, 2, 64, 8, torch.bfloat16, [33, 1], [7, 130])),
    # many 1-token and short sequences (prompts of a chat batch) on 3 CTAs: 7 items, 3 rounds
    (3, None, (7, 1, 64, 32, torch.float16, [1, 1, 5, 1, 2, 20, 1], [0, 3, 0, 40, 7, 0, 0])),
    # d=128 MHA-like group 2, fp16, block 16: a chunk of 70 (three q tiles of 64, the last a partial) behind 45
    (2, None, (2, 1, 128, 16, torch.float16, [70, 9], [45, 0])),
    # one CTA per item (the default grid: fewer items than a wave), d=64
    (None, None, (7, 1, 64, 16, torch.float16, [1, 19, 3], [0, 20, 61])),
]


def v9_id(c):
    return f"ctas{c[0]}-{c[1] or 'tile'}-" + case_id((9, None, c[2]))[len("v9-sNone-"):]


@pytest.mark.parametrize("case", V9_FAST + [pytest.param(c, marks=pytest.mark.slow) for c in V9_SLOW], ids=v9_id)
def test_v9_matches_reference(case):
    ctas, prefetch, shape = case
    run_case(9, None, shape, ctas=ctas, prefetch=prefetch)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", fj.PREFETCH)
@pytest.mark.parametrize("ctas", [1, 3, 7, None])
@pytest.mark.parametrize("shape", SLOW_SHAPES, ids=lambda s: case_id((9, None, s))[len("v9-sNone-"):])
def test_gpu_v9_few_ctas(shape, ctas, prefetch):
    run_case(9, None, shape, ctas=ctas, prefetch=prefetch)


def test_v9_grid_and_choice():
    # one wave of 2 CTAs per SM over the KV heads, never more CTAs than items; ctas overrides
    assert fj.persistent_grid(1000, 2, 132) == 264 and fj.persistent_grid(100, 2, 132) == 200
    assert fj.persistent_grid(1000, 2, 132, ctas=3) == 6
    # short prompts (64 x 128 at 14/2: 1040 CTAs, contexts of 128) run v9; long contexts, grids of one wave
    # or less (1 x 2048: 230 CTAs, a CTA an item either way) and d=128 the engine's version
    assert fj.short_plan(1040, 128, 132) and not fj.short_plan(1040, fj.SHORT_CONTEXT + 1, 132)
    assert not fj.short_plan(230, 2048, 132) and not fj.short_plan(1040, 128, 132, head_dim=128)
    q = torch.zeros(64 * 128, 14, 64, dtype=torch.float16)
    k = torch.zeros(1, 2, 16, 64, dtype=torch.float16)
    assert fj.choose_version(q, k, torch.zeros(64, 8, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)) == 9
    assert fj.choose_version(q[:256], k, torch.zeros(1, 272, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32)) == fj.PRODUCTION_VERSION
    assert fj.choose_version(q, k, torch.zeros(64, 8, dtype=torch.int32), torch.zeros(64, dtype=torch.int32),
                             splits=2) == fj.PRODUCTION_VERSION
    with pytest.raises(KernelLaunchError, match="stages"):
        fj.version_config(9, 64, stages=3)
    with pytest.raises(KernelLaunchError, match="prefetch"):
        fj.version_config(9, 64, prefetch="never")
    with pytest.raises(KernelLaunchError, match="prefetch"):
        fj.version_config(7, 64, prefetch="tile")
    with pytest.raises(KernelLaunchError, match="splits"):
        q, k, v, bt, cu, ctx = make_batch(7, 1, 64, 16, torch.float16, [3], [2], seed=3)
        fj.launch_torch(9, q, k, v, bt, cu, ctx, splits=2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_random_lengths(seed):
    rng = np.random.default_rng(seed)
    num_kv_heads, group = [(1, 7), (2, 1), (1, 3), (2, 2)][seed]
    num_seqs = int(rng.integers(1, 4))
    q_lens = [int(x) for x in rng.integers(1, 40, num_seqs)]
    cached = [int(x) for x in rng.integers(0, 90, num_seqs)]
    shape = (num_kv_heads * group, num_kv_heads, [64, 128][seed % 2], [8, 16, 32][seed % 3],
             [torch.float16, torch.bfloat16][seed % 2], q_lens, cached)
    version = VERSIONS[seed % len(VERSIONS)]
    run_case(version, int(rng.integers(2, 4)) if version in journey.SPLITS_KV else None, shape, seed=seed)


@pytest.mark.parametrize("rising", [True, False])
def test_v8_lazy_rescale(rising):
    # v8 moves a row's running max only when a p would pass 2^RESCALE_LOG2. rising: scores grow with
    # the key's position by ~0.72 (log2 units) per key, so the second tile's 24 keys move the max by
    # ~17 (the rescale path after the first tile); otherwise the first tile's max holds for the rest (p
    # below 2^8, no rescale). GQA 7, d=64: a chunk of 18 (one q tile) behind 70 cached keys, two KV
    # tiles, the second on the diagonal (masked)
    q, k, v, bt, cu, ctx = make_batch(7, 1, 64, 16, torch.float16, [18], [70], seed=6)
    if rising:
        q[..., 0] = 8.0
        pos = torch.arange(int(ctx[0]))
        k[bt[0, pos // 16].long(), :, pos % 16, 0] = (pos.float() / 2)[:, None].to(k.dtype)  # (ctx, Hkv)
    out = journey.paged_prefill(q, k, v, bt, cu, ctx, version=8)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check(out, ref, tolerance(ref, v, q.dtype))


# The shipped kernel's one-warp CTA (16 rows: the batch-invariant mode's decodes): chunks of one and two queries
# give each row the 128-row CTA's bits. GQA 7 over two KV heads at d=64 (a one-query chunk fills 7 of the 16 rows,
# a two-query chunk 14), block 16, contexts crossing 64-key tiles; head_dim 128 bf16 block 8 (tiles of 32 keys, 2
# rows a copy pass) and MHA block 32. All under -m slow (~45 s each in the simulator): by default the mode's test
# (tests/test_batch_invariance.py) compares one-query decodes in one-warp CTAs with the prompt's 128-row CTAs.
ONE_WARP_SHAPES = [pytest.param((14, 2, 64, 16, torch.float16, [1, 2, 1], [0, 63, 130]), marks=pytest.mark.slow),
                   pytest.param((4, 1, 128, 8, torch.bfloat16, [1, 2, 1], [5, 40, 95]), marks=pytest.mark.slow),
                   pytest.param((2, 2, 64, 32, torch.float16, [2, 1], [70, 31]), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", ONE_WARP_SHAPES, ids=lambda s: case_id((7, 1, s))[len("v7-s1-"):])
def test_one_warp_cta_rows_are_the_four_warp_ctas_bits(shape):
    from kernels_numba import paged_prefill_fa2 as fa

    q, k, v, bt, cu, ctx = make_batch(*shape, seed=7)
    four = fa.paged_prefill(q, k, v, bt, cu, ctx, splits=1)
    one = fa.paged_prefill(q, k, v, bt, cu, ctx, splits=1, warps=1)
    assert torch.equal(one, four)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check(one, ref, tolerance(ref, v, q.dtype))


@pytest.mark.slow   # ~2 min in the simulator; by default the mode's prompt == chunk == decode test crosses a part
def test_parts_fixed_by_position_give_a_row_the_same_bits_in_every_launch():
    """part_keys (the batch-invariant mode): a query's keys in parts of 64 keys from position 0, whatever the
    launch: the whole prompt (3 parts), a chunk behind its cached prefix, and one-query decodes in one-warp
    CTAs under a larger bound (7 parts, the last ones empty) give a row the same bits; a row of one part gets
    the unsplit launch's bits (its one part merged is its O exactly); all within the reference's tolerance."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)     # noqa: E731
    q, k, v, bt, cu, ctx = make_batch(4, 1, 64, 16, torch.float16, [170], [0], seed=9)
    whole = fa.paged_prefill(q, k, v, bt, cu, ctx, part_keys=64)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check(whole, ref, tolerance(ref, v, q.dtype))
    chunk = fa.paged_prefill(q[120:].contiguous(), k, v, bt, i32(0, 50), ctx, part_keys=64)
    assert torch.equal(chunk, whole[120:])
    rows = [10, 63, 64, 169]
    decodes = fa.paged_prefill(q[rows].contiguous(), k, v, bt.expand(len(rows), -1).contiguous(), i32(0, 1, 2, 3, 4),
                               i32(*[r + 1 for r in rows]), part_keys=64, warps=1, max_context_len=400)
    assert torch.equal(decodes, whole[rows])
    unsplit = fa.paged_prefill(q, k, v, bt, cu, ctx, splits=1)
    assert torch.equal(unsplit[:64], whole[:64])
    for bad in (dict(part_keys=48), dict(part_keys=64, splits=2), dict(part_keys=0)):
        with pytest.raises(KernelLaunchError, match="part_keys"):
            fa.paged_prefill(q, k, v, bt, cu, ctx, **bad)


def test_scale_and_out_argument():
    q, k, v, bt, cu, ctx = make_batch(2, 1, 64, 16, torch.float16, [3], [5], seed=2)
    out = torch.full_like(q, float("nan"))
    assert journey.paged_prefill(q, k, v, bt, cu, ctx, scale=0.3, out=out, version=4) is out
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx, scale=0.3)
    check(out, ref, tolerance(ref, v, q.dtype))


def test_rejects_bad_arguments():
    q, k, v, bt, cu, ctx = make_batch(4, 2, 64, 8, torch.float16, [3], [2], seed=3)
    with pytest.raises(KernelLaunchError, match="head_dim"):
        fa.paged_prefill(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="dtype"):
        fa.paged_prefill(q, k.float(), v.float(), bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="q.dtype"):
        fa.paged_prefill(q, k.bfloat16(), v.bfloat16(), bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="cu_seqlens_q"):
        fa.paged_prefill(q, k, v, bt, cu[:1], ctx)
    with pytest.raises(KernelLaunchError, match="num_kv_heads"):
        fa.paged_prefill(q[:, :3].contiguous(), k, v, bt, cu, ctx)
    with pytest.raises(KernelLaunchError, match="context_lens"):
        fa.paged_prefill(q, k, v, bt, cu, torch.tensor([2], dtype=torch.int32, device=DEVICE), validate=True)
    with pytest.raises(KernelLaunchError, match="outside"):
        fa.paged_prefill(q, k, v, torch.full_like(bt, k.shape[0]), cu, ctx, validate=True)
    with pytest.raises(KernelLaunchError, match="block_tables"):
        fa.paged_prefill(q, k, v, bt.long(), cu, ctx)
    with pytest.raises(KernelLaunchError, match="version"):
        fj.launch_torch(3, q, k, v, bt, cu, ctx)  # the first era's kernels are not built here
    with pytest.raises(KernelLaunchError, match="version"):
        journey.paged_prefill(q, k, v, bt, cu, ctx, version=max(journey.VERSIONS) + 1)
    with pytest.raises(KernelLaunchError, match="splits"):
        journey.paged_prefill(q, k, v, bt, cu, ctx, version=4, splits=2)


def test_find_tile_starts_the_heaviest_tiles_first():
    cu = np.array([0, 5, 45, 62], dtype=np.int32)  # q_lens 5, 40, 17 -> 1, 5, 2 tiles of 9 queries
    got = np.zeros((10, 2), dtype=np.int64)

    @cuda.jit
    def kernel(cu, got):
        for t in range(got.shape[0]):
            s, tile = fj.find_tile(t, cu, cu.shape[0] - 1, 9)
            got[t, 0] = s
            got[t, 1] = tile

    kernel[1, 1](cu, got)
    # rank 0: every sequence's last tile, then rank 1, ...; (-1, 0) past the 8 tiles
    want = [(0, 0), (1, 4), (2, 1), (1, 3), (2, 0), (1, 2), (1, 1), (1, 0), (-1, 0), (-1, 0)]
    assert [tuple(x) for x in got] == want


def run_plan(q_lens, bq, bound):
    """The plan kernel's work list for chunks of q_lens: [(sequence, q tile)] per item, (-1, 0) past the last."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    work = np.full(3 * bound, 12345, dtype=np.int32)
    fa.make_plan_kernel()[1, fa.PLAN_THREADS](cu, bq, work)
    return [(int(work[i]), int(work[bound + i])) for i in range(bound)]


def test_plan_starts_the_heaviest_tiles_first():
    # q_lens 5, 40, 17 -> 1, 5, 2 tiles of 9 queries; rank 0 is every sequence's last tile, the
    # sequences of a rank by falling tile count (find_tile's ranks, sequences sorted)
    got = run_plan([5, 40, 17], 9, 10)
    want = [(1, 4), (2, 1), (0, 0), (1, 3), (2, 0), (1, 2), (1, 1), (1, 0), (-1, 0), (-1, 0)]
    assert got == want


@pytest.mark.parametrize("seed", range(3))
def test_plan_covers_every_tile_once(seed, monkeypatch):
    # ragged lengths (many 1-token chunks, ties in tile count), more sequences than the plan's
    # threads in the last case: every (sequence, tile) exactly once, ranks never rising, the
    # bound's tail empty. In the simulator (which reads the module's constant at run time) seed 1
    # keeps 16 of its 40 sequences' tile counts in shared memory and recomputes the rest, as the
    # plan does past PLAN_SEQS sequences
    if seed == 1 and parts.SIMULATOR:
        monkeypatch.setattr(fa, "PLAN_SEQS", 16)
    rng = np.random.default_rng(seed)
    num_seqs = [7, 40, fa.PLAN_THREADS + 13][seed]
    q_lens = [int(x) for x in rng.choice([1, 2, 9, 18, 19, 50, 130], num_seqs)]
    bq = [18, 9, 32][seed]
    bound = sum(q_lens) // bq + 1 + num_seqs
    got = run_plan(q_lens, bq, bound)
    ntiles = [-(-n // bq) for n in q_lens]
    items = [x for x in got if x[0] >= 0]
    assert sorted(items) == [(s, t) for s in range(num_seqs) for t in range(ntiles[s])]
    assert got[len(items):] == [(-1, 0)] * (bound - len(items))
    ranks = [ntiles[s] - 1 - t for s, t in items]
    assert ranks == sorted(ranks)


def test_split_plan():
    # a grid that covers the SMs is never split (Qwen2-0.5B, 1 x 2048 new tokens: 230 CTAs)
    ctas = fa.num_tiles_bound(2048, 1, fa.BM // 7) * 2
    assert ctas >= 132 and fa.split_plan(ctas, 2048, 132) == 1
    # 1 x (4096 cached + 256 new): 16 q tiles x 2 KV heads; 8 parts fill one wave of 2 x 132
    ctas = fa.num_tiles_bound(256, 1, fa.BM // 7) * 2
    assert ctas == 32 and fa.split_plan(ctas, 4352, 132) == 8
    # bounded by MAX_SPLITS and by parts of >= MIN_TILES_PER_SPLIT KV tiles
    assert fa.split_plan(1, 10**6, 132) == fa.MAX_SPLITS
    assert fa.split_plan(4, 3 * fa.BN * fa.MIN_TILES_PER_SPLIT, 132) == 3
    assert fa.split_plan(4, 10, 132) == 1
    assert fa.split_plan(100, 10**6, 132) == 2


# ---------------------------------------------------------------------------------------------
# Codegen: compiled for sm_90 without the simulator (conftest.py turns it on in this process)

_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import paged_prefill_fa2 as fa, prefill_journey_fa2 as fj

u32, f32, bt, i32 = types.uint32[::1], types.float32[::1], types.int32[:, ::1], types.int32[::1]
SIG = (u32, u32, u32, bt, i32, i32, u32, f32, f32, i32, types.int64, types.int64, types.float32)
SHIPPED_SIG = SIG + (types.int32,)  # paged_prefill_fa2's kernel (v7): + part_tiles
MERGE_SIG = (f32, f32, u32, types.int64, types.int64)
out = {}
for version, head_dim, kind, block_size in json.loads(sys.argv[1]):
    name = f"v{version}_d{head_dim}_{kind}_bs{block_size}"
    if version == "merge":
        ptx, _ = cuda.compile_ptx(fa.make_merge_kernel(kind).py_func, MERGE_SIG, cc=(9, 0))
    elif version == "plan":
        ptx, _ = cuda.compile_ptx(fa.make_plan_kernel().py_func, (i32, types.int64, i32), cc=(9, 0))
    elif version == "7w1":  # the shipped kernel's one-warp CTA (the batch-invariant mode's decodes)
        kernel = fa.make_prefill_kernel(head_dim, kind, block_size, warps=1)
        ptx, _ = cuda.compile_ptx(kernel.py_func, SHIPPED_SIG, cc=(9, 0), launch_bounds=(32, 8))
    else:  # "9e": v9 with its next item's copies after the last tile's math (prefetch="epilogue")
        version, prefetch = (9, "epilogue") if version == "9e" else (version, None)
        kernel = fj.get_kernel(version, head_dim, kind, block_size, prefetch=prefetch)
        sig = SHIPPED_SIG if version == fj.PRODUCTION_VERSION else SIG
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=fa.LAUNCH_BOUNDS)
    open(f"{sys.argv[2]}/{name}.ptx", "w").write(ptx)
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))
    out[name] = {
        "mma": count("mma.sync.aligned.m16n8k16.row.col.f32." + kind),
        "ldmatrix": count("ldmatrix.sync.aligned.m8n8.x4.shared.b16"),
        "ldmatrix_trans": count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"),
        "cp_async": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
        "cp_async_wait": len(re.findall(r"cp\.async\.wait_group", ptx)),
        "ex2": count("ex2.approx"),
        "ld_shared_scalar": count("ld.shared.u32"),
        "dynamic_smem_align16": bool(re.search(r"\.extern \.shared \.align 16", ptx)),
        "st_global_v4": count("st.global.v4"),
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "f64_ops": sum(1 for o in ops if ".f64" in o),
    }
print("STATS" + json.dumps(out))
"""

CODEGEN_FAST = [(4, 64, "f16", 16), (5, 64, "bf16", 8), ("merge", 0, "f16", 0), (7, 128, "f16", 16),
                ("plan", 0, "", 0), (8, 64, "f16", 16), (9, 64, "f16", 16), ("9e", 64, "f16", 16),
                ("7w1", 64, "f16", 16)]
CODEGEN_SLOW = [(4, 128, "bf16", 32), (5, 128, "f16", 16), (4, 64, "bf16", 8), (5, 64, "f16", 32),
                ("merge", 0, "bf16", 0), (7, 64, "f16", 16), (7, 128, "bf16", 8), (8, 128, "f16", 16),
                (8, 64, "bf16", 8), (9, 128, "bf16", 8), ("9e", 128, "f16", 16), ("7w1", 128, "bf16", 32)]
# ptxas register bounds: 2 CTAs of 128 threads per SM (LAUNCH_BOUNDS) allow 255; v4 at d=64
# measured 212 (numba 0.68 / numba-cuda 0.30.4): a rise past 232 means a regression worth a look
REGISTER_BOUND = {(4, 64): 232}
# v7 at d=128 (128 rows: O is 128 registers, S 32) fills the 255 and ptxas spills a few words
# (measured: 40 bytes stored, 60-64 loaded, numba-cuda 0.30.4, ptxas 13.0); more means the budget
# broke (one of O's loops left rolled moved O to local memory: 500+ bytes)
SPILL_BYTES = {(7, 128): 64, (8, 64): 8, (8, 128): 72, (9, 64): 160, (9, 128): 2560, ("9e", 64): 72,
               ("9e", 128): 2560}
# v8 keeps a tile's block ids (4 registers) live through the KV loop: at d=64 one word spills (4 bytes
# each way), at d=128 56 stored / 64 loaded (numba-cuda 0.30.4, ptxas 13.0)
# v9's item loop keeps more live through the KV loop (the next item's place in the work list, the round, the
# Q buffer's base): at d=64 92 bytes stored / 156 loaded (a few reloads a tile, L1 hits), 56 / 64 with the
# copies after the last tile's math ("9e": none inside the KV loop); at d=128 ~350 / ~1700 with those,
# ~560 / ~2500 at the last tile's start (reloads inside the loop: short_plan leaves d=128 to v7); the
# softmax's test that a row's max stands (alpha held at exactly 1) brings 9e at d=128 to 348 / 2096


def _name(cfg):
    return f"v{cfg[0]}_d{cfg[1]}_{cfg[2]}_bs{cfg[3]}"


def _compile(configs, tmp):
    stats = {}
    for stdout in compile_in_subprocesses(_SCRIPT, configs, lambda part: (json.dumps(part), tmp), timeout=900):
        line = next(x for x in stdout.splitlines() if x.startswith("STATS"))
        stats.update(json.loads(line[len("STATS"):]))
    return stats


def _ptxas(ptx_path):
    """ptxas -v for sm_90: (registers, spill store bytes, spill load bytes)."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not installed")
    text = ptx_path.read_text()
    # numba's NVVM may declare a newer PTX ISA than the installed ptxas reads; nothing here needs it
    ver = re.search(r"release (\d+)\.(\d+)", subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout)
    if ver:
        text = re.sub(r"^\.version \d+\.\d+", f".version {int(ver.group(1)) - 4}.{ver.group(2)}", text, flags=re.M)
    src = ptx_path.with_suffix(".fixed.ptx")
    src.write_text(text)
    proc = subprocess.run([ptxas, "-arch=sm_90", "-v", str(src), "-o", os.devnull], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-2000:]
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return regs, stores, loads


def check_codegen(stats, tmp, cfg):
    s = stats[_name(cfg)]
    assert not s["local"] and s["f64_ops"] == 0, s
    regs, stores, loads = _ptxas(Path(tmp) / f"{_name(cfg)}.ptx")
    spill = SPILL_BYTES.get(cfg[:2], 0)
    assert stores <= spill and loads <= spill, f"{_name(cfg)}: {regs} registers, {stores} B spill stores, {loads} B loads"
    assert regs <= 255, regs
    if cfg[0] in ("merge", "plan"):
        return
    version, head_dim = cfg[0], cfg[1]
    assert regs <= REGISTER_BOUND.get((version, head_dim), 255), f"{_name(cfg)}: {regs} registers"
    if version == "7w1":
        mt, q_in_smem, bn, threads = 1, True, fa.tile_keys(head_dim), 32
    else:
        cfg_v = fj.version_config(9 if version == "9e" else version, head_dim)
        mt, q_in_smem, bn, threads = cfg_v.m_tiles, cfg_v.q_in_smem, cfg_v.bn, fa.THREADS
    # per KV tile of bn keys and warp: S = Q K^T and O += P V are (bn / 8)(D / 16) MT mma each
    assert s["mma"] == 2 * (bn // 8) * (head_dim // 16) * mt, s
    # K: (bn / 8)(D / 32) ldmatrix.x4, Q: D/16 per m-tile (once, or at every tile)
    assert s["ldmatrix"] == (bn // 8) * (head_dim // 32) + (head_dim // 16) * mt, s
    # V: (bn / 16)(D / 16) ldmatrix.x4.trans (k-steps x pairs of d-tiles)
    assert s["ldmatrix_trans"] == (bn // 16) * (head_dim // 16), s
    # the pool and Q only through cp.async (Q tile, prologue tile, steady-state tile), waits
    # for Q and for each tile; no scalar shared loads of fragments
    passes = bn // (threads // (head_dim // 8))     # (the one-warp CTA's 16 passes a tile stay a loop)
    assert s["cp_async"] >= 2 * 2 * (passes if threads == fa.THREADS else 1), s
    assert s["cp_async_wait"] >= (1 if q_in_smem else 2), s
    assert s["ld_shared_scalar"] == 0, s
    # every exponential of the softmax is one ex2.approx: 2 per n-tile and row pair, + 1 rescale each
    assert s["ex2"] == mt * 2 * (2 * (bn // 8) + 1), s
    assert s["dynamic_smem_align16"] and s["st_global_v4"] >= 1, s


@pytest.fixture(scope="module")
def codegen_fast():
    with tempfile.TemporaryDirectory() as tmp:
        yield _compile(CODEGEN_FAST, tmp), tmp


@pytest.mark.parametrize("cfg", CODEGEN_FAST, ids=_name)
def test_codegen(codegen_fast, cfg):
    check_codegen(*codegen_fast, cfg)


@pytest.mark.slow
def test_codegen_other_shapes():
    with tempfile.TemporaryDirectory() as tmp:
        stats = _compile(CODEGEN_SLOW, tmp)
        for cfg in CODEGEN_SLOW:
            check_codegen(stats, tmp, cfg)


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, tolerance from torch's own attention error

GPU_SHAPES = [
    # Qwen2-0.5B layer: 14 query heads, 2 KV heads, d=64
    (14, 2, 64, 16, torch.float16, [1, 15, 17, 97, 1025, 300], [0, 16, 100, 3, 500, 0]),
    (14, 2, 64, 8, torch.bfloat16, [2048], [0]),
    (14, 2, 64, 32, torch.float16, [512] * 4, [1024, 7, 0, 333]),
    (14, 2, 64, 16, torch.float16, [256], [4096]),  # v6 splits this one by itself
    # MHA and d=128
    (8, 8, 128, 16, torch.float16, [1, 97, 640], [63, 200, 1]),
    (16, 2, 128, 32, torch.bfloat16, [255, 129], [1000, 17]),
    # Qwen2-7B layer (28/4, d=128: GQA 7 at 128 rows), and many short prompts with 1-token chunks
    (28, 4, 128, 16, torch.float16, [1, 128, 33, 500], [0, 0, 700, 20]),
    (14, 2, 64, 16, torch.float16, [128] * 40 + [1] * 10, [0] * 40 + [5] * 10),
]


def shape_id(s):
    return f"H{s[0]}-Hkv{s[1]}-d{s[2]}-bs{s[3]}-{str(s[4])[6:]}-{len(s[5])}seq"


def sdpa_error(q, k, v, bt, cu, ctx, ref):
    """max |SDPA - ref| of torch's attention in q's dtype on dense per-sequence K/V, bottom-right causal."""
    worst = 0.0
    for s in range(len(ctx)):
        lo, hi, c = int(cu[s]), int(cu[s + 1]), int(ctx[s])
        kd, vd = (torch.from_numpy(x).to(q.dtype).to(q.device) for x in gather_paged_kv(k, v, bt[s], c))  # (c, Hkv, D)
        qs = q[lo:hi].transpose(0, 1)  # (H, q_len, D)
        pos = torch.arange(c - (hi - lo), c, device=q.device)
        mask = torch.arange(c, device=q.device)[None, :] <= pos[:, None]  # (q_len, c)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, kd.transpose(0, 1), vd.transpose(0, 1), attn_mask=mask, enable_gqa=True).transpose(0, 1)
        worst = max(worst, float(np.abs(o.double().cpu().numpy() - ref[lo:hi]).max()))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
def test_gpu_vs_sdpa_error(shape):
    q, k, v, bt, cu, ctx = make_batch(*shape, seed=4)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    base = sdpa_error(q, k, v, bt, cu, ctx, ref)
    # floor: one unit in the last place of the largest output (both round their result once)
    tol = 2 * base + 2 * UNIT_ROUNDOFF[q.dtype] * float(np.abs(ref).max())
    for version, splits in [(4, None), (5, None), (6, None), (6, 2), (6, 7), (6, 16), (7, None), (7, 3), (8, None),
                           (8, 3), (9, None)]:  # v9's placements and CTA counts: test_gpu_v9_few_ctas
        out = journey.paged_prefill(q, k, v, bt, cu, ctx, version=version, splits=splits)
        torch.cuda.synchronize()
        err = check(out, ref, tol)
        print(f"v{version} splits={splits}: max err {err.max():.3g} (SDPA {base:.3g}), mean {err.mean():.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_gpu_fuzz(seed):
    rng = np.random.default_rng(100 + seed)
    num_kv_heads, group = [(2, 7), (1, 1), (2, 4), (4, 2), (2, 7), (1, 16)][seed]
    num_seqs = int(rng.integers(1, 7))
    q_lens = [int(x) for x in rng.integers(1, 400, num_seqs)]
    cached = [int(x) * int(rng.integers(0, 2)) for x in rng.integers(0, 2000, num_seqs)]
    shape = (num_kv_heads * group, num_kv_heads, [64, 128][seed % 2], [8, 16, 32][seed % 3],
             [torch.float16, torch.bfloat16][seed % 2], q_lens, cached)
    q, k, v, bt, cu, ctx = make_batch(*shape, seed=seed)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    tol = tolerance(ref, v, q.dtype)
    for version in VERSIONS:
        check(journey.paged_prefill(q, k, v, bt, cu, ctx, version=version, splits=None), ref, tol)
    check(fa.paged_prefill(q, k, v, bt, cu, ctx, splits=int(rng.integers(2, 12))), ref, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(14, 2, 64, 16, torch.float16), (28, 4, 128, 8, torch.bfloat16)], ids=str)
def test_gpu_parts_fixed_by_position(shape):
    """part_keys=256 (the batch-invariant mode) at the 0.5B and 7B head shapes: a 1,000-token prompt, its last
    300 queries as a chunk behind the cached prefix, and 9 of its queries as one-query decodes in one-warp
    CTAs under a 4,096-key bound: a row's bits the same in each; the rows of one part the unsplit launch's
    bits; within the reference's tolerance."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)     # noqa: E731
    q, k, v, bt, cu, ctx = make_batch(*shape, [1000], [0], seed=12)
    whole = fa.paged_prefill(q, k, v, bt, cu, ctx, part_keys=256)
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check(whole, ref, tolerance(ref, v, q.dtype))
    chunk = fa.paged_prefill(q[700:].contiguous(), k, v, bt, i32(0, 300), ctx, part_keys=256)
    assert torch.equal(chunk, whole[700:])
    rows = [0, 100, 255, 256, 511, 512, 700, 998, 999]
    decodes = fa.paged_prefill(q[rows].contiguous(), k, v, bt.expand(len(rows), -1).contiguous(),
                               i32(*range(len(rows) + 1)), i32(*[r + 1 for r in rows]), part_keys=256, warps=1,
                               max_context_len=4096)
    assert torch.equal(decodes, whole[rows])
    assert torch.equal(fa.paged_prefill(q, k, v, bt, cu, ctx, splits=1)[:256], whole[:256])


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [2, None])
def test_gpu_v9_in_cuda_graph(ctas):
    # v9 captures the plan and its persistent kernel; two launches on one plans dict (a step's two layers)
    # hold one plan launch
    q, k, v, bt, cu, ctx = make_batch(14, 2, 64, 16, torch.float16, [100, 7, 1, 40], [50, 0, 9, 0], seed=5)
    outs = [torch.empty_like(q) for _ in range(2)]
    journey.paged_prefill(q, k, v, bt, cu, ctx, out=outs[0], version=9, ctas=ctas)  # compile first
    torch.cuda.synchronize()
    plans = {}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            journey.paged_prefill(q, k, v, bt, cu, ctx, out=out, version=9, ctas=ctas, plans=plans)
    assert len(plans) == 1
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    for out in outs:
        check(out, ref, tolerance(ref, v, q.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("version", sorted({6, 7, 8, journey.PRODUCTION_VERSION}))
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_in_cuda_graph(splits, version):
    # v7 captures two launches (the plan, then attention), three with a split
    q, k, v, bt, cu, ctx = make_batch(14, 2, 64, 16, torch.float16, [100, 7], [50, 0], seed=5)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        journey.paged_prefill(q, k, v, bt, cu, ctx, out=out, splits=splits, version=version)  # compile first
    torch.cuda.synchronize()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        journey.paged_prefill(q, k, v, bt, cu, ctx, out=out, splits=splits, version=version)
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_prefill_attention(q, k, v, bt, cu, ctx)
    check(out, ref, tolerance(ref, v, q.dtype))


# ---------------------------------------------------------------------------------------------
# scripts/bench_prefill.py: what it counts and checks (its timings need the GPU)


def test_bench_counts_causal_flops():
    from scripts import bench_prefill as bp

    for num_seqs, cached, new in [(1, 0, 2048), (4, 1024, 512), (1, 4096, 256)]:
        keys = sum(cached + i + 1 for i in range(new))
        assert bp.causal_flops(num_seqs, cached, new) == 4 * bp.NUM_HEADS * bp.HEAD_DIM * keys * num_seqs


def test_bench_parses_variants():
    from scripts import bench_prefill as bp

    assert bp.parse_variant("v6:splits=2,stages=3") == ("v6", {"splits": 2, "stages": 3})
    assert bp.parse_variant("v5") == ("v5", {})
    assert bp.parse_variant("v9:plan=step,ctas=4,prefetch=epilogue") == ("v9", {"plan": "step", "ctas": 4,
                                                                               "prefetch": "epilogue"})
    with pytest.raises(ValueError, match="v4\\+"):
        bp.parse_variant("v3:stages=3")
    with pytest.raises(ValueError, match="overrides"):
        bp.parse_variant("v6:warps=8")


@pytest.mark.slow
def test_bench_validates_every_kernel_before_timing():
    from scripts import bench_prefill as bp

    x = bp.make_inputs(1, 20, 3, seed=0, device=DEVICE)  # a prefix ending mid-block, NaN past it
    sdpa, how = bp.sdpa_call(20, 3)
    assert how == "causal_lower_right"
    calls = {k: bp.kernel_call(k) for k in bp.KERNELS}
    calls["v6:splits=2"] = bp.kernel_call("v6", splits=2)
    calls["v9:plan=step,ctas=1"] = bp.kernel_call("v9", plan="step", ctas=1)
    errors = bp.validate(calls, x, sdpa, 1, 3)
    assert set(errors) == set(calls) | {"sdpa"}
    with pytest.raises(AssertionError, match="max err"):  # a wrong kernel stops the run
        bp.validate({"zeros": lambda x, out: out.zero_()}, x, sdpa, 1, 3)
