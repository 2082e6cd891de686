"""Launching a numba kernel with the argument marshalling done once per signature.

numba's `kernel[grid, block, stream, smem](*args)` does on every call: type each argument, find the
specialisation, turn each array into numba's argument structure and each scalar into a ctypes value, and
hand them to cuda.core's launch. That costs tens of microseconds per launch (more with torch tensors as
arguments), longer than many of the kernels run, and an eager prefill step launches over a hundred. Here:

    launch(kernel, grid, block, args, stream=None, smem=0)

looks up a plan by a cheap key of the arguments' kinds (a torch tensor's dtype and rank, a numba array's
numba type, a scalar's Python type); the plan packs the argument values into one preallocated parameter
buffer (a precompiled struct.Struct) and calls the driver's cuLaunchKernel on the compiled kernel.

The first launch of a signature goes through numba as usual (typing, compiling or loading from the disk
cache, launching): the code that runs is always numba's, only the marshalling of later launches is ours.
A plan checks its layout against the driver's own parameter table of the kernel once (cuKernelGetParamInfo)
and is dropped, launching through numba, if they disagree; tests/test_launcher.py checks the packing
against numba's marshalling and against the parameters of kernels compiled for sm_90.

numba's argument layout (numba.cuda.dispatcher._Kernel._prepare_args): an array is 5 + 2 ndim 8-byte
values (meminfo, parent, item count, item size, data pointer, shape, strides in bytes), an integer or float
its own size, a boolean one byte, a tuple its items in order. Each value gets an 8-byte slot of the buffer
(little-endian: the low bytes hold a narrower value) and the driver copies each parameter's size from it.

    args     numba device arrays, torch tensors (contiguous: passed as numba arrays of their dtype and rank),
             Python ints (int64 in the kernel), floats (float64), bools, numpy scalars (their own type),
             tuples of these
    stream   a numba stream (bridge.torch_stream()) or None: torch's current stream of the current device
    smem     dynamic shared memory bytes (above 48 KiB: bridge.allow_dynamic_smem first)

numba launches as usual under the CUDA simulator, while kernels_numba.precompile records, for a
non-contiguous tensor argument, and everywhere when ENABLED is set to False (tests and profiles compare
both ways).

numba warns at a launch of fewer than 128 blocks; a decode step of a few sequences launches such grids
by design, so the first launch here turns that warning off unless NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS says.
"""
import ctypes
import os
import struct
import threading

import numpy as np
from numba import types

from kernels_numba import bridge
from kernels_numba.errors import KernelLaunchError

ENABLED = True                      # False: every launch through numba's own (tests, scripts/profile_startup.py)

_QUIETED = False
_PLANS = {}  # (kernel, device, argument kinds) -> _Plan, or None: launch through numba
_LIB = []  # [libcuda] once loaded, [None] when it cannot be
_FORMATS = {  # numba scalar type -> struct format of its 8-byte slot
    types.int8: "b7x", types.int16: "h6x", types.int32: "i4x", types.int64: "q",
    types.uint8: "B7x", types.uint16: "H6x", types.uint32: "I4x", types.uint64: "Q",
    types.float16: "e6x", types.float32: "f4x", types.float64: "d", types.boolean: "?7x",
}

def slot_formats(argtypes):
    """The struct format of each parameter slot of a kernel with numba argument types `argtypes`
    (8-byte slots), or None when a type is not one the plans pack."""
    out = []
    for ty in argtypes:
        if isinstance(ty, types.Array):
            out += ["q"] * (5 + 2 * ty.ndim)
        elif isinstance(ty, types.BaseTuple):
            inner = slot_formats(tuple(ty))
            if inner is None:
                return None
            out += inner
        elif ty in _FORMATS:
            out.append(_FORMATS[ty])
        else:
            return None
    return out


def param_sizes(argtypes):
    """Bytes of each kernel parameter (what the compiled kernel's parameter table says), or None."""
    formats = slot_formats(argtypes)
    return None if formats is None else [struct.calcsize("<" + f[0]) for f in formats]   # the slot's own value


def _array_values(a):
    """numba's argument values of a numba device array (cached on the array: the bridge's views recur)."""
    values = a.__dict__.get("_launch_values")
    if values is None:
        s = a._strided_memory_view_shim
        strides = s._layout.strides_in_bytes or _c_strides(s.shape, s.dtype.itemsize)
        values = a.__dict__["_launch_values"] = (0, 0, s.size, s.dtype.itemsize, s.ptr or 0) + tuple(s.shape) + \
            tuple(strides)
    return values


_SCALARS = frozenset((int, float, bool, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                      np.uint64, np.float16, np.float32, np.float64, np.bool_))


def _kind(a, tensor_type):
    """A hashable key of what numba would type `a` as; None: not packable here."""
    t = type(a)
    if t in _SCALARS:
        return t
    if isinstance(a, tensor_type):
        return (a.dtype, a.dim()) if a.is_contiguous() else None
    d = getattr(a, "__dict__", None)
    if d is not None and "_launch_kind" in d:
        return d["_launch_kind"]
    numba_type = getattr(a, "_numba_type_", None)
    if numba_type is not None:       # a numba device array: its type as plain values (cheap to hash), kept
        kind = d["_launch_kind"] = (str(numba_type.dtype), numba_type.ndim, numba_type.layout)
        return kind
    if isinstance(a, tuple):
        kinds = tuple(_kind(x, tensor_type) for x in a)
        return None if None in kinds else ("tuple",) + kinds
    return None


def _c_strides(shape, itemsize):
    if len(shape) == 1:
        return (itemsize,)
    if len(shape) == 2:
        return (shape[1] * itemsize, itemsize)
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _values(args, out, tensor_type):
    """Append the parameter values of args (in order, flattened) to the list `out`."""
    for a in args:
        if type(a) in _SCALARS:
            out.append(a)
        elif isinstance(a, tensor_type):
            shape = tuple(a.shape)
            size = a.element_size()
            out += (0, 0, a.numel(), size, a.data_ptr()) + shape + _c_strides(shape, size)
        elif isinstance(a, tuple):
            _values(a, out, tensor_type)
        else:
            out += _array_values(a)
    return out


def _as_numba(args):
    """args with torch tensors replaced by numba views (what numba's own launch takes)."""
    import torch

    return tuple(bridge.as_array(a) if isinstance(a, torch.Tensor) else _as_numba(a) if isinstance(a, tuple) else a
                 for a in args)


def _libcuda():
    if not _LIB:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            c_uint, c_void_p = ctypes.c_uint, ctypes.c_void_p
            lib.cuLaunchKernel.argtypes = [c_void_p] + [c_uint] * 7 + [c_void_p, c_void_p, c_void_p]
            lib.cuLaunchKernel.restype = ctypes.c_int
            _LIB.append(lib)
        except (OSError, AttributeError):
            _LIB.append(None)
    return _LIB[0]


def _error_name(lib, code):
    name = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    return name.value.decode() if name.value else str(code)


class _Plan:
    """One compiled specialisation's launch: its parameter buffer and the driver handle."""

    def __init__(self, lib, handle, formats):
        self.lib, self.handle = lib, handle
        self.struct = struct.Struct("<" + "".join(formats))
        n = len(formats)
        self.buffer = (ctypes.c_uint64 * max(n, 1))()
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(n, 1))(*[base + 8 * i for i in range(n)])
        self.lock = threading.Lock()  # the buffer is read by the driver while the GIL is released

    def launch(self, grid, block, smem, stream, values):
        with self.lock:
            self.struct.pack_into(self.buffer, 0, *values)
            code = self.lib.cuLaunchKernel(self.handle, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                           smem, stream, self.pointers, None)
        if code:
            raise KernelLaunchError(f"cuLaunchKernel failed: {_error_name(self.lib, code)} "
                                    f"(grid {grid}, block {block}, {smem} bytes of shared memory)")


def param_table(lib, handle):
    """The compiled kernel's parameter sizes as the driver lists them (cuKernelGetParamInfo, or
    cuFuncGetParamInfo for a function handle; CUDA 12.4+), or None when the driver cannot say."""
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for name in ("cuKernelGetParamInfo", "cuFuncGetParamInfo"):
        get = getattr(lib, name, None)
        if get is None:
            continue
        sizes = []
        while not get(ctypes.c_void_p(handle), ctypes.c_size_t(len(sizes)), ctypes.byref(offset), ctypes.byref(size)):
            sizes.append(size.value)
        if sizes:
            return sizes
    return None


def _make_plan(kernel, numba_args):
    """The plan of the specialisation numba chose for numba_args (already compiled by a launch), or None."""
    lib = _libcuda()
    if lib is None:
        return None
    argtypes = tuple(kernel.typeof_pyval(a) for a in numba_args)
    compiled = kernel.overloads.get(argtypes)
    formats = slot_formats(argtypes)
    if compiled is None or formats is None or getattr(compiled, "debug", False) or getattr(compiled, "cooperative",
                                                                                            False):
        return None
    cufunc = compiled._codelibrary.get_cufunc()
    handle = int(cufunc.handle)
    table = param_table(lib, handle)
    if table is not None and table != param_sizes(argtypes):
        return None
    return _Plan(lib, handle, formats)


def _dims(d):
    if isinstance(d, int):
        return (d, 1, 1)
    return tuple(d) + (1,) * (3 - len(d))


def _stream_handle(stream):
    if stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(torch.cuda.current_device()) if raw else torch.cuda.current_stream().cuda_stream
    if isinstance(stream, int):
        return stream
    handle = stream.handle
    return int(getattr(handle, "value", handle) or 0)


def _quiet_occupancy_warnings():
    global _QUIETED
    _QUIETED = True
    if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
        from numba.cuda.core import config

        config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


def launch(kernel, grid, block, args, stream=None, smem=0):
    """kernel[grid, block, stream, smem](*args), through a plan after the signature's first launch."""
    import torch

    if not _QUIETED:
        _quiet_occupancy_warnings()

    if bridge.SIMULATOR or bridge.RECORDING or not ENABLED:
        kernel[grid, block, stream if stream is not None else bridge.torch_stream(), smem](*_as_numba(args))
        return
    kinds = tuple(_kind(a, torch.Tensor) for a in args)
    key = (kernel, torch.cuda.current_device(), kinds)
    plan = _PLANS.get(key, False)
    if plan:
        plan.launch(_dims(grid), _dims(block), smem, _stream_handle(stream), _values(args, [], torch.Tensor))
        return
    numba_args = _as_numba(args)
    kernel[grid, block, stream if stream is not None else bridge.torch_stream(), smem](*numba_args)
    if plan is False and None not in kinds:
        _PLANS[key] = _make_plan(kernel, numba_args)


def clear():
    """Forget every plan (the next launch of each signature goes through numba again)."""
    _PLANS.clear()
