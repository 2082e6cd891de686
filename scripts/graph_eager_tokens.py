"""Where the engine's paths part: greedy tokens of the same requests eagerly, through CUDA graphs with the
piecewise prefill, and through CUDA graphs without it.

Each path runs in its own LLM on the same checkpoint; each request's tokens are compared with the eager
path's, and the first index where they differ is reported with that step's context length (prompt + index),
so a difference can be placed against what changes at a length (a decode plan's bound) or traced to the
prefill (the piecewise graphs run the prompt's GEMMs over padded rows, whose rounding may differ from the
eager step's). A greedy run diverges at a near tie once any logit differs, so "differs at i" says where the
paths' numbers first mattered, not that a path is wrong.

    python3 scripts/graph_eager_tokens.py --prompt-lens 300,400 --max-tokens 200 --out OUT    # random 0.5B, GPU
    python3 scripts/graph_eager_tokens.py --model DIR --device cpu --prompt-lens 20 --max-tokens 8 --out OUT

On the CPU every path is eager (no graphs there): the paths must agree.
"""
import argparse
import os
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from scripts import benchlib  # noqa: E402
from scripts.bench_throughput import first_divergence  # noqa: E402

PATHS = {"eager": dict(enforce_eager=True), "graphs": {}, "graphs, no piecewise": dict(piecewise_graphs=False)}


def run(model, device, prompt_lens, max_tokens, max_model_len, vocab, engine_kw=None):
    """Rows: per path and request, the first index its tokens leave the eager path's. engine_kw: more LLM
    arguments (tests: a small pool)."""
    from pagedattn import LLM, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, vocab, n).tolist() for n in prompt_lens]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, graphs = {}, {}
    for name, kwargs in PATHS.items():
        kw = dict(max_num_seqs=4, max_model_len=max_model_len, **(engine_kw or {}), **kwargs)
        with LLM(model, device=device, **kw) as llm:
            # one request at a time: each runs alone (batch 1), as the engine's own graph test does
            tokens[name] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
            graphs[name] = llm.engine.runner.use_graphs
    rows = []
    for name in PATHS:
        for n, eager, mine in zip(prompt_lens, tokens["eager"], tokens[name]):
            i = None if eager == mine else first_divergence(eager, mine)
            rows.append({"path": name, "graphs": graphs[name], "prompt_len": n, "tokens": len(mine),
                         "first_difference": "none" if i is None else i,
                         "context_there": "" if i is None else n + i})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random 0.5B weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-lens", default="300,400")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn from [0, vocab)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = a.model or benchlib.random_checkpoint("0.5b")
    rows = run(model, a.device, [int(x) for x in a.prompt_lens.split(",")], a.max_tokens, a.max_model_len, a.vocab)
    meta = {k: getattr(a, k) for k in ("device", "prompt_lens", "max_tokens", "max_model_len")}
    meta["model"] = model
    for path in benchlib.save(a.out, "graph_eager_tokens", rows, meta):
        print(path)
    print(benchlib.markdown_table(rows))


if __name__ == "__main__":
    main()
