"""Compile the kernels a piece of work needs in parallel worker processes, into numba's disk cache.

numba compiles one kernel at a time (a process-wide compiler lock), and a first run on a bare machine
compiles dozens of specialisations, each for seconds. So the work is done twice:

    with precompile.recording() as needed:      # 1. no kernel is launched; those not in the disk cache
        run_the_work()                          #    are recorded (kernel, argument types)
    precompile.compile_all(needed, workers=8)   # 2. worker processes compile them into the disk cache
    run_the_work()                              # 3. every kernel now loads from the disk cache

Step 1 launches nothing, so its results are whatever the buffers held: they are meaningless and must be
thrown away (the engine discards its state and graphs after it). Step 2 groups
the specialisations by kernel function (numba keeps one index file per function: two processes writing
the same index could lose an entry) and hands the groups to the workers, largest first.

A kernel takes part when it was built through bridge.disk_cached / enable_disk_cache with a rebuild
recipe (module, attribute, args, kwargs, index): the worker imports the module and rebuilds it, which
gives the same disk-cache key. Launches of any other kernel are not skipped (they compile in step 1).
"""
import collections
import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import time

from kernels_numba import bridge


class Needed:
    """What a recording found: {rebuild recipe: set of argument-type tuples} and the seconds it took."""

    def __init__(self):
        self.kernels = collections.defaultdict(set)
        self.skipped_launches = 0

    def __len__(self):
        return sum(len(sigs) for sigs in self.kernels.values())

    def add(self, function, recipe, argtypes):
        self.kernels[(function, recipe)].add(argtypes)

    def groups(self):
        """[(function, [(recipe, argtypes), ...])], one per kernel function (module.qualname:line), largest
        first."""
        by_function = collections.defaultdict(list)
        for (function, recipe), sigs in self.kernels.items():
            by_function[function] += [(recipe, sig) for sig in sorted(sigs, key=repr)]
        return sorted(by_function.items(), key=lambda kv: -len(kv[1]))


def available():
    """Parallel compilation needs real kernels and the disk cache (not the simulator, not
    PAGEDATTN_KERNEL_CACHE=0)."""
    return not bridge.SIMULATOR and bridge.KERNEL_CACHE


@contextlib.contextmanager
def recording():
    """Inside the block no kernel with a rebuild recipe is launched: each launch whose specialisation is
    neither in memory nor in the disk cache is recorded into the yielded Needed (one in the disk cache is
    loaded, ready for the real run). Skipping every such launch, not only the missing ones, keeps a
    kernel from running on the output of a skipped one (an index list it would read out of bounds).
    Kernels without a recipe compile and run as usual. Does nothing under the simulator."""
    needed = Needed()
    if not available():
        yield needed
        return
    from numba.cuda.dispatcher import CUDADispatcher

    call = CUDADispatcher.call

    def recorded_call(self, args, launch_config):
        recipe = getattr(self, "_rebuild_recipe", None)
        if recipe is None:
            return call(self, args, launch_config)
        if not self.specialized:
            argtypes = tuple(self.typeof_pyval(a) for a in args)
            if argtypes not in self.overloads and not _load_from_disk(self, argtypes):
                f = self.py_func
                needed.add(f"{f.__module__}.{f.__qualname__}:{f.__code__.co_firstlineno}", recipe, argtypes)
        needed.skipped_launches += 1
        return None

    CUDADispatcher.call = recorded_call
    bridge.RECORDING = True
    try:
        yield needed
    finally:
        CUDADispatcher.call = call
        bridge.RECORDING = False


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


def _compile_group(device_id, items):
    """Worker: compile every (recipe, argtypes) of one kernel function into the disk cache."""
    from numba import cuda

    cuda.select_device(device_id)
    t = time.perf_counter()
    for recipe, argtypes in items:
        rebuild(recipe).compile(argtypes)
    return time.perf_counter() - t


def default_workers():
    return max(1, min(16, (os.cpu_count() or 2) - 1))


def compile_all(needed, workers=None, device_id=0, log=None):
    """Compile what `needed` holds into the disk cache, one kernel function per task, over `workers`
    spawned processes (default: the cores less one, at most 16). Returns {function key: seconds}.
    A group that fails is reported through `log` and left to compile in the caller's next run."""
    groups = needed.groups()
    if not groups:
        return {}
    workers = min(workers or default_workers(), len(groups))
    seconds = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(_compile_group, device_id, items): key for key, items in groups}
        for f in concurrent.futures.as_completed(futures):
            key = futures[f]
            try:
                seconds[key] = f.result()
            except Exception as e:          # noqa: BLE001 - the main process compiles it instead
                if log is not None:
                    log(f"precompiling {key} failed ({type(e).__name__}: {e}); it compiles on first use")
    return seconds
