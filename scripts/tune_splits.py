"""How many partitions per context, how many warps per CTA, which merge? Measured for v10.

For each point (Qwen2-0.5B layer: 14/2 heads, d=64, fp16, block 16, shuffled block tables), in one
run and with bench_kernels.py's method (every configuration checked against an fp32 reference first,
then CUDA-graph replay rotating over KV sets larger than L2): torch SDPA on a dense cache, v9 with its
plan, v10 with its plan (decode_plan), and v10 forced to every (splits, warps per CTA, merge) given
whose partitions hold at least one 16-token chunk per warp: merge "f" (fused into the last CTA) or
"k" (the merge kernel). Prints a table (the fastest forced configuration in bold) and writes
tune_splits.json / tune_splits.md to --out.

    python3 scripts/tune_splits.py --out OUT
    python3 scripts/tune_splits.py --points 1x8192 8x2048 --splits 16 32 64 --warps 4 8 --merge fused kernel
"""
import argparse
import time

import torch

DEFAULT_POINTS = ["1x4000", "1x8192", "1x32768", "3x5000", "8x2048", "8x8192", "32x512", "32x2048", "32x8192",
                  "64x2048", "128x2048", "256x512"]
DEFAULT_SPLITS = [1, 4, 16, 32, 64]
DEFAULT_WARPS = [4, 8]
DEFAULT_MERGES = ["fused", "kernel"]


def combos(ctx, split_counts, warp_counts, merges, stages):
    """The forced v10 plans of a point: partitions of >= one 16-token chunk per warp; one merge for
    an unsplit context."""
    from kernels_numba import paged_attention as pa

    plans = []
    for n in split_counts:
        for w in warp_counts:
            if ctx / n < 16 * w:
                continue
            plan = pa.decode_plan(1, 1, 1, ctx, 132, splits=n, warps=w)
            for merge in merges if plan.splits > 1 else ["none"]:
                plans.append(pa.DecodePlan(plan.splits, plan.partition, w, stages, merge))
    return list(dict.fromkeys(plans))


def key(plan):
    """A forced plan's column: "splits x warps f|k" (f: fused merge, k: merge kernel)."""
    return f"{plan.splits} x {plan.warps}" + {"fused": " f", "kernel": " k"}.get(plan.merge, "")


def sweep_point(batch, ctx, plans, time_it=True, device="cuda"):
    """SDPA, v9 and v10 with their plans, v10 with each forced plan: checked, then (time_it) timed."""
    from kernels_numba import paged_attention as pa
    from kernels_numba.decode_journey_tensor_core import v9_plan
    from scripts import benchlib
    from scripts.bench_kernels import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, Problem, check_close

    lens = [ctx] * batch
    num_sets = benchlib.num_sets_for(2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2) if time_it else 2
    prob = Problem(lens, num_sets, device=device)
    ref = prob.reference(0)
    out = torch.empty_like(prob.q)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    v9 = v9_plan(batch, NUM_KV_HEADS, ctx, sms)
    own = pa.decode_plan(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, ctx, sms)
    row = dict(batch=batch, ctx=ctx, us={}, plan={"v9": f"{v9[0]} x {v9[2]}", "v10": key(own)})
    calls = {"sdpa": prob.sdpa, "v9": prob.ours(9, out), "v10": prob.ours(10, out)}
    calls.update({key(p): prob.ours(10, out, p) for p in plans})
    for name, fn in calls.items():  # every configuration checked before anything is timed
        check_close(fn(0), ref, f"{name} at {batch} x {ctx}")
    if time_it:
        for name, fn in calls.items():
            row["us"][name] = benchlib.graph_time_us(lambda i, fn=fn: fn(i % num_sets), calls=max(20, num_sets))
    return row


def markdown(rows, columns):
    """One row per point: SDPA, v9 and v10 with their plans, then v10 per forced plan (`columns`), the
    fastest forced one in bold, and v10's and the best one's speed relative to SDPA."""
    from scripts import benchlib

    lines = []
    for r in rows:
        u = r["us"]
        forced = {c: u[c] for c in columns if c in u}
        best = min(forced.values(), default=u["v10"])
        line = {"B x ctx": f"{r['batch']} x {r['ctx']}", "SDPA us": f"{u['sdpa']:.2f}",
                "v9 us (plan)": f"{u['v9']:.2f} ({r['plan']['v9']})",
                "v10 us (plan)": f"{u['v10']:.2f} ({r['plan']['v10']})"}
        for c in columns:
            line[c] = "" if c not in u else (f"**{u[c]:.2f}**" if u[c] == best else f"{u[c]:.2f}")
        line["v10 / SDPA"] = f"{u['sdpa'] / u['v10']:.2f}"
        line["best / SDPA"] = f"{u['sdpa'] / min(best, u['v10']):.2f}"
        lines.append(line)
    return benchlib.markdown_table(lines)


def main(points=DEFAULT_POINTS, split_counts=DEFAULT_SPLITS, warp_counts=DEFAULT_WARPS, merges=DEFAULT_MERGES,
         stages=3, out_dir=None, check=False, device="cuda"):
    """The sweep; returns its rows. check: validate every configuration without timing (device="cpu":
    in the CUDA simulator)."""
    from scripts import benchlib

    print(benchlib.env_line(), flush=True)
    rows, columns = [], []
    for p in points:
        batch, ctx = (int(x) for x in p.split("x"))
        plans = combos(ctx, split_counts, warp_counts, merges, stages)
        columns += [key(plan) for plan in plans if key(plan) not in columns]
        t0 = time.time()
        rows.append(sweep_point(batch, ctx, plans, not check, device))
        if device == "cuda":
            torch.cuda.empty_cache()  # the point's KV sets are gone: give their memory back
        print(f"B={batch:4d} ctx={ctx:5d} " + " ".join(f"{k}:{v:.1f}" for k, v in rows[-1]["us"].items())
              + f"  ({time.time() - t0:.0f} s)", flush=True)
    if check:
        return rows
    table = markdown(rows, columns)
    print(table)
    if out_dir:
        meta = dict(splits=split_counts, warps=warp_counts, merges=merges, stages=stages)
        benchlib.save(out_dir, "tune_splits", rows, meta, table)
    return rows


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="*", default=DEFAULT_POINTS, help="BxCTX, e.g. 64x2048")
    ap.add_argument("--splits", nargs="*", type=int, default=DEFAULT_SPLITS)
    ap.add_argument("--warps", nargs="*", type=int, default=DEFAULT_WARPS)
    ap.add_argument("--merge", nargs="*", default=DEFAULT_MERGES, choices=["fused", "kernel"])
    ap.add_argument("--stages", type=int, default=3, help="ring stages per warp")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="validate every configuration, no timing")
    a = ap.parse_args()
    main(a.points, a.splits, a.warps, a.merge, a.stages, a.out, a.check,
         "cuda" if torch.cuda.is_available() else "cpu")
