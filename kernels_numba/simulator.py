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
"""
import os
import threading

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


def install():
    """Add the warp primitives to the simulator's fake cuda module (idempotent, sim only)."""
    global _installed
    if _installed or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") != "1":
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    for fn in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp):
        setattr(FakeCUDAModule, fn.__name__, fn)
    _installed = True
