"""The step family on the GPU: kernels_numba/step.py's decode step against the engine's, on Qwen2-0.5B shapes.

For S = 1, 2, 4, 8 sequences at a --context-token history (random K/V in the pool, scattered blocks):

  check     each version's S = 2 logits against reference/step.py (float64, the same float16 weights and pool
            widened): max |diff| and whether the greedy ids agree where the top two logits are apart;
  v0-v5     StepKernels.decode_step (--versions, default 2,3,4,5; v0-v3 one launch per phase; v1: the column
            phases on 16-byte pieces, 16 warps a CTA; v2: 2 columns a warp, the argmax split over the CTAs; v3: a
            lane's loads issued together, the norms in the products, rotary and the K/V write in attention; v4:
            v3's phases in one cooperative launch with grid barriers; v5: v4 asking the L2 for a phase's weights
            a phase ahead) captured in a CUDA graph: microseconds per
            step (median of replays), tok/s = S / step, and
            the fraction of the weight-read floor (bytes of every weight and the pool's context read once / the
            copy bandwidth measured in the same run).

  phases    (--phases) one eager step of each version but v4 and v5 at S = 1 and 8 under torch.profiler: each phase's GPU
            microseconds a step (its launches summed over the layers) and its share, and the effective
            bandwidth of the column phases (their weight bytes / their time).

The engine's own decode step at the same batch sizes is `python scripts/profile_step.py --batches 1,2,4,8`
(`bash scripts/gpu_suite.sh step` runs both in one call).

    python scripts/bench_step_kernel.py --out OUT [--model DIR | --config 7b]      # default: random 0.5B weights

A model over 4 GiB (7B) is checked on its first two layers (the float64 reference of every layer would not fit).
"""
import os
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

BLOCK = 16


def load(path, dtype):
    from safetensors.torch import load_file

    weights = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            weights.update({k: v.to("cuda", dtype) for k, v in load_file(os.path.join(path, name)).items()})
    return weights


def make_step(config, S, context, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = S * per_seq + 8
    shape = (num_blocks, config["num_kv_heads"], BLOCK, config["head_dim"])
    L = config["num_layers"]               # every layer's pool in one allocation (v4 reads them at offsets)
    k_pools = list((torch.randn((L, *shape), generator=g, device="cuda") * 0.5).to(dtype))
    v_pools = list(torch.randn((L, *shape), generator=g, device="cuda").to(dtype))
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[:S * per_seq].reshape(S, per_seq).to(torch.int32)
    tokens = torch.randint(0, 1000, (S,), generator=g, device="cuda", dtype=torch.int32)
    positions = torch.full((S,), context, device="cuda", dtype=torch.int32)
    return tokens, positions, k_pools, v_pools, tables


CHECK_LAYERS = 2       # a model larger than CHECK_BYTES is checked on its first layers (the float64 reference of a
CHECK_BYTES = 4 << 30  # 7B's weights would be 60 GB of host memory): every phase at its widths, the layers' loop aside


def truncated(weights, config, layers):
    """The model's first `layers` layers with its embedding, final norm and LM head: (weights, config)."""
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    return keep, {**config, "num_layers": layers}


def check(kernels, weights, config, context, dtype):
    from reference.step import decode_step

    if sum(t.numel() * t.element_size() for t in weights.values()) > CHECK_BYTES:
        from kernels_numba.step import StepKernels

        weights, config = truncated(weights, config, CHECK_LAYERS)
        kernels = StepKernels(weights, config, num_ctas=kernels.num_ctas, on_gpu=True, version=kernels.version)
    tokens, positions, k_pools, v_pools, tables = make_step(config, 2, context, dtype, seed=1)
    widened = {k: v.double().cpu().numpy() for k, v in weights.items()}
    want, _, _ = decode_step(widened, config, tokens.cpu().numpy(), positions.cpu().numpy(),
                             [k.double().cpu().numpy() for k in k_pools], [v.double().cpu().numpy() for v in v_pools],
                             tables.cpu().numpy())
    logits, ids = kernels.decode_step(tokens, positions, k_pools, v_pools, tables)
    got = logits.double().cpu().numpy()
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05
    return dict(max_abs_diff=float(np.abs(got - want).max()), max_abs_logit=float(np.abs(want).max()),
                greedy_agree=bool((ids.cpu().numpy()[clear] == want.argmax(1)[clear]).all()), clear_rows=int(clear.sum()))


KERNELS = {"embed": "embed", "rms_norm": "rms_norm", "qkv": "linear", "rotary_kv": "rotary_kv",
           "attention": "attention", "o": "linear", "gate_up": "gate_up", "down": "linear",
           "lm_head": "linear", "argmax": "argmax"}           # (v0's kernels are _linear ..., v1's linear ...)


def phase_times(kernels, config, S, context, dtype, steps=3):
    """{phase: GPU us a step} of an eager step (v0-v3): the profiler's kernels in launch order, each named by its
    place in the step (a check: the kernel's name holds its phase's function). v3's qkv holds the RMSNorm before
    it, its attention rotary and the K/V write, its lm_head the final norm and the argmax's parts."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    L = config["num_layers"]
    argmax = ["argmax", "argmax"] if kernels.version == 2 else ["argmax"]      # v2: its parts, then their merge
    order = (["embed"] + ["rms_norm", "qkv", "rotary_kv", "attention", "o", "rms_norm", "gate_up", "down"] * L
             + ["rms_norm", "lm_head"] + argmax)
    if kernels.version == 3:
        order = ["embed"] + ["qkv", "attention", "o", "gate_up", "down"] * L + ["lm_head", "argmax"]
    tokens, positions, k_pools, v_pools, tables = make_step(config, S, context, dtype, seed=S)
    kernels.decode_step(tokens, positions, k_pools, v_pools, tables)         # compiled and loaded first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            kernels.decode_step(tokens, positions, k_pools, v_pools, tables)
        torch.cuda.synchronize()
    names = set(KERNELS.values())       # (the host's check of the positions runs a torch reduction: left out)
    events = sorted((ev for ev in prof.events() if ev.device_type == DeviceType.CUDA
                     and any(n in ev.name for n in names)), key=lambda ev: ev.time_range.start)
    if len(events) != steps * len(order):
        raise RuntimeError(f"{len(events)} kernels in {steps} steps, {steps * len(order)} expected")
    us = {}
    for i, ev in enumerate(events):
        phase = order[i % len(order)]
        if KERNELS[phase] not in ev.name:
            raise RuntimeError(f"kernel {i % len(order)} of a step is {ev.name!r}, not {phase}'s")
        us[phase] = us.get(phase, 0.0) + ev.time_range.elapsed_us() / steps
    return us


def phase_rows(kernels, weights, config, context, dtype, batches=(1, 8)):
    per_layer = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"], "gate_up": ["gate_proj", "up_proj"],
                 "down": ["down_proj"]}
    nbytes = {phase: sum(weights[f"model.layers.{i}.{'self_attn' if phase in ('qkv', 'o') else 'mlp'}.{n}.weight"]
                         .numel() * 2 for i in range(config["num_layers"]) for n in names)
              for phase, names in per_layer.items()}
    nbytes["lm_head"] = kernels.lm_head.numel() * 2
    rows = []
    for S in batches:
        us = phase_times(kernels, config, S, context, dtype)
        total = sum(us.values())
        for phase, t in sorted(us.items(), key=lambda kv: -kv[1]):
            rows.append(dict(S=S, phase=phase, us_per_step=t, share=t / total,
                             weight_gbs=nbytes[phase] / (t * 1e3) if phase in nbytes else None))
        rows.append(dict(S=S, phase="total", us_per_step=total, share=1.0))
    return rows


def main(out, model, context, batches, num_ctas, phases=False, versions=(2, 3, 4, 5), size="0.5b"):
    from kernels_numba.step import StepKernels
    from reference.step import load_config

    path = model or benchlib.random_checkpoint(size)
    dtype = torch.float16
    config = load_config(path)
    weights = load(path, dtype)
    copy_gbs = benchlib.copy_bandwidth_gbs()
    # every weight is read once a step, but the embedding table, of which only S rows are (unless it is
    # also the LM head)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if not config["tied"]:
        embed = weights["model.embed_tokens.weight"]
        weight_bytes -= embed.numel() * embed.element_size()
    rows, prow = [], []
    for version in versions:
        kernels = StepKernels(weights, config, num_ctas=num_ctas, on_gpu=True, version=version)
        try:                                # (a version that fails to build or run: its error in the table)
            rows.append(dict(S=2, part=f"v{version} check", **check(kernels, weights, config, context, dtype)))
        except Exception as e:              # noqa: BLE001
            rows.append(dict(S=2, part=f"v{version} check", error=f"{type(e).__name__}: {e}"[:300]))
            print(rows[-1], flush=True)
            continue
        print(rows[-1], flush=True)
        for S in batches:
            tokens, positions, k_pools, v_pools, tables = make_step(config, S, context, dtype, seed=S)

            def step():     # on torch's current stream: the capture's, inside graph_time_us
                kernels.decode_step(tokens, positions, k_pools, v_pools, tables)
            us = benchlib.graph_time_us(step, calls=5, replays=10)
            kv_bytes = (2 * S * (context + 1) * config["num_kv_heads"] * config["head_dim"]
                        * k_pools[0].element_size() * config["num_layers"])
            floor_us = (weight_bytes + kv_bytes) / (copy_gbs * 1e3)
            rows.append(dict(S=S, part=f"v{version} (graph)", us_per_step=us, tok_s=S / us * 1e6,
                             floor_us=floor_us, of_floor=floor_us / us))
            print(rows[-1], flush=True)
        if phases and version <= 3:         # (v4 and v5 are one launch: no phase to time apart)
            prow += [dict(version=version, **r) for r in phase_rows(kernels, weights, config, context, dtype)]
    md = benchlib.markdown_table(rows)
    meta = dict(model=path, context=context, num_ctas=num_ctas, copy_gbs=copy_gbs, weight_bytes=weight_bytes)
    if phases:
        md += "\n\nThe phases (one eager step, GPU us summed over the layers):\n\n" + benchlib.markdown_table(prow)
        meta["phases"] = prow
    benchlib.save(out, "bench_step_kernel", rows, meta, md)
    print(benchlib.env_line() + "\n\n" + md)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_step_kernel_out")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: random weights of --config)")
    ap.add_argument("--config", default="0.5b", choices=["0.5b", "7b"], help="the random checkpoint's shapes")
    ap.add_argument("--context", type=int, default=256, help="tokens of history per sequence")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--num-ctas", type=int, default=132)
    ap.add_argument("--phases", action="store_true", help="also each phase's GPU time (torch.profiler)")
    ap.add_argument("--versions", default="2,3,4,5")
    a = ap.parse_args()
    main(a.out, a.model, a.context, [int(b) for b in a.batches.split(",")], a.num_ctas, a.phases,
         [int(v) for v in a.versions.split(",")], a.config)
