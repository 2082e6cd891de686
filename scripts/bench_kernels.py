"""Decode attention on the GPU: every kernel version against torch SDPA (dense) and FlexAttention (paged).

One call builds, checks and times everything (validate every version, then time: docs/performance.md), Qwen2-0.5B layer shapes (14 query
heads, 2 KV heads, head_dim 64, fp16, block 16, shuffled block tables):
  * the grid B in {1, 8, 32, 64, 128, 256} x ctx in {512, 2048, 8192}, long and ragged points
    (B=1 x 4000, B=3 x 5000, B=1 x 32768, batches of mixed lengths) and the target concurrency
    rows (1, 2, 4, 8 sequences at ctx 512);
  * at each point, first every version of the decode journey (kernels_numba/decode_journey.py), SDPA
    on a dense cache (enable_gqa; ragged: padded to the longest, with a key mask) and FlexAttention over torch's
    paged-attention helper are checked against an fp32 reference; then each is timed by CUDA-graph
    replay (scripts/benchlib.graph_time_us) rotating over enough KV sets that the 60 MB L2 cannot
    serve them;
  * reported: us per call, GB/s of KV read (2 * sum(ctx) * kv_heads * d * 2 bytes), % of the copy
    bandwidth measured in the same run, the ratio to SDPA and to flex, and v10's prediction (written
    before its first GPU run, docs/kernels.md) beside its time.

    python3 scripts/bench_kernels.py --out docs/results      # kernels_bench.md / .json / .png
    python3 scripts/bench_kernels.py --quick --versions 9 10  # a few points
    python3 scripts/bench_kernels.py --check                  # validate every version at every point, no timing
"""
import argparse
import math
import time
from functools import partial

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 8192]
# long single sequences and ragged batches: (label, context lengths)
EXTRA_POINTS = [
    ("1 x 4000", [4000]),
    ("3 x 5000", [5000] * 3),
    ("1 x 32768", [32768]),
    ("ragged 3", [8000, 300, 1200]),
    ("ragged 8", "uniform 100-8000"),
    ("ragged 64", "uniform 100-4000"),
]
CONCURRENCY = [1, 2, 4, 8]  # sequences at ctx 512
SLOW_VERSION_MAX_TOKENS = 256 * 1024  # v1/v2 beyond this take seconds per point: skipped
TOLERANCE = 4e-3  # |ours - fp32 reference|: fp16 output rounding at |o| ~ 1 plus P rounded to fp16
# v10's predicted us (docs/kernels.md, written before its first GPU run): v9's time where the plan
# is v9's (no split); at split points the main kernel plus a merge of a few L2 round trips
PREDICTED_US = {
    "1 x 512": 6.5, "8 x 512": 7.5, "32 x 512": 8.5, "1 x 2048": 7.0, "8 x 2048": 9.0, "32 x 2048": 16.0,
    "1 x 8192": 8.0, "8 x 8192": 17.0, "32 x 8192": 40.0, "1 x 4000": 7.5, "3 x 5000": 9.5, "1 x 32768": 12.0,
    "64 x 512": 10.2, "128 x 512": 14.2, "256 x 512": 22.7, "64 x 2048": 22.9, "128 x 2048": 37.7,
    "256 x 2048": 68.1, "64 x 8192": 72.3, "128 x 8192": 130.6, "256 x 8192": 247.6,
}


def context_lens(spec, seed=0):
    """A point's context lengths: a list, or "uniform LO-HI" (8 or 64 sequences, seeded)."""
    if isinstance(spec, str):
        lo, hi = (int(x) for x in spec.split()[1].split("-"))
        count = 8 if hi > 4000 else 64
        g = torch.Generator().manual_seed(seed)
        return torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return list(spec)


class Problem:
    """num_sets independent KV sets of one batch (context lengths `lens`), in three layouts of the same
    values: the paged pool (ours), a dense cache padded to the longest context (SDPA) and flex's paged
    cache [1, KVH, pages * 16, D]. device="cpu" runs ours in the CUDA simulator (tiny shapes)."""

    def __init__(self, lens, num_sets, want_flex=False, seed=0, device="cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.lens_list, self.num_sets, self.device = list(lens), num_sets, device
        self.batch, self.ctx = len(lens), max(lens)
        blocks = [-(-n // BLOCK_SIZE) for n in lens]
        width = max(blocks)
        self.num_blocks = sum(blocks) + 1
        self.q = torch.randn(self.batch, NUM_HEADS, HEAD_DIM, device=device, generator=g).half()  # (B, H, D)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)  # (B,)
        ragged = len(set(lens)) > 1
        # keys past a sequence's length are masked out of the padded dense cache: (B, 1, 1, ctx)
        self.mask = (torch.arange(self.ctx, device=device)[None, :] < self.lens[:, None])[:, None, None] if ragged \
            else None
        self.sets = []
        for _ in range(num_sets):
            shape = (self.num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
            k = torch.randn(shape, device=device, generator=g).half()
            v = torch.randn(shape, device=device, generator=g).half()
            perm = torch.randperm(self.num_blocks, device=device, generator=g)
            bt = torch.zeros(self.batch, width, dtype=torch.int32, device=device)  # (B, width); padding: 0
            used = 0
            for s, nb in enumerate(blocks):
                bt[s, :nb] = perm[used:used + nb]
                used += nb
            # dense [B, KVH, width * 16, D]: every sequence's blocks in order, cut at the longest
            kd = k[bt.long()].permute(0, 2, 1, 3, 4).reshape(self.batch, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :self.ctx]
            vd = v[bt.long()].permute(0, 2, 1, 3, 4).reshape(self.batch, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :self.ctx]
            entry = dict(k=k, v=v, bt=bt, kd=kd.contiguous(), vd=vd.contiguous())
            if want_flex:
                # flex's physical cache: page p of head h at tokens p*16 .. p*16+15 of row h
                entry["kf"] = k.permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, -1, HEAD_DIM).contiguous()
                entry["vf"] = v.permute(1, 0, 2, 3).reshape(1, NUM_KV_HEADS, -1, HEAD_DIM).contiguous()
            self.sets.append(entry)
        self.kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2

    def ours(self, version, out, plan=None):
        """A callable(i): our kernel `version` on set i into `out`, no validation (what is timed).
        plan: a DecodePlan forced on v10 (scripts/tune_splits.py)."""
        from kernels_numba import decode_journey, paged_attention as pa

        if plan is None:
            attend = partial(decode_journey.paged_attention, version=version)
        else:  # the shipped kernel (v10) under a forced plan
            attend = partial(pa.paged_attention, plan=plan)

        def run(i):
            s = self.sets[i]
            return attend(self.q, s["k"], s["v"], s["bt"], self.lens, out=out, validate=False,
                          max_context_len=self.ctx)

        return run

    def sdpa(self, i):
        """torch SDPA on set i's dense cache: (B, H, D)."""
        s = self.sets[i]
        return torch.nn.functional.scaled_dot_product_attention(
            self.q[:, :, None], s["kd"], s["vd"], attn_mask=self.mask, enable_gqa=True)[:, :, 0]

    def reference(self, i):
        """fp32 attention on set i: (B, H, D)."""
        s = self.sets[i]
        return torch.nn.functional.scaled_dot_product_attention(
            self.q.float()[:, :, None], s["kd"].float(), s["vd"].float(), attn_mask=self.mask, enable_gqa=True
        )[:, :, 0]


def check_close(out, ref, what):
    """max |out - ref|, or AssertionError naming `what` when it is not finite or above TOLERANCE."""
    err = (out.float() - ref).abs().max().item()
    if not math.isfinite(err) or err > TOLERANCE:
        raise AssertionError(f"{what}: max err {err:.3g} vs fp32 reference")
    return err


def make_flex(problem):
    """A callable(i) running FlexAttention paged on set i (raises where flex is unavailable)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if make_flex.compiled is None:
        make_flex.compiled = torch.compile(flex_attention)
    batch, ctx = problem.batch, problem.ctx
    lens = problem.lens.long()
    masks = []
    for s in problem.sets:
        paged = PagedAttention(problem.num_blocks, BLOCK_SIZE, batch, device="cuda")
        blocks = s["bt"].long()
        paged.page_table[:, : blocks.shape[1]] = blocks
        rows = torch.arange(batch, device="cuda")[:, None].expand_as(blocks)
        paged.physical_to_logical[rows, blocks] = torch.arange(blocks.shape[1], device="cuda")[None].expand_as(blocks)
        paged.capacity[:] = blocks.shape[1] * BLOCK_SIZE

        def within(b, h, q_idx, kv_idx, lens=lens):
            return kv_idx < lens[b]

        logical = create_block_mask(within, batch, None, 1, ctx, device="cuda", BLOCK_SIZE=BLOCK_SIZE)
        masks.append((paged.convert_logical_block_mask(logical, kv_len=lens), paged.get_score_mod(None, lens)))
    q4 = problem.q[:, :, None]  # (B, H, 1, D)

    def run(i):
        mask, score_mod = masks[i]
        s = problem.sets[i]
        # 16-token pages need 16-wide tiles (vLLM's flex backend does the same)
        return make_flex.compiled(q4, s["kf"], s["vf"], score_mod=score_mod, block_mask=mask, enable_gqa=True,
                                  kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})[:, :, 0]

    return run


make_flex.compiled = None


def points(quick=False):
    """(label, context lengths) of every point of the run."""
    batches, contexts = ([1, 64, 256], [512, 8192]) if quick else (BATCHES, CONTEXTS)
    grid = [(f"{b} x {c}", [c] * b) for c in contexts for b in batches]
    extra = EXTRA_POINTS[:3] if quick else EXTRA_POINTS
    return grid + [(label, context_lens(spec)) for label, spec in extra]


def run_point(label, lens, versions, copy_gbs, want_flex, notes, time_it=True, device="cuda"):
    """One row: every kernel checked against the fp32 reference, then (time_it) timed."""
    from kernels_numba import decode_journey
    from scripts import benchlib

    num_sets = benchlib.num_sets_for(2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * 2) if time_it else 2
    prob = Problem(lens, num_sets, want_flex and time_it, device=device)
    ref = prob.reference(0)
    out = torch.empty_like(prob.q)
    row = dict(point=label, batch=prob.batch, ctx=prob.ctx, kv_mb=prob.kv_bytes / 1e6, num_sets=num_sets, us={},
               err={})
    calls = {}
    for version in versions:
        if version <= 2 and sum(lens) > SLOW_VERSION_MAX_TOKENS:
            continue
        s = prob.sets[0]
        decode_journey.paged_attention(prob.q, s["k"], s["v"], s["bt"], prob.lens, version=version, out=out,
                                       max_context_len=prob.ctx)  # validated call (block tables too)
        row["err"][f"v{version}"] = check_close(out, ref, f"v{version} at {label}")
        calls[f"v{version}"] = prob.ours(version, out)
    row["err"]["sdpa"] = check_close(prob.sdpa(0), ref, f"sdpa at {label}")
    calls["sdpa"] = prob.sdpa
    if want_flex and time_it:
        try:
            flex = make_flex(prob)
            row["err"]["flex"] = check_close(flex(0), ref, f"flex at {label}")
            calls["flex"] = flex
        except Exception as e:  # noqa: BLE001 - report it, time the rest
            notes.append(f"FlexAttention paged failed at {label}: {type(e).__name__}: {str(e)[:200]}")
    if time_it:
        for key, fn in calls.items():
            row["us"][key] = benchlib.graph_time_us(lambda i, fn=fn: fn(i % num_sets), calls=max(20, num_sets))
        row["gbs"] = {k: prob.kv_bytes / (us * 1e-6) / 1e9 for k, us in row["us"].items()}
        row["pct_copy"] = {k: 100.0 * g / copy_gbs for k, g in row["gbs"].items()}
        row["vs_sdpa"] = {k: row["us"]["sdpa"] / us for k, us in row["us"].items()}
        row["predicted_us"] = PREDICTED_US.get(label)
    return row


def table(rows, versions):
    """The markdown table: us per kernel, the best version's bandwidth and ratios, v10's prediction."""
    from scripts import benchlib

    best = f"v{max(versions)}"
    out = []
    for r in rows:
        line = {"point": r["point"], "KV MB": r["kv_mb"]}
        for key in [f"v{v}" for v in versions] + ["sdpa", "flex"]:
            line[f"{key} us"] = r["us"].get(key)
        line[f"{best} predicted us"] = r.get("predicted_us")
        line[f"{best} GB/s"] = r.get("gbs", {}).get(best)
        line[f"{best} % copy"] = r.get("pct_copy", {}).get(best)
        line[f"{best}/SDPA"] = r.get("vs_sdpa", {}).get(best)
        flex = r["us"].get("flex")
        line[f"{best}/flex"] = flex / r["us"][best] if flex and best in r["us"] else None
        out.append(line)
    return benchlib.markdown_table(out, floatfmt="{:.3g}")


def concurrency_rows(grid_rows, versions):
    """tokens/s per version at 1, 2, 4, 8 sequences of ctx 512 (one new token per sequence)."""
    rows = []
    base = None
    best = f"v{max(versions)}"
    for r in grid_rows:
        line = {"sequences": r["batch"]}
        for key in [f"v{v}" for v in versions] + ["sdpa"]:
            if key in r["us"]:
                line[f"{key} tok/s"] = r["batch"] / (r["us"][key] * 1e-6)
        base = base or r["us"][best]
        line["best speedup vs 1 seq"] = r["batch"] * base / r["us"][best]
        rows.append(line)
    return rows


def plot(rows, versions, path):
    """GB/s of KV read against batch size, one panel per context length of the grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["ctx"] for r in rows if r["point"] == f"{r['batch']} x {r['ctx']}" and r["ctx"] in CONTEXTS})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        pts = [r for r in rows if r["point"] == f"{r['batch']} x {ctx}"]
        for key in [f"v{v}" for v in versions] + ["sdpa", "flex"]:
            xs = [r["batch"] for r in pts if key in r.get("gbs", {})]
            ys = [r["gbs"][key] for r in pts if key in r.get("gbs", {})]
            if xs:
                ax.plot(xs, ys, marker="o", label=key, linestyle="--" if key in ("sdpa", "flex") else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"ctx {ctx}")
        ax.set_xlabel("batch (sequences)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s of KV read")
    axes[0][-1].legend()
    fig.suptitle("Paged decode attention, Qwen2-0.5B layer (14/2 heads, d=64, fp16, block 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_overhead_us(version, validate):
    """Wall time per paged_attention call from Python (no graph), B=8 x 512."""
    from kernels_numba import decode_journey
    from scripts import benchlib

    prob = Problem([512] * 8, 1)
    s = prob.sets[0]
    out = torch.empty_like(prob.q)
    return benchlib.host_time_us(lambda: decode_journey.paged_attention(prob.q, s["k"], s["v"], s["bt"], prob.lens,
                                                                        version=version, out=out, validate=validate))


def main(out_dir=None, quick=False, versions=None, flex=True, check=False, device="cuda", only=None, todo=None):
    """The whole run; returns the grid rows. check: validate every version at every point without
    timing (device="cpu": in the CUDA simulator). only: labels of the points to run (default all);
    todo: (label, context lengths) points instead of the run's own."""
    from kernels_numba import bridge, decode_journey
    from scripts import benchlib

    versions = sorted(versions or decode_journey.VERSIONS)
    time_it = not check
    copy_gbs = benchlib.copy_bandwidth_gbs() if time_it else None
    print(benchlib.env_line() + (f" | copy bandwidth {copy_gbs:.0f} GB/s" if time_it else " | check only"),
          flush=True)
    notes, rows = [], []
    whole_run = only is None and todo is None
    todo = todo or [(label, lens) for label, lens in points(quick) if only is None or label in only]
    for label, lens in todo:
        t0 = time.time()
        rows.append(run_point(label, lens, versions, copy_gbs, flex, notes, time_it, device))
        print(f"{label:>12}: " + " ".join(f"{k}={v:.1f}us" for k, v in rows[-1]["us"].items())
              + f" max err {max(rows[-1]['err'].values()):.2g} ({time.time() - t0:.1f}s)", flush=True)
        bridge.clear_caches()  # the cached views would keep this point's pools alive
        if device == "cuda":
            torch.cuda.empty_cache()
    report = table(rows, versions)
    meta = dict(copy_gbs=copy_gbs, notes=notes, versions=versions, tolerance=TOLERANCE,
                slow_version_max_tokens=SLOW_VERSION_MAX_TOKENS)
    if time_it and whole_run:
        conc = [run_point(f"{b} x 512", [512] * b, versions, copy_gbs, False, notes, True, device) for b in CONCURRENCY]
        meta["concurrency"] = conc
        meta["host_overhead_us"] = {f"v{max(versions)} validate={v}": host_overhead_us(max(versions), v)
                                    for v in (True, False)}
        report += "\n\nConcurrency (ctx 512):\n\n" + benchlib.markdown_table(concurrency_rows(conc, versions))
        report += "\n\nHost overhead per call (us, no graph): " + str(
            {k: round(v, 1) for k, v in meta["host_overhead_us"].items()})
    if notes:
        report += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes)
    print(report, flush=True)
    if out_dir:
        benchlib.save(out_dir, "kernels_bench", rows, meta, report)
        if time_it:
            plot(rows, versions, f"{out_dir}/kernels_bench.png")
    return rows


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for kernels_bench.md/.json/.png")
    ap.add_argument("--quick", action="store_true", help="a few points only")
    ap.add_argument("--versions", type=int, nargs="*", default=None)
    ap.add_argument("--points", nargs="*", default=None, help='labels to run, e.g. "1 x 8192" "ragged 8"')
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--check", action="store_true", help="validate every version at every point, no timing")
    a = ap.parse_args()
    main(a.out, a.quick, a.versions, not a.no_flex, a.check, "cuda" if torch.cuda.is_available() else "cpu", a.points)
