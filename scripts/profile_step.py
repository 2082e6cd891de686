"""What one engine step costs: kernels per step and per layer, GPU time, wall time, the memory floor.

For each batch size (default 1, 16, 64, 256) `batch` requests with --prompt-len-token prompts are
prefilled, then pure-decode steps are measured (the engine as a user runs it: CUDA graphs unless
--eager). One prefill step (--prefill-seqs prompts of --prefill-len tokens in one step) is measured
the same way. Per step:

  * wall ms: the wall time of `engine.step()` (it returns after the sampled tokens reach the host,
    so it includes the GPU time; wall - GPU is the host time the GPU does not hide);
  * GPU ms and kernels: torch.profiler around a few steps, CUDA kernel events summed per name (the
    kernels inside CUDA-graph replays appear one by one); kernels per layer = kernels per step /
    num_hidden_layers; the top kernels by GPU time;
  * the prefill step's host phases (scripts/profile_host.py's `phases`): schedule, pack, runner (the
    runner's execute: its host work and the launches of the forward, which the GPU may still
    be running when it returns), update, process (waits for the sampled tokens);
  * memory floor: the bytes a decode step must read — every weight once (the embedding only for
    the batch's rows) plus the KV cache of every sequence — over the copy bandwidth measured in the
    same run; "x floor" = GPU ms / floor ms.

Only public APIs are used (LLM, llm.engine.add_request / step / abort_request, llm.metrics()), so
any engine version can be profiled. Sampled decoding (temperature 0.8, top_p 0.95, seeded) is
profiled beside greedy with --sampled.

    python scripts/profile_step.py --out OUT                                  # one H200
    python scripts/profile_step.py --out OUT --batches 1,256 --sampled
"""
import os
import random
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402
from scripts.profile_host import phases  # noqa: E402

SAMPLED = dict(temperature=0.8, top_p=0.95)


def weight_bytes_per_step(cfg, batch, itemsize):
    """Bytes of weights a decode step of `batch` sequences reads: every projection, bias and norm of
    every layer, the final norm and lm_head once, and `batch` rows of the embedding."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * i + 2 * h         # qkv (+bias), o, gate/up/down, norms
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return itemsize * (cfg.num_hidden_layers * layer + h + lm_head + batch * h)


def kv_bytes_per_step(cfg, context_lens, itemsize):
    """Bytes of K and V every layer reads for sequences of `context_lens` tokens."""
    return itemsize * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * sum(context_lens)


def add_requests(llm, prompts, params, tag):
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.engine.add_request(rid, p, params)
    return ids


def step_until_pure_decode(llm, batch, max_steps=10_000):
    """Step until one step computed exactly `batch` tokens and sampled `batch` (every sequence is
    decoding), by the engine's counters; returns the number of steps taken."""
    for n in range(1, max_steps + 1):
        before = llm.metrics()
        llm.engine.step()
        after = llm.metrics()
        computed = after["num_computed_tokens"] - before["num_computed_tokens"]
        generated = after["num_generated_tokens"] - before["num_generated_tokens"]
        if computed == generated == batch:
            return n
    raise RuntimeError(f"no pure-decode step of {batch} sequences within {max_steps} steps")


def wall_ms_per_step(llm, steps):
    """Mean wall milliseconds of `steps` back-to-back step() calls (host and GPU overlap as they would
    in a run; the clock stops after the GPU is done)."""
    watch = benchlib.Stopwatch()
    for _ in range(steps):
        llm.engine.step()
    return watch.elapsed() * 1e3 / steps


def summarize(name, batch, wall_ms, prof, profile_steps, cfg, floor_bytes, copy_gbs, top):
    """One table row (and the top kernels) from the measurements of one batch size."""
    kernels = prof["kernels"]
    count = sum(k["count"] for k in kernels.values()) / profile_steps
    gpu_ms = sum(k["us"] for k in kernels.values()) / profile_steps / 1e3
    copies_ms = sum(k["us"] for k in prof["memcpy"].values()) / profile_steps / 1e3
    floor_ms = floor_bytes / (copy_gbs * 1e9) * 1e3 if copy_gbs else None
    row = dict(step=name, batch=batch, wall_ms=wall_ms, gpu_ms=gpu_ms if kernels else None,
               host_ms=wall_ms - gpu_ms if kernels else None, copies_ms=copies_ms if kernels else None,
               kernels=count if kernels else None,
               kernels_per_layer=count / cfg.num_hidden_layers if kernels else None,
               floor_ms=floor_ms, x_floor=gpu_ms / floor_ms if floor_ms and kernels else None,
               tok_s=batch / wall_ms * 1e3)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top]
    top_rows = [dict(kernel=n[:90], per_step=k["count"] / profile_steps, us_per_step=k["us"] / profile_steps,
                     share=k["us"] / profile_steps / 1e3 / gpu_ms if gpu_ms else None) for n, k in ranked]
    return row, top_rows


def profile_decode(llm, cfg, batch, prompt_len, params, steps, profile_steps, copy_gbs, itemsize, top, seed):
    """Decode steps of `batch` sequences: (row, top kernels)."""
    rng = random.Random(seed)
    vocab = min(10000, cfg.vocab_size - 1)
    prompts = [[rng.randint(0, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    ids = add_requests(llm, prompts, params, f"dec{batch}-{seed}")
    try:
        taken = step_until_pure_decode(llm, batch)
        for _ in range(2):                          # the first decode steps capture graphs / compile
            llm.engine.step()
        wall = wall_ms_per_step(llm, steps)
        prof = benchlib.kernel_times(llm.engine.step, profile_steps)
    finally:
        for rid in ids:
            llm.engine.abort_request(rid)
    context = prompt_len + taken + 2 + (steps + profile_steps) / 2                 # mean context while measured
    floor = weight_bytes_per_step(cfg, batch, itemsize) + kv_bytes_per_step(cfg, [context] * batch, itemsize)
    name = "decode" + (" sampled" if params.temperature > 0 else "")
    return summarize(name, batch, wall, prof, profile_steps, cfg, floor, copy_gbs, top)


def profile_prefill(llm, cfg, num_seqs, prompt_len, params, copy_gbs, itemsize, top, seed):
    """One step that prefills `num_seqs` prompts of `prompt_len` tokens: (row, top kernels). Its floor
    counts the weights and the KV it writes; prefill is compute-bound, so the floor is far below."""
    rng = random.Random(seed)
    vocab = min(10000, cfg.vocab_size - 1)

    def prefill_step(tag, measure):
        """New prompts (no prefix-cache hit), their prefill step measured, then aborted."""
        prompts = [[rng.randint(0, vocab) for _ in range(prompt_len)] for _ in range(num_seqs)]
        ids = add_requests(llm, prompts, params, f"pre-{tag}-{seed}")
        try:
            return measure()
        finally:
            for rid in ids:
                llm.engine.abort_request(rid)

    def timed():
        before = llm.metrics()["num_computed_tokens"]
        with phases(llm.engine) as timer:
            wall = wall_ms_per_step(llm, 1)
        return wall, llm.metrics()["num_computed_tokens"] - before, timer.now

    prefill_step("warm", llm.engine.step)           # compiles the prefill kernels
    wall, tokens, host = prefill_step("wall", timed)  # tokens < num_seqs * prompt_len if the budget splits it
    prof = prefill_step("prof", lambda: benchlib.kernel_times(llm.engine.step, 1))
    floor = weight_bytes_per_step(cfg, tokens, itemsize) + kv_bytes_per_step(cfg, [tokens], itemsize)
    row, top_rows = summarize("prefill", num_seqs, wall, prof, 1, cfg, floor, copy_gbs, top)
    row["tok_s"] = tokens / wall * 1e3                                             # prompt tokens per second
    row["prefill_tokens"] = tokens
    row.update({f"{k}_ms": 1e3 * v for k, v in host.items()})   # the engine's phases in that step()
    return row, top_rows


COLUMNS = ["step", "batch", "wall_ms", "gpu_ms", "host_ms", "copies_ms", "kernels", "kernels_per_layer", "floor_ms",
           "x_floor", "tok_s", "prefill_tokens", "schedule_ms", "pack_ms", "runner_ms", "update_ms", "process_ms"]


def markdown(rows, tops, meta):
    head = (f"Model {meta['model']} ({meta['num_layers']} layers), {meta['device']}, {meta['dtype']}, CUDA graphs: "
            f"{not meta['eager']}; decode prompts of {meta['prompt_len']} tokens; prefill step: {meta['prefill_seqs']} x "
            f"{meta['prefill_len']} tokens. Copy bandwidth {meta['copy_gbs'] or 0:,.0f} GB/s (0: no GPU). Wall = step() (mean "
            f"of {meta['steps']} back to back); GPU = kernel time from torch.profiler (mean of {meta['profile_steps']} steps); "
            "host = wall - GPU; floor = bytes a step must read / copy bandwidth; tok/s = batch / wall "
            "(prefill: prompt tokens / wall).")
    parts = [head, "", benchlib.markdown_table(rows, COLUMNS, floatfmt="{:.3g}")]
    for (step, batch), top in tops.items():
        if top:
            parts += ["", f"Top kernels, {step} at batch {batch}:", "",
                      benchlib.markdown_table(top, floatfmt={"share": "{:.1%}", "per_step": "{:.3g}",
                                                             "us_per_step": "{:.1f}"})]
    return "\n".join(parts)


def main(out="prof_out", batches=(1, 16, 64, 256), model=None, config="0.5b", device=None, eager=False,
         prompt_len=256, steps=20, profile_steps=5, prefill_seqs=8, prefill_len=1024, sampled=False, top=8,
         max_model_len=2048, engine_kw=None):
    """Profile every batch size (greedy, and sampled with sampled=True) and one prefill step; prints
    the table and writes profile_step.{json,md} under `out`. Returns {"meta", "rows", "top"}."""
    from pagedattn import LLM, SamplingParams
    from pagedattn.models.loader import read_config

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = model or benchlib.random_checkpoint(config)
    cfg = read_config(ckpt)
    max_tokens = steps + profile_steps + 2 + 64     # decode never ends while measured (64: tokens made while others prefill)
    copy_gbs = benchlib.copy_bandwidth_gbs() if torch.device(device).type == "cuda" else None   # before the KV pool
    kw = dict(max_num_seqs=max(batches), max_model_len=max_model_len, enforce_eager=eager, **(engine_kw or {}))
    llm = LLM(ckpt, device=device, **kw)
    dtype = llm.engine.config.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    kinds = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)]
    if sampled:
        kinds.append(SamplingParams(**SAMPLED, seed=0, max_tokens=max_tokens, ignore_eos=True))
    rows, tops = [], {}
    row, top_rows = profile_prefill(llm, cfg, prefill_seqs, prefill_len, kinds[0], copy_gbs, itemsize, top, 1)
    rows.append(row)
    tops[("prefill", prefill_seqs)] = top_rows
    for params in kinds:
        for b in batches:
            row, top_rows = profile_decode(llm, cfg, b, prompt_len, params, steps, profile_steps, copy_gbs, itemsize,
                                           top, seed=b)
            rows.append(row)
            tops[(row["step"], b)] = top_rows
            print({k: row[k] for k in ("step", "batch", "wall_ms", "gpu_ms", "kernels_per_layer")}, flush=True)
    llm.close()
    meta = dict(model=ckpt, num_layers=cfg.num_hidden_layers, device=device, dtype=str(dtype), eager=eager
                or torch.device(device).type != "cuda", prompt_len=prompt_len, prefill_seqs=prefill_seqs,
                prefill_len=prefill_len, steps=steps, profile_steps=profile_steps, copy_gbs=copy_gbs)
    md = markdown(rows, tops, meta)
    top_json = [dict(step=s, batch=b, kernels=t) for (s, b), t in tops.items()]
    benchlib.save(out, "profile_step", rows, {**meta, "top": top_json}, md)
    print(benchlib.env_line() + "\n\n" + md)
    return dict(meta=meta, rows=rows, top=top_json)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="prof_out")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random weights of --config)")
    ap.add_argument("--config", choices=sorted(benchlib.QWEN2_CONFIGS), default="0.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed (wall) per batch size")
    ap.add_argument("--profile-steps", type=int, default=5, help="decode steps profiled per batch size")
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--sampled", action="store_true", help="also profile sampled decoding")
    ap.add_argument("--top", type=int, default=8, help="top kernels listed per batch size")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batch-invariant", action="store_true", help="the engine in its batch-invariant mode")
    ap.add_argument("--step-kernel", choices=("auto", "on", "off"), default="auto",
                    help="EngineConfig.step_kernel: decode steps of <= 8 sequences as one kernel")
    a = ap.parse_args()
    main(a.out, tuple(int(x) for x in a.batches.split(",")), a.model, a.config, a.device, a.eager, a.prompt_len,
         a.steps, a.profile_steps, a.prefill_seqs, a.prefill_len, a.sampled, a.top, a.max_model_len,
         dict(batch_invariant=a.batch_invariant, step_kernel=a.step_kernel))
