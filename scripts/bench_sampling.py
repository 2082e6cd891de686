"""The device sampler beside torch's argmax: microseconds per call for every parameter kind.

    python3 scripts/bench_sampling.py --out OUT        # H200: N = 1, 8 and 256 rows of V = 151,936 logits

Rows are "model-like" (a few hundred tokens well above a broad randn floor, as a trained model's logits
look) or flat randn (the worst case for top-p: the nucleus holds most of the vocabulary). Each kind runs
every version of kernels_numba/sampling_journey.py: v2, the split path (the engine's: split_chunks(N, V)
CTAs per row, column "chunks"), and v1, the one-CTA path (chunks 0). Timed by CUDA-graph replay over 4 rotated logits sets (L2 cannot serve
them at N = 256); GB/s is one pass over the logits. Every configuration is checked against the CPU
implementation of the same rule first (same tokens). "predicted" is the estimate docs/sampling.md made
before the split path was measured.
"""
import os
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

V = 151_936
CASES = [("torch argmax", None), ("greedy", dict(temperature=0)), ("T=0.8", dict(temperature=0.8)),
         ("T=0.8 p=0.95", dict(temperature=0.8, top_p=0.95)),
         ("T=0.8 k=50 p=0.95", dict(temperature=0.8, top_k=50, top_p=0.95)), ("T=1 (default)", dict())]
# microseconds predicted for the split path on model-like rows (docs/sampling.md), by (rows, kind)
PREDICTED = {(1, "greedy"): 10, (1, "T=0.8"): 12, (1, "T=0.8 p=0.95"): 15, (1, "T=0.8 k=50 p=0.95"): 16,
             (1, "T=1 (default)"): 12, (8, "greedy"): 11, (8, "T=0.8"): 14, (8, "T=0.8 p=0.95"): 30,
             (8, "T=0.8 k=50 p=0.95"): 35, (8, "T=1 (default)"): 14,
             (256, "greedy"): 50, (256, "T=0.8"): 110, (256, "T=0.8 p=0.95"): 300,
             (256, "T=0.8 k=50 p=0.95"): 330, (256, "T=1 (default)"): 110}


def logits_set(n, flat, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randn(n, V, device="cuda", generator=g)
        if not flat:
            x *= 2.5
            idx = torch.randperm(V, device="cuda", generator=g)[:200]
            x[:, idx] += torch.rand(n, 200, device="cuda", generator=g) * 15
        out.append(x)
    return out


def main(out=None, rows=(1, 8, 256), one_cta=True):
    """rows: the batch sizes; one_cta: also time v1, the one-CTA path (chunks 0), beside v2, the split path."""
    from kernels_numba.sampling import split_chunks
    from kernels_numba.sampling_journey import entry
    from pagedattn.layers.sampler import SamplingTensors, sample
    from pagedattn.sampling_params import SamplingParams

    results = []
    for n in rows:
        for flat in (False, True):
            sets = logits_set(n, flat, 4, seed=n)
            for name, kw in CASES:
                st = SamplingTensors.from_params([SamplingParams(**(kw or {}))] * n, list(range(n)), [0] * n,
                                                 [3] * n, "cuda")
                tok = torch.empty(n, dtype=torch.int32, device="cuda")
                lp = torch.empty(n, dtype=torch.float32, device="cuda")
                cpu_tok = None if kw is None else sample(sets[0].cpu(), st.to("cpu"))[0]
                for chunks in ([None] if kw is None else [split_chunks(n, V)] + [0] * one_cta):
                    if kw is None:
                        run = lambda i: torch.argmax(sets[i % 4], dim=-1)      # noqa: E731
                    else:
                        def run(i, chunks=chunks):
                            version, options = (2, dict(chunks=chunks)) if chunks else (1, {})
                            entry(version)(sets[i % 4], st.temperature, st.top_k, st.top_p, st.seed, st.index,
                                           st.position, tok, lp, **options)
                        run(0)
                        assert torch.equal(cpu_tok, tok.cpu()), \
                            f"{name}, chunks {chunks}: GPU tokens differ from the CPU rule"
                    us = benchlib.graph_time_us(run, calls=20)
                    pred = PREDICTED.get((n, name)) if chunks and not flat else None
                    results.append(dict(rows=n, logits="randn" if flat else "model-like", kind=name,
                                        chunks=chunks, us=us, predicted=pred, gbs_per_pass=n * V * 4 / us / 1e3))
                    print(f"N={n:3d} {'randn' if flat else 'model':6s} {name:18s} chunks {str(chunks):4s} "
                          f"{us:8.1f} us (predicted {pred}) {results[-1]['gbs_per_pass']:6.0f} GB/s/pass",
                          flush=True)
    md = benchlib.markdown_table(results)
    print(md)
    if out:
        benchlib.save(out, "bench_sampling", results, {"env": benchlib.env_line(), "vocab": V}, md)
    return results


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,8,256", help="comma-separated batch sizes")
    ap.add_argument("--no-one-cta", action="store_true", help="time the split path only")
    a = ap.parse_args()
    main(a.out, tuple(int(r) for r in a.rows.split(",")), not a.no_one_cta)
