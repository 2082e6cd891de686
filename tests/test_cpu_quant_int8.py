"""int8 activations on GGUF blocks (kernels_numba/cpu_quant_int8.py) against reference/quant.py's numpy
version: the same quantization of x bit for bit, the same integer sums, the two spellings of those sums
(x86 AVX2 and target-independent IR) giving identical bits, and the error against the float32 product
bounded by what rounding x costs.

Tolerances: the kernel and reference.linear_int8 share the integers and the float32 scale products, and
differ only in how the per-run terms are summed (float32 in the kernel, float64 in the reference): within
(R + 2) * u * sum |terms| for R runs of 32 (+ the bias's rounding), u = 2^-24. Against the float32 product
of the dequantized matrix the difference is x's rounding: |y - W x| <= |W| |x_hat - x| (x_hat = dx * xq,
the reference's), plus the float32 summation bound of tests/test_cpu_quant.py.
"""
import numpy as np
import pytest
import torch
from numba import njit
from helpers import bundled_gguf, bundled_model_dir  # noqa: F401 (session fixtures)
from test_cpu_quant import FORMATS, U, bound, synthetic_blocks

from kernels_numba import cpu_quant, cpu_quant_int8
from kernels_numba.cpu_simd import (target_has_avx2, vb_dot4, vb_dot4_avx2, vb_load, vb_udot4, vb_udot4_avx2, vf_fma,
                                    vf_halves, vf_mul, vf_splat, vf_sum, vf_zero)
from pagedattn.errors import KernelLaunchError
from reference import quant

AVX2 = target_has_avx2()


def awkward_x(M, K, seed):
    """float32 [M, K]: normal values at scales 1e-6..1e3 per block, an all-zero block, exact .5 ties of
    x * 127 / amax, a block whose largest magnitude is negative, fp16-subnormal scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)) * 10.0 ** rng.integers(-6, 4, (M, K // 32)).repeat(32, 1)
    x = x.astype(np.float32)
    x[0, :32] = 0
    if K >= 64:
        x[0, 32:64] = np.arange(32, dtype=np.float32) - 15.5          # x * 127 / amax = x exactly: ties .5
        x[0, 32] = -127.0                                             # amax 127, the largest negative
    if M > 1:
        x[1, :32] *= np.float32(1e-4)                                             # dx an fp16 subnormal
    return x


@pytest.mark.parametrize("M, K", [(1, 32), (3, 96), (7, 256)])
def test_quantization_is_the_references_bit_for_bit(M, K):
    x = awkward_x(M, K, seed=M * K)
    *ours, xl = cpu_quant_int8.quantize_rows(x)
    for got, want in zip(ours, quant.quantize_rows_int8(x), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    xq, dx, _ = quant.quantize_rows_int8(x)
    assert np.abs(xq.astype(np.int32)).max() <= 127 and (xq[0, :32] == 0).all() and dx[0, 0] == 0
    # Q6_K's - 32 on the activations' side: 32 x each 4 values' sum of xq
    assert xl.dtype == np.int32 and np.array_equal(xl, 32 * xq.astype(np.int32).reshape(M, K // 4, 4).sum(-1))


@njit
def _round_all(a, out):
    for i in range(a.shape[0]):
        out[i] = cpu_quant_int8._round_to_f16(a[i])


def test_fp16_rounding_of_the_scales():
    """The kernels' fp16 rounding of dx (no float16 type in numba) against numpy's on every kind of value:
    fp16 normals, subnormals, ties between neighbours, values at the edges of both ranges."""
    rng = np.random.default_rng(3)
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)         # every finite fp16 >= 0
    mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)                     # ties (exact in float32)
    v = np.concatenate([h, mid, np.nextafter(mid, 0), np.nextafter(mid, 1),
                        np.abs(rng.standard_normal(10000) * 10.0 ** rng.integers(-9, 4, 10000)).astype(np.float32)])
    v = v[v < 65504]
    out = np.empty_like(v)
    _round_all(v, out)
    want = v.astype(np.float16).astype(np.float32)
    bad = np.flatnonzero(out.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size} values, e.g. {v[bad[:3]]} -> {out[bad[:3]]}, numpy {want[bad[:3]]}"


def check_against_reference(y, x, raw, fmt, b=None):
    """y (the kernel's) within float32 summation of reference.linear_int8's float64 sum of the same terms."""
    ref = quant.linear_int8(x, raw, fmt, b)
    xq, dx, xs = quant.quantize_rows_int8(x)
    q, s, mn = quant.integer_form(raw, fmt)
    x_hat = np.abs(xq.astype(np.float64) * np.repeat(dx, 32, 1))
    mag = x_hat @ (np.abs(s.astype(np.float64)) * np.abs(q)).T + np.abs(xs.astype(np.float64)) @ np.abs(mn[:, ::32]).T
    R = x.shape[1] // 32
    tol = (R + 4) * U * (mag + (np.abs(b.astype(np.float64)) if b is not None else 0)) + 1e-30
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"{fmt}: max err {err.max():.3g}, worst err/bound {(err / tol).max():.2f}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("N, blocks", [(67, 3), (5, 1)])
def test_product_matches_reference(fmt, M, N, blocks):
    seed = FORMATS.index(fmt) * 1000 + M * 10 + N + blocks
    raw = synthetic_blocks(fmt, N, blocks, seed)
    K = blocks * quant.BLOCK[fmt][0]
    x = awkward_x(M, K, seed)
    b = np.random.default_rng(seed).standard_normal(N).astype(np.float32) if M % 2 else None
    y = cpu_quant_int8.linear(x, raw, fmt, None if b is None else torch.from_numpy(b), num_threads=2)
    assert y.shape == (M, N) and y.dtype == torch.float32
    check_against_reference(y, x, raw, fmt, b)


KQUANTS = ["Q6_K", "Q4_K"]


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("N, blocks", [(1, 1), (3, 2), (5, 1), (31, 3)])
def test_kquant_halves_on_ragged_shapes(fmt, N, blocks):
    """The K-quants' half super-block rows against the reference at every row count 1-16 (the 4-row groups
    and the rest) and odd N, one and two threads: N = 1 .. 5 leaves a thread one row or none."""
    raw = synthetic_blocks(fmt, N, blocks, seed=N * 10 + blocks)
    x = awkward_x(16, 256 * blocks, seed=N + blocks)
    b = np.random.default_rng(N).standard_normal(N).astype(np.float32)
    for M in range(1, 17):
        y = cpu_quant_int8.linear(x[:M], raw, fmt, torch.from_numpy(b) if M % 3 else None, num_threads=1 + M % 2)
        assert y.shape == (M, N)
        check_against_reference(y, x[:M], raw, fmt, b if M % 3 else None)


def _previous_rows(fmt, avx2):
    """The int8 product as it was before the K-quants' half super-block rows (one input row at a time, which
    the previous 4-row groups computed the same way): each run's signed q as cpu_quant unpacks it (Q6_K's
    - 32 and Q5_0's - 16 in the bytes, so vpsignb's pair on AVX2), the scales cpu_quant._run_scales forms
    (Q8_0 / Q5_0: lo == hi == the block's d), and acc += [lo x4, hi x4] * (dx * lanes) run by run."""
    @njit(nogil=True)
    def rows(xq, dx, xs, w, out):
        M, R = dx.shape
        lo, hi, mn = np.empty(R, np.float32), np.empty(R, np.float32), np.zeros(R, np.float32)
        for n in range(w.shape[0]):
            row = w[n]
            cpu_quant._run_scales(fmt, row, lo, hi, mn, cpu_quant._F16)
            for m in range(M):
                acc = vf_zero()
                for r in range(R):
                    q, b = cpu_quant._run_values(fmt, row, r), vb_load(xq, (m * R + r) * 32)
                    if fmt == cpu_quant._Q4_K:
                        s = vb_udot4_avx2(q, b) if avx2 else vb_udot4(q, b)
                    else:
                        s = vb_dot4_avx2(q, b) if avx2 else vb_dot4(q, b)
                    acc = vf_fma(vf_halves(lo[r], hi[r]), vf_mul(vf_splat(dx[m, r]), s), acc)
                cpu_quant._store(fmt, vf_sum(acc), m, n, mn, xs, np.zeros(0, np.float32), False, out)
    return rows


_PREVIOUS = {}


def previous_kernel(fmt, x, raw, avx2):
    key = (fmt, avx2)
    if key not in _PREVIOUS:
        _PREVIOUS[key] = _previous_rows(cpu_quant._CODE[fmt], avx2)
    xq, dx, xs, _ = cpu_quant_int8.quantize_rows(x)
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    _PREVIOUS[key](xq.reshape(-1), dx, xs, raw, out)
    return out


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("avx2", [False, pytest.param(True, marks=pytest.mark.skipif(not AVX2, reason="no AVX2"))])
def test_kquant_halves_are_the_previous_kernels_bits(fmt, avx2):
    """Same integers (Q6_K: (q + 32) . xq - 32 sum(xq) is q . xq exactly), same scales, same float32
    operations in the same order: every output bit for bit the previous kernel's, at 1-16 rows."""
    raw = synthetic_blocks(fmt, 37, 3, seed=7 + avx2)
    x = awkward_x(16, 768, seed=8)
    for M in (1, 2, 3, 4, 5, 8, 13, 16):
        y = cpu_quant_int8.linear(x[:M], raw, fmt, num_threads=2, avx2=avx2).numpy()
        assert np.array_equal(y.view(np.uint32), previous_kernel(fmt, x[:M], raw, avx2).view(np.uint32)), M


def test_bundled_down_matrices_are_the_previous_kernels_bits(bundled_gguf):  # noqa: F811
    """The same on the bundled model's ffn_down matrices (896 x 4864, Q6_K and Q4_K): 1 and 5 rows."""
    from pagedattn.models.gguf_weights import read_gguf

    tensors = read_gguf(bundled_gguf)
    x = (np.random.default_rng(0).standard_normal((5, 4864)) * 0.1).astype(np.float32)
    seen = set()
    for layer in range(24):
        t = tensors[f"blk.{layer}.ffn_down.weight"]
        if t.fmt in seen:
            continue
        seen.add(t.fmt)
        for M in (1, 5):
            y = cpu_quant_int8.linear(x[:M], t.data, t.fmt, num_threads=2).numpy()
            assert np.array_equal(y.view(np.uint32), previous_kernel(t.fmt, x[:M], t.data, AVX2).view(np.uint32))
    assert seen == {"Q6_K", "Q4_K"}


@pytest.mark.parametrize("fmt", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("avx2", [False, pytest.param(True, marks=pytest.mark.skipif(not AVX2, reason="no AVX2"))])
@pytest.mark.parametrize("N, blocks", [(1, 1), (3, 2), (37, 24)])
def test_q5_0_q8_0_runs_are_the_previous_kernels_bits(fmt, avx2, N, blocks):
    """Q5_0 / Q8_0 a run at a time: every output bit for bit the run-at-a-time kernel kept above (signed q,
    vpsignb on AVX2) at 1-16 rows, one and two threads, so that a faster spelling of these rows can be
    checked against it."""
    raw = synthetic_blocks(fmt, N, blocks, seed=N + 100 * blocks + avx2)
    x = awkward_x(16, 32 * blocks, seed=N + blocks)
    for M in range(1, 17):
        y = cpu_quant_int8.linear(x[:M], raw, fmt, num_threads=1 + M % 2, avx2=avx2).numpy()
        assert np.array_equal(y.view(np.uint32), previous_kernel(fmt, x[:M], raw, avx2).view(np.uint32)), M


def test_bundled_q5_0_matrices_are_the_previous_kernels_bits(bundled_gguf):  # noqa: F811
    """The same on the bundled model's Q5_0 matrices (layer 0's q / k / o, gate / up, 896 input features;
    and the first Q5_0 v if any): 1 and 5 rows."""
    from pagedattn.models.gguf_weights import read_gguf

    tensors = read_gguf(bundled_gguf)
    x = (np.random.default_rng(1).standard_normal((5, 896)) * 0.5).astype(np.float32)
    names = [f"blk.0.{k}.weight" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")]
    seen = [n for n in names if tensors[n].fmt == "Q5_0"]
    assert {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"} <= set(seen)
    for name in seen:
        t = tensors[name]
        for M in (1, 5):
            y = cpu_quant_int8.linear(x[:M], t.data, t.fmt, num_threads=2).numpy()
            assert np.array_equal(y.view(np.uint32), previous_kernel(t.fmt, x[:M], t.data, AVX2).view(np.uint32)), name


@pytest.mark.skipif(not AVX2, reason="the CPU numba compiles for has no AVX2")
@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_and_generic_sums_give_identical_bits(fmt):
    """The same integers either way (exact sums), then the same float32 operations: the same bits."""
    raw = synthetic_blocks(fmt, 45, 2, seed=40)
    x = awkward_x(6, 2 * quant.BLOCK[fmt][0], seed=41)
    a = cpu_quant_int8.linear(x, raw, fmt, num_threads=2, avx2=True)
    g = cpu_quant_int8.linear(x, raw, fmt, num_threads=2, avx2=False)
    assert np.array_equal(a.numpy().view(np.uint32), g.numpy().view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_against_float32_is_the_rounding_of_x(fmt):
    """|y_int8 - W x| <= |W| |x_hat - x| + the float32 summation bound: the only other function is x's."""
    raw = synthetic_blocks(fmt, 40, 2, seed=60)
    w = quant.dequantize(raw, fmt)
    x = np.random.default_rng(61).standard_normal((4, w.shape[1])).astype(np.float32)
    xq, dx, _ = quant.quantize_rows_int8(x)
    x_hat = xq.astype(np.float64) * np.repeat(dx, 32, 1)
    y = cpu_quant_int8.linear(x, raw, fmt).double().numpy()
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    tol = np.abs(x_hat - x) @ np.abs(w.astype(np.float64)).T + 2 * bound(x_hat.astype(np.float32), w) + 1e-30
    err = np.abs(y - exact)
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/bound {(err / tol).max():.2f}"
    # and it is an approximation, not the float32 product: some output differs by more than float32 rounding
    assert (err > bound(x, w)).any()


def test_threads_and_neighbours_do_not_change_a_row():
    raw = synthetic_blocks("Q6_K", 301, 1, seed=70)
    x = awkward_x(7, 256, seed=71)
    y = cpu_quant_int8.linear(x, raw, "Q6_K", num_threads=1)
    assert torch.equal(cpu_quant_int8.linear(x, raw, "Q6_K", num_threads=3), y)
    for m in (0, 4, 6):
        assert torch.equal(cpu_quant_int8.linear(x[m:m + 1], raw, "Q6_K", num_threads=2)[0], y[m])


def test_parts_and_prefill_rows():
    """A fused layer's parts in one call, each part's columns its own product; above MAX_ROWS rows the
    float32 tiles of cpu_quant (x not rounded)."""
    fmts = ["Q5_0", "Q8_0", "Q6_K", "Q4_K"]
    parts = [synthetic_blocks(f, n, 256 // quant.BLOCK[f][0], seed=80 + i)
             for i, (f, n) in enumerate(zip(fmts, [9, 4, 13, 6]))]
    x = torch.from_numpy(awkward_x(5, 256, seed=81))
    y = cpu_quant_int8.linear_parts(x, list(zip(parts, fmts)), num_threads=2)
    col = 0
    for raw, fmt in zip(parts, fmts):
        assert torch.equal(y[:, col:col + raw.shape[0]], cpu_quant_int8.linear(x, raw, fmt, num_threads=1)), fmt
        col += raw.shape[0]
    big = torch.randn(cpu_quant.MAX_ROWS + 1, 256)
    assert torch.equal(cpu_quant_int8.linear_parts(big, list(zip(parts, fmts))),
                       cpu_quant.linear_parts(big, list(zip(parts, fmts))))


def test_bad_arguments_name_the_field():
    raw = synthetic_blocks("Q5_0", 4, 1, seed=90)
    with pytest.raises(KernelLaunchError, match="blocks"):
        cpu_quant_int8.linear(torch.randn(1, 64), raw, "Q5_0")
    with pytest.raises(KernelLaunchError, match="bias"):
        cpu_quant_int8.linear(torch.randn(1, 32), raw, "Q5_0", torch.zeros(3))
    if not AVX2:
        with pytest.raises(KernelLaunchError, match="avx2"):
            cpu_quant_int8.linear(torch.randn(1, 32), raw, "Q5_0", avx2=True)


X86 = __import__("platform").machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not (X86 and AVX2), reason="checks x86 AVX2 instructions")
@pytest.mark.parametrize("avx2", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_codegen_of_the_integer_sums(avx2):
    """The AVX2 spelling compiles to vpmaddubsw + vpmaddwd (and vpsignb for signed weights); the
    target-independent one names none of them (-m slow: a fresh compile is 5-10 s); neither converts a
    value from int to float alone (cvtsi2ss)."""
    import re

    fresh = njit(nogil=True)(cpu_quant_int8.ROWS[cpu_quant._Q5_0, avx2].py_func)     # not from the cache
    raw = synthetic_blocks("Q5_0", 4, 1, seed=95).view()
    raw.flags.writeable = False
    one = np.ones((1, 1), np.float32)
    fresh(np.ones(32, np.int8), one, one, np.zeros(8, np.int32), raw, np.zeros(0, np.float32),
          np.zeros((1, 4), np.float32), 0, 4, 0, cpu_quant._F16)
    ops = set(re.findall(r"^\s+([a-z][a-z0-9]*)", fresh.inspect_asm(fresh.signatures[0]), re.M))
    if avx2:
        assert {"vpmaddubsw", "vpmaddwd", "vpsignb"} <= ops
    else:
        assert not {"vpmaddubsw", "vpsignb"} & ops
    assert any(o.endswith("cvtdq2ps") for o in ops) and not any(o.endswith("cvtsi2ss") for o in ops)


@pytest.mark.skipif(not (X86 and AVX2), reason="checks x86 AVX2 instructions")
@pytest.mark.parametrize("fmt", KQUANTS)
def test_codegen_of_the_kquant_halves(fmt):
    """The K-quants' rows (AVX2): unsigned byte products (vpmaddubsw + vpmaddwd, no vpsignb), Q6_K's
    lane sums subtracted (vpsubd); every shift of a byte field a constant one (no vpsrlw / vpsllw by a
    register count, which a run's place unknown at compile time costs), no scalar int -> float conversion
    (the scales converted in vectors)."""
    import re

    fresh = njit(nogil=True)(cpu_quant_int8.ROWS[cpu_quant._CODE[fmt], True].py_func)
    raw = synthetic_blocks(fmt, 4, 1, seed=96).view()
    raw.flags.writeable = False
    one = np.ones((1, 8), np.float32)
    fresh(np.ones(256, np.int8), one, one, np.zeros(64, np.int32), raw, np.zeros(0, np.float32),
          np.zeros((1, 4), np.float32), 0, 4, 0, cpu_quant._F16)
    asm = fresh.inspect_asm(fresh.signatures[0])
    ops = set(re.findall(r"^\s+([a-z][a-z0-9]*)", asm, re.M))
    assert {"vpmaddubsw", "vpmaddwd"} <= ops and "vpsignb" not in ops
    assert ("vpsubd" in ops) == (fmt == "Q6_K")
    assert not re.search(r"^\s+vps[rl]lw\s+%xmm", asm, re.M)
    assert not any(o.endswith("cvtsi2ss") for o in ops)
