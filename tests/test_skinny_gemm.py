"""The skinny decode GEMM (kernels_numba/skinny_gemm.py) against reference/skinny.py.

Without a GPU the kernels run in numba's CUDA simulator (tests/conftest.py): every lane's 16-byte loads,
the staged activation rows, the mma fragments (emulated from every lane's registers), split-K's partials
and the second pass, on small ragged shapes (M in {1, 3, 16}; N not a multiple of the 16-row tile; K not a
multiple of the 32-k step; several K splits). The `gpu` tests run Qwen2-0.5B's and 7B's shapes against
torch and check that replays give the same bits.

Tolerance: the product's reference is float64; the kernel sums K products in float32 on the tensor cores in
its own order, an error of at most about K * 2^-23 * sum_k |x_k w_k| (the scale reference/skinny.py returns;
2^-23: the tensor cores may truncate instead of round), and then rounds once to the output dtype: so
|got - want| <= 1 unit in the last place of want + K 2^-23 scale. A missing or doubled term, a swapped
half or a wrong row moves an output by about one |x_k w_k| ~ scale / K, hundreds of times that bound.
The fused epilogues round where the unfused path rounds, so given the kernel's own plain output they are
checked against the unfused ops applied to it: the residual add exactly, SiLU-and-mul within one unit
(expf's last bit).
"""
import json
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from helpers import capture_after_warmup, compile_in_subprocesses
from kernels_numba import skinny_gemm as sg
from pagedattn.errors import KernelLaunchError
from reference import layers as ref_layers
from reference import skinny as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: numba's CUDA simulator (conftest)
NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TINY = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}
F32_SUM = 2.0 ** -23                      # per term of a float32 sum (rounding or truncation)

SLOW = pytest.mark.slow
F16, BF16 = torch.float16, torch.bfloat16

# (dtype, M, N, K, steps_per_split): N = 40 is 2.5 tiles; K = 72 ends inside a 32-k step; K = 136 is 5
# steps: 2 splits of 4; K = 264 is 9 steps: 3 splits of 4, or one split of 12 (the last step and the
# unrolled steps past it are masked). The default run takes one dtype per case, `slow` the other.
PLAIN_CASES = [(F16, 3, 40, 72, None), (BF16, 1, 40, 72, None), (BF16, 16, 24, 136, 4),
               pytest.param(F16, 16, 24, 264, 4, marks=SLOW), pytest.param(F16, 3, 24, 264, 12, marks=SLOW),
               pytest.param(BF16, 3, 24, 264, 12, marks=SLOW), pytest.param(F16, 1, 40, 72, None, marks=SLOW)]


def randn(*shape, seed=0, scale=1.0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def assert_close(got, want, scale, K, dtype, what, ulps=1):
    """|got - want| <= ulps units in the last place of want + the float32 summation bound K 2^-23 scale."""
    got = got.double().cpu().numpy()
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    bound = ulps * ULP[dtype] * np.abs(want) + TINY[dtype] + K * F32_SUM * np.asarray(scale)
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} outside the bound; max err {err.max():.3e}, "
                           f"mean err {err.mean():.3e}, worst (index, got, want): "
                           f"{[(tuple(i), got[tuple(i)], want[tuple(i)]) for i in np.argwhere(bad)[:4]]}")


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def case(M, N, K, dtype, seed=1):
    """x [M, K] and a weight [N, K] with the scale of a trained layer's (dot products of order 1)."""
    return randn(M, K, seed=seed, dtype=dtype), randn(N, K, seed=seed + 1, scale=K ** -0.5, dtype=dtype)


# ---- the plain GEMM ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, M, N, K, sps", PLAIN_CASES)
def test_plain_gemm_matches_float64(dtype, M, N, K, sps):
    x, w = case(M, N, K, dtype)
    y = sg.skinny_linear(x, w, steps_per_split=sps)
    want, scale = ref.linear(x, w, NAME[dtype])
    assert y.shape == (M, N) and y.dtype == dtype
    assert_close(y, want, scale, K, dtype, f"y, plan {sg.plan(M, N, K, steps_per_split=sps)}")


# v2: (dtype, M, N, K, kwarps): K = 520 is 65 pieces, 5 chunks of 128 k, the last one a single piece: with
# 4 warps warp 0 takes chunks 0 and 4 (its prefetch past the end loads nothing). K = 1096 is 9 chunks, the
# last 9 pieces long: 8 warps, warp 0 with chunks 0 and 8; 16 warps, 7 of them with no chunk at all.
V2_CASES = [(BF16, 16, 16, 520, 4), pytest.param(F16, 1, 40, 1096, 8, marks=SLOW),
            pytest.param(F16, 5, 40, 264, 4, marks=SLOW), pytest.param(BF16, 3, 24, 1096, 16, marks=SLOW)]


@pytest.mark.parametrize("dtype, M, N, K, kwarps", V2_CASES)
def test_v2_warps_share_k(dtype, M, N, K, kwarps):
    """v2: the tile's warps each sum their own chunks, added in warp order through shared memory."""
    x, w = case(M, N, K, dtype, seed=41)
    y = sg.skinny_linear(x, w, variant=2, warps_per_tile=kwarps)
    want, scale = ref.linear(x, w, NAME[dtype])
    assert_close(y, want, scale, K, dtype, f"v2 with {kwarps} warps per tile")


def test_v2_is_the_default_and_v1_stays_reachable():
    """Both variants within the bound of the same reference; v1's split options pick v1 (variant 2 refuses
    them), the norm prologue does not."""
    M, N, K = 3, 24, 72
    x, w = case(M, N, K, F16, seed=42)
    want, scale = ref.linear(x, w, "float16")
    for variant in sg.VARIANTS:
        assert_close(sg.skinny_linear(x, w, variant=variant), want, scale, K, F16, f"variant {variant}")
    for kw in ({"steps_per_split": 4}, {"reduce": "kernel"}):
        with pytest.raises(KernelLaunchError, match="variant 2 has no"):
            sg.skinny_linear(x, w, variant=2, **kw)
    gamma = randn(K, seed=43)
    assert same_bits(sg.skinny_linear(x, w, norm_weight=gamma, eps=1e-6),
                     sg.skinny_linear(x, w, norm_weight=gamma, eps=1e-6, variant=2))


def test_strided_rows_of_x():
    """x read as rows of a wider buffer (e.g. a slice of a merged output)."""
    wide = randn(3, 80, seed=3)
    x, w = wide[:, :72], randn(40, 72, seed=4, scale=72 ** -0.5)
    want, scale = ref.linear(x, w, "float16")
    assert_close(sg.skinny_linear(x, w), want, scale, 72, torch.float16, "strided x")


# ---- epilogues -------------------------------------------------------------------------------------
# (dtype, K, steps_per_split): 2 splits (the second pass applies the epilogue) or 1 (the warp does)
EPILOGUE_CASES = [(F16, 136, 4), (BF16, 72, None), pytest.param(BF16, 136, 4, marks=SLOW),
                  pytest.param(F16, 72, None, marks=SLOW)]


@pytest.mark.parametrize("dtype, K, sps", EPILOGUE_CASES)
def test_bias_epilogue(dtype, K, sps):
    M, N = 3, 40
    x, w = case(M, N, K, dtype, seed=5)
    bias = randn(N, seed=7, dtype=dtype)
    want, scale = ref.linear(x, w, NAME[dtype], bias=bias)
    y = sg.skinny_linear(x, w, bias, steps_per_split=sps)
    assert_close(y, want, scale, K, dtype, "y + bias")
    if sps is not None:   # split-K: the second kernel adds the same partials in the same order
        assert same_bits(sg.skinny_linear(x, w, bias, steps_per_split=sps, reduce="kernel"), y)


@pytest.mark.parametrize("dtype, K, sps", [
    (BF16, 72, None), pytest.param(F16, 136, 4, marks=SLOW), pytest.param(BF16, 136, 4, marks=SLOW),
    pytest.param(F16, 72, None, marks=SLOW)])
def test_residual_epilogue_rounds_like_the_unfused_add(dtype, K, sps):
    """round(round(acc) + r): the plain kernel's output plus r, rounded once, bit for bit; out may be r."""
    M, N = 3, 40
    x, w = case(M, N, K, dtype, seed=8)
    r = randn(M, N, seed=9, scale=4.0, dtype=dtype)
    plain = sg.skinny_linear(x, w, steps_per_split=sps)
    want = ref_layers.round_to(ref_layers._f32(plain) + ref_layers._f32(r), NAME[dtype])
    got = sg.skinny_linear(x, w, residual=r.clone(), steps_per_split=sps)
    assert np.array_equal(got.float().cpu().numpy(), want)
    in_place = r.clone()
    reduce = "kernel" if sps is not None else "warp"             # split-K: the second kernel's epilogue too
    assert sg.skinny_linear(x, w, residual=in_place, out=in_place, steps_per_split=sps, reduce=reduce) is in_place
    assert np.array_equal(in_place.float().cpu().numpy(), want)


@pytest.mark.parametrize("dtype, M, inter, K, sps", [
    (BF16, 3, 20, 72, None), pytest.param(F16, 3, 20, 72, None, marks=SLOW),
    pytest.param(F16, 16, 12, 264, 4, marks=SLOW), pytest.param(BF16, 16, 12, 136, 4, marks=SLOW)])
@pytest.mark.filterwarnings("ignore:overflow encountered")       # the simulator's exp of a large -g
def test_silu_epilogue(dtype, M, inter, K, sps):
    """weight = [gate; up]: against float64 with the unfused roundings, and against silu_and_mul's
    reference applied to the plain kernel's own [M, 2 I] output (the same sums: within expf's last bit)."""
    x, w = case(M, 2 * inter, K, dtype, seed=10)
    got = sg.skinny_linear(x, w, silu=True, steps_per_split=sps)
    assert got.shape == (M, inter)
    plain = sg.skinny_linear(x, w, steps_per_split=sps)
    chained = ref_layers.silu_and_mul(plain, NAME[dtype])
    if sps is not None:
        assert same_bits(sg.skinny_linear(x, w, silu=True, steps_per_split=sps, reduce="kernel"), got)
    g = plain[:, :inter].double().cpu().numpy()
    err = np.abs(got.double().cpu().numpy() - chained)
    assert (err <= ULP[dtype] * np.abs(chained) + TINY[dtype]).all(), f"vs the unfused chain: max err {err.max()}"
    want, scale_g, scale_u = ref.silu_mul_linear(x, w, NAME[dtype])
    # a gate one unit off (summation order) moves silu(g) * up by |silu'(g) up| units of g
    slack = (ULP[dtype] * np.abs(g) + K * F32_SUM * scale_g) * 1.1 * np.abs(ref_layers._f32(plain[:, inter:]))
    assert_close(got, want, scale_u + slack / (K * F32_SUM), K, dtype, "silu(gate) * up", ulps=2)


# ---- RMSNorm prologue ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, add, M, N, K, sps", [
    (F16, True, 3, 40, 136, 4), (BF16, False, 16, 24, 72, None),
    pytest.param(BF16, True, 3, 40, 264, 4, marks=SLOW), pytest.param(F16, False, 3, 40, 264, 4, marks=SLOW),
    pytest.param(BF16, True, 16, 24, 72, None, marks=SLOW), pytest.param(F16, False, 16, 24, 72, None, marks=SLOW)])
def test_norm_prologue(dtype, add, M, N, K, sps):
    """Every CTA norms its rows (the sum of squares over all K, its own K range staged); with add, the new
    residual (one exact rounding) is stored once over all of K."""
    x, w = case(M, N, K, dtype, seed=11)
    gamma = (1 + randn(K, seed=12, scale=0.1, dtype=torch.float32)).to(dtype)
    r = randn(M, K, seed=13, scale=3.0, dtype=dtype) if add else None
    r_out = torch.full((M, K), float("nan"), dtype=dtype, device=DEVICE) if add else None
    bias = randn(N, seed=14, dtype=dtype)
    got = sg.skinny_linear(x, w, bias, norm_weight=gamma, eps=1e-6, norm_residual=r, residual_out=r_out,
                           steps_per_split=sps)
    want, scale, normed, new_res = ref.norm_linear(x, gamma, 1e-6, w, NAME[dtype], norm_residual=r, bias=bias)
    # the kernel's normed x may be one unit off the reference's (its own order of the sum of squares)
    scale_x = ref.gemm(ULP[dtype] * np.abs(normed), w)[1]
    assert_close(got, want, scale + scale_x / (K * F32_SUM), K, dtype, "norm then linear")
    if add:
        assert np.array_equal(r_out.float().cpu().numpy(), new_res), "residual_out is round(residual + x)"


def norm_inputs(M, K, dtype, add, seed):
    """The prologue's inputs: gamma ~ 1 +- 0.1 (a trained norm's), the residual stream at 3x x's scale, and
    residual_out poisoned with NaN (every element must be written)."""
    gamma = (1 + randn(K, seed=seed, scale=0.1, dtype=torch.float32)).to(dtype)
    r = randn(M, K, seed=seed + 1, scale=3.0, dtype=dtype) if add else None
    r_out = torch.full((M, K), float("nan"), dtype=dtype, device=DEVICE) if add else None
    return gamma, r, r_out


# v2's prologue: the rows' 1 / rms by the whole CTA, R = 1..16 (>= M) groups of G = 32 kwarps / R threads.
# (dtype, add, M, N, K, kwarps, epilogue): M = 3, 4 warps: G = 32, K = 264 is 33 pieces (thread 0 of a row
# sums 2, the others 1); M = 16: G = 8 (a row's threads share a warp), 17 pieces (up to 3 a thread), two mma
# groups; M = 5, 8 warps: G = 32, 137 pieces (5 a thread: a second pass of 4 loads ahead); M = 1, 16 warps:
# G = 512 (a row over 16 warps, their sums through shared memory), the last chunk of 9 pieces; M = 9, 16
# warps: R = 16, G = 32, two groups.
V2_NORM_CASES = [(F16, True, 3, 24, 264, 4, "resid"), (BF16, False, 16, 12, 136, 4, "silu"),
                 pytest.param(BF16, True, 5, 24, 1096, 8, "bias", marks=SLOW),
                 pytest.param(F16, False, 1, 16, 1096, 16, None, marks=SLOW),
                 pytest.param(BF16, True, 9, 12, 264, 16, "silu", marks=SLOW),
                 pytest.param(F16, True, 16, 24, 136, 4, "bias", marks=SLOW),
                 pytest.param(BF16, False, 3, 40, 520, 4, "resid", marks=SLOW)]


@pytest.mark.parametrize("dtype, add, M, N, K, kwarps, epilogue", V2_NORM_CASES)
@pytest.mark.filterwarnings("ignore:overflow encountered")       # the simulator's exp of a large -g
def test_v2_norm_prologue(dtype, add, M, N, K, kwarps, epilogue):
    """v2 with the prologue: the plain product (with the bias where the case has one) within v1's prologue
    bound of float64 applied to reference/layers.py's norm; residual_out exactly round(residual + x); the
    residual and SiLU epilogues against the unfused ops applied to that plain output (as for the plain
    kernel: bit for bit, and within expf's last bit)."""
    silu = epilogue == "silu"
    rows = 2 * N if silu else N                                  # silu: N is the intermediate size
    x, w = case(M, rows, K, dtype, seed=51)
    gamma, r, r_out = norm_inputs(M, K, dtype, add, seed=52)
    bias = randn(rows, seed=54, dtype=dtype) if epilogue == "bias" else None
    kw = dict(norm_weight=gamma, eps=1e-6, norm_residual=r, residual_out=r_out, variant=2, warps_per_tile=kwarps)
    plain = sg.skinny_linear(x, w, bias, **kw)
    want, scale, normed, new_res = ref.norm_linear(x, gamma, 1e-6, w, NAME[dtype], norm_residual=r, bias=bias)
    # the kernel's normed x may be one unit off the reference's (its own order of the sum of squares)
    scale_x = ref.gemm(ULP[dtype] * np.abs(normed), w)[1]
    assert_close(plain, want, scale + scale_x / (K * F32_SUM), K, dtype, f"v2: norm then linear ({kwarps} warps)")
    if add:
        assert np.array_equal(r_out.float().cpu().numpy(), new_res), "residual_out is round(residual + x)"
    if epilogue == "resid":
        res = randn(M, N, seed=55, scale=4.0, dtype=dtype)
        got = sg.skinny_linear(x, w, residual=res.clone(), **kw)
        want = ref_layers.round_to(ref_layers._f32(plain) + ref_layers._f32(res), NAME[dtype])
        assert np.array_equal(got.float().cpu().numpy(), want), "norm, linear, residual add"
    elif silu:
        got = sg.skinny_linear(x, w, silu=True, **kw)
        chained = ref_layers.silu_and_mul(plain, NAME[dtype])
        err = np.abs(got.double().cpu().numpy() - chained)
        assert (err <= ULP[dtype] * np.abs(chained) + TINY[dtype]).all(), f"vs the unfused chain: max err {err.max()}"


# (dtype, add, M, N, K, kwarps, epilogue) where every prologue thread sums at most one piece (K / 8 <= G):
# M = 1, 4 warps: G = 128, 33 pieces (4 warps' sums in shared memory); M = 3: G = 32, 17 pieces;
# M = 16: G = 8, 8 pieces
V2_NORM_CHAIN_CASES = [(BF16, True, 1, 24, 264, 4, "bias"),
                       pytest.param(F16, False, 3, 12, 136, 4, "silu", marks=SLOW),
                       pytest.param(F16, True, 16, 40, 64, 4, "resid", marks=SLOW)]


@pytest.mark.parametrize("dtype, add, M, N, K, kwarps, epilogue", V2_NORM_CHAIN_CASES)
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_v2_norm_prologue_is_rmsnorm_then_v2_bit_for_bit(dtype, add, M, N, K, kwarps, epilogue):
    """With at most one piece a thread the prologue's sum of squares is rmsnorm.py's, in its order: then the
    fused call gives the bits of kernels_numba/rmsnorm.py's kernel followed by the plain v2 GEMM (same
    epilogue), and residual_out the bits of its fused residual add."""
    from kernels_numba import rmsnorm

    silu = epilogue == "silu"
    rows = 2 * N if silu else N
    x, w = case(M, rows, K, dtype, seed=61)
    gamma, r, r_out = norm_inputs(M, K, dtype, add, seed=62)
    bias = randn(rows, seed=64, dtype=dtype) if epilogue == "bias" else None
    res = randn(M, N, seed=65, scale=4.0, dtype=dtype) if epilogue == "resid" else None
    fused = sg.skinny_linear(x, w, bias, residual=None if res is None else res.clone(), silu=silu, norm_weight=gamma,
                             eps=1e-6, norm_residual=r, residual_out=r_out, variant=2, warps_per_tile=kwarps)
    if add:
        stream = r.clone()
        normed, _ = rmsnorm.fused_add_rms_norm(x, stream, gamma, 1e-6)
        assert same_bits(r_out, stream), "residual_out"
    else:
        normed = rmsnorm.rms_norm(x, gamma, 1e-6)
    chained = sg.skinny_linear(normed, w, bias, residual=res, silu=silu, variant=2, warps_per_tile=kwarps)
    assert same_bits(fused, chained), f"max diff {(fused.double() - chained.double()).abs().max().item():.3e}"


# ---- the plan and the checks -----------------------------------------------------------------------
QWEN_SHAPES = {  # (N, K, silu) of Qwen2-0.5B's and 7B's decode GEMMs
    "0.5B qkv": (1152, 896, False), "0.5B o": (896, 896, False), "0.5B gate_up": (9728, 896, True),
    "0.5B down": (896, 4864, False), "0.5B lm_head": (151936, 896, False),
    "7B qkv": (4608, 3584, False), "7B o": (3584, 3584, False), "7B gate_up": (37888, 3584, True),
    "7B down": (3584, 18944, False), "7B lm_head": (152064, 3584, False),
}


@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
def test_plan_covers_every_tile_and_k_once(name):
    N, K, silu = QWEN_SHAPES[name]
    tiles, sps, splits, grid_x = sg.plan(16, N, K, silu)
    assert tiles * (8 if silu else 16) >= (N // 2 if silu else N) > (tiles - 1) * (8 if silu else 16)
    assert sps % sg.UNROLL == 0 and sg.UNROLL <= sps <= sg.MAX_STEPS
    assert (splits - 1) * sps * 32 < K <= splits * sps * 32, "every split has k to do and all of K is covered"
    assert grid_x * sg.WARPS >= min(tiles, -(-tiles // max(1, tiles // (sg.GRID_TARGET // splits))))
    assert tiles * splits >= min(sg.SPLIT_TARGET, tiles * -(-K // 32 // sg.UNROLL)) or sps == sg.UNROLL


@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
def test_plan_v2_fills_the_gpu_in_one_wave(name):
    N, K, silu = QWEN_SHAPES[name]
    tiles, kwarps, chunks = sg.plan_v2(1, N, K, silu)
    assert tiles * (8 if silu else 16) >= (N // 2 if silu else N) > (tiles - 1) * (8 if silu else 16)
    assert chunks * 128 >= K > (chunks - 1) * 128
    assert kwarps in (4, 8, 16) and (kwarps == 4 or chunks >= 2 * kwarps), "every warp has 2 chunks or more"
    # more warps on a tile only while the grid is short of warps, and never past one wave of 16 per SM
    assert kwarps == 4 or (tiles * kwarps // 2 < sg.V2_TARGET_WARPS and tiles * kwarps <= 16 * 132)


def test_launch_errors_name_the_field():
    x, w = case(2, 16, 64, torch.float16)
    cases = [
        (lambda: sg.skinny_linear(randn(2, 60), randn(16, 60)), "multiple of 8"),
        (lambda: sg.skinny_linear(randn(17, 64), w), "1 to 16 rows"),
        (lambda: sg.skinny_linear(x, w.to(torch.bfloat16)), "weight.dtype"),
        (lambda: sg.skinny_linear(x, randn(16, 72)), r"weight must be a contiguous"),
        (lambda: sg.skinny_linear(x, w, randn(15)), "bias"),
        (lambda: sg.skinny_linear(x, w, silu=True, residual=randn(2, 8)), "residual is not supported"),
        (lambda: sg.skinny_linear(x, w, residual=randn(3, 16)), "residual must be"),
        (lambda: sg.skinny_linear(x, w, out=randn(2, 8)), "out must be"),
        (lambda: sg.skinny_linear(x, w, norm_weight=randn(64)), "eps"),
        (lambda: sg.skinny_linear(x, w, eps=1e-6), "need norm_weight"),
        (lambda: sg.skinny_linear(x, w, norm_weight=randn(64), eps=1e-6, norm_residual=randn(2, 64)),
         "residual_out is needed"),
        (lambda: sg.skinny_linear(x, w, steps_per_split=6), "steps_per_split"),
        (lambda: sg.skinny_linear(x, w, reduce="atomic"), "reduce"),
        (lambda: sg.skinny_linear(x, w, variant=3), "variant must be"),
        (lambda: sg.skinny_linear(x, w, warps_per_tile=8, variant=1), "warps_per_tile"),
        (lambda: sg.skinny_linear(x, w, warps_per_tile=6), "warps_per_tile"),
    ]
    r = randn(2, 64)
    cases.append((lambda: sg.skinny_linear(x, w, norm_weight=randn(64), eps=1e-6, norm_residual=r, residual_out=r),
                  "neither norm_residual nor x"))
    cases.append((lambda: sg.skinny_linear(x, w, norm_weight=randn(64), eps=1e-6, norm_residual=r, residual_out=x,
                                           variant=2), "neither norm_residual nor x"))
    square = randn(16, 16)                                        # y [2, 16] written over x [2, 16]
    cases.append((lambda: sg.skinny_linear(square[:2], square, out=square[:2]), "out must be neither"))
    for call, message in cases:
        with pytest.raises(KernelLaunchError, match=message):
            call()


# ---- code generation: the real kernels compiled for sm_90 -------------------------------------------
_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import skinny_gemm as sg
u32, i16, f32, i64 = types.uint32[::1], types.int16[::1], types.float32[::1], types.int64
SIG = (u32, i64, u32, i16, f32, types.int32[::1], i16, i16, u32, i64, u32, u32, types.float32,
       i64, i64, i64, i64, i64, i64)
RSIG = (f32, i64, i16, i16, i16, i64, i64, i64)
V2SIG = (u32, i64, u32, i16, i16, i16, u32, i64, u32, u32, types.float32, i64, i64, i64, i64)
out = {}
for name, flags in json.loads(sys.argv[1]).items():
    if name.startswith("reduce"):
        ptx, _ = cuda.compile_ptx(sg.make_reduce_kernel(*flags).py_func, RSIG, cc=(9, 0))
    elif name.startswith("v2"):
        kernel = sg.make_gemm_kernel_v2(*flags)
        ptx, _ = cuda.compile_ptx(kernel.py_func, V2SIG, cc=(9, 0),
                                  launch_bounds=kernel.targetoptions.get("launch_bounds"))
    else:
        ptx, _ = cuda.compile_ptx(sg.make_gemm_kernel(*flags).py_func, SIG, cc=(9, 0))
    open(f"{sys.argv[2]}/{name}.ptx", "w").write(ptx)
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))
    out[name] = {"ld_global_v4": count("ld.global.v4"), "mma": count("mma.sync.aligned.m16n8k16"),
                 "ld_shared_v4": count("ld.shared.v4"), "shfl": count("shfl.sync"), "atomic": count("atom."),
                 "bar": count("bar.sync") + count("barrier.sync"),
                 "cp_async": len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),
                 "st_global_v4": count("st.global.v4"),
                 "ld_global_v4_no_l1": len(re.findall(r"ld\.global\.L1::no_allocate\.v4", ptx)),
                 "ex2": count("ex2.approx"), "f64_ops": sum(1 for o in ops if ".f64" in o),
                 "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx))}
print(json.dumps(out))
"""

# name: make_gemm_kernel(is_bf16, two_groups, norm, add, bias, silu, resid, split) / make_reduce_kernel(...);
# the default run compiles the plain kernel and the one with the most fused (prologue, bias, M > 8, split-K
# with the last warp's reduction)
CODEGEN = {
    "plain_f16": (False, False, False, False, False, False, False, 0),
    "norm_add_split_bf16_m16": (True, True, True, True, True, False, False, sg.SPLIT_WARP),
    "silu_bias_f16": (False, False, False, False, True, True, False, 0),
    "resid_split_kernel_bf16": (True, False, False, False, False, False, False, sg.SPLIT_KERNEL),
    "silu_split_f16": (False, False, False, False, False, True, True, sg.SPLIT_WARP),
    "reduce_silu_bias_bf16": (True, True, True, False),
    # make_gemm_kernel_v2(is_bf16, two_groups, kwarps, bias, silu, resid, l1_no_allocate, norm, add)
    "v2_plain_bf16": (True, False, 4, False, False, False, True),
    "v2_silu_bias_f16_m16_w16": (False, True, 16, True, True, False, True),
    "v2_resid_bf16_w8_l1": (True, False, 8, False, False, True, False),
    "v2_norm_add_bias_bf16_m16_w16": (True, True, 16, True, False, False, True, True, True),
    "v2_norm_silu_f16_m16": (False, True, 4, False, True, False, True, True, False),
    "v2_norm_add_resid_f16_w8": (False, False, 8, False, False, True, True, True, True),
}
CODEGEN_DEFAULT = ("plain_f16", "norm_add_split_bf16_m16", "v2_plain_bf16", "v2_norm_add_bias_bf16_m16_w16")
CODEGEN_PARAMS = [n if n in CODEGEN_DEFAULT else pytest.param(n, marks=SLOW) for n in sorted(CODEGEN)]


def assert_v2_ptx(s, two_groups, l1_no_allocate, norm, add, what):
    """The PTX counts `s` (from _SCRIPT) of a v2 kernel with these flags: the first chunk's 8 weight loads and
    the next chunk's 8 inside the loop (not allocating in L1 unless l1_no_allocate is off), 4 activation
    pieces per group; 4 steps x 2 halves x groups mma; one barrier (the warps' sums), no staging, no atomics,
    no shuffles. The norm prologue adds: its sum of squares reads 4 pieces of x (and of the residual) ahead,
    one butterfly (5 shuffles), two more barriers (the warps' sums, the scales), CTA 0's 4 stores of the new
    residual; the loop reads each step's norm weights once for both groups and x (and the residual) per
    group."""
    groups = 2 if two_groups else 1
    weights = 16 if l1_no_allocate else 0
    acts = (4 * (1 + add) + 4 + 4 * groups * (1 + add)) if norm else 4 * groups
    assert s["ld_global_v4_no_l1"] == weights and s["ld_global_v4"] == 16 - weights + acts, (what, s)
    assert s["mma"] == 8 * groups and s["bar"] == (3 if norm else 1), (what, s)
    assert s["shfl"] == (5 if norm else 0) and s["st_global_v4"] == (4 if add else 0), (what, s)
    assert s["cp_async"] == 0 and s["ld_shared_v4"] == 0 and s["atomic"] == 0, (what, s)
    assert s["f64_ops"] == 0 and not s["local"], (what, s)


@pytest.fixture(scope="module")
def compiled(request):
    """PTX of the kernels this run selected (split over parallel subprocesses)."""
    picked = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    wanted = {n: f for n, f in CODEGEN.items() if n in picked}
    tmp = tempfile.mkdtemp(prefix="pa_skinny_ptx_")
    stats = {}
    parts = compile_in_subprocesses(_SCRIPT, sorted(wanted),
                                    lambda names: (json.dumps({n: wanted[n] for n in names}), tmp), timeout=900)
    for stdout in parts:
        stats.update(json.loads(stdout.strip().splitlines()[-1]))
    yield stats, tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", CODEGEN_PARAMS)
def test_ptx_has_wide_loads_mma_and_no_fp64(compiled, name):
    s = compiled[0][name]
    assert s["f64_ops"] == 0, f"{name}: {s['f64_ops']} fp64 instructions"
    assert not s["local"], f"{name}: local memory (a register array spilled)"
    # atomics only to elect the tile's last warp (one count per warp and tile), never to add the sums
    elected = CODEGEN[name][-1] == sg.SPLIT_WARP if name[:2] not in ("re", "v2") else False
    assert s["atomic"] == (1 if elected else 0), f"{name}: {s['atomic']} atomics"
    if name.startswith("reduce"):
        return
    groups = 2 if "m16" in name else 1
    if name.startswith("v2"):
        flags = dict(zip(("is_bf16", "two_groups", "kwarps", "bias", "silu", "resid", "l1_no_allocate", "norm",
                          "add"), CODEGEN[name]))
        assert_v2_ptx(s, flags.get("two_groups"), flags.get("l1_no_allocate", True), flags.get("norm", False),
                      flags.get("add", False), name)
        return
    # 4 steps of 2 rows: 8 16-byte weight loads per unrolled iteration; x staged by cp.async, or (norm) by
    # 16-byte loads of x, the residual and the norm weight, 4 pieces at a time
    norm = "norm" in name
    assert s["ld_global_v4"] >= (8 + 8 + 12 if norm else 8), s
    assert (s["cp_async"] > 0) != norm, s
    assert s["mma"] == 8 * groups, s                          # 4 steps x 2 halves of a piece x M groups
    assert s["ld_shared_v4"] >= 4 * groups, s
    # the norm's sum of squares (5), the election's broadcast (1)
    assert s["shfl"] == (5 if "norm" in name else 0) + (1 if elected else 0), s


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", ["plain_f16", "norm_add_split_bf16_m16", "v2_plain_bf16",
                                  "v2_norm_add_bias_bf16_m16_w16"])
def test_ptxas_no_spills(compiled, name):
    ptx = open(os.path.join(compiled[1], name + ".ptx")).read()
    m = re.search(r"release (\d+)\.(\d+)", subprocess.run(["ptxas", "--version"], capture_output=True,
                                                          text=True).stdout)
    if m:  # NVVM may write a newer PTX ISA than this ptxas reads; the kernel uses nothing new
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, flags=re.M)
    src = os.path.join(compiled[1], name + ".fixed.ptx")
    open(src, "w").write(ptx)
    proc = subprocess.run(["ptxas", "-arch=sm_90", "-v", src, "-o", os.devnull], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stderr + proc.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report   # >= 16 warps per SM


# ---- on the GPU: real shapes ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gpu_real_shapes_match_float64_and_repeat_bit_for_bit(name, M):
    """The same bound as the simulator's tests, the float64 reference computed on the GPU (the 7B LM
    head is 0.5 G weights); then two more calls give the same bits (no arrival-order sums)."""
    N, K, silu = QWEN_SHAPES[name]
    dtype = torch.bfloat16 if "7B" in name else torch.float16
    x, w = case(M, N, K, dtype, seed=21)
    got = {v: sg.skinny_linear(x, w, silu=silu, variant=v) for v in sg.VARIANTS}
    wd = w.double()
    acc, scale = x.double() @ wd.T, x.double().abs() @ wd.abs().T                  # (M, N)
    del wd
    if silu:
        inter = N // 2
        rnd = lambda v: v.to(dtype).double()
        g, u = rnd(acc[:, :inter]), rnd(acc[:, inter:])
        want = rnd(rnd(g * torch.sigmoid(g)) * u)
        # the gate and up sums may each be one unit off: a few units of the product
        slack = (ULP[dtype] * g.abs() + K * F32_SUM * scale[:, :inter]) * 1.1 * u.abs() \
            + (ULP[dtype] * u.abs() + K * F32_SUM * scale[:, inter:]) * rnd(g * torch.sigmoid(g)).abs()
        bound = 2 * ULP[dtype] * want.abs() + TINY[dtype] + slack
    else:
        want = acc.to(dtype).double()
        bound = ULP[dtype] * want.abs() + TINY[dtype] + K * F32_SUM * scale
    for v, y in got.items():
        err = (y.double() - want).abs()
        assert bool((err <= bound).all()), f"{name} M={M} v{v}: max err {err.max().item():.3e}, max err/bound " \
                                           f"{(err / bound).max().item():.3f}"
    assert same_bits(sg.skinny_linear(x, w, silu=silu), got[2])
    for reduce in ("warp", "kernel"):
        assert same_bits(sg.skinny_linear(x, w, silu=silu, reduce=reduce, variant=1), got[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["0.5B qkv", "0.5B gate_up", "0.5B lm_head", "7B qkv", "7B gate_up"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gpu_v2_norm_prologue_real_shapes(name, M):
    """v2's prologue as a decoder calls it (qkv: the residual add and the bias; gate_up: the residual add and
    SiLU-and-mul; the LM head: the norm alone) within the bench's bound of torch's float32 reference, the
    residual stream exact, repeated calls bit for bit, and, where every prologue thread sums at most one
    piece, the bits of rmsnorm.py's kernel followed by the plain v2 GEMM."""
    from kernels_numba import rmsnorm
    from scripts.bench_skinny_gemm import DTYPE, EPS, torch_reference

    N, K, silu = QWEN_SHAPES[name]
    add = "lm_head" not in name
    x, w = case(M, N, K, DTYPE, seed=24)
    gamma, r, r_out = norm_inputs(M, K, DTYPE, add, seed=25)
    bias = randn(N, seed=27, dtype=DTYPE) if "qkv" in name else None
    kw = dict(silu=silu, norm_weight=gamma, eps=EPS, norm_residual=r, residual_out=r_out, variant=2)
    got = sg.skinny_linear(x, w, bias, **kw)
    variant = "norm" + "_add" * add + "_bias" * (bias is not None) + "_silu" * silu
    want, bound, new_res = torch_reference(x, w, variant, bias=bias, gamma=gamma, norm_residual=r)
    ratio = ((got.double() - want).abs() / bound).max().item()
    assert ratio <= 1, f"{name} M={M}: max err / bound {ratio:.3f}"
    if add:
        assert torch.equal(r_out.float(), new_res), "residual_out"
    assert same_bits(sg.skinny_linear(x, w, bias, **kw), got)
    kwarps = sg.plan_v2(M, N, K, silu)[1]
    if K // 8 <= 32 * kwarps // (1 << (M - 1).bit_length()):
        normed = rmsnorm.fused_add_rms_norm(x, r.clone(), gamma, EPS)[0] if add else rmsnorm.rms_norm(x, gamma, EPS)
        assert same_bits(sg.skinny_linear(normed, w, bias, silu=silu, variant=2), got), "vs rmsnorm then v2"


@pytest.mark.gpu
@pytest.mark.parametrize("variant, norm", [(1, False), (2, False), (2, True)])
def test_gpu_graph_capture_and_replay(variant, norm):
    """Captured launches replay the same bits (with the prologue: the output and residual_out)."""
    x, w = case(4, 896, 4864, torch.float16, seed=22)
    out = torch.empty(4, 896, dtype=torch.float16, device="cuda")
    kw = {}
    if norm:
        gamma, r, r_out = norm_inputs(4, 4864, torch.float16, True, seed=28)
        kw = dict(norm_weight=gamma, eps=1e-6, norm_residual=r, residual_out=r_out)
    sg.skinny_linear(x, w, out=out, variant=variant, **kw)                # compile, make the scratch
    torch.cuda.synchronize()
    want = out.clone()
    want_res = kw["residual_out"].clone() if norm else None
    graph = capture_after_warmup(lambda: sg.skinny_linear(x, w, out=out, variant=variant, **kw))
    out.zero_()
    if norm:
        kw["residual_out"].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    if norm:
        assert torch.equal(kw["residual_out"].view(torch.int16), want_res.view(torch.int16))


@pytest.mark.gpu
def test_gpu_sass_has_128_bit_loads_and_hmma():
    """The machine code of the plain kernels (needs nvdisasm): LDG.E.128 weight loads, HMMA.16816, no fp64."""
    if shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm not installed")
    x, w = case(3, 896, 896, torch.float16, seed=23)
    sg.skinny_linear(x, w, steps_per_split=28)                           # one split: the plain kernel
    sg.skinny_linear(x, w, variant=2)                                    # 4 warps per tile
    for kernel in (sg.make_gemm_kernel(False, False, False, False, False, False, False, 0),
                   sg.make_gemm_kernel_v2(False, False, 4, False, False, False, True)):
        sass = "\n".join(kernel.inspect_sass().values())
        assert "LDG.E.128" in sass and "HMMA.16816.F32" in sass, sass[:2000]
        assert not re.search(r"\bD(ADD|MUL|FMA)\b", sass), "fp64 instructions in the SASS"


# ---- the bench's own validation (scripts/bench_skinny_gemm.py) -------------------------------------
def test_bench_validation_accepts_the_kernel_and_rejects_a_wrong_row():
    from scripts.bench_skinny_gemm import DTYPE, torch_reference

    M, N, K = 3, 40, 72
    x, w = case(M, N, K, DTYPE, seed=31)
    y = sg.skinny_linear(x, w)
    want, bound, _ = torch_reference(x.cpu(), w.cpu(), "plain")
    assert bool(((y.cpu().double() - want).abs() <= bound).all())
    wrong = sg.skinny_linear(x, torch.roll(w, 1, 0))                       # every output from its neighbour's row
    assert not bool(((wrong.cpu().double() - want).abs() <= bound).all())


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_bench_unfused_chain_and_v2_fused_pass_its_validation():
    """The bench times v2's prologue + SiLU-and-mul against rmsnorm.py's kernel, cuBLAS (here torch's CPU
    GEMM) and activation.py's kernel: both within the bench's bound of its torch reference, and the chain's
    residual stream is the reference's new residual."""
    from scripts.bench_skinny_gemm import DTYPE, EPS, torch_reference, unfused_chain

    M, inter, K = 3, 8, 64
    x, w = case(M, 2 * inter, K, DTYPE, seed=32)
    gamma, r, r_out = norm_inputs(M, K, DTYPE, True, seed=33)
    kw = dict(norm_weight=gamma, eps=EPS, norm_residual=r, residual_out=r_out, silu=True)
    want, bound, new_res = torch_reference(x.cpu(), w.cpu(), "norm_add_silu", gamma=gamma.cpu(), norm_residual=r.cpu())
    run, stream = unfused_chain("norm_add_silu", x, None, kw)
    for what, y in (("unfused", run(w)), ("v2 fused", sg.skinny_linear(x, w, variant=2, **kw))):
        assert bool(((y.cpu().double() - want).abs() <= bound).all()), what
    assert torch.equal(stream.cpu().float(), new_res) and torch.equal(r_out.cpu().float(), new_res)
