"""Decode attention on the GPU: every kernel version against torch SDPA (dense) and FlexAttention (paged).

One call builds, checks and times everything (DEVICE.md's method):
  * copy bandwidth of the card (device-to-device copy, bytes read + written);
  * for B in {1, 8, 32, 64, 128, 256} x ctx in {512, 2048, 8192}, Qwen2-0.5B layer shapes
    (14 query heads, 2 KV heads, head_dim 64, fp16, block 16, shuffled block tables):
    every version of kernels_numba.paged_attention, SDPA on a dense contiguous cache
    (enable_gqa=True) and FlexAttention with torch's paged-attention helper;
  * the design's concurrency table (1, 2, 4, 8 sequences at ctx 512: tokens/s, speedup).
Every configuration is validated (fp32 torch reference) before it is timed. Timing: CUDA-graph
replay of >= 20 calls that rotate over >= 4 KV buffer sets (more for small sets, so that the
60 MB L2 does not serve them), median of >= 10 replays. Reported: us per call, GB/s of KV read
(2 * B * ctx * kv_heads * d * 2 bytes), % of the measured copy bandwidth, ratio to SDPA.

    python scripts/bench_kernels.py --out docs/            # kernels_bench.md / .json / .png
    python scripts/bench_kernels.py --quick                # a few points, for a smoke test
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 8192]
L2_BYTES = 60 * 2**20
SLOW_VERSION_MAX_TOKENS = 256 * 1024  # v1/v2 beyond this take seconds per point: skipped


def _time_graph(fn_of_set, num_sets, calls=20, replays=10):
    """us per call: a CUDA graph of max(calls, num_sets) calls rotating over the sets."""
    n = max(calls, num_sets)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(n, 3)):  # warm up (compiles, allocator pools) outside the capture
            fn_of_set(i % num_sets)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            fn_of_set(i % num_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n)
    del graph
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes=2 * 2**30):
    x = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del x, y
    return 2 * nbytes / statistics.median(times) / 1e9


class Problem:
    """num_sets independent KV sets of one (B, ctx) point, in three layouts of the same values:
    the paged pool (ours), a dense cache (SDPA) and flex's paged cache [1, KVH, pages*16, D]."""

    def __init__(self, batch, ctx, num_sets, want_flex, seed=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.ctx, self.num_sets = batch, ctx, num_sets
        blocks_per_seq = ctx // BLOCK_SIZE
        self.num_blocks = batch * blocks_per_seq + 1
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, generator=g).half()
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.sets = []
        for _ in range(num_sets):
            shape = (self.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
            k = torch.randn(shape, device=device, generator=g).half()
            v = torch.randn(shape, device=device, generator=g).half()
            perm = torch.randperm(self.num_blocks, device=device, generator=g)
            bt = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).int().contiguous()
            # dense [B, KVH, ctx, D]: gather every sequence's blocks in order
            kd = k[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, NUM_KV_HEADS, ctx, HEAD_DIM).contiguous()
            vd = v[bt.long()].permute(0, 2, 1, 3, 4).reshape(batch, NUM_KV_HEADS, ctx, HEAD_DIM).contiguous()
            entry = dict(k=k, v=v, bt=bt, kd=kd, vd=vd)
            if want_flex:
                # flex's physical cache: page p of head h at tokens p*16 .. p*16+15 of row h
                entry["kf"] = k.permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, -1, HEAD_DIM).contiguous()
                entry["vf"] = v.permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, -1, HEAD_DIM).contiguous()
            self.sets.append(entry)
        self.kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2

    @staticmethod
    def num_sets_for(batch, ctx):
        """Enough KV sets that their rotation does not fit in L2 (4 to 64)."""
        set_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2
        return min(64, max(4, math.ceil(3 * L2_BYTES / set_bytes)))

    def ours(self, version, out):
        """A callable(i): our kernel `version` on set i into `out` (no validation: timed)."""
        from kernels_numba import paged_attention as pa

        def run(i):
            s = self.sets[i]
            return pa.paged_attention(self.q, s["k"], s["v"], s["bt"], self.lens, version=version, out=out,
                                      validate=False, max_context_len=self.ctx)
        return run

    def sdpa(self, i):
        """torch SDPA on set i's dense cache."""
        s = self.sets[i]
        return torch.nn.functional.scaled_dot_product_attention(
            self.q[:, :, None], s["kd"], s["vd"], enable_gqa=True)[:, :, 0]

    def reference(self, i):
        s = self.sets[i]
        o = torch.nn.functional.scaled_dot_product_attention(
            self.q.float()[:, :, None], s["kd"].float(), s["vd"].float(), enable_gqa=True
        )
        return o[:, :, 0]


def _check(out, ref, what):
    err = (out.float() - ref).abs().max().item()
    if not math.isfinite(err) or err > 4e-3:
        raise AssertionError(f"{what}: max err {err:.3g} vs fp32 reference")
    return err


def make_flex(problem):
    """A callable(i) running FlexAttention paged on set i, or raise if unavailable."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = make_flex.compiled
    if flex is None:
        flex = make_flex.compiled = torch.compile(flex_attention)
    batch, ctx = problem.batch, problem.ctx
    masks = []
    for s in problem.sets:
        paged = PagedAttention(problem.num_blocks, BLOCK_SIZE, batch, device="cuda")
        blocks = s["bt"].long()
        paged.page_table[:, : blocks.shape[1]] = blocks
        rows = torch.arange(batch, device="cuda")[:, None].expand_as(blocks)
        paged.physical_to_logical[rows, blocks] = torch.arange(blocks.shape[1], device="cuda")[None].expand_as(blocks)
        paged.capacity[:] = ctx
        lens = problem.lens.long()

        def causal_free(b, h, q_idx, kv_idx, lens=lens):
            return kv_idx < lens[b]

        logical = create_block_mask(causal_free, batch, None, 1, ctx, device="cuda", BLOCK_SIZE=BLOCK_SIZE)
        masks.append((paged.convert_logical_block_mask(logical, kv_len=lens), paged.get_score_mod(None, lens)))
    q4 = problem.q[:, :, None]  # [B, H, 1, D]

    def run(i):
        mask, score_mod = masks[i]
        s = problem.sets[i]
        # 16-token pages need 16-wide tiles (vLLM's flex backend does the same)
        return flex(q4, s["kf"], s["vf"], score_mod=score_mod, block_mask=mask, enable_gqa=True,
                    kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})[:, :, 0]

    return run


make_flex.compiled = None


def bench_point(batch, ctx, versions, copy_gbs, want_flex, notes):
    from kernels_numba import paged_attention as pa

    num_sets = Problem.num_sets_for(batch, ctx)
    prob = Problem(batch, ctx, num_sets, want_flex)
    ref0 = prob.reference(0)
    row = dict(batch=batch, ctx=ctx, kv_mb=prob.kv_bytes / 1e6, num_sets=num_sets, us={}, err={})
    out = torch.empty_like(prob.q)

    for version in versions:
        if version <= 2 and batch * ctx > SLOW_VERSION_MAX_TOKENS:
            continue
        fn = prob.ours(version, out)
        pa.paged_attention(prob.q, prob.sets[0]["k"], prob.sets[0]["v"], prob.sets[0]["bt"], prob.lens,
                           version=version, out=out)  # validated call (block tables too)
        row["err"][f"v{version}"] = _check(out, ref0, f"v{version} B={batch} ctx={ctx}")
        row["us"][f"v{version}"] = _time_graph(fn, num_sets)

    row["err"]["sdpa"] = _check(prob.sdpa(0), ref0, "sdpa")
    row["us"]["sdpa"] = _time_graph(prob.sdpa, num_sets)
    if want_flex:
        try:
            flex = make_flex(prob)
            row["err"]["flex"] = _check(flex(0), ref0, "flex")
            row["us"]["flex"] = _time_graph(flex, num_sets)
        except Exception as e:  # report, keep going
            notes.append(f"FlexAttention paged failed at B={batch} ctx={ctx}: {type(e).__name__}: {str(e)[:200]}")
    row["gbs"] = {k: prob.kv_bytes / (us * 1e-6) / 1e9 for k, us in row["us"].items()}
    row["pct_copy"] = {k: 100.0 * g / copy_gbs for k, g in row["gbs"].items()}
    row["vs_sdpa"] = {k: row["us"]["sdpa"] / us for k, us in row["us"].items()}
    del prob
    pa.clear_caches()  # the wrapper cache would keep this point's pools alive
    torch.cuda.empty_cache()
    return row


def host_overhead_us(version, validate, calls=200):
    """Wall time per paged_attention call from Python, synchronising once at the end."""
    from kernels_numba import paged_attention as pa

    prob = Problem(8, 512, 1, False)
    s = prob.sets[0]
    out = torch.empty_like(prob.q)
    for _ in range(5):
        pa.paged_attention(prob.q, s["k"], s["v"], s["bt"], prob.lens, version=version, out=out, validate=validate)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        pa.paged_attention(prob.q, s["k"], s["v"], s["bt"], prob.lens, version=version, out=out, validate=validate)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def markdown(rows, versions, copy_gbs):
    cols = [f"v{v}" for v in versions] + ["sdpa", "flex"]
    best = f"v{max(versions)}"
    lines = [f"Copy bandwidth: {copy_gbs:.0f} GB/s (read + write).", "",
             "| B | ctx | KV MB | " + " | ".join(f"{c} us" for c in cols)
             + f" | {best} GB/s | {best} % copy | {best}/SDPA | {best}/flex |",
             "|" + "---|" * (3 + len(cols) + 4)]
    for r in rows:
        us = [f"{r['us'][c]:.1f}" if c in r["us"] else "-" for c in cols]
        flex_ratio = f"{r['us']['flex'] / r['us'][best]:.2f}x" if "flex" in r["us"] else "-"
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['kv_mb']:.1f} | " + " | ".join(us)
                     + f" | {r['gbs'][best]:.0f} | {r['pct_copy'][best]:.0f}% | {r['vs_sdpa'][best]:.2f}x | {flex_ratio} |")
    return "\n".join(lines)


def concurrency_table(versions, copy_gbs, notes):
    rows = [bench_point(b, 512, versions, copy_gbs, False, notes) for b in (1, 2, 4, 8)]
    out = ["| sequences | " + " | ".join(f"v{v} tok/s" for v in versions) + " | SDPA tok/s | best speedup vs 1 seq |",
           "|" + "---|" * (len(versions) + 3)]
    best = f"v{max(versions)}"
    base = rows[0]["us"][best]
    for r in rows:
        toks = [f"{r['batch'] / (r['us'][f'v{v}'] * 1e-6):,.0f}" for v in versions]
        sd = f"{r['batch'] / (r['us']['sdpa'] * 1e-6):,.0f}"
        out.append(f"| {r['batch']} | " + " | ".join(toks) + f" | {sd} | {r['batch'] * base / r['us'][best]:.2f}x |")
    return "\n".join(out), rows


def plot(rows, versions, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONTEXTS), figsize=(5 * len(CONTEXTS), 4), sharey=True)
    for ax, ctx in zip(axes, CONTEXTS):
        pts = [r for r in rows if r["ctx"] == ctx]
        for key in [f"v{v}" for v in versions] + ["sdpa", "flex"]:
            xs = [r["batch"] for r in pts if key in r["gbs"]]
            ys = [r["gbs"][key] for r in pts if key in r["gbs"]]
            if xs:
                ax.plot(xs, ys, marker="o", label=key, linestyle="--" if key in ("sdpa", "flex") else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"ctx {ctx}")
        ax.set_xlabel("batch (sequences)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s of KV read")
    axes[-1].legend()
    fig.suptitle("Paged decode attention, H200, Qwen2-0.5B layer (14/2 heads, d=64, fp16, block 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sass_summary():
    """Per compiled kernel (bench geometry): registers and SASS counts of the promised instructions."""
    import re

    from kernels_numba import paged_attention as pa

    group = NUM_HEADS // NUM_KV_HEADS
    kernels = [pa._make_v1(HEAD_DIM, BLOCK_SIZE, False), pa._make_v2(HEAD_DIM, BLOCK_SIZE, False),
               pa._make_v3(HEAD_DIM, BLOCK_SIZE, False), pa._make_merge(HEAD_DIM, False),
               pa._make_v4(HEAD_DIM, BLOCK_SIZE, group, False), pa._make_v5(HEAD_DIM, BLOCK_SIZE, group, False),
               pa._make_v7(HEAD_DIM, BLOCK_SIZE, group, False), pa._make_v8(HEAD_DIM, BLOCK_SIZE, group, False),
               pa._make_v9(HEAD_DIM, BLOCK_SIZE, group, False)]
    summary = {}
    for kernel in kernels:
        try:
            regs = kernel.get_regs_per_thread()
            sass_of = kernel.inspect_sass()
        except Exception as e:  # noqa: BLE001 - report and go on
            summary[kernel.__name__] = f"{type(e).__name__}: {e}"
            continue
        for sig, sass in sass_of.items():
            ops = re.findall(r"\b(HFMA2[\w.]*|HMMA[\w.]*|LDGSTS[\w.]*|LDG[\w.]*|SHFL[\w.]*|FFMA[\w.]*|LDL[\w.]*|STL[\w.]*"
                             r"|MUFU\.EX2)\b", sass)
            count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
            summary[f"{kernel.__name__} {sig}"] = dict(
                regs=regs.get(sig) if isinstance(regs, dict) else regs, HFMA2=count("HFMA2"), LDG=count("LDG"),
                LDG_128=sum(1 for o in ops if o.startswith("LDG.") and ".128" in o), LDGSTS=count("LDGSTS"),
                SHFL=count("SHFL"), HMMA=count("HMMA"),
                FFMA=count("FFMA"), LDL=count("LDL"), STL=count("STL"), MUFU_EX2=count("MUFU.EX2"))
    return summary


def main(out_dir=None, quick=False, versions=None, flex=True, prefill=True):
    """Decode grid + concurrency table; with prefill=True also the paged prefill kernel vs SDPA
    on a dense causal prefix (scripts/bench_prefill.py, same method, same run)."""
    from kernels_numba import paged_attention as pa

    versions = versions or sorted(pa.VERSIONS)
    dev = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    print(f"{dev}: copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    notes = []
    batches, contexts = ([1, 64, 256], [512, 8192]) if quick else (BATCHES, CONTEXTS)
    rows = []
    for ctx in contexts:
        for batch in batches:
            t0 = time.time()
            rows.append(bench_point(batch, ctx, versions, copy_gbs, flex, notes))
            r = rows[-1]
            print(f"B={batch:4d} ctx={ctx:5d} " + " ".join(f"{k}={v:.1f}us" for k, v in r["us"].items())
                  + f"  ({time.time() - t0:.1f}s)", flush=True)
            if out_dir:  # what is measured so far survives an interrupted run
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                (Path(out_dir) / "kernels_bench.partial.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows, versions, copy_gbs)
    conc, conc_rows = concurrency_table(versions, copy_gbs, notes)
    overhead = {f"v{max(versions)}_validate": host_overhead_us(max(versions), True),
                f"v{max(versions)}_no_validate": host_overhead_us(max(versions), False)}
    import numba

    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=dev, torch=torch.__version__,
                numba=numba.__version__, cuda=torch.version.cuda, copy_gbs=copy_gbs, notes=notes,
                host_overhead_us=overhead, slow_version_max_tokens=SLOW_VERSION_MAX_TOKENS)
    report = (f"{meta['date']}, {dev}, torch {meta['torch']}, numba {meta['numba']}, CUDA {meta['cuda']}\n\n"
              + table + "\n\nConcurrency (ctx 512):\n\n" + conc
              + "\n\nHost overhead per call (us, no graph): " + json.dumps({k: round(v, 1) for k, v in overhead.items()})
              + ("\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes) if notes else ""))
    print(report, flush=True)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels_bench.md").write_text(report + "\n")
        (out / "kernels_bench.json").write_text(json.dumps(dict(meta=meta, grid=rows, concurrency=conc_rows), indent=1))
        plot(rows, versions, out / "kernels_bench.png")
        try:
            (out / "sass_summary.json").write_text(json.dumps(sass_summary(), indent=1, default=str))
        except Exception as e:  # the disassembler is optional
            print(f"SASS summary unavailable: {type(e).__name__}: {e}")
    if prefill:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_prefill

        bench_prefill.main(out=out_dir)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for kernels_bench.md/.json/.png and sass_summary.json")
    ap.add_argument("--quick", action="store_true", help="a few points only")
    ap.add_argument("--versions", type=int, nargs="*", default=None)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--no-prefill", action="store_true", help="skip the paged prefill rows")
    a = ap.parse_args()
    main(a.out, a.quick, a.versions, not a.no_flex, not a.no_prefill)
