"""Start-up work done once, when the engine is built, so that the first request meets the same program as
every later one: every kernel a step can launch is compiled (or loaded from the disk cache), the decode
graphs are captured, and so are the piecewise graphs of steps with prompt tokens (every padded size).

The engine runs a small, fixed workload of its own (warm_up_requests): a greedy prompt, then a sampled one
(temperature, top-k, top-p, a seed) arriving while the first decodes, so the steps are a prefill, pure
decodes (the graphs: every batch size of the ladder is captured at the first one), and a mixed
prefill + decode step; and one prompt longer than the step's token budget allows in one step when the
budget is below max_model_len (a chunk after a computed prefix). Then the engine's request state, prefix
cache and statistics are reset (LLMEngine.reset_state): nothing of the workload stays visible.

On a cold disk cache (a bare machine) the workload first runs once with kernels_numba.precompile
recording which kernels it lacks, those compile in parallel worker processes, and the workload runs again
on the cache they filled. Each phase's seconds are in engine.startup_times, and a line per phase goes to
the "pagedattn.startup" logger (LLM(...) shows them on stderr on CUDA or a terminal when the application has
not configured logging).
"""
import hashlib
import json
import logging
import os
import random
import time
from importlib.metadata import version

from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger("pagedattn.startup")

WARMUP_PREFIX = "__warmup__"


def warm_up_requests(engine, seed=1234):
    """[(arrival step, request id, prompt ids, SamplingParams)]: the warm-up workload for this engine's
    limits (token ids drawn from a fixed seed, so every start runs the same steps)."""
    rng = random.Random(seed)
    cfg, vocab = engine.config, engine.vocab_size
    bs, budget, limit = cfg.block_size, cfg.max_num_batched_tokens, engine.max_model_len
    short = max(1, min(2 * bs + 3, limit - 8))
    greedy = SamplingParams(temperature=0, seed=1, max_tokens=6, ignore_eos=True)
    # n=2: the two completions share the prompt's last, partial block until one writes it (copy-on-write)
    sampled = SamplingParams(n=2, temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=4, ignore_eos=True)
    work = [(0, "greedy", short, greedy), (2, "sampled", max(1, short // 2), sampled)]
    if budget + 8 < limit:                           # a prompt the scheduler must chunk
        work.append((4, "chunked", budget + min(bs, limit - budget - 4),
                     SamplingParams(temperature=0, seed=1, max_tokens=1, ignore_eos=True)))
    return [(at, f"{WARMUP_PREFIX}{name}", [rng.randrange(vocab) for _ in range(n)], p) for at, name, n, p in work]


def run_workload(engine, max_steps=10_000):
    """Add the warm-up requests at their arrival steps (those this engine's limits refuse are left out) and
    step until all have finished; then reset the engine's request state."""
    from pagedattn.errors import InvalidRequestError

    pending = sorted(warm_up_requests(engine), key=lambda w: w[0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, ids, params = pending.pop(0)
            try:
                engine.add_request(rid, ids, params)
            except InvalidRequestError as e:
                logger.debug(f"warm-up request {rid} left out: {e}")
        engine.step()
        step += 1
        if step > max_steps:
            raise RuntimeError("the warm-up workload did not finish")
    engine.reset_state()


def _marker(engine):
    """The file that says this engine's kernels were all compiled into the disk cache on this machine:
    named by what decides them (kernel sources, numba-cuda, the GPU, the engine's shapes and options)."""
    import torch

    from kernels_numba import bridge
    from pagedattn.bundled import cache_root

    cfg, mc, runner = engine.config, engine.model_config, engine.runner
    what = dict(sources=bridge.source_digest(), numba_cuda=version("numba-cuda"),
                gpu=torch.cuda.get_device_name(runner.device), cc=torch.cuda.get_device_capability(runner.device),
                cache_dir=os.environ.get("NUMBA_CACHE_DIR", ""), dtype=str(cfg.dtype), block_size=cfg.block_size,
                max_num_seqs=cfg.max_num_seqs, max_model_len=engine.max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens, attn_backend=str(cfg.attn_backend),
                enforce_eager=cfg.enforce_eager, heads=mc.num_attention_heads, kv_heads=mc.num_key_value_heads,
                head_dim=mc.head_dim, hidden=mc.hidden_size, intermediate=mc.intermediate_size, vocab=mc.vocab_size)
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_root(), "kernels-ready", key)


def warm_up(engine, workers=None):
    """Compile, capture and run the warm-up workload (see the module's docstring). Returns {phase: seconds
    or counts}."""
    from kernels_numba import bridge, precompile

    times = {}
    runner = engine.runner
    cuda = engine.config.device_type == "cuda"
    marker = _marker(engine) if cuda and engine.runner.world_size == 1 and precompile.available() else None
    if marker is not None and not _marker_holds(marker):
        t = time.perf_counter()
        logger.info("checking the kernel cache ...")
        # no marker: most likely an empty cache (a bare machine), so the workers start with the check
        with precompile.recording(start_workers=True) as needed:
            run_workload(engine)
        runner.drop_graphs()                         # captured around skipped launches: meaningless
        times["check_kernel_cache"] = time.perf_counter() - t
        if not len(needed):
            needed.close_workers()                   # everything was on disk after all
        else:
            groups = needed.groups()
            n = needed.workers.count if needed.workers is not None else \
                min(workers or precompile.default_workers(), len(needed))
            logger.info(f"compiling {len(needed)} specialisations of {len(groups)} kernels in {n} processes "
                        f"(once per machine) ...")
            t = time.perf_counter()
            import torch

            seconds = precompile.compile_all(needed, workers=n, cc=torch.cuda.get_device_capability(runner.device),
                                             log=logger.warning)
            times["compile_kernels"] = time.perf_counter() - t
            if seconds:
                slowest, slowest_s = next(iter(seconds.items()))
                times["compile_slowest"] = slowest_s
                logger.info(f"compiled in {times['compile_kernels']:.1f} s; the slowest: {slowest} ({slowest_s:.1f} s)")
            line = needed.timeline
            if line and line["workers_ready_s"]:
                ready = line["workers_ready_s"]
                times["compile_workers_ready"] = ready[-1]
                times["compile_last_saved"] = line["last_saved_s"]
                logger.info(f"{line['tasks']} tasks ({line['early']} handed over during the check); {len(ready)} "
                            f"workers ready {ready[0]:.1f}-{ready[-1]:.1f} s after their start, the last result "
                            f"saved at {line['last_saved_s']:.1f} s")
    t = time.perf_counter()
    hits, misses = bridge.disk_cache_stats()
    logger.info("loading kernels and capturing CUDA graphs ..." if cuda else "loading kernels ...")
    run_workload(engine)
    times["warm_up"] = time.perf_counter() - t
    if runner is not None and runner.piecewise is not None:
        t = time.perf_counter()
        logger.info("capturing the piecewise CUDA graphs ...")
        runner.piecewise.capture()                   # every padded size: no capture inside a request's step
        times["capture_piecewise"] = time.perf_counter() - t
    hits2, misses2 = bridge.disk_cache_stats()
    times["kernels_loaded"], times["kernels_compiled"] = hits2 - hits, misses2 - misses
    if marker is not None and times["kernels_compiled"] == 0:
        _write_marker(marker, times)
    elif marker is not None and os.path.exists(marker):
        os.remove(marker)                            # something compiled serially: record next time
    return times


def _index_files():
    """The disk cache's index files of every kernel this process loaded or compiled."""
    from kernels_numba import bridge

    files = set()
    for kernel in bridge._DISK_CACHED:
        cache_file = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        path = getattr(cache_file, "_index_path", None)
        if path and kernel.overloads:
            files.add(path)
    return sorted(files)


def _write_marker(marker, times):
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(written=time.strftime("%Y-%m-%d %H:%M:%S"), times=times, index_files=_index_files()), f)
    os.replace(tmp, marker)


def _marker_holds(marker):
    """The marker exists and every index file it names is still there (a cleared numba cache, or a copy
    of the sources elsewhere, makes it stale: the kernels are checked and compiled again)."""
    try:
        with open(marker) as f:
            files = json.load(f)["index_files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all(os.path.exists(p) for p in files)
