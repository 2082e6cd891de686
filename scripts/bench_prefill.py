"""Paged prefill kernels (every version) vs torch SDPA on a dense causal prefix, Qwen2-0.5B layer shapes.

For each shape (num_seqs x (cached prefix + new tokens)): build a shuffled paged pool and the
same K/V as a dense [B, Hkv, ctx, D] tensor, check both outputs against a float64 reference
(kernel error <= 2x SDPA's error + one fp16 ulp of the largest output), then time each by
CUDA-graph replay (CALLS launches per graph, median of REPS replays, ROTATE sets of buffers
cycled so L2 does not serve repeated reads). SDPA runs bottom-right causal (is_causal when
there is no prefix, torch's causal_lower_right otherwise) with enable_gqa. Also the kernel's
eager launch cost (host overhead included), which graphs remove.

    python scripts/bench_prefill.py [--out DIR] [--reps 10] [--calls 20]

Prints a table; with --out writes bench_prefill.json and bench_prefill.md there.
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_numba import paged_prefill as pp  # noqa: E402

# (label, num_seqs, cached tokens, new tokens)
SHAPES = [
    ("1x2048 new", 1, 0, 2048),
    ("8x512 new", 8, 0, 512),
    ("4x(1024+512)", 4, 1024, 512),
    ("1x(4096+256)", 1, 4096, 256),
]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 14, 2, 64, 16, torch.float16
VERSIONS = sorted(pp.VERSIONS)
DEVICE = "cuda"


def causal_flops(num_seqs, cached, new, num_heads, head_dim):
    """2 matmuls x 2 flops x heads x d x (keys each query sees), summed over queries."""
    keys = sum(cached + i + 1 for i in range(new))
    return 4 * num_heads * head_dim * keys * num_seqs


def make_inputs(num_seqs, cached, new, seed):
    """Paged pool (shuffled tables) and the same K/V dense; every pool block is in use."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ctx = cached + new
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    k_dense = torch.randn(num_seqs, NUM_KV_HEADS, ctx, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
    v_dense = torch.randn(num_seqs, NUM_KV_HEADS, ctx, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
    q_dense = torch.randn(num_seqs, NUM_HEADS, new, HEAD_DIM, device=DEVICE, generator=g, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g).to(torch.int32)
    block_tables = perm.view(num_seqs, blocks_per_seq).contiguous()
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=DTYPE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=DTYPE)
    pos = torch.arange(ctx, device=DEVICE)
    for s in range(num_seqs):
        blocks, offs = block_tables[s, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE
        k_cache[blocks, :, offs] = k_dense[s].transpose(0, 1)  # (ctx, Hkv, D) into [b, :, o, :]
        v_cache[blocks, :, offs] = v_dense[s].transpose(0, 1)
    q = q_dense.permute(0, 2, 1, 3).reshape(num_seqs * new, NUM_HEADS, HEAD_DIM).contiguous()  # packed
    cu = torch.arange(0, num_seqs + 1, device=DEVICE, dtype=torch.int32) * new
    context_lens = torch.full((num_seqs,), ctx, device=DEVICE, dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu=cu,
                context_lens=context_lens, q_dense=q_dense, k_dense=k_dense, v_dense=v_dense)


def sdpa_call(cached, new):
    """SDPA bottom-right causal, GQA; returns (fn(q, k, v) -> [B, H, new, D], description)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if cached == 0:
        return (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)), "is_causal"
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(new, cached + new)
    return (lambda q, k, v: sdpa(q, k, v, attn_mask=bias, enable_gqa=True)), "causal_lower_right"


def reference(x):
    """float64 bottom-right causal attention on the dense tensors: [B, H, new, D]."""
    q, k, v = x["q_dense"].double(), x["k_dense"].double(), x["v_dense"].double()
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    new, ctx = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)  # (B, H, new, ctx)
    visible = torch.arange(ctx, device=DEVICE)[None, :] <= torch.arange(ctx - new, ctx, device=DEVICE)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def kernel_call(x, out, version=pp.DEFAULT_VERSION):
    pp.paged_prefill(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu"], x["context_lens"], out=out,
                     version=version)


def time_graph(step, calls, reps):
    """Median µs per call: `calls` steps captured in one CUDA graph, replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm up: compile, allocator pools
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_eager(step, calls):
    """µs per call launched from Python (host overhead included), after a warm-up."""
    step(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def bench_shape(label, num_seqs, cached, new, reps, calls, rotate):
    sets = [make_inputs(num_seqs, cached, new, seed=i) for i in range(rotate)]
    sdpa, how = sdpa_call(cached, new)

    # validate every version before timing, on the first set
    x = sets[0]
    ref = reference(x)  # (B, H, new, D)
    theirs = sdpa(x["q_dense"], x["k_dense"], x["v_dense"]).double()
    err_sdpa = (theirs - ref).abs().max().item()
    tol = 2 * err_sdpa + 2 * 2.0**-11 * ref.abs().max().item()
    row = dict(shape=label, num_seqs=num_seqs, cached=cached, new=new, sdpa_mask=how, err_sdpa=err_sdpa)
    for version in VERSIONS:
        out = torch.empty_like(x["q"])
        kernel_call(x, out, version)
        ours = out.view(num_seqs, new, NUM_HEADS, HEAD_DIM).permute(0, 2, 1, 3).double()
        err = (ours - ref).abs().max().item()
        if not err <= tol:
            raise AssertionError(f"{label}: v{version} max err {err:.3g} > tol {tol:.3g} (SDPA err {err_sdpa:.3g})")
        row[f"err_v{version}"] = err

    flops = causal_flops(num_seqs, cached, new, NUM_HEADS, HEAD_DIM)
    outs = [torch.empty_like(s["q"]) for s in sets]
    for version in VERSIONS:
        us = time_graph(lambda i: kernel_call(sets[i % rotate], outs[i % rotate], version), calls, reps)
        row[f"us_v{version}"], row[f"tflops_v{version}"] = us, flops / us / 1e6
    us = time_graph(lambda i: sdpa(sets[i % rotate]["q_dense"], sets[i % rotate]["k_dense"],
                                   sets[i % rotate]["v_dense"]), calls, reps)
    row["us_sdpa"], row["tflops_sdpa"] = us, flops / us / 1e6
    best = min(VERSIONS, key=lambda v: row[f"us_v{v}"])
    row["best"], row["speed_vs_sdpa"] = best, row["us_sdpa"] / row[f"us_v{best}"]
    row["us_eager"] = time_eager(lambda i: kernel_call(sets[i % rotate], outs[i % rotate], best), calls)
    return row


def format_table(rows):
    cols = [f"v{v} µs (TFLOP/s)" for v in VERSIONS] + ["SDPA µs (TFLOP/s)", "best / SDPA speed",
                                                         "best eager µs", "max err " + ", ".join(f"v{v}" for v in VERSIONS) + " (SDPA)"]
    lines = ["| shape | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = [f"{r[f'us_v{v}']:.1f} ({r[f'tflops_v{v}']:.1f})" for v in VERSIONS]
        cells += [f"{r['us_sdpa']:.1f} ({r['tflops_sdpa']:.1f})", f"v{r['best']}: {r['speed_vs_sdpa']:.3f}x",
                  f"{r['us_eager']:.1f}",
                  ", ".join(f"{r[f'err_v{v}']:.2g}" for v in VERSIONS) + f" ({r['err_sdpa']:.2g})"]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment():
    from importlib.metadata import version

    return dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, numba=version("numba"), numba_cuda=version("numba-cuda"),
                numpy=version("numpy"))


def main(out=None, reps=10, calls=20, rotate=4, shapes=None):
    """Run every shape; return the rows. out: a folder for bench_prefill.{json,md}."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill needs a CUDA GPU")
    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"layer: {NUM_HEADS} q heads / {NUM_KV_HEADS} KV heads, d={HEAD_DIM}, {DTYPE}, block {BLOCK_SIZE}; "
          f"graph of {calls} calls, median of {reps} replays, {rotate} buffer sets")
    rows = []
    for label, num_seqs, cached, new in shapes or SHAPES:
        rows.append(bench_shape(label, num_seqs, cached, new, reps, calls, rotate))
        r = rows[-1]
        print(f"{label:>14}: " + "  ".join(f"v{v} {r[f'us_v{v}']:8.1f} µs ({r[f'tflops_v{v}']:5.1f} TFLOP/s)"
                                            for v in VERSIONS)
              + f"  SDPA[{r['sdpa_mask']}] {r['us_sdpa']:8.1f} µs ({r['tflops_sdpa']:5.1f} TFLOP/s)"
              + f"  eager v{r['best']} {r['us_eager']:.1f} µs", flush=True)
    table = format_table(rows)
    print(table)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_prefill.json").write_text(json.dumps(dict(env=env, rows=rows), indent=2))
        (out / "bench_prefill.md").write_text(" ".join(f"{k}={v}" for k, v in env.items()) + "\n\n" + table + "\n")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for bench_prefill.json / .md")
    parser.add_argument("--reps", type=int, default=10, help="graph replays; the median is reported")
    parser.add_argument("--calls", type=int, default=20, help="launches captured per graph")
    parser.add_argument("--rotate", type=int, default=4, help="buffer sets cycled through")
    args = parser.parse_args()
    main(out=args.out, reps=args.reps, calls=args.calls, rotate=args.rotate)
