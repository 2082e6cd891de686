"""Paged prefill attention: a chunk of new queries per sequence attends causally to the
sequence's cached prefix and to itself, every K/V read through the block table.

Contract (docs/architecture.md): q [total_q, num_heads, head_dim] packs the chunks of
num_seqs sequences (cu_seqlens_q); their K/V are already in the pool; query i of a chunk of
q_len sits at position context_len - q_len + i and sees positions 0..that position.

Work decomposition, one CTA of 128 threads per (sequence, q tile, KV head):

    rows   = BQ queries x G query heads of the KV head's GQA group   (BM = 64 or 32 rows)
    S      = Q_rows . K_tile^T      [BM, BN]  BN = 32 keys per KV tile
    online softmax per row          (running max m, sum l; fp32)
    O     += P . V_tile             [BM, head_dim] in registers (fp32)

* Each K/V tile is loaded from the pool once per CTA and shared by all G heads of the group
  and all BQ queries (the GQA group is why a row is (query, head) and not just a query).
* Tiles go through shared memory as fp32: K then V in the same buffer (K is dead once S is
  computed), rows padded by one word so the strided reads are free of bank conflicts.
* Register blocking: thread (tr, tc) = (tid // 8, tid % 8) owns rows tr + 16 i (i < BM/16),
  keys tc + 8 j of S (j < 4) and dims tc + 8 j of O (j < head_dim/8): every shared load feeds
  2-3 FMAs.
* The KV loop stops at the causal boundary of the tile's last query; only keys past a row's
  own position are masked (-inf), and keys past context_len are never read (so unused pool
  slots can hold anything, NaN included).
* Global loads are 128-bit (8 halves, `common.load_u32x4`), output goes out through shared
  memory as packed pairs.
* The grid is 1-D over tiles (upper bound sum ceil(q_len/BQ) <= total_q/BQ + num_seqs, so no
  host sync is needed to size it) x KV heads; each CTA finds its (sequence, tile) by scanning
  cu_seqlens_q, and a sequence's *last* tile (the longest causal range) is scheduled first.

No tensor cores yet (mma.sync would be the next step): the math runs on fp32 FMA units.
Supported: fp16 and bf16 q/K/V, head_dim 64 (BM 64) and 128 (BM 32), block_size 8/16/32,
any GQA ratio G <= BM (G = 1 is MHA).
"""
import math

import numpy as np
import torch
from numba import cuda, float32

from kernels_numba import common
from pagedattn.errors import KernelLaunchError

SIMULATOR = common.SIMULATOR
THREADS = 128
BN = 32  # keys per KV tile
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
NEG_INF = np.float32(-np.inf)


def tile_rows(head_dim):
    """BM: query-head rows per CTA (shared memory keeps it under 48 KiB: 64 rows at d=64)."""
    return 64 if head_dim == 64 else 32


def queries_per_tile(head_dim, group):
    """BQ: queries per CTA, all `group` heads of each."""
    return tile_rows(head_dim) // group


_KERNELS = {}


def _build(head_dim, kind):
    """Compile-time specialised kernel for one head_dim and storage type ("f16" / "bf16")."""
    D = head_dim
    BM = tile_rows(D)
    TM = BM // 16  # rows per thread
    TN = BN // 8  # keys per thread in S
    TD = D // 8  # dims per thread in O
    DP = D + 1  # padded row stride of the fp32 tiles in shared memory
    BNP = BN + 1
    W = D // 2  # uint32 words (pairs of halves) per head_dim row
    CH = D // 8  # 128-bit chunks per row
    to_f32 = common.f16x2_to_f32 if kind == "f16" else common.bf16x2_to_f32
    pack = common.f32x2_to_f16x2 if kind == "f16" else common.f32x2_to_bf16x2
    load4 = common.load_u32x4

    @cuda.jit(device=True, inline=True)
    def store8(dst, row, col, a, b, c, d):
        # 4 words = 8 halves -> dst[row, col : col + 8] as fp32
        x0, x1 = to_f32(a)
        x2, x3 = to_f32(b)
        x4, x5 = to_f32(c)
        x6, x7 = to_f32(d)
        dst[row, col] = x0
        dst[row, col + 1] = x1
        dst[row, col + 2] = x2
        dst[row, col + 3] = x3
        dst[row, col + 4] = x4
        dst[row, col + 5] = x5
        dst[row, col + 6] = x6
        dst[row, col + 7] = x7

    @cuda.jit(device=True, inline=True)
    def load_kv_tile(dst, cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size):
        # dst[n, :] = cache[block_tables[s, pos // bs], g, pos % bs, :] for pos = n0 + n < kv_end, else 0
        # cache: flat uint32 view of [num_blocks, num_kv_heads, block_size, D]
        for idx in range(cuda.threadIdx.x, BN * CH, THREADS):
            n = idx // CH
            c = idx % CH
            pos = n0 + n
            if pos < kv_end:
                block = block_tables[s, pos // block_size]
                base = ((block * num_kv_heads + g) * block_size + pos % block_size) * W + c * 4
                a, b, cc, d = load4(cache, base)
                store8(dst, n, c * 8, a, b, cc, d)
            else:
                for e in range(8):
                    dst[n, c * 8 + e] = float32(0.0)

    @cuda.jit
    def kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
               num_heads, num_kv_heads, block_size, scale):
        # q, out: flat uint32 views of [total_q, num_heads, D]; k/v_cache: flat uint32 views of
        # [num_blocks, num_kv_heads, block_size, D]; block_tables [num_seqs, max_blocks] int32;
        # cu_seqlens_q [num_seqs + 1], context_lens [num_seqs] int32; scale float32.
        q_s = cuda.shared.array((BM, DP), float32)  # Q rows, later the output staging
        kv_s = cuda.shared.array((BN, DP), float32)  # K tile, then V tile
        p_s = cuda.shared.array((BM, BNP), float32)  # scores, then probabilities
        m_s = cuda.shared.array(BM, float32)  # running max per row
        l_s = cuda.shared.array(BM, float32)  # running sum per row
        alpha_s = cuda.shared.array(BM, float32)  # rescale of the accumulator this tile

        tid = cuda.threadIdx.x
        tr = tid // 8
        tc = tid % 8
        g = cuda.blockIdx.y  # KV head
        group = num_heads // num_kv_heads
        bq = BM // group  # queries per tile

        # ---- which (sequence, q tile) is this CTA: scan the chunk lengths
        t = cuda.blockIdx.x
        s = -1
        tile = 0
        for i in range(context_lens.shape[0]):
            ntiles = (cu_seqlens_q[i + 1] - cu_seqlens_q[i] + bq - 1) // bq
            if t < ntiles:
                s = i
                tile = ntiles - 1 - t  # last (heaviest) tile first
                break
            t -= ntiles
        if s < 0:
            return  # past the last tile: the grid is an upper bound
        q_start = cu_seqlens_q[s]
        q_len = cu_seqlens_q[s + 1] - q_start
        ctx = context_lens[s]
        first_pos = ctx - q_len  # position of the chunk's query 0
        q0 = tile * bq  # first query of this tile within the chunk
        q_hi = min(q0 + bq, q_len)  # one past its last query
        kv_end = first_pos + q_hi  # causal boundary of the tile's last query

        # ---- Q tile: row r = (query q0 + r // group, head g * group + r % group)
        for idx in range(tid, BM * CH, THREADS):
            r = idx // CH
            c = idx % CH
            qi = q0 + r // group
            if r < bq * group and qi < q_len:
                base = ((q_start + qi) * num_heads + g * group + r % group) * W + c * 4
                a, b, cc, d = load4(q, base)
                store8(q_s, r, c * 8, a, b, cc, d)
            else:
                for e in range(8):
                    q_s[r, c * 8 + e] = float32(0.0)
        if tid < BM:
            m_s[tid] = NEG_INF
            l_s[tid] = float32(0.0)

        # causal limit of each of this thread's rows (unused rows see everything: scores 0)
        qpos = cuda.local.array(TM, np.int32)
        for i in range(TM):
            r = tr + 16 * i
            qi = q0 + r // group
            qpos[i] = first_pos + qi if (r < bq * group and qi < q_len) else ctx - 1
        acc = cuda.local.array((TM, TD), float32)  # O rows tr + 16 i, dims tc + 8 j
        sacc = cuda.local.array((TM, TN), float32)  # S rows tr + 16 i, keys tc + 8 j
        qv = cuda.local.array(TM, float32)  # operands of one rank-1 update
        kv = cuda.local.array(TN, float32)
        pv = cuda.local.array(TM, float32)
        vv = cuda.local.array(TD, float32)
        for i in range(TM):
            for j in range(TD):
                acc[i, j] = float32(0.0)

        for n0 in range(0, kv_end, BN):
            load_kv_tile(kv_s, k_cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size)
            cuda.syncthreads()

            # ---- S = Q K^T for rows tr + 16 i, keys tc + 8 j
            for i in range(TM):
                for j in range(TN):
                    sacc[i, j] = float32(0.0)
            for d in range(D):
                for i in range(TM):
                    qv[i] = q_s[tr + 16 * i, d]
                for j in range(TN):
                    kv[j] = kv_s[tc + 8 * j, d]
                for i in range(TM):
                    for j in range(TN):
                        sacc[i, j] += qv[i] * kv[j]
            for i in range(TM):
                for j in range(TN):
                    key = n0 + tc + 8 * j
                    p_s[tr + 16 * i, tc + 8 * j] = sacc[i, j] * scale if key <= qpos[i] else NEG_INF
            cuda.syncthreads()  # S complete; K is dead

            # ---- online softmax, one thread per row; meanwhile everyone loads V
            if tid < BM:
                m_old = m_s[tid]
                m_new = m_old
                for n in range(BN):
                    m_new = max(m_new, p_s[tid, n])
                alpha = math.exp(m_old - m_new)  # 0 on the first tile (m_old = -inf)
                total = float32(0.0)
                for n in range(BN):
                    p = math.exp(p_s[tid, n] - m_new)  # masked: exp(-inf) = 0
                    p_s[tid, n] = p
                    total += p
                m_s[tid] = m_new
                l_s[tid] = l_s[tid] * alpha + total
                alpha_s[tid] = alpha
            load_kv_tile(kv_s, v_cache, block_tables, s, g, n0, kv_end, num_kv_heads, block_size)
            cuda.syncthreads()

            # ---- O = alpha O + P V for rows tr + 16 i, dims tc + 8 j
            for i in range(TM):
                a = alpha_s[tr + 16 * i]
                for j in range(TD):
                    acc[i, j] *= a
            for n in range(BN):
                for i in range(TM):
                    pv[i] = p_s[tr + 16 * i, n]
                for j in range(TD):
                    vv[j] = kv_s[n, tc + 8 * j]
                for i in range(TM):
                    for j in range(TD):
                        acc[i, j] += pv[i] * vv[j]
            cuda.syncthreads()  # before the next tile overwrites kv_s and p_s

        # ---- normalise, stage in shared memory, write packed pairs
        for i in range(TM):
            r = tr + 16 * i
            inv = float32(1.0) / l_s[r]
            for j in range(TD):
                q_s[r, tc + 8 * j] = acc[i, j] * inv
        cuda.syncthreads()
        for idx in range(tid, BM * W, THREADS):
            r = idx // W
            w = idx % W
            qi = q0 + r // group
            if r < bq * group and qi < q_len:
                dst = ((q_start + qi) * num_heads + g * group + r % group) * W + w
                out[dst] = pack(q_s[r, 2 * w], q_s[r, 2 * w + 1])

    return kernel


def get_kernel(head_dim, kind):
    """The compiled-on-first-launch kernel for (head_dim, "f16" | "bf16")."""
    key = (head_dim, kind)
    if key not in _KERNELS:
        _KERNELS[key] = _build(head_dim, kind)
    return _KERNELS[key]


def num_tiles_bound(total_q, num_seqs, head_dim, group):
    """Grid x: an upper bound of sum_s ceil(q_len_s / BQ) that needs no host sync."""
    bq = queries_per_tile(head_dim, group)
    return (total_q + bq - 1) // bq + num_seqs


def launch_paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
                         num_heads, num_kv_heads, head_dim, block_size, scale, kind="f16", stream=0):
    """Launch on raw arrays, no checks.

    q, out: 1-D uint32 views of [total_q, num_heads, head_dim] (pairs of halves), 16-byte aligned
    k_cache, v_cache: 1-D uint32 views of [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: [num_seqs, max_blocks] int32; cu_seqlens_q: [num_seqs + 1] int32;
    context_lens: [num_seqs] int32; scale: float. numba device arrays (numpy in the simulator).
    """
    total_q = q.shape[0] // (num_heads * head_dim // 2)
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    grid = (num_tiles_bound(total_q, num_seqs, head_dim, group), num_kv_heads)
    if total_q == 0 or num_seqs == 0:
        return
    get_kernel(head_dim, kind)[grid, THREADS, stream](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        num_heads, num_kv_heads, block_size, np.float32(scale),
    )


# ----------------------------------------------------------------------------------------
# torch entry point


def _check_tensor(name, t, dim=None, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise KernelLaunchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if SIMULATOR:
        if t.device.type != "cpu":
            raise KernelLaunchError(f"{name} must be a CPU tensor in the CUDA simulator, got {t.device}")
    elif t.device.type != "cuda":
        raise KernelLaunchError(f"{name} must be a CUDA tensor, got {t.device}")
    if dim is not None and t.dim() != dim:
        raise KernelLaunchError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise KernelLaunchError(f"{name}.dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def _flat_words(name, t):
    """1-D uint32 view of a contiguous fp16/bf16 tensor, 16-byte aligned (for 128-bit loads)."""
    if t.data_ptr() % 16 != 0:
        raise KernelLaunchError(f"{name} must be 16-byte aligned for 128-bit loads")
    words = t.view(-1).view(torch.int32)
    return words.numpy().view(np.uint32) if SIMULATOR else cuda.as_cuda_array(words).view(np.uint32)


def _as_array(t):
    return t.numpy() if SIMULATOR else cuda.as_cuda_array(t)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale=None, out=None,
                  check_bounds=False):
    """Causal prefill attention over the paged pool (new K/V already written).

    q: [total_q, num_heads, head_dim] float16/bfloat16, the chunks of num_seqs sequences packed
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], q's dtype, contiguous
    block_tables: [num_seqs, max_blocks] int32 (entries past a sequence's end are never read)
    cu_seqlens_q: [num_seqs + 1] int32, sequence s owns q[cu[s]:cu[s+1]] (each >= 1 token)
    context_lens: [num_seqs] int32, tokens in the pool for s after the write (prefix + chunk)
    scale: softmax scale (default 1/sqrt(head_dim)); out: optional [total_q, num_heads, head_dim]
    check_bounds: verify the metadata on the host (one sync): context_len >= q_len, block ids
        inside the pool, enough table columns. Off by default (the kernel is graph-capturable).
    Returns out [total_q, num_heads, head_dim] in q's dtype. Runs on torch's current stream.
    """
    half = tuple(DTYPES)
    _check_tensor("q", q, 3, half)
    _check_tensor("k_cache", k_cache, 4, half)
    _check_tensor("v_cache", v_cache, 4, half)
    _check_tensor("block_tables", block_tables, 2, (torch.int32,))
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    _check_tensor("context_lens", context_lens, 1, (torch.int32,))
    total_q, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelLaunchError(f"k_cache/v_cache dtype must equal q.dtype={q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if v_cache.shape != k_cache.shape:
        raise KernelLaunchError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelLaunchError("k_cache and v_cache must be contiguous")
    if cache_head_dim != head_dim:
        raise KernelLaunchError(f"q head_dim={head_dim} must equal the cache's head_dim={cache_head_dim}")
    if head_dim not in HEAD_DIMS:
        raise KernelLaunchError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size not in BLOCK_SIZES:
        raise KernelLaunchError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if num_heads % num_kv_heads != 0:
        raise KernelLaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if group > tile_rows(head_dim):
        raise KernelLaunchError(f"GQA group num_heads/num_kv_heads={group} must be <= {tile_rows(head_dim)}")
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelLaunchError(f"cu_seqlens_q must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if block_tables.shape[0] != num_seqs:
        raise KernelLaunchError(f"block_tables must have num_seqs={num_seqs} rows, got {block_tables.shape[0]}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_tensor("out", out, 3, (q.dtype,))
        if out.shape != q.shape:
            raise KernelLaunchError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if check_bounds:
        cu, ctx = cu_seqlens_q.cpu().long(), context_lens.cpu().long()
        q_lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total_q or bool((q_lens < 1).any()):
            raise KernelLaunchError(f"cu_seqlens_q must rise from 0 to total_q={total_q} by >= 1 per sequence")
        if bool((ctx < q_lens).any()):
            raise KernelLaunchError("context_lens must be >= each sequence's q_len")
        need = (ctx + block_size - 1) // block_size
        if num_seqs and int(need.max()) > block_tables.shape[1]:
            raise KernelLaunchError(f"block_tables has {block_tables.shape[1]} columns, a sequence needs {int(need.max())}")
        bt = block_tables.cpu().long()
        for s in range(num_seqs):
            used = bt[s, : int(need[s])]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
                raise KernelLaunchError(f"block_tables[{s}] has block ids outside [0, {num_blocks})")
    if total_q == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_c = q.contiguous()
    if q_c.data_ptr() % 16:
        q_c = q_c.clone()
    target = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(q_c)
    stream = 0 if SIMULATOR else cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    launch_paged_prefill(
        _flat_words("q", q_c), _flat_words("k_cache", k_cache), _flat_words("v_cache", v_cache),
        _as_array(block_tables.contiguous()), _as_array(cu_seqlens_q.contiguous()),
        _as_array(context_lens.contiguous()), _flat_words("out", target),
        num_heads, num_kv_heads, head_dim, block_size, scale, DTYPES[q.dtype], stream,
    )
    if target is not out:
        out.copy_(target)
    return out
