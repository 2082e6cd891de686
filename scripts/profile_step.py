"""Where a decode step's time goes: scheduling / preparing inputs / GPU / sampling.

Runs the engine's step by hand (the same calls LLMEngine.step makes), synchronising between the
phases so each is timed alone (the real step overlaps host work with the GPU; the sum here is an upper
bound). For each batch size: `batch` requests are prefilled, then `steps` pure-decode steps are timed,
with CUDA graphs and with enforce_eager. Random weights of the real Qwen2-0.5B config, fp16.

    python scripts/profile_step.py --out prof_out          # writes profile_step.md / .json there
"""
import argparse
import json
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.bench_throughput import env_line, make_llm, write_random_checkpoint  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def profile(llm, batch, steps, prompt_len, device):
    from pagedattn import SamplingParams
    engine = llm.engine
    runner, sched = engine.runner, engine.scheduler
    rng = random.Random(batch)
    for i in range(batch):
        p = [rng.randint(0, 10000) for _ in range(prompt_len)]
        engine.add_request(f"prof-{batch}-{i}-{time.time()}", p,
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True), prompt_token_ids=p)
    while any(s.num_computed_tokens < s.num_prompt_tokens for g in engine.groups.values() for s in g.seqs):
        engine.step()                                  # prefills (and the first decodes) untimed
    engine.step()                                      # one decode: captures the graphs if needed
    phases = {"scheduling": 0.0, "preparing inputs": 0.0, "GPU (forward + logits)": 0.0, "sampling": 0.0}
    n = 0
    with torch.inference_mode():
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            runner.copy_blocks(out.block_copies)
            seqs = [s for s, _ in out.scheduled]
            dec = runner.graph_decoder if runner.use_graphs and not out.num_prefills else None
            if dec is not None:
                tokens = [s.token_ids[-1] for s in seqs]
                positions = [s.num_tokens - 1 for s in seqs]
                tables = [engine.block_manager.block_table(s.seq_id) for s in seqs]
                from pagedattn.engine.cuda_graph import padded_batch_size
                b = padded_batch_size(len(seqs), dec.sizes)
                dec.buffers.fill(tokens, positions, tables, dec.block_size, b)
                sync(device)
                t2 = time.perf_counter()
                dec.graphs[b].replay()
                logits = dec.logits[b][:len(seqs)]
            else:
                step = runner.prepare(out)
                sync(device)
                t2 = time.perf_counter()
                hidden = runner.model.forward(step.input_ids, step.positions, runner.kv_cache, step.attn_metadata)
                logits = runner.model.compute_logits(hidden[step.logits_indices])
                seqs = step.sampling_seqs
            sync(device)
            t3 = time.perf_counter()
            sched.update(out)
            engine._process(logits, seqs, t3)
            t4 = time.perf_counter()
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k] += dt
            n += 1
    for g in list(engine.groups):
        engine.abort_request(g)
    return {k: 1e3 * v / n for k, v in phases.items()}


def markdown(rows, env):
    lines = ["| batch | mode | scheduling ms | preparing inputs ms | GPU ms | sampling ms | total ms | tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["phases_ms"]
        total = sum(p.values())
        lines.append(f"| {r['batch']} | {r['mode']} | " + " | ".join(f"{v:.3f}" for v in p.values()) +
                     f" | {total:.3f} | {r['batch'] * 1e3 / total:,.0f} |")
    return f"Decode steps, {env}\n\n" + "\n".join(lines) + "\n"


def main(out="prof_out", batches=(1, 16, 64, 256), steps=30, prompt_len=256, device=None, ckpt=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = ckpt or write_random_checkpoint()
    rows = []
    for eager in (False, True):
        kw = dict(max_num_seqs=max(batches), max_model_len=1024, enforce_eager=eager)
        if device == "cpu":
            kw.update(dtype=torch.float32, num_blocks=max(batches) * 24)
        llm = make_llm(ckpt, device, **kw)
        for b in batches:
            rows.append({"batch": b, "mode": "eager" if eager or device != "cuda" else "CUDA graph",
                         "phases_ms": profile(llm, b, steps, prompt_len, device)})
            print(rows[-1], flush=True)
        del llm
        if device != "cuda":
            break
    env = env_line(device)
    os.makedirs(out, exist_ok=True)
    md = markdown(rows, env)
    with open(os.path.join(out, "profile_step.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "profile_step.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(md)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="prof_out")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--ckpt", default=None, help="checkpoint dir (default: the random 0.5B-config one)")
    a = ap.parse_args()
    main(a.out, tuple(int(x) for x in a.batches.split(",")), a.steps, a.prompt_len, a.device, a.ckpt)
