"""Validation layer 2: the numba decode kernels against the float64 reference.

Without a GPU (CI) every version runs in numba's CUDA simulator, one Python thread per CUDA
thread, so those shapes are tiny (a few sequences, tens of tokens) yet awkward: lengths 1, 15,
17, 33 (not multiples of the block size), shuffled block tables, every unused pool slot
poisoned with NaN (a read past a sequence's end shows up as NaN in its output), GQA and MHA,
fp16 and bf16, every supported block size and both head dims across the cases.

The slow set forces partitions on v6-v9 (v9 at its smallest and largest CTA); v9 at 4 warps runs with
PAGEDATTN_FULL_MATRIX=1 python -m pytest -m slow tests/test_paged_attention_cuda.py.

`gpu` tests (run on the H200: python -m pytest -m gpu) use real shapes, compare against torch's
own fp16/bf16 SDPA error, and replay a launch inside a CUDA graph.
"""
import math

import numpy as np
import pytest
import torch
from numba import cuda

from kernels_numba import attention_parts as parts
from kernels_numba import common, decode_journey as journey, paged_attention as pa
from kernels_numba import decode_journey_cuda_core as cuda_core
from kernels_numba import decode_journey_tensor_core as tensor_core
from helpers import capture_after_warmup, full_matrix_param
from pagedattn.errors import KernelLaunchError
from reference.attention import paged_decode_attention

HAS_GPU = torch.cuda.is_available()
VERSIONS = sorted(journey.VERSIONS)

# (name, num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens)
TINY_CASES = [
    ("gqa_f16_d64_bs8", 4, 2, 64, 8, np.float16, [1, 15, 17]),
    ("mha_bf16_d64_bs16", 2, 2, 64, 16, "bf16", [33, 16]),
    ("gqa_f16_d128_bs32", 3, 1, 128, 32, np.float16, [40]),
]


def _bf16_bits(x):
    """float32 numpy -> bf16 bits (uint16), round to nearest even (torch does the rounding)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def _bits_to_f64(bits, dtype):
    if dtype == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def make_problem(rng, num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens, spare_blocks=3):
    """A paged batch with shuffled block tables and NaN in every slot no sequence owns.

    Returns raw 16-bit arrays (q, k_cache, v_cache), block_tables, context_lens and the
    float64 reference output [num_seqs, num_heads, head_dim].
    """
    context_lens = np.asarray(context_lens, dtype=np.int32)
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-int(n) // block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column past the longest sequence
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = rng.permutation(num_blocks)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)  # padding entries: 0
    pos = 0
    nan_mask = np.ones((num_blocks, block_size), dtype=bool)  # True = nobody owns the slot
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[pos : pos + nb]
        pos += nb
        for j in range(int(context_lens[s])):
            nan_mask[block_tables[s, j // block_size], j % block_size] = False
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kv = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    for x in kv:
        x.transpose(0, 2, 1, 3)[nan_mask] = np.nan  # [NB, BS, KVH, D] view: poison whole slots
    q = rng.standard_normal((num_seqs, num_heads, head_dim)).astype(np.float32)
    if dtype == "bf16":
        q16, k16, v16 = _bf16_bits(q), _bf16_bits(kv[0]), _bf16_bits(kv[1])
    else:
        q16, k16, v16 = (x.astype(np.float16).view(np.uint16) for x in (q, kv[0], kv[1]))
    ref = paged_decode_attention(
        _bits_to_f64(q16, dtype), _bits_to_f64(k16, dtype), _bits_to_f64(v16, dtype), block_tables, context_lens
    )
    return q16, k16, v16, block_tables, context_lens, ref


def _tolerance(dtype):
    # one output rounding (half an ulp at |o| <= 1) plus fp32 accumulation noise;
    # v3's fp16/bf16 pair products add about one more input ulp to a score
    return 2.0 ** -10 if dtype == np.float16 else 2.0 ** -7


def _version_cases():
    """Every version on the first case; the other cases for v3, v8 and v10 (the ends of the journey's
    eras and the production kernel) by default, for the rest under `slow`."""
    for case in TINY_CASES:
        for version in VERSIONS:
            slow = case is not TINY_CASES[0] and version not in (3, 8, journey.PRODUCTION_VERSION)
            yield pytest.param(version, case, id=f"{case[0]}-v{version}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("version, case", _version_cases())
def test_version_matches_reference(version, case):
    _, num_heads, num_kv_heads, head_dim, block_size, dtype, lens = case
    rng = np.random.default_rng(1000 * version + len(lens))
    q16, k16, v16, block_tables, context_lens, ref = make_problem(
        rng, num_heads, num_kv_heads, head_dim, block_size, dtype, lens
    )
    out16 = np.full(q16.shape, 0x7E00, dtype=np.uint16)  # NaN bits: unwritten outputs fail
    journey.launch(version, q16, k16, v16, block_tables, context_lens, out16, is_bf16=(dtype == "bf16"))
    out = _bits_to_f64(out16, dtype)
    err = np.abs(out - ref)
    assert np.isfinite(out).all(), f"v{version}: NaN/inf in output (read past a sequence's end?)"
    assert err.max() <= _tolerance(dtype), f"v{version}: max err {err.max():.3g}, mean {err.mean():.3g}"


@pytest.mark.parametrize("version", [v if v in (4, 9) else pytest.param(v, marks=pytest.mark.slow)
                                     for v in [4, 5, 6, 7, 8, 9]])
def test_split_kv_matches_reference(monkeypatch, version):
    """Force several partitions on tiny lengths so the split + merge path runs in CI (by default the
    first split version of each era, v4 and v9; v10's splits have their own tests below)."""
    monkeypatch.setattr(cuda_core, "MIN_PARTITION", 16)
    monkeypatch.setattr(tensor_core, "V6_MIN_PARTITION", 16)
    chunk = cuda_core.v4_geometry(64, 8)[3]
    assert cuda_core.split_plan(3, 2, 48, chunk) == (3, 16)
    assert tensor_core.split_plan_waves(3, 2, 48, 32, 396)[0] == 2  # 32-token steps: 2 partitions
    rng = np.random.default_rng(7)
    q16, k16, v16, block_tables, context_lens, ref = make_problem(rng, 4, 2, 64, 8, np.float16, [1, 20, 47])
    out16 = np.full(q16.shape, 0x7E00, dtype=np.uint16)
    journey.launch(version, q16, k16, v16, block_tables, context_lens, out16, max_context_len=48)
    err = np.abs(_bits_to_f64(out16, np.float16) - ref)
    assert err.max() <= _tolerance(np.float16), f"max err {err.max():.3g}, mean {err.mean():.3g}"


# v9's CTA widths: 2 and 8 warps (the smallest ring and the largest, 96 KiB of dynamic shared memory) in the
# slow run; 4 warps, the same code between them, in the full matrix (helpers.FULL_MATRIX)
PARTITION_CASES = [pytest.param(v, w, marks=pytest.mark.slow) for v, w in [(6, 4), (7, 4), (8, 4), (9, 2), (9, 8)]]
PARTITION_CASES.insert(4, full_matrix_param(9, 4))


@pytest.mark.parametrize("version, warps", PARTITION_CASES)          # v10's splits: below
def test_partitions_match_reference(monkeypatch, version, warps):
    """v6+ cut contexts into partitions of whole CTA steps (16 tokens per warp): force 4 of them
    over lengths that end mid-partition, mid-block, on a partition edge and inside the first
    partition (v9 with CTAs of 2, 4 and 8 warps). One KV head (GQA 4): every CTA of the simulator
    costs seconds here, and a second KV head's indexing on the split path is checked by
    test_split_kv_matches_reference."""
    part = 16 * warps
    monkeypatch.setattr(tensor_core, "split_plan_waves", lambda *args, **kw: (4, part))
    monkeypatch.setattr(tensor_core, "v9_plan", lambda *args, **kw: (4, part, warps))
    rng = np.random.default_rng(11)
    lens = [1, part + 6, 3 * part + 8, 2 * part]
    q16, k16, v16, block_tables, context_lens, ref = make_problem(rng, 4, 1, 64, 16, np.float16, lens)
    out16 = np.full(q16.shape, 0x7E00, dtype=np.uint16)
    journey.launch(version, q16, k16, v16, block_tables, context_lens, out16, max_context_len=4 * part)
    err = np.abs(_bits_to_f64(out16, np.float16) - ref)
    assert np.isfinite(err).all() and err.max() <= _tolerance(np.float16), f"max err {err.max():.3g}"


def test_v9_plan_prefers_warps_to_splits():
    """About 8 warps per SM: one CTA of 2 to 8 warps per (sequence, KV head) before any split."""
    for batch, ctx, want in [(256, 512, (1, 512, 2)), (512, 512, (1, 512, 2)), (128, 2048, (1, 2048, 4)), (64, 2048, (1, 2048, 8)),
                             (32, 8192, (4, 2048, 4)), (8, 2048, (16, 128, 4)), (1, 100, (1, 128, 4))]:
        assert tensor_core.v9_plan(batch, 2, ctx, 132) == want, (batch, ctx)
    for batch, ctx in [(1, 8192), (3, 513), (7, 8191), (40, 3000), (600, 2048)]:
        splits, part, warps = tensor_core.v9_plan(batch, 2, ctx, 132)
        assert warps in (2, 4, 8) and part % (16 * warps) == 0 and (splits - 1) * part < ctx <= splits * part
        assert batch * 2 * splits * warps <= 8 * 132 or (splits == 1 and warps == 2)


def test_wave_plan_fills_whole_waves():
    slots = 3 * 132
    for batch in [32, 64, 128, 256]:
        splits, part = tensor_core.split_plan_waves(batch, 2, 8192, 32, slots)
        ctas = batch * 2 * splits
        assert ctas / (-(-ctas // slots) * slots) >= 0.9
    assert tensor_core.split_plan_waves(1, 2, 8192, 32, slots) == (64, 128)  # short partitions, many SMs
    for args in [(1, 2, 8192), (8, 2, 2048), (64, 2, 513), (3, 1, 100)]:
        splits, part = tensor_core.split_plan_waves(*args, 32, slots)
        assert part % 32 == 0 and (splits - 1) * part < args[2] <= splits * part


def test_split_plan_fills_the_gpu():
    # one long sequence: many partitions; a big batch: none
    assert cuda_core.split_plan(1, 2, 8192, 16)[0] == 8192 // cuda_core.MIN_PARTITION
    assert cuda_core.split_plan(256, 2, 512, 16)[0] == 2
    assert cuda_core.split_plan(256, 2, 256, 16)[0] == 1
    for args in [(1, 2, 8192), (8, 2, 2048), (64, 2, 513), (3, 1, 100)]:
        splits, part = cuda_core.split_plan(*args, 16)
        assert part % 16 == 0 and (splits - 1) * part < args[2] <= splits * part


# ---------------------------------------------------------------------------------------------
# v10 (production): its plan, its split-KV merges, head blocks and d=128 on the cp.async ring


def test_decode_plan_splits_small_batches_only():
    """Large batches keep v9's launch (one CTA over each whole context); 1-8 sequences are split so
    that about 8 warps per SM run, merged in the last CTA up to 16 partitions, by a kernel beyond;
    contexts of <= 512 tokens are not split; split CTAs have 4 warps for one sequence of 2 KV heads, 8 for 3 or
    more (the fastest configurations of v10's sweep in docs/kernels.md)."""
    for batch, ctx in [(256, 512), (512, 512), (128, 2048), (64, 2048), (64, 512)]:
        plan = pa.decode_plan(batch, 2, 7, ctx, 132)
        assert (plan.splits, plan.partition, plan.warps, plan.merge) == (*tensor_core.v9_plan(batch, 2, ctx, 132),
                                                                         "none")
    assert pa.decode_plan(8, 2, 7, 2048, 132) == pa.DecodePlan(8, 256, 8, 3, "fused")
    assert pa.decode_plan(32, 2, 7, 2048, 132) == pa.DecodePlan(2, 1024, 8, 3, "fused")
    assert pa.decode_plan(1, 2, 7, 2048, 132) == pa.DecodePlan(16, 128, 4, 3, "fused")
    assert pa.decode_plan(1, 2, 7, 8192, 132) == pa.DecodePlan(64, 128, 4, 3, "kernel")
    for batch, ctx in [(1, 256), (1, 512), (8, 512), (32, 512), (1, 1)]:          # short: one CTA of 8 warps
        assert pa.decode_plan(batch, 2, 7, ctx, 132) == pa.DecodePlan(1, max(ctx, 128), 8, 3, "none"), (batch, ctx)
    assert pa.decode_plan(1, 2, 7, 513, 132).splits > 1
    assert pa.decode_plan(1, 2, 7, 32768, 132).splits == parts.MAX_SPLITS
    for batch, kv_heads, group, ctx in [(1, 2, 7, 4000), (3, 2, 7, 5000), (7, 2, 7, 8191), (2, 1, 20, 1000),
                                        (1, 4, 7, 100), (40, 2, 7, 3000)]:
        plan = pa.decode_plan(batch, kv_heads, group, ctx, 132)
        step = 16 * plan.warps
        assert plan.partition % step == 0 and (plan.splits - 1) * plan.partition < ctx <= plan.splits * plan.partition
        assert plan.splits <= parts.MAX_SPLITS and plan.warps in (2, 4, 8)
        ctas = batch * kv_heads * pa.head_blocks(group)[0] * plan.splits
        assert ctas * plan.warps <= 8 * 132 or plan.splits == 1, (batch, ctx, plan)
        assert plan.merge == ("none" if plan.splits == 1 else "fused" if plan.splits <= 16 else "kernel")
    assert pa.decode_plan(8, 2, 7, 2048, 132, splits=4, warps=8, merge="kernel") == pa.DecodePlan(4, 512, 8, 3,
                                                                                                   "kernel")


def test_head_blocks_cover_the_group_in_mma_rows():
    assert pa.head_blocks(7) == (1, 7) and pa.head_blocks(16) == (1, 16)
    assert pa.head_blocks(17) == (2, 9) and pa.head_blocks(20) == (2, 10) and pa.head_blocks(40) == (3, 14)


def _as_torch(bits, dtype):
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16 if dtype == "bf16" else torch.float16)


# (name, num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens, plan, calls): lengths of 1 to
# 3 partitions (a one-partition sequence writes its output without a merge), ragged, shuffled tables
V10_SPLIT_CASES = [
    ("fused_ragged", 4, 1, 64, 16, np.float16, [1, 20, 70], pa.DecodePlan(3, 32, 2, 3, "fused"), 2),
    ("kernel_ragged", 4, 1, 64, 16, np.float16, [1, 20, 70], pa.DecodePlan(3, 32, 2, 3, "kernel"), 1),
    ("fused_20_heads_bs8", 20, 1, 64, 8, np.float16, [45, 9], pa.DecodePlan(2, 32, 2, 3, "fused"), 1),
    ("kernel_d128_bf16_bs32", 4, 1, 128, 32, "bf16", [40, 70], pa.DecodePlan(3, 32, 2, 3, "kernel"), 1),
    # the plan's 8-warp split CTAs with the fused merge, on head blocks of more than 8 rows (20 heads: 2 x 10)
    ("fused_8_warps_20_heads", 20, 1, 64, 16, np.float16, [200, 9], pa.DecodePlan(2, 128, 8, 3, "fused"), 2),
]
SLOW_V10_SPLIT_CASES = {"fused_8_warps_20_heads"}       # 23 s in the simulator: under -m slow


@pytest.mark.skipif(HAS_GPU, reason="tiny plans forced on the simulator; the gpu tests below run real ones")
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=[pytest.mark.slow] * (c[0] in SLOW_V10_SPLIT_CASES))
                                  for c in V10_SPLIT_CASES])
def test_v10_split_merges_match_reference(case):
    """Each merge on forced partitions, through the torch entry; the fused case twice: its counters
    (a persistent buffer) must be back at zero after a launch, or the second launch never merges."""
    _, num_heads, num_kv_heads, head_dim, block_size, dtype, lens, plan, calls = case
    rng = np.random.default_rng(17)
    q16, k16, v16, block_tables, context_lens, ref = make_problem(
        rng, num_heads, num_kv_heads, head_dim, block_size, dtype, lens
    )
    q, k, v = (_as_torch(x, dtype) for x in (q16, k16, v16))
    for call in range(calls):
        out = torch.full_like(q, float("nan"))
        pa.paged_attention(q, k, v, torch.from_numpy(block_tables), torch.from_numpy(context_lens), out=out,
                           max_context_len=plan.splits * plan.partition, plan=plan)
        err = np.abs(out.double().numpy() - ref)
        assert np.isfinite(err).all(), f"call {call}: NaN in the output (a merge that did not run?)"
        assert err.max() <= _tolerance(dtype), f"call {call}: max err {err.max():.3g}, mean {err.mean():.3g}"


# ---------------------------------------------------------------------------------------------
# the public entry point (torch tensors): CPU tensors are accepted only under the simulator


def _device():
    return "cuda" if HAS_GPU else "cpu"


def _torch_problem(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16,
                   num_blocks=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    bt = torch.randperm(num_blocks, generator=g)[: num_seqs * 2].reshape(num_seqs, 2).int()
    lens = torch.tensor([5, 2 * block_size][:num_seqs], dtype=torch.int32)
    return [t.to(_device()) for t in (q, k, v, bt, lens)]


def test_public_entry_matches_reference():
    q, k, v, bt, lens = _torch_problem()
    out = torch.full_like(q, float("nan"))
    res = pa.paged_attention(q, k, v, bt, lens, out=out)
    assert res is out
    ref = paged_decode_attention(q, k, v, bt, lens)
    err = np.abs(out.double().cpu().numpy() - ref)
    assert err.max() <= _tolerance(np.float16), f"max err {err.max():.3g}"


def _bad(**changes):
    q, k, v, bt, lens = _torch_problem()
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, context_lens=lens)
    args.update(changes)
    return args


BAD_ARGUMENTS = [
    ("head_dim_96", lambda: _bad(**dict(zip(["q", "k_cache", "v_cache", "block_tables", "context_lens"],
                                            _torch_problem(head_dim=96))))),
    ("block_size_64", lambda: _bad(**dict(zip(["q", "k_cache", "v_cache", "block_tables", "context_lens"],
                                              _torch_problem(block_size=64))))),
    ("float32", lambda: _bad(**dict(zip(["q", "k_cache", "v_cache", "block_tables", "context_lens"],
                                        _torch_problem(dtype=torch.float32))))),
    ("heads_not_multiple", lambda: _bad(q=torch.zeros(2, 3, 64, dtype=torch.float16, device=_device()))),
    ("q_dtype_mismatch", lambda: _bad(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16, device=_device()))),
    ("block_tables_int64", lambda: _bad(block_tables=torch.zeros(2, 2, dtype=torch.int64, device=_device()))),
    ("context_lens_wrong_len", lambda: _bad(context_lens=torch.ones(3, dtype=torch.int32, device=_device()))),
    ("block_id_out_of_pool", lambda: _bad(block_tables=torch.tensor([[0, 1], [2, 8]], dtype=torch.int32,
                                                                     device=_device()))),
    ("negative_block_id", lambda: _bad(block_tables=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32,
                                                                  device=_device()))),
    ("context_len_zero", lambda: _bad(context_lens=torch.tensor([0, 3], dtype=torch.int32, device=_device()))),
    ("context_too_long", lambda: _bad(context_lens=torch.tensor([33, 3], dtype=torch.int32, device=_device()))),
    ("not_contiguous", lambda: _bad(q=torch.zeros(4, 2, 64, dtype=torch.float16, device=_device()).transpose(0, 1))),
]


@pytest.mark.parametrize("make_args", [b[1] for b in BAD_ARGUMENTS], ids=[b[0] for b in BAD_ARGUMENTS])
def test_bad_arguments_raise_before_launch(make_args):
    with pytest.raises(KernelLaunchError):
        pa.paged_attention(**make_args())


def test_unknown_version_raises_before_launch():
    with pytest.raises(KernelLaunchError, match="version=11"):
        journey.paged_attention(**_bad(), version=max(journey.VERSIONS) + 1)


def test_unused_table_entries_are_not_validated():
    # only the blocks a sequence reads must be in the pool: padding past its end may hold anything
    q, k, v, bt, lens = _torch_problem()
    bt = bt.clone()
    bt[0, 1] = 10_000  # sequence 0 has 5 tokens: one block
    journey.paged_attention(q, k, v, bt, lens, version=1)


# ---------------------------------------------------------------------------------------------
# the simulator shim and the common helpers (their numpy fallbacks are what CI runs)

def _shuffle_kernel(x, out):
    t = cuda.threadIdx.x
    v = x[t]
    out[0, t] = cuda.shfl_sync(0xFFFFFFFF, v, 5)
    out[1, t] = cuda.shfl_up_sync(0xFFFFFFFF, v, 3)
    out[2, t] = cuda.shfl_down_sync(0xFFFFFFFF, v, 3)
    out[3, t] = cuda.shfl_xor_sync(0xFFFFFFFF, v, 6)
    cuda.syncwarp(0xFFFFFFFF)


@pytest.mark.skipif(not common.SIMULATOR, reason="checks the simulator shim")
@pytest.mark.parametrize("threads", [64, 48])
def test_simulator_shuffles_follow_ptx_semantics(threads):
    kernel = cuda.jit(_shuffle_kernel)
    x = np.arange(100, 100 + threads, dtype=np.int32)
    out = np.zeros((4, threads), dtype=np.int32)
    kernel[1, threads](x, out)
    for t in range(threads):
        lane, base, width = t % 32, t - t % 32, min(32, threads - (t - t % 32))

        def src(lane_src):
            return x[base + lane_src] if lane_src < width else x[t]

        assert out[0, t] == src(5)
        assert out[1, t] == (src(lane - 3) if lane >= 3 else x[t])
        assert out[2, t] == (src(lane + 3) if lane + 3 < 32 else x[t])
        assert out[3, t] == src(lane ^ 6)


def _barrier_kernel(out, counts, exit_after):
    """Each round, every live thread writes its id into one slot and reads its neighbour's after a
    syncthreads; threads >= exit_after return after round 0 (the rest keep meeting without them)."""
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf = cuda.shared.array(64, dtype=np.int32)
    for r in range(3):
        if r == 1 and t >= exit_after:
            return
        buf[t] = 100 * r + t
        cuda.syncthreads()
        out[r, t] = buf[(t + 1) % min(n, exit_after if r else n)]
        cuda.syncthreads()
    counts[cuda.blockIdx.x, t] = cuda.syncthreads_count(t % 3 == 0)


def _failing_kernel(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 37:
        raise ValueError("lane 37 fails")
    v = cuda.shfl_down_sync(0xFFFFFFFF, t, 1)   # lane 37's warp never completes this shuffle
    cuda.syncthreads()
    out[t] = v


@pytest.mark.skipif(not common.SIMULATOR, reason="checks the simulator's block scheduler")
def test_simulator_block_scheduler_syncs_live_threads_and_raises():
    """syncthreads releases when every live thread waits (returned threads do not take part), the
    block-wide counts see every thread, and a thread's exception aborts the block and reaches the caller
    (not a hang: lane 37's warp-mates wait in a shuffle it never reaches)."""
    kernel = cuda.jit(_barrier_kernel)
    out = np.full((3, 64), -1, dtype=np.int32)
    counts = np.zeros((2, 64), dtype=np.int32)
    kernel[2, 64](out, counts, 40)
    t = np.arange(64)
    assert (out[0] == (t + 1) % 64).all()
    for r in (1, 2):
        assert (out[r, :40] == 100 * r + (t[:40] + 1) % 40).all()
        assert (out[r, 40:] == -1).all()
    assert (counts[:, :40] == np.count_nonzero(np.arange(40) % 3 == 0)).all()
    with pytest.raises(ValueError, match="lane 37 fails"):
        cuda.jit(_failing_kernel)[1, 64](np.zeros(64, dtype=np.int32))


@pytest.mark.skipif(not common.SIMULATOR, reason="the helpers are device intrinsics off the simulator")
def test_pair_helpers_round_trip():
    vals = np.array([1.5, -2.25, 0.1, 65504.0, -1e-3, 3.0], dtype=np.float32)
    for a, b in zip(vals[::2], vals[1::2]):
        lo, hi = common.f16x2_to_f32(common.f32x2_to_f16x2(a, b))
        assert (lo, hi) == (np.float32(np.float16(a)), np.float32(np.float16(b)))
        lo, hi = common.bf16x2_to_f32(common.f32x2_to_bf16x2(a, b))
        expect = torch.tensor([a, b]).bfloat16().float().numpy()
        assert (lo, hi) == tuple(expect)
    r = common.fma_f16x2(common.f32x2_to_f16x2(1.5, -2.0), common.f32x2_to_f16x2(2.0, 0.25),
                         common.f32x2_to_f16x2(0.5, 1.0))
    assert common.f16x2_to_f32(r) == (3.5, 0.5)


@pytest.mark.skipif(not common.SIMULATOR, reason="the simulator fallbacks of the cp.async / bit-cast helpers")
def test_async_copy_and_bit_cast_fallbacks():
    # v8 relies on: a 16-byte copy of words j..j+3 into i..i+4, visible after the wait; f32 bits
    src = np.arange(16, dtype=np.uint32) * 7
    dst = np.zeros(8, dtype=np.uint32)
    common.cp_async16(dst, 4, src, 8)
    common.cp_async_commit()
    common.cp_async_wait(0)()
    assert dst.tolist() == [0, 0, 0, 0, 56, 63, 70, 77]
    for x in (1.0, -0.0, 3.5e-8, np.inf):
        bits = common.f32_bits(np.float32(x))
        assert bits == np.array([x], dtype=np.float32).view(np.uint32)[0]
        assert common.f32_from_bits(bits) == np.float32(x)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes

# (num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
GPU_CASES = [
    (8, 14, 2, 64, 16, torch.float16),
    (5, 14, 2, 128, 8, torch.float16),
    (6, 8, 8, 128, 32, torch.bfloat16),
    (3, 4, 4, 64, 16, torch.bfloat16),
    (2, 16, 2, 64, 32, torch.float16),
]


def _sdpa_error(q, k, v, bt, lens, ref):
    """Max error of torch's own SDPA (same dtype, dense gathered K/V) vs the float64 reference."""
    from pagedattn.kv_cache import gather_kv

    worst = 0.0
    for s in range(q.shape[0]):
        kk, vv = gather_kv(k, v, bt[s], int(lens[s]))  # (L, KVH, D)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s][None, :, None, :], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], enable_gqa=True
        )[0, :, 0]
        worst = max(worst, float(np.abs(o.double().cpu().numpy() - ref[s]).max()))
    return worst


def _gpu_problem(seed, num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, lens=None):
    """A shuffled, NaN-poisoned paged batch on the GPU: q, k, v, block tables, context lengths
    (random in [1, 1500) with 1 and 1025 among them, unless `lens` gives them)."""
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(1, 1500, (num_seqs,), generator=g)
        lens[0] = 1
        if num_seqs > 2:
            lens[1] = 1025
    lens = torch.as_tensor(lens)
    nblk = [-(-int(n) // block_size) for n in lens]
    max_blocks = max(nblk) + 2
    num_blocks = sum(nblk) + 5
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    pos = 0
    for s, nb in enumerate(nblk):
        bt[s, :nb] = perm[pos : pos + nb]
        pos += nb
        j = torch.arange(int(lens[s]))
        owned[bt[s, j // block_size].long(), j % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    for x in (k, v):
        x.transpose(1, 2)[~owned] = float("nan")
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    q, k, v = (x.to(dtype).cuda() for x in (q, k, v))
    return q, k, v, bt.cuda(), lens.int().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"S{c[0]}_H{c[1]}_{c[2]}_d{c[3]}_bs{c[4]}_{str(c[5])[6:]}"
                                                 for c in GPU_CASES])
def test_gpu_version_within_twice_sdpa_error(version, case):
    q, k, v, bt, lens = _gpu_problem(version * 100 + case[0], *case)
    ref = paged_decode_attention(q, k, v, bt, lens)
    sdpa_err = _sdpa_error(q, k, v, bt, lens, ref)
    out = torch.full_like(q, float("nan"))
    journey.paged_attention(q, k, v, bt, lens, version=version, out=out)
    torch.cuda.synchronize()
    err = np.abs(out.double().cpu().numpy() - ref)
    # floor: a quarter of an output ulp at |o| = 0.5, in case SDPA happens to round luckily
    floor = 0.25 * (2.0 ** -11 if case[5] == torch.float16 else 2.0 ** -8)
    assert np.isfinite(err).all()
    assert err.max() <= 2 * sdpa_err + floor, (
        f"v{version}: max err {err.max():.3g} (mean {err.mean():.3g}) vs SDPA {sdpa_err:.3g}"
    )


@pytest.mark.gpu
def test_gpu_launch_replays_in_cuda_graph():
    q, k, v, bt, lens = _gpu_problem(3, 8, 14, 2, 64, 16, torch.float16)
    out = torch.empty_like(q)
    graph = capture_after_warmup(lambda: pa.paged_attention(q, k, v, bt, lens, out=out))
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention(q, k, v, bt, lens)
        err = np.abs(out.double().cpu().numpy() - ref).max()
        assert err <= 2.0 ** -10, f"replay {seed}: max err {err:.3g}"


@pytest.mark.gpu
def test_gpu_long_single_sequence_uses_splits():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 14, 64, generator=g).half().cuda()
    n = 8192
    k2 = torch.randn(n // 16 + 1, 2, 16, 64, generator=g).half().cuda()
    v2 = torch.randn(n // 16 + 1, 2, 16, 64, generator=g).half().cuda()
    bt2 = torch.randperm(n // 16 + 1, generator=g)[: n // 16][None].int().cuda()
    lens2 = torch.tensor([n - 3], dtype=torch.int32, device="cuda")
    assert pa.decode_plan(1, 2, 7, n, 132).splits > 1
    out = pa.paged_attention(q, k2, v2, bt2, lens2)
    ref = paged_decode_attention(q, k2, v2, bt2, lens2)
    err = np.abs(out.double().cpu().numpy() - ref).max()
    assert math.isfinite(err) and err <= 2.0 ** -11, f"max err {err:.3g}"


RAGGED = [8000, 300, 1200, 17, 4097, 1]
# (name, context lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, merge forced or None)
V10_GPU_CASES = [
    ("1x32768", [32768], 14, 2, 64, 16, torch.float16, None),
    ("ragged_fused", RAGGED, 14, 2, 64, 16, torch.float16, "fused"),
    ("ragged_kernel", RAGGED, 14, 2, 64, 16, torch.float16, "kernel"),
    ("d128_g7_bf16_bs8", [3000, 1025, 77], 28, 4, 128, 8, torch.bfloat16, None),
    ("g20_bs32", [2048, 5], 40, 2, 64, 32, torch.float16, "kernel"),
    ("g16_d128_bs32", [513, 4000], 32, 2, 128, 32, torch.float16, "fused"),
    # 8-warp split CTAs (3 sequences x 2 KV heads x 2 head blocks: a share of 64 warps) and the fused merge on
    # head blocks of 10 rows, at d=64 and d=128
    ("g20_8warps_fused", [3000, 700, 5], 40, 2, 64, 16, torch.float16, None),
    ("g20_d128_8warps_fused", [3000, 700, 5], 40, 2, 128, 16, torch.bfloat16, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", V10_GPU_CASES, ids=[c[0] for c in V10_GPU_CASES])
def test_gpu_v10_plans_within_twice_sdpa_error(case):
    """v10 at real shapes, its own plan or its split plan with the merge forced each way."""
    name, lens, num_heads, num_kv_heads, head_dim, block_size, dtype, merge = case
    q, k, v, bt, ctx = _gpu_problem(len(name), len(lens), num_heads, num_kv_heads, head_dim, block_size, dtype, lens)
    ref = paged_decode_attention(q, k, v, bt, ctx)
    sdpa_err = _sdpa_error(q, k, v, bt, ctx, ref)
    plan = None
    if merge is not None:
        plan = pa.decode_plan(len(lens), num_kv_heads, num_heads // num_kv_heads, max(lens), 132, merge=merge)
        assert plan.splits > 1, plan
    if "8warps" in name:                        # the case is there for this plan: make sure it still gets it
        own = pa.decode_plan(len(lens), num_kv_heads, num_heads // num_kv_heads, max(lens), 132)
        assert (own.warps, own.merge) == (8, "fused") and own.splits > 1, own
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(q, k, v, bt, ctx, out=out, max_context_len=max(lens), plan=plan)
    torch.cuda.synchronize()
    err = np.abs(out.double().cpu().numpy() - ref)
    floor = 0.25 * (2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8)
    assert np.isfinite(err).all() and err.max() <= 2 * sdpa_err + floor, (
        f"{name}: max err {err.max():.3g} (mean {err.mean():.3g}) vs SDPA {sdpa_err:.3g}"
    )


@pytest.mark.gpu
def test_gpu_zero_scratch_made_on_one_stream_serves_a_capture_on_another():
    """The fused merge's counters must start at zero, so they are made (zeroed) outside any capture: a launch
    on the default stream makes them, and a graph captured on another stream (7 sequences: a counters shape no
    other test makes) finds them there and replays the launch's output, twice."""
    q, k, v, bt, lens = _gpu_problem(11, 7, 14, 2, 64, 16, torch.float16, [5000, 70, 2048, 3333, 900, 4100, 17])
    plan = pa.decode_plan(7, 2, 7, 5000, 132, merge="fused")
    assert plan.splits > 1
    eager = torch.empty_like(q)
    pa.paged_attention(q, k, v, bt, lens, out=eager, max_context_len=5000, plan=plan)   # the default stream only
    torch.cuda.synchronize()
    out = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        pa.paged_attention(q, k, v, bt, lens, out=out, max_context_len=5000, plan=plan)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["fused", "kernel"])
def test_gpu_v10_split_replays_in_cuda_graph(merge):
    """A captured split launch replayed with new queries: the fused merge's counters reset inside
    the kernel, the merge kernel's records are rewritten each replay."""
    q, k, v, bt, lens = _gpu_problem(9, 4, 14, 2, 64, 16, torch.float16, [5000, 70, 2048, 3333])
    plan = pa.decode_plan(4, 2, 7, 5000, 132, merge=merge)
    assert plan.splits > 1
    out = torch.empty_like(q)
    graph = capture_after_warmup(lambda: pa.paged_attention(q, k, v, bt, lens, out=out, max_context_len=5000,
                                                            plan=plan))
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = np.abs(out.double().cpu().numpy() - paged_decode_attention(q, k, v, bt, lens)).max()
        assert err <= 2.0 ** -10, f"replay {seed}: max err {err:.3g}"
