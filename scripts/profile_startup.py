"""What a user waits for before the first token, and whether the first call is the same program as later ones.

Every measurement runs in a fresh process (this script re-runs itself with --child), so imports, weight
loading, kernel compilation and graph capture are paid the way a user pays them:

  startup      import; LLM(); the first token of one chat request; 64 chat prompts x 400 tokens (greedy),
               twice. Run twice: on an empty kernel cache (a bare machine) and again on the cache the first
               run left (every later start). Numba compilations are recorded (count, seconds, the slowest),
               and a cProfile of LLM() + the first token is written beside the table. On the empty cache
               the parallel compile phase is recorded too (`precompile`: its processes, each task's
               seconds); `startup_phases` gets its slowest specialisation (`compile_slowest`,
               `compile_slowest_s`: the phase cannot be shorter) and the tasks' sum.
  repeat       the same 64 chat requests x 300 tokens (greedy) three times in one process, with prefix
               caching on and off: how many requests come back token-identical call to call.
  lifecycle    create, use and close LLM three times in one process: torch.cuda.memory_allocated() after each.
  prefill      one prefill step of 8 x 1024 fresh tokens: wall time, cProfile of the step (where the host goes);
               a mixed step (64 streams decoding + one new 512-token prompt) and the pure decode step of the
               64; with the kernels' launch plans (kernels_numba.launcher) and with numba's own launches,
               and with --piecewise also through the piecewise graphs (pagedattn.engine.piecewise_graph).

    python scripts/profile_startup.py --model DIR --out OUT                 # all, on the GPU
    python scripts/profile_startup.py --model DIR --out OUT --only startup --device cpu
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T_START = time.perf_counter()


class CompileLog:
    """Every CUDA kernel specialisation this process compiles or loads from the disk cache: (kernel, seconds,
    how) from numba-cuda's CUDADispatcher.compile; and which kernels that ran are kept off the disk cache."""

    def __init__(self):
        from numba.cuda.dispatcher import CUDADispatcher

        log = self.entries = []
        compile = CUDADispatcher.compile

        def timed(disp, sig):
            known = disp.specialized or tuple(sig) in disp.overloads if isinstance(sig, tuple) else False
            misses = sum(disp._cache_misses.values())
            t = time.perf_counter()
            kernel = compile(disp, sig)
            dt = time.perf_counter() - t
            if not known and dt > 1e-3:
                how = "compiled" if sum(disp._cache_misses.values()) > misses else "loaded"
                log.append((f"{disp.py_func.__module__}.{disp.py_func.__qualname__}", dt, how))
            return kernel

        CUDADispatcher.compile = timed

    def summary(self, top=15):
        from kernels_numba import bridge

        compiled = [e for e in self.entries if e[2] == "compiled"]
        loaded = [e for e in self.entries if e[2] == "loaded"]
        slow = sorted(self.entries, key=lambda e: -e[1])[:top]
        uncached = sorted({f"{d.py_func.__module__}.{d.py_func.__qualname__}" for d in live_kernels()
                           if d.overloads and type(d._cache).__name__ != "KernelCache"})
        return dict(compiled=len(compiled), compile_s=round(sum(e[1] for e in compiled), 2),
                    loaded=len(loaded), load_s=round(sum(e[1] for e in loaded), 2),
                    slowest=[(n, round(s, 2), how) for n, s, how in slow], not_disk_cached=uncached,
                    disk_cache_hits_misses=bridge.disk_cache_stats())


class PrecompileLog:
    """The parallel compile phase of an empty cache (kernels_numba.precompile.compile_all): how many
    specialisations, in how many processes, and each task's seconds in its worker (slowest first)."""

    def __init__(self):
        from kernels_numba import precompile

        self.calls = []
        compile_all = precompile.compile_all

        def logged(needed, workers=None, **kwargs):
            started = needed.workers.count if needed.workers is not None else None      # by the recording
            t = time.perf_counter()
            seconds = compile_all(needed, workers=workers, **kwargs)
            self.calls.append(dict(specialisations=len(needed), kernel_functions=len(needed.groups()),
                                   workers=started or min(workers or precompile.default_workers(), len(needed)),
                                   started_by_recording=started is not None,
                                   wall_s=time.perf_counter() - t, task_s=seconds))
            return seconds

        precompile.compile_all = logged

    def phases(self):
        """The slowest task of the (last) compile phase, for startup_phases; {} when nothing compiled."""
        if not self.calls or not self.calls[-1]["task_s"]:
            return {}
        call = self.calls[-1]
        name, seconds = next(iter(call["task_s"].items()))
        return dict(compile_tasks=len(call["task_s"]), compile_specialisations=call["specialisations"],
                    compile_workers=call["workers"], compile_slowest=name, compile_slowest_s=round(seconds, 2),
                    compile_task_sum_s=round(sum(call["task_s"].values()), 2))


def live_kernels():
    import gc

    from numba.cuda.dispatcher import CUDADispatcher
    return [o for o in gc.get_objects() if isinstance(o, CUDADispatcher)]


def chat_prompts(llm, n, seed=0):
    sys.path.insert(0, ROOT)
    from scripts.bench_serving import chat_messages

    if llm.engine.tokenizer is None:            # a checkpoint without one (random weights): 64-id prompts
        vocab = llm.engine.vocab_size
        return [[(17 * i + 31 * j + seed) % vocab for j in range(64)] for i in range(n)]
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chat_messages(n, seed)]


def sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def child_startup(args):
    import torch  # noqa: F401
    from pagedattn import LLM, SamplingParams
    t_import = time.perf_counter() - T_START
    log = CompileLog()
    precompiled = PrecompileLog()
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    t_llm = time.perf_counter() - t
    prompts = chat_prompts(llm, args.requests)
    t = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t_first = time.perf_counter() - t
    prof.disable()
    compiles_before_work = len(log.entries)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        times.append(time.perf_counter() - t)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    with open(os.path.join(args.out, f"startup_{args.tag}_cprofile.txt"), "w") as f:
        f.write(s.getvalue())
    prof.dump_stats(os.path.join(args.out, f"startup_{args.tag}.prof"))     # for pstats' callers / callees
    return dict(tag=args.tag, import_s=t_import, llm_s=t_llm, first_token_s=t_first,
                to_first_token_s=t_import + t_llm + t_first,
                generate1_s=times[0], generate2_s=times[1], first_over_later=times[0] / times[1],
                kernels_after_first_token=len(log.entries) - compiles_before_work,
                startup_phases={**(getattr(llm.engine, "startup_times", None) or {}), **precompiled.phases()},
                precompile=precompiled.calls, **log.summary())


def same(a, b):
    return sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))


def child_repeat(args):
    from pagedattn import LLM, SamplingParams
    rows = []
    for caching in (True, False):
        with LLM(args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=caching) as llm:
            prompts = chat_prompts(llm, args.requests)
            params = SamplingParams(temperature=0, max_tokens=args.tokens * 3 // 4)
            calls = [llm.generate(prompts, params, use_tqdm=False) for _ in range(3)]
            rows.append(dict(prefix_caching=caching, call1_vs_2=same(calls[0], calls[1]),
                             call2_vs_3=same(calls[1], calls[2]), call1_vs_3=same(calls[0], calls[2]),
                             of=len(prompts)))
            if caching:
                first = calls[0]
        if not caching:   # a fresh engine's first call against the first engine's first call
            rows[-1]["call1_vs_other_engine_call1"] = same(first, calls[0])
    return rows


def child_lifecycle(args):
    import gc

    import torch

    from pagedattn import LLM, SamplingParams
    start = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    rows = []
    def use(llm):
        llm.generate(["def fib(n):"] * 4, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        return llm.engine.num_blocks, torch.cuda.memory_allocated() if torch.cuda.is_available() else 0

    for i, how in enumerate(("close", "del", "with")):
        if how == "with":
            with LLM(args.model, device=args.device, dtype=args.dtype) as llm:
                blocks, peak = use(llm)
        else:
            llm = LLM(args.model, device=args.device, dtype=args.dtype)
            blocks, peak = use(llm)
            if how == "close":
                llm.close()
        del llm
        gc.collect()
        after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        rows.append(dict(round=i, how=how, num_blocks=blocks, allocated_in_use_gib=peak / 2**30,
                         allocated_after_gib=after / 2**30, start_gib=start / 2**30))
    rows.append(dict(live_cuda_tensors=live_cuda_tensors()))
    return rows


def live_cuda_tensors(top=12):
    """The largest CUDA tensors still alive, with the types of what refers to them."""
    import gc

    import torch
    found = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                refs = sorted({type(r).__name__ for r in gc.get_referrers(o) if r is not found})[:6]
                found.append((o.numel() * o.element_size(), tuple(o.shape), str(o.dtype), refs))
        except Exception:  # noqa: BLE001 - objects that cannot be inspected are skipped
            pass
    found.sort(key=lambda f: -f[0])
    return dict(count=len(found), bytes=sum(f[0] for f in found), largest=found[:top])


def child_prefill(args):
    import random

    from kernels_numba import launcher
    from pagedattn import LLM, SamplingParams

    launcher.ENABLED = args.tag != "numba"                 # the "numba" run: numba's own launches throughout
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=8192, max_model_len=2048,
              piecewise_graphs=args.tag == "piecewise")
    engine, vocab = llm.engine, llm.engine.vocab_size
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def timed_step():
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        return time.perf_counter() - t

    def prefill_step(tag):
        for i in range(8):
            engine.add_request(f"{tag}-{i}", prompt(1024), SamplingParams(temperature=0, max_tokens=1))
        wall = timed_step()
        while engine.has_unfinished_requests():
            engine.step()
        return wall

    def profiled(name, run, top):
        """cProfile of run() into OUT/{name}_cprofile_{tag}.txt; returns run()'s result."""
        prof = cProfile.Profile()
        prof.enable()
        result = run()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
        with open(os.path.join(args.out, f"{name}_cprofile_{args.tag}.txt"), "w") as f:
            f.write(s.getvalue())
        return result

    def gpu_ms_of(run, table=None):
        """GPU time of run() from torch.profiler (ms), its kernel table into OUT/table if given."""
        try:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                run()
            if table:
                with open(os.path.join(args.out, table), "w") as f:
                    f.write(p.key_averages().table(sort_by="device_time_total", row_limit=25))
            return sum(e.device_time_total for e in p.key_averages()) / 1e3
        except Exception as e:  # the profiler is optional for the rest of the table
            return f"profiler failed: {e}"

    def mixed_step(tag):
        engine.add_request(tag, prompt(512), SamplingParams(temperature=0, max_tokens=1))
        return timed_step()

    for i in range(3):
        prefill_step(f"warm{i}")
    walls = [prefill_step(f"t{i}") for i in range(5)]
    prof_wall = profiled("prefill_step", lambda: prefill_step("prof"), 40)
    gpu_ms = gpu_ms_of(lambda: prefill_step("gpu"))
    # a serving step: 64 streams decode while one new 512-token prompt joins them (an eager mixed step),
    # beside the pure decode steps of the same 64 streams (graphs)
    for i in range(64):
        engine.add_request(f"d{i}", prompt(128), SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    mixed, decode = [], []
    for r in range(7):
        mixed.append(mixed_step(f"m{r}"))
        decode += [timed_step() for _ in range(3)]
    profiled("mixed_step", lambda: mixed_step("mprof"), 50)
    mixed_gpu_ms = gpu_ms_of(lambda: mixed_step("mgpu"), f"mixed_step_kernels_{args.tag}.txt")
    walls.sort()
    mixed.sort()
    decode.sort()
    plans = list(launcher._PLANS.values())
    return dict(launch="plans" if launcher.ENABLED else "numba", wall_ms_median=1e3 * walls[len(walls) // 2],
                wall_ms_all=[1e3 * w for w in walls], wall_ms_profiled=1e3 * prof_wall, gpu_ms=gpu_ms,
                mixed_64x1_plus_512_ms_median=1e3 * mixed[len(mixed) // 2], mixed_gpu_ms=mixed_gpu_ms,
                decode_64_ms_median=1e3 * decode[len(decode) // 2],
                launch_plans=sum(p is not None for p in plans), signatures_without_plan=sum(p is None for p in plans))


CHILDREN = dict(startup=child_startup, repeat=child_repeat, lifecycle=child_lifecycle, prefill=child_prefill)


def run_child(name, args, tag, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--tag", tag, "--model", args.model,
           "--out", args.out, "--device", args.device, "--dtype", args.dtype,
           "--requests", str(args.requests), "--tokens", str(args.tokens)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    with open(os.path.join(args.out, f"{name}_{tag}.log"), "w") as f:
        f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
    try:
        result = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result = dict(error=f"rc {p.returncode}: {p.stderr.strip().splitlines()[-3:] if p.stderr else ''}")
    print(f"== {name} ({tag}) in {time.perf_counter() - t:.1f} s", flush=True)
    print(json.dumps(result, indent=1, default=str), flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="startup_out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--only", default="startup,repeat,lifecycle,prefill")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--requests", type=int, default=64, help="chat requests of the workload")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per request (repeat: 3/4 of it)")
    ap.add_argument("--piecewise", action="store_true", help="prefill: also a run with piecewise_graphs=True")
    ap.add_argument("--child")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        sys.path.insert(0, ROOT)
        result = CHILDREN[args.child](args)
        print(json.dumps(result, default=str))
        return
    results = {}
    cache = tempfile.mkdtemp(prefix="numba_cache_")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PAGEDATTN_KERNEL_CACHE_DIR=cache)
    for name in args.only.split(","):
        if name == "startup":
            results["startup_empty"] = run_child("startup", args, "empty", env)
            results["startup_warm"] = run_child("startup", args, "warm", env)
            du = subprocess.run(["du", "-sh", cache], capture_output=True, text=True).stdout.split()
            results["kernel_cache_size"] = du[0] if du else None
        elif name == "prefill":                 # the kernels' launch plans, then numba's own launches
            results["prefill"] = run_child(name, args, "plans", env)
            results["prefill_numba_launch"] = run_child(name, args, "numba", env)
            if args.piecewise:                  # steps with prompt tokens through the piecewise graphs
                results["prefill_piecewise"] = run_child(name, args, "piecewise", env)
        else:
            results[name] = run_child(name, args, "warm", env)
    with open(os.path.join(args.out, "startup.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
