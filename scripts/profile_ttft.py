"""Where the workload's time to first token goes: the first steps of the nano-vllm workload, one by one.

Every request of the workload arrives at t = 0 (as in scripts/bench_throughput.py), so a request's TTFT
is the wall time of the steps before the one that samples its first token. For each token budget
(--budgets, the engine's max_num_batched_tokens) this runs the workload (greedy, after a warm-up with the
same budget) and records per step: the wall time at its end, the prompt tokens and decodes it launched,
and how many requests have their first token by then. Printed: TTFT p50 / p90 per budget, the step at
which half the requests have their first token, the mean step time before it, and the table of the first
steps of each run; <out>/profile_ttft.{json,md}.

    python scripts/profile_ttft.py --out OUT                          # random 0.5B weights, one H200
    python scripts/profile_ttft.py --model DIR --budgets 8192,16384 --repeat 2 --full --out OUT
"""
import argparse
import cProfile
import os
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import benchlib  # noqa: E402


def run(llm, prompts, out_lens, tag, max_steps, full=False):
    """The workload, greedy, until every request has its first token (full: to the end; the rows stop at
    max_steps either way). Returns (per-step rows, TTFTs in seconds, output tok/s of a full run or None)."""
    engine = llm.engine
    scheduled = []
    schedule = engine.scheduler.schedule

    def logged():                                   # what each step launched
        out = schedule()
        prompt_tokens = sum(n for _, n in out.scheduled if n > 1)
        scheduled.append((prompt_tokens, len(out.scheduled) - out.num_prefills))
        return out

    engine.scheduler.schedule = logged
    groups = {}
    try:
        t0 = time.perf_counter()
        groups = add_workload(engine, prompts, out_lens, tag)
        rows, generated, tok_s = [], 0, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            generated += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
            if len(rows) >= max_steps:
                if not full:
                    break
                continue
            firsts = sum(g.first_token_time is not None for g in groups.values())
            prompt_tokens, decodes = scheduled[-1] if scheduled else (0, 0)
            rows.append(dict(step=len(rows) + 1, t_ms=1e3 * (time.perf_counter() - t0), prompt_tokens=prompt_tokens,
                             decodes=decodes, first_tokens=firsts))
            if firsts == len(groups) and not full:
                break
        if full:
            tok_s = generated / (time.perf_counter() - t0)
        ttfts = [g.first_token_time - g.arrival_time for g in groups.values() if g.first_token_time is not None]
    finally:
        engine.scheduler.schedule = schedule
        abort_all(engine, groups)
    return rows, ttfts, tok_s


def add_workload(engine, prompts, out_lens, tag):
    """Add the workload's requests (greedy, ignore_eos); returns {request id: SequenceGroup}."""
    from pagedattn import SamplingParams

    groups = {}
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        rid = f"{tag}-{i}"
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        groups[rid] = engine.groups[rid]
    return groups


def abort_all(engine, request_ids):
    """Abort the requests still running and step until the engine is empty."""
    for rid in request_ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def gpu_ms(llm, prompts, out_lens, tag, steps):
    """GPU kernel time (ms, torch.profiler) of the workload's first `steps` steps, and their wall time."""
    engine = llm.engine
    groups = add_workload(engine, prompts, out_lens, tag)
    t0 = time.perf_counter()
    times = benchlib.kernel_times(engine.step, steps)
    wall = 1e3 * (time.perf_counter() - t0)
    abort_all(engine, groups)
    return sum(k["us"] for k in times["kernels"].values()) / 1e3, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random 0.5B weights, fp16)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budgets", default="8192,16384")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--show-steps", type=int, default=24, help="rows of the per-step table printed per budget")
    ap.add_argument("--full", action="store_true", help="also run the workload to the end: output tok/s")
    ap.add_argument("--gpu-steps", type=int, default=0,
                    help="also profile the first N steps: their GPU kernel time against their wall time (the "
                         "profiler slows the host)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the workload per LLM (the first may differ)")
    ap.add_argument("--cprofile", action="store_true",
                    help="run the workload under cProfile (slower host): <out>/ttft_<budget>_<run>.prof")
    ap.add_argument("--out", default="out/profile_ttft")
    args = ap.parse_args()

    from pagedattn import LLM

    ckpt = args.model or benchlib.random_checkpoint("0.5b")
    prompts, out_lens = benchlib.nano_vllm_workload(args.num_requests)
    results, lines = [], []
    for budget in [int(b) for b in args.budgets.split(",")]:
        llm = LLM(ckpt, device=args.device, max_num_batched_tokens=budget, enable_prefix_caching=False)
        run(llm, prompts[:8], [8] * 8, f"warm{budget}", args.max_steps)
        for rep in range(args.repeat):
            prof = cProfile.Profile() if args.cprofile else None
            if prof:
                prof.enable()
            rows, ttfts, tok_s = run(llm, prompts, out_lens, f"b{budget}r{rep}", args.max_steps, args.full)
            if prof:
                prof.disable()
                os.makedirs(args.out, exist_ok=True)
                prof.dump_stats(os.path.join(args.out, f"ttft_{budget}_{rep}.prof"))
            pct = benchlib.percentiles(ttfts)
            half = next((r for r in rows if 2 * r["first_tokens"] >= len(prompts)), rows[-1])
            res = dict(budget=budget, run=rep, ttft_p50_s=pct.get("p50"), ttft_p90_s=pct.get("p90"),
                       half_at_step=half["step"], mean_step_ms=half["t_ms"] / half["step"], output_tok_s=tok_s,
                       steps=rows)
            results.append(res)
            lines += [f"max_num_batched_tokens {budget}, run {rep}: TTFT p50 {res['ttft_p50_s']:.3f} s, "
                      f"p90 {res['ttft_p90_s']:.3f} s; half the requests have their first token after step "
                      f"{half['step']} ({half['t_ms']:.1f} ms, {res['mean_step_ms']:.1f} ms per step)"
                      + (f"; the whole workload {tok_s:,.0f} output tok/s" if tok_s else ""), "",
                      benchlib.markdown_table(rows[:args.show_steps], floatfmt="{:.1f}"), ""]
        if args.gpu_steps:
            gpu, wall = gpu_ms(llm, prompts, out_lens, f"g{budget}", args.gpu_steps)
            results[-1].update(gpu_ms_first_steps=gpu, wall_ms_first_steps=wall)
            lines += [f"max_num_batched_tokens {budget}: the first {args.gpu_steps} steps under torch.profiler: GPU "
                      f"{gpu:.1f} ms, wall {wall:.1f} ms", ""]
        llm.close()
        del llm
    md = "\n".join(lines)
    benchlib.save(args.out, "profile_ttft", [{k: v for k, v in r.items() if k != "steps"} for r in results],
                  dict(model=ckpt, device=args.device, num_requests=len(prompts), runs=results), md)
    print(benchlib.env_line() + "\n\n" + md)


if __name__ == "__main__":
    main()
