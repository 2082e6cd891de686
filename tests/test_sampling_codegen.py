"""Static checks on the sampling kernels' code for sm_90 (no GPU needed).

Each kernel is compiled with numba.cuda.compile_ptx in a subprocess without NUMBA_ENABLE_CUDASIM (the
pattern of tests/test_kernel_codegen.py), with the argument types sample_cuda passes, and checked for
what kernels_numba/sampling.py (v2's kernels) and sampling_journey.py (v1's hot kernel) promise:

* no local memory in the PTX, and ptxas reports 0 bytes of spills and of stack;
* the hot kernel and the split path's pass kernels on aligned rows fit 72 registers (their launch
  bounds: two CTAs of 448 threads per SM) and read the row in 16-byte (float32: ld.global.v4) or
  8-byte (fp16/bf16) words;
* the written-out exp/log use mul.rn / add.rn / div.rn: PTX operations with an explicit rounding
  mode, which ptxas never fuses into an FMA (the CPU rounds every operation separately too);
* no atomics on global memory (the split path merges partials in the next kernel); the fallbacks'
  histograms use shared-memory atomics, within 48 KiB.

The default run compiles the split path's float32 kernels on aligned rows (the engine's case); the
one-CTA path and the other dtypes are slow.
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import compile_in_subprocesses

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import sampling as s, sampling_journey as journey

out = {}
for name, kind, vec in json.loads(sys.argv[1]):
    words = types.int32[::1] if kind == "f32" else (types.int64[::1] if vec else types.int16[::1])
    sig = (words, types.int64, types.float32[::1], types.int32[::1], types.float32[::1], types.int64[::1],
           types.int32[::1], types.int32[::1], types.int32[::1], types.float32[::1], types.int64[:, ::1],
           types.float32[:, ::1])
    if name.startswith("split"):            # + chunks after vocab, + the partials
        sig = sig[:2] + (types.int64,) + sig[2:] + (types.int64[:, ::1], types.float32[:, ::1])
    if name == "hot":
        kernel, bounds = journey.make_hot_kernel(kind, vec), (s.THREADS, 2 if vec else 1)
    elif name == "fallback":
        kernel, bounds = s.make_fallback_kernel(kind, vec), (s.FALLBACK_THREADS, 1)
    elif name == "splitfb":
        kernel, bounds = s.make_fallback_kernel(kind, vec, split=True), (s.FALLBACK_THREADS, 1)
    else:
        kernel, bounds = s.make_split_kernels(kind, vec)[int(name[-1]) - 1], (s.THREADS, 2 if vec else 1)
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=bounds)
    tag = f"{name}_{kind}_{int(vec)}"
    open(f"{sys.argv[2]}/{tag}.ptx", "w").write(ptx)
    count = lambda pattern: len(re.findall(pattern, ptx))
    out[tag] = {
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "ld_v4": count(r"ld\.global\.v4"),
        "ld_u64": count(r"ld\.global\.u64"),
        "mul_rn": count(r"mul\.rn\.f32"),
        "add_rn": count(r"add\.rn\.f32"),
        "div_rn": count(r"div\.rn\.f32"),
        "atom_global": count(r"atom\.global"),
        "atom_shared": count(r"atom\.shared\.add"),
    }
print(json.dumps(out))
"""

# (kernel, logits kind, 16-/8-byte words); split1-3, splitfb: the split path's kernels (the default)
CONFIGS = [
    ("split1", "f32", True),
    ("split2", "f32", True),
    ("split3", "f32", True),
    ("splitfb", "f32", True),
    pytest.param(("split2", "f16", True), marks=pytest.mark.slow),
    pytest.param(("split3", "bf16", False), marks=pytest.mark.slow),
    pytest.param(("splitfb", "f16", True), marks=pytest.mark.slow),
    pytest.param(("hot", "f32", True), marks=pytest.mark.slow),
    pytest.param(("fallback", "f32", True), marks=pytest.mark.slow),
    pytest.param(("hot", "f16", True), marks=pytest.mark.slow),
    pytest.param(("hot", "bf16", False), marks=pytest.mark.slow),
    pytest.param(("hot", "f32", False), marks=pytest.mark.slow),
    pytest.param(("fallback", "f16", True), marks=pytest.mark.slow),
    pytest.param(("fallback", "bf16", False), marks=pytest.mark.slow),
]


def _tag(cfg):
    name, kind, vec = cfg
    return f"{name}_{kind}_{int(vec)}"


def _values(param):
    return param.values[0] if hasattr(param, "values") else param


@pytest.fixture(scope="module")
def compiled(request):
    """Compile the configurations this session selected, split over parallel subprocesses."""
    wanted = sorted({_values(item.callspec.params["cfg"]) for item in request.session.items
                     if item.module.__name__ == __name__ and hasattr(item, "callspec")})
    tmp = tempfile.mkdtemp(prefix="sampling_ptx_")
    stats = {}
    for stdout in compile_in_subprocesses(_SCRIPT, wanted, lambda part: (json.dumps(part), tmp), timeout=1800):
        stats.update(json.loads(stdout.strip().splitlines()[-1]))
    yield stats, tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: _tag(c))
def test_ptx(compiled, cfg):
    stats = compiled[0][_tag(cfg)]
    name, kind, vec = cfg
    assert not stats["local"], f"{_tag(cfg)}: local memory in the PTX"
    assert stats["atom_global"] == 0, stats
    if name != "split1":                        # pass 1 is the raw logsumexp: no written-out math
        assert stats["mul_rn"] > 0 and stats["add_rn"] > 0 and stats["div_rn"] > 0, stats
    if name == "hot" and vec:                   # passes 1, 2, 3 each read the row in wide words
        assert stats["ld_v4" if kind == "f32" else "ld_u64"] >= 3, stats
    if name in ("split1", "split2", "split3") and vec and kind == "f32":
        assert stats["ld_v4"] >= 1, stats
    if name in ("fallback", "splitfb"):
        assert stats["atom_shared"] > 0, stats


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: _tag(c))
def test_ptxas_no_spills(compiled, cfg):
    ptx = Path(compiled[1], _tag(cfg) + ".ptx").read_text()
    # NVVM may emit a newer PTX ISA than the installed ptxas knows; these kernels use nothing new
    ver = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", ver)
    if m:
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, flags=re.M)
    src = Path(compiled[1], _tag(cfg) + ".fixed.ptx")
    src.write_text(ptx)
    proc = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(src), "-o", os.devnull], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stderr + proc.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "0 bytes stack frame" in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    name, _, vec = cfg
    if name in ("hot", "split1", "split2", "split3") and vec:     # launch bounds: two CTAs of 448 per SM
        assert regs <= 72, report
    assert int(re.search(r"(\d+) bytes smem", report).group(1)) <= 48 * 1024, report
