"""A/B of the int8-activation products on the bundled model's `ffn_down` matrices (12 Q6_K, 12 Q4_K,
896 x 4864), or with --matrices q5_0 its Q5_0 ones, between this tree's kernels and a git revision's,
alternating in one process.

    python scripts/bench_cpu_int8_kquant.py --old REV [--matrices down|q5_0] [--rounds 7] [--threads 2]
                                            [--rows 1] [--calls 40]

--matrices q5_0: each layer's calls as the engine makes them, one call a fused layer: gate+up (two Q5_0
parts, 9728 x 896), q/k/v (896 + 128 + 128 x 896: Q5_0, Q5_0, and v Q5_0 or Q8_0), o (896 x 896, Q5_0);
"cache" is layer 0's three calls, "memory" all 24 layers' (~176 MB).

The old kernels are REV's kernels_numba/cpu_quant_int8.py, cpu_quant.py and cpu_simd.py, written out as a
package of their own (kq_old_REV, in the temp directory, so numba's cache keeps its compiles) and compiled
in this process beside the new ones. Each output is first compared with the other (bit for bit, or the
largest difference relative to the output's scale), then per round, old and new alternating (and which of
the two goes first alternating from round to round):

    cache   the first Q6_K and the first Q4_K matrix, each called --calls times, the mean of a call
            (the matrix stays in L2/L3: the arithmetic)
    memory  the 24 layers' down matrices, one pass (~72 MB, from memory as a decode step reads them)

and beside them, in the same rounds, "read only": a pass over the same 24 matrices that loads every byte
(32-byte vector loads OR-ed together, the rows cut over the threads as the products cut them) and computes
nothing else, the floor a product from memory can reach here.

Wall time, --threads threads (numba's pool and the products' split as in the engine); the table gives the
minimum and the median over rounds in ms. x: a down projection's input of the bundled model (standard
normal times the scale of SiLU(gate) * up, ~0.1; for q5_0 0.5), --rows rows.
"""
import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("cpu_quant_int8", "cpu_quant", "cpu_simd")


def old_kernels(rev):
    """REV's int8 kernels as the module kq_old_<rev>.cpu_quant_int8 (its own cpu_quant / cpu_simd)."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    pkg = f"kq_old_{sha}"
    base = os.path.join(tempfile.gettempdir(), "pagedattn_bench_old")
    os.makedirs(os.path.join(base, pkg), exist_ok=True)
    open(os.path.join(base, pkg, "__init__.py"), "w").close()
    for name in FILES:
        src = subprocess.run(["git", "-C", ROOT, "show", f"{sha}:kernels_numba/{name}.py"], capture_output=True,
                             text=True, check=True).stdout
        for other in FILES:                              # its imports of the three point at its own copies
            src = re.sub(rf"\bkernels_numba\.{other}\b", f"{pkg}.{other}", src)
            src = re.sub(rf"from kernels_numba import ([^\n]*\b){other}\b", rf"from {pkg} import \g<1>{other}", src)
        path = os.path.join(base, pkg, f"{name}.py")
        if not os.path.exists(path) or open(path).read() != src:
            with open(path, "w") as f:
                f.write(src)
    sys.path.insert(0, base)
    return sha, importlib.import_module(f"{pkg}.cpu_quant_int8")


def layer_calls(kind):
    """[(layer, name, parts)] of the bundled GGUF: parts [(blocks, fmt)], one call of linear_parts each;
    kind "down": the ffn_down matrices, "q5_0": gate+up, q/k/v and o (the Q5_0 matrices, v beside them)."""
    from pagedattn import bundled
    from pagedattn.models.gguf_weights import read_gguf

    path = bundled.bundled_gguf_path(os.path.dirname(bundled.bundled_model_path()))
    tensors = read_gguf(path)
    groups = {"down": {"down": ["ffn_down"]},
              "q5_0": {"gate+up": ["ffn_gate", "ffn_up"], "q/k/v": ["attn_q", "attn_k", "attn_v"],
                       "o": ["attn_output"]}}[kind]
    out = []
    for layer in range(100):
        if f"blk.{layer}.ffn_down.weight" not in tensors:
            break
        for name, keys in groups.items():
            ts = [tensors[f"blk.{layer}.{k}.weight"] for k in keys]
            out.append((layer, name if kind == "q5_0" else ts[0].fmt, [(t.data, t.fmt) for t in ts]))
    return out


def read_only(threads):
    """f(w): every byte of w (a C-contiguous uint8 matrix, whole 4-byte words) loaded once as float32 vectors
    and added up, the bytes cut into one contiguous range per thread."""
    from numba import njit, prange

    from kernels_numba.cpu_simd import vf_add, vf_load, vf_sum, vf_zero
    from kernels_numba.cpu_linear import numba_threads

    @njit(parallel=True, nogil=True)
    def touch(nt, f, sink):
        per = -(-f.shape[0] // nt) // 8 * 8
        for t in prange(nt):
            acc = vf_zero()
            for i in range(t * per, min(f.shape[0] - 7, (t + 1) * per), 8):
                acc = vf_add(acc, vf_load(f, i))
            sink[t] = vf_sum(acc)                          # kept, so the loads are not dropped
    sink = np.zeros(64, np.float32)
    return lambda w: touch(numba_threads(threads), w.reshape(-1).view(np.float32), sink)


def compare(a, b):
    if np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32)):
        return "bit for bit"
    return f"max |diff| / max |y| = {(a - b).abs().max().item() / b.abs().max().item():.2e}"


BLOCK = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q6_K": (256, 210), "Q4_K": (256, 144)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision of the old kernels")
    p.add_argument("--matrices", choices=("down", "q5_0"), default="down")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--calls", type=int, default=40)
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    from kernels_numba import cpu_quant_int8 as new

    sha, old = old_kernels(a.old)
    torch.set_num_threads(a.threads)
    calls = layer_calls(a.matrices)
    w0, f0 = calls[0][2][0]
    x = torch.randn(a.rows, w0.shape[1] // BLOCK[f0][1] * BLOCK[f0][0], generator=torch.Generator().manual_seed(0))
    x *= 0.1 if a.matrices == "down" else 0.5
    kernels = {f"old ({sha})": old, "new": new}
    names = list(dict.fromkeys(name for _, name, _ in calls))
    one = {name: next(c for c in calls if c[1] == name) for name in names}
    for name, (layer, _, parts) in one.items():
        ys = [k.linear_parts(x, parts, num_threads=a.threads) for k in kernels.values()]
        print(f"layer {layer} {name} ({ys[0].shape[1]} x {x.shape[1]}): new against old: {compare(ys[1], ys[0])}")
    for layer, name, parts in calls[len(one):]:                          # every other call bit for bit too
        ys = [k.linear_parts(x, parts, num_threads=a.threads) for k in kernels.values()]
        if compare(ys[1], ys[0]) != "bit for bit":
            print(f"layer {layer} {name}: new against old: {compare(ys[1], ys[0])}")
    mem = f"the {len(calls)} calls of {calls[-1][0] + 1} layers from memory"
    tasks = {f"{name} in cache (layer {layer})": [parts] * a.calls for name, (layer, _, parts) in one.items()}
    tasks[mem] = [parts for _, _, parts in calls]
    times = {(t, k): [] for t in tasks for k in kernels}
    touch, floor = read_only(a.threads), []
    for i in range(a.rounds + 1):                        # round 0 warms up
        for t, task in tasks.items():
            for k, mod in list(kernels.items())[::1 if i % 2 else -1]:      # who goes first alternates
                t0 = time.perf_counter()
                for parts in task:
                    mod.linear_parts(x, parts, num_threads=a.threads)
                times[t, k].append((time.perf_counter() - t0) / (len(task) if "cache" in t else 1))
        t0 = time.perf_counter()
        for parts in tasks[mem]:
            for w, _ in parts:
                touch(w)
        floor.append(time.perf_counter() - t0)
    print(f"\n{a.rows} row(s), {a.threads} threads, {a.rounds} rounds, ms (min / median); load {os.getloadavg()[0]:.2f}")
    print("| | " + " | ".join(kernels) + " | new / old (min) |\n|---|" + "---|" * (len(kernels) + 1))
    for t in tasks:
        cells = [times[t, k][1:] for k in kernels]
        print(f"| {t} | " + " | ".join(f"{min(c) * 1e3:.3f} / {statistics.median(c) * 1e3:.3f}" for c in cells)
              + f" | {min(cells[1]) / min(cells[0]):.2f} |")
    nbytes = sum(w.nbytes for parts in tasks[mem] for w, _ in parts)
    print(f"\nread only, the same matrices ({nbytes / 1e6:.0f} MB): {min(floor[1:]) * 1e3:.3f} / "
          f"{statistics.median(floor[1:]) * 1e3:.3f} ms ({nbytes / min(floor[1:]) / 1e9:.1f} GB/s at the minimum)")


if __name__ == "__main__":
    main()
