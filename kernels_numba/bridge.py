"""The one bridge between torch tensors and numba kernels: views, streams, scratch, device facts.

Every torch entry point of kernels_numba launches through these helpers:

    SIMULATOR                         True under NUMBA_ENABLE_CUDASIM=1 (CPU tensors, numpy views)
    torch_stream(device=None)         the numba stream wrapping torch's current CUDA stream (0 in the
                                      simulator): kernels run in order with torch's own work and can be
                                      captured by torch.cuda.graph
    device_guard(device)              context manager: `device` is the current CUDA device inside
    capturing()                       True while torch captures a CUDA graph on the current stream
    check_tensor(name, t, dim, dtypes)  KernelLaunchError naming `name` unless t is a tensor on the
                                      kernels' device with that rank and one of those dtypes
    as_array(t, dtype=None, flat=False)   zero-copy numba view of t (numpy under the simulator),
                                      reinterpreted as "int16" / "int32" / "uint32" bits, flattened
    cached_view(t, dtype=None, flat=False)  the same, cached by (address, shape, dtype, device, view):
                                      wrapping costs tens of microseconds per tensor, and the pool, the
                                      block tables and the engine's static buffers are the same tensors
                                      call after call (the cache keeps them alive; clear_caches drops it)
    words(t)                          1-D uint32 view of t's bytes from its first element to its last (rows
                                      may be strided views, e.g. q/k/v inside a merged qkv output)
    ints(t)                           a contiguous 1-D int32/int64 tensor as a kernel argument
                                      (both: built from the address without keeping t alive, cached by
                                      address: the caching allocator hands a step's activations out at
                                      the same addresses step after step; under the simulator numpy
                                      views the simulator neither copies nor writes back)
    scratch(device, shape, dtype=np.float32, zero=False, tag=None)  a persistent buffer per (device,
                                      stream, shape, dtype, tag): launches on one stream run in order, so reusing it
                                      is safe, also inside a captured graph. zero=True: one buffer per
                                      (device, shape, dtype, tag) on every stream, zero-filled once when
                                      first made (the kernels that use it leave it zero); a graph captured
                                      on any stream after a warm-up launch finds it (see scratch)
    num_sms(device)                   streaming multiprocessors of the device (132 on an H200)
    allow_dynamic_smem(kernel, args, nbytes)  lets a kernel take more than 48 KiB of dynamic shared memory
    owner(token)                      context manager: the cached views and scratch buffers made or
                                      reused inside belong (also) to `token`, e.g. one engine
    release(token)                    `token` gives up its share: an entry no owner holds any more is
                                      dropped, with the tensor it kept alive (an engine's close);
                                      entries made outside any owner stay until clear_caches
    clear_caches()                    drop the cached views and scratch buffers
    disk_cached(factory)              decorator for a kernel factory: the kernels it builds keep their
                                      compiled code (cubin) in numba's on-disk cache, so the next
                                      process loads them instead of compiling (PAGEDATTN_KERNEL_CACHE=0:
                                      off; NUMBA_CACHE_DIR: where, default kernels_numba/__pycache__)
    enable_disk_cache(kernel, spec, recipe=None)  the same for one kernel; spec: plain values naming
                                      what it is compiled from; recipe: how another process rebuilds
                                      it (kernels_numba.precompile compiles in worker processes)
    disk_cache_stats()                (loaded from disk, compiled) specialisations so far, this process

Kernels are launched by kernels_numba.launcher.launch(kernel, grid, block, args, stream, smem): numba's
launch for a signature's first call, a per-signature plan (the argument marshalling done once) after it.

Tensors stay torch's: nothing here copies data or synchronises the device. numba.cuda is imported by the
helpers that touch a GPU, when first called: a CPU engine, which imports this module for owner/release,
does not pay for it.
"""
import contextlib
import contextvars
import functools
import os

import numpy as np

from kernels_numba.sources import source_digest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
KERNEL_CACHE = os.environ.get("PAGEDATTN_KERNEL_CACHE", "1") != "0"
SMEM_PER_CTA_MAX = 227 * 1024  # H100/H200: the most dynamic shared memory one CTA may have
_MAX_CACHED = 256
_MAX_ADDRESS_VIEWS = 4096

_STREAMS = {}  # torch stream handle -> numba external stream
_VIEWS = {}  # (data_ptr, shape, dtype, device, view) -> (numba view, tensor kept alive, owners)
_ADDRESS_VIEWS = {}  # (device, address, length, type) -> numba device array (not keeping the tensor alive)
_SCRATCH = {}  # (device, stream, shape, dtype, zero) -> (numba view, tensor, owners)
_OWNER = contextvars.ContextVar("kernels_numba_cache_owner", default=None)  # see owner()
_SMS = {}  # device index -> SM count
_DYNAMIC_SMEM = set()  # (kernel, device, argument kinds) that have opted in to > 48 KiB
_DISK_CACHED = []  # kernels whose compiled code goes to the disk cache
RECORDING = False  # inside kernels_numba.precompile.recording(): launches needing a compile are skipped


def torch_stream(device=None):
    """The numba stream that wraps torch's current CUDA stream (0 under the simulator).

    Launching on it orders kernels with torch's own work and lets torch.cuda.graph capture them.
    """
    if SIMULATOR:
        return 0
    import torch

    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        from numba import cuda

        stream = _STREAMS[handle] = cuda.external_stream(handle)
    return stream


@contextlib.contextmanager
def device_guard(device):
    """Make `device` (a torch.device) the current CUDA device for the block, if it is not already."""
    import torch

    if SIMULATOR or device.type != "cuda" or torch.cuda.current_device() == device.index:
        yield
    else:
        with torch.cuda.device(device):
            yield


def capturing():
    """True while a CUDA graph is being captured on torch's current stream (host checks that
    synchronise must be skipped then); always False under the simulator."""
    if SIMULATOR:
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def check_tensor(name, t, dim=None, dtypes=None):
    """Raise KernelLaunchError naming `name` unless t is a torch tensor on the kernels' device
    (CUDA, or CPU under the simulator) with `dim` dims and a dtype in `dtypes`."""
    import torch

    from kernels_numba.errors import KernelLaunchError

    if not isinstance(t, torch.Tensor):
        raise KernelLaunchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if SIMULATOR:
        if t.device.type != "cpu":
            raise KernelLaunchError(f"{name} must be a CPU tensor in the CUDA simulator, got {t.device}")
    elif t.device.type != "cuda":
        raise KernelLaunchError(f"{name} must be a CUDA tensor, got {t.device}")
    if dim is not None and t.dim() != dim:
        raise KernelLaunchError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise KernelLaunchError(f"{name}.dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def as_array(t, dtype=None, flat=False):
    """Zero-copy numba view of a contiguous torch tensor: a device array on CUDA (launch on torch's
    stream: no synchronisation here), the CPU buffer as numpy under the simulator.

    dtype: None (t's own), "int16", "int32" (the last dim halves for 16-bit t) or "uint32" (the
    same bits as "int32"; under the simulator all three are unsigned); flat: a 1-D view.
    """
    import torch

    x = t
    if dtype is not None:
        x = x.view(torch.int16 if dtype == "int16" else torch.int32)
    if flat:
        x = x.view(-1)
    if SIMULATOR:  # unsigned: numpy refuses a uint32 above 2**31 into int32 (the GPU stores the bits)
        arr = x.numpy()
        return arr.view({"int16": np.uint16, "int32": np.uint32, "uint32": np.uint32}[dtype]) if dtype else arr
    from numba import cuda

    arr = cuda.as_cuda_array(x, sync=False)
    return arr.view(np.uint32) if dtype == "uint32" else arr


def cached_view(t, dtype=None, flat=False):
    """as_array(t, dtype, flat), made once per (address, shape, dtype, device, view) and reused."""
    key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device, dtype, flat)
    hit = _VIEWS.get(key)
    if hit is None:
        if len(_VIEWS) >= _MAX_CACHED:
            _VIEWS.pop(next(iter(_VIEWS)))
        hit = _VIEWS[key] = (as_array(t, dtype, flat), t, set())
    hit[2].add(_OWNER.get())
    return hit[0]


def _span(t):
    """Elements from t's first to its last element (strided views included)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _address_view(t, n, typestr):
    key = (t.device.index, t.data_ptr(), n, typestr)
    arr = _ADDRESS_VIEWS.get(key)
    if arr is None:
        from numba import cuda

        desc = {"shape": (n,), "strides": None, "typestr": typestr, "data": (t.data_ptr(), False), "version": 3}
        arr = cuda.from_cuda_array_interface(desc, owner=None, sync=False)
        if len(_ADDRESS_VIEWS) >= _MAX_ADDRESS_VIEWS:
            _ADDRESS_VIEWS.pop(next(iter(_ADDRESS_VIEWS)))
        _ADDRESS_VIEWS[key] = arr
    return arr


def words(t):
    """1-D uint32 view of the bytes from t's first element to its last (a multiple of 4 bytes)."""
    import torch

    n = _span(t) * t.element_size() // 4
    if not SIMULATOR:
        return _address_view(t, n, "<u4")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    flat = torch.as_strided(t, (_span(t),), (1,))                          # t's storage from its first element
    return FakeCUDAArray(flat.view(torch.int32).numpy().view(np.uint32)[:n])


def ints(t):
    """A contiguous 1-D int32/int64 tensor as a kernel argument."""
    if not SIMULATOR:
        return _address_view(t, t.shape[0], "<i4" if t.element_size() == 4 else "<i8")
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.numpy())


def scratch(device, shape, dtype=np.float32, zero=False, tag=None):
    """A persistent numba array of `shape` on `device`. tag: a family's own buffers (never shared with
    another family's of the same shape).

    zero=False: one per (device, current stream, shape, dtype, tag), contents undefined: launches on one
    stream run in order, so reusing it is safe; two streams never share one.
    zero=True: one per (device, shape, dtype, tag), whatever the stream: zero-filled when made, and every
    kernel using it leaves it zero when it ends (counters it counts back down). Being the stream's alone
    would make torch's own capture recipe fail (warm up on a side stream, then capture on torch's capture
    stream: the buffer would be first needed inside the capture, where it cannot be zeroed), so it is not;
    launches that share it must not overlap (one stream, or graphs replayed one after another), as with
    every buffer a captured graph holds."""
    import torch

    dtype = np.dtype(dtype)
    key = (device, None if zero else _current_stream(device), tuple(shape), dtype.str, zero, tag)
    hit = _SCRATCH.get(key)
    if hit is None:
        if zero and _capturing():
            # Made here, the buffer would come from the graph's memory pool, and torch.zeros would only be
            # recorded into that graph: its bytes stay whatever the pool held until the graph replays. A
            # launch of the same shape before the capture (on any stream) makes it, zeroed once and for all.
            raise RuntimeError(f"zero-filled scratch {tuple(shape)} {dtype} (tag {tag!r}) first requested inside a "
                               f"CUDA graph capture: run the launch once before capturing")
        tdtype = {"<f4": torch.float32, "<i4": torch.int32, "<u4": torch.int32, "<i8": torch.int64}[dtype.str]
        t = (torch.zeros if zero else torch.empty)(tuple(shape), dtype=tdtype, device=device)
        hit = _SCRATCH[key] = (as_array(t, "uint32" if dtype.str == "<u4" else None), t, set())
    hit[2].add(_OWNER.get())
    return hit[0]


def _current_stream(device):
    """The handle of torch's current stream on `device` (0 under the simulator)."""
    if SIMULATOR:
        return 0
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def _capturing():
    """Is the current stream capturing a CUDA graph?"""
    if SIMULATOR:
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def num_sms(device):
    """SM count of a torch device (the H200's 132 under the simulator, where plans are only checked)."""
    if SIMULATOR:
        return 132
    n = _SMS.get(device.index)
    if n is None:
        import torch

        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def allow_dynamic_smem(kernel, args, nbytes):
    """Beyond 48 KiB of dynamic shared memory a kernel must opt in (the driver's
    MAX_DYNAMIC_SHARED_SIZE_BYTES attribute) before its first launch: compile the
    specialisation for these arguments now and set the attribute on it. Each specialisation
    is configured for the most any launch may ask (SMEM_PER_CTA_MAX), once; the per-call check
    is a set lookup on what decides the specialisation (dtype and rank of each array)."""
    if SIMULATOR or nbytes <= 48 * 1024 or RECORDING:
        return
    from numba import cuda

    kinds = tuple((getattr(x, "dtype", None), getattr(x, "ndim", type(x))) for x in args)
    key = (id(kernel), cuda.get_current_device().id, kinds)
    if key in _DYNAMIC_SMEM:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    argtypes = tuple(kernel.typeof_pyval(x) for x in args)
    cufunc = kernel.compile(argtypes)._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, SMEM_PER_CTA_MAX, cufunc.handle, cufunc.device.id)
    _DYNAMIC_SMEM.add(key)


@contextlib.contextmanager
def owner(token):
    """Inside the block, every cached view and scratch buffer made or reused is (also) `token`'s.

    Why owners: a captured CUDA graph keeps the raw addresses of the scratch buffers and views its
    kernels used, and two engines on one stream share scratch of the same shape. So nothing is freed
    while any owner may still replay it; release(token) frees what only `token` held. token: any
    hashable object that does not itself keep the owner alive (an engine keeps a plain object())."""
    reset = _OWNER.set(token)
    try:
        yield token
    finally:
        _OWNER.reset(reset)


def release(token):
    """`token` gives up its share of the cached views and scratch buffers; those no owner holds any
    more are dropped (their tensors are freed once nothing else holds them). Returns how many."""
    dropped = 0
    for cache in (_VIEWS, _SCRATCH):
        for key, (_, _, owners) in list(cache.items()):
            owners.discard(token)
            if not owners:
                del cache[key]
                dropped += 1
    return dropped


def cached_tensors():
    """The tensors the caches keep alive now (views' tensors and scratch buffers): for tests."""
    return [hit[1] for cache in (_VIEWS, _SCRATCH) for hit in cache.values()]


def clear_caches():
    """Drop the cached numba views (they keep their tensors alive) and the scratch buffers."""
    _VIEWS.clear()
    _ADDRESS_VIEWS.clear()
    _SCRATCH.clear()


# ----------------------------------------------------------------------------------------------
# numba's on-disk cache for kernels built by factories
#
# numba-cuda caches a kernel under a key made of its signature, the GPU, its bytecode and, for a
# closure, a pickle of the closure's cells. Our kernels are closures over constants *and* over
# device functions and intrinsics; numba pickles an intrinsic with a random uuid, so that key
# differs in every process and a second process would never find the first one's entry. The key
# here replaces the cells by the factory's name and arguments (which fix every constant and
# device function of the closure) and a digest of the kernels_numba sources (a device function
# edited in another file must not load a stale kernel).


@functools.lru_cache(maxsize=None)
def _kernel_cache_class():
    from importlib.metadata import version

    from numba.cuda.dispatcher import CUDACache

    numba_cuda_version = version("numba-cuda")

    class KernelCache(CUDACache):
        """numba-cuda's kernel cache, keyed by (signature, GPU, numba-cuda version, spec, sources)."""

        def __init__(self, py_func, spec):
            self._spec = spec
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), numba_cuda_version, self._spec, source_digest())
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key

    return KernelCache


def enable_disk_cache(kernel, spec, recipe=None):
    """Keep `kernel`'s compiled code in numba's on-disk cache under `spec` (a tuple of plain values
    that, with the sources, determines the kernel). No-op under the simulator, when
    PAGEDATTN_KERNEL_CACHE=0, or where numba finds no cache directory. Returns kernel.
    recipe: how another process rebuilds the same kernel, (module, attribute, args, kwargs, index):
    getattr(module, attribute), called with args and dict(kwargs) unless args is None, indexed by index
    unless None (kernels_numba.precompile compiles such kernels in worker processes)."""
    if SIMULATOR or not KERNEL_CACHE:
        return kernel
    if recipe is not None:
        kernel._rebuild_recipe = recipe
    cache_class = _kernel_cache_class()
    if not isinstance(kernel._cache, cache_class):  # numba-cuda 0.30: the dispatcher's cache slot
        try:
            kernel._cache = cache_class(kernel.py_func, spec)
            _DISK_CACHED.append(kernel)
        except RuntimeError:  # "no locator available": nowhere to write, compile as before
            pass
    return kernel


def disk_cache_stats():
    """(hits, misses): kernel specialisations loaded from the disk cache and compiled, in this
    process, over every kernel enable_disk_cache has seen."""
    hits = sum(sum(k.stats.cache_hits.values()) for k in _DISK_CACHED)
    misses = sum(sum(k.stats.cache_misses.values()) for k in _DISK_CACHED)
    return hits, misses


def disk_cached(factory):
    """Decorator for a (lru-cached) kernel factory: each kernel it returns is disk-cached under
    (the factory's module and name, its arguments)."""

    @functools.wraps(factory)
    def build(*args, **kwargs):
        spec = (factory.__module__, factory.__qualname__, args, tuple(sorted(kwargs.items())))
        return enable_disk_cache(factory(*args, **kwargs), spec, recipe=spec + (None,))

    return build
