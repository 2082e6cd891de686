"""Reference dequantizers for the GGUF block formats the bundled model uses: Q8_0, Q5_0, Q6_K, Q4_K.

A quantized weight row of K values is K / QK blocks laid end to end; each block holds its own scale(s)
and small integers. The layouts (ggml's `block_q8_0`, `block_q5_0`, `block_q6_K`, `block_q4_K`), bytes
in file order, little-endian:

    Q8_0, 32 values in 34 bytes:   d: fp16 | q: int8[32]
        w[j] = d * q[j]
    Q5_0, 32 values in 22 bytes:   d: fp16 | qh: uint32 | qs: uint8[16]
        low nibble of qs[j] and bit j of qh give value j, high nibble of qs[j] and bit j+16 value j+16:
        w[j] = d * ((qs[j] & 15 | bit(qh, j) << 4) - 16),  w[j+16] = d * ((qs[j] >> 4 | bit(qh, j+16) << 4) - 16)
    Q6_K, 256 values in 210 bytes: ql: uint8[128] | qh: uint8[64] | scales: int8[16] | d: fp16
        two halves of 128 values; in half h, value 32*i + l (i = 0..3, l = 0..31) takes 4 low bits from
        ql[64h + l + 32*(i & 1)] (low nibble for i < 2, high for i >= 2) and 2 high bits from
        qh[32h + l] >> 2i; sub-block of 16 values s = 8h + 2i + l // 16:
        w = (d * scales[s]) * (q6 - 32)
    Q4_K, 256 values in 144 bytes: d: fp16 | dmin: fp16 | scales: uint8[12] | qs: uint8[128]
        eight sub-blocks of 32 with 6-bit scale sc[s] and min m[s] packed into the 12 bytes (below);
        sub-blocks 2c and 2c+1 take the low and high nibbles of qs[32c .. 32c+31]:
        w = (d * sc[s]) * q4 - (dmin * m[s])

Rounding: every product is float32, in the association written above, which is what ggml's reference
dequantizers and the `gguf` package compute; the functions here give the same bits (checked in
tests/test_cpu_quant.py). Each function loops over the blocks one by one, the readable way; it is slow
(seconds for a large tensor) and meant as the ground truth, not for use at run time.

Input: `raw`, uint8 [rows, bytes_per_row] (or any shape whose last axis is whole blocks), as the
GGUF file stores a tensor of shape [rows, K]. Output: float32 [rows, K].
"""
import numpy as np

# block size (values) and bytes per block of each format
BLOCK = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q6_K": (256, 210), "Q4_K": (256, 144)}


def _fp16(two_bytes):
    """The float32 value of an fp16 stored as 2 little-endian bytes (exact: fp16 -> fp32 loses nothing)."""
    return np.frombuffer(np.ascontiguousarray(two_bytes, dtype=np.uint8).tobytes(), "<f2")[0].astype(np.float32)


def dequant_block_q8_0(b):
    d = _fp16(b[0:2])
    q = b[2:34].view(np.int8).astype(np.float32)
    return d * q


def dequant_block_q5_0(b):
    d = _fp16(b[0:2])
    qh = int(np.frombuffer(b[2:6].tobytes(), "<u4")[0])
    qs = b[6:22]
    out = np.empty(32, np.float32)
    for j in range(16):
        lo = (int(qs[j]) & 15) | (((qh >> j) & 1) << 4)
        hi = (int(qs[j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)
        out[j] = d * np.float32(lo - 16)
        out[j + 16] = d * np.float32(hi - 16)
    return out


def dequant_block_q6_k(b):
    ql, qh = b[0:128], b[128:192]
    scales = b[192:208].view(np.int8)
    d = _fp16(b[208:210])
    out = np.empty(256, np.float32)
    for h in range(2):                          # two halves of 128 values
        for i in range(4):                      # four runs of 32 in a half
            for l in range(32):
                low = int(ql[64 * h + l + 32 * (i & 1)])
                low = low & 15 if i < 2 else low >> 4
                high = (int(qh[32 * h + l]) >> (2 * i)) & 3
                s = 8 * h + 2 * i + l // 16
                out[128 * h + 32 * i + l] = (d * np.float32(scales[s])) * np.float32((low | high << 4) - 32)
    return out


def q4_k_scale_min(scales):
    """The 8 six-bit (scale, min) pairs of a Q4_K block from its 12 packed bytes:

        bytes 0-3:  sc[0..3] in the low 6 bits, the top 2 bits of sc[4..7] above them
        bytes 4-7:  m[0..3]  in the low 6 bits, the top 2 bits of m[4..7] above them
        bytes 8-11: the low 4 bits of sc[4..7] (low nibble) and of m[4..7] (high nibble)
    """
    q = [int(v) for v in scales]
    sc, m = [0] * 8, [0] * 8
    for j in range(8):
        if j < 4:
            sc[j], m[j] = q[j] & 63, q[j + 4] & 63
        else:
            sc[j] = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4)
            m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
    return sc, m


def dequant_block_q4_k(b):
    d, dmin = _fp16(b[0:2]), _fp16(b[2:4])
    sc, m = q4_k_scale_min(b[4:16])
    qs = b[16:144]
    out = np.empty(256, np.float32)
    for s in range(8):
        scale, minimum = d * np.float32(sc[s]), dmin * np.float32(m[s])
        for l in range(32):
            byte = int(qs[32 * (s // 2) + l])
            q = byte & 15 if s % 2 == 0 else byte >> 4
            out[32 * s + l] = scale * np.float32(q) - minimum
    return out


_BLOCK_FN = {"Q8_0": dequant_block_q8_0, "Q5_0": dequant_block_q5_0,
             "Q6_K": dequant_block_q6_k, "Q4_K": dequant_block_q4_k}


def dequantize(raw, fmt):
    """float32 [..., K] from the blocks `raw` uint8 [..., bytes_per_row] of format fmt ("Q8_0", ...)."""
    qk, nbytes = BLOCK[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.shape[-1] % nbytes:
        raise ValueError(f"{fmt}: a row of {raw.shape[-1]} bytes is not whole blocks of {nbytes}")
    blocks = raw.reshape(-1, nbytes)
    out = np.empty((blocks.shape[0], qk), np.float32)
    fn = _BLOCK_FN[fmt]
    for i in range(blocks.shape[0]):
        out[i] = fn(blocks[i])
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * qk)


# ---- int8 activations (kernels_numba/cpu_quant_int8.py): x rounded per block of 32, integer sums ------
def quantize_rows_int8(x):
    """(xq int8 [M, K], dx float32 [M, K / 32], xs float32 [M, K / 32]) of x float32 [M, K], per block of 32
    values as ggml rounds a row to Q8_0 on AVX2: amax = max |x|, xq = round-half-even(x * (127 / amax))
    (0 where amax = 0), dx = amax / 127 rounded to fp16, xs = dx * sum(xq) (for Q4_K's mins)."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    blocks = x.reshape(M, K // 32, 32)
    amax = np.abs(blocks).max(-1)                                              # (M, K/32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(blocks * inv[..., None]).astype(np.int8)                      # |xq| <= 127
    dx = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    xs = (dx * xq.astype(np.int64).sum(-1).astype(np.float32)).astype(np.float32)
    return xq.reshape(M, K), dx, xs


def integer_form(raw, fmt):
    """(q int64, s float32, m float32), each [rows, K]: the blocks' integers and the float32 scale and min
    of each value, w = s * q - m (s, m the products written in the layouts above; m = 0 but for Q4_K)."""
    qk, nbytes = BLOCK[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(-1, nbytes)
    q = np.empty((blocks.shape[0], qk), np.int64)
    s = np.empty((blocks.shape[0], qk), np.float32)
    m = np.zeros((blocks.shape[0], qk), np.float32)
    for i, b in enumerate(blocks):
        if fmt == "Q8_0":
            q[i], s[i] = b[2:34].view(np.int8), _fp16(b[0:2])
        elif fmt == "Q5_0":
            qh = int(np.frombuffer(b[2:6].tobytes(), "<u4")[0])
            for j in range(16):
                q[i, j] = ((int(b[6 + j]) & 15) | (((qh >> j) & 1) << 4)) - 16
                q[i, j + 16] = ((int(b[6 + j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16
            s[i] = _fp16(b[0:2])
        elif fmt == "Q6_K":
            d, scales = _fp16(b[208:210]), b[192:208].view(np.int8)
            for h in range(2):
                for r in range(4):
                    for l in range(32):
                        low = int(b[64 * h + l + 32 * (r & 1)])
                        low = low & 15 if r < 2 else low >> 4
                        high = (int(b[128 + 32 * h + l]) >> (2 * r)) & 3
                        q[i, 128 * h + 32 * r + l] = (low | high << 4) - 32
                        s[i, 128 * h + 32 * r + l] = d * np.float32(scales[8 * h + 2 * r + l // 16])
        else:
            d, dmin = _fp16(b[0:2]), _fp16(b[2:4])
            sc, mn = q4_k_scale_min(b[4:16])
            for t in range(8):
                for l in range(32):
                    byte = int(b[16 + 32 * (t // 2) + l])
                    q[i, 32 * t + l] = byte & 15 if t % 2 == 0 else byte >> 4
                s[i, 32 * t:32 * t + 32] = d * np.float32(sc[t])
                m[i, 32 * t:32 * t + 32] = dmin * np.float32(mn[t])
    return q.reshape(rows, -1), s.reshape(rows, -1), m.reshape(rows, -1)


def linear_int8(x, raw, fmt, bias=None):
    """float64 [M, N]: x float32 [M, K] times the blocks raw [N, bytes_per_row] with x rounded to int8
    (quantize_rows_int8): per run of 32 (16 for a Q6_K sub-block) the exact integer sum of q * xq, times
    the float32 product (weight scale * dx), minus (Q4_K) the run's min * xs, summed in float64. What the
    int8 kernel computes, up to its float32 accumulation. (The kernel forms Q6_K's integer sums from the
    unsigned q + 32 less 32 x sum(xq) of each 4 values: the same integers, so nothing here depends on it.)"""
    xq, dx, xs = quantize_rows_int8(x)
    q, s, mn = integer_form(raw, fmt)
    M, K = xq.shape
    out = np.zeros((M, q.shape[0]))
    for r in range(K // 32):
        for h in range(2):                                 # halves of 16: Q6_K's sub-blocks (the rest: one scale)
            c = slice(32 * r + 16 * h, 32 * r + 16 * h + 16)
            ints = xq[:, c].astype(np.int64) @ q[:, c].T                  # (M, N) exact
            scale = (s[None, :, 32 * r] if h == 0 else s[None, :, 32 * r + 16]) * dx[:, r, None]   # float32
            out += scale.astype(np.float32).astype(np.float64) * ints
        out -= mn[None, :, 32 * r].astype(np.float64) * xs[:, r, None]
    if bias is not None:
        out += np.asarray(bias, np.float64)
    return out
