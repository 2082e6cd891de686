"""Two source trees of the project measured in one call, alternating: the nano-vllm workload and batch 1.

    python scripts/ab_trees.py --trees OLD_DIR,. --rounds 3 --out OUT

Each measurement runs in a fresh process whose PYTHONPATH starts with one tree (its pagedattn, kernels_numba
and scripts), on random weights of the Qwen2.5-0.5B config in fp16 (scripts/benchlib.random_checkpoint), CUDA
graphs on, prefix caching off:

    workload   the nano-vllm workload (256 requests, prompts of 100-1024 tokens, outputs of 100-1024,
               ignore_eos, seed 0), greedy: output tokens / seconds of one LLM.generate
    batch 1    one request, 512 prompt tokens, 256 output tokens, greedy: (tokens - 1) / seconds after
               the first token

The trees alternate round by round (A B A B ...), so a drift of the machine lands on both; the table
gives each run and each tree's median. A tree's first process compiles its kernels (their sources differ),
so every process warms its engine up before it is timed (LLM() runs the warm-up workload on CUDA).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, time
from scripts import benchlib
from pagedattn import LLM, SamplingParams
ckpt = benchlib.random_checkpoint("0.5b")
llm = LLM(ckpt, device="cuda", dtype="float16", max_model_len=2048, enable_prefix_caching=False)
prompts, lens = benchlib.nano_vllm_workload(256, 100, 1024)
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
llm.generate(prompts[:16], params[:16], use_tqdm=False)                     # warm: cuBLAS shapes, graphs
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
workload = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
prompt = prompts[0][:512] + [7] * max(0, 512 - len(prompts[0]))
one = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
first = None
t = time.perf_counter()
for out in llm.stream([prompt], one):
    if first is None and out.outputs[0].token_ids:
        first = time.perf_counter()
n = len(out.outputs[0].token_ids)
batch1 = (n - 1) / (time.perf_counter() - first)
print(json.dumps(dict(workload_tok_s=workload, batch1_tok_s=batch1)))
"""


def run(tree, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=os.path.abspath(tree), env=env, capture_output=True,
                       text=True, timeout=timeout)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(failed=f"exit {p.returncode}: {p.stderr.strip()[-800:]}")


def main(trees, rounds=3, out="ab_out", timeout=500):
    os.makedirs(out, exist_ok=True)
    rows = []
    for r in range(rounds):
        for tree in trees:
            rows.append(dict(tree=tree, round=r, **run(tree, timeout)))
            print(json.dumps(rows[-1]), flush=True)
    lines = ["| tree | round | workload tok/s | batch 1 tok/s |", "|---|---|---|---|"]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['tree']} | {row['round']} | failed | {row['failed'][:100]} |")
        else:
            lines.append(f"| {row['tree']} | {row['round']} | {row['workload_tok_s']:,.0f} | {row['batch1_tok_s']:,.1f} |")
    for tree in trees:
        done = [row for row in rows if row["tree"] == tree and "failed" not in row]
        if done:
            lines.append(f"| {tree} | median | {statistics.median(r['workload_tok_s'] for r in done):,.0f} | "
                         f"{statistics.median(r['batch1_tok_s'] for r in done):,.1f} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "ab_trees.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "ab_trees.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", required=True, help="comma-separated tree directories, e.g. OLD_DIR,.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="ab_out")
    ap.add_argument("--timeout", type=int, default=500)
    a = ap.parse_args()
    main(a.trees.split(","), a.rounds, a.out, a.timeout)
