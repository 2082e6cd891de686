"""How many partitions per context, how many warps per CTA, how deep a ring? Measured.

For each (B, ctx) point of docs/kernels.md's grid (Qwen2-0.5B layer: 14/2 heads, d=64, fp16,
block 16), in one run and with bench_kernels.py's method (CUDA-graph replay rotating over KV
sets larger than L2): torch SDPA on a dense cache, v8 (wave plan), v9 with its plan, and v9
forced to every (splits, warps per CTA, ring stages) given whose partitions hold at least one
16-token chunk per warp. Prints a table and writes tune_splits.json / tune_splits.md to --out.

    python scripts/tune_splits.py --out docs/
    python scripts/tune_splits.py --points 64x2048 128x2048 --splits 1 2 --warps 8 16 --stages 3 4
"""
import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import NUM_KV_HEADS, Problem, _check, _time_graph  # noqa: E402

DEFAULT_POINTS = ["32x8192", "64x2048", "128x2048", "256x512", "64x8192", "128x8192", "256x2048",
                  "256x8192", "8x2048", "32x2048", "128x512"]
DEFAULT_SPLITS = [1, 2, 4, 8]
DEFAULT_WARPS = [4, 8, 16]
DEFAULT_STAGES = [3]


def sweep_point(batch, ctx, split_counts, warp_counts, stage_counts):
    from kernels_numba import paged_attention as pa

    num_sets = Problem.num_sets_for(batch, ctx)
    prob = Problem(batch, ctx, num_sets, want_flex=False)
    ref0 = prob.reference(0)
    out = torch.empty_like(prob.q)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row = dict(batch=batch, ctx=ctx, us={}, plan={})
    row["us"]["sdpa"] = _time_graph(prob.sdpa, num_sets)
    row["plan"]["v8"] = pa.split_plan_waves(batch, NUM_KV_HEADS, ctx, 16 * pa.NUM_WARPS, pa.V8_CTAS_PER_SM * sms)[0]
    splits, _, warps = pa.v9_plan(batch, NUM_KV_HEADS, ctx, sms)
    row["plan"]["v9"] = f"{splits} x {warps}"
    for version in (8, 9):
        _check(prob.ours(version, out)(0), ref0, f"v{version}")
        row["us"][f"v{version}"] = _time_graph(prob.ours(version, out), num_sets)
    launch_v9 = pa.VERSIONS[9]
    try:
        for n, w, st in combos(split_counts, warp_counts, stage_counts):
            if ctx / n < 16 * w:
                continue
            pa.VERSIONS[9] = functools.partial(launch_v9, splits=n, warps=w, stages=st)
            _check(prob.ours(9, out)(0), ref0, f"v9 splits={n} warps={w} stages={st}")
            row["us"][key(n, w, st)] = _time_graph(prob.ours(9, out), num_sets)
    finally:
        pa.VERSIONS[9] = launch_v9
    return row


def combos(split_counts, warp_counts, stage_counts):
    return [(n, w, st) for n in split_counts for w in warp_counts for st in stage_counts]


def key(n, w, st):
    return f"s{n}_w{w}_st{st}"


def markdown(rows, split_counts, warp_counts, stage_counts):
    """One row per point: SDPA, v8, v9's plan, then v9 per (splits x warps [x stages]), the
    fastest in bold."""
    cs = combos(split_counts, warp_counts, stage_counts)
    name = (lambda n, w, st: f"{n} x {w}") if len(stage_counts) == 1 else (lambda n, w, st: f"{n} x {w} x {st}")
    combos_k = [key(*c) for c in cs]
    head = ["B x ctx", "SDPA us", "v8 us (splits)", "v9 us (splits x warps)"] + \
           [name(*c) for c in cs] + ["v9 / SDPA", "best / SDPA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        u = r["us"]
        forced = {c: u[c] for c in combos_k if c in u}
        best = min(forced.values(), default=u["v9"])
        cells = [f"{r['batch']} x {r['ctx']}", f"{u['sdpa']:.2f}", f"{u['v8']:.2f} ({r['plan']['v8']})",
                 f"{u['v9']:.2f} ({r['plan']['v9']})"]
        cells += ["" if c not in u else (f"**{u[c]:.2f}**" if u[c] == best else f"{u[c]:.2f}") for c in combos_k]
        cells += [f"{u['sdpa'] / u['v9']:.2f}", f"{u['sdpa'] / min(best, u['v9']):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="*", default=DEFAULT_POINTS, help="BxCTX, e.g. 64x2048")
    ap.add_argument("--splits", nargs="*", type=int, default=DEFAULT_SPLITS)
    ap.add_argument("--warps", nargs="*", type=int, default=DEFAULT_WARPS)
    ap.add_argument("--stages", nargs="*", type=int, default=DEFAULT_STAGES)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for p in args.points:
        batch, ctx = (int(x) for x in p.split("x"))
        t0 = time.time()
        rows.append(sweep_point(batch, ctx, args.splits, args.warps, args.stages))
        torch.cuda.empty_cache()  # the point's KV sets are gone: give their memory back
        u = rows[-1]["us"]
        print(f"B={batch:4d} ctx={ctx:5d} sdpa {u['sdpa']:7.2f} v8 {u['v8']:7.2f} v9 {u['v9']:7.2f} | "
              + " ".join(f"{k}:{v:.1f}" for k, v in u.items() if "_st" in k)
              + f"  ({time.time() - t0:.0f} s)", flush=True)
    table = markdown(rows, args.splits, args.warps, args.stages)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
                    torch=torch.__version__)
        (args.out / "tune_splits.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (args.out / "tune_splits.md").write_text(f"{meta}\n\n{table}\n")


if __name__ == "__main__":
    main()
