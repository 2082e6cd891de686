"""The batch-invariant mode beside the default, in one process on the CPU: what it costs and what it buys.

The bundled model on LLM()'s own weights (the GGUF blocks; int8 activations where the CPU has AVX2), --threads
threads. Each round runs every case with the default and then with batch_invariant=True (one LLM each, built
once, prefix caching off so that rounds do not reuse each other's blocks); the table gives the medians of
--repeats rounds after a warm-up round and the ratio mode / default.

  batch 1     one chat prompt, 64 tokens: decode tok/s after the first token, greedy and sampled
              (T 0.8, top-p 0.95, seed 0)
  prompt      a ~1000-token prompt, one token: seconds to it (the prompt's products: where the mode pays)
  workload    bench_cpu.py's mixed batch (8 requests, two ~1000-token prompts, max_tokens 8-64), greedy and
              sampled: generated tokens per second of wall time

Then, once per mode, the invariance itself on the workload's 8 requests (sampled: seeded): each alone and
chunked at a 37-token budget against the batched run, counting the requests whose token ids and logprobs
are bit-identical.

    python scripts/bench_batch_invariant.py --out OUT          # 2 threads, 3 rounds (~13 min on 2 cores)

Writes OUT/bench_batch_invariant.json and .md (benchlib.save).
"""
import os
import statistics
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402
from scripts.bench_cpu import MIXED_MAX_TOKENS, ONE_PROMPT, chat, decode_ours, mixed_prompts  # noqa: E402

MODES = {"default": False, "batch_invariant": True}


def workload_params(temperature):
    from pagedattn import SamplingParams

    return [SamplingParams(max_tokens=m, temperature=temperature, top_p=0.95 if temperature else 1.0,
                           seed=i if temperature else None, logprobs=True) for i, m in enumerate(MIXED_MAX_TOKENS)]


def workload(llm, prompts, temperature):
    """(generated tok/s of wall time, outputs as [(token ids, logprobs)])."""
    t = time.perf_counter()
    outs = llm.generate(prompts, workload_params(temperature), use_tqdm=False)
    wall = time.perf_counter() - t
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return sum(len(ids) for ids, _ in got) / wall, got


def first_token_s(llm, prompt):
    from pagedattn import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t


def identical(llm_of, prompts, temperature):
    """Requests (of the workload) whose token ids and logprobs equal the batched run's: alone, and with a
    37-token budget."""
    batched = workload(llm_of(), prompts, temperature)[1]
    params = workload_params(temperature)
    llm = llm_of()
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    alone = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone]
    chunked = workload(llm_of(max_num_batched_tokens=37), prompts, temperature)[1]
    return (sum(a == b for a, b in zip(alone, batched)), sum(a == b for a, b in zip(chunked, batched)))


def main(out="bench_batch_invariant_out", threads=2, repeats=3):
    from pagedattn import LLM

    torch.set_num_threads(threads)
    args = dict(device="cpu", max_model_len=2048, num_blocks=512, enable_prefix_caching=False)
    llms = {name: LLM(batch_invariant=on, **args) for name, on in MODES.items()}
    tok = llms["default"].get_tokenizer()
    one = chat(tok, ONE_PROMPT)
    prompts = mixed_prompts(tok)
    long = prompts[0]
    cases = {
        "batch 1 decode tok/s, greedy": lambda llm: decode_ours(llm, one, 64)[0],
        "batch 1 decode tok/s, sampled": lambda llm: decode_ours(llm, one, 64, temperature=0.8)[0],
        f"prompt of {len(long)} tokens: s to the first token": lambda llm: first_token_s(llm, long),
        "workload tok/s, greedy": lambda llm: workload(llm, prompts, 0.0)[0],
        "workload tok/s, sampled": lambda llm: workload(llm, prompts, 0.8)[0],
    }
    print(benchlib.env_line())
    got = {(case, name): [] for case in cases for name in MODES}
    for r in range(repeats + 1):                  # round 0: warm-up
        for case, run in cases.items():
            for name, llm in llms.items():
                value = run(llm)
                print(f"  round {r}/{repeats}{' (warm-up)' if r == 0 else ''}: {case}, {name}: {value:.3f}", flush=True)
                if r:
                    got[case, name].append(value)
    rows = []
    for case in cases:
        d, m = (statistics.median(got[case, name]) for name in MODES)
        rows.append({"case": case, "default (median)": d, "batch_invariant (median)": m,
                     "mode / default": m / d,
                     "runs (default; mode)": "; ".join(", ".join(f"{v:.3g}" for v in got[case, n]) for n in MODES)})
    for name, on in MODES.items():
        for temperature in (0.0, 0.8):
            alone, chunked = identical(lambda **kw: LLM(batch_invariant=on, **{**args, **kw}), prompts, temperature)
            rows.append({"case": f"{name}, {'sampled' if temperature else 'greedy'}: requests identical to the "
                                 f"batched run (of {len(prompts)}): alone; at a 37-token budget",
                         "default (median)": alone if not on else "", "batch_invariant (median)": alone if on else "",
                         "mode / default": "", "runs (default; mode)": f"alone {alone}, budget 37 {chunked}"})
    table = benchlib.markdown_table(rows, list(rows[0]))
    print(table)
    meta = {"threads": threads, "repeats": repeats, "engine": args,
            "weights": llms["default"].engine.config.weights, "activations": llms["default"].engine.config.activations,
            "load average at the end": os.getloadavg()}
    print("\n".join(benchlib.save(out, "bench_batch_invariant", rows, meta, table)))
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_batch_invariant_out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    main(a.out, a.threads, a.repeats)
