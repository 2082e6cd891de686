"""The skinny decode GEMM (kernels_numba/skinny_gemm.py) against cuBLAS at Qwen2-0.5B's and 7B's shapes.

One GPU command: validates every shape and fused variant against torch, then times, and writes the table.

    python3 scripts/bench_skinny_gemm.py --out $OUT        (from the repository root; numpy < 2.5)

Both kernels are timed: v1 (activation rows staged in shared memory, split-K over CTAs) and v2 (a CTA per
16-row tile, K split over its warps, next chunk's loads in flight during this chunk's mma), beside cuBLAS;
and each shape's fused variant in v2 (v1 at M = 1 and 16) beside the unfused ops it replaces.

1. Validation, on fresh random bf16 inputs (weights scaled like a trained layer's): for every shape and
   M in ROWS the plain GEMM of each kernel, and each shape's fused variant (qkv: RMSNorm prologue with
   the residual add + bias; o_proj and down_proj: the residual-add epilogue; gate_up: the prologue +
   SiLU-and-mul; LM head: the prologue without add) in v2 at M in ROWS and (1, 5, 16), in v1 at (1, 5, 16),
   and the unfused chain it is timed against, all against torch's float32 product of the same values
   with the unfused roundings: |err| <= 1 unit in the last place + K 2^-23 sum|x w| (2 units and the
   gate/up slack for SiLU-and-mul). Then two more calls must give the same bits (no arrival-order sums).
2. Timing by CUDA-graph replay (benchlib.graph_time_us) with >= 4 rotated weight sets covering 3x the L2,
   so every call streams its weights from HBM; beside it torch's F.linear (cuBLAS) the same way.
   GB/s counts the weight bytes (x and y are < 0.1% of them); "% copy" is against torch's copy of a 1 GiB
   buffer (read + write) measured in the same run. The fused variant beside the unfused chain, the ops
   the engine runs today: kernels_numba/rmsnorm.py's kernel (with the residual add), cuBLAS (bias in its
   epilogue), kernels_numba/activation.py's SiLU-and-mul, torch's add for the residual.
3. The SASS of the plain kernels and of v2's prologue kernels (numba's inspect_sass, where nvdisasm is
   installed): LDG.E.128 and HMMA.

Writes $OUT/skinny_gemm.md and $OUT/skinny_gemm.json.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts import benchlib  # noqa: E402

ROWS = (1, 2, 4, 8, 16)
SWEEP_SHAPES = ("0.5B qkv", "0.5B gate_up", "0.5B down", "7B o_proj")   # small N or long K: the split matters
SWEEP_ROWS = (1, 16)
SWEEP_SPLITS = (4, 8, 16, 24, 32)                                         # steps (of 32 k) per split
VALIDATE_FUSED_ROWS = (1, 5, 16)
V2_SWEEP_SHAPES = ("0.5B gate_up", "0.5B down", "7B qkv", "7B o_proj", "7B gate_up", "7B down", "7B lm_head")
V2_SWEEP_ROWS = (1, 8)
V2_SWEEP_WARPS = (4, 8, 16)                                               # warps sharing a tile's K
# name: (N, K, fused variant); Qwen2-0.5B: hidden 896, 14 / 2 heads of 64, intermediate 4864;
# Qwen2-7B: hidden 3584, 28 / 4 heads of 128, intermediate 18944; vocab 151936 / 152064
SHAPES = {
    "0.5B qkv": (1152, 896, "norm_add_bias"), "0.5B o_proj": (896, 896, "residual"),
    "0.5B gate_up": (9728, 896, "norm_add_silu"), "0.5B down": (896, 4864, "residual"),
    "0.5B lm_head": (151936, 896, "norm"),
    "7B qkv": (4608, 3584, "norm_add_bias"), "7B o_proj": (3584, 3584, "residual"),
    "7B gate_up": (37888, 3584, "norm_add_silu"), "7B down": (3584, 18944, "residual"),
    "7B lm_head": (152064, 3584, "norm"),
}
DTYPE = torch.bfloat16
ULP = 2.0 ** -7
EPS = 1e-6


def rnd(v):
    return v.to(DTYPE).float()


def torch_reference(x, w, variant, bias=None, residual=None, gamma=None, norm_residual=None):
    """The unfused path in torch (float32 math, the dtype's roundings where the layers round).
    Returns (y, bound): the float64 result and the elementwise tolerance."""
    K = x.shape[1]
    new_res = None
    if gamma is not None:
        z = rnd(norm_residual.float() + x.float()) if norm_residual is not None else x.float()
        new_res = z if norm_residual is not None else None
        inv = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + EPS)
        normed = rnd(rnd(z * inv) * gamma.float())
        # the kernel's own sum of squares may put a normed value one unit off
        x_err = ULP * normed.abs()
        x = normed
    else:
        x = x.float()
        x_err = torch.zeros_like(x)
    wf = w.float()
    acc = (x @ wf.T).double()                                               # (M, N)
    scale = (x.abs() @ wf.abs().T).double() * K * 2.0 ** -23 + (x_err @ wf.abs().T).double()
    if bias is not None:
        acc = acc + bias.double()
    if "silu" in variant:
        inter = acc.shape[1] // 2
        g, u = acc[:, :inter].to(DTYPE).double(), acc[:, inter:].to(DTYPE).double()
        s = (g * torch.sigmoid(g)).to(DTYPE).double()
        y = (s * u).to(DTYPE).double()
        bound = 2 * ULP * y.abs() + (ULP * g.abs() + scale[:, :inter]) * 1.1 * u.abs() \
            + (ULP * u.abs() + scale[:, inter:]) * s.abs()
    else:
        y = acc.to(DTYPE).double()
        bound = ULP * y.abs() + scale
        if residual is not None:
            y = (y + residual.double()).to(DTYPE).double()
            bound = bound + ULP * y.abs()
    return y, bound + 2.0 ** -126, new_res


def make_case(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, generator=g, device="cuda").to(DTYPE)
    w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).to(DTYPE)
    return x, w


def unfused_chain(variant, x, bias, kw):
    """The ops that skinny_linear(x, w, bias, **kw) fuses, as separate launches (the engine's path today):
    run(w) -> the output. With the residual add the rmsnorm kernel updates a copy of norm_residual in place
    (stream, returned beside run)."""
    from kernels_numba import activation, rmsnorm

    gamma, nres = kw.get("norm_weight"), kw.get("norm_residual")
    stream = nres.clone() if nres is not None else None
    normed = torch.empty_like(x)

    def run(w):
        h = x
        if gamma is not None and stream is not None:
            h, _ = rmsnorm.fused_add_rms_norm(x, stream, gamma, EPS, out=normed, validate=False)
        elif gamma is not None:
            h = rmsnorm.rms_norm(x, gamma, EPS, out=normed, validate=False)
        y = F.linear(h, w, bias)
        if kw.get("silu"):
            return activation.silu_and_mul(y, validate=False)
        if "residual" in kw:
            return y.add_(kw["residual"])
        return y

    return run, stream


def fused_args(variant, M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    kw = {}
    if "norm" in variant:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).to(DTYPE)
        kw["eps"] = EPS
    if "add" in variant:
        kw["norm_residual"] = (3 * torch.randn(M, K, generator=g, device="cuda")).to(DTYPE)
        kw["residual_out"] = torch.empty(M, K, dtype=DTYPE, device="cuda")
    if "bias" in variant:
        kw["bias"] = torch.randn(N, generator=g, device="cuda").to(DTYPE)
    if variant == "residual":
        kw["residual"] = (4 * torch.randn(M, N, generator=g, device="cuda")).to(DTYPE)
    if "silu" in variant:
        kw["silu"] = True
    return kw


def check(name, M, variant, sg, kernel=None):
    """Validate one (shape, M, variant) of kernel version `kernel` (None: skinny_linear's choice; "unfused":
    unfused_chain, the ops the fused call replaces); returns the worst err / bound."""
    N, K, _ = SHAPES[name]
    x, w = make_case(M, N, K, seed=M * 131 + N)
    kw = fused_args(variant, M, N, K, seed=M) if variant != "plain" else {}
    if kernel is not None and kernel != "unfused":
        kw["variant"] = kernel
    bias = kw.pop("bias", None)
    want, bound, new_res = torch_reference(x, w, variant, bias=bias, residual=kw.get("residual"),
                                           gamma=kw.get("norm_weight"), norm_residual=kw.get("norm_residual"))
    what = f"{name} M={M} {variant}" + (f" ({kernel})" if kernel else "")
    if kernel == "unfused":
        run, stream = unfused_chain(variant, x, bias, kw)
        y = run(w)
        ratio = ((y.double() - want).abs() / bound).max().item()
        if ratio > 1 or not torch.isfinite(y).all():
            raise AssertionError(f"{what}: max err / bound = {ratio:.3f}")
        if new_res is not None and not torch.equal(stream.float(), new_res):
            raise AssertionError(f"{what}: the residual stream is not round(residual + x)")
        return ratio
    y = sg.skinny_linear(x, w, bias, **kw)
    ratio = ((y.double() - want).abs() / bound).max().item()
    if ratio > 1 or not torch.isfinite(y).all():
        raise AssertionError(f"{what}: max err / bound = {ratio:.3f}")
    if new_res is not None and not torch.equal(kw["residual_out"].float(), new_res):
        raise AssertionError(f"{what}: residual_out is not round(residual + x)")
    for _ in range(2):
        if not torch.equal(sg.skinny_linear(x, w, bias, **kw).view(torch.int16), y.view(torch.int16)):
            raise AssertionError(f"{name} M={M} {variant}: a second call gave other bits")
    return ratio


def sass_counts(sg):
    """LDG.E.128 and HMMA in the SASS of the plain kernels compiled so far (None without nvdisasm)."""
    try:
        counts = {}
        kernels = [(f"v1 {k}", sg.make_gemm_kernel(True, k == "m16", False, False, False, False, False, 0))
                   for k in ("m8", "m16")]
        kernels += [(f"v2 {k} {w} warps", sg.make_gemm_kernel_v2(True, k == "m16", w, False, False, False, True))
                    for k in ("m8", "m16") for w in (4, 8, 16)]
        # v2 with the norm prologue as qkv (+ add, bias), gate_up (+ add, SiLU) and the LM head use it
        kernels += [(f"v2 norm{'_add' if add else ''}{'_bias' if b else ''}{'_silu' if si else ''} {k} {w} warps",
                     sg.make_gemm_kernel_v2(True, k == "m16", w, b, si, False, True, True, add))
                    for add, b, si in ((True, True, False), (True, False, True), (False, False, False))
                    for k in ("m8", "m16") for w in (4, 8, 16)]
        for key, kernel in kernels:
            sass = "\n".join(kernel.inspect_sass().values())     # the specialisations compiled so far
            if not sass:                                          # not run at these shapes
                continue
            wide = re.findall(r"LDG\.E[.A-Z0-9_]*\.128[.A-Z0-9_]*", sass)       # 128-bit global loads
            counts[key] = {"LDG 128-bit": len(wide), "of them .NA (no L1 allocation)":
                           sum(1 for op in wide if ".NA." in op + "."),
                           "HMMA.16816": sass.count("HMMA.16816"),
                           "fp64 (DADD/DMUL/DFMA)": sum(sass.count(op) for op in ("DADD", "DMUL", "DFMA"))}
        return counts
    except Exception as e:  # noqa: BLE001 - no nvdisasm: say so in the table, time anyway
        return {"unavailable": f"{type(e).__name__}: {e}"[:200]}


def predicted_us(nbytes, splits, copy_gbs):
    """Before measuring: the weights at 90% of the copy bandwidth, plus ~2 us of launch and first-load
    latency of a kernel in a graph, plus ~1 us with split-K (the last warp of a tile reads the partials)."""
    return nbytes / (0.9 * copy_gbs * 1e3) + 2.0 + (1.0 if splits > 1 else 0.0)


def predicted_us_v2(nbytes, M, N, K, silu, copy_gbs):
    """Before measuring v2: ~2.5 us of launch, first-load latency and drain in a graph (cuBLAS's floor on
    the 2 MB layers is 4.3 us), plus the longer of streaming the weights at 92% of the copy bandwidth and
    the warps' round trips to HBM (~0.8 us each; a warp keeps 2 chunks in flight, so ceil(n / 2) + 1 trips
    for n chunks), plus ~0.3 us for the warps' sums through shared memory and the epilogue."""
    from kernels_numba import skinny_gemm as sg

    tiles, kwarps, chunks = sg.plan_v2(M, N, K, silu)
    per_warp = -(-chunks // kwarps)
    trips = -(-per_warp // 2) + 1
    return 2.5 + max(nbytes / (0.92 * copy_gbs * 1e3), 0.8 * trips) + 0.3


def main(out_dir, shapes=None, rows=ROWS, quick=False, sweeps=True):
    from kernels_numba import skinny_gemm as sg

    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny_gemm.py needs a CUDA GPU")
    shapes = list(shapes or SHAPES)
    t0 = time.time()
    # ---- 1. validation ----
    worst = {}
    for name in shapes:
        for M in rows:
            for kernel in sg.VARIANTS:
                worst[(name, M, f"plain v{kernel}")] = check(name, M, "plain", sg, kernel)
        variant = SHAPES[name][2]
        fused_rows = sorted(set(rows) | set(VALIDATE_FUSED_ROWS))
        for M in fused_rows:
            worst[(name, M, variant)] = check(name, M, variant, sg)               # skinny_linear's choice: v2
            worst[(name, M, variant + " unfused")] = check(name, M, variant, sg, "unfused")
            if M in VALIDATE_FUSED_ROWS:
                worst[(name, M, variant + " v1")] = check(name, M, variant, sg, 1)
        print(f"validated {name}: plain v1 and v2 M={list(rows)}, {variant} v2 and unfused M={fused_rows}, "
              f"v1 M={list(VALIDATE_FUSED_ROWS)}; worst err/bound "
              f"{max(v for k, v in worst.items() if k[0] == name):.3f} ({time.time() - t0:.0f} s)", flush=True)
    torch.cuda.synchronize()
    # ---- 2. timing ----
    copy_gbs = benchlib.copy_bandwidth_gbs()
    print(f"copy bandwidth (read + write): {copy_gbs:,.0f} GB/s", flush=True)
    rows_out = []
    for name in shapes:
        N, K, variant = SHAPES[name]
        nbytes = N * K * 2
        sets = benchlib.num_sets_for(nbytes)
        ws = [torch.randn(N, K, device="cuda", dtype=DTYPE) * K ** -0.5 for _ in range(sets)]
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=DTYPE)
            n_out = N // 2 if "silu" in variant else N
            out = torch.empty(M, N, device="cuda", dtype=DTYPE)
            calls = max(20, sets)
            ours = benchlib.graph_time_us(
                lambda i: sg.skinny_linear(x, ws[i % sets], out=out, variant=1, validate=False),
                calls=calls, replays=5 if quick else 10)
            ours2 = benchlib.graph_time_us(
                lambda i: sg.skinny_linear(x, ws[i % sets], out=out, variant=2, validate=False),
                calls=calls, replays=5 if quick else 10)
            cublas = benchlib.graph_time_us(lambda i: F.linear(x, ws[i % sets]), calls=calls,
                                            replays=5 if quick else 10)
            row = {"shape": name, "M": M, "N": N, "K": K, "weight MB": nbytes / 1e6}
            # the fused variant (one kernel in place of the norm, the GEMM and the glue) beside those ops
            kw = fused_args(variant, M, N, K, seed=3)
            bias = kw.pop("bias", None)
            fout = torch.empty(M, n_out, device="cuda", dtype=DTYPE)
            row["fused"] = variant
            row["v2 fused µs"] = benchlib.graph_time_us(
                lambda i: sg.skinny_linear(x, ws[i % sets], bias, out=fout, variant=2, validate=False, **kw),
                calls=calls, replays=5 if quick else 10)
            chain, _ = unfused_chain(variant, x, bias, kw)
            row["unfused µs"] = benchlib.graph_time_us(lambda i: chain(ws[i % sets]), calls=calls,
                                                       replays=5 if quick else 10)
            row["v2 fused vs unfused"] = row["unfused µs"] / row["v2 fused µs"]
            if M in (1, 16):
                row["v1 fused µs"] = benchlib.graph_time_us(
                    lambda i: sg.skinny_linear(x, ws[i % sets], bias, out=fout, variant=1, validate=False, **kw),
                    calls=calls, replays=5 if quick else 10)
            tiles, sps, splits, grid_x = sg.plan(M, N, K)
            tiles2, kwarps, _ = sg.plan_v2(M, N, K)
            if splits > 1:                   # the same partials added by a second kernel instead
                row["2-kernel µs"] = benchlib.graph_time_us(
                    lambda i: sg.skinny_linear(x, ws[i % sets], out=out, reduce="kernel", validate=False),
                    calls=calls, replays=5 if quick else 10)
            row.update({"plan (steps/split, splits, CTAs)": f"{sps}, {splits}, {grid_x * splits}",
                        "predicted µs": predicted_us(nbytes, splits, copy_gbs),
                        "µs": ours, "GB/s": nbytes / ours / 1e3, "% copy": 100 * nbytes / ours / 1e3 / copy_gbs,
                        "v2 plan (warps/tile, CTAs)": f"{kwarps}, {tiles2}",
                        "v2 predicted µs": predicted_us_v2(nbytes, M, N, K, False, copy_gbs),
                        "v2 µs": ours2, "v2 % copy": 100 * nbytes / ours2 / 1e3 / copy_gbs,
                        "cuBLAS µs": cublas, "cuBLAS GB/s": nbytes / cublas / 1e3,
                        "cuBLAS % copy": 100 * nbytes / cublas / 1e3 / copy_gbs, "vs cuBLAS": cublas / ours,
                        "v2 vs cuBLAS": cublas / ours2})
            rows_out.append(row)
            print(f"{name:>13} M={M:2d}: v1 {ours:8.2f} us ({row['% copy']:5.1f}% copy) | v2 {ours2:8.2f} us "
                  f"({row['v2 % copy']:5.1f}%, predicted {row['v2 predicted µs']:.1f}) | "
                  f"cuBLAS {cublas:8.2f} us ({row['cuBLAS % copy']:5.1f}%) | "
                  f"{variant}: v2 fused {row['v2 fused µs']:.2f} us, unfused {row['unfused µs']:.2f} us "
                  f"({row['v2 fused vs unfused']:.2f}x), v1 fused {row.get('v1 fused µs', float('nan')):.2f} us "
                  f"({time.time() - t0:.0f} s)", flush=True)
        del ws
        torch.cuda.empty_cache()
    # ---- the split-K span: the plan's choice against the other spans, where it matters ----
    sweep = []
    for name in [s for s in SWEEP_SHAPES if s in shapes and sweeps]:
        N, K, _ = SHAPES[name]
        sets = benchlib.num_sets_for(N * K * 2)
        ws = [torch.randn(N, K, device="cuda", dtype=DTYPE) for _ in range(sets)]
        for M in SWEEP_ROWS:
            x = torch.randn(M, K, device="cuda", dtype=DTYPE)
            out = torch.empty(M, N, device="cuda", dtype=DTYPE)
            row = {"shape": name, "M": M, "plan's steps/split": sg.plan(M, N, K)[1]}
            for sps in SWEEP_SPLITS:
                if (sps - sg.UNROLL) * 32 >= K:       # a span past K: the same as a shorter one
                    continue
                row[f"{sps} steps/split µs"] = benchlib.graph_time_us(
                    lambda i: sg.skinny_linear(x, ws[i % sets], out=out, steps_per_split=sps, validate=False),
                    calls=max(20, sets), replays=5)
            sweep.append(row)
            print("sweep", row, flush=True)
        del ws
    # ---- v2's warps per tile against the plan's choice ----
    sweep2 = []
    for name in [s for s in V2_SWEEP_SHAPES if s in shapes and sweeps]:
        N, K, _ = SHAPES[name]
        sets = benchlib.num_sets_for(N * K * 2)
        ws = [torch.randn(N, K, device="cuda", dtype=DTYPE) for _ in range(sets)]
        for M in V2_SWEEP_ROWS:
            x = torch.randn(M, K, device="cuda", dtype=DTYPE)
            out = torch.empty(M, N, device="cuda", dtype=DTYPE)
            row = {"shape": name, "M": M, "plan's warps/tile": sg.plan_v2(M, N, K)[1]}
            for kw in V2_SWEEP_WARPS:
                row[f"{kw} warps µs"] = benchlib.graph_time_us(
                    lambda i: sg.skinny_linear(x, ws[i % sets], out=out, variant=2, warps_per_tile=kw,
                                               validate=False),
                    calls=max(20, sets), replays=5)
            # the plan's warps with weight loads that allocate in L1 (plain ld.global)
            row["plan's warps, L1-allocating loads µs"] = benchlib.graph_time_us(
                lambda i: sg.launch_v2(x, ws[i % sets], None, out, None, False, l1_no_allocate=False),
                calls=max(20, sets), replays=5)
            sweep2.append(row)
            print("v2 sweep", row, flush=True)
        del ws
        torch.cuda.empty_cache()
    sass = sass_counts(sg)
    print("SASS of the plain kernels:", sass)
    columns = ["shape", "M", "N", "K", "weight MB", "plan (steps/split, splits, CTAs)", "predicted µs", "µs",
               "GB/s", "% copy", "2-kernel µs", "v2 plan (warps/tile, CTAs)", "v2 predicted µs", "v2 µs",
               "v2 % copy", "cuBLAS µs", "cuBLAS GB/s", "cuBLAS % copy", "vs cuBLAS", "v2 vs cuBLAS", "fused",
               "v2 fused µs", "unfused µs", "v2 fused vs unfused", "v1 fused µs"]
    md = "\n".join([
        f"Skinny GEMM y[M, N] = x[M, K] W[N, K]^T, bf16, CUDA-graph replay, >= 4 rotated weight sets "
        f"(3x the L2). Copy bandwidth measured in this run: {copy_gbs:,.0f} GB/s (read + write).",
        "µs, GB/s, % copy, predicted, plan: v1 (staged rows, split-K over CTAs). v2 ...: a CTA per 16-row tile, "
        "K split over its warps. GB/s: weight bytes per second. 2-kernel: v1's split-K partials added by a "
        "second kernel instead of the tile's last warp. fused: the shape's fused variant (prologue/epilogue) "
        "in one call of v2 (v1 at M = 1 and 16); unfused: the same ops as separate launches (rmsnorm.py's "
        "kernel with the residual add, cuBLAS with the bias, activation.py's SiLU-and-mul, torch's add). "
        "vs cuBLAS: cuBLAS µs / ours; v2 fused vs unfused: unfused µs / fused µs.",
        f"Validated first (max err / bound over all cases: {max(worst.values()):.3f}; same bits on repeat).",
        f"SASS (plain kernels): {sass}", "", benchlib.markdown_table(rows_out, columns), "",
        "v1's split-K span (steps of 32 k per split) against the plan's choice, µs:", "",
        benchlib.markdown_table(sweep) if sweep else "(not run)", "",
        "v2's warps per tile (sharing its K) against the plan's choice, µs:", "",
        benchlib.markdown_table(sweep2) if sweep2 else "(not run)"])
    meta = {"sweep": sweep, "v2_sweep": sweep2, "copy_gbs": copy_gbs, "validation_worst_ratio": max(worst.values()),
            "sass": sass,
            "seconds": time.time() - t0}
    paths = benchlib.save(out_dir, "skinny_gemm", rows_out, meta, markdown=md)
    print(md)
    print("wrote", ", ".join(paths), f"in {time.time() - t0:.0f} s")
    return rows_out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for skinny_gemm.md / .json")
    parser.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="a subset of the shapes")
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS), help="activation rows M to time")
    parser.add_argument("--quick", action="store_true", help="5 replays instead of 10")
    parser.add_argument("--no-sweeps", action="store_true", help="skip v1's split sweep and v2's warps sweep")
    args = parser.parse_args()
    main(args.out, args.shapes, tuple(args.rows), args.quick, sweeps=not args.no_sweeps)
