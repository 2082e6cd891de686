"""Where does tensor parallelism diverge? TP=2 against TP=1, layer by layer, step by step.

Three copies of one Qwen2 run the same steps on the same inputs, outside the engine:

    ref   TP=1 in a wider dtype (float32 for an fp16/bf16 run, float64 for a float32 run; the torch
          attention backend): the truth, up to its own rounding
    tp1   TP=1 in the run's dtype and attention backend
    tp2   world_size ranks (rank r on cuda:r over NCCL, or all on the CPU over gloo), each loading
          its shard; rank 0 records

The steps: one prefill of a few ragged prompts (optionally in chunks of --chunk tokens, so later
chunks start mid-block over cached tokens), then --decode-steps decode steps of every sequence. The
inputs are fixed in advance (prompt and decode token ids drawn from --seed; no sampling), block tables
are shuffled and every pool slot starts as NaN, so a read past a sequence's end shows as NaN.

Forward hooks on model.model.layers[i], its self_attn and its mlp record, for every step: the
attention output, the MLP output and the hidden state after each decoder layer, the final-normed
hidden state and the logits of each chunk's last token. Per site the error is the largest, over
tokens, of ||x_t - ref_t|| / ||ref_t|| (float64). TP=1's error against ref is the noise of the
run's dtype at that site; a site "jumps" where TP=2's error exceeds 4x that noise (or 4x a floor of
4 units of the dtype's rounding, where the noise is smaller). The first jump in execution order
names the step, layer and site to look at; `--backend torch` against `--backend numba` separates a
kernel's bug from the sharding's.

    python scripts/tp_layer_diff.py --out OUT                       # 2 GPUs, 0.5B shapes, fp16, numba
    python scripts/tp_layer_diff.py --backend torch --out OUT       # the same with torch attention
    python scripts/tp_layer_diff.py --device cpu --dtype float32    # 2 CPU ranks over gloo
"""
import datetime
import math
import os
import random
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable (spawned ranks inherit it)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scripts import benchlib  # noqa: E402

JUMP_FACTOR = 4.0          # TP=2's error may be up to this many times TP=1's (two independent roundings)
FLOOR_ULPS = 4.0           # ... or of this many units of the dtype's rounding, where TP=1's is smaller
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


# ---- the steps ------------------------------------------------------------------------------------
def make_plan(prompt_lens, decode_steps, chunk=None):
    """The steps, each a list of (sequence, start, q_len, is_prefill): prompt tokens in chunks of at
    most `chunk` (None = whole prompts in one step), then `decode_steps` one-token decode steps."""
    plan, done = [], [0] * len(prompt_lens)
    while any(d < n for d, n in zip(done, prompt_lens)):
        step = []
        for s, n in enumerate(prompt_lens):
            if done[s] < n:
                q = n - done[s] if chunk is None else min(chunk, n - done[s])
                step.append((s, done[s], q, True))
                done[s] += q
        plan.append(step)
    for k in range(decode_steps):
        plan.append([(s, n + k, 1, False) for s, n in enumerate(prompt_lens)])
    return plan


def make_inputs(prompt_lens, decode_steps, vocab_size, block_size, seed):
    """Token ids [prompt + decode inputs] per sequence, shuffled block tables, and the pool size."""
    rng = random.Random(seed)
    tokens = [[rng.randrange(vocab_size) for _ in range(n + decode_steps)] for n in prompt_lens]
    need = [math.ceil(len(t) / block_size) for t in tokens]
    num_blocks = sum(need) + 3                      # a few blocks nobody owns (they stay NaN)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    return tokens, tables, num_blocks


# ---- models ---------------------------------------------------------------------------------------
def load(path, device, dtype, backend, rank=0, world_size=1):
    """Rank `rank` of `world_size`'s Qwen2ForCausalLM (the full model at world_size 1) and its config."""
    from pagedattn.models.loader import load_model

    # The hooks read each layer's attention and MLP outputs as all-reduced sums: the model keeps the
    # all-reduce that is not fused with the next norm (which would leave them partial sums).
    return load_model(path, device, dtype, backend, tp_rank=rank, tp_size=world_size, fused_allreduce="off")


def _tensor_of(output):
    """A module's output as one tensor: a layer returning (hidden, residual) means their sum."""
    if isinstance(output, torch.Tensor):
        return output
    if len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output) and output[0].shape == output[1].shape:
        return output[0] + output[1]
    return output[0]


def site_names(num_layers):
    """The recorded sites in execution order."""
    return [f"L{i:02d} {part}" for i in range(num_layers) for part in ("attn", "mlp", "out")] + ["norm", "logits"]


@torch.no_grad()
def run_steps(model, config, plan, tokens, tables, num_blocks, block_size, device, kv_heads, kv_dtype):
    """Run the plan through `model`; returns one {site: float tensor on the CPU} per step."""
    from pagedattn.kv_cache import KVCache
    from pagedattn.layers.attention import AttentionMetadata

    kv = KVCache(config.num_hidden_layers, num_blocks, kv_heads, block_size, config.head_dim,
                 dtype=kv_dtype, device=str(device))
    for pool in kv.k_caches + kv.v_caches:
        pool.fill_(float("nan"))                    # a read past a sequence's end poisons the output
    record = {}

    def hook(name):
        # a copy: fused kernels may update the residual stream in place later in the forward
        return lambda module, args, output: record.__setitem__(name, _tensor_of(output).detach().to("cpu", copy=True))

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [layer.self_attn.register_forward_hook(hook(f"L{i:02d} attn")),
                    layer.mlp.register_forward_hook(hook(f"L{i:02d} mlp")),
                    layer.register_forward_hook(hook(f"L{i:02d} out"))]
    steps = []
    try:
        for step in plan:
            ids = [t for s, start, q, _ in step for t in tokens[s][start:start + q]]          # (T,)
            pos = [p for _, start, q, _ in step for p in range(start, start + q)]              # (T,)
            meta = AttentionMetadata.build([q for _, _, q, _ in step], [start + q for _, start, q, _ in step],
                                           [tables[s] for s, _, _, _ in step], block_size,
                                           sum(prefill for *_, prefill in step), device)
            record.clear()
            hidden = model.forward(torch.tensor(ids, device=device), torch.tensor(pos, device=device), kv, meta)
            last = torch.tensor([q for _, _, q, _ in step], device=device).cumsum(0) - 1   # (S,) each chunk's last row
            record["norm"] = hidden.detach().to("cpu", copy=True)
            record["logits"] = model.compute_logits(hidden[last]).detach().cpu()           # (S, V)
            steps.append(dict(record))
    finally:
        for h in handles:
            h.remove()
    return steps


# ---- comparison -----------------------------------------------------------------------------------
def rel_err(x, ref):
    """max over tokens t of ||x_t - ref_t|| / ||ref_t||, in float64; NaN counts as infinite."""
    x, ref = x.double().flatten(1), ref.double().flatten(1)                  # (T, features)
    err = (x - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)          # (T,)
    return torch.nan_to_num(err, nan=math.inf).max().item()


def compare(ref, tp1, tp2, dtype, step_kinds):
    """Rows (one per step and site, in execution order) with each run's error and the jump flag.

    ref, tp1, tp2: lists (one per step) of {site: tensor}; dtype: the run's dtype (for the floor);
    step_kinds: "prefill" / "decode" per step."""
    floor = FLOOR_ULPS * torch.finfo(dtype).eps
    rows = []
    for k, (r, a, b) in enumerate(zip(ref, tp1, tp2)):
        for site in r:
            e1, e2 = rel_err(a[site], r[site]), rel_err(b[site], r[site])
            rows.append(dict(step=k, kind=step_kinds[k], site=site, tp1_vs_ref=e1, tp2_vs_ref=e2,
                             tp2_vs_tp1=rel_err(b[site], a[site]), ratio=e2 / max(e1, floor),
                             jump=not e2 <= JUMP_FACTOR * max(e1, floor)))
    return rows


def summarize(rows, sites):
    """One row per site: the largest errors over steps (and the step of TP=2's largest)."""
    out = []
    for site in sites:
        mine = [r for r in rows if r["site"] == site]
        if not mine:
            continue
        worst = max(mine, key=lambda r: (r["ratio"] if r["ratio"] == r["ratio"] else math.inf))
        out.append(dict(site=site, tp1_vs_ref=max(r["tp1_vs_ref"] for r in mine),
                        tp2_vs_ref=max(r["tp2_vs_ref"] for r in mine), tp2_vs_tp1=max(r["tp2_vs_tp1"] for r in mine),
                        ratio=worst["ratio"], worst_step=worst["step"], jump=any(r["jump"] for r in mine)))
    return out


def argmax_agreement(ref, tp1, tp2):
    """Per step: how many chunks' greedy tokens TP=2 shares with TP=1 and with ref, and ref's smallest
    top-1 margin (a flip where the margin is below the noise is not a bug)."""
    out = []
    for r, a, b in zip(ref, tp1, tp2):
        top2 = r["logits"].double().topk(2, dim=-1).values                   # (S, 2)
        out.append(dict(chunks=r["logits"].shape[0],
                        tp2_eq_tp1=int((b["logits"].argmax(-1) == a["logits"].argmax(-1)).sum()),
                        tp2_eq_ref=int((b["logits"].argmax(-1) == r["logits"].argmax(-1)).sum()),
                        tp1_eq_ref=int((a["logits"].argmax(-1) == r["logits"].argmax(-1)).sum()),
                        min_ref_margin=(top2[:, 0] - top2[:, 1]).min().item()))
    return out


# ---- ranks ----------------------------------------------------------------------------------------
def _rank_device(device_type, rank):
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def _join_group(rank, world_size, port, device, timeout_s):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")        # NVLink multicast stays off, as in scripts/gpu_suite.sh
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def run_rank(rank, world_size, port, spec):
    """One rank's share of the TP run: join the group, load the shard, run the steps. Returns the
    recorded steps (every rank records; rank 0's are used)."""
    device = _rank_device(spec["device"], rank)
    _join_group(rank, world_size, port, device, spec["timeout_s"])
    try:
        model, config = load(spec["path"], device, spec["dtype"], spec["backend"], rank, world_size)
        steps = run_steps(model, config, spec["plan"], spec["tokens"], spec["tables"], spec["num_blocks"],
                          spec["block_size"], device, config.num_key_value_heads // world_size, spec["dtype"])
        dist.barrier()
        return steps
    finally:
        dist.destroy_process_group()


def _worker(index, world_size, port, spec):
    """Entry point of ranks 1..world_size-1 (torch.multiprocessing passes `index` = rank - 1)."""
    run_rank(index + 1, world_size, port, spec)


def main(device=None, backend=None, model=None, config="0.5b", dtype=None, ref_dtype=None,
         prompt_lens=(1, 17, 100, 513), decode_steps=4, chunk=None, block_size=16, world_size=2, seed=0,
         out=None, timeout_s=600):
    """Run the comparison and print it; returns {"sites": per-site rows, "rows": per step and site,
    "first_jump": the first jumping row or None, "argmax": per step, "meta": ...}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype or (torch.float16 if device == "cuda" else torch.float32)
    if ref_dtype is None:
        ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref_dtype = DTYPES[ref_dtype] if isinstance(ref_dtype, str) else ref_dtype
    backend = backend or ("numba" if device == "cuda" else "torch")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"world size {world_size} on CUDA needs {world_size} GPUs, found {torch.cuda.device_count()}")
    path = model or benchlib.random_checkpoint(config)
    from pagedattn.models.loader import read_config

    cfg = read_config(path)
    plan = make_plan(list(prompt_lens), decode_steps, chunk)
    tokens, tables, num_blocks = make_inputs(list(prompt_lens), decode_steps, cfg.vocab_size, block_size, seed)
    kinds = ["prefill" if step[0][3] else "decode" for step in plan]
    spec = dict(device=device, path=path, dtype=dtype, backend=backend, plan=plan, tokens=tokens, tables=tables,
                num_blocks=num_blocks, block_size=block_size, timeout_s=timeout_s)
    from pagedattn.distributed.parallel import free_port

    port = free_port()
    workers = mp.start_processes(_worker, args=(world_size, port, spec), nprocs=world_size - 1, join=False,
                                 start_method="spawn")
    try:
        tp2 = run_rank(0, world_size, port, spec)
    except BaseException:
        for p in workers.processes:                      # a rank waiting for rank 0 would wait for the timeout
            p.terminate()
        raise
    while not workers.join():                            # raises if a rank failed
        pass
    dev0 = _rank_device(device, 0)
    m, _ = load(path, dev0, dtype, backend)
    tp1 = run_steps(m, cfg, plan, tokens, tables, num_blocks, block_size, dev0, cfg.num_key_value_heads, dtype)
    del m
    m, _ = load(path, dev0, ref_dtype, "torch")
    kv_dtype = torch.float32 if ref_dtype == torch.float64 else ref_dtype      # pools hold at most float32
    ref = run_steps(m, cfg, plan, tokens, tables, num_blocks, block_size, dev0, cfg.num_key_value_heads, kv_dtype)
    del m
    rows = compare(ref, tp1, tp2, dtype, kinds)
    sites = summarize(rows, site_names(cfg.num_hidden_layers))
    first = next((r for r in rows if r["jump"]), None)
    meta = dict(path=path, device=device, backend=backend, dtype=_name(dtype), ref_dtype=_name(ref_dtype),
                world_size=world_size, prompt_lens=list(prompt_lens), decode_steps=decode_steps, chunk=chunk,
                block_size=block_size, seed=seed, jump_factor=JUMP_FACTOR,
                floor=FLOOR_ULPS * torch.finfo(dtype).eps)
    result = dict(meta=meta, sites=sites, rows=rows, first_jump=first, argmax=argmax_agreement(ref, tp1, tp2))
    md = report(result)
    print(benchlib.env_line() + "\n\n" + md)
    if out:
        benchlib.save(out, "tp_layer_diff", rows, {**meta, "first_jump": first, "argmax": result["argmax"]}, md)
    return result


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def report(result):
    """The markdown: the verdict, the per-site table (max over steps) and the greedy agreement."""
    m, first = result["meta"], result["first_jump"]
    head = (f"TP={m['world_size']} vs TP=1 ({m['dtype']}, {m['backend']} attention, {m['device']}) against a "
            f"{m['ref_dtype']} TP=1 reference; prompts {m['prompt_lens']}, chunk {m['chunk']}, "
            f"{m['decode_steps']} decode steps. A site jumps where TP=2's error > {m['jump_factor']:g}x "
            f"max(TP=1's, {m['floor']:.1e}).")
    if first is None:
        verdict = "No jump: TP=2 stays within the noise of TP=1 at every site and step."
    else:
        verdict = (f"FIRST JUMP: step {first['step']} ({first['kind']}), {first['site']}: TP=2 vs ref "
                   f"{first['tp2_vs_ref']:.2e} against TP=1's {first['tp1_vs_ref']:.2e} ({first['ratio']:.1f}x).")
    table = benchlib.markdown_table(result["sites"], ["site", "tp1_vs_ref", "tp2_vs_ref", "tp2_vs_tp1", "ratio",
                                                      "worst_step", "jump"], floatfmt="{:.2e}")
    greedy = benchlib.markdown_table([dict(step=k, **a) for k, a in enumerate(result["argmax"])],
                                     floatfmt="{:.3g}")
    return f"{head}\n\n**{verdict}**\n\n{table}\n\nGreedy tokens of each chunk's last position:\n\n{greedy}\n"


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--backend", choices=("numba", "torch"), default=None, help="default: numba on cuda, torch on cpu")
    ap.add_argument("--model", default=None, help="a Qwen2 checkpoint directory (default: random weights of --config)")
    ap.add_argument("--config", choices=sorted(benchlib.QWEN2_CONFIGS), default="0.5b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float16 on cuda, float32 on cpu")
    ap.add_argument("--ref-dtype", choices=sorted(DTYPES), default=None)
    ap.add_argument("--prompt-lens", default="1,17,100,513")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: whole prompts)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    main(a.device, a.backend, a.model, a.config, a.dtype, a.ref_dtype, [int(x) for x in a.prompt_lens.split(",")],
         a.decode_steps, a.chunk, a.block_size, a.world_size, a.seed, a.out)
