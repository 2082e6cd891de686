"""A small CPU step's decoder layer, compiled by numba's CPU target: its glue (residual add + RMSNorm, rotary
with the KV-cache write, SiLU-and-mul) as one call each, and the whole layer as one call. float32 only
(the CPU engine's dtype).

The glue. A small CPU step (at most 16 rows: decodes) spends little on the glue's arithmetic and much on
dispatch: torch's RMSNorm is eight ops (~150 us per call at one row on the 2-core Xeon of docs/cpu.md, 48 calls a
step) and rotary plus the write another six. Here each is one call of a few microseconds. The math is
the torch path's (pagedattn/layers/norm.py, rotary.py) in float32, checked against reference/layers.py:

    add_rms_norm   s = x + residual (stored into residual); out = weight * s / sqrt(mean(s^2) + eps)
    rotary_cache   q, k rotated by cos/sin of each token's position (the first half of the head dim
                   against the second, as HF's rotate_half); q into a new [T, H, D] tensor, the rotated
                   k and v into the pool at slot_mapping (-1: not written)

Safety: positions and slots are checked before any write (numba does not check bounds); a bad one
raises KernelLaunchError naming the field.

The whole layer (`run_layer`), on GGUF blocks or float32 weights. A decode step of the 0.5B model on two cores is ~40 ms, of which the block products are ~28; most of
the rest is not arithmetic but the way to it: ten ops a layer, each a Python call through the layer
modules, the ops table, a wrapper that checks and converts its tensors, and numba's dispatcher (15-25 us
a call, 240 calls a token), plus torch ops on [1, 4864] rows. Here the layer is one compiled function
that calls the same compiled kernels in the same order:

    h = RMSNorm(x + residual)            _add_rms_norm (the sum stored into residual)
    qkv = h Wqkv^T + b                   cpu_quant._run (or the int8 runners), q / k / v parts at once
    q = rotary(q); k, v -> the pool      _rotary_cache
    o = attention(q, pool)               cpu_attention._run_parallel on the step's plan
    a = o Wo^T
    h = RMSNorm(a + residual)            the sum stored into residual
    g = SiLU(h Wg^T) * (h Wu^T)          one product over gate and up, then silu_and_mul below
    out = g Wd^T                         -> (out, residual), as the layer modules return them

so its results are the unfused small step's bit for bit (tests/test_cpu_layer.py): every kernel keeps its
own thread split, and none of them depends on the thread count. SiLU-and-mul is this module's own
(`silu_and_mul`, which the unfused small step uses too), with cpu_attention's vectorisable exponential.

Which products run is fixed per compiled copy (`LAYERS`): GGUF blocks with float32 activations (cpu_quant)
or int8 ones with AVX2's or the generic integer sums (cpu_quant_int8), or float32 weights (cpu_linear); the
threaded driver is handed to the shared body as a function, so each copy is one specialisation.
"""
import numba
import numpy as np
import torch
from numba import njit

from kernels_numba import cpu_linear, cpu_quant, cpu_quant_int8
from kernels_numba.cpu_attention import FASTMATH, _exp_inplace
from kernels_numba.cpu_attention import _run as _attend_serial
from kernels_numba.cpu_attention import _run_parallel as _attend_parallel
from kernels_numba.cpu_linear import product_threads
from kernels_numba.errors import KernelLaunchError


# ---- the glue --------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _add_rms_norm(x, residual, weight, eps, out, has_residual):
    T, E = x.shape
    for t in range(T):
        ss = np.float32(0)
        for e in range(E):
            s = x[t, e] + residual[t, e] if has_residual else x[t, e]
            if has_residual:
                residual[t, e] = s
            ss += s * s
        inv = np.float32(1) / np.sqrt(ss / np.float32(E) + eps)
        for e in range(E):
            s = residual[t, e] if has_residual else x[t, e]
            out[t, e] = weight[e] * (s * inv)


@njit(cache=True, nogil=True)
def _rotary_cache(positions, qkv, H, Hkv, D, cos_sin, k_cache, v_cache, slots, q_out):
    """Returns 0, 1 (a position outside the cos/sin cache) or 2 (a slot outside the pool)."""
    T = qkv.shape[0]
    num_slots = k_cache.shape[0] * k_cache.shape[2]
    BS = k_cache.shape[2]
    for t in range(T):
        if positions[t] < 0 or positions[t] >= cos_sin.shape[0]:
            return 1
        if slots[t] >= num_slots:
            return 2
    for t in range(T):
        cs = cos_sin[positions[t]]
        for h in range(H):
            _rotate(qkv[t, h * D:(h + 1) * D], cs, q_out[t, h])
        slot = slots[t]
        if slot < 0:
            continue
        blk, off = slot // BS, slot % BS
        for h in range(Hkv):
            _rotate(qkv[t, (H + h) * D:(H + h + 1) * D], cs, k_cache[blk, h, off])
            v_cache[blk, h, off, :] = qkv[t, (H + Hkv + h) * D:(H + Hkv + h + 1) * D]
    return 0


@njit(inline="always")
def _rotate(x, cs, out):
    """out = x rotated: (x1 cos - x2 sin, x2 cos + x1 sin) over the halves of one head; cs = [cos | sin]."""
    half = x.shape[0] // 2
    for i in range(half):
        c, s = cs[i], cs[half + i]
        x1, x2 = x[i], x[half + i]
        out[i] = x1 * c - x2 * s
        out[half + i] = x2 * c + x1 * s


def _f32(t, name, ndim):
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != ndim or not t.is_contiguous():
        raise KernelLaunchError(f"{name}: needs a contiguous {ndim}-D float32 CPU tensor "
                                f"(got {tuple(t.shape)} {t.dtype} on {t.device})")
    return t.numpy()


def add_rms_norm(x, residual, weight, eps, validate=True):
    """x, residual (or None): [T, E] float32; weight: [E]. Returns out, or (out, residual) with the sum
    x + residual written into residual. validate: check the arguments first (KernelLaunchError naming one);
    a caller whose tensors are known to fit (the engine's small step) passes False."""
    if validate:
        xa, wa = _f32(x, "x", 2), _f32(weight, "weight", 1)
        if wa.shape[0] != xa.shape[1]:
            raise KernelLaunchError(f"weight: {wa.shape[0]} elements for rows of {xa.shape[1]}")
        ra = xa if residual is None else _f32(residual, "residual", 2)
        if ra.shape != xa.shape:
            raise KernelLaunchError(f"residual: shape {tuple(ra.shape)}, x has {tuple(xa.shape)}")
    else:
        xa, wa, ra = x.numpy(), weight.numpy(), x.numpy() if residual is None else residual.numpy()
    out = torch.empty_like(x)
    _add_rms_norm(xa, ra, wa, np.float32(eps), out.numpy(), residual is not None)
    return out if residual is None else (out, residual)


def rotary_error(err):
    """The KernelLaunchError of _rotary_cache's error code err (1 or 2), naming the field."""
    return KernelLaunchError("positions: a position outside the cos/sin cache" if err == 1
                             else "slot_mapping: a slot outside the pool")


def rotary_cache(positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """qkv: [T, (H + 2 Hkv) D] float32 (the merged projection's output); positions, slot_mapping: [T] int;
    cos_sin_cache: [max_position, D] float32; k_cache, v_cache: [num_blocks, Hkv, block_size, D] float32.
    Returns q rotated, [T, H, D]; writes the rotated k and v into the pool."""
    qa = _f32(qkv, "qkv", 2)
    if qa.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise KernelLaunchError(f"qkv: {qa.shape[1]} features, expected (H + 2 Hkv) D = "
                                f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    kc, vc = _f32(k_cache, "k_cache", 4), _f32(v_cache, "v_cache", 4)
    q_out = torch.empty(qa.shape[0], num_heads, head_dim)
    err = _rotary_cache(positions.numpy(), qa, num_heads, num_kv_heads, head_dim, _f32(cos_sin_cache, "cos_sin_cache", 2),
                        kc, vc, slot_mapping.numpy(), q_out.numpy())
    if err:
        raise rotary_error(err)
    return q_out


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def _silu_and_mul(gu, out):
    """out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + exp(-g)), with exp's argument -|g|
    (g >= 0: g / (1 + e); g < 0: g e / (1 + e), e = exp(-|g|) in (0, 1]), so it never overflows; exp is
    cpu_attention's vectorisable polynomial over a row (relative error ~1e-7, 0 below e^-87)."""
    T, I = out.shape
    e = np.empty(I, np.float32)
    bits = np.empty(I, np.uint32)
    for t in range(T):
        for i in range(I):
            e[i] = -abs(gu[t, i])
        _exp_inplace(e, I, bits)
        for i in range(I):
            g = gu[t, i]
            s = g / (np.float32(1.0) + e[i]) if g >= 0 else g * e[i] / (np.float32(1.0) + e[i])
            out[t, i] = s * gu[t, I + i]


def silu_and_mul(x):
    """x: [T, 2 I] float32 CPU tensor (gate then up) -> silu(gate) * up, a new [T, I] tensor."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 2 or not x.is_contiguous():
        raise KernelLaunchError(f"x: needs a contiguous [T, 2 I] float32 CPU tensor (got {tuple(x.shape)} "
                                f"{x.dtype} on {x.device})")
    out = torch.empty(x.shape[0], x.shape[1] // 2)
    _silu_and_mul(x.numpy(), out.numpy())
    return out


@njit(inline="always")
def _layer(linear, run, x, residual, has_residual, w, pool, step, threads, f16):
    """The layer (module docstring) with linear(run, ...) as its products (_blocks or _dense).

    w: the layer's weights (in_norm [E], post_norm [E], eps, then qkv, o, gate_up and down, each a product
    as `linear` takes it: (codes, parts, offsets, bias) for the blocks, (weight, bias) for float32 weights;
    an empty bias for none); pool: (k_cache, v_cache, cos_sin, H, Hkv, D, scale); step: the step's
    (positions, slots, block_tables, cu_seqlens_q, context_lens, tile_seq, tile_q0, order, attention
    threads, query tile: the plan's, cpu_attention.Plan). Returns (out, residual, error code)."""
    in_norm, post_norm, eps, qkv, o_w, gate_up, down = w
    k_cache, v_cache, cos_sin, H, Hkv, D, scale = pool
    positions, slots, tables, cu, ctx, tile_seq, tile_q0, order, attn_threads, query_tile = step
    T, E = x.shape
    h = np.empty((T, E), np.float32)
    _add_rms_norm(x, residual, in_norm, eps, h, has_residual)      # has_residual False: residual is x

    qkv_out = linear(run, threads, qkv, h, f16)
    q = np.empty((T, H, D), np.float32)
    err = _rotary_cache(positions, qkv_out, H, Hkv, D, cos_sin, k_cache, v_cache, slots, q)
    if err:
        return h, residual, err
    attn = np.empty((T, H, D), np.float32)
    if attn_threads > 1:
        _attend_parallel(attn_threads, q, k_cache, v_cache, tables, cu, ctx, scale, query_tile, tile_seq,
                         tile_q0, order, attn)
    else:
        _attend_serial(0, 1, q, k_cache, v_cache, tables, cu, ctx, scale, query_tile, tile_seq, tile_q0, order,
                       attn)

    a = linear(run, threads, o_w, attn.reshape(T, H * D), f16)
    _add_rms_norm(a, residual, post_norm, eps, h, True)

    gu = linear(run, threads, gate_up, h, f16)
    g = np.empty((T, gu.shape[1] // 2), np.float32)
    _silu_and_mul(gu, g)
    return linear(run, threads, down, g, f16), residual, 0


# The products x W^T (+ b) -> a new [T, N] array: `run` is the threaded driver of the call the unfused small
# step makes (cpu_quant.linear_parts, cpu_quant_int8.linear_parts, cpu_linear.linear), thread count included.
@njit(inline="always")
def _blocks(run, threads, p, x, f16):
    """p = (codes, parts, offsets, bias): GGUF blocks (cpu_quant._run or cpu_quant_int8's runners)."""
    out = np.empty((x.shape[0], p[2][-1]), np.float32)
    run(product_threads(threads, p[2][-1]), p[0], p[1], p[2], x, p[3], out, f16)
    return out


@njit(inline="always")
def _dense(run, threads, p, x, f16):
    """p = (weight, bias): float32 weights (cpu_linear._run)."""
    out = np.empty((x.shape[0], p[0].shape[0]), np.float32)
    run(product_threads(threads, p[0].shape[0]), x, p[0], p[1], out)
    return out


@njit(cache=True, nogil=True)
def _layer_float32(x, residual, has_residual, w, pool, step, threads, f16):
    return _layer(_blocks, cpu_quant._run, x, residual, has_residual, w, pool, step, threads, f16)


@njit(cache=True, nogil=True)
def _layer_int8_generic(x, residual, has_residual, w, pool, step, threads, f16):
    return _layer(_blocks, cpu_quant_int8._run_generic, x, residual, has_residual, w, pool, step, threads, f16)


@njit(cache=True, nogil=True)
def _layer_int8_avx2(x, residual, has_residual, w, pool, step, threads, f16):
    return _layer(_blocks, cpu_quant_int8._run_avx2, x, residual, has_residual, w, pool, step, threads, f16)


@njit(cache=True, nogil=True)
def _layer_dense(x, residual, has_residual, w, pool, step, threads, f16):
    return _layer(_dense, cpu_linear._run, x, residual, has_residual, w, pool, step, threads, f16)


# kind of weights -> the compiled layer: the blocks with float32 or int8 activations ("int8" picks its integer
# sums' spelling as cpu_quant_int8 does), or float32 weights ("dense": kernels_numba.cpu_linear)
LAYERS = {"float32": _layer_float32, "int8-generic": _layer_int8_generic, "int8-avx2": _layer_int8_avx2,
          "dense": _layer_dense}


def layer_kind(activations):
    """The LAYERS key of GGUF blocks with these activations ("float32" or "int8"), or of float32 weights
    (activations None)."""
    if activations is None:
        return "dense"
    if activations == "float32":
        return "float32"
    return "int8-avx2" if cpu_quant_int8.AVX2 else "int8-generic"


_pool_started = False


def _start_pool():
    """Start numba's thread pool. A compiled layer loaded from the disk cache calls its parallel loops from
    inside compiled code, which does not start the pool as a call from Python does: without this, a process
    whose first parallel loop is a layer's crashes (the products' loops schedule onto a pool not there)."""
    global _pool_started
    numba.get_num_threads()                          # starts the threading layer's pool if it is not running
    _pool_started = True


def run_layer(kind, x, residual, w, pool, step, threads):
    """One decoder layer (module docstring) of a small step. x: float32 numpy [T, E] (the previous layer's
    output, or the embedding); residual: float32 numpy [T, E] or None (the first layer: x is the residual
    stream); w, pool, step: the tuples `_layer` reads (pagedattn/layers/cpu.py builds them once per
    layer / step). threads: the step's threads (numba's pool already set to them); each product
    takes as many as the unfused call would.
    Returns (out, residual) as numpy arrays; KernelLaunchError naming a bad position or slot."""
    if not _pool_started:
        _start_pool()
    has_residual = residual is not None
    out, res, err = LAYERS[kind](x, residual if has_residual else x, has_residual, w, pool, step, threads,
                                 cpu_quant._F16)
    if err:
        raise rotary_error(err)                      # _rotary_cache's codes, its messages
    return out, res
