"""kernels_numba.launcher: the per-signature launch plans against numba's own marshalling.

What can go wrong in a plan is its layout: a parameter of the wrong size or in the wrong place would
hand the kernel garbage. So the layout is checked three ways without a GPU:

* against numba's marshalling (numba.cuda.dispatcher._Kernel._prepare_args, the code numba's launch runs)
  on every kind of argument the kernels take, value by value, byte for byte;
* against the parameter list of kernels compiled for sm_90 (the .entry's .param widths in the PTX): the
  engine's glue kernels with the argument types their launches pass, and one kernel with every scalar type;
* the plan's buffer as the driver reads it (a stand-in for cuLaunchKernel follows the pointer array).

On a GPU (marker `gpu`) the engine's greedy tokens are the same with and without plans, and every kernel a
step launches got a plan (the driver's parameter table agreed with the layout).
"""
import ctypes
import json
import struct

import numpy as np
import pytest
import torch
from numba import cuda

from helpers import compile_in_subprocess
from kernels_numba import launcher

# numba's argument marshalling (in a subprocess: this process runs the CUDA simulator) on fake device
# arrays, each value turned into its bytes, beside the launcher's slots for the same arguments
_MARSHAL_SCRIPT = r"""
import json, struct, ctypes, types as pytypes
import numpy as np
from numba import types
from numba.cuda.dispatcher import _Kernel
from numba.cuda.cudadrv.devicearray import _StridedLayoutShim, _StridedMemoryViewShim
from kernels_numba import launcher

class FakeDeviceArray:
    __cuda_memory__ = True

    def __init__(self, ptr, shape, dtype, strides=None):
        dtype = np.dtype(dtype)
        c = [dtype.itemsize]
        for n in reversed(shape[1:]):
            c.insert(0, c[0] * n)
        strides = tuple(c) if strides is None else strides
        contiguous = strides == tuple(c)
        self._strided_memory_view_shim = _StridedMemoryViewShim(
            ptr=ptr, shape=tuple(shape), dtype=dtype, size=int(np.prod(shape)),
            _layout=_StridedLayoutShim(strides_in_bytes=strides, is_contiguous_c=contiguous, is_contiguous_f=False,
                                       is_contiguous_any=contiguous))
        from numba.np import numpy_support
        self._numba_type_ = types.Array(numpy_support.from_dtype(dtype), len(shape), "C" if contiguous else "A")

def numba_bytes(argtypes, args):
    fake = pytypes.SimpleNamespace(extensions=[])
    fake._prepare_args = lambda *a: _Kernel._prepare_args(fake, *a)
    out = []
    for ty, val in zip(argtypes, args):
        values = []
        _Kernel._prepare_args(fake, ty, val, 0, [], values)
        for v in values:
            if isinstance(v, bool):
                out.append(bytes([v]).hex())
            elif isinstance(v, int):
                out.append(struct.pack("<q" if v < 2**63 else "<Q", v).hex())
            else:
                out.append(bytes(v).hex())
    return out

def launcher_bytes(argtypes, args):
    formats = launcher.slot_formats(argtypes)
    values = launcher._values(args, [], ())
    packed = struct.pack("<" + "".join(formats), *values)
    sizes = launcher.param_sizes(argtypes)
    return [packed[8 * i: 8 * i + n].hex() for i, n in enumerate(sizes)]

a1 = FakeDeviceArray(0x7f0000001000, (1000,), np.uint32)
a2 = FakeDeviceArray(0x7f0000002000, (7, 33), np.int32)
a4 = FakeDeviceArray(0x7f0000003000, (5, 2, 16, 32), np.uint16)
strided = FakeDeviceArray(0x7f0000004000, (4, 6), np.float32, strides=(96, 8))
empty = FakeDeviceArray(0, (0,), np.int64)
cases = {
    "arrays": ((a1, a2, a4, strided, empty), None),
    "scalars": ((3, -5, 2**40, np.int32(-7), np.uint32(4000000000), np.int16(-3), np.uint8(200), np.float32(1.25),
                 -2.5, np.float64(3.5), np.float16(0.333), True, False), None),
    "mixed": ((a1, 17, np.float32(0.125), a2, np.int32(9), True), None),
    "tuple": (((a2, a2, a2), a1, (np.int32(1), np.float32(2.0))), None),
}
out = {}
from numba.core.typing.typeof import typeof, Purpose
for name, (args, _) in cases.items():
    argtypes = tuple(typeof(a, Purpose.argument) for a in args)
    out[name] = {"numba": numba_bytes(argtypes, args), "launcher": launcher_bytes(argtypes, args),
                 "types": [str(t) for t in argtypes]}
print(json.dumps(out))
"""


def test_layout_matches_numba_marshalling():
    """Every value numba's launch would pass, in order, with the same bytes: arrays of 1-4 dims (strided,
    empty), every integer and float width, bools, Python ints and floats, tuples of arrays and scalars."""
    cases = json.loads(compile_in_subprocess(_MARSHAL_SCRIPT, timeout=300))
    assert set(cases) == {"arrays", "scalars", "mixed", "tuple"}
    for name, case in cases.items():
        assert case["launcher"] == case["numba"], (name, case["types"])
    assert len(cases["arrays"]["numba"]) == sum(5 + 2 * n for n in (1, 2, 4, 2, 1))


# the widths of each kernel's parameters in the PTX numba generates for sm_90, beside param_sizes()
_PTX_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import launcher

u32, i64a, i32a = types.uint32[::1], types.int64[::1], types.int32[::1]
def sizes_of(ptx):
    entry = re.search(r"\.entry\s+\S+\((.*?)\)", ptx, re.S).group(1)
    return [int(re.search(r"\.[usbf](\d+)", p).group(1)) // 8 for p in entry.split(",") if ".param" in p]

def every_scalar(flag, a, b, c, d, e, f, g, arr3, arr1):
    if flag and cuda.threadIdx.x == 0:
        arr1[0] = a + b + c + d + e + f + g + arr3[0, 0, 0]

kernels = {"every_scalar": (cuda.jit(every_scalar),
                            (types.boolean, types.int8, types.int16, types.int32, types.uint32, types.int64,
                             types.float32, types.float64, types.float32[:, :, ::1], types.float64[:]))}
names = sys.argv[1].split(",")
if "rmsnorm" in names:
    from kernels_numba import rmsnorm
    kernels["rmsnorm"] = (rmsnorm._make_kernel(False, True),
                          (u32, types.int64, u32, types.int64, u32, u32, types.int64, types.int64, types.float32,
                           types.float32))
if "rotary" in names:
    from kernels_numba import rotary
    kernels["rotary"] = (rotary._make_kernel(64, False),
                         (i32a, u32, types.int64, u32, types.int64, u32, types.int64, u32, types.int64, u32, u32, u32,
                          i32a, types.int64, types.int64, types.int64))
if "copy_blocks" in names:
    from kernels_numba import cache_ops
    kernels["copy_blocks"] = (cache_ops._copy_blocks_kernel,
                              (types.UniTuple(types.int64[:, ::1], 4), types.int64[:, ::1]))
if "prefill_plan" in names:
    from kernels_numba import paged_prefill_fa2
    kernels["prefill_plan"] = (paged_prefill_fa2.make_plan_kernel(), (i32a, types.int64, i32a))
out = {}
for name in names:
    kernel, sig = kernels[name]
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    out[name] = {"ptx": sizes_of(ptx), "launcher": launcher.param_sizes(sig)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("names", [
    "every_scalar,rmsnorm",
    pytest.param("rotary,copy_blocks,prefill_plan", marks=pytest.mark.slow),
])
def test_layout_matches_compiled_kernels(names):
    """The sizes a plan gives each parameter are the compiled kernel's: a kernel with every scalar type,
    the fused add-RMSNorm (and, slow: rotary + cache write, the block copy with a tuple, the prefill plan)."""
    out = json.loads(compile_in_subprocess(_PTX_SCRIPT, names, timeout=600))
    for name in names.split(","):
        assert out[name]["launcher"] == out[name]["ptx"], name
    if "every_scalar" in out:          # boolean, int8, int16, int32, uint32, int64, float32, float64
        assert out["every_scalar"]["ptx"][:8] == [1, 1, 2, 4, 4, 8, 4, 8]


class _FakeDriver:
    """Stands in for libcuda: cuLaunchKernel reads each parameter through the pointer array, as the driver
    does, taking `sizes[i]` bytes from pointer i."""

    def __init__(self, sizes):
        self.sizes, self.calls = sizes, []

    def cuLaunchKernel(self, handle, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        read = [ctypes.string_at(pointers[i], n) for i, n in enumerate(self.sizes)]
        self.calls.append(((handle, (gx, gy, gz), (bx, by, bz), smem, stream), read))
        return 0


def test_plan_buffer_as_the_driver_reads_it():
    """A plan packs torch tensors (data pointer, shape, C strides in bytes), ints, float32 and bools into
    its slots, and the driver finds each value behind its pointer; a second launch overwrites the first."""
    from numba import types

    argtypes = (types.float16[:, ::1], types.int64, types.float32, types.boolean, types.int32[::1])
    sizes = launcher.param_sizes(argtypes)
    fake = _FakeDriver(sizes)
    plan = launcher._Plan(fake, 1234, launcher.slot_formats(argtypes))
    x = torch.zeros(3, 5, dtype=torch.float16)
    ids = torch.arange(7, dtype=torch.int32)
    for scale, flag in ((0.5, True), (-3.0, False)):
        values = launcher._values((x, 42, np.float32(scale), flag, ids), [], torch.Tensor)
        plan.launch((2, 1, 1), (128, 1, 1), 1024, 99, values)
        (call, read) = fake.calls[-1]
        assert call == (1234, (2, 1, 1), (128, 1, 1), 1024, 99)
        expect = [struct.pack("<q", v) for v in (0, 0, 15, 2, x.data_ptr(), 3, 5, 10, 2)]
        expect += [struct.pack("<q", 42), struct.pack("<f", scale), bytes([flag])]
        expect += [struct.pack("<q", v) for v in (0, 0, 7, 4, ids.data_ptr(), 7, 4)]
        assert read == expect


def test_launch_error_names_the_failure():
    """A driver error code becomes a KernelLaunchError with the launch's geometry."""
    from numba import types

    from kernels_numba.errors import KernelLaunchError

    class Failing(_FakeDriver):
        def cuLaunchKernel(self, *a):
            return 1

        def cuGetErrorName(self, code, out):
            out._obj.value = b"CUDA_ERROR_INVALID_VALUE"
            return 0

    plan = launcher._Plan(Failing([8]), 1, launcher.slot_formats((types.int64,)))
    with pytest.raises(KernelLaunchError, match="CUDA_ERROR_INVALID_VALUE.*grid \\(1, 1, 1\\)"):
        plan.launch((1, 1, 1), (32, 1, 1), 0, 0, [5])


def test_argument_kinds():
    """The plan key: a contiguous tensor by dtype and rank; a non-contiguous one has no plan (numba
    launches it); scalars by type; tuples by their items."""
    t = torch.zeros(4, 6)
    assert launcher._kind(t, torch.Tensor) == (torch.float32, 2)
    assert launcher._kind(t[:, ::2], torch.Tensor) is None
    assert launcher._kind((t, 3), torch.Tensor) == ("tuple", (torch.float32, 2), int)
    assert launcher._kind((t[:, 1:], 3), torch.Tensor) is None
    assert launcher._kind(np.float32(1), torch.Tensor) is np.float32
    assert launcher.slot_formats((object(),)) is None


def test_simulator_launch_converts_tensors():
    """Under the simulator (no plans) torch tensors, tuples of them and scalars reach numba's launch as
    arrays: a kernel adds a scalar to a tuple's arrays."""
    if not launcher.bridge.SIMULATOR:
        pytest.skip("the simulator path")

    @cuda.jit
    def add(pair, out, c):
        i = cuda.threadIdx.x
        if i < out.shape[0]:
            out[i] = pair[0][i] + pair[1][i] + c

    a, b = torch.arange(10, dtype=torch.float32), torch.ones(10)
    out = torch.zeros(10)
    launcher.launch(add, 1, 32, ((a, b), out, np.float32(2.0)))
    assert torch.equal(out, a + 3)


@pytest.mark.parametrize("asked", [None, "1"])
def test_first_launch_turns_off_low_occupancy_warnings(monkeypatch, asked):
    """A small grid is the decode step's normal case: the first launch turns numba's warning off, unless
    NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS asks for it."""
    from numba.cuda.core import config

    monkeypatch.setattr(config, "CUDA_LOW_OCCUPANCY_WARNINGS", 1)
    monkeypatch.setattr(launcher, "_QUIETED", False)
    if asked is None:
        monkeypatch.delenv("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", raising=False)
    else:
        monkeypatch.setenv("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", asked)

    @cuda.jit
    def fill(out):
        out[cuda.threadIdx.x] = 1.0

    out = cuda.to_device(np.zeros(32, np.float32))
    launcher.launch(fill, 1, 32, (out,))
    assert out.copy_to_host().sum() == 32
    assert config.CUDA_LOW_OCCUPANCY_WARNINGS == (0 if asked is None else 1)


def test_zero_scratch_is_never_first_made_inside_a_capture(monkeypatch):
    """A zero-filled scratch buffer made inside a graph capture would be zeroed only when that graph
    replays (and would live in its memory pool): refused with an error that says what to do. One made
    before the capture is found inside it; one that need not start at zero may be made there."""
    if not launcher.bridge.SIMULATOR:
        pytest.skip("the simulator path (scratch on a CPU device)")
    bridge, dev, token = launcher.bridge, torch.device("cpu"), object()
    with bridge.owner(token):
        monkeypatch.setattr(bridge, "_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="inside a CUDA graph capture: run the launch once"):
            bridge.scratch(dev, (3, 5), np.int32, zero=True, tag="capture-test")
        monkeypatch.setattr(bridge, "_capturing", lambda: False)
        made = bridge.scratch(dev, (3, 5), np.int32, zero=True, tag="capture-test")
        assert not np.asarray(made).any()
        monkeypatch.setattr(bridge, "_capturing", lambda: True)
        assert bridge.scratch(dev, (3, 5), np.int32, zero=True, tag="capture-test") is made
        assert bridge.scratch(dev, (4,), np.float32, tag="capture-test").shape == (4,)
    assert bridge.release(token) == 2


def test_zero_scratch_is_found_from_another_stream(monkeypatch):
    """torch's capture recipe warms up on a side stream and captures on torch's own capture stream: a
    zero-filled buffer made by the warm-up must be the one the capture finds (one per device, not per
    stream), while buffers of undefined contents stay the stream's own (two streams never share one)."""
    if not launcher.bridge.SIMULATOR:
        pytest.skip("the simulator path (scratch on a CPU device)")
    bridge, dev, token = launcher.bridge, torch.device("cpu"), object()
    with bridge.owner(token):
        monkeypatch.setattr(bridge, "_current_stream", lambda device: 11)      # the warm-up's side stream
        zeroed = bridge.scratch(dev, (6,), np.int32, zero=True, tag="stream-test")
        loose = bridge.scratch(dev, (6,), np.float32, tag="stream-test")
        monkeypatch.setattr(bridge, "_current_stream", lambda device: 22)      # the capture's stream
        monkeypatch.setattr(bridge, "_capturing", lambda: True)
        assert bridge.scratch(dev, (6,), np.int32, zero=True, tag="stream-test") is zeroed
        assert bridge.scratch(dev, (6,), np.float32, tag="stream-test") is not loose
    assert bridge.release(token) == 3


@pytest.mark.gpu
def test_engine_same_tokens_with_and_without_plans(monkeypatch, tmp_path):
    """Greedy ids of a small fp16 model through eager prefill, decode and mixed steps (graphs off, small
    prefill chunks) are identical with numba's launches and with the plans; every kernel a step launched
    got a plan (the driver's parameter table agreed with its layout)."""
    from helpers import write_tiny_checkpoint
    from pagedattn import LLM, SamplingParams

    ckpt = write_tiny_checkpoint(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (int(n),), generator=g).tolist() for n in torch.randint(5, 300, (12,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for enabled in (False, True):
        monkeypatch.setattr(launcher, "ENABLED", enabled)
        launcher.clear()
        llm = LLM(ckpt, device="cuda", dtype="float16", max_model_len=512, max_num_seqs=8,
                  max_num_batched_tokens=256, enforce_eager=True, warmup=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    assert runs[0] == runs[1]
    assert launcher._PLANS and all(plan is not None for plan in launcher._PLANS.values()), \
        [k for k, p in launcher._PLANS.items() if p is None]
