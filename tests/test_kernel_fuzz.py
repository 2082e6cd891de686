"""Kernel fuzzing: random shapes against the float64 reference, every failure names its seed.

Each case draws batch size, context lengths, block size, GQA ratio, head dim and dtype from one
integer seed; block tables are shuffled and *sparse* (the pool has many more blocks than the
batch owns, all of them NaN), so a read through a wrong table entry or past a sequence's end
shows up as NaN. Without a GPU the kernels run in the CUDA simulator, so the cases are small
and few; the `gpu` cases go up to thousands of tokens and hundreds of sequences.

Reproduce one case:  PAGEDATTN_FUZZ_SEED=<seed> python -m pytest tests/test_kernel_fuzz.py -k seed
More cases by hand:   PAGEDATTN_FUZZ_CASES=200 python -m pytest tests/test_kernel_fuzz.py
"""
import os

import numpy as np
import pytest
import torch

from kernels_numba import decode_journey as journey, paged_attention as pa
from kernels_numba import prefill_journey
from test_paged_attention_cuda import _bits_to_f64, _tolerance, make_problem
from test_paged_prefill_cuda import make_batch
from reference.attention import paged_prefill_attention

HAS_GPU = torch.cuda.is_available()
NUM_CASES = int(os.environ.get("PAGEDATTN_FUZZ_CASES", "0"))
ONE_SEED = os.environ.get("PAGEDATTN_FUZZ_SEED")


def seeds(n_default, base):
    """The seeds a test runs: one from the environment, else n (or PAGEDATTN_FUZZ_CASES) in a row."""
    if ONE_SEED is not None:
        return [int(ONE_SEED)]
    return [base + i for i in range(NUM_CASES or n_default)]


def draw_decode_case(seed, large):
    """(num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens, spare_blocks) from a seed."""
    rng = np.random.default_rng(seed)
    num_kv_heads = int(rng.choice([1, 2] if not large else [1, 2, 4]))
    group = int(rng.choice([1, 2, 3, 7] if not large else [1, 2, 4, 7, 8]))
    head_dim = 64 if not large else int(rng.choice([64, 128]))
    block_size = int(rng.choice([8, 16, 32]))
    dtype = np.float16 if rng.random() < 0.7 else "bf16"
    num_seqs = int(rng.integers(1, 4 if not large else 65))
    max_len = 48 if not large else int(rng.choice([64, 600, 3000]))
    context_lens = rng.integers(1, max_len + 1, size=num_seqs).tolist()
    spare = int(rng.integers(0, 8 if not large else 200))  # unowned NaN blocks: a sparse pool
    return num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, context_lens, spare


def draw_plan(seed, max_len):
    """A v10 launch plan forced on a case: 1-4 partitions of CTAs of 2/4/8 warps, either merge."""
    rng = np.random.default_rng(seed + 2)
    warps = int(rng.choice([2, 4, 8]))
    splits = int(rng.integers(1, 5))
    partition = max(1, -(-max_len // splits))
    partition = -(-partition // (16 * warps)) * (16 * warps)
    merge = str(rng.choice(["fused", "kernel"]))
    return pa.DecodePlan(-(-max_len // partition), partition, warps, 3, merge)


def check_decode(seed, version, large, forced_plan=False):
    case = draw_decode_case(seed, large)
    num_heads, num_kv_heads, head_dim, block_size, dtype, lens, spare = case
    rng = np.random.default_rng(seed + 1)
    q16, k16, v16, tables, ctx, ref = make_problem(
        rng, num_heads, num_kv_heads, head_dim, block_size, dtype, lens, spare_blocks=spare
    )
    out16 = np.full(q16.shape, 0x7E00, dtype=np.uint16)  # NaN bits: an unwritten output fails
    plan = draw_plan(seed, max(lens)) if forced_plan else None
    if plan:  # the shipped kernel (v10) under a plan of its own
        pa.launch(q16, k16, v16, tables, ctx, out16, is_bf16=(dtype == "bf16"),
                  max_context_len=plan.splits * plan.partition, plan=plan)
    else:
        journey.launch(version, q16, k16, v16, tables, ctx, out16, is_bf16=(dtype == "bf16"))
    out = _bits_to_f64(out16, dtype)
    err = np.abs(out - ref)
    where = (f"seed={seed} version={version} case={case[:5]} lens={lens[:8]}{'...' if len(lens) > 8 else ''}"
             f"{' ' + str(plan) if plan else ''}")
    assert np.isfinite(out).all(), f"NaN/inf in output; reproduce with PAGEDATTN_FUZZ_SEED={seed}: {where}"
    assert err.max() <= _tolerance(dtype), f"max err {err.max():.3g} mean {err.mean():.3g}: {where}"


def draw_prefill_case(seed, large):
    rng = np.random.default_rng(seed)
    num_kv_heads = int(rng.choice([1, 2]))
    group = int(rng.choice([1, 2, 7] if not large else [1, 2, 4, 7, 8]))
    head_dim = 64 if not large else int(rng.choice([64, 128]))
    block_size = int(rng.choice([8, 16, 32]))
    dtype = torch.float16 if rng.random() < 0.7 else torch.bfloat16
    num_seqs = int(rng.integers(1, 3 if not large else 9))
    max_new, max_cached = (12, 24) if not large else (700, 1500)
    q_lens = rng.integers(1, max_new + 1, size=num_seqs).tolist()
    cached = rng.integers(0, max_cached + 1, size=num_seqs).tolist()
    return num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, q_lens, cached


def check_prefill(seed, large):
    case = draw_prefill_case(seed, large)
    q, k_cache, v_cache, tables, cu, ctx = make_batch(*case, seed=seed)
    out = prefill_journey.paged_prefill(q, k_cache, v_cache, tables, cu, ctx, version=3)
    ref = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx)
    got = out.double().cpu().numpy()
    err = np.abs(got - ref)
    # one output rounding plus fp32 accumulation and P rounded to 16 bits before P.V (as in
    # FlashAttention): a few units of the storage format's roundoff at |o| <= ~1
    tol = 4 * (2.0**-11 if case[4] == torch.float16 else 2.0**-8)
    where = f"seed={seed} case={case}"
    assert np.isfinite(got).all(), f"NaN/inf in output; reproduce with PAGEDATTN_FUZZ_SEED={seed}: {where}"
    assert err.max() <= tol, f"max err {err.max():.3g} mean {err.mean():.3g}: {where}"


# --- CPU (simulator): small and few, every kernel family -------------------------------------
SIM_VERSIONS = [3, 5, 8, 10] + [pytest.param(v, marks=pytest.mark.slow) for v in (4, 6, 7, 9)]


@pytest.mark.skipif(HAS_GPU, reason="simulator cases; the gpu cases below cover the device")
@pytest.mark.parametrize("version", SIM_VERSIONS)
@pytest.mark.parametrize("seed", seeds(2, 100))
def test_decode_fuzz_simulator(seed, version):
    check_decode(seed, version, large=False)


@pytest.mark.skipif(HAS_GPU, reason="simulator cases; the gpu cases below cover the device")
@pytest.mark.parametrize("seed", seeds(2, 300))
def test_decode_fuzz_v10_forced_plans_simulator(seed):
    """v10 with a random plan (partitions, CTA width, merge) on a random case: the split paths run
    on ragged lengths that end anywhere in a partition."""
    check_decode(seed, 10, large=False, forced_plan=True)


@pytest.mark.skipif(HAS_GPU, reason="simulator cases; the gpu cases below cover the device")
@pytest.mark.parametrize("seed", [s if i == 0 else pytest.param(s, marks=pytest.mark.slow)
                                  for i, s in enumerate(seeds(2, 200))])
def test_prefill_fuzz_simulator(seed):
    check_prefill(seed, large=False)


# --- GPU: large ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("version", [4, 5, 7, 8, 9, 10])
@pytest.mark.parametrize("seed", seeds(6, 1000))
def test_decode_fuzz_gpu(seed, version):
    check_decode(seed, version, large=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", seeds(12, 3000))
def test_decode_fuzz_v10_forced_plans_gpu(seed):
    check_decode(seed, 10, large=True, forced_plan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", seeds(6, 2000))
def test_prefill_fuzz_gpu(seed):
    check_prefill(seed, large=True)
