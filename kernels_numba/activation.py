"""SiLU-and-mul over the merged gate_up projection, in numba.cuda: the MLP's glue in one kernel.

    x = [gate | up]   [T, 2 I]  (one GEMM with the gate and up rows of the weight stacked)
    out = round(round(silu(gate)) * up)   [T, I],   silu(g) = g / (1 + exp(-g)) in float32

the roundings of Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)` in torch eager mode (silu's result is
stored in the dtype before the product), so the kernel matches it up to expf's last bit. torch runs this as
two kernels and one more intermediate tensor.

Grid (T, ceil(I / 8 / THREADS)): thread j of CTA (t, b) owns the 8 outputs (16 bytes) of chunk
b * THREADS + j of row t, reading 16 bytes of gate and 16 of up (LDG.E.128) and writing one STG.E.128.
I must be a multiple of 8 and the rows 16-byte aligned. Pure streaming: 6 bytes moved per output.
"""
import math
from functools import lru_cache

from numba import cuda, float32

from kernels_numba import bridge
from kernels_numba.bridge import words
from kernels_numba.common import check_tensor, load_u32x4, pack2, store_u32x4, unpack2
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel
from kernels_numba.rmsnorm import check_rows, row_words

THREADS = 128


@cuda.jit(device=True)
def _silu_mul_pair(g, u, bf16):
    g0, g1 = unpack2(g, bf16)
    u0, u1 = unpack2(u, bf16)
    one = float32(1.0)
    s0, s1 = unpack2(pack2(g0 / (one + float32(math.exp(-g0))), g1 / (one + float32(math.exp(-g1))), bf16), bf16)
    return pack2(s0 * u0, s1 * u1, bf16)


@bridge.disk_cached
@lru_cache(maxsize=None)
def _make_kernel(is_bf16):
    BF16 = is_bf16

    @cuda.jit
    def silu_and_mul_kernel(x, x_stride, out, o_stride, chunks):
        # x: rows of 2 I halves as words (gate: words [0, I/2), up: [I/2, I)); out: rows of I halves.
        # chunks = I / 8.
        t = cuda.blockIdx.x
        c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if c >= chunks:
            return
        g0, g1, g2, g3 = load_u32x4(x, t * x_stride + 4 * c)
        u0, u1, u2, u3 = load_u32x4(x, t * x_stride + 4 * chunks + 4 * c)
        store_u32x4(out, t * o_stride + 4 * c, _silu_mul_pair(g0, u0, BF16), _silu_mul_pair(g1, u1, BF16),
                    _silu_mul_pair(g2, u2, BF16), _silu_mul_pair(g3, u3, BF16))

    return silu_and_mul_kernel


def silu_and_mul(x, out=None, validate=True):
    """out = silu(x[:, :I]) * x[:, I:] with HF's roundings.

    x: [T, 2 I] float16/bfloat16 (gate then up; rows contiguous, 16-byte aligned; I % 8 == 0)
    out: optional [T, I] in x's dtype. validate: check shapes, dtypes, strides, alignment (host, no sync).
    Returns out. Runs on torch's current stream (capturable in a CUDA graph).
    """
    import torch

    T, two_i = x.shape
    inter = two_i // 2
    if validate:
        check_rows("x", x, two_i, (torch.float16, torch.bfloat16))
        if two_i % 16:
            raise KernelLaunchError(f"x must be [T, 2 I] with I a multiple of 8, got {tuple(x.shape)}")
        if out is not None:
            check_tensor("out", out, 2, (x.dtype,))
            check_rows("out", out, inter, (x.dtype,))
            if out.shape[0] != T:
                raise KernelLaunchError(f"out must be [{T}, {inter}], got {tuple(out.shape)}")
    if out is None:
        out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    chunks = inter // 8
    launch_kernel(_make_kernel(x.dtype == torch.bfloat16), (T, -(-chunks // THREADS)), THREADS,
           (words(x), row_words(x), words(out), row_words(out), chunks))
    return out

