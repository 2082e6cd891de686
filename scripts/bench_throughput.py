"""End-to-end throughput of the engine: the nano-vllm workload and batch 1, greedy and sampled;
tensor parallelism; the HF transformers baseline. One call per mode; every run has a time limit.

Model: random weights of the real Qwen2.5-0.5B config in fp16 (as fast as the real checkpoint;
scripts/benchlib.py `random_checkpoint`, generated once into a cache directory), or --model DIR.

--mode workload (default; one GPU):
  * the nano-vllm workload: 256 requests, prompt lengths uniform in [100, 1024] with token ids in
    [0, 10000], output lengths uniform in [100, 1024], ignore_eos, seed 0 — run greedy, sampled
    (temperature 0.8, top_p 0.95) with a seed per request and unseeded, and with the default
    SamplingParams() (temperature 1.0): output tok/s each and its ratio to greedy;
  * batch 1: one request, 512 prompt + 256 output tokens, greedy and sampled: decode tok/s
    ((tokens - 1) / (seconds after the first token)).
--mode tp (two GPUs): TP=1 and TP=2, with CUDA graphs and eagerly, on --config 0.5b or 7b: batch-1
  decode tok/s and the workload's (--num-requests of it) output tok/s; the greedy token ids of TP=2
  against TP=1 (requests identical, first divergence positions).
--mode hf: HF transformers on the same requests (batch 1 with `generate`, greedy and sampled; the
  first --hf-requests workload requests with `generate_batch`, greedy); beside the engine's numbers
  when --out holds a workload run's bench_throughput.json.

Prefix caching is off (the runs repeat the same prompts). Every mode prints one table last and
writes <name>.json / .md (and a PNG) under --out.

    python scripts/bench_throughput.py --out OUT                              # workload, one H200
    python scripts/bench_throughput.py --mode hf --out OUT                    # after the workload run
    python scripts/bench_throughput.py --mode tp --config 0.5b --out OUT      # two H200s
    python scripts/bench_throughput.py --mode tp --config 7b --num-requests 64 --runs tp1_graphs,tp2_graphs --out OUT
"""
import gc
import json
import os
import random
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

SAMPLED = dict(temperature=0.8, top_p=0.95)
PARAM_KINDS = ("greedy", "sampled seeded", "sampled unseeded", "default params")
BATCH1_KINDS = ("greedy", "sampled seeded", "sampled unseeded")
BATCH1 = (512, 256)                 # prompt tokens, output tokens


def sampling_params(kind, max_tokens, index):
    """The SamplingParams of request `index` for a kind of PARAM_KINDS (ignore_eos, max_tokens)."""
    from pagedattn import SamplingParams

    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == "sampled seeded":
        return SamplingParams(**SAMPLED, seed=index, max_tokens=max_tokens, ignore_eos=True)
    if kind == "sampled unseeded":
        return SamplingParams(**SAMPLED, max_tokens=max_tokens, ignore_eos=True)
    if kind == "default params":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    raise ValueError(f"unknown sampling kind {kind!r}: one of {PARAM_KINDS}")


def batch1_request(max_model_len, vocab_size, lens=BATCH1, seed=1):
    """The batch-1 prompt (token ids in [0, 10000], or the vocabulary if smaller) and output length,
    both scaled down to fit max_model_len if they do not."""
    prompt_len, out_len = lens
    if prompt_len + out_len > max_model_len:
        scale = max_model_len / (prompt_len + out_len)
        prompt_len, out_len = max(1, int(prompt_len * scale)), max(2, int(out_len * scale) - 1)
    rng = random.Random(seed)
    return [rng.randint(0, min(10000, vocab_size - 1)) for _ in range(prompt_len)], out_len


def vocab_size(ckpt):
    from pagedattn.models.loader import read_config

    return read_config(ckpt).vocab_size


# ---- the engine -----------------------------------------------------------------------------------
def run_requests(llm, prompts, params, time_limit, tag):
    """Add every request at once, step the engine until all finish or `time_limit` seconds pass
    (the rest are aborted), and measure.

    prompts: token-id lists; params: one SamplingParams per prompt. Returns a dict: requests,
    finished, timed_out, seconds, output_tokens (every generated token, unfinished requests
    included), output_tok_s, ttft_s / itl_s percentiles (finished requests), preemptions, and
    token_ids (one list per request, None for an unfinished one).
    """
    engine = llm.engine
    before = llm.metrics()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    watch = benchlib.Stopwatch()
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    outs, timed_out = {}, False
    while engine.has_unfinished_requests():
        for o in engine.step():
            if getattr(o, "finished", True):
                outs[o.request_id] = o
        if watch.elapsed(wait=False) > time_limit:
            timed_out = True
            break
    seconds = watch.elapsed()
    after = llm.metrics()
    for rid in ids:
        if rid not in outs:
            engine.abort_request(rid)
    if "num_generated_tokens" in after:
        generated = after["num_generated_tokens"] - before["num_generated_tokens"]
    else:
        generated = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
    metrics = [o.metrics for o in outs.values() if getattr(o, "metrics", None) is not None]
    return dict(requests=len(prompts), finished=len(outs), timed_out=timed_out, seconds=seconds,
                output_tokens=generated, output_tok_s=generated / seconds,
                ttft_s=benchlib.percentiles([m.ttft for m in metrics if m.ttft is not None]),
                itl_s=benchlib.percentiles([m.mean_itl for m in metrics if m.mean_itl is not None]),
                preemptions=after["num_preemptions"] - before["num_preemptions"],
                token_ids=[outs[r].outputs[0].token_ids if r in outs else None for r in ids])


def run_batch1(llm, prompt, out_len, kind, time_limit, tag):
    """One request alone: decode tok/s = (tokens - 1) / (seconds - TTFT), and the token ids."""
    r = run_requests(llm, [prompt], [sampling_params(kind, out_len, 0)], time_limit, tag)
    ttft = r["ttft_s"].get("p50")
    tokens = r["token_ids"][0] or []
    decode_s = r["seconds"] - ttft if ttft is not None else None
    return dict(r, output_tok_s=(len(tokens) - 1) / decode_s if decode_s and len(tokens) > 1 else None,
                ttft_p50_s=ttft)


def warm_up(llm, prompts, kinds):
    """A few short requests of every kind: kernels compiled and CUDA graphs captured before timing."""
    for i, kind in enumerate(kinds):
        run_requests(llm, prompts[:4], [sampling_params(kind, 8, j) for j in range(len(prompts[:4]))], 300,
                     f"warm{i}")


def make_llm(ckpt, device, **kw):
    from pagedattn import LLM

    return LLM(ckpt, device=device, **kw)


def release(device):
    """Give the memory of dropped engines back to the driver (the next LLM sizes its KV pool from the
    free memory the driver reports): collect reference cycles, then empty torch's cache."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def result_row(group, kind, r):
    return dict(group=group, params=kind, requests=r["requests"], finished=r["finished"],
                output_tokens=r["output_tokens"], seconds=r["seconds"], tok_s=r["output_tok_s"], vs_greedy=None,
                ttft_p50_s=r["ttft_s"].get("p50"), itl_p50_ms=1e3 * r["itl_s"]["p50"] if r["itl_s"] else None,
                preemptions=r["preemptions"], timed_out=r["timed_out"])


def add_ratios(rows):
    """vs_greedy: each row's tok/s over the greedy row's of its group."""
    greedy = {r["group"]: r["tok_s"] for r in rows if r["params"] == "greedy" and r["tok_s"]}
    for r in rows:
        if r["tok_s"] and greedy.get(r["group"]):
            r["vs_greedy"] = r["tok_s"] / greedy[r["group"]]


WORKLOAD_COLUMNS = ["group", "params", "requests", "finished", "output_tokens", "seconds", "tok_s", "vs_greedy",
                    "ttft_p50_s", "itl_p50_ms", "preemptions", "timed_out"]


def workload_markdown(rows, meta):
    lines = [f"Model {meta['model']}, {meta['device']}, {meta['dtype']}, CUDA graphs: {not meta['eager']}; "
             f"warm-up (compiles, graph capture) {meta['warmup_s']:.1f} s, not counted. Workload: "
             f"{meta['num_requests']} nano-vllm requests ({meta['prompt_tokens']:,} prompt tokens); batch 1: "
             f"{meta['batch1'][0]} prompt + {meta['batch1'][1]} output tokens (tok/s = decode rate). "
             f"Sampled = temperature 0.8, top_p 0.95; default params = SamplingParams() (temperature 1.0). "
             "Prefix caching off (the kinds run the same prompts).", "",
             benchlib.markdown_table(rows, WORKLOAD_COLUMNS, floatfmt={"vs_greedy": "{:.2f}", "seconds": "{:.1f}"})]
    if meta.get("errors"):
        lines += ["", "Errors: " + json.dumps(meta["errors"])]
    return "\n".join(lines)


def workload_mode(out, ckpt, device, num_requests=256, time_limit=120.0, engine_kw=None, workload=None,
                  kinds=PARAM_KINDS, batch1_kinds=BATCH1_KINDS, batch1=BATCH1):
    """The nano-vllm workload and batch 1 for every sampling kind on one LLM; see the module docstring.
    Returns {"meta": ..., "rows": [...]} (also written to <out>/bench_throughput.{json,md,png})."""
    engine_kw = dict(engine_kw or {})
    engine_kw.setdefault("enable_prefix_caching", False)   # every kind runs the same prompts: no cross-run hits
    prompts, out_lens = workload or benchlib.nano_vllm_workload(num_requests)
    llm = make_llm(ckpt, device, **engine_kw)
    p1, n1 = batch1_request(engine_kw.get("max_model_len", 2048), vocab_size(ckpt), batch1)
    meta = dict(mode="workload", model=ckpt, device=device, dtype=str(getattr(llm.engine.config, "dtype", "auto")),
                eager=engine_kw.get("enforce_eager", False) or torch.device(device).type != "cuda",
                num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)), batch1=(len(p1), n1),
                time_limit_s=time_limit, num_blocks=llm.metrics()["num_blocks"], errors={})
    watch = benchlib.Stopwatch()
    warm_up(llm, prompts, list(dict.fromkeys([*kinds, *batch1_kinds])))
    meta["warmup_s"] = watch.elapsed()
    rows = []
    for group, todo in (("workload", kinds), ("batch 1", batch1_kinds)):
        for kind in todo:
            try:
                if group == "workload":
                    params = [sampling_params(kind, n, i) for i, n in enumerate(out_lens)]
                    r = run_requests(llm, prompts, params, time_limit, f"wl-{kind}")
                else:
                    r = run_batch1(llm, p1, n1, kind, time_limit, f"b1-{kind}")
                rows.append(result_row(group, kind, r))
                print(f"{group} {kind}: {rows[-1]['tok_s'] or 0:,.1f} tok/s", flush=True)
            except Exception as e:                                   # noqa: BLE001 (the other rows still run)
                meta["errors"][f"{group} {kind}"] = repr(e)
            add_ratios(rows)
            benchlib.save(out, "bench_throughput", rows, meta, workload_markdown(rows, meta))
    llm.close()
    del llm
    release(device)
    md = workload_markdown(rows, meta)
    benchlib.save(out, "bench_throughput", rows, meta, md)
    groups = ["workload", "batch 1"]
    series = {k: [next((r["tok_s"] for r in rows if r["group"] == g and r["params"] == k), None) for g in groups]
              for k in PARAM_KINDS}
    benchlib.save_plot(os.path.join(out, "bench_throughput.png"), groups, series, "", "output tokens/s",
                       "pagedattn: greedy vs sampled", logy=True, kind="bar")
    print(benchlib.env_line() + "\n\n" + md)
    return dict(meta=meta, rows=rows)


# ---- tensor parallelism ---------------------------------------------------------------------------
def first_divergence(a, b):
    """Index of the first differing token of two id lists (len of the shorter if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_greedy(base, other):
    """How many requests' greedy ids agree, and where the others first diverge (sorted)."""
    pairs = [(a, b) for a, b in zip(base, other) if a is not None and b is not None]
    return dict(compared=len(pairs), identical=sum(a == b for a, b in pairs),
                first_divergence=sorted(first_divergence(a, b) for a, b in pairs if a != b))


def tp_runs(tp, device):
    """(name, tensor_parallel_size, enforce_eager) of every run; graphs need CUDA."""
    runs = [("tp1_graphs", 1, False), ("tp1_eager", 1, True), (f"tp{tp}_graphs", tp, False), (f"tp{tp}_eager", tp, True)]
    return [r for r in runs if r[2] or torch.device(device).type == "cuda"]


def tp_markdown(res):
    rows = [dict(run=k, **{c: r.get(c) for c in ("graphs", "batch1_tok_s", "output_tok_s", "finished", "requests",
                                                  "seconds", "num_preemptions")}) for k, r in res["tp"].items()]
    lines = [f"Model {res['model']}; workload: {res['num_requests']} nano-vllm requests, greedy; batch 1: "
             f"{res['batch1'][0]} prompt + {res['batch1'][1]} output tokens (decode tok/s). `graphs`: the engine's "
             "own enforce_eager after construction.", "",
             benchlib.markdown_table(rows, floatfmt={"seconds": "{:.1f}"}), ""]
    tp = res["tp_size"]
    for mode in ("graphs", "eager"):
        a, b = res["tp"].get(f"tp1_{mode}"), res["tp"].get(f"tp{tp}_{mode}")
        if a and b:
            lines.append(f"- TP={tp} / TP=1 ({mode}): workload {b['output_tok_s'] / a['output_tok_s']:.2f}x"
                         + (f", batch 1 {b['batch1_tok_s'] / a['batch1_tok_s']:.2f}x"
                            if a.get("batch1_tok_s") and b.get("batch1_tok_s") else ""))
        g = res.get("greedy" if mode == "eager" else "greedy_graphs")
        if g:
            lines.append(f"- {mode}: Greedy ids identical for {g['identical']} of {g['compared']} requests; "
                         f"first divergences at tokens {g['first_divergence'][:20]}")
    if res["errors"]:
        lines += ["", "Errors: " + json.dumps(res["errors"])]
    return "\n".join(lines)


def tp_mode(out, num_requests, workload_limit, max_num_seqs, max_model_len, ckpt=None, device="cuda", tp=2,
            workload=None, config="0.5b", runs=None, batch1=BATCH1):
    """TP=1 vs TP=`tp` on one workload and batch 1 (see the module docstring). Returns a dict: "tp"
    {run: numbers}, "greedy" (TP=`tp` vs TP=1, eager) and "greedy_graphs" (with graphs), speedups,
    "errors"; written to <out>/bench_tp.{json,md}."""
    ckpt = ckpt or benchlib.random_checkpoint(config)
    prompts, out_lens = workload or benchlib.nano_vllm_workload(num_requests)
    p1, n1 = batch1_request(max_model_len, vocab_size(ckpt), batch1)
    res = dict(mode="tp", model=ckpt, tp_size=tp, num_requests=len(prompts), batch1=(len(p1), n1), tp={},
               errors={})
    ids = {}
    for key, size, eager in tp_runs(tp, device):
        if runs and key not in runs:
            continue
        llm = None
        try:
            llm = make_llm(ckpt, device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           enforce_eager=eager, tensor_parallel_size=size, enable_prefix_caching=False)
            warm_up(llm, prompts, ["greedy"])
            r = run_requests(llm, prompts, [sampling_params("greedy", n, i) for i, n in enumerate(out_lens)],
                             workload_limit, key)
            b = run_batch1(llm, p1, n1, "greedy", workload_limit, f"{key}-b1")
            ids[key] = r["token_ids"]
            res["tp"][key] = dict(graphs=not getattr(llm.engine.config, "enforce_eager", eager)
                                  and torch.device(device).type == "cuda",
                                  **{k: r[k] for k in ("requests", "finished", "timed_out", "seconds", "output_tokens",
                                                       "output_tok_s")},
                                  num_preemptions=r["preemptions"], num_blocks=llm.metrics()["num_blocks"],
                                  batch1_tok_s=b["output_tok_s"])
            print(f"{key}: workload {r['output_tok_s']:,.0f} tok/s, batch 1 {b['output_tok_s'] or 0:,.1f} tok/s",
                  flush=True)
        except Exception as e:                                       # noqa: BLE001 (the other runs still go)
            res["errors"][key] = repr(e)
        finally:
            if llm is not None:
                llm.close()                                          # stops the TP workers
            llm = None
            release(device)
        benchlib.save(out, "bench_tp", list(res["tp"].values()), res, tp_markdown(res))
    for mode, name in (("eager", "greedy"), ("graphs", "greedy_graphs")):
        if f"tp1_{mode}" in ids and f"tp{tp}_{mode}" in ids:
            res[name] = compare_greedy(ids[f"tp1_{mode}"], ids[f"tp{tp}_{mode}"])
            a, b = res["tp"][f"tp1_{mode}"], res["tp"][f"tp{tp}_{mode}"]
            res[f"speedup_{mode}"] = b["output_tok_s"] / a["output_tok_s"]
            if a["batch1_tok_s"] and b["batch1_tok_s"]:
                res[f"batch1_speedup_{mode}"] = b["batch1_tok_s"] / a["batch1_tok_s"]
    md = tp_markdown(res)
    benchlib.save(out, "bench_tp", [dict(run=k, **v) for k, v in res["tp"].items()], res, md)
    if res["tp"]:
        benchlib.save_plot(os.path.join(out, "bench_tp.png"), ["batch 1 decode", "workload"],
                           {k: [r["batch1_tok_s"], r["output_tok_s"]] for k, r in res["tp"].items()}, "",
                           "output tokens/s", f"TP=1 vs TP={tp}", logy=True, kind="bar")
    print(benchlib.env_line() + "\n\n" + md)
    return res


# ---- HF transformers ------------------------------------------------------------------------------
def load_hf(ckpt, device, dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def hf_generate_s(model, prompt, new_tokens, sampled, device):
    """Seconds of one HF `generate` call that makes exactly `new_tokens` tokens after `prompt`."""
    ids = torch.tensor([prompt], device=device)                                  # (1, prompt_len)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, attention_mask=torch.ones_like(ids),
              pad_token_id=0, do_sample=sampled, **({**SAMPLED, "top_k": 0} if sampled else {}))
    watch = benchlib.Stopwatch()
    with torch.no_grad():
        model.generate(ids, **kw)
    return watch.elapsed()


def hf_batch1(model, prompt, new_tokens, sampled, device):
    """HF decode tok/s at batch 1, the engine's way: (tokens - 1) / (time of N tokens - time of 1)."""
    hf_generate_s(model, prompt, 4, sampled, device)                           # warm-up
    first = hf_generate_s(model, prompt, 1, sampled, device)
    total = hf_generate_s(model, prompt, new_tokens, sampled, device)
    return dict(output_tokens=new_tokens, seconds=total, tok_s=(new_tokens - 1) / max(total - first, 1e-9))


def hf_generate_batch(model, prompts, max_new_tokens):
    """HF continuous batching (`generate_batch`, paged cache), greedy, one max_new_tokens for all."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    watch = benchlib.Stopwatch()
    res = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    seconds = watch.elapsed()
    generated = sum(len(r.generated_tokens) for r in res.values())
    return dict(output_tokens=generated, seconds=seconds, tok_s=generated / seconds)


def hf_mode(out, ckpt, device, num_requests=256, hf_requests=64, hf_max_new=512, batch1_tokens=64,
            max_model_len=2048, dtype=None, workload=None):
    """HF beside the engine on the same requests; see the module docstring. Returns {"meta", "rows"}."""
    dtype = dtype or (torch.float16 if torch.device(device).type == "cuda" else torch.float32)
    prompts, out_lens = workload or benchlib.nano_vllm_workload(num_requests)
    p1, n1 = batch1_request(max_model_len, vocab_size(ckpt))
    model = load_hf(ckpt, device, dtype)
    engine = {}
    try:
        with open(os.path.join(out, "bench_throughput.json")) as f:
            engine = {(r["group"], r["params"]): r["tok_s"] for r in json.load(f)["rows"]}
    except (OSError, ValueError, KeyError):
        pass
    meta = dict(mode="hf", model=ckpt, device=device, dtype=str(dtype), errors={})
    rows = []
    for kind in ("greedy", "sampled seeded"):
        try:
            r = hf_batch1(model, p1, min(batch1_tokens, n1), kind != "greedy", device)
            rows.append(dict(group="batch 1", params=kind, system="HF generate", **r))
        except Exception as e:                                       # noqa: BLE001
            meta["errors"][f"batch 1 {kind}"] = repr(e)
    sub = prompts[:hf_requests]                     # a subset: HF is ~20-70x slower (docs/performance.md)
    max_new = min(hf_max_new, sum(out_lens[:hf_requests]) // max(1, len(sub)))
    try:
        if sub:
            r = hf_generate_batch(model, sub, max_new)
            rows.append(dict(group="workload", params="greedy",
                             system=f"HF generate_batch ({len(sub)} requests x {max_new} tokens)", **r))
    except Exception as e:                                           # noqa: BLE001
        meta["errors"]["workload greedy"] = repr(e)
    for r in rows:
        ours = engine.get((r["group"], r["params"]))
        r["engine_tok_s"], r["engine_vs_hf"] = ours, ours / r["tok_s"] if ours and r["tok_s"] else None
    md = ("HF transformers (sdpa) on the engine's requests; engine_tok_s from this --out's bench_throughput.json."
          "\n\n" + benchlib.markdown_table(rows, ["group", "params", "system", "output_tokens", "seconds", "tok_s",
                                                  "engine_tok_s", "engine_vs_hf"],
                                           floatfmt={"engine_vs_hf": "{:.1f}", "seconds": "{:.1f}"}))
    if meta["errors"]:
        md += "\n\nErrors: " + json.dumps(meta["errors"])
    benchlib.save(out, "bench_hf", rows, meta, md)
    if rows:
        benchlib.save_plot(os.path.join(out, "bench_hf.png"), [f"{r['group']} {r['params']}" for r in rows],
                           {"HF": [r["tok_s"] for r in rows], "pagedattn": [r["engine_tok_s"] for r in rows]}, "",
                           "output tokens/s", "pagedattn vs HF transformers", logy=True, kind="bar")
    print(benchlib.env_line() + "\n\n" + md)
    return dict(meta=meta, rows=rows)


def main(mode="workload", out="bench_out", model=None, config="0.5b", device=None, num_requests=256,
         time_limit=120.0, max_num_seqs=256, max_model_len=2048, eager=False, tp=2, runs=None, hf_requests=64,
         hf_max_new=512, hf_batch1_tokens=64, step_kernel="auto"):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if mode == "tp":
        return tp_mode(out, num_requests, time_limit, max_num_seqs, max_model_len, ckpt=model, device=device, tp=tp,
                       config=config, runs=runs)
    ckpt = model or benchlib.random_checkpoint(config)
    if mode == "hf":
        return hf_mode(out, ckpt, device, num_requests, hf_requests, hf_max_new, hf_batch1_tokens, max_model_len)
    return workload_mode(out, ckpt, device, num_requests, time_limit,
                         dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, enforce_eager=eager,
                              step_kernel=step_kernel))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("workload", "tp", "hf"), default="workload")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random weights of --config)")
    ap.add_argument("--config", choices=sorted(benchlib.QWEN2_CONFIGS), default="0.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per run (the rest is aborted)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--eager", action="store_true", help="workload mode without CUDA graphs")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--runs", default=None, help="tp mode: a subset of tp1_graphs,tp1_eager,tp2_graphs,tp2_eager")
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--hf-max-new", type=int, default=512)
    ap.add_argument("--hf-batch1-tokens", type=int, default=64)
    ap.add_argument("--step-kernel", choices=("auto", "on", "off"), default="auto",
                    help="workload mode: EngineConfig.step_kernel (decode steps of <= 8 sequences as one kernel)")
    a = ap.parse_args()
    main(a.mode, a.out, a.model, a.config, a.device, a.num_requests, a.time_limit, a.max_num_seqs, a.max_model_len,
         a.eager, a.tp, a.runs.split(",") if a.runs else None, a.hf_requests, a.hf_max_new, a.hf_batch1_tokens,
         a.step_kernel)
