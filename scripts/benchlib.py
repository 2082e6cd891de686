"""The bench library every script shares: timers, L2-rotating input sets, the environment line,
saving tables (JSON + markdown) and plots, random checkpoints and the nano-vllm workload.

Timing rules (docs/performance.md):
  * GPU work is timed by CUDA-graph replay (`graph_time_us`) or CUDA events (`event_time_us`),
    median of several runs after a warm-up; never by host clocks around asynchronous launches.
  * Repeated reads of the same buffers are served by the 60 MB L2: rotate `num_sets_for(...)` input
    sets so every call reads from HBM.
  * Wall-clock quantities (a whole engine run, a step, host overhead) go through `Stopwatch` /
    `host_time_us`, which wait for the device before reading the clock.

Scripts import it as `from scripts.benchlib import ...` (run them from the repository root as
`python3 scripts/x.py` or `python3 -m scripts.x`). Nothing here imports numba or transformers at
module level, and every GPU function fails with a clear message on a machine without CUDA.
"""
import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import random
import statistics
import time

import torch

L2_BYTES = 60 << 20                    # the H200's L2 cache


# ---- the environment ------------------------------------------------------------------------------
def _version(dist_name):
    from importlib import metadata
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def env_line():
    """One line naming when and on what a number was measured, e.g.

    "2026-11-30 14:02 UTC | NVIDIA H200 | torch 2.11.0+cu130 | numba 0.68.0 | numba-cuda 0.30.4 |
    numpy 2.4.6 | CUDA 13.0"; without a GPU the CPU model and torch's thread count stand in for the GPU.
    """
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        device = (names[0] if len(names) == 1
                  else f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names))
    else:
        device = f"{_cpu_name()} ({torch.get_num_threads()} threads)"
    parts = [when, device, f"torch {torch.__version__}", f"numba {_version('numba')}",
             f"numba-cuda {_version('numba-cuda')}", f"numpy {_version('numpy')}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    return " | ".join(parts)


# ---- timers ---------------------------------------------------------------------------------------
def _need_cuda(what):
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} times GPU work and needs a CUDA device")


def _indexed(fn):
    """fn as a function of the call index: fn(i) if it takes a positional argument, else fn()."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):                      # some builtins have no signature
        return lambda i: fn()
    takes_index = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                      and p.default is p.empty for p in params)
    return fn if takes_index else (lambda i: fn())


def _event_ms(run):
    """Milliseconds of the GPU work `run()` enqueues on the current stream, by two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def sync():
    """Wait for the GPU (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def graph_time_us(fn, calls=20, replays=10, warmup=3):
    """Median microseconds per call of fn, timed by replaying a CUDA graph of `calls` calls.

    fn: a capturable callable (no host syncs, no allocations that change between calls), either
        fn() or fn(i) with i the call index 0..calls-1, to rotate input sets:
        graph_time_us(lambda i: kernel(sets[i % len(sets)]), calls=max(20, len(sets))).
    The warm-up calls run on a side stream (compiles, allocator pools) before the capture; the graph
    is replayed once untimed, then `replays` times between CUDA events.
    """
    _need_cuda("graph_time_us")
    call = _indexed(fn)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):     # the warm-up's stream: its kept buffers exist already
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    times = [_event_ms(graph.replay) * 1e3 / calls for _ in range(replays)]
    del graph
    return statistics.median(times)


def event_time_us(fn, iters=50, warmup=5):
    """Median microseconds of fn() (or fn(i)) between CUDA events around each call: for work that
    cannot be captured in a graph. Includes the launch cost when the GPU waits for the host."""
    _need_cuda("event_time_us")
    call = _indexed(fn)
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    return statistics.median(_event_ms(lambda: call(i)) * 1e3 for i in range(iters))


def host_time_us(fn, calls=200, warmup=5):
    """Wall microseconds per call of fn() (or fn(i)) launched back to back from Python, waiting for
    the device once at the end: the host-side cost of a call when it exceeds the GPU time."""
    call = _indexed(fn)
    for i in range(warmup):
        call(i)
    watch = Stopwatch()
    for i in range(calls):
        call(i)
    return watch.elapsed() * 1e6 / calls


class Stopwatch:
    """Wall seconds since (re)start. With sync=True (the default) it waits for the GPU before reading
    the clock, at start and at every `elapsed()`, so queued device work is counted."""

    def __init__(self, sync=True):
        self.sync = sync
        self.restart()

    def restart(self):
        if self.sync:
            sync()
        self.t0 = time.perf_counter()

    def elapsed(self, wait=None):
        """Seconds since start; wait=False reads the clock without waiting for the GPU (a cheap
        deadline check inside a loop)."""
        if self.sync if wait is None else wait:
            sync()
        return time.perf_counter() - self.t0


def num_sets_for(bytes_per_set, l2_bytes=L2_BYTES, minimum=4, maximum=64):
    """How many input sets of `bytes_per_set` to rotate so L2 cannot serve repeated reads.

    The rotation covers at least 3x the L2 (L2 is not strictly LRU, so one L2-ful is not enough to
    evict a set before it comes round again), with at least `minimum` sets and at most `maximum`
    (tiny sets: a graph of 64 calls is enough to amortise, and their total stays small).
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    return min(maximum, max(minimum, math.ceil(3 * l2_bytes / bytes_per_set)))


def copy_bandwidth_gbs(nbytes=1 << 30, iters=10):
    """Device-to-device copy bandwidth in GB/s (bytes read + written per second), measured now:
    the roof for "% of copy bandwidth" columns of memory-bound kernels."""
    _need_cuda("copy_bandwidth_gbs")
    x = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()     # (nbytes / 2,)
    y = torch.empty_like(x)
    ms = event_time_us(lambda: y.copy_(x), iters=iters, warmup=3) / 1e3
    del x, y
    return 2 * nbytes / (ms / 1e3) / 1e9


def kernel_times(fn, steps=1):
    """GPU time per kernel name of `steps` calls of fn(), from torch.profiler (CUDA-graph replays
    included: their kernels appear one by one).

    Returns {"kernels": {name: {"count": int, "us": float}}, "memcpy": {...}} summed over the calls:
    "kernels" holds CUDA kernels, "memcpy" the copies and memsets the profiler records beside them.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync()
    return sum_device_events(prof.events())


def sum_device_events(events):
    """Per-name count and total microseconds of the device-side events of a profile (see kernel_times).
    events: torch.autograd.profiler_util.FunctionEvent-like objects (name, device_type, time_range)."""
    from torch.autograd import DeviceType

    out = {"kernels": {}, "memcpy": {}}
    for ev in events:
        if ev.device_type != DeviceType.CUDA:
            continue
        kind = "memcpy" if ev.name.startswith(("Memcpy", "Memset")) else "kernels"
        entry = out[kind].setdefault(ev.name, {"count": 0, "us": 0.0})
        entry["count"] += 1
        entry["us"] += ev.time_range.elapsed_us()
    return out


def percentiles(xs, qs=(50, 90, 99)):
    """{"p50": ..., ...} by the nearest rank of the sorted values ({} for no values)."""
    xs = sorted(xs)
    if not xs:
        return {}
    return {f"p{q}": xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] for q in qs}


# ---- tables, files, plots -------------------------------------------------------------------------
def _cell(value, fmt):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        text = fmt.format(value)
        if "e+" in text and 1e3 <= abs(value) < 1e15:    # "1.88e+04" reads worse than "18,812"
            text = f"{value:,.0f}"
        return text
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, (list, tuple, dict)):
        value = json.dumps(value, default=str)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows, columns=None, floatfmt="{:.3g}"):
    """A GitHub markdown table of `rows` (list of dicts).

    columns: the keys to show, in order (default: every key, in order of first appearance); a key a
        row lacks gives an empty cell. floatfmt: a format for floats, or {column: format} (other
        columns "{:.3g}"); a float the format would write with an exponent (>= 1e3) is written as a
        rounded integer with thousands separators. Ints >= 10,000 get separators; None is empty;
        bools are yes/no; lists and dicts are written as JSON.
    """
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    fmts = floatfmt if isinstance(floatfmt, dict) else {}
    default = "{:.3g}" if isinstance(floatfmt, dict) else floatfmt
    lines = ["| " + " | ".join(str(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c), fmts.get(c, default)) for c in columns) + " |")
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "item") and callable(x.item):         # numpy / torch scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def save(out_dir, name, rows, meta, markdown=None):
    """Write <out_dir>/<name>.json ({"meta": meta, "rows": rows}) and <out_dir>/<name>.md (the
    environment line, then `markdown`, or markdown_table(rows) when it is None). meta gets an "env"
    entry (env_line()) unless it has one. Returns [json path, md path]."""
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(meta)
    meta.setdefault("env", env_line())
    json_path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=_jsonable)
    with open(md_path, "w") as f:
        f.write(f"{meta['env']}\n\n{markdown if markdown is not None else markdown_table(rows)}\n")
    return [json_path, md_path]


def save_plot(path, x, series, xlabel, ylabel, title, logx=False, logy=False, kind="line"):
    """A PNG (matplotlib, Agg) of one or more series over x; returns path.

    x: list of numbers (or labels); series: {label: list of y values, one per x (None = no point)}.
    kind: "line" (markers joined per series) or "bar" (grouped bars, x as categories).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if kind == "bar":
        width = 0.8 / max(1, len(series))
        for j, (label, ys) in enumerate(series.items()):
            pos = [i + (j - (len(series) - 1) / 2) * width for i in range(len(x))]
            ax.bar(pos, [float("nan") if y is None else y for y in ys], width, label=label)
        ax.set_xticks(range(len(x)), [str(v) for v in x])
    else:
        for label, ys in series.items():
            ax.plot(x, [float("nan") if y is None else y for y in ys], "o-", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- random checkpoints and the workload ----------------------------------------------------------
# Qwen2.5-0.5B / Qwen2.5-Coder-0.5B (the bundled model's config.json) and Qwen2-7B: the shapes only.
QWEN2_CONFIGS = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4),
}
_CONFIG_DEFAULTS = dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643,
                        eos_token_id=151645, use_sliding_window=False)
WEIGHT_RULE = "v1"      # bump when random_weight() changes, so cached checkpoints are rebuilt
CKPT_CACHE = os.environ.get("PAGEDATTN_CKPT_CACHE", "/tmp/pagedattn_ckpt")


def qwen2_tensor_shapes(cfg):
    """{HF tensor name: shape} of a Qwen2ForCausalLM with config dict `cfg`, in HF's order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_weight(name, shape, seed, device="cpu"):
    """One tensor of the random checkpoint, float32, reproducible from (seed, name) alone:

    norms 1 + 0.1 N(0, 1); biases 0.1 N(0, 1); lm_head 4 N(0, 1) / sqrt(fan_in) (logits with std ~4,
    so top-1 margins stand far above fp16 noise, as a trained model's do); every other weight
    N(0, 1) / sqrt(fan_in): unit-variance activations through every layer, the scale of HF's std-0.02
    init at fan_in 2,500 (0.0167 at the 7B's hidden size 3584).
    """
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    g = torch.Generator(device=device).manual_seed(key)
    r = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * r
    if name.endswith(".bias"):
        return 0.1 * r
    scale = 4.0 if name == "lm_head.weight" else 1.0
    return r * (scale / shape[-1] ** 0.5)


def random_checkpoint(config="0.5b", seed=0, dtype=torch.float16, cache_dir=None, shard_bytes=2 << 30,
                      device=None):
    """A Hugging Face Qwen2 directory (config.json + safetensors shards + index) with random weights;
    written once under cache_dir and reused. Returns its path.

    config: a QWEN2_CONFIGS name ("0.5b", "7b") or a config dict (the shape keys; the rest default to
        Qwen2.5's). The shards are generated and written one at a time (a 7B fp16 checkpoint is
        ~15 GB; at most one shard is in memory), on `device` (default: cuda when available; the
        values depend on the device's generator), into a temporary directory renamed when complete.
    """
    from safetensors.torch import save_file

    cfg = {**_CONFIG_DEFAULTS, **(QWEN2_CONFIGS[config] if isinstance(config, str) else config)}
    for key in ("bos_token_id", "eos_token_id"):     # a small test vocabulary has no id 151,643
        if cfg[key] is not None and cfg[key] >= cfg["vocab_size"]:
            cfg[key] = None
    dtype_name = str(dtype).removeprefix("torch.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tag = hashlib.sha256(json.dumps([cfg, seed, dtype_name, WEIGHT_RULE, torch.device(device).type],
                                    sort_keys=True).encode()).hexdigest()[:12]
    name = config if isinstance(config, str) else "custom"
    path = os.path.join(cache_dir or CKPT_CACHE, f"qwen2-{name}-random-{dtype_name}-{tag}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    shapes = qwen2_tensor_shapes(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards, size = [[]], 0
    for tensor, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_weight(n, shapes[n], seed, device).to(dtype).cpu() for n in names}
        save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    total = sum(math.prod(s) * itemsize for s in shapes.values())
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": dtype_name,
                   **cfg}, f, indent=1)
    try:
        os.replace(tmp, path)
    except OSError:                                      # another process finished first: keep theirs
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    return path


def nano_vllm_workload(num_requests=256, min_len=100, max_len=1024, seed=0):
    """(prompts, output lengths) as nano-vllm's bench.py draws them: random.seed(0), every prompt's
    length uniform in [min_len, max_len] with token ids uniform in [0, 10000], then every output
    length uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, out_lens
