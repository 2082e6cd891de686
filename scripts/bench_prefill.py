"""Paged prefill kernels (v3 and the FlashAttention-2-style v4+) vs torch SDPA on a dense causal
prefix, Qwen2 layer shapes (0.5B: 14/2 heads, d=64; 7B: 28/4 heads, d=128), in one run.

For each shape (num_seqs x (cached prefix + new tokens), heads, head_dim): build a shuffled paged pool and the same
K/V as a dense [B, Hkv, ctx, D] tensor, check every kernel and SDPA against a float64 reference
(kernel error <= 2x SDPA's error + one fp16 ulp of the largest output) *before* timing anything,
then time each by CUDA-graph replay (scripts/benchlib.graph_time_us: a graph of >= 20 calls,
median of 10 replays) with enough input sets rotated that L2 cannot serve repeated reads. SDPA
runs bottom-right causal (is_causal without a prefix, torch's causal_lower_right with one) with
enable_gqa, torch's default dispatch (flash attention on the H200). Each row also shows the
prediction written before the GPU run (docs/prefill.md) and the default version's eager cost.

    python3 scripts/bench_prefill.py [--out DIR] [--kernels v3 v4 v5 v6 v7 v8 v9] [--variant v9:plan=step] [--reps 10]

By default it times v7 and v9 (the engine's kernel and the short prompts' one) at every shape, SDPA beside them.
A variant overrides a v4+ kernel's launch: splits=N, stages=N, ctas=N (v9's CTAs per KV head), prefetch=
tile|epilogue (where v9 copies the next item: at its last tile's start, the default, or after its math), or plan=step:
the work list built once for all the calls of a graph (which share one cu_seqlens_q), as the engine builds it
once per step for all layers, so the time is a layer's in a step (each call plans for itself otherwise).
Prints a table (µs, TFLOP/s and speed vs SDPA per version); with --out writes prefill_bench.json and
prefill_bench.md there.
"""
import argparse
import math

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 14, 2, 64, 16, torch.float16  # Qwen2-0.5B's layer
LARGE = (28, 4, 128)  # Qwen2-7B's layer: query heads, KV heads, head_dim
# (label, num_seqs, cached tokens, new tokens[, (num_heads, num_kv_heads, head_dim)]): the first four are
# this bench's own set, the next five the short prompts and head_dim 128 shapes v7 is for, the last two
# where v9's advantage should end (prefill_journey_fa2.SHORT_CONTEXT)
SHAPES = [
    ("1x2048 new", 1, 0, 2048),
    ("8x512 new", 8, 0, 512),
    ("4x(1024+512)", 4, 1024, 512),
    ("1x(4096+256)", 1, 4096, 256),
    ("64x128 new", 64, 0, 128),
    ("16x256 new", 16, 0, 256),
    ("4x1024 new d128", 4, 0, 1024, LARGE),
    ("2x4096 new d128", 2, 0, 4096, LARGE),
    ("1x8192 new", 1, 0, 8192),
    ("8x1024 new", 8, 0, 1024),
    ("4x2048 new", 4, 0, 2048),
]
UNIT_ROUNDOFF = 2.0**-11  # fp16

# kernel label -> version of the journey (kernels_numba/prefill_journey.py); v3 is the best of the first era
KERNELS = {"v3": 3, "v4": 4, "v5": 5, "v6": 6, "v7": 7, "v8": 8, "v9": 9}
DEFAULT_LABELS = ("v7", "v9")  # timed unless --kernels says otherwise


def default_label():
    """The engine's kernel (prefill_journey.PRODUCTION_VERSION): its eager cost is measured too."""
    from kernels_numba.prefill_journey import PRODUCTION_VERSION

    return f"v{PRODUCTION_VERSION}"

# predicted µs per shape, written before the first GPU run of v4-v6 (docs/prefill.md says why)
PREDICTED_US = {
    "v4": {"1x2048 new": 50, "8x512 new": 28, "4x(1024+512)": 60, "1x(4096+256)": 45},
    "v5": {"1x2048 new": 40, "8x512 new": 22, "4x(1024+512)": 48, "1x(4096+256)": 55},
    "v6": {"1x2048 new": 40, "8x512 new": 22, "4x(1024+512)": 48, "1x(4096+256)": 15},
    # v7, written before its first GPU run (docs/prefill.md, "v7"): the work list takes the per-CTA search
    # away (short prompts), 128 rows per CTA at d=128 halve the shared-memory traffic per row
    "v7": {"1x2048 new": 62, "8x512 new": 38, "4x(1024+512)": 58, "1x(4096+256)": 40, "64x128 new": 30,
           "16x256 new": 24, "4x1024 new d128": 160, "2x4096 new d128": 950, "1x8192 new": 490,
           "8x1024 new": 100, "4x2048 new": 167},  # the last two written with v9's, from v7's measured fit
    # v8, written before its first GPU run (docs/prefill.md, "v8"): block ids a tile ahead (no copy waits on
    # a dependent load), the running max moved only when it grows by 2^8 (O's rescale skipped most tiles)
    "v8": {"1x2048 new": 64, "8x512 new": 36, "4x(1024+512)": 52, "1x(4096+256)": 35, "64x128 new": 45,
           "16x256 new": 29, "4x1024 new d128": 160, "2x4096 new d128": 850, "1x8192 new": 440},
    # v9, written before its first GPU run (docs/prefill.md, "v9"): a persistent loop over the work list hides
    # part of a CTA's fixed cost (~9 us a CTA in v7's numbers) behind the item before (prefetch=tile, the
    # default: ~6 of the 9 us; prefetch=epilogue: ~4.5); no split (1x(4096+256): 32 CTAs of 68 tiles), ptxas
    # spills at d=128
    "v9": {"1x2048 new": 71, "8x512 new": 29, "4x(1024+512)": 59, "1x(4096+256)": 110, "64x128 new": 32,
           "16x256 new": 22, "4x1024 new d128": 240, "2x4096 new d128": 1250, "1x8192 new": 500,
           "8x1024 new": 85, "4x2048 new": 163},
    "v9:prefetch=epilogue": {"1x2048 new": 71, "8x512 new": 32, "4x(1024+512)": 59, "1x(4096+256)": 110,
                             "64x128 new": 37, "16x256 new": 24, "4x1024 new d128": 230, "2x4096 new d128": 1200,
                             "1x8192 new": 500, "8x1024 new": 91, "4x2048 new": 167},
    # v9 and v7 with the plan once per step (its ~5 us launch and run gone from a layer's time)
    "v9:plan=step": {"1x2048 new": 66, "8x512 new": 25, "4x(1024+512)": 54, "1x(4096+256)": 105,
                     "64x128 new": 27, "16x256 new": 17, "4x1024 new d128": 235, "2x4096 new d128": 1245,
                     "1x8192 new": 492, "8x1024 new": 80, "4x2048 new": 158},
    "v7:plan=step": {"1x2048 new": 65, "8x512 new": 35, "4x(1024+512)": 54, "1x(4096+256)": 35,
                     "64x128 new": 49, "16x256 new": 28, "4x1024 new d128": 181, "2x4096 new d128": 1022,
                     "1x8192 new": 486, "8x1024 new": 95, "4x2048 new": 162},
}


def causal_flops(num_seqs, cached, new, num_heads=NUM_HEADS, head_dim=HEAD_DIM):
    """2 matmuls x 2 flops x heads x d x (keys each query sees), summed over queries."""
    keys = new * cached + new * (new + 1) // 2
    return 4 * num_heads * head_dim * keys * num_seqs


def make_inputs(num_seqs, cached, new, seed, device="cuda", heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    """Paged pool (shuffled block table; the tail of each last block NaN) and the same K/V dense.
    heads: (num_heads, num_kv_heads, head_dim).

    Returns a dict: q [B*new, H, D] packed, k_cache/v_cache [num_blocks, Hkv, bs, D],
    block_tables [B, blocks] int32, cu [B+1] int32, context_lens [B] int32, and the dense
    q_dense [B, H, new, D], k_dense/v_dense [B, Hkv, ctx, D].
    """
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator(device=device).manual_seed(seed)
    ctx = cached + new
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    k_dense = torch.randn(num_seqs, num_kv_heads, ctx, head_dim, device=device, generator=g).to(DTYPE)
    v_dense = torch.randn(num_seqs, num_kv_heads, ctx, head_dim, device=device, generator=g).to(DTYPE)
    q_dense = torch.randn(num_seqs, num_heads, new, head_dim, device=device, generator=g).to(DTYPE)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    block_tables = perm.view(num_seqs, blocks_per_seq).contiguous()
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    k_cache = torch.full(shape, float("nan"), device=device, dtype=DTYPE)
    v_cache = torch.full(shape, float("nan"), device=device, dtype=DTYPE)
    pos = torch.arange(ctx, device=device)
    for s in range(num_seqs):
        blocks, offs = block_tables[s, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE
        k_cache[blocks, :, offs] = k_dense[s].transpose(0, 1)  # (ctx, Hkv, D) into [b, :, o, :]
        v_cache[blocks, :, offs] = v_dense[s].transpose(0, 1)
    q = q_dense.permute(0, 2, 1, 3).reshape(num_seqs * new, num_heads, head_dim).contiguous()  # (B*new, H, D)
    cu = torch.arange(0, num_seqs + 1, device=device, dtype=torch.int32) * new
    context_lens = torch.full((num_seqs,), ctx, device=device, dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu=cu,
                context_lens=context_lens, q_dense=q_dense, k_dense=k_dense, v_dense=v_dense)


def sdpa_call(cached, new):
    """SDPA bottom-right causal with GQA: (fn(q, k, v) -> [B, H, new, D], how the mask is given)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if cached == 0:
        return (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True)), "is_causal"
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(new, cached + new)
    return (lambda q, k, v: sdpa(q, k, v, attn_mask=bias, enable_gqa=True)), "causal_lower_right"


def reference(x):
    """float64 bottom-right causal attention on the dense tensors: [B, H, new, D]."""
    q, k, v = x["q_dense"].double(), x["k_dense"].double(), x["v_dense"].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, ctx, D)
    new, ctx = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[3])  # (B, H, new, ctx)
    visible = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - new, ctx, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def parse_variant(text):
    """"v6:splits=2,stages=3" -> ("v6", {"splits": 2, "stages": 3}): a v4+ kernel with launch
    overrides (prefill_journey.paged_prefill's splits=, stages=, v9's ctas=), or plan=step (kernel_call)."""
    label, _, rest = text.partition(":")
    from kernels_numba.prefill_journey import FA2_VERSIONS

    if KERNELS.get(label) not in FA2_VERSIONS:
        raise ValueError(f"variants are of v4+ kernels, got {label!r}")
    extra = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "plan" and value == "step":
            extra["plan"] = "step"
        elif key == "prefetch":
            extra["prefetch"] = value
        elif key in ("splits", "stages", "ctas"):
            extra[key] = int(value)
        else:
            raise ValueError(f"a variant overrides splits=, stages=, ctas=, prefetch= or plan=step, got {item!r}")
    return label, extra


def kernel_call(label, plan=None, **extra):
    """fn(x, out) launching kernel `label` on input set x (no host sync: capturable); extra:
    launch overrides of a v4+ kernel (splits=, stages=, ctas=). plan="step": the calls share one dict of
    work lists (paged_prefill's plans=), so the calls of one graph on one cu_seqlens_q plan once, as a
    step's layers do in the engine (bench_shape gives every input set the same cu tensor)."""
    from kernels_numba.prefill_journey import entry

    run = entry(KERNELS[label])
    if plan == "step":
        extra["plans"] = {}
    elif plan is not None:
        raise ValueError(f"plan={plan!r}: only 'step'")

    def call(x, out):
        run(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["cu"], x["context_lens"], out=out,
            validate=False, **extra)

    return call


def validate(label_calls, x, sdpa, num_seqs, new):
    """Max abs error of every kernel and of SDPA vs the float64 reference; raises if a kernel's
    error exceeds 2x SDPA's + one fp16 ulp of the largest output (both round their result once)."""
    ref = reference(x)  # (B, H, new, D)
    err_sdpa = (sdpa(x["q_dense"], x["k_dense"], x["v_dense"]).double() - ref).abs().max().item()
    tol = 2 * err_sdpa + 2 * UNIT_ROUNDOFF * ref.abs().max().item()
    errors = {"sdpa": err_sdpa}
    for label, call in label_calls.items():
        out = torch.full_like(x["q"], float("nan"))
        call(x, out)
        ours = out.view(num_seqs, new, *x["q"].shape[1:]).permute(0, 2, 1, 3).double()  # (B, H, new, D)
        err = (ours - ref).abs().max().item()
        if not err <= tol:  # NaN fails too
            raise AssertionError(f"{label}: max err {err:.3g} > tol {tol:.3g} (SDPA err {err_sdpa:.3g})")
        errors[label] = err
    return errors


def bench_shape(label, num_seqs, cached, new, labels, variants, reps, calls, heads=(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)):
    from scripts import benchlib

    num_heads, num_kv_heads, head_dim = heads
    set_bytes = 2 * num_seqs * (cached + new) * num_kv_heads * head_dim * 2  # K and V
    rotate = benchlib.num_sets_for(set_bytes, maximum=16)
    sets = [make_inputs(num_seqs, cached, new, seed=i, heads=heads) for i in range(rotate)]
    for x in sets:  # one cu_seqlens_q tensor (the same values in every set), as a step's layers share one
        x["cu"] = sets[0]["cu"]
    sdpa, how = sdpa_call(cached, new)
    label_calls = {k: kernel_call(k) for k in labels}
    for text in variants:
        base, extra = parse_variant(text)
        label_calls[text] = kernel_call(base, **extra)
    errors = validate(label_calls, sets[0], sdpa, num_seqs, new)

    flops = causal_flops(num_seqs, cached, new, num_heads, head_dim)
    outs = [torch.empty_like(s["q"]) for s in sets]
    n_calls = max(calls, rotate)
    row = dict(shape=label, num_seqs=num_seqs, cached=cached, new=new, num_heads=num_heads,
               num_kv_heads=num_kv_heads, head_dim=head_dim, sdpa_mask=how, sets=rotate)
    us = {}
    for k, call in label_calls.items():
        us[k] = benchlib.graph_time_us(lambda i, call=call: call(sets[i % rotate], outs[i % rotate]),
                                       calls=n_calls, replays=reps)
    us["sdpa"] = benchlib.graph_time_us(
        lambda i: sdpa(sets[i % rotate]["q_dense"], sets[i % rotate]["k_dense"], sets[i % rotate]["v_dense"]),
        calls=n_calls, replays=reps)
    for k in list(label_calls) + ["sdpa"]:
        row[f"us {k}"] = us[k]
        row[f"TFLOP/s {k}"] = flops / us[k] / 1e6
        row[f"err {k}"] = errors[k]
        if k != "sdpa":
            row[f"{k} / SDPA speed"] = us["sdpa"] / us[k]
            if label in PREDICTED_US.get(k, {}):
                row[f"predicted us {k}"] = PREDICTED_US[k][label]
    default = default_label()
    if default in label_calls:
        eager = label_calls[default]
        row[f"eager us {default}"] = benchlib.host_time_us(lambda i: eager(sets[i % rotate], outs[i % rotate]),
                                                           calls=50)
    del sets, outs
    torch.cuda.empty_cache()  # the float64 reference of the long shapes takes gigabytes
    return row


def table(rows, labels):
    """Markdown: per kernel µs (TFLOP/s) [prediction] and speed vs SDPA, then errors."""
    lines = ["| shape | " + " | ".join(f"{k} µs (TFLOP/s) [pred.]" for k in labels) + " | SDPA µs (TFLOP/s) | "
             + " | ".join(f"{k} / SDPA" for k in labels) + " | max err " + ", ".join(labels) + " (SDPA) |"]
    lines.append("|" + "---|" * (2 + 2 * len(labels)))
    for r in rows:
        cells = []
        for k in labels:
            pred = r.get(f"predicted us {k}")
            cells.append(f"{r[f'us {k}']:.1f} ({r[f'TFLOP/s {k}']:.0f})" + (f" [{pred}]" if pred else ""))
        cells.append(f"{r['us sdpa']:.1f} ({r['TFLOP/s sdpa']:.0f})")
        cells += [f"{r[f'{k} / SDPA speed']:.2f}x" for k in labels]
        cells.append(", ".join(f"{r[f'err {k}']:.2g}" for k in labels) + f" ({r['err sdpa']:.2g})")
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(out=None, labels=None, variants=(), reps=10, calls=20, shapes=None):
    """Validate then time every kernel at every shape; returns the rows. out: folder for
    bench_prefill.{json,md}. variants: also time v4+ kernels with launch overrides
    ("v6:splits=2", "v5:stages=3": see parse_variant)."""
    from scripts import benchlib

    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill needs a CUDA GPU")
    labels = list(labels or DEFAULT_LABELS)
    env = benchlib.env_line()
    print(env)
    print(f"layers: {NUM_HEADS}/{NUM_KV_HEADS} heads d={HEAD_DIM}, or {LARGE[0]}/{LARGE[1]} d={LARGE[2]} (d128); "
          f"{DTYPE}, block {BLOCK_SIZE}; CUDA-graph replay, median of {reps}")
    rows = []
    for shape in shapes or SHAPES:
        label, num_seqs, cached, new = shape[:4]
        heads = shape[4] if len(shape) > 4 else (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        rows.append(bench_shape(label, num_seqs, cached, new, labels, list(variants), reps, calls, heads))
        r = rows[-1]
        timed = [k for k in r if k.startswith("us ")]
        print(f"{r['shape']:>16}: " + "  ".join(f"{k[3:]} {r[k]:7.1f} µs" for k in timed) + "  |  "
              + "  ".join(f"{k[3:]} {r['us sdpa'] / r[k]:.2f}x SDPA" for k in timed if k != "us sdpa"), flush=True)
    all_labels = [k[3:] for k in rows[0] if k.startswith("us ") and k != "us sdpa"]
    text = table(rows, all_labels)
    print(text)
    if out is not None:
        for path in benchlib.save(out, "prefill_bench", rows, dict(shapes=shapes or SHAPES, variants=list(variants)),
                                  text):
            print("wrote", path)
    return rows


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for prefill_bench.json / .md")
    parser.add_argument("--kernels", nargs="*", default=None,
                        help=f"subset of {list(KERNELS)} (default: {' '.join(DEFAULT_LABELS)})")
    parser.add_argument("--variant", action="append", default=[],
                        help="also time a v4+ kernel with overrides, e.g. v8:splits=2 or v8:stages=3 (repeatable)")
    parser.add_argument("--reps", type=int, default=10, help="graph replays; the median is reported")
    parser.add_argument("--calls", type=int, default=20, help="launches captured per graph (at least the set count)")
    args = parser.parse_args()
    main(out=args.out, labels=args.kernels, variants=args.variant, reps=args.reps, calls=args.calls)
