"""kernels_numba/step.py, the decode step as numba.cuda phases (v0-v3: one launch per phase; v4: one cooperative
launch), in numba's CUDA simulator against reference/step.py (float64), compiled for sm_90, and on the GPU.

Tiny random Qwen2 checkpoints decode a few sequences token by token from an empty pool with scattered blocks,
over 2-3 CTAs (fewer than the phases' items, so each CTA and warp loops over several): every step's logits,
greedy ids and the K/V it wrote against the reference's. The shapes: head_dim 64 (Qwen2's: a lane holds two
of a head's elements, rotary pairs 32 apart), 16 (the shared tiny model: half a warp per head) and 128 with the
step's 8 sequences.
"""
import numpy as np
import pytest

from helpers import capture_after_warmup, compile_in_subprocess, write_tiny_checkpoint
from kernels_numba import step as sk
from reference.step import decode_step, load_config, load_weights

SHAPES = {
    "d16": dict(),                                                         # 2 layers, width 96, 6/2 heads of 16
    "d64": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1),
    "d128": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                 intermediate_size=64),
}

# Tolerances from the runs of these cases: float32 weights, the phases' float32 sums against float64: max
# |diff| 7.6e-7 on the logits (up to 3.0) and 7.2e-7 on the pools (d16, 3 steps); 1e-4 keeps 130x room and is
# far below a real mistake (a position off by one, a head reading the wrong K/V head: > 1e-2). float16 weights
# and pools (the reference widens the same float16 values): 8.9e-4 on the logits; 1e-2. The pools: pool_close.
LOGITS_ATOL = {np.float32: 1e-4, np.float16: 1e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """shape name -> (weights, config) of a tiny random checkpoint, written on first use."""
    made = {}

    def get(name):
        if name not in made:
            path = write_tiny_checkpoint(tmp_path_factory.mktemp(f"step_{name}"), **SHAPES[name])
            made[name] = load_weights(path), load_config(path)
        return made[name]
    return get


def pool_close(got, ref, dtype):
    """got (the kernel's pool) against ref (the reference's, already rounded to dtype): float32 within 1e-4;
    float16 within 1e-2 + 4e-3 |ref| (measured: 2.0e-3, one float16 step at |k| in [2, 4): a step's K/V rounded
    from float32 here and float64 there, and a later layer's carrying the earlier steps' one-step differences
    through attention; the relative part is four steps, for the |k| >= 16 whose one step is 1.6e-2)."""
    if dtype == np.float16:
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=4e-3, atol=1e-2)
    else:
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=0, atol=1e-4)


def _decode_all(weights, config, dtype, lengths, block_size, num_ctas, version=0):
    """Decode len(lengths) random sequences token by token; per step (logits, ids, the reference's logits,
    the K pools, V pools, the reference's K pools, V pools)."""
    rng = np.random.default_rng(0)
    S, vocab = len(lengths), weights["model.embed_tokens.weight"].shape[0]
    seqs = [rng.integers(3, vocab, n).tolist() for n in lengths]
    per_seq = -(-max(lengths) // block_size)
    num_blocks = S * per_seq + 4
    tables = rng.permutation(num_blocks)[:S * per_seq].reshape(S, per_seq).astype(np.int32)
    shape = (num_blocks, config["num_kv_heads"], block_size, config["head_dim"])
    L = config["num_layers"]
    k_pools, v_pools = list(np.zeros((L, *shape), dtype)), list(np.zeros((L, *shape), dtype))   # (v4: one allocation)
    ref_k, ref_v = [np.zeros(shape) for _ in range(L)], [np.zeros(shape) for _ in range(L)]
    narrowed = {k: v.astype(dtype) for k, v in weights.items()}
    widened = {k: v.astype(np.float64) for k, v in narrowed.items()}
    kernels = sk.StepKernels(narrowed, config, num_ctas=num_ctas, version=version, column_threads=64)
    steps = []
    for pos in range(max(lengths)):
        live = [i for i, s in enumerate(seqs) if pos < len(s)]
        tokens = np.array([seqs[i][pos] for i in live], np.int32)
        positions = np.full(len(live), pos, np.int32)
        logits, ids = kernels.decode_step(tokens, positions, k_pools, v_pools, np.ascontiguousarray(tables[live]))
        want, ref_k, ref_v = decode_step(widened, config, tokens, positions, ref_k, ref_v, tables[live])
        ref_k = [r.astype(dtype).astype(np.float64) for r in ref_k]      # the pool stores in dtype
        ref_v = [r.astype(dtype).astype(np.float64) for r in ref_v]
        steps.append((logits.copy(), ids.copy(), want, [k.copy() for k in k_pools], [v.copy() for v in v_pools],
                      ref_k, ref_v))
    return steps


# The simulator runs each CTA's 128 threads as Python threads and a warp's shuffles as barriers (~1 min a step of
# the 2-layer d16 model on a 2-core machine), so the default suite runs the version the engine uses, v5 (v4 with
# the L2 prefetch, whose ranges the simulator checks against the arrays): the d16 model in float32, two layers (the
# next layer's q/k/v prefetched too), v3's float32 phases, which v4 and v5 call; the engine's own path through v4
# is test_engine_decodes_through_the_step_kernel_in_the_simulator. Under `slow`, each version of the journey:
# v0 (the phases, one launch each) 2 steps of the d64 model (two sequences then one; block size 1: the second step
# reads two blocks), 3 steps of both d16 layers in float16 (block size 2), 5 steps over 3 CTAs (block size 4: the
# last crosses a block) and one step of 8 sequences at d128; v1 (the column phases on 16-byte pieces, attention's
# keys over the warps, here 2 warps a CTA: the second warp has no key at the first step) d64 in float16, d16 in
# float32; v2 (2 columns a warp, the argmax split over the CTAs) both (by default its column phases against v1's
# bits and its argmax alone: test_v2_*); v3 (a round of loads before its products, the norms in the products,
# rotary and the K/V write in attention, several keys a warp) d64 in float16, d16 in float16 over 3 CTAs (16 keys a
# warp, most slots past the end at the first steps; the last step crosses a block) and d128 with 8 sequences; v4
# (v3's phases in one cooperative launch: the simulator runs a cooperative grid of one CTA) d64 in float16.
CASES = [pytest.param("d64", np.float32, (2, 1), 1, 2, 0, id="d64-f32-2steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float16, (3, 2, 3), 2, 2, 0, id="d16-f16-3steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float32, (5, 1, 2), 4, 3, 0, id="d16-f32-5steps", marks=pytest.mark.slow),
         pytest.param("d128", np.float16, (1,) * 8, 2, 2, 0, id="d128-f16-8seqs", marks=pytest.mark.slow),
         pytest.param("d64", np.float16, (2, 1), 1, 2, 1, id="v1-d64-f16-2steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float32, (3, 2, 3), 2, 3, 1, id="v1-d16-f32-3steps", marks=pytest.mark.slow),
         pytest.param("d64", np.float16, (2, 1), 1, 2, 2, id="v2-d64-f16-2steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float32, (3, 2, 3), 2, 3, 2, id="v2-d16-f32-3steps", marks=pytest.mark.slow),
         pytest.param("d64", np.float16, (2, 1), 1, 2, 3, id="v3-d64-f16-2steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float16, (5, 1, 2), 4, 3, 3, id="v3-d16-f16-5steps", marks=pytest.mark.slow),
         pytest.param("d128", np.float16, (1,) * 8, 2, 2, 3, id="v3-d128-f16-8seqs", marks=pytest.mark.slow),
         pytest.param("d64", np.float16, (2, 1), 1, 1, 4, id="v4-d64-f16-2steps", marks=pytest.mark.slow),
         pytest.param("d16", np.float32, (2, 1), 2, 1, 5, id="v5-d16-f32-2steps")]


@pytest.mark.parametrize("shape, dtype, lengths, block_size, num_ctas, version", CASES)
def test_decode_steps_against_the_float64_reference(checkpoints, shape, dtype, lengths, block_size, num_ctas,
                                                    version):
    weights, config = checkpoints(shape)
    atol = LOGITS_ATOL[dtype]
    for logits, ids, want, k_pools, v_pools, ref_k, ref_v in _decode_all(weights, config, dtype, lengths,
                                                                          block_size, num_ctas, version):
        np.testing.assert_allclose(logits, want, rtol=0, atol=atol)
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * atol           # rows whose winner no rounding can change
        assert clear.any()
        np.testing.assert_array_equal(ids[clear], want.argmax(1)[clear])
        np.testing.assert_array_equal(ids, logits.argmax(1))  # the argmax phase: the lowest index of the max
        for got, ref in zip(k_pools + v_pools, ref_k + ref_v):
            pool_close(got, ref, dtype)


def test_argmax_takes_the_lowest_index_of_a_tie():
    logits = np.full((2, 300), -1.0, np.float32)
    logits[0, [7, 200, 299]] = 5.0                 # a tie across threads of the CTA
    logits[1, 299] = np.inf
    ids = np.empty(2, np.int32)
    sk._argmax[1, sk.THREADS](logits, ids)
    assert ids.tolist() == [7, 299]


@pytest.mark.parametrize("half", [True, False])
def test_v2_column_phases_give_v1s_bits(half):
    """v2's linear and gate_up (2 adjacent columns a warp, the last group short when odd) against v1's (one column a
    warp): the same sums in the same order, so the same bits, with the bias, the accumulation and 3 sequences."""
    rng = np.random.default_rng(3)
    dtype = np.float16 if half else np.float32
    S, K, N, I = 3, 64, 9, 5
    h = rng.standard_normal((S, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(dtype)
    wg, wu = rng.standard_normal((I, K)).astype(dtype), rng.standard_normal((I, K)).astype(dtype)
    bias = rng.standard_normal(N).astype(dtype)
    words = lambda a: np.ascontiguousarray(a).view(np.uint32).reshape(-1)        # noqa: E731
    outs = []
    for phases in (sk.COLUMN_PHASES, sk.COLUMN_PHASES_V2):
        linear, gate_up = phases[half]
        out = rng.standard_normal((S, N)).astype(np.float32) * 0 + 1.5
        m = np.empty((S, I), np.float32)
        linear[2, 64](h, words(w), bias, True, True, out)
        gate_up[2, 64](h, words(wg), words(wu), m)
        outs.append((out, m))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(outs[0][0], h @ w.astype(np.float64).T + bias + 1.5, rtol=1e-5, atol=1e-5)


def test_v2_argmax_over_slices_takes_the_lowest_index_of_a_tie():
    """argmax_parts over 3 slices of 100 logits, then argmax_merge: a tie within a slice and across slices
    (the lowest index wins), a maximum alone in the last slice, an empty slice (a grid of 4 over 300)."""
    logits = np.full((3, 300), -1.0, np.float32)
    logits[0, [7, 200, 299]] = 5.0
    logits[1, [150, 250]] = 2.0
    logits[2, 299] = np.inf
    for grid in (3, 4, 7):
        best, where, ids = np.empty((3, grid), np.float32), np.empty((3, grid), np.int32), np.empty(3, np.int32)
        sk.argmax_parts[grid, sk.THREADS](logits, best, where)
        sk.argmax_merge[2, sk.THREADS](best, where, ids)
        assert ids.tolist() == [7, 150, 299], grid


def test_a_step_it_cannot_take_is_refused(checkpoints):
    weights, config = checkpoints("d64")
    kernels = sk.StepKernels({k: v.astype(np.float32) for k, v in weights.items()}, config, num_ctas=2)
    with pytest.raises(ValueError, match="9 sequences"):
        kernels.decode_step(np.zeros(9, np.int32), np.zeros(9, np.int32), [], [], np.zeros((9, 1), np.int32))
    with pytest.raises(ValueError, match="position 4096 is past max_positions 4096"):
        kernels.decode_step(np.zeros(1, np.int32), np.full(1, 4096, np.int32), [], [], np.zeros((1, 1), np.int32))


@pytest.mark.parametrize("half", [True, False])
def test_v3_norm_linear_in_pairs_and_its_argmax_parts(half):
    """v3's norm_linear (two adjacent columns a warp, a CTA's slice odd: its last column alone) with the argmax's
    parts, then argmax_merge: the RMSNorm'd products against float64, and the ids the lowest index of each row's
    largest logit, with ties planted inside a pair, across pairs and across CTAs' slices."""
    rng = np.random.default_rng(5)
    dtype = np.float16 if half else np.float32
    S, K, N, grid = 2, 64, 13, 3                    # slices of 5, 5, 3 columns
    x = rng.standard_normal((S, K)).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    x[1] = 0.0
    x[1, 0] = 1.0                                   # row 1: a one-hot input, w[:, 0] decides
    w[:, 0] = 0
    w[[6, 11], 0] = 1                               # row 1: 6 and 11 tie (two slices)
    w[2, 1:] = 2 * np.sign(x[0, 1:])                # row 0: 2 the largest, tied by 3 (its pair) and 4 (alone,
    w[[3, 4]] = w[2]                                # another warp's) and 7 (the next slice)
    w[7] = w[2]
    eps = np.float32(1e-6)
    kernels = sk.v3_kernels(half, S, K // (8 if half else 4))
    words = np.ascontiguousarray(w).view(np.uint32).reshape(-1)
    out = np.empty((S, N), np.float32)
    best, where, ids = np.empty((S, grid), np.float32), np.empty((S, grid), np.int32), np.empty(S, np.int32)
    kernels.norm_linear[grid, 64](x, norm_w, eps, words, norm_w, False, out, True, best, where)
    sk.argmax_merge[S, sk.THREADS](best, where, ids)
    h = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + eps) * norm_w.astype(np.float64)
    np.testing.assert_allclose(out, h @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)
    assert (out[0, [3, 4, 7]] == out[0, 2]).all() and out[0, 2] == out[0].max()
    assert out[1, 6] == out[1, 11] == out[1].max()
    assert ids.tolist() == [2, 6], ids


def test_v4_refuses_pools_it_cannot_read_as_one(checkpoints):
    """v4 reads layer l's pool at an offset from the first: pools made one by one are refused by name."""
    weights, config = checkpoints("d16")
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    kernels = sk.StepKernels(weights, config, num_ctas=1, version=4, column_threads=64)
    shape = (4, config["num_kv_heads"], 2, config["head_dim"])
    apart = [np.zeros(shape, np.float32) for _ in range(config["num_layers"])]
    with pytest.raises(ValueError, match="one allocation"):
        kernels.decode_step(np.zeros(1, np.int32), np.zeros(1, np.int32), apart, apart, np.zeros((1, 2), np.int32))


def _gpu_step_inputs(config, S, pos, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = pos // 4 + 1
    shape = (S * per_seq + 2, config["num_kv_heads"], 4, config["head_dim"])
    k = list(torch.randn((config["num_layers"], *shape), generator=g, device="cuda").half())   # (v4: one allocation)
    v = list(torch.randn((config["num_layers"], *shape), generator=g, device="cuda").half())
    tables = torch.randperm(shape[0], generator=g, device="cuda")[:S * per_seq].reshape(S, per_seq).int()
    tokens = torch.randint(3, 128, (S,), generator=g, device="cuda", dtype=torch.int32)
    return tokens, torch.full((S,), pos, device="cuda", dtype=torch.int32), k, v, tables


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", ["d64", "d16", "d128"])
def test_gpu_decode_step_against_the_float64_reference(checkpoints, shape, version):
    """On the GPU, torch tensors in and out (float16 weights and pools), 8 sequences at position 9 over a
    random history: logits and the K/V written against the reference on the same weights; bfloat16 weights
    are refused by name."""
    import torch

    weights, config = checkpoints(shape)
    with pytest.raises(ValueError, match="bfloat16"):
        sk.StepKernels({k: torch.from_numpy(v).to("cuda", torch.bfloat16) for k, v in weights.items()}, config,
                       on_gpu=True)
    dev = {k: torch.from_numpy(v).to("cuda", torch.float16) for k, v in weights.items()}
    kernels = sk.StepKernels(dev, config, on_gpu=True, version=version)
    tokens, positions, k_pools, v_pools, tables = _gpu_step_inputs(config, 8, 9, seed=0)
    np64 = lambda t: t.double().cpu().numpy()                                     # noqa: E731
    want, ref_k, ref_v = decode_step({k: np64(t) for k, t in dev.items()}, config, np64(tokens).astype(int),
                                     np64(positions).astype(int), [np64(k) for k in k_pools],
                                     [np64(v) for v in v_pools], tables.cpu().numpy())
    logits, ids = kernels.decode_step(tokens, positions, k_pools, v_pools, tables)
    np.testing.assert_allclose(logits.cpu().numpy(), want, rtol=0, atol=LOGITS_ATOL[np.float16])
    assert ids.tolist() == logits.argmax(1).tolist()
    for got, ref in zip(k_pools + v_pools, ref_k + ref_v):
        pool_close(got.cpu().numpy(), ref.astype(np.float16).astype(np.float64), np.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5])
def test_gpu_step_captured_in_a_graph_replays_the_eager_step(checkpoints, version):
    """torch's own capture recipe (a warm-up on a side stream, then torch.cuda.graph): the replayed step's
    logits, ids and pools are the eager step's bits."""
    import torch

    weights, config = checkpoints("d64")
    kernels = sk.StepKernels({k: torch.from_numpy(v).to("cuda", torch.float16) for k, v in weights.items()},
                             config, on_gpu=True, version=version)
    tokens, positions, k_pools, v_pools, tables = _gpu_step_inputs(config, 3, 6, seed=1)
    k_eager, v_eager = list(torch.stack(k_pools)), list(torch.stack(v_pools))      # copies, each one allocation
    logits, ids = kernels.decode_step(tokens, positions, k_eager, v_eager, tables)
    out = {}

    def step():
        out["logits"], out["ids"] = kernels.decode_step(tokens, positions, k_pools, v_pools, tables)
    graph = capture_after_warmup(step)
    for k, v, k0, v0 in zip(k_pools, v_pools, k_eager, v_eager):
        k.copy_(k0)                                  # the history back as the eager step saw it ...
        v.copy_(v0)
        for s in range(3):                           # ... but this step's slots wiped: the replay must write them
            k[int(tables[s, 6 // k.shape[2]]), :, 6 % k.shape[2]] = 0
            v[int(tables[s, 6 // v.shape[2]]), :, 6 % v.shape[2]] = 0
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["logits"], logits) and torch.equal(out["ids"], ids)
    for got, want in zip(k_pools + v_pools, k_eager + v_eager):
        assert torch.equal(got, want)


_COMPILE = r"""
import re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import step as sk

f32_2, f16_2, i32_1, i32_2 = types.float32[:, ::1], types.float16[:, ::1], types.int32[::1], types.int32[:, ::1]
f32_1, f16_1, f16_4 = types.float32[::1], types.float16[::1], types.float16[:, :, :, ::1]
SIGS = {
    "_embed": (i32_1, f16_2, f32_2),
    "_rms_norm": (f32_2, f16_1, types.float32, f32_2),
    "_linear": (f32_2, f16_2, f16_1, types.boolean, types.boolean, f32_2),              # q, k, v with its bias
    "_linear_no_bias": (f32_2, f16_2, f32_1, types.boolean, types.boolean, f32_2),      # o, down, the LM head
    "_gate_up": (f32_2, f16_2, f16_2, f32_2),
    "_rotary_kv": (f32_2, i32_1, f32_2, f32_2, types.int64, types.int64, f16_4, f16_4, i32_2),
    "_attention": (f32_2, f16_4, f16_4, i32_2, i32_1, types.int64, types.int64, types.float32, f32_2),
    "_argmax": (f32_2, i32_1),
}
u32_1 = types.uint32[::1]
V1 = {                                  # v1's (v2's) column phases on float16 words (half) and float32 words
    "v1_linear_f16": (sk.COLUMN_PHASES[True][0], (f32_2, u32_1, f16_1, types.boolean, types.boolean, f32_2)),
    "v1_gate_up_f16": (sk.COLUMN_PHASES[True][1], (f32_2, u32_1, u32_1, f32_2)),
    "v1_linear_f32": (sk.COLUMN_PHASES[False][0], (f32_2, u32_1, f32_1, types.boolean, types.boolean, f32_2)),
    "v1_attention": (sk.attention_v1, SIGS["_attention"]),
    "v2_linear_f16": (sk.COLUMN_PHASES_V2[True][0], (f32_2, u32_1, f16_1, types.boolean, types.boolean, f32_2)),
    "v2_gate_up_f16": (sk.COLUMN_PHASES_V2[True][1], (f32_2, u32_1, u32_1, f32_2)),
    "v2_linear_f32": (sk.COLUMN_PHASES_V2[False][0], (f32_2, u32_1, f32_1, types.boolean, types.boolean, f32_2)),
    "v2_argmax_parts": (sk.argmax_parts, (f32_2, f32_2, i32_2)),
    "v2_argmax_merge": (sk.argmax_merge, (f32_2, i32_2, i32_1)),
}
kernels = [(name, getattr(sk, name.replace("_no_bias", "")), sig) for name, sig in SIGS.items()]
for name, (kernel, sig) in V1.items():
    kernels.append((name, kernel, sig))
for name, kernel, sig in kernels:
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    body = "\n".join(l for l in ptx.splitlines() if not l.lstrip().startswith("//"))
    print(name, len(re.findall(r"\.f64\b", body)), len(re.findall(r"\.local\b", body)),
          len(re.findall(r"shfl\.sync", body)), len(re.findall(r"ld\.global(?:\.nc)?\.v4\.[buf]32", body)))
"""


def test_every_phase_compiles_for_sm90_in_float32_without_local_memory():
    """The phases (and v1's column phases) compiled for sm_90 (float16 weights and pool): no float64
    instruction (each constant and function float32; rotary from tables, not cosf / sinf, whose slow path has
    both), no local memory (the per-sequence and per-lane accumulators are unrolled into registers: loops over
    MAX_S and MAX_D_PER_LANE with constant bounds), the reductions as warp shuffles (5 a sum; the column phases'
    sums unrolled over MAX_S sequences, LLVM may copy them once more for the bias / accumulate branches), and
    v1's weights read by 16-byte loads."""
    counts, v4 = {}, {}
    for line in compile_in_subprocess(_COMPILE, timeout=600).strip().splitlines():
        name, f64, local, shfl, loads = line.split()
        counts[name], v4[name] = (int(f64), int(local), int(shfl)), int(loads)
    assert set(counts) == {"_embed", "_rms_norm", "_linear", "_linear_no_bias", "_gate_up", "_rotary_kv",
                           "_attention", "_argmax", "v1_linear_f16", "v1_gate_up_f16", "v1_linear_f32",
                           "v1_attention", "v2_linear_f16", "v2_gate_up_f16", "v2_linear_f32", "v2_argmax_parts",
                           "v2_argmax_merge"}
    assert all(f64 == 0 and local == 0 for f64, local, _ in counts.values()), counts
    # v1 reads the weights 16 bytes a load (one per row a step of its loop; the gate and the up row each)
    assert v4["v1_linear_f16"] >= 1 and v4["v1_linear_f32"] >= 1 and v4["v1_gate_up_f16"] >= 2, v4
    # v2's warp issues the loads of its 2 (gate/up: 2 + 2) columns together
    assert v4["v2_linear_f16"] >= 2 and v4["v2_linear_f32"] >= 2 and v4["v2_gate_up_f16"] >= 4, v4
    assert v4["_linear"] == v4["_gate_up"] == 0, v4
    shfl = {name: c[2] for name, c in counts.items()}
    assert shfl["_rms_norm"] == shfl["_attention"] == shfl["v1_attention"] == 5, shfl
    assert all(shfl[n] % (5 * sk.MAX_S) == 0 and shfl[n] >= 5 * sk.MAX_S for n in ("_linear", "_linear_no_bias")), shfl
    assert shfl["_gate_up"] % (10 * sk.MAX_S) == 0 and shfl["_gate_up"] >= 10 * sk.MAX_S, shfl
    assert shfl["_embed"] == shfl["_rotary_kv"] == shfl["_argmax"] == 0, shfl


_COMPILE_V3 = r"""
import collections, re, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import step as sk

f32_2, f16_1, f16_2, u32_1 = types.float32[:, ::1], types.float16[::1], types.float16[:, ::1], types.uint32[::1]
i32_1, i32_2, b, f32, i64 = types.int32[::1], types.int32[:, ::1], types.boolean, types.float32, types.int64
SIGS = dict(linear=(f32_2, u32_1, f16_1, b, b, f32_2),
            norm_linear=(f32_2, f16_1, f32, u32_1, f16_1, b, f32_2, b, f32_2, i32_2),
            norm_gate_up=(f32_2, f16_1, f32, u32_1, u32_1, f32_2))
todo = []
for S in (1, 4, 8):                     # Qwen2-0.5B's rows: 112 16-byte pieces (width 896), 608 (4,864)
    for kc in (112, 608):
        k = sk.v3_kernels(True, S, kc)
        names = ("linear",) if kc == 608 else ("linear", "norm_linear", "norm_gate_up")
        todo += [(f"{name}_S{S}_{kc}", getattr(k, name), SIGS[name]) for name in names]
todo.append(("attention", sk.ATTENTION_V3[True][0], (f32_2, u32_1, u32_1, i64, i64, i64, i32_2, i32_1, f32_2, f32_2,
                                                    i64, f32, f32_2)))
V4_SIG = (i32_1, i32_1, i32_2, f16_2, f32_2, f32_2, f32_2, f32_2, f32_2, f32_2, i32_2, i32_1, f16_2, u32_1, f16_2,
              u32_1, f16_2, u32_1, u32_1, u32_1, f16_1, u32_1, u32_1, u32_1, i64, i64, i64, i64, f32_2, f32_2, i64,
              f32, f32)
todo.append(("v4_S1", sk.v4_kernel(True, 1, 112, 608), V4_SIG))
todo.append(("v5_S1", sk.v4_kernel(True, 1, 112, 608, prefetch=True), V4_SIG))
for name, kernel, sig in todo:
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    body = "\n".join(l for l in ptx.splitlines() if not l.lstrip().startswith("//"))
    calls = collections.Counter(re.findall(r"call(?:\.uni)?\s*(?:\(\w+\),\s*)?(\w+)", body))
    print(name, len(re.findall(r"\.f64\b", body)), len(re.findall(r"\.local\b", body)),
          len(re.findall(r"ld\.global(?:\.nc)?\.v4\.[buf]32", body)), calls["cudaCGSynchronize"],
          len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", body)))
"""


def test_v3_and_v4_compile_for_sm90_without_local_memory():
    """v3's column kernels at Qwen2-0.5B's widths for 1, 4 and 8 sequences, its attention and v4's whole step,
    compiled for sm_90 (float16): no float64, no local memory (a round's loads and products unrolled into
    registers: v3_round keeps a round at <= 128 products, where 240 spilled), a round's 16-byte loads issued
    together (as many as v3_round gives: 4 a row at width 896, 10 at 4,864 for one sequence; gate/up and the column
    pairs of norm_linear both rows'),
    attention's K and V loads of both rounds, v4's 7 grid barriers (after the embedding, 5 a layer in the layer
    loop, before the argmax's merge) and v5's L2 prefetches (PTX cp.async.bulk.prefetch.L2)."""
    got = {}
    for line in compile_in_subprocess(_COMPILE_V3, timeout=900).strip().splitlines():
        name, f64, local, v4, syncs, prefetches = line.split()
        got[name] = (int(f64), int(local), int(v4), int(syncs), int(prefetches))
    assert len(got) == 3 * 4 + 3, got
    assert all(f64 == 0 and local == 0 for f64, local, *_ in got.values()), got
    for S in (1, 4, 8):
        for kc in (112, 608):
            assert got[f"linear_S{S}_{kc}"][2] >= sk.v3_round(S, kc), (S, kc, got)
        for name in ("norm_gate_up", "norm_linear"):          # two rows a round: gate and up, two columns
            assert got[f"{name}_S{S}_112"][2] >= 2 * sk.v3_round(S, 112, rows=2), (S, name, got)
    # one sequence: a row of 112 pieces in one round of 4 a lane, 608 in two of 10 (not 8 + 8 + 3)
    assert (sk.v3_round(1, 112), sk.v3_round(1, 608), sk.v3_round(8, 112, rows=2)) == (4, 10, 1)
    assert got["attention"][2] >= 4, got
    assert got["v4_S1"][3] == got["v5_S1"][3] == 7 and got["attention"][3] == 0, got
    # v5's prefetches: q/k/v before the layers, then o, gate, up, down and the next q/k/v in each layer (6 loops over
    # pieces, which the compiler may unroll: at least one instruction each); v4 none
    assert got["v5_S1"][4] >= 6 and got["v4_S1"][4] == 0, got


def test_first_difference_reports_where_and_how_close():
    from scripts.step_kernel_greedy import first_difference

    logits = np.zeros((3, 5), np.float32)
    logits[1, [2, 4]] = [1.0, 0.75]                  # at index 1 we chose 2; 4 is our second, 0.25 behind
    assert first_difference([7, 2, 3], [7, 2, 3], logits) is None
    assert first_difference([7, 2, 3], [7, 4, 3], logits) == (1, 0.25, True)
    assert first_difference([7, 2], [7, 2, 9], logits) == (2, None, False)      # one stopped earlier


@pytest.mark.slow
def test_step_greedy_against_hf_generate(checkpoints, tmp_path):
    """scripts/step_kernel_greedy.py's decode loop (prompts of different lengths fed a token a step, each at its
    own position, then greedy tokens; a sequence leaves the step when done) with v5 in float32 in the simulator,
    against HF transformers' generate(do_sample=False) in float32 on the same tiny checkpoint: the same tokens,
    or a first difference at a near-tie (the issue's rule)."""
    import torch
    from transformers import AutoModelForCausalLM

    from scripts.step_kernel_greedy import first_difference, step_greedy

    path = write_tiny_checkpoint(tmp_path, **SHAPES["d64"])
    weights, config = load_weights(path), load_config(path)
    with pytest.raises(ValueError, match="weight '.*' is float64"):        # (the reference's float64 arrays)
        sk.StepKernels(weights, config, num_ctas=1, version=5)
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    kernels = sk.StepKernels(weights, config, num_ctas=1, version=5, column_threads=64)
    prompts, max_new = [[5, 9], [3]], 2             # the second done a step before the first
    ours, logits = step_greedy(kernels, prompts, eos_ids={-1}, max_new=max_new, block_size=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, a, lg in zip(prompts, ours, logits):
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        theirs = seq[0, len(p):].tolist()
        assert len(a) == max_new and lg.shape == (max_new, weights["model.embed_tokens.weight"].shape[0])
        diff = first_difference(a, theirs, lg)
        assert diff is None or diff[1] < 1e-4, (a, theirs, diff)


def test_engine_model_shares_its_weights_with_the_step_kernels(tmp_path):
    """share_step_kernels: the kernels built from the engine's model (its merged q/k/v and gate/up) hold the
    bits the kernels built from the checkpoint's own tensors hold; the model's parameters become views of the
    kernels' stacks (held once), and the model's forward gives the bits it gave before."""
    import torch

    from helpers import PagedRunner
    from pagedattn.engine.model_runner import share_step_kernels
    from pagedattn.models.loader import load_model

    path = write_tiny_checkpoint(tmp_path, **SHAPES["d64"])
    model, config = load_model(path)
    before = PagedRunner(model, config).greedy([[5, 9, 3], [7]], 2)
    kernels = share_step_kernels(model, version=4, num_ctas=1, column_threads=64)
    layer = model.model.layers[0]
    for param, name in ((layer.self_attn.qkv_proj.weight, "qkv_w"), (layer.self_attn.qkv_proj.bias, "qkv_b"),
                        (layer.mlp.gate_up_proj.weight, "gate_up"), (layer.mlp.down_proj.weight, "down"),
                        (layer.self_attn.o_proj.weight, "o"), (layer.input_layernorm.weight, "ln1")):
        assert np.shares_memory(param.numpy(), kernels.stacked[name])
    after = PagedRunner(model, config).greedy([[5, 9, 3], [7]], 2)
    assert before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1], after[1]))

    # what a step computes from: every weight, stack and table the kernels hold, bit for bit (a step through the
    # engine's kernels runs in test_engine_decodes_through_the_step_kernel_in_the_simulator)
    own = sk.StepKernels({k: v.astype(np.float32) for k, v in load_weights(path).items()}, load_config(path),
                         num_ctas=1, version=4, column_threads=64)           # (the checkpoint is float32)
    assert kernels.config == own.config and kernels.stacked.keys() == own.stacked.keys()
    for name in kernels.stacked:
        np.testing.assert_array_equal(np.asarray(kernels.stacked[name]), np.asarray(own.stacked[name]), err_msg=name)
    for name in ("embed", "lm_head", "final_norm", "cos", "sin"):
        np.testing.assert_array_equal(np.asarray(getattr(kernels, name)), np.asarray(getattr(own, name)), err_msg=name)


def test_engine_decodes_through_the_step_kernel_in_the_simulator(tmp_path):
    """The engine's own path to the step kernel (ModelRunner.run_step's branch: the gathered ids, the step's
    positions and block tables, the engine's KV pool, the sampler on the kernel's logits), on the CPU with v4 in
    numba's CUDA simulator: two prompts, greedy, the decode steps the kernel's, the tokens those of the model's
    kernels (float32; the tiny model's top two logits are far apart)."""
    from pagedattn import LLM, SamplingParams
    from pagedattn.engine.model_runner import share_step_kernels

    path = write_tiny_checkpoint(tmp_path, **SHAPES["d64"])
    prompts, params = [[5, 9, 3], [7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", weights="float32", num_blocks=16, block_size=4, max_num_seqs=4)
    with LLM(path, **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **kw) as llm:
        runner, calls = llm.engine.runner, []
        kernels = runner.step_kernels = share_step_kernels(runner.model, 4, num_ctas=1, column_threads=64)
        runner.step_limits = (8, 1024)
        step = kernels.decode_step
        kernels.decode_step = lambda *args: calls.append(args[0].tolist()) or step(*args)       # noqa: E731
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert calls == [[want[0][0], want[1][0]], [want[0][1], want[1][1]]]       # the ids each decode step fed it

def test_step_kernel_setting_is_checked_and_decides_which_steps():
    """EngineConfig.step_kernel: a bad value or "on" where the kernel cannot run names the field; step_kernel_limits:
    "on" takes up to 8 sequences at contexts up to STEP_CONTEXT, "off", the CPU, two ranks, bfloat16 and the
    batch-invariant mode none, "auto" what was measured (STEP_KERNEL_AUTO)."""
    import types

    import torch

    from pagedattn.config import EngineConfig
    from pagedattn.engine import model_runner as mr
    from pagedattn.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="step_kernel must be"):
        EngineConfig(model="m", step_kernel=True)
    with pytest.raises(InvalidRequestError, match="step_kernel='on'.*device='cpu'"):
        EngineConfig(model="m", device="cpu", step_kernel="on")
    assert EngineConfig(model="m", device="cpu").step_kernel == "auto"
    gpu = dict(device="cuda", dtype=torch.float16, batch_invariant=False)
    config = lambda **kw: types.SimpleNamespace(**{**gpu, "step_kernel": "on", **kw})        # noqa: E731
    assert mr.step_kernel_limits(config(), 1) == (mr.STEP_MAX_SEQS, mr.STEP_CONTEXT) == (8, 1024)
    assert mr.step_kernel_limits(config(dtype=torch.float32), 1) == (8, 1024)
    for kw, ranks in ((dict(step_kernel="off"), 1), (dict(device="cpu"), 1), ({}, 2), (dict(dtype=torch.bfloat16), 1),
                      (dict(batch_invariant=True), 1)):
        assert mr.step_kernel_limits(config(**kw), ranks) is None, kw
    assert mr.step_kernel_limits(config(step_kernel="auto"), 1) == mr.STEP_KERNEL_AUTO

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_engine_decode_steps_through_the_step_kernel(dtype):
    """LLM(step_kernel="on") on random 0.5B weights: every graphed decode step of at most 8 sequences (batch sizes
    7..1 as requests finish: graphs of 8, 4, 2, 1 with padding rows) is the step kernel's, and is also run
    through the model's kernels eagerly on the same state: logits within float16 noise (float32: 1e-2, the
    kernels' sums in other orders), the greedy token the same wherever the top-two margin exceeds twice the
    difference. The padding rows wrote the pad block (a row writes one slot: nowhere else); a step of 12
    sequences (over 8) is the model's."""
    import torch

    from pagedattn import LLM, SamplingParams
    from scripts.benchlib import random_checkpoint

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, int(n)).tolist() for n in rng.integers(5, 300, 7)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(10, 60, 7)]
    llm = LLM(random_checkpoint("0.5b"), device="cuda", dtype=dtype, max_num_seqs=16, max_model_len=512,
              num_blocks=512, async_scheduling=False, step_kernel="on")
    runner = llm.engine.runner
    assert runner.step_kernels is not None and runner.pad_block == 512 and runner.kv_cache.k_caches[0].shape[0] == 513
    graphs = runner.capture_graphs()
    replay, kernels = graphs.run, runner.step_kernels
    stats = {"steps": 0, "sizes": set(), "worst": 0.0, "mismatch": 0, "step_kernel": 0}

    def checked(step):
        n = step.num_seqs
        took = runner.takes_step_kernel(step, graphs.key(step)[1])
        g_logits = replay(step)[:n].float().clone()
        dev = torch.from_numpy(step.data).to(runner.device)
        runner.step_kernels = None                      # the model's kernels, eagerly, on the same state
        try:
            _, e_logits = runner.run_step(step, dev, max_context_len=step.max_context_len)
        finally:
            runner.step_kernels = kernels
        e_logits = e_logits.float()
        diff = (g_logits - e_logits).abs().amax(-1)
        top2 = e_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        stats["steps"] += 1
        stats["sizes"].add(n)
        stats["step_kernel"] += took
        stats["worst"] = max(stats["worst"], float(diff.max()))
        stats["mismatch"] += int((g_logits.argmax(-1) != e_logits.argmax(-1))[clear].sum())
        return g_logits

    graphs.run = checked
    for k in runner.kv_cache.k_caches:
        k[512].zero_()                                  # (the captures' warm-ups wrote it)
    llm.generate(prompts, params, use_tqdm=False)
    print(stats)
    assert stats["steps"] > 20 and stats["step_kernel"] == stats["steps"] and len(stats["sizes"]) > 3
    assert stats["mismatch"] == 0 and stats["worst"] < (1.0 if dtype == "float16" else 1e-2)
    assert all(bool(k[512, :, 0].abs().sum() > 0) for k in runner.kv_cache.k_caches)   # the padding rows' writes
    from pagedattn.engine.cuda_graph import decode_header
    from pagedattn.engine.step_inputs import StepInputs

    assert not runner.takes_step_kernel(StepInputs(decode_header(12, 4), None), 64)      # over 8 sequences
    assert runner.takes_step_kernel(StepInputs(decode_header(8, 4), None), 512)
    big = [rng.integers(0, 10000, 20).tolist() for _ in range(12)]
    outs = llm.generate(big, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    llm.close()
