"""The engine's host cost per output token on the nano-vllm workload: offline, and as the engine core runs it.

Two ways to run the same 256 requests (greedy, ignore_eos, all at t = 0) on one LLM:

  * offline   the requests as `LLM.generate` gives them to the engine (not streamed; the engine's own
              output processor, with the tokenizer);
  * core      as pagedattn/serving/engine_core.py runs them: streamed requests, the core's output processor
              (no tokenizer, deltas only), and each step's outputs packed into one StepOutputs message
              (`engine_core.pack_outputs` and `encode_step`, as EngineCore._step does, the send left out).

Per way and run (they alternate, --runs each): output tok/s, and the process's CPU time (every thread) per
1000 output tokens. With --profile, one more run of each under cProfile, the top functions by own time
printed. <out>/profile_core.{json,md}.

    python scripts/profile_core.py --out OUT                  # random 0.5B weights, one H200
    python scripts/profile_core.py --model DIR --runs 3 --profile --out OUT
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import benchlib  # noqa: E402


def run(llm, prompts, out_lens, way, tag):
    """The workload one way; returns (output tokens, wall seconds, CPU seconds)."""
    from pagedattn import SamplingParams
    from pagedattn.serving.engine_core import encode_step, pack_outputs

    engine = llm.engine
    stream = way == "core"
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        rid = (b"client", i) if stream else f"{tag}-{i}"        # (the core's ids: (client, wire id))
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), stream=stream)
    tokens = 0
    w0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if not stream:
            tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
            continue
        for entries, finished, errors in pack_outputs(outs).values():      # EngineCore._step's packing
            tokens += sum(len(e[2]) for e in entries)
            encode_step(0, entries, finished, errors)
    return tokens, time.perf_counter() - w0, time.process_time() - c0


def run_way(llm, prompts, out_lens, way, tag):
    """run() with the engine's output processor for `way`: its own (offline), or the engine core's (no
    tokenizer, deltas only: pagedattn/serving/engine_core.py's EngineCore), restored afterwards."""
    from pagedattn.engine.output_processor import OutputProcessor

    engine = llm.engine
    own = engine.outputs
    if way == "core":
        engine.outputs = OutputProcessor(None, engine.eos_token_ids, engine.max_model_len, deltas_only=True)
    try:
        return run(llm, prompts, out_lens, way, tag)
    finally:
        engine.outputs = own


def top_functions(fn, n=30):
    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random 0.5B weights, fp16)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="out/profile_core")
    args = ap.parse_args()

    from pagedattn import LLM

    ckpt = args.model or benchlib.random_checkpoint("0.5b")
    prompts, out_lens = benchlib.nano_vllm_workload(args.num_requests)
    llm = LLM(ckpt, device=args.device, enable_prefix_caching=False)

    def way_run(way, tag):
        return run_way(llm, prompts, out_lens, way, tag)

    way_run("offline", "warm0")
    way_run("core", "warm1")
    rows = []
    for r in range(args.runs):
        for way in ("offline", "core"):
            tokens, wall, cpu = way_run(way, f"{way}{r}")
            rows.append(dict(way=way, run=r, output_tokens=tokens, seconds=wall, tok_s=tokens / wall,
                             cpu_ms_per_ktok=1e6 * cpu / tokens, cpu_share=cpu / wall))
            print(rows[-1], flush=True)
    profiles = {}
    if args.profile:
        for way in ("offline", "core"):
            profiles[way] = top_functions(lambda: way_run(way, f"prof-{way}"))
            print(f"---- {way} under cProfile\n{profiles[way]}", flush=True)
    llm.close()
    md = benchlib.markdown_table(rows, floatfmt="{:.1f}")
    benchlib.save(args.out, "profile_core", rows, dict(model=ckpt, device=args.device, profiles=profiles), md)
    print(benchlib.env_line() + "\n\n" + md)


if __name__ == "__main__":
    main()
