"""Device helpers shared by every numba kernel: packed fp16/bf16 math and wide loads.

numba-cuda has no half2 type and no 128-bit vector loads, so this module makes them from
LLVM IR with `numba.cuda.extending.intrinsic`:

    pair of halves   = one uint32 (low 16 bits: element 2i, high 16 bits: element 2i+1)
    fma_f16x2(a,b,c) = llvm.fma.v2f16   -> PTX fma.rn.f16x2   -> SASS HFMA2
    fma_bf16x2       = llvm.fma.v2bf16  -> PTX fma.rn.bf16x2  -> SASS HFMA2.BF16
    load_u32x4(a, i) = load <4 x i32>, align 16 of a[i:i+4] -> PTX ld.global.v4.u32 -> LDG.E.128

Half-precision tensors travel to kernels as *raw bits*: the launcher views an fp16/bf16
tensor as uint16 (one element) or uint32 (a pair), and kernels convert with the helpers
below. That keeps one kernel body for fp16 and bf16 (the converter is chosen when the
kernel is built) and lets the same code run under the CUDA simulator, where every helper
has a numpy fallback with the same name and signature.

Stable API (other kernels import these):
    SIMULATOR                                   True under NUMBA_ENABLE_CUDASIM=1
    load_u32x4(arr_u32, i) -> (u32, u32, u32, u32)        16-byte load, i % 4 == 0
    cp_async16(dst_shared_u32, i, src_global_u32, j)     16-byte asynchronous copy global -> shared
                                      (PTX cp.async.cg, bypasses L1; SASS LDGSTS), i, j % 4 == 0
    cp_async_commit()                 close the thread's group of cp.async copies issued so far
    cp_async_wait(n)() -> None        a device function: wait until at most n groups are pending
                                      (the thread's own copies are then visible to it)
    prefetch_l2(global_u32, i, nbytes)  ask the L2 for nbytes of the array from word i, not waiting
                                      (PTX cp.async.bulk.prefetch.L2, sm_90; the simulator checks the range)
    f32_bits(x) -> u32, f32_from_bits(u32) -> f32      reinterpret the 32 bits
    f16x2_to_f32(u32) -> (lo, hi)     bf16x2_to_f32(u32) -> (lo, hi)     (float32)
    f16_to_f32(u16) -> f32            bf16_to_f32(u16) -> f32             (int16/int32 bits too)
    f32_to_f16(x) -> u16              f32_to_bf16(x) -> u16               (round to nearest even)
    f32x2_to_f16x2(lo, hi) -> u32     f32x2_to_bf16x2(lo, hi) -> u32
    fma_f16x2(a, b, c) -> u32         fma_bf16x2(a, b, c) -> u32          (a*b+c per half)
    ex2(x) -> f32                     2**x on the SFU (ex2.approx.ftz.f32, one MUFU.EX2; ex2(-inf) = 0)
    mul_rn(a, b) -> f32               a*b rounded to float32 by itself (mul.rn.f32: never fused into an FMA)
    store_u32x4(arr_u32, i, a, b, c, d)  16-byte store of 4 words at arr[i:i+4] (STG.E.128), i % 4 == 0
    ldmatrix_x4(shared_u32, i) -> 4 x u32   four 8x8 b16 matrices of shared memory in mma fragment
    ldmatrix_x4_trans(shared_u32, i)     layout (PTX ldmatrix .x4, and .trans); this lane gives the
                                      16-byte row at word i of matrix lane // 8
    unpack2(u32, bf16) -> (lo, hi)    a pair of fp16/bf16 as float32 (bf16 a compile-time constant)
    pack2(lo, hi, bf16) -> u32        two float32 rounded to fp16/bf16 (nearest even), packed
    warp_sum(x), warp_max(x)          butterfly over 32 lanes with shfl_xor_sync, every lane gets it
    mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
    mma_m16n8k16_bf16(...)            warp-wide D = A B + C on tensor cores (PTX mma.sync, SASS HMMA):
                                      A 16x16 and B 16x8 in half pairs, C/D 16x8 float32, in the
                                      PTX fragment layout (lane = 4 * group + t):
                                      a0 = A[group, 2t:2t+2]     a1 = A[group+8, 2t:2t+2]
                                      a2 = A[group, 2t+8:2t+10]  a3 = A[group+8, 2t+8:2t+10]
                                      b0 = B[2t:2t+2, group]     b1 = B[2t+8:2t+10, group]
                                      c0, c1 = C[group, 2t], C[group, 2t+1]; c2, c3 = row group+8
"""
import numpy as np
from numba import cuda, types

# SIMULATOR and the host helpers live in bridge.py; importing them from here keeps working
from kernels_numba.bridge import SIMULATOR, check_tensor, torch_stream  # noqa: F401

FULL_MASK = 0xFFFFFFFF


def inline_device(fn):
    """A device function that NVVM inlines into every kernel calling it (LLVM's alwaysinline attribute).
    numba's own inline="always" inlines at the level of its IR instead, by deep-copying the callee's IR at
    every call site: the same PTX, but ~2/3 of the decode kernel's compile (10.7 -> 3.8 s for sm_90).
    The simulator's jit knows neither: there it is a plain device function."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)

if SIMULATOR:
    from kernels_numba import simulator as _sim

    _sim.install()

    def _halves(u, dt):
        return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(dt).astype(np.float32)

    def _u32(x):
        return np.uint32(int(x) & 0xFFFFFFFF)

    def load_u32x4(arr, i):
        return _u32(arr[i]), _u32(arr[i + 1]), _u32(arr[i + 2]), _u32(arr[i + 3])

    def cp_async16(dst, i, src, j):
        # the simulator has no asynchronous copies: the copy is done when it is issued
        dst[i : i + 4] = src[j : j + 4]

    def cp_async_commit():
        pass

    def prefetch_l2(arr, i, nbytes):
        # no cache to warm here; the range must be one the GPU may read (16-byte aligned, inside the array)
        if not (i >= 0 and i % 4 == 0 and nbytes % 16 == 0 and 0 < nbytes and i + nbytes // 4 <= arr.size):
            raise IndexError(f"prefetch_l2 of {nbytes} bytes at word {i} of an array of {arr.size} words")

    def cp_async_wait(n):
        return lambda: None

    def f32_bits(x):
        return np.array([x], dtype=np.float32).view(np.uint32)[0]

    def f32_from_bits(u):
        return np.array([int(u) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]

    def f16x2_to_f32(u):
        lo, hi = _halves(u, np.float16)
        return lo, hi

    def bf16x2_to_f32(u):
        u = int(u) & 0xFFFFFFFF
        lo = np.array([(u & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0]
        hi = np.array([u & 0xFFFF0000], dtype=np.uint32).view(np.float32)[0]
        return lo, hi

    def f16_to_f32(u):
        return np.float32(np.array([int(u) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    def bf16_to_f32(u):
        return np.array([(int(u) & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0]

    def f32_to_f16(x):
        with np.errstate(over="ignore"):  # inf, like cvt.rn.f16.f32
            return np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0]

    def f32_to_bf16(x):
        # round to nearest even on the top 16 bits (NaN stays NaN: the kernels never make one)
        b = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        b += 0x7FFF + ((b >> 16) & 1)
        return np.uint16((b >> 16) & 0xFFFF)

    def f32x2_to_f16x2(lo, hi):
        return np.uint32(int(f32_to_f16(lo)) | (int(f32_to_f16(hi)) << 16))

    def f32x2_to_bf16x2(lo, hi):
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))

    def _fma2(a, b, c, dt, pack):
        # the hardware rounds once per half (fused); float64 then one rounding matches it
        x = [int(v) & 0xFFFFFFFF for v in (a, b, c)]
        if dt is None:  # bf16
            f = [bf16x2_to_f32(v) for v in x]
        else:
            f = [_halves(v, dt) for v in x]
        lo = np.float64(f[0][0]) * np.float64(f[1][0]) + np.float64(f[2][0])
        hi = np.float64(f[0][1]) * np.float64(f[1][1]) + np.float64(f[2][1])
        return pack(np.float32(lo), np.float32(hi))

    def fma_f16x2(a, b, c):
        return _fma2(a, b, c, np.float16, f32x2_to_f16x2)

    def _mma(frag, unpack):
        lanes = _sim.warp_all(frag)
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        for lane, f in enumerate(lanes):
            g, t = lane >> 2, lane & 3
            a[g, 2 * t : 2 * t + 2] = unpack(f[0])
            a[g + 8, 2 * t : 2 * t + 2] = unpack(f[1])
            a[g, 2 * t + 8 : 2 * t + 10] = unpack(f[2])
            a[g + 8, 2 * t + 8 : 2 * t + 10] = unpack(f[3])
            b[2 * t : 2 * t + 2, g] = unpack(f[4])
            b[2 * t + 8 : 2 * t + 10, g] = unpack(f[5])
        d = a @ b
        lane = _sim.lane_id()
        g, t = lane >> 2, lane & 3
        c = frag[6:]
        return (np.float32(d[g, 2 * t] + c[0]), np.float32(d[g, 2 * t + 1] + c[1]),
                np.float32(d[g + 8, 2 * t] + c[2]), np.float32(d[g + 8, 2 * t + 1] + c[3]))

    def mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), f16x2_to_f32)

    def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), bf16x2_to_f32)

    def fma_bf16x2(a, b, c):
        return _fma2(a, b, c, None, f32x2_to_bf16x2)

    def ex2(x):
        return np.float32(np.exp2(np.float32(x)))

    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    def store_u32x4(arr, i, a, b, c, d):
        arr[i], arr[i + 1], arr[i + 2], arr[i + 3] = a, b, c, d

    def ldmatrix_x4(arr, i):
        """Of matrix 0..3, the word (row lane // 4, halves 2 (lane % 4), +1)."""
        rows = _sim.warp_all((arr, int(i)))  # each lane's row address (arrays are shared: one block)
        lane = _sim.lane_id()
        g, t = lane >> 2, lane & 3
        words = []
        for m in range(4):
            a, j = rows[8 * m + g]
            words.append(np.uint32(int(a[j + t]) & 0xFFFFFFFF))
        return tuple(words)

    def _row_half(a, j, col):
        # half `col` (0..7) of the 16-byte row at word j of a
        return (int(a[j + col // 2]) >> (16 * (col % 2))) & 0xFFFF

    def ldmatrix_x4_trans(arr, i):
        """Of matrix m this lane receives the halves (row 2t, col g) (low) and (row 2t + 1, col g)
        (high), lane = 4 g + t."""
        rows = _sim.warp_all((arr, int(i)))
        lane = _sim.lane_id()
        g, t = lane >> 2, lane & 3
        words = []
        for m in range(4):
            lo = _row_half(*rows[8 * m + 2 * t], g)
            hi = _row_half(*rows[8 * m + 2 * t + 1], g)
            words.append(np.uint32(lo | (hi << 16)))
        return tuple(words)

else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i16, _i32 = ir.IntType(16), ir.IntType(32)
    _f32 = ir.FloatType()
    _half = ir.HalfType()
    _v2half = ir.VectorType(_half, 2)
    _v2i16 = ir.VectorType(_i16, 2)
    _v4i32 = ir.VectorType(_i32, 4)

    def _asm(builder, ret, args, text, constraints, side_effect=False):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def _item_pointer(context, builder, aryty, ary_val, idxty, idx_val):
        """Generic pointer to ary[idx] of a 1-D array."""
        ary = context.make_array(aryty)(context, builder, ary_val)
        i = context.cast(builder, idx_val, idxty, types.intp)
        return cgutils.get_item_pointer(context, builder, aryty, ary, [i], wraparound=False)

    def _space_address(context, builder, aryty, ary_val, idxty, idx_val, space, int_type):
        """Address of ary[idx] in a state space (3: shared, as 32 bits; 1: global), converted by
        LLVM (addrspacecast), not inside the asm: the conversion of the array's base is then
        loop-invariant code that LLVM hoists, and the index becomes a plain add."""
        ptr = _item_pointer(context, builder, aryty, ary_val, idxty, idx_val)
        spaced = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, addrspace=space))
        return builder.ptrtoint(spaced, int_type)

    def _is_u32_vector(arr):
        return isinstance(arr, types.Array) and arr.dtype in (types.uint32, types.int32) and arr.ndim == 1

    @intrinsic
    def cp_async16(typingctx, dst, i, src, j):
        """dst: 1-D uint32 shared array, src: 1-D uint32/int32 global array; i, j % 4 == 0."""
        if not (_is_u32_vector(dst) and _is_u32_vector(src)):
            return None
        sig = types.void(dst, i, src, j)

        def codegen(context, builder, sig, args):
            d = _space_address(context, builder, sig.args[0], args[0], sig.args[1], args[1], 3, _i32)
            g = _space_address(context, builder, sig.args[2], args[2], sig.args[3], args[3], 1, ir.IntType(64))
            _asm(builder, ir.VoidType(), [d, g], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, arr, i, nbytes):
        """Ask the L2 to load nbytes (a multiple of 16) of arr (1-D uint32/int32, global) from word i (i % 4
        == 0) from DRAM, without waiting and without any register (cp.async.bulk.prefetch.L2, sm_90)."""
        if not (_is_u32_vector(arr) and isinstance(nbytes, types.Integer)):
            return None
        sig = types.void(arr, i, nbytes)

        def codegen(context, builder, sig, args):
            g = _space_address(context, builder, sig.args[0], args[0], sig.args[1], args[1], 1, ir.IntType(64))
            n = context.cast(builder, args[2], sig.args[2], types.uint32)
            _asm(builder, ir.VoidType(), [g, n], "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    _WAITS = {}

    def cp_async_wait(n):
        """A device function that waits until at most n of the thread's cp.async groups are pending."""
        if n not in _WAITS:
            @intrinsic
            def wait(typingctx):
                sig = types.void()

                def codegen(context, builder, sig, args):
                    _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {int(n)};", "~{memory}",
                         side_effect=True)
                    return context.get_dummy_value()

                return sig, codegen

            _WAITS[n] = wait
        return _WAITS[n]

    @intrinsic
    def f32_bits(typingctx, x):
        if not isinstance(x, types.Float):
            return None
        sig = types.uint32(x)

        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _i32)

        return sig, codegen

    @intrinsic
    def f32_from_bits(typingctx, u):
        if not isinstance(u, types.Integer):
            return None
        sig = types.float32(u)

        def codegen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), _f32)

        return sig, codegen

    @intrinsic
    def load_u32x4(typingctx, arr, idx):
        """arr: 1-D uint32 or int32 array (global or shared); idx % 4 == 0. Returns 4 uint32."""
        ok_dtype = isinstance(arr, types.Array) and arr.dtype in (types.uint32, types.int32)
        if not (ok_dtype and arr.ndim == 1):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vptr = builder.bitcast(ptr, _v4i32.as_pointer())
            vec = builder.load(vptr, align=16)
            elems = [builder.extract_element(vec, ir.Constant(_i32, k)) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    def _pair_to_f32(builder, u32, bf16):
        lo16 = builder.trunc(u32, _i16)
        hi16 = builder.trunc(builder.lshr(u32, ir.Constant(_i32, 16)), _i16)
        if bf16:  # bf16 is the top half of an fp32: shift into place
            lo = builder.bitcast(builder.shl(u32, ir.Constant(_i32, 16)), _f32)
            hi = builder.bitcast(builder.and_(u32, ir.Constant(_i32, 0xFFFF0000)), _f32)
        else:
            lo = builder.fpext(builder.bitcast(lo16, _half), _f32)
            hi = builder.fpext(builder.bitcast(hi16, _half), _f32)
        return lo, hi

    def _make_pair_to_f32(bf16):
        @intrinsic
        def impl(typingctx, u):
            if not isinstance(u, types.Integer):
                return None
            sig = types.UniTuple(types.float32, 2)(u)

            def codegen(context, builder, sig, args):
                u32 = context.cast(builder, args[0], sig.args[0], types.uint32)
                lo, hi = _pair_to_f32(builder, u32, bf16)
                return context.make_tuple(builder, sig.return_type, [lo, hi])

            return sig, codegen

        return impl

    f16x2_to_f32 = _make_pair_to_f32(False)
    bf16x2_to_f32 = _make_pair_to_f32(True)

    def _make_one_to_f32(bf16):
        @intrinsic
        def impl(typingctx, u):
            if not isinstance(u, types.Integer):
                return None
            sig = types.float32(u)

            def codegen(context, builder, sig, args):
                u32 = context.cast(builder, args[0], sig.args[0], types.uint32)
                u32 = builder.and_(u32, ir.Constant(_i32, 0xFFFF))
                return _pair_to_f32(builder, u32, bf16)[0]

            return sig, codegen

        return impl

    f16_to_f32 = _make_one_to_f32(False)
    bf16_to_f32 = _make_one_to_f32(True)

    def _make_f32_to_16(ptx_type):
        @intrinsic
        def impl(typingctx, x):
            if not isinstance(x, types.Float):
                return None
            sig = types.uint16(x)

            def codegen(context, builder, sig, args):
                xf = context.cast(builder, args[0], sig.args[0], types.float32)
                return _asm(builder, _i16, [xf], f"cvt.rn.{ptx_type}.f32 $0, $1;", "=h,f")

            return sig, codegen

        return impl

    f32_to_f16 = _make_f32_to_16("f16")
    f32_to_bf16 = _make_f32_to_16("bf16")

    def _make_f32x2_to_16x2(ptx_type):
        @intrinsic
        def impl(typingctx, lo, hi):
            if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
                return None
            sig = types.uint32(lo, hi)

            def codegen(context, builder, sig, args):
                lof = context.cast(builder, args[0], sig.args[0], types.float32)
                hif = context.cast(builder, args[1], sig.args[1], types.float32)
                # cvt.rn.f16x2.f32 d, a, b puts a in the upper half, b in the lower
                return _asm(builder, _i32, [hif, lof], f"cvt.rn.{ptx_type}.f32 $0, $1, $2;", "=r,f,f")

            return sig, codegen

        return impl

    f32x2_to_f16x2 = _make_f32x2_to_16x2("f16x2")
    f32x2_to_bf16x2 = _make_f32x2_to_16x2("bf16x2")

    def _make_fma2(bf16):
        @intrinsic
        def impl(typingctx, a, b, c):
            if not all(isinstance(t, types.Integer) for t in (a, b, c)):
                return None
            sig = types.uint32(a, b, c)

            def codegen(context, builder, sig, args):
                vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
                if bf16:
                    # NVVM's bfloat vector support varies by version: inline PTX is exact
                    return _asm(builder, _i32, vals, "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
                vecs = [builder.bitcast(v, _v2half) for v in vals]
                mod = builder.module
                fn = cgutils.get_or_insert_function(
                    mod, ir.FunctionType(_v2half, [_v2half] * 3), "llvm.fma.v2f16"
                )
                return builder.bitcast(builder.call(fn, vecs), _i32)

            return sig, codegen

        return impl

    fma_f16x2 = _make_fma2(False)
    fma_bf16x2 = _make_fma2(True)

    def _make_mma(ab_type):
        @intrinsic
        def impl(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            ints, floats = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
            if not (all(isinstance(t, types.Integer) for t in ints)
                    and all(isinstance(t, types.Float) for t in floats)):
                return None
            sig = types.UniTuple(types.float32, 4)(*ints, *floats)

            def codegen(context, builder, sig, args):
                vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
                vals += [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
                ret = ir.LiteralStructType([_f32] * 4)
                text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32 "
                        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
                res = _asm(builder, ret, vals, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                elems = [builder.extract_value(res, k) for k in range(4)]
                return context.make_tuple(builder, sig.return_type, elems)

            return sig, codegen

        return impl

    mma_m16n8k16_f16 = _make_mma("f16")
    mma_m16n8k16_bf16 = _make_mma("bf16")

    @intrinsic
    def ex2(typingctx, x):
        """2**x by the SFU (ex2.approx.ftz.f32: one MUFU.EX2, rel. error ~2**-22; ex2(-inf) = 0)."""
        if not isinstance(x, types.Float):
            return None
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            xf = context.cast(builder, args[0], sig.args[0], types.float32)
            return _asm(builder, _f32, [xf], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

        return sig, codegen

    @intrinsic
    def mul_rn(typingctx, a, b):
        """a*b rounded to float32 on its own (mul.rn.f32: the compiler never contracts it into an FMA, which it
        may do for a*b + c in one unrolled copy of a loop and not in another)."""
        if not (isinstance(a, types.Float) and isinstance(b, types.Float)):
            return None
        sig = types.float32(a, b)

        def codegen(context, builder, sig, args):
            af, bf = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
            return _asm(builder, _f32, [af, bf], "mul.rn.f32 $0, $1, $2;", "=f,f,f")

        return sig, codegen

    @intrinsic
    def store_u32x4(typingctx, arr, idx, a, b, c, d):
        """arr: 1-D uint32/int32 array; idx % 4 == 0 (16-byte aligned). Stores a, b, c, d at arr[idx:idx+4]."""
        if not _is_u32_vector(arr) or not all(isinstance(t, types.Integer) for t in (idx, a, b, c, d)):
            return None
        sig = types.void(arr, idx, a, b, c, d)

        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = ir.Constant(_v4i32, ir.Undefined)
            for k, (val, ty) in enumerate(zip(args[2:], sig.args[2:])):
                vec = builder.insert_element(vec, context.cast(builder, val, ty, types.uint32), ir.Constant(_i32, k))
            builder.store(vec, builder.bitcast(ptr, _v4i32.as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen

    def _make_ldmatrix(trans):
        text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "")
                + ".shared.b16 {$0, $1, $2, $3}, [$4];")

        @intrinsic
        def impl(typingctx, arr, idx):
            if not (_is_u32_vector(arr) and isinstance(idx, types.Integer)):
                return None
            sig = types.UniTuple(types.uint32, 4)(arr, idx)

            def codegen(context, builder, sig, args):
                addr = _space_address(context, builder, sig.args[0], args[0], sig.args[1], args[1], 3, _i32)
                # the memory clobber keeps it after the barrier that publishes the tile
                res = _asm(builder, ir.LiteralStructType([_i32] * 4), [addr], text, "=r,=r,=r,=r,r,~{memory}")
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])

            return sig, codegen

        return impl

    ldmatrix_x4 = _make_ldmatrix(False)
    ldmatrix_x4_trans = _make_ldmatrix(True)


@cuda.jit(device=True)
def unpack2(u, bf16):
    """A pair of fp16/bf16 (low half first) as two float32."""
    if bf16:
        return bf16x2_to_f32(u)
    return f16x2_to_f32(u)


@cuda.jit(device=True)
def pack2(lo, hi, bf16):
    """Two float32 rounded to fp16/bf16 and packed (lo in the low half)."""
    if bf16:
        return f32x2_to_bf16x2(lo, hi)
    return f32x2_to_f16x2(lo, hi)


@cuda.jit(device=True)
def warp_sum(x):
    """Sum of x over the 32 lanes of the warp; every lane receives it."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 16)
    x += cuda.shfl_xor_sync(FULL_MASK, x, 8)
    x += cuda.shfl_xor_sync(FULL_MASK, x, 4)
    x += cuda.shfl_xor_sync(FULL_MASK, x, 2)
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x


@cuda.jit(device=True)
def warp_max(x):
    """Max of x over the 32 lanes of the warp; every lane receives it."""
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 16))
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 8))
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 4))
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))
    x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return x
