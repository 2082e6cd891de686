"""Time y = x W^T with W in each GGUF block format (kernels_numba.cpu_quant) at the bundled Qwen2-0.5B's
layer shapes, 1 and 8 rows of x, beside the float32 paths (kernels_numba.cpu_linear, torch's F.linear),
all in the same run, and estimate a decode step's weight matvecs from them.

Every method is checked against a float64 product before it is timed. Weights are rotated over copies
whose total exceeds the last-level cache (>= 64 MB), so each call streams its weight from memory as a
decode step does; the methods alternate within each round; the table gives the median over rounds.
GB/s counts the weight bytes a call reads (the blocks, or 4 bytes a value in float32).

    python scripts/bench_cpu_quant.py [--rounds 7] [--threads 2] [--out OUT.md]
"""
import argparse
import datetime
import platform
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F

from kernels_numba import cpu_linear, cpu_quant

# (N, K) of the layer matrices: q/o, k/v, gate/up, down, the LM head
SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]
FORMATS = ["Q8_0", "Q5_0", "Q6_K", "Q4_K"]
ROTATE_BYTES = 64 << 20
CHECK_ROWS = 4096            # output features checked against float64 before timing
# what one decode token reads in the bundled file: (N, K, format, matrices per token)
MODEL = [(896, 896, "Q5_0", 48), (128, 896, "Q5_0", 24), (128, 896, "Q8_0", 24), (4864, 896, "Q5_0", 48),
         (896, 4864, "Q6_K", 12), (896, 4864, "Q4_K", 12), (151936, 896, "Q8_0", 1)]


def random_blocks(fmt, N, K, rng):
    """uint8 [N, K / QK * bytes]: random quants with finite fp16 scales ~ 1e-3 (any values time the same)."""
    _, qk, nbytes = cpu_quant.FORMATS[fmt]
    raw = rng.integers(0, 256, (N * (K // qk), nbytes), dtype=np.uint8)
    for off in {"Q8_0": [0], "Q5_0": [0], "Q6_K": [208], "Q4_K": [0, 2]}[fmt]:
        raw[:, off:off + 2] = (rng.random(raw.shape[0]) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


def copies(make, one_bytes):
    return [make(i) for i in range(max(1, -(-ROTATE_BYTES // one_bytes)))]


def methods(N, K, rng):
    """{name: (call(x, i), bytes per call, float64 rows :CHECK_ROWS of copy 0's weight, for the check)}."""
    out = {}
    for fmt in FORMATS:
        if K % cpu_quant.FORMATS[fmt][1]:
            continue                         # K-quants need K a multiple of 256 (GGUF stores K = 896 otherwise)
        ws = copies(lambda i: random_blocks(fmt, N, K, rng), N * K)   # ~1 byte a value; enough copies
        out[fmt] = ((lambda x, i, ws=ws, fmt=fmt: cpu_quant.linear(x, ws[i % len(ws)], fmt)), ws[0].nbytes,
                    cpu_quant.dequantize(ws[0][:CHECK_ROWS], fmt).astype(np.float64))
    wf = copies(lambda i: torch.randn(N, K, generator=torch.Generator().manual_seed(i)) * 0.02, 4 * N * K)
    out["f32 cpu_linear"] = ((lambda x, i: cpu_linear.linear(x, wf[i % len(wf)])), 4 * N * K, wf[0][:CHECK_ROWS].double().numpy())
    out["f32 torch"] = ((lambda x, i: F.linear(x, wf[i % len(wf)])), 4 * N * K, wf[0][:CHECK_ROWS].double().numpy())
    return out


def bench(rounds, threads, rows_list=(1, 8), calls=None):
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    results = []
    for N, K in SHAPES:
        ms = methods(N, K, rng)
        n_calls = calls or (3 if N > 100000 else 20)
        for M in rows_list:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            for name, (call, _, w64) in ms.items():                     # check, then warm up
                y = call(x, 0).double().numpy()[:, :CHECK_ROWS]
                ref = x.double().numpy() @ w64.T
                bound = (K + 1) * 2.0 ** -24 * (np.abs(x.double().numpy()) @ np.abs(w64).T) + 1e-30
                assert (np.abs(y - ref) <= bound).all(), f"{name} {N}x{K} M={M}: outside the float32 bound"
            times = {name: [] for name in ms}
            for _ in range(rounds):
                for name, (call, _, _) in ms.items():
                    t0 = time.perf_counter()
                    for i in range(n_calls):
                        call(x, i)
                    times[name].append((time.perf_counter() - t0) / n_calls)
            for name, (_, nbytes, _) in ms.items():
                t = float(np.median(times[name]))
                results.append(dict(N=N, K=K, M=M, method=name, ms=t * 1e3, gbps=nbytes / t / 1e9, bytes=nbytes))
                print(f"{N:>6} x {K:<5} M={M:<2} {name:15s} {t * 1e3:8.3f} ms {nbytes / t / 1e9:6.1f} GB/s", flush=True)
    return results


def decode_estimate(results, M):
    """Sum over one token's weight matvecs (MODEL) of the measured times at M rows: ms per step."""
    at = {(r["N"], r["K"], r["method"]): r["ms"] for r in results if r["M"] == M}
    quant = sum(count * at[(N, K, fmt)] for N, K, fmt, count in MODEL)
    f32 = sum(count * at[(N, K, "f32 cpu_linear")] for N, K, _, count in MODEL)
    return quant, f32


def table(results, rounds, threads):
    methods_ = list(dict.fromkeys(r["method"] for r in results))
    lines = ["| N x K | rows | " + " | ".join(methods_) + " |", "|---|---|" + "---|" * len(methods_)]
    keys = list(dict.fromkeys((r["N"], r["K"], r["M"]) for r in results))
    for N, K, M in keys:
        cells = {r["method"]: r for r in results if (r["N"], r["K"], r["M"]) == (N, K, M)}
        lines.append(f"| {N} x {K} | {M} | " + " | ".join(
            f"{cells[m]['ms']:.3f} ms, {cells[m]['gbps']:.1f} GB/s" if m in cells else "-" for m in methods_) + " |")
    est = []
    for M in sorted({r["M"] for r in results}):
        q, f = decode_estimate(results, M)
        est.append(f"- {M} row(s): the bundled file's formats {q:.1f} ms per step ({1e3 / q:.1f} steps/s); "
                   f"the same matrices in float32 through cpu_linear {f:.1f} ms ({1e3 / f:.1f} steps/s)")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    head = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, {threads} threads, "
            f"median of {rounds} rounds; torch {torch.__version__}, numba {numba.__version__}, numpy {np.__version__}")
    return head, "\n".join(lines), "\n".join(est)


def main(rounds=7, threads=2, out=None):
    results = bench(rounds, threads)
    head, tab, est = table(results, rounds, threads)
    print(head, tab, "Weight matvecs of one decode step (sum over the model's matrices):", est, sep="\n\n")
    if out:
        with open(out, "a") as f:
            f.write(f"\n### {head}\n\n{tab}\n\nWeight matvecs of one decode step:\n\n{est}\n")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", help="append the table to this markdown file")
    a = p.parse_args()
    main(a.rounds, a.threads, a.out)
