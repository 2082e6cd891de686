"""pagedattn against HF transformers `generate` on the CPU: same model (the bundled Qwen2.5-Coder-0.5B-Instruct;
HF on its float32 conversion, pagedattn on what LLM() picks: the GGUF blocks), same machine, same thread
count, greedy, prompts the tests never use. Goals:

  one prompt   chat template, a 100-token answer: pagedattn >= 1.05x HF's tokens/s, same tokens
  mixed batch  8 requests, two of them long (~1000-token prompts: two standard-library modules to explain),
               max_tokens 8-64 each. HF pads every prompt to the longest and runs every row until the
               longest request is done (64 tokens); pagedattn batches them continuously and stops each at
               its own max_tokens. Compared in *useful* tokens/s (each request's own tokens, cut at its
               max_tokens and end of turn): pagedattn >= 5x HF.

The runs alternate (ours, HF, ours, HF, ...) after one warm-up each, so a load change on a shared machine
hits both; the table gives the median of --repeats runs and the ratio of medians (wall clock: the goal), and
the ratio of median CPU seconds (all threads of the process; steadier than wall clock on a busy machine,
exact at --threads 1). Loading is not timed.

    python scripts/bench_cpu.py --out OUT                 # 2 threads, 3 repeats (~10 min on 2 cores)
    python scripts/bench_cpu.py --threads 4 --repeats 5 --out OUT
    python scripts/bench_cpu.py --profile --out OUT       # where a decode step's milliseconds go
    python scripts/bench_cpu.py --decode --repeats 5 --out OUT   # one prompt's decode tok/s: the GGUF
                                                          # blocks (float32 and int8 activations), float32,
                                                          # HF, llama.cpp if it imports
    python scripts/bench_cpu.py --memory --out OUT        # resident memory after LLM() and an answer
    python scripts/bench_cpu.py --weights float32 ...     # the HF comparison on the float32 path (default:
                                                          # LLM()'s own choice, the GGUF blocks on the CPU)

Writes OUT/bench_cpu.json and .md (benchlib.save); --profile writes OUT/profile_cpu.json and .md: per
piece of a decode step (scheduling, packing, each layer's GEMMs, norms, rotary, the attention write and
read, logits, sampling, output processing) the median and minimum milliseconds per step over --steps
steps, with the torch backend (gather + SDPA) and the numba CPU backend, at 1 sequence of ~130 tokens
and 8 of ~1000.
"""
import inspect
import os
import statistics
import sys
import time

DECODE_TOKENS = 64


def decode_ours(llm, prompt, tokens, temperature=0.0):
    """(decode tok/s after the first token, token ids) of one streamed request, greedy or sampled (a fixed
    seed)."""
    from pagedattn import SamplingParams

    stamps, cpu, ids = [], [], []
    params = SamplingParams(temperature=temperature, seed=0 if temperature else None, max_tokens=tokens,
                            ignore_eos=True)
    for out in llm.stream([prompt], params):
        for t in out.outputs[0].delta_token_ids:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            ids.append(t)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), (cpu[-1] - cpu[0]) / (len(cpu) - 1), ids


def decode_hf(hf, prompt, tokens, temperature=0.0):
    """HF generate: (tokens - 1) / (time of `tokens` tokens - time of 1 token), and the token ids."""
    ids = torch.tensor([prompt])
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    kw = dict(attention_mask=torch.ones_like(ids), min_new_tokens=tokens, **sample)
    with torch.no_grad():
        t0, c0, _ = timed(lambda: hf.generate(ids, max_new_tokens=1, **{**kw, "min_new_tokens": 1}))
        t1, c1, seq = timed(lambda: hf.generate(ids, max_new_tokens=tokens, **kw))
    return (tokens - 1) / (t1 - t0), (c1 - c0) / (tokens - 1), seq[0, len(prompt):].tolist()


def decode_llama_cpp(llama, prompt, tokens, temperature=0.0):
    """llama-cpp-python streaming the same prompt's completion: decode tok/s after the first token (sampled:
    plain temperature sampling, no top-k / top-p, as ours)."""
    llama.reset()
    stamps, cpu, ids = [], [], []
    sample = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0) if temperature else dict(temp=0.0, top_k=1)
    for tok in llama.generate(prompt, reset=True, **sample):
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        ids.append(tok)
        if len(ids) == tokens:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), (cpu[-1] - cpu[0]) / (len(cpu) - 1), ids


def first_difference(a, b):
    """'same' when the token lists agree, else the index of the first token where they differ."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None and len(a) == len(b):
        return "same"
    return f"differ from token {i if i is not None else min(len(a), len(b))}"


def layer_modules(llm, run):
    """run() with the model's decoder layers as modules (the fused CPU layers off), as before they existed."""
    from pagedattn.layers.ops import run_layer

    def unfused():
        ops = llm.engine.model.ops
        keep, ops.decoder_layer = ops.decoder_layer, run_layer
        try:
            return run()
        finally:
            ops.decoder_layer = keep
    return unfused


def main_decode(out="bench_cpu_out", threads=2, repeats=5, tokens=DECODE_TOKENS, only=None, temperature=0.0):
    """One chat prompt, greedy, `tokens` tokens: decode tok/s after the first token of the bundled model on
    its GGUF blocks (weights="quantized", the CPU default) with float32 and with int8 activations (the row
    of LLM()'s own choice marked "(default)": int8 where numba's target has AVX2), each with
    the fused CPU layers (the default) and with the layer modules, on the float32 checkpoint, HF generate
    (float32), and llama.cpp on the same GGUF file when llama_cpp imports; the systems alternate within each
    of `repeats` rounds after one warm-up each; the table gives the median, the range, and each system's
    tokens against the float32 model's and llama.cpp's. only: the systems whose names contain one of these
    strings (the float32 model, the tokens' reference, always runs). temperature > 0: sampled decoding
    (each system's own sampler, plain temperature; the token columns then compare random streams)."""
    from transformers import AutoModelForCausalLM

    from pagedattn import LLM
    from pagedattn.bundled import bundled_gguf_path, bundled_model_path
    from pagedattn.config import EngineConfig
    from pagedattn.engine.metrics import model_weight_bytes

    torch.set_num_threads(threads)
    path, gguf = bundled_model_path(), bundled_gguf_path()
    engine_args = dict(device="cpu", max_model_len=1024, max_num_seqs=4, num_blocks=128, enable_prefix_caching=False)
    systems = {}
    quant = LLM(path, weights="quantized", activations="float32", **engine_args)
    int8 = LLM(path, weights="quantized", activations="int8", **engine_args)
    f32 = LLM(path, weights="float32", **engine_args)
    tok = quant.get_tokenizer()
    prompt = chat(tok, ONE_PROMPT)
    def ours(llm):
        return (lambda: decode_ours(llm, prompt, tokens, temperature)), model_weight_bytes(llm.engine.model)

    default = EngineConfig(model=path, **engine_args).with_model_path(path).activations     # what LLM() takes
    systems[f"pagedattn, GGUF blocks, float32 x{' (default)' if default == 'float32' else ''}"] = ours(quant)
    systems[f"pagedattn, GGUF blocks, int8 x{' (default)' if default == 'int8' else ''}"] = ours(int8)
    for name, llm in (("float32 x", quant), ("int8 x", int8)):
        run, size = ours(llm)
        systems[f"pagedattn, GGUF blocks, {name}, layer modules"] = (layer_modules(llm, run), size)
    systems["pagedattn, float32"] = ours(f32)
    if not only or any(o in "HF generate, float32" for o in only):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        systems["HF generate, float32"] = (lambda: decode_hf(hf, prompt, tokens, temperature),
                                           sum(p.numel() * 4 for p in hf.parameters()))
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("llama_cpp does not import: llama.cpp left out (docs/cpu.md says how to build it)")
    llama_name = None
    if llama_cpp is not None:
        llama = llama_cpp.Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
        llama_name = f"llama.cpp {llama_cpp.__version__}"
        systems[llama_name] = (lambda: decode_llama_cpp(llama, prompt, tokens, temperature),
                               os.path.getsize(gguf))
    if only:
        systems = {name: v for name, v in systems.items()
                   if name == "pagedattn, float32" or any(o in name for o in only)}
    print(benchlib.env_line())
    rates, cpus, loads = {name: [] for name in systems}, {name: [] for name in systems}, []
    ids = {}
    for r in range(repeats + 1):                  # round 0: warm-up, not counted
        for name, (run, _) in systems.items():
            rate, cpu, ids[name] = run()
            load = os.getloadavg()[0]
            print(f"  round {r}/{repeats} ({'warm-up' if r == 0 else 'timed'}): {name} {rate:.2f} tok/s, "
                  f"{1e3 * cpu:.0f} CPU ms/token, load average {load:.1f}", flush=True)
            if r:
                rates[name].append(rate)
                cpus[name].append(cpu)
                loads.append(load)
    rows = [{"system": name, "weight bytes": f"{size / 2**20:.0f} MiB",
             "decode tok/s (median)": statistics.median(rates[name]),
             "range": f"{min(rates[name]):.1f}-{max(rates[name]):.1f}",
             "CPU ms/token (median)": 1e3 * statistics.median(cpus[name]),
             "tokens vs float32 model": first_difference(ids[name], ids["pagedattn, float32"]),
             "tokens vs llama.cpp": first_difference(ids[name], ids[llama_name]) if llama_name in ids else "-"}
            for name, (_, size) in systems.items()]
    table = benchlib.markdown_table(rows, list(rows[0]))
    print(table)
    meta = {"threads": threads, "repeats": repeats, "tokens": tokens, "prompt tokens": len(prompt),
            "temperature": temperature,
            "load average after each timed run": loads, "load average at the end": os.getloadavg()}
    print("\n".join(benchlib.save(out, "bench_cpu_decode", rows, meta, table)))
    return rows


_RESIDENT = """
import json, sys, time
import torch
torch.set_num_threads(2)
t = time.perf_counter()
from pagedattn import LLM, SamplingParams
llm = LLM(device="cpu", **json.loads(sys.argv[1]))
load = time.perf_counter() - t
llm.generate([[9707] * 16], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"weights": llm.metrics()["weights"], "model_weight_bytes": llm.metrics()["model_weight_bytes"],
                  "kv_pool_bytes": llm.engine.num_blocks * llm.engine.kv_cache.bytes_per_block,
                  "VmRSS": status["VmRSS"].strip(), "VmHWM": status["VmHWM"].strip(), "import + LLM() s": load}))
"""


def main_memory(out="bench_cpu_out"):
    """Resident memory of a fresh process after LLM() (the bundled model, its defaults on the CPU) and a
    64-token answer, for each weights= setting: VmRSS and its peak VmHWM, the KV pool included."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for kwargs in ({}, {"activations": "float32"}, {"activations": "int8"}, {"weights": "float32"}):
        child = subprocess.run([sys.executable, "-c", _RESIDENT, json.dumps(kwargs)], capture_output=True, text=True,
                               cwd=root, env=dict(os.environ, PYTHONPATH=root))
        if child.returncode:
            raise RuntimeError(child.stderr[-2000:])
        r = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append({"LLM(...)": ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "defaults",
                     "weights": r["weights"], "weight MiB": r["model_weight_bytes"] / 2**20,
                     "KV pool MiB": r["kv_pool_bytes"] / 2**20, "VmRSS": r["VmRSS"], "VmHWM": r["VmHWM"],
                     "import + LLM() s": r["import + LLM() s"]})
        print(rows[-1], flush=True)
    table = benchlib.markdown_table(rows, list(rows[0]))
    print(table)
    print("\n".join(benchlib.save(out, "bench_cpu_memory", rows, {"load average": os.getloadavg()}, table)))
    return rows


if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

ONE_PROMPT = "Write a Python class that implements an LRU cache with get and put methods, with docstrings."
ONE_PROMPT_TOKENS = 100
SHORT_PROMPTS = [
    "What does the Python `with` statement do?",
    "Write a bash one-liner that counts the lines of every .py file in a directory tree.",
    "Name three differences between TCP and UDP.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "What is a race condition?",
    "Write a regular expression that matches an ISO 8601 date.",
]
LONG_MODULES = ("textwrap", "heapq")          # their source, cut to LONG_TOKENS tokens, to explain
LONG_TOKENS = 1000
MIXED_MAX_TOKENS = [64, 8, 48, 16, 64, 32, 24, 40]   # two long prompts first, then the six short ones


def chat(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def long_question(tok, module_name):
    """'Explain this module' over the first LONG_TOKENS tokens of a standard-library module's source."""
    import importlib

    source = inspect.getsource(importlib.import_module(module_name))
    cut = tok.decode(tok.encode(source)[:LONG_TOKENS])
    return f"Explain briefly what this Python module does:\n```python\n{cut}\n```"


def mixed_prompts(tok):
    questions = [long_question(tok, m) for m in LONG_MODULES] + SHORT_PROMPTS
    return [chat(tok, q) for q in questions]


def cut(tokens, max_tokens, eos):
    """A request's useful tokens: at most max_tokens, through the first end-of-turn token."""
    tokens = list(tokens)[:max_tokens]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def timed(fn):
    """(wall seconds, CPU seconds of this process over all its threads, fn())."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - t0, time.process_time() - c0, result


def run_ours(llm, prompts, max_tokens):
    from pagedattn import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    wall, cpu, outs = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return wall, cpu, [o.outputs[0].token_ids for o in outs]


def run_hf(hf, tok, prompts, max_tokens, eos):
    """Left-padded batch through HF generate(do_sample=False) up to max(max_tokens)."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])                    # (B, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        wall, cpu, seqs = timed(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens),
                                                    do_sample=False, pad_token_id=pad))
    return wall, cpu, [cut(row[width:].tolist(), m, eos) for row, m in zip(seqs, max_tokens)]


def compare(name, llm, hf, tok, prompts, max_tokens, eos, repeats, goal, warmup):
    """Alternating timed runs (after a warm-up of each when `warmup`); returns the table row."""
    if warmup:
        run_ours(llm, prompts, max_tokens)
        run_hf(hf, tok, prompts, max_tokens, eos)
    ours, theirs = [], []                         # (wall s, cpu s) per run
    for r in range(repeats):
        *t, ours_tok = run_ours(llm, prompts, max_tokens)
        ours.append(t)
        *t, hf_tok = run_hf(hf, tok, prompts, max_tokens, eos)
        theirs.append(t)
        print(f"  {name} run {r + 1}/{repeats}: pagedattn {ours[-1][0]:.2f} s ({ours[-1][1]:.2f} s CPU), "
              f"HF {theirs[-1][0]:.2f} s ({theirs[-1][1]:.2f} s CPU)", flush=True)
    useful = sum(len(cut(t, m, eos)) for t, m in zip(ours_tok, max_tokens))
    same = sum(cut(a, m, eos) == b for a, b, m in zip(ours_tok, hf_tok, max_tokens))
    ours_s, hf_s = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
    ours_cpu, hf_cpu = statistics.median(c for _, c in ours), statistics.median(c for _, c in theirs)
    return {"workload": name, "requests": len(prompts), "prompt tokens": sum(len(p) for p in prompts),
            "useful tokens": useful, "pagedattn s": ours_s, "HF s": hf_s,
            "pagedattn tok/s": useful / ours_s, "HF useful tok/s": useful / hf_s,
            "speed-up": hf_s / ours_s, "CPU-time speed-up": hf_cpu / ours_cpu, "goal": goal,
            "met": hf_s / ours_s >= goal, "same tokens": f"{same}/{len(prompts)}",
            "pagedattn runs (wall s, cpu s)": ours, "HF runs (wall s, cpu s)": theirs}


class StepProfile:
    """Wall time of each piece of an engine step, summed per step (the wrappers time a method of an
    instance or a module function; a shared object is wrapped once)."""

    def __init__(self):
        self.current, self.steps, self.wrapped = {}, [], set()

    def wrap(self, obj, name, label):
        if (id(obj), name) in self.wrapped:
            return
        self.wrapped.add((id(obj), name))
        fn = getattr(obj, name)

        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[label] = self.current.get(label, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed_call)

    def step(self, engine):
        self.current = {}
        t0 = time.perf_counter()
        engine.step()
        self.current["engine.step (total)"] = time.perf_counter() - t0
        self.steps.append(self.current)

    def rows(self):
        """Per piece: median and minimum milliseconds per step (the minimum: the step least disturbed
        by other processes, a quiet machine's figure)."""
        labels = list(dict.fromkeys(k for st in self.steps for k in st))
        return [{"piece": k, "median ms": 1e3 * statistics.median(st.get(k, 0.0) for st in self.steps),
                 "min ms": 1e3 * min(st.get(k, 0.0) for st in self.steps)} for k in labels]


def profile_decode(llm, num_seqs, context_len, steps=30):
    """Decode steps of num_seqs sequences at about context_len tokens each, timed piece by piece (through the
    layer modules: the fused CPU layers are switched off in `llm`)."""
    import pagedattn.engine.llm_engine as llm_engine
    import pagedattn.engine.model_runner as model_runner
    from pagedattn import SamplingParams

    engine, prof = llm.engine, StepProfile()
    model = engine.model
    from pagedattn.layers.ops import run_layer

    model.ops.decoder_layer = run_layer     # the layer modules: one call a layer has no separate pieces to time
    prof.wrap(engine.scheduler, "schedule", "schedule")
    prof.wrap(llm_engine, "build_step_inputs", "build_step_inputs (pack the step)")
    prof.wrap(engine, "_process", "process outputs (append, stop checks, detokenize)")
    prof.wrap(model, "forward", "model.forward")
    prof.wrap(model, "compute_logits", "lm_head (logits of the sampling rows)")
    prof.wrap(model_runner.sampler, "sample", "sampler")
    prof.wrap(model.ops, "rotary_and_cache_write", "  rotary + K/V write")
    prof.wrap(model.ops, "attention", "  attention")
    for layer in model.model.layers:
        prof.wrap(layer.input_layernorm, "forward", "  RMSNorm x2 (+ residual add)")
        prof.wrap(layer.post_attention_layernorm, "forward", "  RMSNorm x2 (+ residual add)")
        prof.wrap(layer.self_attn.qkv_proj, "forward", "  qkv_proj GEMM")
        prof.wrap(layer.self_attn.o_proj, "forward", "  o_proj GEMM")
        prof.wrap(layer.mlp, "forward", "  MLP (gate_up GEMM, SiLU*mul, down GEMM)")
    words = [1000 + i for i in range(context_len + 8 * num_seqs)]
    for i in range(num_seqs):
        engine.add_request(f"profile-{i}", words[8 * i: 8 * i + context_len],
                           SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(3):                           # the prefill, then two warm decode steps
        engine.step()
    prof.steps.clear()
    for _ in range(steps):
        prof.step(engine)
    while engine.has_unfinished_requests():
        engine.step()
    rows = prof.rows()
    for r in rows:
        r.update(backend=getattr(model.attn_backend, "name", str(model.attn_backend)), seqs=num_seqs, context=context_len)
    return rows


def main_profile(out="bench_cpu_out", threads=2, model=None, steps=30):
    """--profile: the decode-step breakdown, the torch backend against the numba CPU backend, at one
    sequence of ~130 tokens and at eight of ~1000."""
    from pagedattn import LLM
    from pagedattn.bundled import bundled_model_path

    torch.set_num_threads(threads)
    path = model or bundled_model_path()
    print(benchlib.env_line())
    rows = []
    for backend in ("torch", "cpu"):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=2048, max_num_seqs=16, num_blocks=640,
                  enable_prefix_caching=False, attn_backend=backend)
        for num_seqs, context in ((1, 130), (8, 1000)):
            rows += profile_decode(llm, num_seqs, context, steps)
        llm.close()
        del llm
    table = benchlib.markdown_table(rows, ["backend", "seqs", "context", "piece", "median ms", "min ms"],
                                    floatfmt="{:.2f}")
    print(table)
    meta = {"threads": threads, "steps": steps, "model": path, "dtype": "float32"}
    print("\n".join(benchlib.save(out, "profile_cpu", rows, meta, table)))
    return rows


def main(out="bench_cpu_out", threads=2, repeats=3, model=None, weights="auto"):
    from transformers import AutoModelForCausalLM

    from pagedattn import LLM
    from pagedattn.bundled import bundled_model_path

    torch.set_num_threads(threads)
    path = model or bundled_model_path()
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=2048, max_num_seqs=16, num_blocks=512,
              enable_prefix_caching=False, weights=weights)      # the runs repeat the same prompts
    backend = llm.engine.model.attn_backend
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = set(llm.engine.eos_token_ids)
    print(benchlib.env_line())
    print(f"pagedattn weights: {llm.engine.config.weights}; attention backend: {getattr(backend, 'name', backend)}; "
          f"HF attention: "
          f"{hf.config._attn_implementation}")

    one = [chat(tok, ONE_PROMPT)]
    rows = [compare("one prompt", llm, hf, tok, one, [ONE_PROMPT_TOKENS], eos, repeats, 1.05, warmup=True)]
    rows.append(compare("mixed batch of 8", llm, hf, tok, mixed_prompts(tok), MIXED_MAX_TOKENS, eos, repeats, 5.0,
                        warmup=False))           # both are warm from the first workload
    columns = ["workload", "requests", "prompt tokens", "useful tokens", "pagedattn s", "HF s", "pagedattn tok/s",
               "HF useful tok/s", "speed-up", "CPU-time speed-up", "goal", "met", "same tokens"]
    table = benchlib.markdown_table(rows, columns)
    print(table)
    meta = {"threads": threads, "repeats": repeats, "model": path, "dtype": "float32", "greedy": True,
            "weights": llm.engine.config.weights, "load average": os.getloadavg(),
            "attention backend": getattr(backend, "name", str(backend)),
            "mixed max_tokens": MIXED_MAX_TOKENS, "long prompts": [f"{m} source, {LONG_TOKENS} tokens"
                                                                   for m in LONG_MODULES]}
    print("\n".join(benchlib.save(out, "bench_cpu", rows, meta, table)))
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_cpu_out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="HF Qwen2 directory with a tokenizer (default: the bundled model)")
    ap.add_argument("--profile", action="store_true", help="the decode-step breakdown instead of the HF comparison")
    ap.add_argument("--steps", type=int, default=30, help="--profile: decode steps timed per case")
    ap.add_argument("--decode", action="store_true",
                    help="one prompt's decode tok/s: GGUF blocks (float32 and int8 activations), float32, HF, "
                         "llama.cpp (when llama_cpp imports)")
    ap.add_argument("--only", default=None, help="--decode: comma-separated pieces of the names of the systems to "
                                                 "run (e.g. 'GGUF blocks,llama.cpp')")
    ap.add_argument("--temperature", type=float, default=0.0, help="--decode: sample at this temperature "
                                                                   "(default 0: greedy)")
    ap.add_argument("--memory", action="store_true", help="resident memory after LLM() and a 64-token answer")
    ap.add_argument("--weights", default="auto", help="the HF comparison's LLM(weights=...): auto (the GGUF blocks on "
                                                      "the CPU), quantized or float32")
    a = ap.parse_args()
    if a.memory:
        main_memory(a.out)
    elif a.profile:
        main_profile(a.out, a.threads, a.model, a.steps)
    elif a.decode:
        main_decode(a.out, a.threads, a.repeats, only=a.only.split(",") if a.only else None,
                    temperature=a.temperature)
    else:
        main(a.out, a.threads, a.repeats, a.model, a.weights)
