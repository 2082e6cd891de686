"""Does a GEMM row's result depend on how many rows the GEMM has? torch.matmul (cuBLAS) on Qwen2-0.5B's shapes.

For each shape and dtype: x [8192, K], W [N, K]; y_M = x[:M] @ W^T for M in MS. Row 0's bits are grouped by M:
the table gives how many different results row 0 takes over the M's, and the M's where it changes. Then the
fixed-piece recipe (every call P rows, the last piece padded with zero rows: one shape, so one cuBLAS
algorithm, so a row's bits never depend on M): checked bit for bit against a P-row call, and timed
against the plain call (CUDA events, median of 20 after 3 warm-ups) at a few M.

    python scripts/gemm_rows.py --out OUT        # ~1 minute on an H200

Writes OUT/gemm_rows.json and .md (benchlib.save).
"""
import os
import statistics
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}
MS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256, 257,
      384, 512, 768, 1024, 2048, 4096, 8192]
PIECES = (64, 128, 256)
TIMED_MS = (1, 8, 64, 256, 1024, 8192)


def pieces(x, w, P):
    """x @ w^T in calls of exactly P rows (the last padded with zeros)."""
    M = x.shape[0]
    pad = -M % P
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([x[i:i + P] @ w.T for i in range(0, x.shape[0], P)])[:M]


def time_us(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b))
    return statistics.median(times)


def main(out="gemm_rows_out"):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, timings = [], []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, (K, N) in SHAPES.items():
            x = torch.randn(max(MS), K, device="cuda", generator=g).to(dtype)
            w = (0.05 * torch.randn(N, K, device="cuda", generator=g)).to(dtype)
            results, changes, prev = {}, [], None
            for M in MS:
                key = (x[:M] @ w.T)[0].float().cpu().numpy().tobytes()
                results.setdefault(key, M)
                if prev is not None and key != prev:
                    changes.append(M)
                prev = key
            invariant = {}
            for P in PIECES:
                ref = x[:P] @ w.T
                invariant[P] = all(torch.equal(pieces(x[:M], w, P)[:min(M, P)], ref[:min(M, P)]) for M in MS)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "GEMM": name, "K x N": f"{K} x {N}",
                         "distinct row-0 results over the M's": len(results),
                         "M where row 0 changes": ", ".join(map(str, changes)) or "-",
                         **{f"pieces of {P}: bitwise invariant": invariant[P] for P in PIECES}})
            print(rows[-1], flush=True)
            if dtype != torch.float32:
                for M in TIMED_MS:
                    plain = time_us(lambda: x[:M] @ w.T)
                    t = {P: time_us(lambda: pieces(x[:M], w, P)) for P in PIECES}
                    timings.append({"dtype": rows[-1]["dtype"], "GEMM": name, "M": M, "plain us": plain,
                                    **{f"pieces of {P} us": t[P] for P in PIECES},
                                    **{f"x{P}": t[P] / plain for P in PIECES}})
    table = benchlib.markdown_table(rows, list(rows[0])) + "\n\n" + benchlib.markdown_table(timings, list(timings[0]))
    print(table)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "timings": timings}
    print("\n".join(benchlib.save(out, "gemm_rows", rows, meta, table)))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "gemm_rows_out")
