"""The pieces the decode kernels share, each written once: the production kernel (paged_attention.py)
is built from them, and so is the journey (decode_journey_*.py), whose own pieces (v4's split-KV
launch and merge kernel) are in decode_journey_cuda_core.py; v10's own split-KV merge is in
paged_attention.py.

Host side
    LaunchArgs                  raw-bit views of a launch's tensors plus its geometry
    ring_bytes(...)             shared memory of a cp.async ring
    check_supported(...), check_args(...), check_block_tables(...)
                                the entry points' checks (geometry; shapes, dtypes, devices; values)
    launch_args(...)            LaunchArgs of raw-bit arrays (the low-level launchers)
    torch_launch_args(...)      (LaunchArgs, out) of checked torch tensors (the torch entry points)

Device side (numba device functions, inlined; each factory is cached per compile-time shape)
    lane_roles(tid)             (warp, lane, g, t) of a thread
    make_warp_start(...)        start_warp: this lane's mma A fragments of q (the group's heads as
                                rows) and the online softmax's empty state
    make_mma_step(...)          compute_chunk: S = Q K^T, online softmax, O += P V for 16 tokens
    make_warp_merge(...)        stash a warp's (max, sum, accumulator) in shared memory; combine_pair
                                merges the CTA's warps for two dims of one head
    make_ring(...)              attend_partition: a CTA's warps stream a partition through their
                                cp.async rings; their softmax states are left in shared memory

The fragment layouts are those of PTX's mma.m16n8k16 (lane = 4 * g + t; see common.py). A 16-token
chunk of K/V, per lane: K of tokens g and 8 + g (words of D/4 dims), V of tokens 2t, 2t + 1, 8 + 2t,
9 + 2t (D/8 dims from DPC * g), which is what compute_chunk multiplies.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba import bridge
from kernels_numba.common import (
    FULL_MASK,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    f32_bits,
    f32_from_bits,
    f32x2_to_bf16x2,
    f32x2_to_f16x2,
    inline_device,
    load_u32x4,
    mma_m16n8k16_bf16,
    mma_m16n8k16_f16,
)
from kernels_numba.errors import KernelLaunchError

LOG2E = 1.4426950408889634
NEG_INF = float32(-math.inf)
CHUNK = 16  # tokens of one mma step: one k-slice of P V, two n-tiles of Q K^T
MAX_SPLITS = 128  # production: partitions per context a merge takes (its weights live in shared memory)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)


def pairs(x16):
    """A 16-bit array viewed as pairs (last dim halved), numpy or numba device array."""
    return x16.view(np.uint32 if x16.dtype == np.uint16 else np.int32)


@dataclass
class LaunchArgs:
    """Everything a version's launcher needs: raw-bit views of the tensors plus geometry.

    scratch(shape, dtype=np.float32, zero=False) -> an array on the launch's device (zero=True: all
    zero, and left zero by the kernel that uses it)."""

    q16: object  # [S, H, D] 16-bit
    k16: object  # [NB, KVH, BS, D] 16-bit
    v16: object
    block_tables: object  # [S, M] int32
    context_lens: object  # [S] int32
    out16: object  # [S, H, D] 16-bit
    scale: float
    is_bf16: bool
    max_context_len: int
    scratch: object
    q32: object = None  # [S, H, D/2] pairs
    k32_4d: object = None  # [NB, KVH, BS, D/2] pairs
    v32_4d: object = None
    k32: object = None  # flat pairs
    v32: object = None
    out32: object = None  # [S, H, D/2] pairs
    num_sms: int = 132  # H200

    def __post_init__(self):
        self.num_seqs, self.num_heads, self.head_dim = self.q16.shape
        _, self.num_kv_heads, self.block_size, _ = self.k16.shape
        self.group = self.num_heads // self.num_kv_heads
        self.scale = float32(self.scale)
        if self.q32 is None:
            self.q32, self.out32 = pairs(self.q16), pairs(self.out16)
        if self.k32_4d is None:
            self.k32_4d, self.v32_4d = pairs(self.k16), pairs(self.v16)
        if self.k32 is None:
            self.k32, self.v32 = self.k32_4d.reshape(-1), self.v32_4d.reshape(-1)


def ring_bytes(head_dim, stages, warps):
    """A cp.async ring: warps x stages x one 16-token chunk of K and V."""
    return warps * stages * 2 * CHUNK * head_dim * 2


# ----------------------------------------------------------------------------------------------
# the entry points' arguments: the checks, then LaunchArgs from raw arrays or torch tensors


def check_supported(num_heads, num_kv_heads, head_dim, block_size):
    """Raise KernelLaunchError for a geometry no version supports."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise KernelLaunchError(f"head_dim={head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise KernelLaunchError(
            f"block_size={block_size} is not supported (supported: {SUPPORTED_BLOCK_SIZES})"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise KernelLaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def check_args(q, k_cache, v_cache, block_tables, context_lens, out):
    """Shapes, dtypes, devices (host only, no sync). Raises KernelLaunchError."""
    import torch

    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                 context_lens=context_lens)
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise KernelLaunchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise KernelLaunchError(f"{name} must be contiguous")
    if q.dim() != 3:
        raise KernelLaunchError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelLaunchError(
            f"k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise KernelLaunchError(f"q head_dim={head_dim} but the pool has head_dim={kv_dim}")
    check_supported(num_heads, num_kv_heads, head_dim, block_size)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise KernelLaunchError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelLaunchError(f"k_cache/v_cache dtype ({k_cache.dtype}/{v_cache.dtype}) must equal q's ({q.dtype})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise KernelLaunchError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (num_seqs,):
        raise KernelLaunchError(
            f"context_lens must be int32 [num_seqs={num_seqs}], got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise KernelLaunchError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise KernelLaunchError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = q.device
    if device.type != "cuda" and not (bridge.SIMULATOR and device.type == "cpu"):
        raise KernelLaunchError(f"tensors must be on a CUDA device, got {device}")
    if num_seqs == 0 or block_tables.shape[1] == 0:
        raise KernelLaunchError("num_seqs and max_blocks must be >= 1")


def check_block_tables(block_tables, context_lens, num_blocks, block_size, max_context_len):
    """Value checks (one device->host sync): 1 <= context_len <= max_context_len, and every
    block-table entry a sequence will read lies in [0, num_blocks). Raises KernelLaunchError."""
    import torch

    lens = context_lens.long()
    max_blocks = block_tables.shape[1]
    used = torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_entry = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flags = torch.stack([(lens < 1).any(), (lens > max_context_len).any(), bad_entry.any()]).tolist()
    if flags[0]:
        raise KernelLaunchError("every context_len must be >= 1")
    if flags[1]:
        raise KernelLaunchError(
            f"a context_len exceeds {max_context_len} (max_context_len, or max_blocks * block_size)"
        )
    if flags[2]:
        s, b = [int(x) for x in bad_entry.nonzero()[0]]
        raise KernelLaunchError(
            f"block_tables[{s}, {b}] = {int(block_tables[s, b])} is outside the pool [0, {num_blocks})"
        )


def launch_args(q, k_cache, v_cache, block_tables, context_lens, out, scale=None, is_bf16=False,
                max_context_len=None, stream=0, scratch=None):
    """LaunchArgs of raw-bit arrays (the low-level launchers' arguments; the geometry is checked,
    the values are not): see paged_attention.launch."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    check_supported(num_heads, k_cache.shape[1], head_dim, k_cache.shape[2])
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if scratch is None:
        def scratch(shape, dtype=np.float32, zero=False):
            if bridge.SIMULATOR:
                return np.zeros(shape, dtype=dtype)
            if zero:
                return cuda.to_device(np.zeros(shape, dtype=dtype), stream=stream)
            return cuda.device_array(shape, dtype=dtype, stream=stream)
    return LaunchArgs(q, k_cache, v_cache, block_tables, context_lens, out, scale, is_bf16, int(max_context_len),
                      scratch)


def _torch_view(t, dtype=None, flat=False):
    """bridge.cached_view's view of t as a torch tensor."""
    import torch

    x = t if dtype is None else t.view(torch.int16 if dtype == "int16" else torch.int32)
    return x.view(-1) if flat else x


def torch_launch_args(q, k_cache, v_cache, block_tables, context_lens, scale=None, out=None, validate=True,
                      max_context_len=None, tensors=False):
    """(LaunchArgs, out) for torch tensors (the torch entry points' arguments, see
    paged_attention.paged_attention): checked by check_args, and with validate by check_block_tables
    (skipped inside a CUDA-graph capture); out allocated when None.
    tensors: the arrays are torch views (for kernels launched through kernels_numba.launcher, which takes
    tensors as they are) instead of cached numba views (for numba's own launch); not under the simulator,
    whose kernels need the unsigned views bridge.as_array makes."""
    import torch

    check_args(q, k_cache, v_cache, block_tables, context_lens, out)
    num_blocks, _, block_size, head_dim = k_cache.shape
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if out is None:
        out = torch.empty_like(q)
    if validate and not bridge.capturing():
        check_block_tables(block_tables, context_lens, num_blocks, block_size, max_context_len)
    device = q.device
    view = _torch_view if tensors and not bridge.SIMULATOR else bridge.cached_view   # (simulator: unsigned views)

    def scratch(shape, dtype=np.float32, zero=False):
        return bridge.scratch(device, shape, dtype, zero)

    args = LaunchArgs(view(q, "int16"), view(k_cache, "int16"), view(v_cache, "int16"), view(block_tables),
                      view(context_lens), view(out, "int16"), 1.0 / math.sqrt(head_dim) if scale is None else scale,
                      q.dtype == torch.bfloat16, int(max_context_len), scratch,
                      q32=view(q, "int32"), k32_4d=view(k_cache, "int32"), v32_4d=view(v_cache, "int32"),
                      k32=view(k_cache, "int32", flat=True), v32=view(v_cache, "int32", flat=True),
                      out32=view(out, "int32"), num_sms=bridge.num_sms(device))
    return args, out


# ----------------------------------------------------------------------------------------------
# a warp's state: q fragments, the online softmax, the mma step


@inline_device
def lane_roles(tid):
    """(warp, lane, g, t) of thread tid: its warp and lane, and the lane's mma group g = lane // 4
    and thread-in-group t = lane % 4 (shifts and masks: no sign fix-ups of // and %)."""
    lane = tid & 31
    return tid >> 5, lane, lane >> 2, lane & 3


@lru_cache(maxsize=None)
def make_warp_start(head_dim, rows, permuted):
    """start_warp(qa, m, lsum, acc, q, s, h0, nh, g, t): a warp's online softmax before its first
    chunk: this lane's mma A fragments of q [S, H, D/2] pairs for S = Q K^T in qa (rows g, and g + 8
    when rows == 2, = heads h0 + g of the group, zero past nh heads; per k-step ks: qa[4 ks + r]
    (a0 / a1) and qa[4 ks + 2 + r] (a2 / a3)); running max -inf and sum 0 for the lane's two head rows
    (m, lsum), accumulators 0.

    The k (dim) order is the one K is read in: permuted=False (v5, v7: lane t holds dims t D/4 ..);
    permuted=True (the cp.async ring: k-steps 2j, 2j + 1 read one 16-byte unit 4j + t of a row, so
    word w of the lane <-> pair 16 (w // 4) + 4 t + w % 4). Any order works if q and K share it."""
    KS = head_dim // 16
    QW = head_dim // 8
    ACC = (head_dim // 8) * 4

    @inline_device
    def start_warp(qa, m, lsum, acc, q, s, h0, nh, g, t):
        for ks in range(KS):
            col = (ks // 2) * 16 + t * 4 + (2 * ks) % 4 if permuted else t * QW + 2 * ks
            for r in range(2):
                h = g + 8 * r
                w0 = uint32(0)
                w1 = uint32(0)
                if r < rows and h < nh:
                    w0 = uint32(q[s, h0 + h, col])
                    w1 = uint32(q[s, h0 + h, col + 1])
                qa[ks * 4 + r] = w0
                qa[ks * 4 + 2 + r] = w1
        for r in range(2):
            m[r] = NEG_INF
            lsum[r] = 0.0
        for i in range(ACC):
            acc[i] = 0.0

    return start_warp


@lru_cache(maxsize=None)
def make_mma_step(head_dim, rows, is_bf16):
    """compute_chunk(kw, ko, vw, vo, qa, m, lsum, acc, sc, pw, c0, end, t, sl, full): one warp's math on
    a 16-token chunk held in registers: S = Q K^T (2 n-tiles x D/16 k-steps), online softmax per head
    row, O += P V (D/8 mmas). kw[ko:]: K of tokens g and 8 + g (this lane's D/4 dims); vw[vo:]: V of
    tokens 2t, 2t + 1, 8 + 2t, 9 + 2t (D/8 dims from DPC * g); P goes to the second mma as fp16/bf16
    pairs (pw), V is transposed in registers by interleaving the halves of two tokens' words.
    full: every token of the chunk is inside the context (no masking). rows: mma row blocks holding
    heads (1 when the group has <= 8 heads: rows g + 8 stay zero)."""
    KS = head_dim // 16
    QW = head_dim // 8
    NTILE = head_dim // 8
    VW = head_dim // 16
    ROWS = rows
    mma = mma_m16n8k16_bf16 if is_bf16 else mma_m16n8k16_f16
    pack = f32x2_to_bf16x2 if is_bf16 else f32x2_to_f16x2

    @inline_device
    def compute_chunk(kw, ko, vw, vo, qa, m, lsum, acc, sc, pw, c0, end, t, sl, full):
        # S = Q K^T: n-tile n holds tokens 8n .. 8n+7; column 2t, 2t+1 of this lane
        for n in range(2):
            d0 = float32(0.0)
            d1 = float32(0.0)
            d2 = float32(0.0)
            d3 = float32(0.0)
            for ks in range(KS):
                d0, d1, d2, d3 = mma(qa[ks * 4], qa[ks * 4 + 1], qa[ks * 4 + 2], qa[ks * 4 + 3],
                                     kw[ko + n * QW + 2 * ks], kw[ko + n * QW + 2 * ks + 1], d0, d1, d2, d3)
            jt = c0 + 8 * n + 2 * t
            sc[n * 2 + 0] = d0 * sl if full or jt < end else NEG_INF
            sc[n * 2 + 1] = d1 * sl if full or jt + 1 < end else NEG_INF
            if ROWS == 2:
                sc[4 + n * 2 + 0] = d2 * sl if full or jt < end else NEG_INF
                sc[4 + n * 2 + 1] = d3 * sl if full or jt + 1 < end else NEG_INF
        # online softmax per head row (the 4 lanes of a group hold the 16 tokens)
        pw[1] = 0
        pw[3] = 0
        for r in range(ROWS):
            cmax = max(max(sc[r * 4], sc[r * 4 + 1]), max(sc[r * 4 + 2], sc[r * 4 + 3]))
            cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 1))
            cmax = max(cmax, cuda.shfl_xor_sync(FULL_MASK, cmax, 2))
            m_new = max(m[r], cmax)
            alpha = math.exp2(m[r] - m_new)
            m[r] = m_new
            p0 = math.exp2(sc[r * 4 + 0] - m_new)
            p1 = math.exp2(sc[r * 4 + 1] - m_new)
            p2 = math.exp2(sc[r * 4 + 2] - m_new)
            p3 = math.exp2(sc[r * 4 + 3] - m_new)
            lsum[r] = lsum[r] * alpha + (p0 + p1) + (p2 + p3)
            pw[r] = pack(p0, p1)  # a0 / a1: tokens 2t, 2t+1
            pw[2 + r] = pack(p2, p3)  # a2 / a3: tokens 8+2t, 9+2t
            for jn in range(NTILE):
                acc[jn * 4 + 2 * r] *= alpha
                acc[jn * 4 + 2 * r + 1] *= alpha
        # O += P V: n-tile jn covers dims DPC*g + jn (column g); B needs token pairs of one dim in a
        # word, so interleave the halves of two tokens' words
        for i in range(VW):
            for hi in range(2):
                jn = 2 * i + hi
                if hi == 0:
                    b0 = (vw[vo + i] & 0xFFFF) | (vw[vo + VW + i] << 16)
                    b1 = (vw[vo + 2 * VW + i] & 0xFFFF) | (vw[vo + 3 * VW + i] << 16)
                else:
                    b0 = (vw[vo + i] >> 16) | (vw[vo + VW + i] & 0xFFFF0000)
                    b1 = (vw[vo + 2 * VW + i] >> 16) | (vw[vo + 3 * VW + i] & 0xFFFF0000)
                c2 = acc[jn * 4 + 2] if ROWS == 2 else float32(0.0)
                c3 = acc[jn * 4 + 3] if ROWS == 2 else float32(0.0)
                a0, a1, a2, a3 = mma(pw[0], pw[1], pw[2], pw[3], b0, b1, acc[jn * 4], acc[jn * 4 + 1], c2, c3)
                acc[jn * 4] = a0
                acc[jn * 4 + 1] = a1
                if ROWS == 2:
                    acc[jn * 4 + 2] = a2
                    acc[jn * 4 + 3] = a3

    return compute_chunk


@lru_cache(maxsize=None)
def make_warp_merge(head_dim, heads, rows, warps):
    """(stash, combine_pair) for the end of a CTA whose warps each hold a partial softmax.

    stash(buf, base, nh, g, t, lsum, m, acc): this warp's result for heads < nh into uint32 shared
        buf[base:] as f32 bits: accumulator at [h * D + d], max at heads * D + h, sum at
        heads * D + heads + h (heads * D + 2 * heads words). The caller syncs before combining.
    combine_pair(buf, stride, h, d) -> (max, num_d, num_d+1, den): the warps' regions (warp w at
        w * stride) merged for dims d, d + 1 of head h; the output is num / den."""
    D, GH, ROWS, NW = head_dim, heads, rows, warps
    DPC = D // 8
    NTILE = D // 8

    @inline_device
    def stash(buf, base, nh, g, t, lsum, m, acc):
        # rows g, g + 8 of this warp; acc[jn*4 + 2r + e] is dim DPC*(2t+e) + jn
        for r in range(ROWS):
            x = lsum[r]
            x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
            x += cuda.shfl_xor_sync(FULL_MASK, x, 2)
            h = g + 8 * r
            if h < nh:
                for jn in range(NTILE):
                    buf[base + h * D + DPC * (2 * t) + jn] = f32_bits(acc[jn * 4 + 2 * r])
                    buf[base + h * D + DPC * (2 * t + 1) + jn] = f32_bits(acc[jn * 4 + 2 * r + 1])
                if t == 0:
                    buf[base + GH * D + h] = f32_bits(m[r])
                    buf[base + GH * D + GH + h] = f32_bits(x)

    @inline_device
    def combine_pair(buf, stride, h, d):
        mx = NEG_INF
        for w in range(NW):
            mx = max(mx, f32_from_bits(buf[w * stride + GH * D + h]))
        num0 = float32(0.0)
        num1 = float32(0.0)
        den = float32(0.0)
        for w in range(NW):
            f = math.exp2(f32_from_bits(buf[w * stride + GH * D + h]) - mx)  # 0 for a warp with no chunk
            num0 += f32_from_bits(buf[w * stride + h * D + d]) * f
            num1 += f32_from_bits(buf[w * stride + h * D + d + 1]) * f
            den += f32_from_bits(buf[w * stride + GH * D + GH + h]) * f
        return mx, num0, num1, den

    return stash, combine_pair


# ----------------------------------------------------------------------------------------------
# the cp.async ring


@lru_cache(maxsize=None)
def make_ring(head_dim, block_size, heads, is_bf16, warps, stages):
    """attend_partition(ring, q, k_flat, v_flat, block_tables, s, kvh, num_kv_heads, h0, nh, start, end,
    scale, tid): a CTA of `warps` warps attends query heads h0 .. h0 + nh - 1 (nh <= heads <= 16) of
    sequence s to tokens [start, end) of KV head kvh and leaves each warp's (max, sum, accumulator)
    stashed in the ring (make_warp_merge's layout, warp w at w * stages * 16 * head_dim words): the
    caller combines them with combine_pair. q: [S, H, D/2] pairs; k_flat, v_flat: the pool
    [NB, KVH, BS, D] as flat 32-bit words; ring: ring_bytes(head_dim, stages, warps) of uint32
    shared memory. Called by every thread of the CTA (it synchronises the CTA).

    Warp w takes chunks w, w + warps, ... of 16 tokens and streams them from the pool through its
    `stages` shared-memory stages by cp.async (stages - 1 chunks in flight), each folded into its
    online softmax by compute_chunk once it has landed.

    A stage holds a chunk's 16 K rows (words 0 .. 16 P) then its 16 V rows, one row of D halves =
    P = D/2 words = D/8 16-byte units, each row's units XOR-swizzled:
        K unit u of row r at u ^ 4 (r & 1)
        V unit u of row r at u ^ x(r), x(r) = 2 ((r >> 1) & 3) at d=64; at d=128 the two bits of
            (r >> 1) & 3 go to bits 0 and 2 (bit 1 of the unit is the lane's g & 1 there)
    Copies: lane L copies unit L % U of rows R i + L // U (U = D/8 units per row, R = 32/U rows per
    instruction): every copy instruction reads 512 contiguous bytes of the pool (whole lines: as few
    L2 requests as a dense kernel makes). Reads: the fragments' rows and units (K: rows g, 8 + g,
    units 4 i + t; V: rows 2t.., units (D/64) g + i). Both sides hit 8 different bank groups per
    phase of 8 lanes with these swizzles. Rows past `end` are not copied; their stale words read as 0.
    """
    D, BS, NW, ST = head_dim, block_size, warps, stages
    ROWS = 1 if heads <= 8 else 2  # mma row blocks holding heads (g, and g + 8)
    CH = CHUNK
    P = D // 2  # words per row
    U = D // 8  # 16-byte units per row
    R = 32 // U  # rows per copy instruction: 4 (d=64) or 2 (d=128)
    NI = CH // R  # copy instructions per 16 rows
    KV4 = D // 32  # K units a lane reads per token row
    VV4 = D // 64  # V units a lane reads per token
    QW = D // 8  # K words of one token a lane holds
    VW = D // 16  # V words of one token a lane holds
    KWN, VWN = 2 * QW, 4 * VW  # local array sizes must be plain constants
    SLOT = 2 * CH * P  # words of one warp's stage
    WARP_WORDS = ST * SLOT
    KS4, ACC = (D // 16) * 4, (D // 8) * 4
    HALF = 8 if BS == 8 else 0  # block size 8: tokens 8..15 of a chunk are in the next block
    start_warp = make_warp_start(D, ROWS, True)
    compute_chunk = make_mma_step(D, ROWS, is_bf16)
    stash = make_warp_merge(D, heads, ROWS, NW)[0]
    wait_oldest = cp_async_wait(ST - 1)  # after step k commits chunk k + ST - 1: chunk k has landed
    wait_all = cp_async_wait(0)
    QSCALE_LOG2E = float32(LOG2E)

    @inline_device
    def v_swizzle(r):
        if D == 64:
            return 2 * ((r >> 1) & 3)
        return ((r >> 1) & 1) | (((r >> 2) & 1) << 2)

    @inline_device
    def chunk_bases(block_tables, s, c0, end, words_per_block, head_off):
        # words of the chunk's row 0 in the pool; rows 8.. at base_hi + r * P (another block
        # when the block size is 8)
        blk = block_tables[s, c0 // BS]
        base_lo = blk * words_per_block + head_off + (c0 & (BS - 1)) * P
        base_hi = base_lo
        if HALF and c0 + 8 < end:
            base_hi = block_tables[s, c0 // BS + 1] * words_per_block + head_off - 8 * P
        return base_lo, base_hi

    @inline_device
    def issue_chunk(ring, slot, k_flat, v_flat, base_lo, base_hi, src_lane, kdst, lrow, unit, c0, end, full):
        for i in range(NI):
            r = R * i + lrow
            if full or c0 + r < end:
                src = (base_lo if i < NI // 2 else base_hi) + R * i * P + src_lane
                cp_async16(ring, slot + kdst + R * i * P, k_flat, src)
                cp_async16(ring, slot + CH * P + r * P + 4 * (unit ^ v_swizzle(r)), v_flat, src)

    @inline_device
    def read_chunk(kw, vw, ring, slot, krd, kx, vrd, vx, c0, end, g, t, full):
        for n in range(2):
            ok = full or c0 + 8 * n + g < end
            for i in range(KV4):
                w = load_u32x4(ring, slot + krd + 16 * (i ^ kx) + 8 * n * P)
                for e in range(4):
                    kw[4 * (n * KV4 + i) + e] = w[e] if ok else uint32(0)
        for u in range(4):
            ok = full or c0 + 2 * t + (u % 2) + 8 * (u // 2) < end
            for i in range(VV4):
                w = load_u32x4(ring, slot + vrd + 4 * ((VV4 * g + i) ^ vx) + ((u % 2) + 8 * (u // 2)) * P)
                for e in range(4):
                    vw[u * VW + 4 * i + e] = w[e] if ok else uint32(0)

    @inline_device
    def attend(ring, k_flat, v_flat, block_tables, s, start, end, words_per_block, head_off, qa, m, lsum, acc,
               warp, lane, sl):
        g = lane >> 2
        t = lane & 3
        kw = cuda.local.array(KWN, uint32)
        vw = cuda.local.array(VWN, uint32)
        sc = cuda.local.array(8, float32)
        pw = cuda.local.array(4, uint32)
        # this lane's word offsets in a stage, from the swizzles above with i, n, u folded out
        lrow = lane // U
        unit = lane % U
        src_lane = lrow * P + 4 * unit
        kdst = lrow * P + 4 * (unit ^ (4 * (lrow & 1)))  # + R i P: K rows R i + lrow have lrow's parity
        krd = g * P + 4 * t  # + 16 (i ^ kx) + 8 n P: K unit 4 i + t of rows g, 8 + g
        kx = g & 1
        vrd = CH * P + 2 * t * P  # + 4 (unit ^ x) + row P: V units of rows 2t.. (one swizzle for all 4)
        vx = v_swizzle(2 * t)
        base = warp * WARP_WORDS
        num_chunks = (end - start + CH - 1) // CH
        nk = (num_chunks - warp + NW - 1) // NW  # this warp's chunks: warp, warp + NW, ...
        step = NW * CH

        # prologue: chunks 0 .. ST-2 into stages 0 .. ST-2, one commit group each
        c0 = start + warp * CH
        for k in range(ST - 1):
            if k < nk:
                b_lo, b_hi = chunk_bases(block_tables, s, c0, end, words_per_block, head_off)
                issue_chunk(ring, base + k * SLOT, k_flat, v_flat, b_lo, b_hi, src_lane, kdst, lrow, unit, c0, end,
                            False)
            cp_async_commit()
            c0 += step
        # the pool offsets of the next chunk to issue are read a step ahead of their use
        nxt_lo = 0
        nxt_hi = 0
        if ST - 1 < nk:
            nxt_lo, nxt_hi = chunk_bases(block_tables, s, c0, end, words_per_block, head_off)
        c_issue = c0  # first token of chunk k + ST - 1
        c0 = start + warp * CH  # first token of chunk k
        slot_read = base
        slot_write = base + (ST - 1) * SLOT
        for k in range(nk):
            # refill the stage read at step k - 1 (its values are used) with chunk k + ST - 1
            if k + ST - 1 < nk:
                if c_issue + CH <= end:
                    issue_chunk(ring, slot_write, k_flat, v_flat, nxt_lo, nxt_hi, src_lane, kdst, lrow, unit, c_issue,
                                end, True)
                else:
                    issue_chunk(ring, slot_write, k_flat, v_flat, nxt_lo, nxt_hi, src_lane, kdst, lrow, unit, c_issue,
                                end, False)
                c_issue += step
                if k + ST < nk:
                    nxt_lo, nxt_hi = chunk_bases(block_tables, s, c_issue, end, words_per_block, head_off)
            cp_async_commit()
            slot_write = slot_read  # the stage read now is refilled at the next step
            wait_oldest()  # this lane's copies of chunk k have landed; k+1 .. k+ST-1 stay in flight
            cuda.syncwarp()  # ... and every lane's (a lane reads units other lanes copied)
            # (the stage refilled at the next step is free: its values fed this step's mma.sync,
            # which every lane of the warp must reach)
            if c0 + CH <= end:
                read_chunk(kw, vw, ring, slot_read, krd, kx, vrd, vx, c0, end, g, t, True)
                compute_chunk(kw, 0, vw, 0, qa, m, lsum, acc, sc, pw, c0, end, t, sl, True)
            else:
                read_chunk(kw, vw, ring, slot_read, krd, kx, vrd, vx, c0, end, g, t, False)
                compute_chunk(kw, 0, vw, 0, qa, m, lsum, acc, sc, pw, c0, end, t, sl, False)
            c0 += step
            slot_read += SLOT
            if slot_read == base + WARP_WORDS:
                slot_read = base

    @inline_device
    def attend_partition(ring, q, k_flat, v_flat, block_tables, s, kvh, num_kv_heads, h0, nh, start, end, scale,
                         tid):
        warp, lane, g, t = lane_roles(tid)
        qa = cuda.local.array(KS4, uint32)
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        acc = cuda.local.array(ACC, float32)
        start_warp(qa, m, lsum, acc, q, s, h0, nh, g, t)
        attend(ring, k_flat, v_flat, block_tables, s, start, end, num_kv_heads * BS * P, kvh * BS * P, qa, m, lsum,
               acc, warp, lane, scale * QSCALE_LOG2E)
        wait_all()
        cuda.syncthreads()  # the ring is idle: it now carries each warp's (max, sum, accumulator)
        stash(ring, warp * WARP_WORDS, nh, g, t, lsum, m, acc)
        cuda.syncthreads()

    return attend_partition
