"""Start-up: the warm-up at LLM() time leaves no trace, the KV pool needs no zeroing, kernels compile once per
machine (parallel precompilation into the disk cache), and the first call is the same program as later ones."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kernels_numba import precompile
from pagedattn import LLM, SamplingParams
from pagedattn.engine.warmup import WARMUP_PREFIX, warm_up_requests
from scripts.compile_seconds import NO_DEVICE
from tests.helpers import ROOT, write_tiny_checkpoint

KW = dict(device="cpu", num_blocks=64, max_model_len=96, max_num_batched_tokens=48, max_num_seqs=4)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [9, 8, 7], list(range(20, 80))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def run(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_warm_up_leaves_no_trace(ckpt):
    plain = LLM(ckpt, warmup=False, **KW)
    warmed = LLM(ckpt, warmup=True, **KW)
    e = warmed.engine
    assert set(e.startup_times) >= {"load_model", "load_tokenizer", "warm_up"}
    assert not e.groups and not e.scheduler.waiting and not e.scheduler.running
    bm = e.block_manager
    assert len(bm.free_blocks) == bm.total_blocks and not bm.block_hash and bm.num_query_tokens == 0
    assert e.stats.num_steps == 0 and e.stats.num_generated_tokens == 0
    for params in (GREEDY, SAMPLED):
        assert run(warmed, params) == run(plain, params)
    assert plain.metrics()["prefix_cache_hit_rate"] == warmed.metrics()["prefix_cache_hit_rate"]
    plain.close()
    warmed.close()


def test_warm_up_workload_covers_the_step_kinds(ckpt):
    """A prefill, decodes, a prompt arriving while others decode (a mixed step), n=2 (copy-on-write) with
    temperature, top-k, top-p and a seed, and a prompt longer than the step's token budget (chunked)."""
    llm = LLM(ckpt, warmup=False, **KW)
    work = warm_up_requests(llm.engine)
    names = [rid[len(WARMUP_PREFIX):] for _, rid, _, _ in work]
    assert names == ["greedy", "sampled", "chunked"]
    at = {rid[len(WARMUP_PREFIX):]: (step, ids, p) for step, rid, ids, p in work}
    assert at["sampled"][0] > at["greedy"][0] and at["sampled"][2].n == 2 and at["sampled"][2].temperature > 0
    assert len(at["chunked"][1]) > KW["max_num_batched_tokens"]
    assert all(0 <= t < llm.engine.vocab_size for _, _, ids, _ in work for t in ids)
    assert work == warm_up_requests(llm.engine)                       # the same workload at every start
    llm.close()


@pytest.mark.parametrize("limits", [dict(max_model_len=24, max_num_batched_tokens=24),
                                    dict(max_model_len=40, max_num_batched_tokens=16, num_blocks=3)])
def test_warm_up_fits_small_engines(ckpt, limits):
    """Requests an engine's limits refuse are left out; the warm-up never stops an engine from starting."""
    llm = LLM(ckpt, warmup=True, **{**KW, **limits})
    assert not llm.engine.groups
    outs = llm.generate([[1, 2, 3], [9, 8, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    llm.close()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_no_kernel_reads_a_slot_before_writing_it(ckpt, backend):
    """The CPU pool is not zeroed (torch.empty): filled with NaN, a slot read before written would poison the
    output. Greedy and sampled tokens, prefix-cache hits and copy-on-write forks (n=2) included, equal those
    of a zeroed pool."""
    kw = dict(KW, attn_backend=backend)
    zeroed, poisoned = LLM(ckpt, **kw), LLM(ckpt, **kw)
    for c in zeroed.engine.kv_cache.k_caches + zeroed.engine.kv_cache.v_caches:
        c.zero_()
    for c in poisoned.engine.kv_cache.k_caches + poisoned.engine.kv_cache.v_caches:
        c.fill_(math.nan)
    forks = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=5, ignore_eos=True)
    for params in (GREEDY, SAMPLED, forks, GREEDY):                  # the last: prefix-cache hits
        a = [[c.token_ids for c in o.outputs] for o in zeroed.generate(PROMPTS, params, use_tqdm=False)]
        b = [[c.token_ids for c in o.outputs] for o in poisoned.generate(PROMPTS, params, use_tqdm=False)]
        assert a == b
    assert poisoned.metrics()["prefix_cache_hit_rate"] > 0
    zeroed.close()
    poisoned.close()


def test_recording_groups_by_kernel_function():
    needed = precompile.Needed()
    needed.add("m.f:1", ("m", "make_f", (1,), (), None), ("sig-a",))
    needed.add("m.f:1", ("m", "make_f", (2,), (), None), ("sig-a",))
    needed.add("m.g:9", ("m", "make_g", (), (), 0), ("sig-b",))
    needed.add("m.f:1", ("m", "make_f", (1,), (), None), ("sig-a",))        # the same launch again
    assert len(needed) == 3
    groups = needed.groups()
    assert [g for g, _ in groups] == ["m.f:1", "m.g:9"]                  # largest first
    assert len(groups[0][1]) == 2


def test_one_task_per_specialisation_longest_first(monkeypatch):
    """Every specialisation is its own task (two of one kernel function, even of one closure, compile in
    two workers); tasks go out by estimated seconds, then the function with more specialisations first."""
    monkeypatch.setattr(precompile, "COMPILE_SECONDS", {"m.slow": 30.0, "m.fast": 0.5})
    needed = precompile.Needed()
    slow, fast = ("m", "make_slow", (64,), (), None), ("m", "fast", None, None, None)
    needed.add("m.fast:3", fast, ("sig-a",))
    needed.add("m.unknown:5", ("m", "u", None, None, None), ("sig-a",))
    needed.add("m.many:7", ("m", "many", (1,), (("bf16", True),), None), ("sig-a",))
    needed.add("m.many:7", ("m", "many", (1,), (("bf16", True),), None), ("sig-b",))
    needed.add("m.slow:1", slow, ("sig-a",))
    needed.add("m.slow:1", slow, ("sig-b",))
    needed.add("m.slow:1", ("m", "make_slow", (128,), (), None), ("sig-a",))
    tasks = needed.tasks()
    assert len(tasks) == len(needed) == 7
    assert [t.function for t in tasks] == ["m.slow:1"] * 3 + ["m.many:7"] * 2 + ["m.unknown:5", "m.fast:3"]
    assert [t.seconds for t in tasks] == [30.0] * 3 + [precompile.DEFAULT_SECONDS] * 3 + [0.5]
    assert {(t.recipe, t.argtypes) for t in tasks[:3]} == {(slow, ("sig-a",)), (slow, ("sig-b",)),
                                                           (("m", "make_slow", (128,), (), None), ("sig-a",))}
    assert len({t.name for t in tasks}) == 7                              # a name tells each task apart
    assert {t.name for t in tasks[:3]} == {"m.slow:1 make_slow(64) (sig-a)", "m.slow:1 make_slow(64) (sig-b)",
                                           "m.slow:1 make_slow(128) (sig-a)"}
    assert tasks[3].name == "m.many:7 many(1, bf16=True) (sig-a)" and tasks[-1].name == "m.fast:3 (sig-a)"
    assert tasks == needed.tasks()                                       # the same order every time


def test_compile_seconds_name_the_engines_kernel_functions():
    """COMPILE_SECONDS names each kernel function as a recording does (module.qualname): exactly those
    scripts/compile_seconds.py measures, built here (a kernel renamed or moved would otherwise fall back
    to DEFAULT_SECONDS without a word)."""
    from scripts.compile_seconds import kernels

    measured = {f"{k.py_func.__module__}.{k.py_func.__qualname__}" for k, _ in kernels().values()}
    assert measured == set(precompile.COMPILE_SECONDS)
    some = sorted(measured)[0]
    assert precompile.estimated_seconds(f"{some}:12") == precompile.COMPILE_SECONDS[some]     # the line aside


def test_default_workers_are_every_core_but_one():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert precompile.default_workers() == max(1, min(precompile.MAX_WORKERS, cores - 1))


ROUND_TRIP = """
import json, os
import numpy as np
from numba import types
from kernels_numba import precompile, rmsnorm

words = np.zeros(64, np.uint32)
closures = [(False, True), (True, False)]          # two closures of one kernel function: one index file


def launch_norms():
    for bf16, add in closures:
        rmsnorm._make_kernel(bf16, add)[1, 32](words, 0, words, 0, words, words, 0, 8, 64, 1e-6)


with precompile.recording() as needed:
    launch_norms()
recorded, started = len(needed), needed.workers.count if needed.workers else 0
handed = len(needed.submitted)                         # given to the workers during the recording
copy = ("kernels_numba.cache_ops", "_copy_blocks_kernel", None, None, None)
needed.add("kernels_numba.cache_ops._copy_blocks_kernel:60", copy, (types.uint32[::1], types.int64))   # no typing
failures = []
seconds = precompile.compile_all(needed, workers=1, log=failures.append)
with precompile.recording() as again:                   # the same launches: all on disk now
    launch_norms()
with precompile.recording(start_workers=True) as eager:  # workers asked for up front, then nothing missing
    launch_norms()
eager_started, eager_found = eager.workers is not None, len(eager)
eager.close_workers()
kernels = [rmsnorm._make_kernel(*c) for c in closures]
index = kernels[0]._cache._cache_file
print(json.dumps(dict(recorded=recorded, started=started, handed=handed, seconds=seconds, failures=failures,
                      entries=len(index._load_index()), index=os.path.basename(index._index_path),
                      again=len(again), again_started=again.workers is not None,
                      hits=[sum(k._cache_hits.values()) for k in kernels],
                      misses=[sum(k._cache_misses.values()) for k in kernels], timeline=needed.timeline,
                      eager=[eager_started, eager_found, eager.workers is None])))
"""


def test_workers_compile_and_this_process_saves(tmp_path):
    """A recording, compile_all and a second recording on real kernels (PTX and cubin for sm_90 without a
    GPU: NO_DEVICE). The first miss starts the workers (one per core but one) and every miss is handed to
    them at once; two specialisations of one kernel function compile in them and both reach the function's one index file, written by this process alone;
    a task that fails is logged and the others are saved; the same launches then find every kernel on
    disk, by the key a normal compile looks up (hits, no compile), and start no workers."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_DEVICE)      # in every process, workers too
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), PAGEDATTN_KERNEL_CACHE="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT), env.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", ROUND_TRIP], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["recorded"] == 2 and out["started"] == precompile.default_workers(), out
    assert out["handed"] == 2, out              # both compiled while the recording went on, not after it
    assert len(out["seconds"]) == 2 and all(s > 0 for s in out["seconds"].values()), out
    assert list(out["seconds"].values()) == sorted(out["seconds"].values(), reverse=True), out   # slowest first
    assert len(out["failures"]) == 1 and "_copy_blocks_kernel" in out["failures"][0], out
    assert out["index"].startswith("rmsnorm._make_kernel.locals.rms_norm_kernel") and out["entries"] == 2, out
    assert out["again"] == 0 and not out["again_started"], out
    assert out["eager"] == [True, 0, True], out         # start_workers: started at once, stopped when unused
    assert out["hits"] == [1, 1] and out["misses"] == [0, 0], out
    line = out["timeline"]                      # where the phase's time went: every worker's start, the end
    assert (line["tasks"], line["early"], line["workers"]) == (3, 2, precompile.default_workers()), line
    assert 1 <= len(line["workers_ready_s"]) <= line["workers"], line      # (one may answer for two)
    assert 0 < line["workers_ready_s"][0] <= line["workers_ready_s"][-1] < line["last_saved_s"], line


WORKER_WITHOUT_DEVICE = """
import json, pickle
import torch
from numba import types
from numba.cuda.cudadrv import driver
from kernels_numba import precompile

precompile._start_worker((9, 0), ("kernels_numba.rmsnorm",))
recipe = ("kernels_numba.rmsnorm", "_make_kernel", (False, True), (), None)
u32, i64 = types.uint32[::1], types.int64
payload, seconds = precompile._compile_task(recipe, (u32, i64, u32, i64, u32, u32, i64, i64, i64, types.float64))
library = pickle.loads(payload)["codelibrary"]
cubin = next(iter(library._cubin_cache.values()))
print(json.dumps(dict(cubins=[list(k) for k in library._cubin_cache], code_type=cubin.code_type,
    cubin_bytes=len(cubin.code), driver_started=driver.driver.pid is not None,
    torch_cuda=torch.cuda.is_initialized(), seconds=seconds)))
"""


def test_a_compile_worker_never_opens_the_gpu():
    """A compile worker compiles a real kernel (PTX by NVVM, the cubin linked for sm_90) for the compute
    capability it was given, without initialising the CUDA driver: it holds no context, so it takes no GPU
    memory from an engine beside it (on a machine without a GPU, any driver call would fail here)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", WORKER_WITHOUT_DEVICE], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0 and "CUDA toolkit" in p.stderr:
        pytest.skip("no CUDA toolkit (NVVM) to compile with")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["cubins"] == [[9, 0, "a"]], out                     # the key numba-cuda gives an sm_90 device
    assert out["code_type"] == "cubin" and out["cubin_bytes"] > 1000, out
    assert not out["driver_started"] and not out["torch_cuda"], out


WORKER_START = """
import importlib, json, subprocess, sys
import pagedattn.engine.llm_engine, pagedattn.engine.model_runner      # what an engine's process holds
from kernels_numba import precompile
for name in {kernel_modules!r}:                                         # and the GPU kernels it builds
    importlib.import_module(name)
modules = precompile.worker_modules()
start = ("import json, sys, time; t = time.perf_counter(); from kernels_numba import precompile; "
         "precompile._start_worker((9, 0), tuple(sys.argv[1:])); "
         "print(json.dumps(dict(torch='torch' in sys.modules, seconds=time.perf_counter() - t, "
         "modules=sorted(m for m in sys.modules if m.startswith('kernels_numba.')))))")
child = subprocess.run([sys.executable, "-c", start, *modules], capture_output=True, text=True, timeout=300)
print(json.dumps(dict(modules=modules, child=json.loads(child.stdout.strip().splitlines()[-1]),
                      here_torch="torch" in sys.modules)))
"""


def test_a_compile_worker_starts_without_torch():
    """A compile worker imports, at its start, the kernels' modules an engine's process holds (overlapping the
    rest of the dry run), but not torch: every module with a CUDA kernel imports torch only where a launch
    needs it, and the CPU kernels' modules (torch at their top, no CUDA kernel) are left out. torch is
    seconds a process on a host without compiled bytecode, times a worker per core."""
    kernel_modules = sorted({name.split(".<locals>")[0].rsplit(".", 1)[0] if "<locals>" in name
                             else name.rsplit(".", 1)[0] for name in precompile.COMPILE_SECONDS})
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", WORKER_START.format(kernel_modules=kernel_modules)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["here_torch"]                                    # the engine's process: torch, of course
    assert set(kernel_modules) <= set(out["modules"]), (kernel_modules, out["modules"])
    assert "kernels_numba.cpu_layer" not in out["modules"], out["modules"]      # torch at its top: left out
    assert set(out["modules"]) <= set(out["child"]["modules"]), out
    assert not out["child"]["torch"], out


def test_a_worker_that_cannot_start_reports_through_its_tasks(monkeypatch):
    """A worker whose start fails raises nothing there (an initializer that raises breaks the pool with a
    traceback printed by each process); every task it is given raises the reason instead."""
    monkeypatch.setattr(precompile, "compile_without_device", lambda cc: (_ for _ in ()).throw(OSError("no NVVM")))
    monkeypatch.setattr(precompile, "_WORKER_ERROR", None)
    precompile._start_worker((9, 0), ())
    with pytest.raises(OSError, match="no NVVM"):
        precompile._compile_task(("math", "pi", None, None, None), ())


def test_rebuild_follows_a_recipe():
    """A recipe names a factory and its arguments (or a module-level kernel): rebuilding gives the very
    object the factory returns in this process (so a worker process gets the same disk-cache key)."""
    from kernels_numba import rmsnorm
    factory = rmsnorm._make_kernel
    assert precompile.rebuild((rmsnorm.__name__, "_make_kernel", (False, True), (), None)) is factory(False, True)
    assert precompile.rebuild(("math", "pi", None, None, None)) == math.pi
    assert precompile.rebuild(("builtins", "divmod", (7, 2), (), 1)) == 1


def test_recording_under_the_simulator_records_nothing():
    """Under the simulator (no compiler, no disk cache) recording leaves launches alone."""
    with precompile.recording() as needed:
        pass
    assert len(needed) == 0


# ---- GPU: a fresh machine, a second process, three identical calls --------------------------------

CHILD = """
import json, sys, time
t = time.perf_counter()
from kernels_numba import bridge, precompile
compile_all, phase = precompile.compile_all, {}

def compile_all_logged(needed, **kwargs):           # what the engine's compile phase recorded and compiled
    phase.update(specialisations=len(needed), task_s=compile_all(needed, **kwargs))
    return phase["task_s"]

precompile.compile_all = compile_all_logged
from pagedattn import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", dtype="float16", max_model_len=256, max_num_seqs=8)
t_llm = time.perf_counter() - t
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print(json.dumps(dict(times=llm.engine.startup_times, after_first_token=bridge.disk_cache_stats(), llm_s=t_llm,
                      compile_phase=phase)))
"""


@pytest.mark.gpu
def test_second_process_finds_every_kernel_on_disk(tmp_path):
    """On an empty kernel cache the first process records the specialisations its warm-up lacks, workers
    compile each as its own task and the process saves them into the disk cache: its own warm-up then
    loads every one (0 compiled), and so does a second process, which compiles nothing, neither at LLM()
    nor at the first token."""
    ckpt = write_tiny_checkpoint(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PAGEDATTN_CACHE_DIR=str(tmp_path / "pa"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", CHILD, str(ckpt)], env=env, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["times"].get("compile_kernels", 0) > 0, runs
    tasks = first["compile_phase"]["task_s"]
    assert len(tasks) == first["compile_phase"]["specialisations"] > 1, runs    # one task each, none failed
    assert list(tasks.values()) == sorted(tasks.values(), reverse=True), runs    # slowest first
    assert first["times"]["kernels_compiled"] == 0, runs                 # the saved entries load by the same keys
    assert first["times"]["kernels_loaded"] > 0, runs
    assert not second["compile_phase"], runs
    assert "compile_kernels" not in second["times"] and second["times"]["kernels_compiled"] == 0, runs
    assert second["after_first_token"][1] == 0, runs                    # misses: nothing compiled at all
    assert second["after_first_token"][0] > 0, runs                     # hits: every kernel came from the disk


@pytest.mark.gpu
def test_first_call_is_the_program_of_every_later_call(tmp_path):
    """The same 64 requests three times in one process (fp16, CUDA graphs): identical tokens every call
    without prefix caching. With it, calls 2 and 3 (both served from the cache) are identical and call 1
    equals a fresh engine's call 1; between calls 1 and 2 the cached prefix changes the GEMMs' row counts,
    so fp16 roundings (and this random-weight model's near-ties) may differ — a property of prefix caching,
    not of the first call (docs/performance.md gives the real checkpoint's figures)."""
    ckpt = write_tiny_checkpoint(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 vocab_size=1000, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 1000, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 120, (64,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    runs = {}
    for caching in (False, True, True):
        llm = LLM(ckpt, device="cuda", dtype="float16", max_model_len=512, max_num_seqs=64,
                  enable_prefix_caching=caching)
        calls = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(3)]
        llm.close()
        runs.setdefault(caching, []).append(calls)
    off, on, on_again = runs[False][0], runs[True][0], runs[True][1]
    assert off[0] == off[1] == off[2]
    assert on[1] == on[2] and on[0] == on_again[0]
    assert on[0] == off[0]                    # no cache hit in a first call


def test_marker_goes_stale_with_the_numba_cache(tmp_path):
    """The "kernels ready" marker holds only while every index file it names exists: a cleared numba cache
    (or sources copied elsewhere) sends the next start through the parallel compile again."""
    from pagedattn.engine import warmup

    index = tmp_path / "kernel-1.nbi"
    index.write_bytes(b"x")
    marker = tmp_path / "ready" / "key"
    warmup._write_marker(str(marker), {"warm_up": 1.0})
    assert not warmup._marker_holds(str(marker))             # names no index file: this process loaded none
    marker.write_text(json.dumps(dict(index_files=[str(index)])))
    assert warmup._marker_holds(str(marker))
    index.unlink()
    assert not warmup._marker_holds(str(marker))
    assert not warmup._marker_holds(str(tmp_path / "absent"))


def test_tokenizer_loads_beside_the_warm_up(tmp_path, monkeypatch):
    """A tokenizer not ready when the weights are (its first load on a machine goes through transformers)
    keeps loading while the warm-up runs, and the engine has it, with its end-of-sequence id, when LLM()
    returns; a text prompt then works."""
    import threading

    from pagedattn.engine import llm_engine, warmup
    from tests.serving_helpers import write_tiny_chat_checkpoint

    ckpt = write_tiny_chat_checkpoint(tmp_path / "chat")
    real_load, real_warm_up = llm_engine.load_tokenizer, warmup.warm_up
    warm_up_done, seen = threading.Event(), []

    def slow_load(path):
        assert warm_up_done.wait(60), "the tokenizer was waited for before the warm-up"
        return real_load(path)

    def watched_warm_up(engine, *args, **kwargs):
        seen.append(engine.tokenizer)
        try:
            return real_warm_up(engine, *args, **kwargs)
        finally:
            warm_up_done.set()

    monkeypatch.setattr(llm_engine, "load_tokenizer", slow_load)
    monkeypatch.setattr(warmup, "warm_up", watched_warm_up)
    llm = LLM(ckpt, device="cpu", warmup=True, num_blocks=64, max_model_len=64)
    assert seen == [None]
    tok = llm.engine.tokenizer
    assert tok is not None and tok.eos_token_id in llm.engine.eos_token_ids
    assert llm.engine.inputs.tokenizer is tok and llm.engine.outputs.tokenizer is tok
    out = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and isinstance(out[0].outputs[0].text, str)
    assert llm.engine.startup_times["load_tokenizer"] > 0
    llm.close()


def test_a_failed_warm_up_gives_the_engine_back(tmp_path, monkeypatch):
    """An error during the warm-up reaches the caller, and the half-built engine's runner (weights, KV pool,
    workers) is closed on the way, not left to the garbage collector."""
    from pagedattn.engine import model_runner, warmup

    shut = []
    monkeypatch.setattr(model_runner.ModelRunner, "close",
                        lambda self, _real=model_runner.ModelRunner.close: (shut.append(self), _real(self)))

    def failing(engine, *args, **kwargs):
        raise RuntimeError("the warm-up broke")

    monkeypatch.setattr(warmup, "warm_up", failing)
    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    with pytest.raises(RuntimeError, match="the warm-up broke"):
        LLM(ckpt, device="cpu", warmup=True, num_blocks=16, max_model_len=32)
    assert len(shut) >= 1 and all(r is shut[0] for r in shut) and shut[0]._closed
