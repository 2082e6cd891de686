"""End-to-end throughput: the engine vs HF transformers, in one run.

GPU mode (one call on the H200; random weights of the real Qwen2-0.5B config in fp16, which is
exactly as fast as the real checkpoint, since that one cannot travel):
  * the nano-vllm workload: 256 requests, prompt lengths uniform in [100, 1024], output lengths
    uniform in [100, 1024], random token ids in [0, 10000], ignore_eos, seed 0, greedy decoding;
    the engine (CUDA graphs) on all of it, HF `generate_batch` (continuous batching, paged cache)
    on the first --hf-requests requests with one max_new_tokens (the mean of their output lengths);
    tokens/s compared;
  * batch-1 decode: prompt 512, 256 new tokens, the engine vs HF `generate` (fewer new tokens for HF
    if --hf-batch1-tokens says so; tokens/s compared);
  * output tokens/s, TTFT and per-request mean ITL percentiles, peak KV usage, preemptions;
    JSON + markdown + a PNG under --out.
CPU mode: the bundled real model on this machine, the engine vs HF `generate` (batched, left
padding) on the same 8 prompts, greedy, float32.
TP mode (2 GPUs): the same random checkpoint and nano-vllm workload (--num-requests of it) at
tensor_parallel_size 1 and 2 in one run. TP runs eagerly (the CUDA-graph decode path is
single-rank), so TP=1 is measured eagerly too (like with like) and, for reference, with graphs;
output tokens/s side by side, and the greedy token ids of TP=2 against TP=1-eager (fp16: the
all-reduce sums in another order, so a near-tie may flip; the first divergence is reported).

Every phase runs under a time limit (a phase that overruns stops and says so), so one call ends
inside the device's per-call limit.

    python scripts/bench_throughput.py --out bench_out                 # GPU
    python scripts/bench_throughput.py --mode cpu --out bench_cpu      # CPU, bundled model
    python scripts/bench_throughput.py --mode tp --num-requests 128 --out bench_tp   # 2 GPUs
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Qwen2.5-0.5B / Qwen2.5-Coder-0.5B (the bundled model's config.json).
QWEN2_05B_CONFIG = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu",
    bos_token_id=151643, eos_token_id=151645, use_sliding_window=False,
)
RANDOM_CKPT_DIR = os.environ.get("PAGEDATTN_RANDOM_CKPT", "/tmp/pagedattn_qwen2_05b_random")


def make_random_hf_model(seed=0, device="cpu", dtype=torch.float16, **overrides):
    """transformers.Qwen2ForCausalLM with the real 0.5B config and reproducible random weights.

    Projections ~ N(0, 1/fan_in) (unit-variance activations through every layer), norms ~ 1 + 0.1 N,
    biases 0.1 N, lm_head 4x larger (logits with std ~4, so the top-1 margins are well above fp16
    noise, as a trained model's are). Built in float32 from one CPU generator, then cast.
    """
    import transformers

    config = transformers.Qwen2Config(**{**QWEN2_05B_CONFIG, **overrides})
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif name == "lm_head.weight":
                p.copy_(4 * r / p.shape[-1] ** 0.5)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)
    return model.to(dtype).eval()


def write_random_checkpoint(path=RANDOM_CKPT_DIR, seed=0, device=None):
    """Save the random fp16 model (safetensors) to `path` once; later calls reuse it. Returns path."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = make_random_hf_model(seed, device)
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    del model
    return path


def nano_vllm_workload(num_requests=256, min_len=100, max_len=1024, seed=0):
    """(prompts, output lengths) as nano-vllm's bench.py draws them (random.seed(0), ids in [0, 10000])."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, out_lens


def pct(xs, qs=(50, 90, 99)):
    if not xs:
        return {}
    xs = sorted(xs)
    return {f"p{q}": xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] for q in qs}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- the engine ---------------------------------------------------------------------------------
def make_llm(ckpt, device, **kw):
    from pagedattn import LLM
    return LLM(ckpt, device=device, **kw)


def run_engine(llm, prompts, out_lens, time_limit):
    """Drive the engine's step loop with a deadline; per-request TTFT/ITL from its metrics."""
    from pagedattn import SamplingParams

    engine = llm.engine
    ids = []
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        rid = f"bench-{i}-{t0}"
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           prompt_token_ids=p, arrival_time=t0)
        ids.append(rid)
    outs, kv_peak, timed_out = {}, 0.0, False
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        kv_peak = max(kv_peak, engine.block_manager.utilization)
        if time.perf_counter() - t0 > time_limit:
            timed_out = True
            break
    sync()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs.values())
    if timed_out:       # count the tokens of the unfinished ones too, then clean up
        for g in list(engine.groups.values()):
            generated += sum(s.num_output_tokens for s in g.seqs)
        for rid in ids:
            if rid not in outs:
                engine.abort_request(rid)
    ttft = [o.metrics.ttft for o in outs.values() if o.metrics and o.metrics.ttft is not None]
    itl = [o.metrics.mean_itl for o in outs.values() if o.metrics and o.metrics.mean_itl is not None]
    m = llm.metrics()
    return {
        "requests": len(prompts), "finished": len(outs), "timed_out": timed_out, "seconds": elapsed,
        "output_tokens": generated, "output_tok_s": generated / elapsed,
        "prompt_tokens": sum(map(len, prompts)),
        "ttft_s": pct(ttft), "itl_s": pct(itl), "peak_kv_usage": kv_peak,
        "num_preemptions": m["num_preemptions"], "num_blocks": m["num_blocks"],
        "ttfts": ttft, "outputs": {rid: outs[rid].outputs[0].token_ids for rid in ids if rid in outs},
        "ids": ids,
    }


# ---- HF -----------------------------------------------------------------------------------------
def load_hf(ckpt, device, dtype, attn="sdpa"):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def run_hf_generate_batch(model, prompts, max_new_tokens):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    sync()
    elapsed = time.perf_counter() - t0
    generated = sum(len(r.generated_tokens) for r in res.values())
    return {"requests": len(prompts), "max_new_tokens": max_new_tokens, "seconds": elapsed,
            "output_tokens": generated, "output_tok_s": generated / elapsed}


def run_hf_generate(model, prompt_ids, new_tokens, device):
    ids = torch.tensor([prompt_ids], device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})     # warm-up
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    sync()
    elapsed = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    return {"new_tokens": n, "seconds": elapsed, "tok_s": n / elapsed, "tokens": out[0, ids.shape[1]:].tolist()}


# ---- report -------------------------------------------------------------------------------------
def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    w = res.get("workload", {})
    names, vals = [], []
    for key, label in (("engine", "pagedattn"), ("hf_generate_batch", "HF generate_batch")):
        if key in w and "output_tok_s" in w[key]:
            names.append(label)
            vals.append(w[key]["output_tok_s"])
    ax[0].bar(names, vals, color=["tab:blue", "tab:gray"][:len(vals)])
    ax[0].axhline(20000, color="red", ls="--", lw=1, label="goal 20,000")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("output tokens/s")
    ax[0].set_title("256-request workload")
    ax[0].legend()
    b = res.get("batch1", {})
    names, vals = [], []
    for key, label in (("engine", "pagedattn"), ("engine_eager", "pagedattn eager"), ("hf_generate", "HF generate")):
        if key in b and "tok_s" in b[key]:
            names.append(label)
            vals.append(b[key]["tok_s"])
    ax[1].bar(names, vals, color=["tab:blue", "tab:cyan", "tab:gray"][:len(vals)])
    ax[1].axhline(300, color="red", ls="--", lw=1, label="goal 300")
    ax[1].set_ylabel("tokens/s")
    ax[1].set_title("batch 1 decode (prompt 512)")
    ax[1].legend()
    ttfts = sorted(w.get("engine", {}).get("ttfts", []))
    if ttfts:
        ax[2].plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))])
        ax[2].set_xlabel("TTFT (s), all requests arrive at t=0")
        ax[2].set_ylabel("fraction of requests")
        ax[2].set_title("pagedattn TTFT CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def markdown(res):
    lines = [f"# Throughput benchmark ({res['mode']})", "", f"- {res['env']}", ""]
    w = res.get("workload")
    if w:
        e, h = w.get("engine", {}), w.get("hf_generate_batch", {})
        lines += ["## Workload (nano-vllm: 256 requests, prompts/outputs uniform in [100, 1024], greedy, ignore_eos)",
                  "", "| system | requests | output tokens | seconds | output tok/s |", "|---|---|---|---|---|"]
        for label, r in (("pagedattn", e), ("HF generate_batch", h)):
            if "output_tok_s" in r:
                lines.append(f"| {label} | {r['requests']} | {r['output_tokens']:,} | {r['seconds']:.1f} | "
                             f"{r['output_tok_s']:,.0f} |")
            elif r:
                lines.append(f"| {label} | {r} | | | |")
        if "output_tok_s" in e:
            lines += ["", f"- TTFT (s): {fmt(e['ttft_s'])}; per-request mean ITL (s): {fmt(e['itl_s'])}",
                      f"- peak KV usage {100 * e['peak_kv_usage']:.1f}% of {e['num_blocks']} blocks; "
                      f"preemptions {e['num_preemptions']}; timed out: {e['timed_out']}"]
        if "ratio_vs_hf" in w:
            lines.append(f"- ratio vs HF generate_batch: {w['ratio_vs_hf']:.1f}x (goal >= 20x); "
                         f"output tok/s {e.get('output_tok_s', 0):,.0f} (goal >= 20,000)")
    b = res.get("batch1")
    if b:
        lines += ["", "## Batch 1 decode (prompt 512)", "", "| system | new tokens | tok/s |", "|---|---|---|"]
        for key, label in (("engine", "pagedattn (CUDA graphs)"), ("engine_eager", "pagedattn (eager)"),
                           ("hf_generate", "HF generate")):
            r = b.get(key)
            if r and "tok_s" in r:
                lines.append(f"| {label} | {r['new_tokens']} | {r['tok_s']:,.1f} |")
            elif r:
                lines.append(f"| {label} | {r} | |")
    c = res.get("cpu")
    if c:
        lines += ["", "## CPU: the bundled model, 8 prompts, greedy, float32", "",
                  "| system | new tokens | seconds | tok/s |", "|---|---|---|---|"]
        for key, label in (("engine", "pagedattn"), ("hf_generate", "HF generate (batched, left padding)")):
            r = c[key]
            lines.append(f"| {label} | {r['new_tokens']} | {r['seconds']:.2f} | {r['tok_s']:.1f} |")
        lines.append(f"- same greedy tokens as HF on {c['matching_prompts']} of 8 prompts")
    if res.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def fmt(d):
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items()) if d else "-"


def env_line(device):
    import transformers
    import numba
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"numba {numba.__version__}, device {device}")


def save(res, out):
    os.makedirs(out, exist_ok=True)
    slim = json.loads(json.dumps(res, default=str))
    for part in (slim.get("workload") or {}).values():
        if isinstance(part, dict):
            part.pop("outputs", None)
            part.pop("ids", None)
    with open(os.path.join(out, "bench_throughput.json"), "w") as f:
        json.dump(slim, f, indent=1)
    with open(os.path.join(out, "bench_throughput.md"), "w") as f:
        f.write(markdown(res))
    plot(res, os.path.join(out, "bench_throughput.png"))


# ---- modes --------------------------------------------------------------------------------------
def gpu_mode(out, num_requests, hf_requests, hf_max_new, workload_limit, batch1_tokens, hf_batch1_tokens,
             max_num_seqs, max_model_len, skip_hf):
    device = "cuda"
    res = {"mode": "gpu", "env": env_line(device), "errors": {}}
    t = time.perf_counter()
    ckpt = write_random_checkpoint()
    res["checkpoint_seconds"] = time.perf_counter() - t
    prompts, out_lens = nano_vllm_workload(num_requests)
    res["workload"] = {}
    llm = make_llm(ckpt, device, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    t = time.perf_counter()
    llm.engine.runner.capture_graphs()
    res["graph_capture_seconds"] = time.perf_counter() - t
    print(f"graphs captured in {res['graph_capture_seconds']:.1f}s", flush=True)
    # warm-up: a few short requests (compiles the prefill kernels)
    run_engine(llm, prompts[:4], [8] * 4, 60)
    try:
        e = run_engine(llm, prompts, out_lens, workload_limit)
        res["workload"]["engine"] = e
        print(f"engine: {e['output_tok_s']:,.0f} output tok/s, {e['finished']}/{e['requests']} finished "
              f"in {e['seconds']:.1f}s, preemptions {e['num_preemptions']}", flush=True)
    except Exception as ex:                                      # noqa: BLE001
        res["errors"]["engine_workload"] = repr(ex)
    save(res, out)
    # batch 1
    res["batch1"] = {}
    rng = random.Random(1)
    p512 = [rng.randint(0, 10000) for _ in range(512)]
    for key, eager in (("engine", False), ("engine_eager", True)):
        try:
            target = llm if not eager else make_llm(ckpt, device, max_num_seqs=8, max_model_len=2048,
                                                    enforce_eager=True, num_blocks=1024)
            run_engine(target, [p512], [4], 60)
            r = run_engine(target, [p512], [batch1_tokens], 120)
            toks = next(iter(r["outputs"].values()))
            # decode rate: tokens after the first over the time after the first token
            dec_time = r["seconds"] - r["ttft_s"]["p50"]
            res["batch1"][key] = {"new_tokens": len(toks), "seconds": r["seconds"], "ttft_s": r["ttft_s"]["p50"],
                                  "tok_s": (len(toks) - 1) / dec_time, "tokens": toks}
            print(f"batch1 {key}: {res['batch1'][key]['tok_s']:.1f} tok/s", flush=True)
            if eager:
                del target
        except Exception as ex:                                  # noqa: BLE001
            res["errors"][f"batch1_{key}"] = repr(ex)
    if "engine" in res["batch1"] and "engine_eager" in res["batch1"]:
        res["batch1"]["graph_equals_eager"] = res["batch1"]["engine"]["tokens"] == res["batch1"]["engine_eager"]["tokens"]
    del llm
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    save(res, out)
    if skip_hf:
        return res
    try:
        hf = load_hf(ckpt, device, torch.float16)
        r = run_hf_generate(hf, p512, hf_batch1_tokens, device)
        res["batch1"]["hf_generate"] = r
        ours = res["batch1"].get("engine", {}).get("tokens", [])
        res["batch1"]["hf_same_tokens_prefix"] = next((i for i, (a, b) in enumerate(zip(ours, r["tokens"])) if a != b),
                                                      min(len(ours), len(r["tokens"])))
        print(f"batch1 HF generate: {r['tok_s']:.1f} tok/s", flush=True)
        save(res, out)
        sub_p, sub_o = prompts[:hf_requests], out_lens[:hf_requests]
        max_new = min(hf_max_new, int(statistics.mean(sub_o)))
        h = run_hf_generate_batch(hf, sub_p, max_new)
        res["workload"]["hf_generate_batch"] = h
        print(f"HF generate_batch: {h['output_tok_s']:,.0f} output tok/s on {h['requests']} requests", flush=True)
        if "engine" in res["workload"]:
            res["workload"]["ratio_vs_hf"] = res["workload"]["engine"]["output_tok_s"] / h["output_tok_s"]
    except Exception as ex:                                      # noqa: BLE001
        res["errors"]["hf"] = repr(ex)
    save(res, out)
    return res


def first_divergence(a, b):
    """Index of the first differing token of two id lists (len of the shorter if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tp_mode(out, num_requests, workload_limit, max_num_seqs, max_model_len, ckpt=None, device="cuda", tp=2,
            workload=None):
    """Throughput at tensor_parallel_size 1 and `tp`, one run; see the module docstring."""
    res = {"mode": "tp", "env": env_line(device), "errors": {}, "tp": {}, "tp_size": tp}
    ckpt = ckpt or write_random_checkpoint()
    prompts, out_lens = workload or nano_vllm_workload(num_requests)
    runs = [("tp1_graphs", 1, False), ("tp1_eager", 1, True), (f"tp{tp}_eager", tp, True)]
    outputs = {}
    for key, size, eager in runs:
        if size == 1 and not eager and device != "cuda":
            continue                                             # graphs: CUDA only
        llm = None
        try:
            llm = make_llm(ckpt, device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           enforce_eager=eager, tensor_parallel_size=size)
            run_engine(llm, prompts[:4], [8] * 4, 120)          # warm-up: compiles the kernels
            r = run_engine(llm, prompts, out_lens, workload_limit)
            outputs[key] = [r["outputs"].get(rid) for rid in r["ids"]]
            res["tp"][key] = {k: r[k] for k in ("requests", "finished", "timed_out", "seconds", "output_tokens",
                                                "output_tok_s", "num_preemptions", "num_blocks")}
            print(f"{key}: {r['output_tok_s']:,.0f} output tok/s, {r['finished']}/{r['requests']} finished "
                  f"in {r['seconds']:.1f}s", flush=True)
        except Exception as ex:                                  # noqa: BLE001
            res["errors"][key] = repr(ex)
        finally:
            if llm is not None:
                llm.close()
            del llm
            if device == "cuda":
                torch.cuda.empty_cache()
        save_tp(res, out)
    base, other = outputs.get("tp1_eager"), outputs.get(f"tp{tp}_eager")
    if base and other:
        pairs = [(a, b) for a, b in zip(base, other) if a is not None and b is not None]
        div = [first_divergence(a, b) for a, b in pairs]
        res["greedy"] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs),
                         "first_divergence": sorted(d for d, (a, b) in zip(div, pairs) if a != b)}
        e1, e2 = res["tp"]["tp1_eager"], res["tp"][f"tp{tp}_eager"]
        res["speedup_eager"] = e2["output_tok_s"] / e1["output_tok_s"]
    save_tp(res, out)
    return res


def tp_markdown(res):
    lines = [res["env"], "", "| run | output tok/s | finished | seconds | preemptions |", "|---|---|---|---|---|"]
    for key, r in res["tp"].items():
        lines.append(f"| {key} | {r['output_tok_s']:,.0f} | {r['finished']}/{r['requests']} | {r['seconds']:.1f} | "
                     f"{r['num_preemptions']} |")
    if "speedup_eager" in res:
        g = res["greedy"]
        lines += ["", f"TP={res['tp_size']} / TP=1 (both eager): "
                      f"{res['speedup_eager']:.2f}x. Greedy ids identical for {g['identical']} of {g['compared']} "
                      f"requests; first divergences at tokens {g['first_divergence'][:20]}"]
    if res["errors"]:
        lines += ["", "Errors: " + json.dumps(res["errors"])]
    return "\n".join(lines) + "\n"


def save_tp(res, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_tp.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(out, "bench_tp.md"), "w") as f:
        f.write(tp_markdown(res))


CPU_PROMPTS = [
    "def fibonacci(n):", "# Sort a list of numbers in Python\n", "class Stack:\n    def __init__(self):",
    "import numpy as np\n\ndef softmax(x):", "SELECT name FROM users WHERE", "def is_prime(n):\n    \"\"\"",
    "// Reverse a string in JavaScript\nfunction reverse(s) {", "def quicksort(arr):",
]


def cpu_mode(out, new_tokens):
    from pagedattn.bundled import bundled_model_path
    torch.manual_seed(0)
    path = bundled_model_path()
    res = {"mode": "cpu", "env": env_line("cpu"), "errors": {}}
    from pagedattn import SamplingParams
    llm = make_llm(path, "cpu", dtype=torch.float32, max_num_seqs=8, max_model_len=1024)
    tok = llm.get_tokenizer()
    ids = [tok(p)["input_ids"] for p in CPU_PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(ids[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)        # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(ids, sp, use_tqdm=False)
    te = time.perf_counter() - t0
    ours = [o.outputs[0].token_ids for o in outs]
    hf = load_hf(path, "cpu", torch.float32)
    tok.padding_side = "left"
    batch = tok(CPU_PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    hf.generate(**tok(CPU_PROMPTS[:2], return_tensors="pt", padding=True), **{**kw, "max_new_tokens": 2,
                                                                              "min_new_tokens": 2})
    t0 = time.perf_counter()
    g = hf.generate(**batch, **kw)
    th = time.perf_counter() - t0
    theirs = g[:, batch["input_ids"].shape[1]:].tolist()
    n = sum(map(len, ours))
    res["cpu"] = {"engine": {"new_tokens": n, "seconds": te, "tok_s": n / te},
                  "hf_generate": {"new_tokens": len(theirs) * new_tokens, "seconds": th,
                                  "tok_s": len(theirs) * new_tokens / th},
                  "matching_prompts": sum(a == b for a, b in zip(ours, theirs)),
                  "threads": torch.get_num_threads()}
    res["cpu"]["speedup"] = res["cpu"]["engine"]["tok_s"] / res["cpu"]["hf_generate"]["tok_s"]
    save(res, out)
    print(markdown(res))
    return res


def main(mode="gpu", out="bench_out", num_requests=256, hf_requests=64, hf_max_new=512, workload_limit=150.0,
         batch1_tokens=256, hf_batch1_tokens=64, max_num_seqs=256, max_model_len=2048, skip_hf=False,
         cpu_new_tokens=32):
    if mode == "cpu":
        return cpu_mode(out, cpu_new_tokens)
    if mode == "tp":
        return tp_mode(out, num_requests, workload_limit, max_num_seqs, max_model_len)
    return gpu_mode(out, num_requests, hf_requests, hf_max_new, workload_limit, batch1_tokens, hf_batch1_tokens,
                    max_num_seqs, max_model_len, skip_hf)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gpu", "cpu", "tp"), default="gpu")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--hf-max-new", type=int, default=512)
    ap.add_argument("--workload-limit", type=float, default=150.0, help="seconds for the engine's workload run")
    ap.add_argument("--batch1-tokens", type=int, default=256)
    ap.add_argument("--hf-batch1-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cpu-new-tokens", type=int, default=32)
    a = ap.parse_args()
    main(a.mode, a.out, a.num_requests, a.hf_requests, a.hf_max_new, a.workload_limit, a.batch1_tokens,
         a.hf_batch1_tokens, a.max_num_seqs, a.max_model_len, a.skip_hf, a.cpu_new_tokens)
