"""Warp primitives for numba's CUDA simulator (active only under NUMBA_ENABLE_CUDASIM=1).

The simulator runs every CUDA thread of a block as a real Python thread but has no
`shfl_*_sync` and no `syncwarp`. `install()` adds them to the simulator's fake `cuda`
module, so kernels call `cuda.shfl_down_sync(...)` unchanged on the GPU and on the CPU.

How: the 32 threads of a warp meet at a `threading.Barrier` (one per warp of the block
being simulated), each publishes its value into the warp's slot list, and after a second
barrier each reads the slot of its source lane. Like the hardware with a full mask, every
lane of the warp must reach the same shuffle (a lane that exits early would hang its warp,
so the barrier has a timeout that turns that bug into an error).

Semantics follow the PTX `shfl.sync` instructions with width 32 (numba's API has no width):
    shfl_sync(mask, v, src)        lane gets v of lane src % 32
    shfl_up_sync(mask, v, d)       lane gets v of lane - d, or its own v if lane < d
    shfl_down_sync(mask, v, d)     lane gets v of lane + d, or its own v if lane + d > 31
    shfl_xor_sync(mask, v, m)      lane gets v of lane ^ m
A warp narrower than 32 (blockDim not a multiple of 32) uses its own size; a source lane
outside it returns the caller's own value.

`install()` also replaces the simulator's block scheduler. The stock one has the launching thread poll
every simulated thread in a loop (`is_alive`, a flag per thread) to find when all of them wait in
`syncthreads`; under the GIL that loop takes most of the interpreter's time from the threads doing
the work (a 128-thread kernel ran ~10x slower than it needs to). Here the block's threads meet at a
condition variable instead: `syncthreads` releases the block when every thread still alive waits there
(threads that returned do not take part, as in the stock simulator), and the launching thread just
joins them. A thread that raises aborts the others (their `syncthreads`, shuffles and warp barriers
raise) and its exception is re-raised from the launch, as before.
"""
import os
import threading

import numpy as np

_BARRIER_TIMEOUT_S = 120.0
_installed = False
_state_lock = threading.Lock()


class _WarpState:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_BARRIER_TIMEOUT_S)
        self.slots = [None] * 32


def _warp():
    """(state of the calling thread's warp, lane id) for the block being simulated."""
    t = threading.current_thread()
    manager = t._manager  # one simulator BlockManager per simulated block
    warp_id, lane = divmod(t.thread_id, 32)
    with _state_lock:
        if getattr(manager, "_pagedattn_failed", None) is not None:
            raise RuntimeError("block aborted: another thread failed")
        warps = manager.__dict__.setdefault("_pagedattn_warps", {})
        state = warps.get(warp_id)
        if state is None:
            bx, by, bz = manager._block_dim
            size = min(32, bx * by * bz - 32 * warp_id)
            state = warps[warp_id] = _WarpState(size)
    return state, lane


def _exchange(value, src_of_lane):
    state, lane = _warp()
    state.slots[lane] = value
    state.barrier.wait()
    src = src_of_lane(lane)
    out = state.slots[src] if 0 <= src < state.size else value
    state.barrier.wait()  # nobody overwrites a slot before every lane has read
    return out


def shfl_sync(self, mask, value, src_lane):
    return _exchange(value, lambda lane: int(src_lane) % 32)


def shfl_up_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane - int(delta) if lane >= int(delta) else lane)


def shfl_down_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane + int(delta) if lane + int(delta) < 32 else lane)


def shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(value, lambda lane: lane ^ int(lane_mask))


def lane_id():
    """Lane of the calling simulated thread."""
    return threading.current_thread().thread_id % 32


def warp_all(value):
    """Every lane's value (a list indexed by lane; None past a narrow warp's end).

    For warp-collective operations the simulator has to emulate as a whole, such as
    common.mma_m16n8k16_*: each lane publishes its fragment and reads everyone's.
    """
    state, lane = _warp()
    state.slots[lane] = value
    state.barrier.wait()
    values = list(state.slots[: state.size]) + [None] * (32 - state.size)
    state.barrier.wait()
    return values


def syncwarp(self, mask=0xFFFFFFFF):
    state, _ = _warp()
    state.barrier.wait()


class _Block:
    """What the threads of one simulated block share: how many are alive, how many wait in
    syncthreads, and a generation counter that moves on each release."""

    def __init__(self, size):
        self.cond = threading.Condition()
        self.live, self.waiting, self.generation = size, 0, 0

    def release_if_all_wait(self):  # with self.cond held
        if self.live and self.waiting == self.live:
            self.waiting, self.generation = 0, self.generation + 1
            self.cond.notify_all()


def _syncthreads(self):
    """BlockThread.syncthreads: wait until every live thread of the block is here."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = self._manager._pagedattn_block
    with block.cond:
        generation = block.generation
        block.waiting += 1
        block.release_if_all_wait()
        while block.generation == generation and not self.abort:
            block.cond.wait()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _abort_block(manager, failed):
    """`failed` raised: remember the block's first failure, then wake everyone so they raise too."""
    for t in manager._pagedattn_threads:
        t.abort = True
    with _state_lock:
        if manager._pagedattn_failed is None:
            manager._pagedattn_failed = failed
        for state in manager.__dict__.get("_pagedattn_warps", {}).values():
            state.barrier.abort()
    block = manager._pagedattn_block
    with block.cond:
        block.cond.notify_all()


def _run_block(self, grid_point, *args):
    """BlockManager.run: start the block's threads, join them, re-raise the first error."""
    from numba.cuda.simulator.kernel import BlockThread

    self._pagedattn_block = _Block(int(np.prod(self._block_dim)))
    self._pagedattn_threads = threads = []
    self._pagedattn_failed = None           # the first thread to raise (the others follow from the abort)

    def target():
        try:
            self._f(*args)
        except BaseException:
            _abort_block(self, threading.current_thread())
            raise
        finally:
            block = self._pagedattn_block
            with block.cond:
                block.live -= 1
                block.release_if_all_wait()

    for block_point in np.ndindex(*self._block_dim):
        threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = self._pagedattn_failed
    if first is not None and first.exception:
        raise first.exception[0].with_traceback(first.exception[1])


def _poisoned_local_array(self, shape, dtype, alignment=None):
    """cuda.local.array with its floats NaN: a thread's registers hold whatever was there before, so a kernel
    that uses an element it never wrote (say, 0 x a stale inf) must fail here, not only on some GPU run."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f":
        a.fill(np.nan)
    return a


def install():
    """Add the warp primitives to the simulator's fake cuda module and replace its block scheduler
    (idempotent, sim only)."""
    global _installed
    if _installed or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") != "1":
        return
    from numba.cuda.simulator.kernel import BlockManager, BlockThread
    from numba.cuda.simulator.kernelapi import FakeCUDALocal, FakeCUDAModule

    for fn in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp):
        setattr(FakeCUDAModule, fn.__name__, fn)
    FakeCUDALocal.array = _poisoned_local_array
    BlockThread.syncthreads = _syncthreads
    BlockManager.run = _run_block
    _installed = True
