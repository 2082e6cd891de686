"""Where a decode step of the GGUF-block CPU path goes: its block-kernel calls timed in place, the same calls
replayed alone (same x, same weights, same order, so the weights come from memory in both), and the rest of
the step, alternating step by step so that a load change on a shared machine hits both.

    python scripts/bench_cpu_decode_split.py [--activations int8] [--steps 40] [--threads 2]

Prints, per decode step (minimum and median over --steps): the step's wall time, the wall time of its
block-kernel calls in place (cpu_quant / cpu_quant_int8 `linear_parts`), the same calls replayed back to
back right after the step, and the step's pieces outside the kernels (wall time summed per step). The
layers run as modules (one call a layer, the engine's default, has no separate calls to time).
"""
import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(activations="float32", steps=40, threads=2):
    from kernels_numba import cpu_quant, cpu_quant_int8
    from pagedattn import LLM, SamplingParams
    from pagedattn.bundled import bundled_model_path
    from scripts.bench_cpu import ONE_PROMPT, StepProfile, chat

    torch.set_num_threads(threads)
    module = cpu_quant_int8 if activations == "int8" else cpu_quant
    kernel = module.linear_parts
    rec = {"on": False, "wall": 0.0, "calls": []}

    def timed_kernel(x, parts, bias=None, num_threads=None, *rest):
        t0 = time.perf_counter()
        out = kernel(x, parts, bias, num_threads, *rest)
        if rec["on"]:
            rec["wall"] += time.perf_counter() - t0
            rec["calls"].append((x.clone(), parts, bias, num_threads))
        return out

    module.linear_parts = timed_kernel
    try:
        llm = LLM(bundled_model_path(), weights="quantized", activations=activations, device="cpu",
                  max_model_len=2048, max_num_seqs=4, num_blocks=256, enable_prefix_caching=False)
        engine, ops = llm.engine, llm.engine.model.ops
        from pagedattn.layers.ops import run_layer

        ops.decoder_layer = run_layer            # the layer modules: their kernel calls are separate to time
        prof = StepProfile()                     # its wrappers sum each piece's wall time into prof.current
        for name in ("rotary_and_cache_write", "attention", "rms_norm", "add_rms_norm", "silu_and_mul", "embedding"):
            prof.wrap(ops, name, name)
        import pagedattn.engine.model_runner as model_runner
        prof.wrap(model_runner.sampler, "sample", "sampler")
        engine.add_request("split", chat(llm.get_tokenizer(), ONE_PROMPT),
                           SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
        for _ in range(3):                       # the prefill and two warm decode steps
            engine.step()
        rows = {"step (wall)": [], "block kernels in place": [], "the same calls replayed alone": []}
        per_piece = []
        for _ in range(steps):
            rec.update(on=True, wall=0.0, calls=[])
            prof.current = {}
            t0 = time.perf_counter()
            engine.step()
            rows["step (wall)"].append(time.perf_counter() - t0)
            rec["on"] = False
            rows["block kernels in place"].append(rec["wall"])
            per_piece.append(prof.current)
            t0 = time.perf_counter()
            for x, parts, bias, nt in rec["calls"]:
                kernel(x, parts, bias, nt)
            rows["the same calls replayed alone"].append(time.perf_counter() - t0)
        for k in per_piece[0]:
            rows[f"  {k}"] = [p.get(k, 0.0) for p in per_piece]
        rows["step - kernels"] = [s - k for s, k in zip(rows["step (wall)"], rows["block kernels in place"])]
        print(f"{activations} activations, {threads} threads, {len(rec['calls'])} block-kernel calls a step, "
              f"{steps} steps, load average {os.getloadavg()[0]:.2f}")
        for k, v in rows.items():
            print(f"{k:34s} min {1e3 * min(v):7.2f} ms   median {1e3 * statistics.median(v):7.2f} ms")
        llm.close()
    finally:
        module.linear_parts = kernel


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--activations", default="float32", choices=["float32", "int8"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    main(a.activations, a.steps, a.threads)
