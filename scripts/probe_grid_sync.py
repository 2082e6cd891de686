"""What a whole-step kernel's phases can wait on, measured on the GPU: numba's grid barrier against a
barrier of our own, and whether either survives a CUDA graph (docs/kernels.md, "The step family: plan").

  1. cooperative launch: a kernel that calls cuda.cg.this_grid() launches cooperatively (numba links
     cudadevrt and passes the cooperative attribute); the largest grid it may have at 128 / 256 / 512
     threads (overload.max_cooperative_grid_blocks); a grid one CTA larger is refused, not hung.
  2. cost: microseconds per barrier over 1,000 rounds for `grid.sync()` and for a counter barrier (thread 0
     of every CTA adds one to a global counter and spins until it reaches CTAs x epoch: no reset between
     rounds or launches), at one and two CTAs per SM; each checked by a neighbour exchange whose result is
     wrong if any CTA ran ahead.
  3. CUDA graphs: both kernels captured by torch.cuda.graph on a side stream (numba launching on it through
     cuda.external_stream), replayed 5 times, checked.

    python scripts/probe_grid_sync.py --out OUT         # one GPU, a few seconds
"""
import json
import os
import sys
import time

import numpy as np
import torch
from numba import cuda

ROUNDS = 1000


@cuda.jit
def grid_exchange(a, c, rounds):
    """Round r: CTA b writes b + r, waits for every CTA, adds its neighbour's value minus r: c[b] gains
    (b + 1) % G per round if no CTA ran ahead."""
    grid = cuda.cg.this_grid()
    b, g = cuda.blockIdx.x, cuda.gridDim.x
    for r in range(rounds):
        if cuda.threadIdx.x == 0:
            a[b] = b + r
        grid.sync()
        if cuda.threadIdx.x == 0:
            c[b] += a[(b + 1) % g] - r
        grid.sync()


@cuda.jit(device=True)
def counter_barrier(bar, target):
    """Every CTA adds one to bar[0] and waits until it reaches target (CTAs x barriers passed so far)."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()
        cuda.atomic.add(bar, 0, 1)
        while cuda.atomic.add(bar, 0, 0) < target:      # an atomic read: never a stale cached value
            cuda.nanosleep(20)
        cuda.threadfence()
    cuda.syncthreads()


@cuda.jit
def counter_exchange(a, c, bar, rounds, epoch0):
    cuda.cg.this_grid()             # a cooperative launch: all CTAs resident, or the launch is refused
    b, g = cuda.blockIdx.x, cuda.gridDim.x
    for r in range(rounds):
        if cuda.threadIdx.x == 0:
            a[b] = b + r
        counter_barrier(bar, g * (epoch0 + 2 * r + 1))
        if cuda.threadIdx.x == 0:
            c[b] += a[(b + 1) % g] - r
        counter_barrier(bar, g * (epoch0 + 2 * r + 2))


def expected(g, rounds, launches=1):
    return ((np.arange(g) + 1) % g) * rounds * launches


def cooperative_part():
    a, c = cuda.device_array(4096, np.int32), cuda.to_device(np.zeros(4096, np.int32))
    grid_exchange[4, 128](a, c, 1)
    cuda.synchronize()
    overload = next(iter(grid_exchange.overloads.values()))
    out = dict(cooperative=bool(overload.cooperative),
               max_blocks={t: overload.max_cooperative_grid_blocks(t) for t in (128, 256, 512)})
    try:
        grid_exchange[out["max_blocks"][256] + 1, 256](a, c, 1)
        cuda.synchronize()
        out["oversized_grid"] = "launched (not refused)"
    except Exception as e:  # noqa: BLE001 (the answer we want)
        out["oversized_grid"] = f"refused: {type(e).__name__}: {str(e)[:120]}"
    return out


def cost_part(sms):
    rows = []
    for g in (sms, 2 * sms):
        a = cuda.device_array(4096, np.int32)
        for name in ("grid.sync", "counter"):
            c = cuda.to_device(np.zeros(4096, np.int32))
            bar = cuda.to_device(np.zeros(1, np.int32))
            epoch = [0]

            def launch():
                if name == "grid.sync":
                    grid_exchange[g, 256](a, c, ROUNDS)
                else:
                    counter_exchange[g, 256](a, c, bar, ROUNDS, epoch[0])
                    epoch[0] += 2 * ROUNDS
            try:
                launch()
                cuda.synchronize()
                t = time.perf_counter()
                for _ in range(5):
                    launch()
                cuda.synchronize()
                us = (time.perf_counter() - t) / 5 / (2 * ROUNDS) * 1e6
                ok = bool((c.copy_to_host()[:g] == expected(g, ROUNDS, 6)).all())
                rows.append(dict(barrier=name, ctas=g, us_per_barrier=round(us, 3), correct=ok))
            except Exception as e:  # noqa: BLE001 (reported, the other rows still run)
                rows.append(dict(barrier=name, ctas=g, error=f"{type(e).__name__}: {str(e)[:120]}"))
            print(rows[-1], flush=True)
    return rows


def graph_part(sms):
    side = torch.cuda.Stream()
    stream = cuda.external_stream(side.cuda_stream)
    a = cuda.device_array(4096, np.int32)
    x = torch.zeros(4096, dtype=torch.int32, device="cuda")
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    c, b = cuda.as_cuda_array(x), cuda.as_cuda_array(bar)
    with torch.cuda.stream(side):                       # compiled and loaded before the capture
        grid_exchange[sms, 256, stream](a, c, 1)
        counter_exchange[sms, 256, stream](a, c, b, 1, 0)
    side.synchronize()
    out = {}
    for name in ("grid.sync", "counter"):
        x.zero_()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side):
                if name == "grid.sync":
                    grid_exchange[sms, 256, stream](a, c, 2)
                else:
                    bar.zero_()                         # a memset node: the counter starts at 0 every replay
                    counter_exchange[sms, 256, stream](a, c, b, 2, 0)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            out[name] = "correct" if (x.cpu().numpy()[:sms] == expected(sms, 2, 5)).all() else "WRONG values"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
        print(name, out[name], flush=True)
    return out


def main(out_dir):
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    res = dict(device=torch.cuda.get_device_name(), sms=sms, torch=torch.__version__,
               cooperative=cooperative_part(), cost=cost_part(sms), graphs=graph_part(sms))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "probe_grid_sync.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "probe_grid_sync_out")
