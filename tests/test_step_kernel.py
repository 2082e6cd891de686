"""kernels_numba/step.py, the decode step as numba.cuda phases (v0: one launch per phase), in numba's CUDA
simulator against reference/step.py (float64), and compiled for sm_90.

The tiny Qwen2 (2 layers, width 96, 6/2 heads of 16, vocabulary 128) decodes three sequences token by token
from an empty pool with scattered blocks, over 2-3 CTAs (fewer than the phases' items, so each CTA and warp loops
over several): every step's logits, greedy ids and the K/V it wrote against the reference's.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import tiny_checkpoint  # noqa: F401 (session fixture)
from kernels_numba import step as sk
from reference.step import decode_step, load_config, load_weights

ROOT = Path(__file__).resolve().parents[1]

# Tolerances from the 3-step run (2 layers, block size 2): float32 weights, the phases' float32 sums against
# float64: max |diff| 7.6e-7 on the logits (up to 3.0), 7.2e-7 on the pools; 1e-4 keeps 130x room and is far
# below a real mistake (a position off by one, a head reading the wrong K/V head: > 1e-2). float16 weights and
# pools (the reference widens the same float16 values): 8.9e-4 on the logits, 2.0e-3 on the pools (one float16
# step at |k| in [2, 4): the new K/V rounded from a float32 and a float64 value); 1e-2.
ATOL = {np.float32: 1e-4, np.float16: 1e-2}


def _decode_all(weights, config, dtype, lengths, block_size, num_ctas):
    """Decode len(lengths) random sequences token by token; per step (logits, ids, the reference's logits,
    the K pools, V pools, the reference's K pools, V pools)."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 128, n).tolist() for n in lengths]
    per_seq = -(-max(lengths) // block_size)
    num_blocks = 3 * per_seq + 4
    tables = rng.permutation(num_blocks)[:3 * per_seq].reshape(3, per_seq).astype(np.int32)
    shape = (num_blocks, config["num_kv_heads"], block_size, config["head_dim"])
    pools = [np.zeros(shape, dtype) for _ in range(2 * config["num_layers"])]
    k_pools, v_pools = pools[:config["num_layers"]], pools[config["num_layers"]:]
    ref_k = [p.astype(np.float64) for p in k_pools]
    ref_v = [p.astype(np.float64) for p in v_pools]
    kernels = sk.StepKernels({k: v.astype(dtype) for k, v in weights.items()}, config, num_ctas=num_ctas)
    steps = []
    for pos in range(max(len(s) for s in seqs)):
        live = [i for i, s in enumerate(seqs) if pos < len(s)]
        tokens = np.array([seqs[i][pos] for i in live], np.int32)
        positions = np.full(len(live), pos, np.int32)
        logits, ids = kernels.decode_step(tokens, positions, k_pools, v_pools, np.ascontiguousarray(tables[live]))
        want, ref_k, ref_v = decode_step({k: v.astype(dtype).astype(np.float64) for k, v in weights.items()},
                                         config, tokens, positions, ref_k, ref_v, tables[live])
        ref_k = [r.astype(dtype).astype(np.float64) for r in ref_k]      # the pool stores in dtype
        ref_v = [r.astype(dtype).astype(np.float64) for r in ref_v]
        steps.append((logits.copy(), ids.copy(), want, [k.copy() for k in k_pools], [v.copy() for v in v_pools],
                      ref_k, ref_v))
    return steps


# The simulator runs each CTA's 128 threads as Python threads and a warp's shuffles as barriers (~1-2 min a
# step of the 2-layer model on a busy 2-core machine): the default suite decodes 2 steps of the first layer
# alone (block size 1: the second step reads two blocks); `slow` 3 steps of both layers in both dtypes (block
# size 2) and 5 steps (block size 4: the last crosses a block) over 3 CTAs.
CASES = [pytest.param(np.float32, 1, (2, 1, 2), 1, 2, id="f32-1layer-2steps"),
         pytest.param(np.float32, 2, (3, 2, 3), 2, 2, id="f32-3steps", marks=pytest.mark.slow),
         pytest.param(np.float16, 2, (3, 2, 3), 2, 2, id="f16-3steps", marks=pytest.mark.slow),
         pytest.param(np.float32, 2, (5, 1, 2), 4, 3, id="f32-5steps", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype, num_layers, lengths, block_size, num_ctas", CASES)
def test_decode_steps_against_the_float64_reference(tiny_checkpoint, dtype, num_layers, lengths,  # noqa: F811
                                                    block_size, num_ctas):
    weights, config = load_weights(tiny_checkpoint), load_config(tiny_checkpoint)
    config = dict(config, num_layers=num_layers)
    atol = ATOL[dtype]
    for logits, ids, want, k_pools, v_pools, ref_k, ref_v in _decode_all(weights, config, dtype, lengths,
                                                                          block_size, num_ctas):
        np.testing.assert_allclose(logits, want, rtol=0, atol=atol)
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * atol           # rows whose winner no rounding can change
        assert clear.any()
        np.testing.assert_array_equal(ids[clear], want.argmax(1)[clear])
        np.testing.assert_array_equal(ids, logits.argmax(1))  # the argmax phase: the lowest index of the max
        for got, ref in zip(k_pools + v_pools, ref_k + ref_v):
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=0, atol=atol)



@pytest.mark.gpu
def test_gpu_decode_steps_against_the_float64_reference(tiny_checkpoint):  # noqa: F811
    """On the GPU, torch tensors in and out (weights and pools float16): 7 steps of three sequences against the
    reference on the same weights; bfloat16 weights are refused by name."""
    import torch

    weights, config = load_weights(tiny_checkpoint), load_config(tiny_checkpoint)
    with pytest.raises(ValueError, match="bfloat16"):
        sk.StepKernels({k: torch.from_numpy(v).to("cuda", torch.bfloat16) for k, v in weights.items()}, config,
                       on_gpu=True)
    tdt = torch.float16
    dev = {k: torch.from_numpy(v).to("cuda", tdt) for k, v in weights.items()}
    kernels = sk.StepKernels(dev, config, on_gpu=True)
    widened = {k: t.double().cpu().numpy() for k, t in dev.items()}
    atol = ATOL[np.float16]
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 128, n).tolist() for n in (4, 7, 5)]
    tables = rng.permutation(16)[:6].reshape(3, 2).astype(np.int32)
    shape = (16, config["num_kv_heads"], 4, config["head_dim"])
    k_pools = [torch.zeros(shape, dtype=tdt, device="cuda") for _ in range(config["num_layers"])]
    v_pools = [torch.zeros(shape, dtype=tdt, device="cuda") for _ in range(config["num_layers"])]
    for pos in range(7):
        live = [i for i, q in enumerate(seqs) if pos < len(q)]
        tokens, positions = np.array([seqs[i][pos] for i in live], np.int32), np.full(len(live), pos, np.int32)
        ref_k = [k.double().cpu().numpy() for k in k_pools]
        ref_v = [v.double().cpu().numpy() for v in v_pools]
        want, _, _ = decode_step(widened, config, tokens, positions, ref_k, ref_v, tables[live])
        logits, ids = kernels.decode_step(torch.from_numpy(tokens).cuda(), torch.from_numpy(positions).cuda(),
                                          k_pools, v_pools, torch.from_numpy(np.ascontiguousarray(tables[live])).cuda())
        np.testing.assert_allclose(logits.cpu().numpy(), want, rtol=0, atol=atol)
        assert ids.tolist() == logits.argmax(1).tolist()

def test_argmax_takes_the_lowest_index_of_a_tie():
    logits = np.full((2, 300), -1.0, np.float32)
    logits[0, [7, 200, 299]] = 5.0                 # a tie across threads of the CTA
    logits[1, 299] = np.inf
    ids = np.empty(2, np.int32)
    sk._argmax[1, sk.THREADS](logits, ids)
    assert ids.tolist() == [7, 299]


def test_a_step_it_cannot_take_is_refused(tiny_checkpoint):  # noqa: F811
    kernels = sk.StepKernels(load_weights(tiny_checkpoint), load_config(tiny_checkpoint), num_ctas=2)
    with pytest.raises(ValueError, match="9 sequences"):
        kernels.decode_step(np.zeros(9, np.int32), np.zeros(9, np.int32), [], [], np.zeros((9, 1), np.int32))
    with pytest.raises(ValueError, match="position 4096 is past max_positions 4096"):
        kernels.decode_step(np.zeros(1, np.int32), np.full(1, 4096, np.int32), [], [], np.zeros((1, 1), np.int32))


_COMPILE = r"""
import re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import step as sk

f32_2, f16_2, i32_1, i32_2 = types.float32[:, ::1], types.float16[:, ::1], types.int32[::1], types.int32[:, ::1]
f16_1, f16_4 = types.float16[::1], types.float16[:, :, :, ::1]
SIGS = {
    "_embed": (i32_1, f16_2, f32_2),
    "_rms_norm": (f32_2, f16_1, types.float32, f32_2),
    "_linear": (f32_2, f16_2, f16_1, types.boolean, types.boolean, f32_2),
    "_gate_up": (f32_2, f16_2, f16_2, f32_2),
    "_rotary_kv": (f32_2, i32_1, f32_2, f32_2, types.int64, types.int64, f16_4, f16_4, i32_2),
    "_attention": (f32_2, f16_4, f16_4, i32_2, i32_1, types.int64, types.int64, types.float32, f32_2),
    "_argmax": (f32_2, i32_1),
}
bad = []
for name, sig in SIGS.items():
    ptx, _ = cuda.compile_ptx(getattr(sk, name).py_func, sig, cc=(9, 0))
    body = "\n".join(l for l in ptx.splitlines() if not l.lstrip().startswith("//"))
    f64 = len(re.findall(r"\.f64\b", body))
    local = len(re.findall(r"\.local\b", body))
    shfl = len(re.findall(r"shfl\.sync", body))
    print(name, "f64", f64, "local", local, "shfl", shfl)
    if f64 or local:
        bad.append(name)
sys.exit(1 if bad else 0)
"""


def test_every_phase_compiles_for_sm90_in_float32_without_local_memory():
    """The phases compiled for sm_90 (float16 weights and pool): no float64 instruction (each constant and
    function float32; rotary from tables, not cosf / sinf, whose slow path has both) and no local memory (the
    per-sequence and per-lane accumulators are unrolled into registers: loops over MAX_S and MAX_D_PER_LANE
    with constant bounds)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
