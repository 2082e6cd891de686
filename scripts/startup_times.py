"""How long a fresh process waits for `LLM()` and for its first token, cold and warm, each start in its own process.

    python scripts/startup_times.py --model DIR --device cuda --fresh 5 --warm 3 --out OUT   # the GPU
    python scripts/startup_times.py --device cpu --warm 3 --out OUT                           # the bundled model

A cold start is a process on caches nothing has filled: a fresh kernel cache (NUMBA_CACHE_DIR) and a fresh
pagedattn cache (PAGEDATTN_CACHE_DIR: the kernels-ready markers and the tokenizer's converted file), as on a
bare machine; `--fresh N` runs N of them, each on its own new directories. A warm start runs on the caches
the first cold start left (or, with --fresh 0, on the process's own environment). Times are seconds from
the interpreter's start (the process's start time in /proc, so the interpreter's own start-up counts):

    import     `from pagedattn import LLM, SamplingParams` done
    llm        `LLM(model, device=..., dtype=...)` returned
    first      the first token of one greedy request ("The capital of France is", max_tokens=1; token ids
               for a checkpoint without a tokenizer) returned

and `error_lines`: lines of the child's stderr that report an error or a traceback (a start that recovers
from a failure must print none). One row per start; the table and the JSON go to --out.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, os, sys, time
def since_start():
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
from pagedattn import LLM, SamplingParams
t_import = since_start()
model, device, dtype = sys.argv[1] or None, sys.argv[2], sys.argv[3]
llm = LLM(model, device=device, dtype=dtype)
t_llm = since_start()
prompt = "The capital of France is" if llm.engine.tokenizer is not None else [1, 2, 3]    # (a bare checkpoint)
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t_first = since_start()
print(json.dumps(dict(import_s=t_import, llm_s=t_llm, first_s=t_first, text=out[0].outputs[0].text,
                      phases={k: v for k, v in llm.engine.startup_times.items() if isinstance(v, (int, float))})))
"""

# a traceback, an exception's last line, a log record at level ERROR (not a warning's class path)
ERROR = re.compile(r"^Traceback|^[\w.]*(Error|Exception)\b|\bERROR\b")


def start(model, device, dtype, env, timeout, log=None):
    """One start in a fresh process: its row (times, error lines) or the failure. log: a file for its stderr
    (the start-up logger's lines: phases, the compile's tasks and workers)."""
    p = subprocess.run([sys.executable, "-c", CHILD, model or "", device, dtype], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    if log is not None:
        with open(log, "w") as f:
            f.write(p.stderr)
    errors = [line for line in p.stderr.splitlines() if ERROR.search(line)]
    try:
        row = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        row = dict(failed=f"exit {p.returncode}: {p.stderr.strip()[-500:]}")
    row.update(error_lines=len(errors), first_errors=errors[:3])
    return row


def main(model=None, device="cpu", dtype="auto", fresh=0, warm=3, out="startup_times_out", timeout=900):
    os.makedirs(out, exist_ok=True)
    if model == "random":               # random weights of the Qwen2.5-0.5B config (no tokenizer)
        import torch

        from scripts import benchlib
        model = benchlib.random_checkpoint("0.5b", dtype=torch.float16)
    base = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows, first_env = [], None
    for i in range(fresh):
        env = dict(base, NUMBA_CACHE_DIR=tempfile.mkdtemp(prefix="numba_cache_"),
                   PAGEDATTN_CACHE_DIR=tempfile.mkdtemp(prefix="pagedattn_cache_"))
        first_env = first_env or env
        rows.append(dict(kind="cold", run=i, **start(model, device, dtype, env, timeout,
                                                     os.path.join(out, f"stderr_cold_{i}.log"))))
        print(json.dumps(rows[-1]), flush=True)
    for i in range(warm):
        rows.append(dict(kind="warm", run=i, **start(model, device, dtype, first_env or base, timeout,
                                                     os.path.join(out, f"stderr_warm_{i}.log"))))
        print(json.dumps(rows[-1]), flush=True)
    lines = [f"model {model or 'bundled'}, device {device}, dtype {dtype}; seconds from interpreter start", "",
             "| start | run | import | LLM() | first token | error lines |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['kind']} | {r['run']} | failed: {r['failed'][:80]} | | | {r['error_lines']} |")
            continue
        lines.append(f"| {r['kind']} | {r['run']} | {r['import_s']:.2f} | {r['llm_s']:.2f} | {r['first_s']:.2f} | "
                     f"{r['error_lines']} |")
    for kind in ("cold", "warm"):
        done = [r for r in rows if r["kind"] == kind and "failed" not in r]
        if done:
            lines.append(f"\n{kind}: LLM() median {statistics.median(r['llm_s'] for r in done):.2f} s, max "
                         f"{max(r['llm_s'] for r in done):.2f} s; first token median "
                         f"{statistics.median(r['first_s'] for r in done):.2f} s, max {max(r['first_s'] for r in done):.2f} s")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "startup_times.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "startup_times.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="checkpoint directory, or random (Qwen2.5-0.5B shapes; default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--fresh", type=int, default=0, help="cold starts, each on new cache directories")
    ap.add_argument("--warm", type=int, default=3, help="starts on the first cold start's caches")
    ap.add_argument("--out", default="startup_times_out")
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    main(a.model, a.device, a.dtype, a.fresh, a.warm, a.out, a.timeout)
