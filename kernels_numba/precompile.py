"""Compile the kernels a piece of work needs in parallel worker processes, into numba's disk cache.

numba compiles one kernel at a time (a process-wide compiler lock), and a first run on a bare machine
compiles dozens of specialisations, each for seconds. So the work is done twice:

    with precompile.recording() as needed:      # 1. no kernel is launched; those not in the disk cache
        run_the_work()                          #    are recorded (kernel, argument types)
    precompile.compile_all(needed, workers=8)   # 2. worker processes compile them; this process writes
                                                #    them into the disk cache
    run_the_work()                              # 3. every kernel now loads from the disk cache

Step 1 launches nothing, so its results are whatever the buffers held: they are meaningless and must be
thrown away (the engine discards its state and graphs after it).

Step 2 is one task per specialisation (kernel, argument types), so the phase lasts about as long as the
slowest single specialisation, not as long as the kernel function with the most or slowest ones. The
workers (one per core but one, at most MAX_WORKERS) are started by step 1's first missing
specialisation (or at its start, `recording(start_workers=True)`, when misses are expected), and each
missing specialisation is handed to them as soon as step 1 meets it: the
compiles run while the rest of step 1 does (what step 1 cannot hand over goes at step 2, longest first by
an estimate per kernel function: COMPILE_SECONDS). A worker compiles (the PTX, and the cubin linked for the device's compute capability) and writes nothing:
it sends back what numba's cache would write for that specialisation (the kernel's reduced states, cubin
included). A worker never opens the GPU: NVVM and nvJitLink need only the compute capability, which this
process passes it, so the workers take no GPU memory (a CUDA context each would compete with an engine that
already holds its KV pool) and start as fast as an interpreter and the kernels' modules import. This process saves each one with the kernel's own cache object (`save_overload`), so every
entry gets the key a normal compile gives it, and only one process writes an index file (numba keeps one
per kernel function, shared by every specialisation and every closure of that function: two processes
updating it at once could lose an entry).

A kernel takes part when it was built through bridge.disk_cached / enable_disk_cache with a rebuild
recipe (module, attribute, args, kwargs, index): the worker imports the module and rebuilds it, which
gives the same kernel (and so the same cache key). Launches of any other kernel are not skipped (they
compile in step 1). A task that fails is logged and its specialisation compiles on first use.
"""
import collections
import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import time

from kernels_numba import bridge


# Seconds one specialisation of a kernel function takes to compile in a fresh process (typing, PTX, cubin),
# by module.qualname: the order in which tasks are handed out, longest first (only the order matters).
# Measured with `python scripts/compile_seconds.py --no-device` (sm_90 code, the cubin linked by nvJitLink)
# on a 2-core CPU machine, 2026-12-01; that script on the GPU machine gives its own. Functions not listed
# count DEFAULT_SECONDS.
COMPILE_SECONDS = {
    "kernels_numba.paged_attention.make_decode_kernel.<locals>.paged_attention_decode": 24.8,
    "kernels_numba.sampling.make_fallback_kernel.<locals>.split_fallback": 11.9,
    "kernels_numba.paged_prefill_fa2.make_prefill_kernel.<locals>.paged_prefill_attention": 11.2,
    "kernels_numba.sampling._make_split_kernels.<locals>.pass2": 4.0,
    "kernels_numba.sampling._make_split_kernels.<locals>.pass3": 3.8,
    "kernels_numba.paged_attention.make_merge_kernel.<locals>.merge_decode_splits": 3.4,
    "kernels_numba.paged_prefill_fa2.make_plan_kernel.<locals>.plan_work_list": 2.1,
    "kernels_numba.sampling._make_split_kernels.<locals>.pass1": 2.0,
    "kernels_numba.rmsnorm._make_kernel.<locals>.rms_norm_kernel": 1.7,
    "kernels_numba.rotary._make_kernel.<locals>.rotary_cache_kernel": 1.7,
    "kernels_numba.cache_ops._copy_blocks_kernel": 1.2,
    "kernels_numba.activation._make_kernel.<locals>.silu_and_mul_kernel": 1.2,
    "kernels_numba.cache_ops._reshape_and_cache_kernel": 1.1,
    "kernels_numba.paged_prefill_fa2.make_merge_kernel.<locals>.merge_prefill_splits": 1.1,
}
DEFAULT_SECONDS = 2.0


class Task(collections.namedtuple("Task", "function recipe argtypes seconds")):
    """One specialisation to compile: the kernel function (module.qualname:line), its rebuild recipe, the
    argument types, and the estimated seconds (COMPILE_SECONDS)."""

    @property
    def name(self):
        """The kernel function, the factory's arguments when it has any, and the argument types."""
        _, attr, args, kwargs, index = self.recipe
        parts = [repr(a) for a in args or ()] + [f"{k}={v!r}" for k, v in kwargs or ()]
        call = "" if args is None else f" {attr}({', '.join(parts)})"
        pick = "" if index is None else f"[{index}]"
        return f"{self.function}{call}{pick} ({', '.join(map(str, self.argtypes))})"


def estimated_seconds(function):
    """COMPILE_SECONDS of a kernel function key (module.qualname:line), DEFAULT_SECONDS if not listed."""
    return COMPILE_SECONDS.get(function.rsplit(":", 1)[0], DEFAULT_SECONDS)


class Needed:
    """What a recording found: {(kernel function, rebuild recipe): set of argument-type tuples}, and how
    many launches it skipped."""

    def __init__(self):
        self.kernels = collections.defaultdict(set)
        self.skipped_launches = 0
        self.workers = None                 # Workers a recording started at its first miss (compile_all's)
        self.timeline = None                # compile_all's: tasks, workers' start seconds, last result saved
        self.submitted = {}                 # (recipe, argtypes) -> the future of its task, handed over early

    def __len__(self):
        return sum(len(sigs) for sigs in self.kernels.values())

    def close_workers(self):
        """Stop the workers the recording started (when compile_all will not take them over)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            self.submitted.clear()

    def add(self, function, recipe, argtypes):
        self.kernels[(function, recipe)].add(argtypes)

    def groups(self):
        """[(function, [(recipe, argtypes), ...])], one per kernel function (module.qualname:line), largest
        first: what numba keeps one index file for."""
        by_function = collections.defaultdict(list)
        for (function, recipe), sigs in self.kernels.items():
            by_function[function] += [(recipe, sig) for sig in sorted(sigs, key=repr)]
        return sorted(by_function.items(), key=lambda kv: (-len(kv[1]), kv[0]))

    def tasks(self):
        """[Task], one per specialisation, longest first: by estimated seconds, then (among functions of
        the same estimate) the function with the most specialisations first, then by name (a fixed
        order for a given recording)."""
        count = collections.Counter(function for (function, _), sigs in self.kernels.items() for _ in sigs)
        tasks = [Task(function, recipe, sig, estimated_seconds(function))
                 for (function, recipe), sigs in self.kernels.items() for sig in sigs]
        return sorted(tasks, key=lambda t: (-t.seconds, -count[t.function], t.function, repr(t.recipe),
                                            repr(t.argtypes)))


def available():
    """Parallel compilation needs real kernels and the disk cache (not the simulator, not
    PAGEDATTN_KERNEL_CACHE=0)."""
    return not bridge.SIMULATOR and bridge.KERNEL_CACHE


@contextlib.contextmanager
def recording(start_workers=False):
    """Inside the block no kernel with a rebuild recipe is launched: each launch whose specialisation is
    neither in memory nor in the disk cache is recorded into the yielded Needed (one in the disk cache is
    loaded, ready for the real run). Skipping every such launch, not only the missing ones, keeps a
    kernel from running on the output of a skipped one (an index list it would read out of bounds).
    Kernels without a recipe compile and run as usual. Does nothing under the simulator.

    The first missing specialisation starts the worker processes (Workers: default_workers() of them, for
    the current device), so that their start overlaps the rest of the recording; compile_all(needed)
    takes them over. A recording that finds nothing starts none. start_workers: start them at once instead
    (the caller expects misses: an empty cache), so their start overlaps the recording from its beginning;
    if it then finds nothing, needed.close_workers() stops them."""
    needed = Needed()
    if not available():
        yield needed
        return
    from numba import cuda
    from numba.cuda.dispatcher import CUDADispatcher

    call = CUDADispatcher.call
    workers_asked = False                   # the workers start once, at the first miss (or now)

    def ask_workers():
        nonlocal workers_asked
        workers_asked = True
        try:
            needed.workers = Workers(default_workers(), cuda.get_current_device().compute_capability,
                                     worker_modules())
        except Exception:                   # noqa: BLE001 - compile_all starts its own
            needed.workers = None

    if start_workers:
        ask_workers()

    def recorded_call(self, args, launch_config):
        recipe = getattr(self, "_rebuild_recipe", None)
        if recipe is None:
            return call(self, args, launch_config)
        if not self.specialized:
            argtypes = tuple(self.typeof_pyval(a) for a in args)
            if argtypes not in self.overloads and not _load_from_disk(self, argtypes):
                f = self.py_func
                needed.add(f"{f.__module__}.{f.__qualname__}:{f.__code__.co_firstlineno}", recipe, argtypes)
                if not workers_asked:
                    ask_workers()
                key = (recipe, argtypes)
                if needed.workers is not None and key not in needed.submitted and _saves_to_disk(self):
                    needed.submitted[key] = needed.workers.executor.submit(_compile_task, recipe, argtypes)
        needed.skipped_launches += 1
        return None

    CUDADispatcher.call = recorded_call
    bridge.RECORDING = True
    try:
        yield needed
    except BaseException:
        needed.close_workers()
        raise
    finally:
        CUDADispatcher.call = call
        bridge.RECORDING = False


def worker_modules():
    """The modules a worker imports at its start: this process's kernels_numba modules but those that import
    torch at their top (the CPU kernels' modules: no CUDA kernel there). The GPU kernels' modules import
    torch only where a launch needs it, so a worker's start is an interpreter, numba and these modules:
    seconds less than with torch (~3.4 s more a process on a host without compiled bytecode, and a
    worker per core importing it at once)."""
    import sys

    return sorted(name for name, m in list(sys.modules.items())
                  if name.startswith("kernels_numba.") and m is not None and "torch" not in vars(m))


def _load_from_disk(kernel, argtypes):
    """Load this specialisation from the disk cache into `kernel`; False when it is not there."""
    loaded = kernel._cache.load_overload(argtypes, kernel.targetctx)
    if loaded is None:
        return False
    kernel._cache_hits[argtypes] += 1
    kernel.add_overload(loaded, argtypes)
    return True


def rebuild(recipe):
    """The kernel a recipe (module, attribute, args, kwargs, index) names, disk-cached as in its factory."""
    module, attr, args, kwargs, index = recipe
    obj = getattr(importlib.import_module(module), attr)
    if args is not None:
        obj = obj(*args, **dict(kwargs))
    return obj if index is None else obj[index]


class Workers:
    """`count` spawned processes that compile tasks for GPUs of compute capability `cc` (major, minor). Each
    starts (in the background) by importing `modules` (worker_modules(): an interpreter, numba and the
    kernels' modules, not torch), seconds that overlap whatever this process does meanwhile. They open no
    CUDA context."""

    def __init__(self, count, cc, modules=()):
        self.count, self.cc = count, tuple(cc)
        self.started = time.time()
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=count, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
            initargs=(self.cc, tuple(modules)))
        # the executor spawns a process per task it cannot place; each answers when its start is done
        self.hello = [self.executor.submit(_ready) for _ in range(count)]

    def ready_seconds(self):
        """Seconds from the start to each worker's start being done, in order (a worker that started early
        may answer for a later one: those that answered)."""
        at = {}
        for f in self.hello:
            if f.done() and not f.cancelled() and f.exception() is None:
                pid, t = f.result()
                at[pid] = t - self.started
        return sorted(at.values())

    def close(self):
        """Stop the processes; queued tasks are dropped."""
        self.executor.shutdown(wait=False, cancel_futures=True)


_WORKER_ERROR = None  # in a worker: why its start failed (each task then raises it; see _start_worker)
_READY_AT = None      # in a worker: when its start was done (time.time())


def _ready():
    """Worker: (its pid, when its start was done)."""
    return os.getpid(), _READY_AT


def _start_worker(cc, modules):
    """Worker start: compile for `cc` without a device (compile_without_device), and import the modules the
    tasks will rebuild kernels from (an import that fails is left to the task). Nothing here raises: an
    initializer that raises makes the pool print a traceback and break; a task reports it instead."""
    global _WORKER_ERROR, _READY_AT
    try:
        compile_without_device(cc)
    except Exception as e:                  # noqa: BLE001 - raised again by every task
        _WORKER_ERROR, _READY_AT = e, time.time()
        return
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:                   # noqa: BLE001 - the task that needs it reports it
            pass
    _READY_AT = time.time()


def compile_without_device(cc):
    """Make numba-cuda compile kernels for compute capability `cc` in this process without a GPU: its
    compiler asks the device for nothing but the compute capability (the kernel's target, the PTX and cubin
    caches' key); here that answer comes from `cc`, and any other device query still goes to the driver. For
    worker processes, which compile and never launch."""
    from numba.cuda import codegen, dispatcher

    cc = tuple(int(v) for v in cc)
    target = (cc[0], cc[1], "a" if cc >= (9, 0) else "")            # the key numba-cuda itself gives a device
    device = collections.namedtuple("CompileTarget", "compute_capability")(cc)
    dispatcher.get_current_device = lambda: device
    codegen.CUDACodeLibrary._ensure_cc = lambda self, want: target if want is None else want


def _has_disk_cache(recipe):
    """The recipe's kernel keeps its code in numba's disk cache (without a cache directory it has numba's
    NullCache: nowhere to save). A recipe that does not rebuild here counts as cached: its worker fails
    and says why."""
    try:
        return _saves_to_disk(rebuild(recipe))
    except Exception:                       # noqa: BLE001 - reported by the task
        return True


def _saves_to_disk(kernel):
    """A kernel with numba's disk cache (one without a cache directory has NullCache, without `_impl`)."""
    return hasattr(kernel._cache, "_impl")


def _compile_task(recipe, argtypes):
    """Worker: compile one specialisation, writing nothing to the disk cache. Returns (payload, seconds):
    payload is what numba's cache would write for it (the kernel's reduced states: PTX and cubin
    included, serialised by numba), seconds the compile's alone (not the module's import)."""
    if _WORKER_ERROR is not None:
        raise _WORKER_ERROR
    from numba.cuda.dispatcher import _Kernel
    from numba.cuda.serialize import dumps

    kernel = rebuild(recipe)
    t = time.perf_counter()
    compiled = _Kernel(kernel.py_func, argtypes, **kernel.targetoptions)    # as the dispatcher's compile does
    compiled._codelibrary.get_cubin()      # linked now (a compile in place would load it: bind), carried along
    if getattr(compiled, "launch_config_sensitive", False):
        raise RuntimeError("its cache key depends on the launch configuration")
    payload = dumps(kernel._cache._impl.reduce(compiled))
    return payload, time.perf_counter() - t


def save_compiled(recipe, argtypes, payload):
    """Write a worker's payload into the disk cache through the kernel's own cache object: the entry is
    keyed exactly as a compile in this process would key it, and a later load finds it."""
    import pickle

    kernel = rebuild(recipe)
    cache = kernel._cache
    compiled = cache._impl.rebuild(kernel.targetctx, pickle.loads(payload))     # as a load from disk does
    compiled.target_context = kernel.targetctx      # a compiled kernel's; the key takes its codegen's
    cache.save_overload(argtypes, compiled)


MAX_WORKERS = 16  # each worker is an interpreter with numba and torch (~0.5 GiB of host memory)


def default_workers():
    """Every core this process may run on but one (this process runs the rest of the recording while they
    compile), at most MAX_WORKERS: an engine's warm-up needs ~16 specialisations, and the slowest one
    bounds the phase."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                  # not on Linux
        cores = os.cpu_count() or 2
    return max(1, min(MAX_WORKERS, cores - 1))


def compile_all(needed, workers=None, cc=None, log=None):
    """Compile what `needed` holds into the disk cache, one specialisation per task, longest first, over
    the processes its recording started (needed.workers: default_workers()) or else `workers` spawned now
    (default_workers(); never more than the tasks), for compute capability `cc` (default: the current
    device's). This process saves each result as it arrives (kernels without a disk cache are left out).
    Returns {task name: seconds the worker spent compiling it}, slowest first (the phase cannot end before
    the first). What fails is reported through `log` in one line and left to compile on first use."""
    tasks = [t for t in needed.tasks() if _has_disk_cache(t.recipe)]
    if cc is None:
        from numba import cuda

        cc = cuda.get_current_device().compute_capability
    pool, needed.workers = needed.workers, None
    early, needed.submitted = needed.submitted, {}
    if pool is not None and (not tasks or pool.cc != tuple(cc)):
        pool.close()
        pool, early = None, {}
    if not tasks:
        return {}
    if pool is None:
        pool = Workers(min(workers or default_workers(), len(tasks)), cc)
    seconds, failed = {}, []
    with pool.executor:
        futures = {}
        for t in tasks:             # those handed over during the recording, then the rest (FIFO order)
            f = early.get((t.recipe, t.argtypes))
            futures[f if f is not None else pool.executor.submit(_compile_task, t.recipe, t.argtypes)] = t
        for f in concurrent.futures.as_completed(futures):
            task = futures[f]
            try:
                payload, seconds[task.name] = f.result()
                save_compiled(task.recipe, task.argtypes, payload)
            except Exception as e:          # noqa: BLE001 - the main process compiles it instead
                seconds.pop(task.name, None)
                failed.append((task, e))
        # where the phase's time went: the workers' starts, and when the last result was saved
        needed.timeline = dict(tasks=len(tasks), early=len(early), workers=pool.count,
                               workers_ready_s=pool.ready_seconds(), last_saved_s=time.time() - pool.started)
    if failed and log is not None:
        task, e = failed[0]
        why = (str(e).strip().splitlines() or [""])[0][:300]
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        log(f"precompiling {task.name}{more} failed ({type(e).__name__}: {why}); "
            f"{'they compile' if more else 'it compiles'} on first use")
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
