"""One decode-attention point, launched repeatedly, for a profiler (ncu / compute-sanitizer).

    ncu --launch-skip 6 --launch-count 4 --metrics gpu__time_duration.sum,... \
        python scripts/profile_decode.py --batch 64 --ctx 2048 --version 8
    python scripts/profile_decode.py --batch 64 --ctx 2048 --version sdpa

Same shapes as scripts/bench_kernels.py (Qwen2-0.5B layer: 14/2 heads, d=64, fp16, block 16,
shuffled block tables). --splits forces a split count on v8+ (default: the version's plan).
The output is checked against an fp32 reference once, before the profiled launches.
"""
import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Problem, _check  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--version", default="8", help="a kernel version, or sdpa")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    prob = Problem(args.batch, args.ctx, num_sets=1, want_flex=False)
    if args.version == "sdpa":
        def run():
            return prob.sdpa(0)
    else:
        from kernels_numba import paged_attention as pa

        version = int(args.version)
        if args.splits is not None:
            pa.VERSIONS[version] = functools.partial(pa.VERSIONS[version], splits=args.splits)
        ours = prob.ours(version, torch.empty_like(prob.q))

        def run():
            return ours(0)
    _check(run(), prob.reference(0), f"{args.version}")
    for _ in range(args.iters):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
