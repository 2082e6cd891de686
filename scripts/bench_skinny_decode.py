"""Decode with the few-row layer path (pagedattn/layers/skinny_decode.py) on and off, on one GPU.

Steps of at most PAGEDATTN_SKINNY_ROWS rows (off by default; 8 here) run each decoder layer as five launches plus
attention: the RMSNorms and SiLU-and-mul inside the skinny GEMM (kernels_numba/skinny_gemm.py). This runs the
engine (LLM, CUDA graphs, random Qwen2 weights of --config from scripts/benchlib.py) twice, the path on
(PAGEDATTN_SKINNY_ROWS=8, skinny_decode.FUSED_ROWS) and off (PAGEDATTN_SKINNY_ROWS=0), and for each:

  1. validates before timing: every decode step of a greedy run of --prompts requests (of different lengths,
     so the batch shrinks through every graph size) runs eagerly through the unfused path and then replays its
     graph on the same state (logits within fp16 noise, the argmax equal wherever the top-2 margin exceeds
     twice their difference), and the greedy tokens of both engines are compared request by request
     (near-ties may flip: counted);
  2. decode tok/s at each --batches size, greedy and sampled (temperature 0.8, top_p 0.95, seeded): the wall
     time of back-to-back step() calls at pure decode (scripts/profile_step.py's helpers), tok/s = batch /
     wall, and the GPU time per step from torch.profiler;
  3. kernels per layer at batch 1: one pure-decode step (one graph replay) under torch.profiler, the kernels
     between consecutive layers' rotary kernels (and the names of one layer's kernels).

    python3 scripts/bench_skinny_decode.py --out $OUT               # one H200, ~3-4 minutes on a bare machine

Writes $OUT/skinny_decode.md and $OUT/skinny_decode.json.
"""
import os
import random
import re
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedattn.layers.skinny_decode import ENV_ROWS, FUSED_ROWS  # noqa: E402
from scripts import benchlib  # noqa: E402
SAMPLED = dict(temperature=0.8, top_p=0.95)
ROTARY = "rotary_cache_kernel"       # one per layer on both paths: the layers' boundaries in a profile


def short_name(name, width=48):
    """A kernel's name for a table: the last identifier of an Itanium-mangled nested name (numba's kernels),
    or the name itself, cut to `width`."""
    if name.startswith("_ZN"):
        parts, i = [], 3
        while i < len(name) and name[i].isdigit():
            j = i
            while name[j].isdigit():
                j += 1
            n = int(name[i:j])
            parts.append(name[j:j + n])
            i = j + n
        names = [p for p in parts if not p.startswith("_") and p != "cudapy"]
        if names:
            name = re.sub(r"_2[0-9a-f]+$", "", names[-1])
    return name[:width]


def layer_launches(step):
    """Kernels of one call of step() (an engine step at pure decode: one graph replay) from torch.profiler
    (kernels inside a CUDA graph appear one by one), counted by layer_counts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == DeviceType.CUDA
                     and not ev.name.startswith(("Memcpy", "Memset"))), key=lambda ev: ev.time_range.start)
    return layer_counts([ev.name for ev in events])


def layer_counts(names):
    """Kernel names in launch order -> {"kernels": all, "layers": rotary kernels seen (one per layer),
    "per_layer": the median count from one layer's rotary kernel to the next's (a step's boundary, where an
    asynchronous engine's profile holds parts of two steps, is an outlier), "outside": the rest (embedding,
    final norm, LM head, sampling), "layer": one layer's kernel names in order, from its rotary kernel}."""
    marks = [i for i, n in enumerate(names) if ROTARY in n]
    if len(marks) < 3:
        raise RuntimeError(f"{len(marks)} rotary kernels in the profile of one step: cannot find the layers")
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    per_layer = sorted(gaps)[len(gaps) // 2]
    first = marks[gaps.index(per_layer)]
    return dict(kernels=len(names), layers=len(marks), per_layer=per_layer, outside=len(names) - per_layer * len(marks),
                layer=[short_name(n) for n in names[first:first + per_layer]])


def checked_decode_steps(llm, stats):
    """Make the engine check every decode graph replay: the step first runs eagerly with the few-row path off
    (model.skinny.max_rows = 0), then the sampled-token buffers are put back and the graph replays the same
    step on the same state (its K/V writes replace the eager run's, its tokens are the step's). `stats`
    collects the steps, the fused ones, the batch sizes, the worst logit difference, argmax mismatches where
    the top-2 margin is clear (> 2x the difference) and the near-ties. Returns a function that undoes it."""
    runner = llm.engine.runner
    graphs = runner.capture_graphs()
    replay, skinny = graphs.run, runner.model.skinny

    def checked(step):
        n = step.num_seqs
        tokens, logprobs = runner.sampled_tokens.clone(), runner.sampled_logprobs.clone()   # the in-flight ids
        rows = skinny.max_rows if skinny is not None else 0
        if skinny is not None:
            skinny.max_rows = 0
        try:
            dev = torch.from_numpy(step.data).to(runner.device)
            plan_len = runner.plan_len_of(n, step.max_context_len)           # the graph's plan
            e_logits = runner.run_step(step, dev, max_context_len=plan_len)[1].clone()
        finally:
            if skinny is not None:
                skinny.max_rows = rows
        runner.sampled_tokens.copy_(tokens)
        runner.sampled_logprobs.copy_(logprobs)
        logits = replay(step)
        g_logits = logits[:n]
        diff = (g_logits - e_logits).abs().amax(-1)
        top2 = e_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        stats["steps"] += 1
        stats["fused_steps"] += int(skinny is not None and skinny.takes(n))
        stats["sizes"].add(n)
        stats["worst"] = max(stats["worst"], float(diff.max()))
        stats["mismatch"] += int((g_logits.argmax(-1) != e_logits.argmax(-1))[clear].sum())
        stats["near_ties"] += int((~clear).sum())
        return logits

    graphs.run = checked

    def restore():
        graphs.run = replay
    return restore


def validation_requests(num, seed=0, vocab=10000):
    """(prompts, greedy SamplingParams with logprobs): prompts of 5-200 tokens, 8-64 new tokens each, so that
    the batch shrinks as requests finish and the decode graphs of every size run."""
    from pagedattn import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(5, 200, num)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True, logprobs=True)
              for m in rng.integers(8, 64, num)]
    return prompts, params


def greedy_run(llm, prompts, params, check=True):
    """Greedy tokens (and their logprobs) of `prompts`, with every graphed decode step checked against the
    unfused eager step when `check`. Returns (outputs [(token ids, logprobs)], stats)."""
    stats = dict(steps=0, fused_steps=0, sizes=set(), worst=0.0, mismatch=0, near_ties=0)
    restore = checked_decode_steps(llm, stats) if check else (lambda: None)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        restore()
    stats["sizes"] = sorted(stats["sizes"])
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stats


def compare_tokens(a, b):
    """Requests whose greedy tokens agree; for the others, where they first part and the chosen tokens'
    logprob gap there (a near-tie flips with a gap of about the fp16 noise of the logits)."""
    same, parted = 0, []
    for (ta, la), (tb, lb) in zip(a, b):
        if list(ta) == list(tb):
            same += 1
            continue
        i = next(k for k, (x, y) in enumerate(zip(ta, tb)) if x != y)
        parted.append(dict(at=i, gap=abs(la[i] - lb[i]) if la and lb else None))
    return dict(requests=len(a), same=same, parted=parted)


def decode_rate(llm, cfg, batch, sampling, steps, profile_steps, seed, launches=False):
    """Pure-decode steps of `batch` sequences of 128-token prompts, sampled with SamplingParams(**sampling):
    wall ms per step() and tok/s, GPU ms and kernels per step; with launches, also layer_launches of one more
    step."""
    from pagedattn import SamplingParams
    from scripts.profile_step import add_requests, step_until_pure_decode, wall_ms_per_step

    # decode never ends while measured (64: tokens made while the others prefill)
    params = SamplingParams(**sampling, max_tokens=steps + profile_steps + 4 + 64, ignore_eos=True)
    rng = random.Random(seed)
    vocab = min(10000, cfg.vocab_size - 1)
    prompts = [[rng.randint(0, vocab) for _ in range(128)] for _ in range(batch)]
    ids = add_requests(llm, prompts, params, f"rate{batch}-{seed}")
    try:
        step_until_pure_decode(llm, batch)
        for _ in range(2):
            llm.engine.step()
        wall = wall_ms_per_step(llm, steps)
        prof = benchlib.kernel_times(llm.engine.step, profile_steps)
        layers = layer_launches(llm.engine.step) if launches else None
    finally:
        for rid in ids:
            llm.engine.abort_request(rid)
    kernels = prof["kernels"]
    gpu_ms = sum(k["us"] for k in kernels.values()) / profile_steps / 1e3
    row = dict(wall_ms=wall, tok_s=batch / wall * 1e3, gpu_ms=gpu_ms,
               kernels=sum(k["count"] for k in kernels.values()) / profile_steps)
    return row, layers


def run_engine(ckpt, rows, batches, steps, profile_steps, requests, max_num_seqs, max_model_len):
    """One LLM with PAGEDATTN_SKINNY_ROWS=rows (None: unset, the default): its validation run, then the decode
    rates (greedy and sampled) and the kernels per layer of a batch-1 step. Returns a dict."""
    from pagedattn import LLM
    from pagedattn.models.loader import read_config

    old = os.environ.pop(ENV_ROWS, None)
    if rows is not None:
        os.environ[ENV_ROWS] = str(rows)
    t0 = time.perf_counter()
    try:
        llm = LLM(ckpt, device="cuda", max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    finally:
        os.environ.pop(ENV_ROWS, None)
        if old is not None:
            os.environ[ENV_ROWS] = old
    try:
        start_s = time.perf_counter() - t0
        cfg = read_config(ckpt)
        skinny = llm.engine.runner.model.skinny
        out = dict(rows=skinny.max_rows if skinny is not None else 0, startup_s=start_s)
        out["tokens"], out["check"] = greedy_run(llm, *requests)
        print(f"rows {out['rows']}: validation {out['check']}", flush=True)
        out["rates"] = []
        for kind, sampling in (("greedy", dict(temperature=0)), ("sampled", dict(**SAMPLED, seed=0))):
            for b in batches:
                r, layers = decode_rate(llm, cfg, b, sampling, steps, profile_steps, seed=b,
                                        launches=(b == 1 and kind == "greedy"))
                out["rates"].append(dict(kind=kind, batch=b, **r))
                if layers is not None:
                    out["launches"] = layers
                print(f"rows {out['rows']}: {kind} batch {b}: {r}", flush=True)
        return out
    finally:
        llm.close()


def markdown(on, off, tokens, meta):
    lines = [f"Model {meta['model']} ({meta['config']}, {meta['num_layers']} layers), fp16, CUDA graphs, one GPU. "
             f"Fused: steps of <= {on['rows']} rows run each layer through the skinny GEMM "
             "(pagedattn/layers/skinny_decode.py); unfused: PAGEDATTN_SKINNY_ROWS=0. Wall = step() at pure decode "
             f"(mean of {meta['steps']} back to back, contexts from 128 tokens); GPU = kernel time per step "
             f"(torch.profiler, mean of {meta['profile_steps']} steps).", ""]
    rows = []
    for a, b in zip(on["rates"], off["rates"]):
        rows.append(dict(kind=a["kind"], batch=a["batch"], fused_tok_s=a["tok_s"], unfused_tok_s=b["tok_s"],
                         speedup=a["tok_s"] / b["tok_s"], fused_wall_ms=a["wall_ms"], unfused_wall_ms=b["wall_ms"],
                         fused_gpu_ms=a["gpu_ms"], unfused_gpu_ms=b["gpu_ms"], fused_kernels=a["kernels"],
                         unfused_kernels=b["kernels"]))
    lines += [benchlib.markdown_table(rows, floatfmt="{:.3g}"), ""]
    lines.append("Kernels per layer at batch 1 (one step, one replay of the batch-1 graph, between consecutive "
                 "layers' rotary kernels):")
    lines.append("")
    lines.append(benchlib.markdown_table([
        dict(path=name, per_layer=r["launches"]["per_layer"], outside_layers=r["launches"]["outside"],
             total=r["launches"]["kernels"], one_layer=" ".join(r["launches"]["layer"]))
        for name, r in (("fused", on), ("unfused", off))], floatfmt="{:.3g}"))
    lines.append("")
    for name, r in (("fused", on), ("unfused", off)):
        c = r["check"]
        lines.append(f"Validation, {name} engine: {c['steps']} decode graph replays ({c['fused_steps']} fused, batch "
                     f"sizes {c['sizes']}) against the same steps eager and unfused: worst logit difference "
                     f"{c['worst']:.3g}, argmax mismatches where the margin is clear: {c['mismatch']}, near-ties: "
                     f"{c['near_ties']}.")
    lines.append(f"Greedy tokens, fused vs unfused engine: {tokens['same']} of {tokens['requests']} requests identical"
                 + (f"; the others part at tokens {[p['at'] for p in tokens['parted']]} with logprob gaps "
                    f"{[round(p['gap'], 4) if p['gap'] is not None else None for p in tokens['parted']]}"
                    if tokens["parted"] else "") + ".")
    lines.append(f"Start-up: fused engine {on['startup_s']:.1f} s (first: compiles), unfused {off['startup_s']:.1f} s.")
    return "\n".join(lines), rows


def main(out=".", config="0.5b", batches=(1, 8, 16), steps=30, profile_steps=3, num_prompts=16, max_model_len=1024):
    """Both engines, validated then timed; writes skinny_decode.{md,json} under `out`. Returns the result."""
    from pagedattn.models.loader import read_config

    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny_decode.py needs a CUDA GPU")
    ckpt = benchlib.random_checkpoint(config)
    cfg = read_config(ckpt)
    if 1 not in batches:
        raise SystemExit("--batches must include 1 (the kernels per layer are counted at batch 1)")
    kw = dict(batches=batches, steps=steps, profile_steps=profile_steps, requests=validation_requests(num_prompts),
              max_num_seqs=max(batches), max_model_len=max_model_len)
    on = run_engine(ckpt, FUSED_ROWS, **kw)
    off = run_engine(ckpt, 0, **kw)
    tokens = compare_tokens(on["tokens"], off["tokens"])
    meta = dict(model=ckpt, config=config, num_layers=cfg.num_hidden_layers, steps=steps,
                profile_steps=profile_steps, tokens=tokens)
    md, rows = markdown(on, off, tokens, meta)
    result = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in (("fused", on), ("unfused", off))}
    paths = benchlib.save(out, "skinny_decode", rows, {**meta, **result}, md)
    print(benchlib.env_line() + "\n\n" + md)
    print("wrote", *paths)
    problems = [f"{name}: {r['check']['mismatch']} argmax mismatches" for name, r in (("fused", on), ("unfused", off))
                if r["check"]["mismatch"]]
    if on["launches"]["per_layer"] > 7:
        problems.append(f"fused: {on['launches']['per_layer']} kernels per layer at batch 1 (> 7)")
    if problems:
        raise SystemExit("validation failed: " + "; ".join(problems))
    return dict(meta=meta, rows=rows, **result)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for skinny_decode.md / .json")
    ap.add_argument("--config", choices=sorted(benchlib.QWEN2_CONFIGS), default="0.5b")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed (wall) per point")
    ap.add_argument("--profile-steps", type=int, default=3, help="decode steps profiled per point")
    ap.add_argument("--prompts", type=int, default=16, help="greedy requests of the validation run")
    a = ap.parse_args()
    main(a.out, a.config, tuple(int(b) for b in a.batches.split(",")), a.steps, a.profile_steps, a.prompts)
