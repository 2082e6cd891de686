"""Does cuBLAS give a row the same bits at every row count when it has no workspace (so cannot split K)?

cuBLAS chooses a product's algorithm by its shape; where it splits K over CTAs (small M, large K: the 0.5B
model's `down`) a row's bits change with the number of rows beside it. Split-K needs a workspace, and torch
sizes cuBLAS's workspace once per process from CUBLAS_WORKSPACE_CONFIG and cuBLASLt's from
CUBLASLT_WORKSPACE_SIZE. Each setting runs in its own process: for the 0.5B model's shapes, fp16 and bf16,
at how many row counts M a row's bits differ from the same row in an 8,192-row product (1,024 for the LM
head), and microseconds per product (CUDA-graph replay).

    python scripts/probe_no_split_k.py --out OUT
"""
import json
import os
import subprocess
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"default": {}, "no workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
            "16 KiB": {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "16"}}
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 151936)}
ROW_COUNTS = list(range(1, 300)) + [384, 511, 512, 1000, 2048, 4096, 8192]
TIMED_M = (1, 16, 128, 256, 1024, 8192)


def child(setting):
    import torch
    import torch.nn.functional as F

    from scripts import benchlib

    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for name, (k, n) in SHAPES.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(n, k, generator=g, device="cuda", dtype=dtype) / k ** 0.5
            b = torch.randn(n, generator=g, device="cuda", dtype=dtype) if name == "qkv" else None
            top = 1024 if name == "lm_head" else 8192
            x = torch.randn(top, k, generator=g, device="cuda", dtype=dtype)
            full = F.linear(x, w, b)
            differ = [m for m in ROW_COUNTS if m <= top and not torch.equal(F.linear(x[:m], w, b), full[:m])]
            row = dict(setting=setting, dtype=str(dtype).replace("torch.", ""), shape=name,
                       M_differing=f"{len(differ)}/{sum(m <= top for m in ROW_COUNTS)} {differ[:8]}")
            for m in TIMED_M:
                if m <= top:
                    row[f"us M={m}"] = round(benchlib.graph_time_us(lambda: F.linear(x[:m], w, b), calls=10,
                                                                    replays=5), 2)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    print(json.dumps(rows))


def main(out):
    from scripts import benchlib

    rows = []
    for setting, env in SETTINGS.items():
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", setting],
                             env={**os.environ, **env}, stdout=subprocess.PIPE, text=True, check=True)
        rows += json.loads(res.stdout.strip().splitlines()[-1])
    md = benchlib.markdown_table(rows)
    benchlib.save(out, "probe_no_split_k", rows, dict(env=benchlib.env_line(), settings=SETTINGS), md)
    print(md)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_no_split_k_out")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    child(a.child) if a.child else main(a.out)
