"""Fixed-width vectors for numba's CPU target: 8 float32 lanes and 32 byte lanes, as LLVM vector values.

numba types integer arithmetic on scalars at 64 bits (`uint8 & uint8` is an int64), so a loop that
unpacks 4-6 bit fields from bytes vectorises, if at all, in 64-bit lanes (4 per 256-bit register, plus
a 64 -> 32-bit conversion before every float). The GGUF block kernels (kernels_numba/cpu_quant.py)
instead say what they mean at the width they mean it, through the few operations here, each a numba
intrinsic emitting plain LLVM vector IR:

    F32x8  <8 x float>   vf_load / vf_store / vf_splat / vf_zero / vf_fma / vf_add / vf_mul / vf_sum,
                         vf_mul_rounded / vf_sub_rounded (each result rounded on its own: no contraction)
    U8x32  <32 x i8>     vb_load (32 bytes), vb_nibbles (16 bytes -> low nibbles then high nibbles),
                         vb_bits (a uint32 -> one byte in the lanes whose bit is set, another elsewhere),
                         vb_shr / vb_shl / vb_and / vb_or / vb_add / vb_sub (byte lanes, wrapping),
                         vb_to_f32 (signed bytes -> four F32x8)
    scalars              load_u16 / load_u32 (little-endian words at any byte offset), f32_bits / f32_from_bits,
                         prefetch (a cache-line hint: llvm.prefetch)
    int8 products        vb_dot4 / vb_udot4 (target-independent), vb_dot4_avx2 / vb_udot4_avx2 (x86 AVX2's
                         vpmaddubsw + vpmaddwd, only where target_has_avx2()): 32 byte products summed
                         in fours into an F32x8, exactly; vb_udot4_minus(_avx2): the same less 8 int32
                         lanes of an array; vf_halves (two scalars, four lanes each); vf_i8 (8 stored signed
                         bytes), vf_bytes (a uint64's 8 bytes), vf_spread_pairs (lanes 2k, 2k + 1 four times)

Nothing but the _avx2 products names a target-specific instruction: LLVM's instruction selection maps
the vector ops to what the compile target has (two SSE registers per vector on a generic x86-64, one AVX2 register on a recent
one), so the kernels run on any CPU numba targets. The float ops (but the two `_rounded` ones, for the
dequantizer's bits) carry LLVM's `contract` flag and nothing else: a product feeding a sum may become
one FMA where the target has it (the same code, the same choice every time), nothing is reassociated,
and vf_sum adds the lanes in one fixed order, so a result does not depend on the thread count or the
call. Byte lanes are little-endian words' bytes (load_u32's byte k is bits 8k..8k+7), as GGUF stores them.
"""
import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic, models, register_model


class F32x8(types.Type):
    def __init__(self):
        super().__init__(name="F32x8")


class U8x32(types.Type):
    def __init__(self):
        super().__init__(name="U8x32")


f32x8, u8x32 = F32x8(), U8x32()
_F8 = ir.VectorType(ir.FloatType(), 8)
_B32 = ir.VectorType(ir.IntType(8), 32)
_B16 = ir.VectorType(ir.IntType(8), 16)
_I32 = ir.IntType(32)


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _F8)


@register_model(U8x32)
class _U8x32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _B32)


def _ptr(context, builder, aryty, ary, idx, vty):
    """Pointer to element idx of the 1-D array ary, as a pointer to the vector type vty (no bounds check)."""
    a = context.make_array(aryty)(context, builder, ary)
    p = cgutils.get_item_pointer(context, builder, aryty, a, [idx], wraparound=False)
    return builder.bitcast(p, vty.as_pointer())


def _load(builder, ptr):
    v = builder.load(ptr)
    v.align = 1                                  # any element offset: unaligned vector load
    return v


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, vty.count),
                                                                                  [0] * vty.count))


# ---- F32x8 ----------------------------------------------------------------------------------------
@intrinsic
def vf_load(typingctx, ary, idx):
    """ary[idx:idx + 8] of a 1-D float32 array (C-contiguous; idx + 8 <= len, unchecked)."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _F8))
    return f32x8(ary, idx), codegen


@intrinsic
def vf_store(typingctx, ary, idx, v):
    """ary[idx:idx + 8] = v."""
    def codegen(context, builder, sig, args):
        st = builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], args[1], _F8))
        st.align = 1
        return context.get_dummy_value()
    return types.none(ary, idx, v), codegen


@intrinsic
def vf_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_F8, [0.0] * 8)
    return f32x8(), codegen


@intrinsic
def vf_splat(typingctx, x):
    """A float32 scalar in every lane."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _F8)
    return f32x8(x), codegen


def _binary(name, fuse):
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, sig, args):
            flags = ("contract",) if fuse else ()
            return getattr(builder, name)(args[0], args[1], flags=flags)
        return f32x8(a, b), codegen
    return op


vf_add = _binary("fadd", True)
vf_mul = _binary("fmul", True)
vf_mul_rounded = _binary("fmul", False)         # never fused into a later add: rounds as a scalar product would
vf_sub_rounded = _binary("fsub", False)


@intrinsic
def vf_fma(typingctx, a, b, c):
    """a * b + c lane by lane; the product and sum may fuse into one rounding where the target has FMA."""
    def codegen(context, builder, sig, args):
        p = builder.fmul(args[0], args[1], flags=("contract",))
        return builder.fadd(p, args[2], flags=("contract",))
    return f32x8(a, b, c), codegen


@intrinsic
def vf_sum(typingctx, v):
    """The 8 lanes' sum, always in the order ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)): a float32."""
    def codegen(context, builder, sig, args):
        v = args[0]
        u = ir.Constant(_F8, ir.Undefined)
        h = builder.fadd(builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3])),
                         builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7])))
        u4 = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
        q = builder.fadd(builder.shuffle_vector(h, u4, ir.Constant(ir.VectorType(_I32, 2), [0, 1])),
                         builder.shuffle_vector(h, u4, ir.Constant(ir.VectorType(_I32, 2), [2, 3])))
        return builder.fadd(builder.extract_element(q, ir.Constant(_I32, 0)),
                            builder.extract_element(q, ir.Constant(_I32, 1)))
    return types.float32(v), codegen


# ---- U8x32 ----------------------------------------------------------------------------------------
@intrinsic
def vb_load(typingctx, ary, idx):
    """ary[idx:idx + 32] of a 1-D uint8 (or int8) array as 32 byte lanes."""
    def codegen(context, builder, sig, args):
        return _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _B32))
    return u8x32(ary, idx), codegen


@intrinsic
def vb_nibbles(typingctx, ary, idx):
    """The 16 bytes ary[idx:idx + 16] as 32 lanes: their low nibbles in lanes 0-15, high nibbles in 16-31
    (the order of Q5_0's and Q4_K's values)."""
    def codegen(context, builder, sig, args):
        b = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], _B16))
        lo = builder.and_(b, ir.Constant(_B16, [15] * 16))
        hi = builder.lshr(b, ir.Constant(_B16, [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return u8x32(ary, idx), codegen


@intrinsic
def vb_bits(typingctx, word, on, off):
    """Lane j = `on` where bit j of the uint32 `word` is set, else `off` (bytes; Q5_0's fifth bits)."""
    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        val_on = _splat(builder, context.cast(builder, args[1], sig.args[1], types.uint8), _B32)
        val_off = _splat(builder, context.cast(builder, args[2], sig.args[2], types.uint8), _B32)
        bytes4 = builder.bitcast(w, ir.VectorType(ir.IntType(8), 4))     # little-endian: byte k = bits 8k..8k+7
        spread = builder.shuffle_vector(bytes4, ir.Constant(ir.VectorType(ir.IntType(8), 4), ir.Undefined),
                                        ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, ir.Constant(_B32, [1 << (j % 8) for j in range(32)]))
        is_set = builder.icmp_unsigned("!=", bit, ir.Constant(_B32, [0] * 32))
        return builder.select(is_set, val_on, val_off)
    return u8x32(word, on, off), codegen


def _byte_op(name):
    @intrinsic
    def op(typingctx, a, b):
        """a <op> b in byte lanes; b a U8x32 or a scalar (taken modulo 256, in every lane)."""
        def codegen(context, builder, sig, args):
            rhs = args[1]
            if sig.args[1] != u8x32:
                rhs = _splat(builder, context.cast(builder, rhs, sig.args[1], types.uint8), _B32)
            return getattr(builder, name)(args[0], rhs)
        return u8x32(a, b), codegen
    return op


vb_and = _byte_op("and_")
vb_or = _byte_op("or_")
vb_sub = _byte_op("sub")
vb_add = _byte_op("add")
vb_shr = _byte_op("lshr")                        # logical: zeros shifted in
vb_shl = _byte_op("shl")


@intrinsic
def vb_to_f32(typingctx, v):
    """The 32 lanes read as signed bytes (-128..127), converted exactly: four F32x8 of lanes 0-7 ... 24-31."""
    def codegen(context, builder, sig, args):
        u = ir.Constant(_B32, ir.Undefined)
        out = []
        for k in range(4):
            part = builder.shuffle_vector(args[0], u, ir.Constant(ir.VectorType(_I32, 8), list(range(8 * k, 8 * k + 8))))
            out.append(builder.sitofp(part, _F8))
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(f32x8, 4)(v), codegen


# ---- scalars --------------------------------------------------------------------------------------
def _word_loader(bits):
    @intrinsic
    def load(typingctx, ary, idx):
        """The little-endian unsigned word at byte offset idx of a 1-D uint8 array (any alignment)."""
        def codegen(context, builder, sig, args):
            v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(bits)))
            return builder.zext(v, ir.IntType(64)) if bits < 64 else v
        return types.uint64(ary, idx), codegen
    return load


load_u16 = _word_loader(16)
load_u32 = _word_loader(32)


# ---- integer dot products of byte lanes (int8 activations) -----------------------------------------
# dot4(a, b): F32x8 whose lane k is the exact integer sum a[4k]*b[4k] + ... + a[4k+3]*b[4k+3] of the 32
# byte lanes, converted to float32 (exact: |sum| <= 4 * 128 * 127 < 2^24); b signed, -127..127; a signed
# (-128..127), or with a_unsigned 0..128 (Q4_K's 0..15). Two spellings of the same integers:
#   target-independent IR: bytes widened to 16 bits, multiplied, adjacent pairs added twice (32 bits)
#   x86 AVX2:              vpmaddubsw (unsigned bytes x signed bytes, adjacent pairs summed into 16 bits)
#                          + vpmaddwd by ones (adjacent 16-bit pairs -> 32 bits); a signed `a` goes in as
#                          |a| with its sign moved onto b (vpsignb), as llama.cpp does
# In those ranges a pair is at most 2 * 128 * 127 = 32512 < 2^15: vpmaddubsw never saturates, so both
# give the same lanes bit for bit. vb_udot4_minus subtracts 8 int32 lanes from an array before the
# conversion (Q6_K's q - 32 as the unsigned q times xq, less 32 x the lane's sum of xq: the same lanes).
_I16x16, _I32x8, _I16x32, _I32x16 = (ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8),
                                     ir.VectorType(ir.IntType(16), 32), ir.VectorType(_I32, 16))


def _pairs(builder, v, vty, wide):
    """Adjacent lanes of v (vector type vty) sign-extended to `wide` lanes and added: half as many lanes."""
    n = vty.count
    u = ir.Constant(vty, ir.Undefined)
    even = builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(_I32, n // 2), list(range(0, n, 2))))
    odd = builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(_I32, n // 2), list(range(1, n, 2))))
    w = ir.VectorType(wide, n // 2)
    return builder.add(builder.sext(even, w), builder.sext(odd, w))


def _declare(module, name, ret, *params):
    """The function `name` (an LLVM intrinsic) declared once in module."""
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, list(params)), name=name)


def _dot4(avx2, a_unsigned, minus=False):
    def codegen(context, builder, sig, args):
        a, b = args[:2]
        if avx2:
            m = builder.module
            if not a_unsigned:
                sign = _declare(m, "llvm.x86.avx2.psign.b", _B32, _B32, _B32)
                a, b = builder.call(sign, [a, a]), builder.call(sign, [b, a])     # |a|, b * sign(a)
            p16 = builder.call(_declare(m, "llvm.x86.avx2.pmadd.ub.sw", _I16x16, _B32, _B32), [a, b])
            p32 = builder.call(_declare(m, "llvm.x86.avx2.pmadd.wd", _I32x8, _I16x16, _I16x16),
                               [p16, ir.Constant(_I16x16, [1] * 16)])
        else:
            wide_a = builder.zext(a, _I16x32) if a_unsigned else builder.sext(a, _I16x32)
            prod = builder.mul(wide_a, builder.sext(b, _I16x32))                # |a b| <= 128 * 127: 16 bits
            p16 = _pairs(builder, prod, _I16x32, _I32)                           # i32 x 16 (no overflow)
            u = ir.Constant(_I32x16, ir.Undefined)
            even = builder.shuffle_vector(p16, u, ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2))))
            odd = builder.shuffle_vector(p16, u, ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2))))
            p32 = builder.add(even, odd)
        if minus:                                                                # less c[i:i + 8]
            p32 = builder.sub(p32, _load(builder, _ptr(context, builder, sig.args[2], args[2], args[3], _I32x8)))
        return builder.sitofp(p32, _F8)

    if minus:
        @intrinsic
        def dot4_minus(typingctx, a, b, c, i):
            """dot4(a, b) less the int32 lanes c[i:i + 8] (a 1-D int32 array), before the conversion."""
            return f32x8(a, b, c, i), codegen
        return dot4_minus

    @intrinsic
    def dot4(typingctx, a, b):
        return f32x8(a, b), codegen
    return dot4


vb_dot4 = _dot4(False, False)                    # any target
vb_udot4 = _dot4(False, True)
vb_udot4_minus = _dot4(False, True, minus=True)
vb_dot4_avx2 = _dot4(True, False)                # x86 with AVX2 only (LLVM cannot select it elsewhere)
vb_udot4_avx2 = _dot4(True, True)
vb_udot4_minus_avx2 = _dot4(True, True, minus=True)


@intrinsic
def vf_halves(typingctx, a, b):
    """a in lanes 0-3, b in lanes 4-7 (float32 scalars): a scale per 16 bytes of a dot4's 32."""
    def codegen(context, builder, sig, args):
        v = ir.Constant(_F8, ir.Undefined)
        a = context.cast(builder, args[0], sig.args[0], types.float32)
        b = context.cast(builder, args[1], sig.args[1], types.float32)
        for k in range(8):
            v = builder.insert_element(v, a if k < 4 else b, ir.Constant(_I32, k))
        return v
    return f32x8(a, b), codegen


@intrinsic
def vf_i8(typingctx, ary, idx):
    """The 8 signed bytes ary[idx:idx + 8] of a 1-D uint8 array as float32 lanes (exact)."""
    def codegen(context, builder, sig, args):
        b = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], ir.VectorType(ir.IntType(8), 8)))
        return builder.sitofp(builder.sext(b, _I32x8), _F8)
    return f32x8(ary, idx), codegen


@intrinsic
def vf_spread_pairs(typingctx, v):
    """Four F32x8 from the lanes of v: the k-th has lane 2k in lanes 0-3 and lane 2k + 1 in lanes 4-7 (Q6_K's
    sub-block scales of 16 values, two to a run of 32)."""
    def codegen(context, builder, sig, args):
        u = ir.Constant(_F8, ir.Undefined)
        out = [builder.shuffle_vector(args[0], u, ir.Constant(ir.VectorType(_I32, 8), [2 * k] * 4 + [2 * k + 1] * 4))
               for k in range(4)]
        return context.make_tuple(builder, sig.return_type, out)
    return types.UniTuple(f32x8, 4)(v), codegen


@intrinsic
def vf_bytes(typingctx, word):
    """Byte k of the uint64 `word` (bits 8k..8k+7, unsigned) in lane k, as float32 (exact)."""
    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[0], sig.args[0], types.uint64)
        b = builder.bitcast(w, ir.VectorType(ir.IntType(8), 8))
        return builder.sitofp(builder.zext(b, _I32x8), _F8)
    return f32x8(word), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32 as a uint32 (and f32_from_bits back)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _I32)
    return types.uint32(x), codegen


@intrinsic
def f32_from_bits(typingctx, u):
    def codegen(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())
    return types.float32(u), codegen


@functools.cache
def target_has_avx2():
    """Whether the CPU numba compiles for has AVX2 (its target's features: the host's, or none under
    NUMBA_CPU_NAME=generic), so the _avx2 dot products can be selected. Fixed for the process (numba
    reads its target once), so asked once: the question took ~5 us, a tenth of a small layer's call."""
    from numba.core.registry import cpu_target

    codegen = cpu_target.target_context.codegen()
    return "+avx2" in str(getattr(codegen, "_tm_features", "")).split(",")


@intrinsic
def prefetch(typingctx, ary, idx):
    """A hint to bring the cache line holding byte idx of the 1-D array ary into the cache (for reading,
    kept: llvm.prefetch, any target; a no-op where the target has no such instruction)."""
    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8))
        fn = _declare(builder.module, "llvm.prefetch.p0", ir.VoidType(), p.type, _I32, _I32, _I32)
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(ary, idx), codegen
