"""GGUF block formats: reference/quant.py and kernels_numba/cpu_quant.py against the `gguf` package's
dequantizer, the kernels' products against a float64 product of the dequantized matrix, and (-m slow) the
bundled file's every tensor against its converted float32 checkpoint.

Dequantization is exact: every value is a float32 product (d * q, or (d * sc) * q - dmin * m) and is
compared bit for bit. The products' tolerance is the float32 summation bound of tests/test_cpu_linear.py:
a float32 dot product of length K in any order is within (K + 1) * u * sum_k |x_k w_k| (+ the bias's
rounding) of the exact value, u = 2^-24, element by element; the typical error is a median over the
output, never judged on a few dozen elements.
"""
import mmap
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import bundled_model_dir  # noqa: F401 (session fixture)

from kernels_numba import cpu_quant
from pagedattn.errors import KernelLaunchError, ModelLoadError
from reference import quant

U = 2.0 ** -24
FORMATS = ["Q8_0", "Q5_0", "Q6_K", "Q4_K"]
# byte offsets of each block's fp16 scales (d, and dmin for Q4_K), where random bytes may not go
SCALE_OFFSETS = {"Q8_0": [0], "Q5_0": [0], "Q6_K": [208], "Q4_K": [0, 2]}


def synthetic_blocks(fmt, rows, blocks_per_row, seed):
    """uint8 [rows, blocks_per_row * bytes_per_block]: random quants and packed scales, fp16 scales drawn
    from normal values of both signs plus zero and the subnormal range (never inf or NaN)."""
    _, nbytes = quant.BLOCK[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks_per_row, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[fmt]:
        d = (rng.standard_normal(raw.shape[0]) * 10.0 ** rng.integers(-8, 1, raw.shape[0])).astype(np.float16)
        d[::7] = 0
        d[3::11] = np.float16(3e-6)                 # an fp16 subnormal
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_is_ggufs_bit_for_bit(fmt):
    raw = synthetic_blocks(fmt, rows=9, blocks_per_row=3, seed=FORMATS.index(fmt))
    theirs = gguf_dequantize(raw, GGMLQuantizationType[fmt])
    assert same_bits(quant.dequantize(raw, fmt), theirs)
    assert same_bits(cpu_quant.dequantize(raw, fmt, num_threads=2), theirs)
    assert same_bits(cpu_quant.embedding(np.array([8, 0, 3, 3]), raw, fmt).numpy(), theirs[[8, 0, 3, 3]])


def test_fp16_scales_of_every_kind():
    """Every fp16 bit pattern as a Q8_0 scale times q = 1: the kernel's integer decode of the scale is the
    hardware's conversion, subnormals, zeros of both signs, inf and NaN included."""
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    raw = np.zeros((65536, 34), np.uint8)
    raw[:, 0:2] = h.view(np.uint8).reshape(-1, 2)
    raw[:, 2] = 1
    got = cpu_quant.dequantize(raw, "Q8_0")[:, 0]
    want = h.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(want)], want[np.isinf(want)])


def reference(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y + b.astype(np.float64) if b is not None else y


def bound(x, w, b=None):
    K = x.shape[1]
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return (K + 1) * U * (mag + (np.abs(b.astype(np.float64)) if b is not None else 0)) + 1e-30


def check_product(y, x, w, b):
    ref, tol = reference(x, w, b), bound(x, w, b)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/bound {(err / tol).max():.2f}"
    # typical errors sit well inside the bound: the median of err / bound is 0.01-0.05 here under
    # NUMBA_CPU_NAME=generic, znver4 and skylake-avx512, so 0.25 is a 5x margin; a median needs
    # enough elements to be a statistic.
    if err.size >= 32:
        assert np.median(err / tol) < 0.25, f"median err/bound {np.median(err / tol):.3f}"


# rows: every leftover of the 4-row groups and both ends of the kernel's range (1-16), and 17 (torch's
# GEMM on dequantized tiles); weight rows: every N % 4 and N below one group; K: 1-3 blocks
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 11, 16, 17])
@pytest.mark.parametrize("N, blocks", [(67, 3), (130, 1), (5, 2), (2, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_matches_reference(fmt, M, N, blocks, with_bias):
    seed = FORMATS.index(fmt) * 100000 + M * 1000 + N * 10 + blocks
    raw = synthetic_blocks(fmt, N, blocks, seed)
    w = quant.dequantize(raw, fmt)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, w.shape[1])).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if with_bias else None
    y = cpu_quant.linear(torch.from_numpy(x), raw, fmt, None if b is None else torch.from_numpy(b), num_threads=2)
    assert y.shape == (M, N) and y.dtype == torch.float32
    check_product(y, x, w, b)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_threads_give_identical_bits(threads):
    raw = synthetic_blocks("Q5_0", 1027, 4, seed=5)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5))
    one = cpu_quant.linear(x, raw, "Q5_0", num_threads=1)
    assert torch.equal(cpu_quant.linear(x, raw, "Q5_0", num_threads=threads), one)


def test_a_row_does_not_depend_on_the_other_rows():
    """Rows go 4 at a time, then one by one, with the same operations per row: a row's result is the same
    bits alone or inside any batch (the engine's output for a sequence does not depend on its neighbours)."""
    for fmt in FORMATS:
        raw = synthetic_blocks(fmt, 37, 2, seed=11)
        x = torch.randn(7, raw.shape[1] // quant.BLOCK[fmt][1] * quant.BLOCK[fmt][0],
                        generator=torch.Generator().manual_seed(11))
        y = cpu_quant.linear(x, raw, fmt, num_threads=2)
        for m in (0, 3, 4, 6):
            assert torch.equal(cpu_quant.linear(x[m:m + 1], raw, fmt, num_threads=1)[0], y[m]), (fmt, m)


@pytest.mark.parametrize("M", [1, 5])
def test_parts_in_one_call_are_each_parts_product(M):
    """linear_parts (a fused layer stored as parts in different formats, as q / k / v are) writes each
    part's outputs into its columns, the same bits as the part alone, with the bias cut to match."""
    fmts = ["Q5_0", "Q8_0", "Q6_K", "Q4_K"]
    parts = [synthetic_blocks(f, n, 256 // quant.BLOCK[f][0], seed=20 + i) for i, (f, n) in enumerate(zip(fmts, [9, 4, 13, 6]))]
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(21))
    bias = torch.randn(32, generator=torch.Generator().manual_seed(22))
    y = cpu_quant.linear_parts(x, list(zip(parts, fmts)), bias, num_threads=3)
    col = 0
    for raw, fmt in zip(parts, fmts):
        n = raw.shape[0]
        assert torch.equal(y[:, col:col + n], cpu_quant.linear(x, raw, fmt, bias[col:col + n], num_threads=1)), fmt
        col += n
    assert y.shape == (M, col)


@pytest.mark.parametrize("M", [5, 40])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_strided_rows_give_the_contiguous_copys_bits(M, activations):
    """x may be a view of every other column block (SiLU-and-mul's output is the gate half of [T, 2 I]):
    few rows run the block kernel on a contiguous copy, a prefill's GEMM reads the strides; the same bits
    as a contiguous x either way, and x itself untouched. A numpy view with rows in reverse (which torch
    cannot wrap) is copied first."""
    from kernels_numba import cpu_quant_int8

    linear = cpu_quant.linear if activations == "float32" else cpu_quant_int8.linear
    raw = synthetic_blocks("Q5_0", 70, 4, seed=31)
    wide = torch.randn(M, 256, generator=torch.Generator().manual_seed(31))
    x = wide[:, :128]                                          # rows 256 apart
    assert not x.is_contiguous()
    before = wide.clone()
    y = linear(x, raw, "Q5_0", num_threads=2)
    assert torch.equal(y, linear(x.contiguous(), raw, "Q5_0", num_threads=2))
    assert torch.equal(wide, before)
    flipped = x.contiguous().numpy()[::-1]                     # a numpy view with a negative row stride
    assert torch.equal(linear(flipped, raw, "Q5_0", num_threads=2),
                       linear(np.ascontiguousarray(flipped), raw, "Q5_0", num_threads=2))


X86 = __import__("platform").machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not X86, reason="the instruction names checked are x86's")
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=() if f == "Q5_0" else pytest.mark.slow) for f in FORMATS])
def test_codegen_unpacks_in_byte_lanes_and_multiplies_in_float32_lanes(fmt):
    """The compiled product (for the compile target numba picks: NUMBA_CPU_NAME, or this machine) converts
    32-bit integer lanes to float32 (cvtdq2ps) and multiplies packed floats (mulps / fmadd...ps), and has
    none of the 64-bit-lane code numba's scalar integer typing led to (vpmovzxbq, vpsrlvq, vcvtqq2ps) nor a
    scalar int -> float conversion per value (cvtsi2ss: only in Q6_K's and Q4_K's scale pass, one per
    6- or 8-bit scale or min of a super-block, the unrolled loop's 16).
    Q5_0's fifth bits are spread to byte lanes by a compare (pcmpeqb; with AVX-512BW a bit test into a mask,
    vptestnmb, as LLVM picks for znver5). A fresh compile takes 10-30 s, so
    the default suite checks Q5_0 (most of a token's weights) and -m slow the others."""
    import re

    from numba import njit

    fresh = njit(nogil=True)(getattr(cpu_quant, f"_rows_{fmt.lower()}").py_func)   # not from the cache
    raw = synthetic_blocks(fmt, 4, 1, seed=30)
    K = quant.BLOCK[fmt][0]
    x = np.ones((1, K), np.float32)
    ro = raw.view()
    ro.flags.writeable = False
    out = np.zeros((1, 4), np.float32)
    fresh(x, np.zeros((1, K // 32), np.float32), ro, np.zeros(0, np.float32), out, 0, 4, 0, cpu_quant._F16)
    asm = fresh.inspect_asm(fresh.signatures[0])
    ops = re.findall(r"^\s+([a-z][a-z0-9]*)", asm, re.M)
    assert any(o.endswith("cvtdq2ps") for o in ops)
    assert any(re.fullmatch(r"v?mulps|vfmadd\d+ps", o) for o in ops)
    assert not {"vpmovzxbq", "vpsrlvq", "vcvtqq2ps"} & set(ops)
    scalar_converts = sum(o.endswith("cvtsi2ss") for o in ops)
    assert scalar_converts == 0 if fmt in ("Q8_0", "Q5_0") else scalar_converts <= 16, scalar_converts
    if fmt == "Q5_0":
        assert any(o.endswith("pcmpeqb") or re.fullmatch(r"vptestn?mb", o) for o in ops)
    # the 1-row loop's product is vector work: at least 4 packed float ops per run of 32 values
    assert sum(bool(re.fullmatch(r"v?(mul|add)ps|vfmadd\d+ps", o)) for o in ops) >= 4


BF16_U = 2.0 ** -9     # bfloat16's unit roundoff (8 significant bits, round to nearest)


# a prompt's rows in bfloat16 tiles: 17 rows (16-row tiles of W), 200 (1024-row tiles: N = 1100 crosses one)
@pytest.mark.parametrize("M, N", [(17, 67), (200, 1100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_tiles_within_their_rounding_bound(M, N, with_bias):
    """tile_dtype=torch.bfloat16: x and every dequantized tile rounded to bfloat16 (u = 2^-9 each), the
    products accumulated in float32, each output rounded to bfloat16 (u again): |y - ref| <= (3 u + (K + 1)
    2^-24) |x| |W| (+ the bias's float32 rounding), every format of a fused layer's parts in one call; typical
    errors far inside (random roundings); NaN stays in its row. Any x86 CPU runs it (bfloat16 is emulated
    where it is not native)."""
    fmts = ["Q5_0", "Q8_0", "Q6_K", "Q4_K"]
    raws = [synthetic_blocks(f, n, 256 // quant.BLOCK[f][0], seed=40 + i)
            for i, (f, n) in enumerate(zip(fmts, [N, 5, 9, 3]))]
    w = np.concatenate([quant.dequantize(r, f) for r, f in zip(raws, fmts)])
    rng = np.random.default_rng(M * 10 + with_bias)
    x = rng.standard_normal((M, 256)).astype(np.float32)
    b = rng.standard_normal(w.shape[0]).astype(np.float32) if with_bias else None
    y = cpu_quant.linear_parts(torch.from_numpy(x), list(zip(raws, fmts)), None if b is None else torch.from_numpy(b),
                               num_threads=2, tile_dtype=torch.bfloat16)
    ref = reference(x, w, b)
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    tol = (3 * BF16_U + 257 * 2.0 ** -24) * mag + (U * np.abs(b) if b is not None else 0) + 1e-30
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"max err/bound {(err / tol).max():.2f}"
    assert np.median(err / tol) < 0.25, f"median err/bound {np.median(err / tol):.3f}"
    assert not torch.equal(y, cpu_quant.linear_parts(torch.from_numpy(x), list(zip(raws, fmts)),
                                                     None if b is None else torch.from_numpy(b)))   # it is bfloat16
    x[3, 7] = np.nan
    y = cpu_quant.linear_parts(torch.from_numpy(x), list(zip(raws, fmts)), tile_dtype=torch.bfloat16)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[[0, 1, 2, 4]]).all()
    with pytest.raises(KernelLaunchError, match="^tile_dtype:"):
        cpu_quant.linear_parts(torch.from_numpy(x), list(zip(raws, fmts)), tile_dtype=torch.float16)


@pytest.mark.parametrize("native", [False, True])
def test_quant_weight_takes_bfloat16_tiles_with_int8_activations_on_a_native_cpu(monkeypatch, native):
    """QuantWeight: int8 activations and a CPU that multiplies bfloat16 natively -> a prompt's tiles in
    bfloat16; float32 activations, or no native bfloat16 -> float32 tiles (the dequantized matrix's GEMM);
    a decode's few rows are the int8 kernel's either way."""
    from kernels_numba import cpu_quant_int8
    from pagedattn.models.gguf_weights import GGUFTensor, QuantWeight

    monkeypatch.setattr(cpu_quant, "native_bf16", lambda: native)
    raw = synthetic_blocks("Q5_0", 40, 8, seed=50)
    t = GGUFTensor("blk.0.attn_q.weight", "Q5_0", (40, 256), raw)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(50))
    for activations in ("float32", "int8"):
        qw = QuantWeight([t], activations)
        want = torch.bfloat16 if native and activations == "int8" else torch.float32
        assert qw.tile_dtype == want
        assert torch.equal(qw(x), cpu_quant.linear_parts(x, [(raw, "Q5_0")], tile_dtype=want))
        few = cpu_quant_int8.linear if activations == "int8" else cpu_quant.linear
        assert torch.equal(qw(x[:4]), few(x[:4], raw, "Q5_0"))


def test_nan_and_inf_propagate_to_their_rows_only():
    raw = synthetic_blocks("Q4_K", 40, 1, seed=6)
    x = torch.randn(8, 256)
    x[2, 5], x[6, 0] = float("nan"), float("inf")
    y = cpu_quant.linear(x, raw, "Q4_K")
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[6]).all()
    assert torch.isfinite(y[[0, 1, 3, 4, 5, 7]]).all()


@pytest.mark.parametrize("args, field", [
    ((torch.randn(2, 64, dtype=torch.float64), synthetic_blocks("Q8_0", 8, 2, 0), "Q8_0"), "x"),
    ((torch.randn(2, 64), synthetic_blocks("Q8_0", 8, 2, 0).view(np.int8), "Q8_0"), "blocks"),
    ((torch.randn(2, 64), synthetic_blocks("Q8_0", 8, 2, 0)[:, :60], "Q8_0"), "blocks"),
    ((torch.randn(2, 96), synthetic_blocks("Q8_0", 8, 2, 0), "Q8_0"), "blocks"),
    ((torch.randn(2, 64), synthetic_blocks("Q8_0", 8, 2, 0), "Q2_K"), "fmt"),
    ((torch.randn(2, 64, 1), synthetic_blocks("Q8_0", 8, 2, 0), "Q8_0"), "x"),
    ((torch.randn(2, 64), synthetic_blocks("Q8_0", 8, 2, 0), "Q8_0", torch.randn(7)), "bias"),
])
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(KernelLaunchError, match=f"^{field}:"):
        cpu_quant.linear(*args)


def test_embedding_rejects_ids_outside_the_table():
    raw = synthetic_blocks("Q5_0", 10, 1, seed=7)
    for ids in ([10], [-1], [[1, 2]]):
        with pytest.raises(KernelLaunchError, match="^ids:"):
            cpu_quant.embedding(np.array(ids), raw, "Q5_0")


def test_gguf_tensor_linear_and_embedding(tmp_path):
    """gguf_weights on a small GGUF written here: shapes in torch's order, blocks kept as stored (a view of
    the mapped file, no float32 copy), quant_linear / QuantLinear / embedding on them."""
    import gguf

    from pagedattn.models import gguf_weights

    raw = synthetic_blocks("Q5_0", 12, 2, seed=8)
    bias = np.linspace(-1, 1, 12, dtype=np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.0.attn_q.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = gguf_weights.read_gguf(str(tmp_path / "t.gguf"))
    w, b = tensors["blk.0.attn_q.weight"], tensors["blk.0.attn_q.bias"]
    assert (w.fmt, w.shape, w.data.dtype, w.data.shape, w.nbytes) == ("Q5_0", (12, 64), np.uint8, (12, 44), 12 * 44)
    base = w.data                                      # a view of the file's mapping, not a copy
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    assert base is not None
    assert (b.fmt, b.shape) == ("F32", (12,)) and np.array_equal(b.data, bias)
    assert gguf_weights.hf_name(w.name) == "model.layers.0.self_attn.q_proj.weight"
    x = torch.randn(3, 64)
    y = gguf_weights.QuantLinear(w, b)(x)
    check_product(y, x.numpy(), quant.dequantize(raw, "Q5_0"), bias)
    assert torch.equal(gguf_weights.quant_linear(x, w, torch.from_numpy(bias)), y)
    assert same_bits(gguf_weights.embedding([4, 1], w).numpy(), quant.dequantize(raw, "Q5_0")[[4, 1]])


def test_gguf_header_walks_past_string_arrays(tmp_path):
    """The header's string arrays (a tokenizer's tokens and merges) are skipped by the compiled loop: the
    tensors after them are found where they are, and a file cut inside such an array is refused by name."""
    import gguf

    from pagedattn.models import gguf_weights

    rng = np.random.default_rng(3)
    tokens = ["".join(chr(c) for c in rng.integers(33, 0x2FFF, int(n))) for n in rng.integers(0, 40, 3000)]
    raw = synthetic_blocks("Q8_0", 4, 1, seed=2)
    path = str(tmp_path / "t.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(tokens[:1000])
    writer.add_tensor("blk.0.attn_k.weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf_weights.read_gguf(path)["blk.0.attn_k.weight"]
    assert (t.fmt, t.shape) == ("Q8_0", (4, 32)) and np.array_equal(t.data, raw)
    data = open(path, "rb").read()
    cut = data.index(next(t for t in tokens[1500:] if len(t) > 20).encode())     # inside the token list
    with open(tmp_path / "cut.gguf", "wb") as f:
        f.write(data[:cut])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*string array runs past the end"):
        gguf_weights.read_gguf(str(tmp_path / "cut.gguf"))


@pytest.mark.slow
def test_bundled_gguf_dequantizes_to_the_converted_checkpoint(tmp_path, bundled_model_dir):
    """Every tensor of the bundled GGUF, dequantized from its blocks by the kernel, equals the converted
    float32 checkpoint's tensor of the Qwen2 name bit for bit (so the conversion permutes nothing); the
    numpy reference agrees on the first rows of each quantized tensor; a product on real blocks (the LM
    head's, at 8 rows) meets the bound."""
    from safetensors import safe_open

    from pagedattn import bundled
    from pagedattn.models import gguf_weights

    checkpoint = bundled_model_dir
    if bundled.missing_pieces():
        pytest.skip(f"the bundled GGUF's pieces are not installed ({', '.join(bundled.missing_pieces())})")
    path = os.path.join(tmp_path, "model.gguf")
    bundled.join_parts(bundled.verify_parts(), path)
    tensors = gguf_weights.read_gguf(path)
    formats = {t.fmt for t in tensors.values()}
    assert formats == {"Q8_0", "Q5_0", "Q6_K", "Q4_K", "F32"}
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "np") as f:
        assert {gguf_weights.hf_name(n) for n in tensors} == set(f.keys())
        for name, t in tensors.items():
            assert same_bits(t.dequantize(), f.get_tensor(gguf_weights.hf_name(name))), name
            if t.quantized:
                assert same_bits(quant.dequantize(t.data[:2], t.fmt), t.dequantize()[:2]), name
    head = tensors["output.weight"]
    x = np.random.default_rng(9).standard_normal((8, head.shape[1])).astype(np.float32)
    rows = slice(0, 4099)
    y = cpu_quant.linear(torch.from_numpy(x), head.data[rows], head.fmt)
    check_product(y, x, head.dequantize()[rows], None)
