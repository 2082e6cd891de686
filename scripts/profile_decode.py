"""One decode-attention point, launched repeatedly, for a profiler (ncu / nsys / compute-sanitizer).

    ncu --launch-skip 6 --launch-count 4 --metrics gpu__time_duration.sum,... \\
        python3 scripts/profile_decode.py --batch 64 --ctx 2048 --version 10
    python3 scripts/profile_decode.py --batch 1 --ctx 8192 --plan 64 4 kernel   # v10, a forced plan
    python3 scripts/profile_decode.py --batch 64 --ctx 2048 --version sdpa

Same shapes as scripts/bench_kernels.py (Qwen2-0.5B layer: 14/2 heads, d=64, fp16, block 16,
shuffled block tables). The output is checked against an fp32 reference once, before the profiled
launches.
"""
import argparse

import torch


def main(batch, ctx, version="10", plan=None, iters=10, device="cuda"):
    """Check one launch of `version` (a number, or "sdpa") at batch x ctx, then launch it `iters` times.
    plan: (splits, warps, merge) forced on v10."""
    from scripts.bench_kernels import Problem, check_close

    prob = Problem([ctx] * batch, num_sets=1, device=device)
    if version == "sdpa":
        def run():
            return prob.sdpa(0)
    else:
        from kernels_numba import paged_attention as pa

        forced = None
        if plan is not None:
            splits, warps, merge = plan
            forced = pa.decode_plan(batch, 2, 7, ctx, 132, splits=int(splits), warps=int(warps), merge=merge)
        ours = prob.ours(int(version), torch.empty_like(prob.q), forced)

        def run():
            return ours(0)
    err = check_close(run(), prob.reference(0), f"{version}")
    for _ in range(iters):
        run()
    if device == "cuda":
        torch.cuda.synchronize()
    return err


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--version", default="10", help="a kernel version, or sdpa")
    ap.add_argument("--plan", nargs=3, default=None, metavar=("SPLITS", "WARPS", "MERGE"),
                    help="v10 forced to this plan (merge: fused or kernel)")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    main(a.batch, a.ctx, a.version, a.plan, a.iters, "cuda" if torch.cuda.is_available() else "cpu")
