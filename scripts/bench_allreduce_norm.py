"""The all-reduce + residual add + RMSNorm of a tensor-parallel layer: unfused against fused, per token count.

    python3 scripts/bench_allreduce_norm.py --device cuda --world-size 2      # 2 GPUs, NCCL (multicast off)
    python3 scripts/bench_allreduce_norm.py --device cpu --hidden 896         # 2 CPU ranks, gloo

unfused: all_reduce(partial), then add_rms_norm on all T rows (what the model runs today after o_proj and
down_proj). fused: pagedattn.distributed.allreduce_norm.all_reduce_add_rms_norm (reduce-scatter over tokens,
add + norm on each rank's T/P rows, all-gather of the normed rows; the residual stays as rows). Every
configuration is checked first: the fused output and the gathered residual against the unfused ones (bit
for bit at P = 2, where both paths add the same two terms). Times are rank 0's median microseconds per call
(CUDA events around `iters` calls on CUDA, perf_counter on CPU), the ranks starting each timing together.
Default shapes: Qwen2-7B's hidden 3584, T from one decode token to a 2048-token prefill chunk.
"""
import os
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` and `pagedattn` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

TOKENS = (1, 8, 64, 256, 2048)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _time_us(fn, device, iters, repeats=5):
    """Median over `repeats` of the mean microseconds per call of `iters` calls (ranks start together)."""
    import torch.distributed as dist

    out = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1000 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1e6 / iters)
    return _median(out)


def _rank(rank, world_size, init_method, device_type, hidden, tokens, dtype, iters, results):
    import torch.distributed as dist

    from pagedattn.distributed.allreduce_norm import all_reduce_add_rms_norm, gather_rows, shard_rows
    from pagedattn.layers.ops import add_rms_norm

    device = torch.device(f"cuda:{rank}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size)
    try:
        rows = []
        eps = 1e-6
        for T in tokens:
            mine = torch.Generator().manual_seed(1000 * T + rank)
            shared = torch.Generator().manual_seed(T)
            partial = torch.randn(T, hidden, generator=mine).to(device, dtype)               # (T, hidden)
            residual = (3 * torch.randn(T, hidden, generator=shared)).to(device, dtype)      # (T, hidden)
            weight = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(device, dtype)     # (hidden,)
            residual_rows = shard_rows(residual, rank, world_size)                          # (T/P, hidden)

            def unfused():
                y = partial.clone()
                dist.all_reduce(y)
                return add_rms_norm(y, residual, weight, eps)

            def fused():
                return all_reduce_add_rms_norm(partial, residual_rows, weight, eps, add_rms_norm)

            want_x, want_res = unfused()
            x, res_rows = fused()
            res = gather_rows(res_rows, T)
            diff = max((x.float() - want_x.float()).abs().max().item(),
                       (res.float() - want_res.float()).abs().max().item())
            equal = bool(torch.equal(x, want_x) and torch.equal(res, want_res))
            t_unfused = _time_us(unfused, device, iters)
            t_fused = _time_us(fused, device, iters)
            rows.append(dict(tokens=T, unfused_us=t_unfused, fused_us=t_fused, speedup=t_unfused / t_fused,
                             equal=equal, max_diff=diff))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main(device="cuda", world_size=2, hidden=3584, tokens=TOKENS, dtype="float16", iters=50):
    """Returns one row per token count: tokens, unfused_us, fused_us, speedup, equal, max_diff."""
    import torch.multiprocessing as mp

    from pagedattn.distributed.parallel import free_port

    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--world-size {world_size} needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world_size, f"tcp://127.0.0.1:{free_port()}", device, hidden, tuple(tokens),
                                    DTYPES[dtype], iters, results), nprocs=world_size, join=True, start_method="spawn")
    rows = results.get()
    print(f"P={world_size} {device} {dtype} hidden={hidden}, median us per call")
    print("| tokens | unfused us | fused us | speedup | equal | max diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.2f}x | "
              f"{r['equal']} | {r['max_diff']:.3g} |")
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float16 on cuda, float32 on cpu")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    main(a.device, a.world_size, a.hidden, a.tokens, a.dtype or ("float16" if a.device == "cuda" else "float32"),
         a.iters)
