"""The batch-invariant mode on a GPU beside the default, in one process: what it buys and what it costs.

Three parts (--parts, comma-separated; each writes OUT/gpu_batch_invariant_<part>.{json,md}):

  gemm      the mode's products (pagedattn.layers.ops.InvariantLinear: the bits of fixed_rows_linear's
            128-row pieces, in one call at the row counts its check finds equal) against F.linear and the
            pieces alone, for the 0.5B model's shapes, fp16 and bf16: the check's time per row count, the row
            counts left to the pieces, at how many of the row counts M tried a row's bits differ from the row
            alone (the invariance), and microseconds per product at M = 1 .. 8192 (CUDA-graph replay; the cost).
  identity  --requests prompts (chat prompts through the tokenizer where the model has one, else random
            ids), half greedy, half sampled (T 0.8, top-p 0.95, a seed each), --max-tokens tokens each,
            logprobs on: run batched (prefix caching on), again (prefix-cache hits), the first 8 alone, at
            a 256-token budget, eagerly, and in a small pool that preempts; the requests whose token ids and
            logprobs are bit-identical to the batched run's, mode off and on, per --dtypes.
  cost      bench_throughput.py's workload (the nano-vllm load, --workload-requests of it) and batch 1,
            greedy and seeded-sampled, mode off and on in turns, --rounds rounds: tok/s of each round and
            the median ratio; --part-keys K1,K2: the mode with attention parts of each size in turn.

    python scripts/gpu_batch_invariant.py --out OUT                             # random 0.5B weights
    python scripts/gpu_batch_invariant.py --model DIR --parts identity --out OUT  # the real checkpoint

The mode gives cuBLAS no workspace (ops.no_split_k), which torch reads at a process's first GEMM: a process
that starts with the mode has it, but here the default runs first, so the script sets it at its start, for
both (the default's throughput is the same with it: docs/batch_invariance.md, probe_no_split_k.py).
"""
import os
import statistics
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts import benchlib  # noqa: E402
from scripts.bench_throughput import release, workload_mode  # noqa: E402

ROWS = 128                          # NumbaBackend.INVARIANT_ROWS
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 151936)}
ROW_COUNTS = list(range(1, 300, 3)) + [384, 511, 512, 1000, 2048, 4096, 8192]
TIMED_M = (1, 16, 128, 256, 1024, 8192)
TOPICS = ["a hash map", "recursion", "the TCP handshake", "a binary heap", "garbage collection", "a mutex",
          "the CAP theorem", "a bloom filter"]
ASKS = ["Explain {} in two sentences.", "Write a short Python example of {}.", "List three facts about {}.",
        "Why does {} matter to a programmer?", "Compare {} with its closest alternative.",
        "Give a one-line definition of {}.", "What is a common mistake with {}?", "Teach {} to a child."]


def gemm_part(dtypes):
    from pagedattn.layers.ops import InvariantLinear, fixed_rows_linear

    rows = []
    for dtype in dtypes:
        for name, (k, n) in SHAPES.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(n, k, generator=g, device="cuda", dtype=dtype) / k ** 0.5
            b = torch.randn(n, generator=g, device="cuda", dtype=dtype) if name == "qkv" else None
            x = torch.randn(max(ROW_COUNTS), k, generator=g, device="cuda", dtype=dtype)
            row = dict(dtype=str(dtype).replace("torch.", ""), shape=name, K=k, N=n)
            lin = InvariantLinear(ROWS)             # the mode's products: checked at every M up to checked_rows
            checked_rows = 1024 if name == "lm_head" else max(ROW_COUNTS)
            t0 = time.perf_counter()
            bad = [m for m in range(1, checked_rows + 1) if not lin.one_call(w, b, m)]
            row["check ms per M"] = round((time.perf_counter() - t0) * 1e3 / checked_rows, 3)
            row["one call at M"] = f"{checked_rows - len(bad)}/{checked_rows} (pieces at {runs(bad)})"
            for label, fn in (("F.linear", F.linear), ("fixed rows", lambda x, w, b: fixed_rows_linear(ROWS, x, w, b)),
                              ("mode", lin)):
                probe = range(0, max(ROW_COUNTS), 97)           # rows checked at every M, against themselves alone
                alone = {i: fn(x[i:i + 1], w, b)[0] for i in probe}
                differ = []
                for m in ROW_COUNTS:
                    y = fn(x[:m], w, b)
                    if any(not torch.equal(y[i], alone[i]) for i in probe if i < m):
                        differ.append(m)
                row[f"{label}: M differing"] = f"{len(differ)}/{len(ROW_COUNTS)} {differ[:6]}"
                for m in TIMED_M:
                    if name == "lm_head" and m > 1024:
                        continue
                    row[f"{label} us M={m}"] = benchlib.graph_time_us(lambda: fn(x[:m], w, b), calls=10, replays=5)
            rows.append(row)
            print(row, flush=True)
    return rows


def runs(ms, shown=8):
    """[3, 4, 5, 9] -> '3-5, 9' (the first `shown` runs)."""
    out = []
    for m in ms:
        if out and out[-1][1] == m - 1:
            out[-1][1] = m
        else:
            out.append([m, m])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out[:shown])
    return text + (f", ... ({len(out)} runs)" if len(out) > shown else "") if out else "none"


def prompts_for(llm, n):
    tok = llm.get_tokenizer()
    if tok is None:
        prompts, _ = benchlib.nano_vllm_workload(n, 50, 300, seed=7)
        return prompts
    texts = [ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)]) + f" (note {i})" for i in range(n)]
    if getattr(tok, "chat_template", None):      # the template's system turn is a prefix every prompt shares
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in texts]
    return [tok.encode(t) for t in texts]


def identity_params(n, max_tokens):
    from pagedattn import SamplingParams

    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, temperature=0.0) if i % 2 == 0
            else SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True, temperature=0.8, top_p=0.95,
                                seed=100 + i) for i in range(n)]


def identity_part(model, dtypes, num_requests, max_tokens, device="cuda"):
    from pagedattn import LLM

    rows = []
    for dtype in dtypes:
        for invariant in (False, True):
            def make(**kw):
                return LLM(model, device=device, dtype=dtype, batch_invariant=invariant, **kw)

            def run(llm, prompts, params):
                outs = llm.generate(prompts, params, use_tqdm=False)
                return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

            llm = make()
            prompts = prompts_for(llm, num_requests)
            params = identity_params(num_requests, max_tokens)
            base = run(llm, prompts, params)
            runs = {"prefix hits": run(llm, prompts, params),
                    "alone (8)": [run(llm, [prompts[i]], [params[i]])[0] for i in range(8)]}
            hits = llm.metrics()["prefix_cache_hit_tokens"]
            if not hits:
                raise SystemExit("the second run had no prefix-cache hits: its comparison would test nothing")
            blocks_needed = sum(-(-(len(p) + max_tokens) // 16) for p in prompts)
            llm.close()
            release(device)
            preemptions = None
            for name, kw in (("budget 256", dict(max_num_batched_tokens=256)), ("eager", dict(enforce_eager=True)),
                             ("small pool", dict(num_blocks=max(blocks_needed // 4, 64), max_model_len=1024))):
                llm = make(**kw)
                runs[name] = run(llm, prompts, params)
                if name == "small pool":
                    preemptions = llm.metrics()["num_preemptions"]
                llm.close()
                release(device)
            row = dict(dtype=dtype, mode="batch_invariant" if invariant else "default", requests=num_requests,
                       max_tokens=max_tokens, prefix_hit_tokens=hits, small_pool_preemptions=preemptions)
            for name, outs in runs.items():
                row[name] = f"{sum(a == b for a, b in zip(outs, base))}/{len(outs)}"
            rows.append(row)
            print(row, flush=True)
    return rows


def cost_part(out, model, dtype, rounds, workload_requests, part_keys=(None,)):
    """part_keys: the mode's attention parts to measure (NumbaBackend.INVARIANT_PART_KEYS; None: as set),
    each beside the same round's default."""
    from pagedattn.layers.attention import NumbaBackend

    kinds = ("greedy", "sampled seeded")
    workload = benchlib.nano_vllm_workload(workload_requests)
    tok_s = {}
    keep = NumbaBackend.INVARIANT_PART_KEYS
    try:
        for r in range(rounds):
            for keys in (False, *part_keys):         # False: the default (mode off)
                NumbaBackend.INVARIANT_PART_KEYS = keep if keys in (False, None) else keys
                tag = "off" if keys is False else f"on{keys or ''}"
                res = workload_mode(os.path.join(out, f"cost_{r}_{tag}"), model, "cuda",
                                    engine_kw=dict(batch_invariant=keys is not False, dtype=dtype),
                                    workload=workload, kinds=kinds, batch1_kinds=kinds)
                for row in res["rows"]:
                    tok_s.setdefault((row["group"], row["params"], keys), []).append(row["tok_s"])
    finally:
        NumbaBackend.INVARIANT_PART_KEYS = keep
    rows = []
    for (group, kind, keys), values in tok_s.items():
        if keys is not False:
            base = tok_s[(group, kind, False)]
            rows.append(dict(group=group, params=kind, part_keys=keys or keep, default_tok_s=base,
                             invariant_tok_s=values,
                             ratio_median=statistics.median(v / b for v, b in zip(values, base) if v and b)))
    return rows


def main(out, model, parts, dtypes, num_requests, max_tokens, rounds, workload_requests, device="cuda",
         part_keys=(None,)):
    from pagedattn.layers.ops import no_split_k

    no_split_k()                    # before the first GEMM: the mode's setting, for the default too
    model = model or benchlib.random_checkpoint("0.5b")
    meta = dict(model=model, env=benchlib.env_line(),
                cublas={k: os.environ.get(k) for k in ('CUBLAS_WORKSPACE_CONFIG', 'CUBLASLT_WORKSPACE_SIZE')})
    dtypes = [getattr(torch, d) for d in dtypes]
    for part in parts:
        if part == "gemm":
            rows = gemm_part(dtypes)
        elif part == "identity":
            rows = identity_part(model, [str(d).replace("torch.", "") for d in dtypes], num_requests, max_tokens,
                                 device)
        elif part == "cost":
            rows = cost_part(out, model, str(dtypes[0]).replace("torch.", ""), rounds, workload_requests,
                             part_keys)
        else:
            raise SystemExit(f"unknown part {part!r}: gemm, identity, cost")
        md = benchlib.markdown_table(rows)
        benchlib.save(out, f"gpu_batch_invariant_{part}", rows, meta, md)
        print(f"\n## {part}\n\n{md}", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_batch_invariant_out")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random 0.5B weights)")
    ap.add_argument("--parts", default="gemm,identity,cost")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload-requests", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="identity on the CPU (float32): a smoke run of the script")
    ap.add_argument("--part-keys", default=None,
                    help="cost: the mode's attention parts to measure, comma-separated (e.g. 128,256; default: "
                         "NumbaBackend.INVARIANT_PART_KEYS)")
    a = ap.parse_args()
    keys = tuple(int(k) for k in a.part_keys.split(",")) if a.part_keys else (None,)
    main(a.out, a.model, a.parts.split(","), a.dtypes.split(","), a.requests, a.max_tokens, a.rounds,
         a.workload_requests, a.device, keys)
