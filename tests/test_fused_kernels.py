"""The decode step's glue kernels (kernels_numba/rmsnorm.py, rotary.py, activation.py) against
reference/layers.py, their layers' torch paths, Hugging Face's rotary embedding, and the whole model.

Without a GPU the kernels run in numba's CUDA simulator on CPU tensors (tests/conftest.py); the `gpu`
tests run the same checks at Qwen2-0.5B's shapes (hidden 896, 14 / 2 heads, head_dim 64, T up to 8192).

Tolerance: the kernels round to fp16/bf16 exactly where the reference (and HF) do, in float32 math; what
may differ is the order of float32 operations (the sum of squares of a row, a fused multiply-add on the
GPU, expf's last bit), a relative change of a few 1e-7 that can move a result across one rounding
boundary of the output dtype. So outputs must be within one unit in the last place of the output dtype
(2^-10 |x| for fp16, 2^-7 |x| for bf16), while any indexing, half-swap, sign or rounding-point mistake
moves them by many units. Copies (the new residual, v into the pool, untouched slots) must be exact.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import compile_in_subprocess, PagedRunner, tiny_checkpoint  # noqa: F401 (fixture)
from kernels_numba import activation, rmsnorm, rotary
from pagedattn.errors import KernelLaunchError
from pagedattn.layers.rotary import rope_cos_sin_cache
from reference import layers as ref

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: numba's CUDA simulator (conftest)
DTYPES = [torch.float16, torch.bfloat16]
NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TINY = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}   # the smallest subnormal step


def randn(*shape, seed=0, scale=1.0, dtype=torch.float16, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)


def assert_within_one_ulp(got, want, dtype, what, ulps=1, slack=0.0):
    """Elementwise |got - want| <= ulps units in the last place of want (+ the smallest subnormal, + slack:
    an absolute allowance per element). Failures list the worst elements (index, got, want)."""
    got = got.double().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    nan = np.isnan(want)                                           # slots nothing may write stay NaN
    err = np.where(nan, 0.0, np.abs(got - want))
    bound = ulps * ULP[dtype] * np.abs(np.where(nan, 0.0, want)) + TINY[dtype] + slack
    ok = (np.isnan(got) == nan) & (nan | (err <= bound))
    if not ok.all():
        bad = np.argwhere(~ok)
        worst = sorted(bad.tolist(), key=lambda i: -float(err[tuple(i)] / bound[tuple(i)]))[:5]
        detail = "; ".join(f"{tuple(i)}: got {got[tuple(i)]:.6g} want {want[tuple(i)]:.6g}" for i in worst)
        raise AssertionError(f"{what}: {len(bad)} of {ok.size} outside {ulps} unit(s) in the last place; "
                             f"max err {err.max():.3e}, mean err {err.mean():.3e}; worst: {detail}")


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


# ---- RMSNorm -------------------------------------------------------------------------------------
# (tokens, hidden): one 16-byte piece per thread (96 -> 12 pieces), and more pieces than a warp (264 -> 33)
NORM_SHAPES = [(3, 96), (2, 264)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_matches_reference(dtype, shape):
    T, hidden = shape
    x = randn(T, hidden, seed=1, scale=3.0, dtype=dtype)
    w = (1 + randn(hidden, seed=2, scale=0.1, dtype=torch.float32)).to(dtype)
    out = rmsnorm.rms_norm(x, w, 1e-6)
    want, _ = ref.rms_norm(x, w, 1e-6, NAME[dtype])
    assert out.dtype == dtype
    assert_within_one_ulp(out, want, dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rms_norm_matches_reference(dtype, shape):
    """residual += x (exact: one rounding per element, as the reference), then the norm of the sum;
    x read through a strided view (rows of a wider buffer), out written in place over x."""
    T, hidden = shape
    wide = randn(T, hidden + 8, seed=3, dtype=dtype)
    x = wide[:, :hidden]                                          # rows 16 bytes longer than the data
    residual = randn(T, hidden, seed=4, scale=4.0, dtype=dtype)
    w = (1 + randn(hidden, seed=5, scale=0.1, dtype=torch.float32)).to(dtype)
    want, want_res = ref.rms_norm(x, w, 1e-6, NAME[dtype], residual=residual)
    tail = wide[:, hidden:].clone()
    out, res = rmsnorm.fused_add_rms_norm(x, residual, w, 1e-6, out=x)
    assert res is residual and out is x
    assert np.array_equal(residual.float().cpu().numpy(), want_res), "the new residual is one exact rounding"
    assert_within_one_ulp(out, want, dtype, "fused_add_rms_norm")
    assert same_bits(wide[:, hidden:], tail), "the kernel wrote outside its rows"


def test_rms_norm_matches_torch_layer_path():
    """The RMSNorm layer's torch path (HF's recipe) and the kernel agree within one unit."""
    from pagedattn.layers.norm import RMSNorm
    from pagedattn.layers.attention import TorchPagedBackend
    from pagedattn.layers.ops import torch_ops

    norm = RMSNorm(96, 1e-6, torch_ops(TorchPagedBackend())).to(torch.bfloat16)
    norm.weight.copy_(1 + randn(96, seed=6, scale=0.1, dtype=torch.float32, device="cpu"))
    x, r = randn(4, 96, seed=7, dtype=torch.bfloat16), randn(4, 96, seed=8, dtype=torch.bfloat16)
    torch_out, torch_res = norm.to("cpu")(x.cpu(), r.cpu())
    out, res = rmsnorm.fused_add_rms_norm(x, r.clone(), norm.weight.to(DEVICE), 1e-6)
    assert torch.equal(res.cpu(), torch_res)
    assert_within_one_ulp(out, torch_out.float().numpy(), torch.bfloat16, "kernel vs torch layer")


def test_rms_norm_validation():
    x = randn(2, 96)
    w = torch.ones(96, dtype=torch.float16, device=DEVICE)
    with pytest.raises(KernelLaunchError, match="multiple of 8"):
        rmsnorm.rms_norm(randn(2, 100), torch.ones(100, dtype=torch.float16, device=DEVICE), 1e-6)
    with pytest.raises(KernelLaunchError, match="x.dtype"):
        rmsnorm.rms_norm(x.float(), w.float(), 1e-6)
    with pytest.raises(KernelLaunchError, match="residual must have 2 rows"):
        rmsnorm.fused_add_rms_norm(x, randn(3, 96), w, 1e-6)
    with pytest.raises(KernelLaunchError, match="16 bytes apart"):
        rmsnorm.rms_norm(randn(2, 100)[:, :96], w, 1e-6)


# ---- SiLU-and-mul --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, inter", [(3, 40), (2, 160)])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")      # the simulator's exp(100) in float32
def test_silu_and_mul_matches_reference(dtype, T, inter):
    x = randn(T, 2 * inter, seed=9, scale=4.0, dtype=dtype)
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0], dtype=dtype)             # exp overflow, saturation, zero
    out = activation.silu_and_mul(x)
    assert out.shape == (T, inter) and out.dtype == dtype
    assert_within_one_ulp(out, ref.silu_and_mul(x, NAME[dtype]), dtype, "silu_and_mul")
    torch_path = torch.nn.functional.silu(x[:, :inter].cpu()) * x[:, inter:].cpu()   # HF's act_fn(gate) * up
    assert_within_one_ulp(out, torch_path.float().numpy(), dtype, "silu_and_mul vs torch")


def test_silu_and_mul_strided_rows_and_validation():
    wide = randn(3, 96, seed=10)
    out = torch.full((3, 40), float("nan"), dtype=torch.float16, device=DEVICE)
    activation.silu_and_mul(wide[:, :80], out=out)                          # rows 96 apart, 80 used
    assert_within_one_ulp(out, ref.silu_and_mul(wide[:, :80], "float16"), torch.float16, "strided rows")
    with pytest.raises(KernelLaunchError, match="multiple of 8"):
        activation.silu_and_mul(randn(2, 24))
    with pytest.raises(KernelLaunchError, match="out"):
        activation.silu_and_mul(randn(2, 32), out=randn(3, 16))


# ---- rotary embedding + KV-cache write -----------------------------------------------------------
# (num_heads, num_kv_heads, head_dim): the tiny model's, and Qwen2-0.5B's GQA 7 at d=64
ROPE_HEADS = [(6, 2, 16), (14, 2, 64)]
MAX_POSITION = 64


def rope_case(heads, dtype, num_tokens=5, block_size=8, num_blocks=4, seed=11):
    """A merged qkv buffer and q/k/v views into it, a NaN-poisoned pool, positions up to the cache's end,
    slots with one padding token (-1)."""
    H, Hkv, D = heads
    qkv = randn(num_tokens, (H + 2 * Hkv) * D, seed=seed, dtype=dtype)
    q = qkv[:, :H * D].view(num_tokens, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(num_tokens, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(num_tokens, Hkv, D)
    pool = (num_blocks, Hkv, block_size, D)
    k_cache = torch.full(pool, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(pool, float("nan"), dtype=dtype, device=DEVICE)
    positions = torch.tensor([0, 3, MAX_POSITION - 1, 17, 40][:num_tokens], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 9, -1, 31, 12][:num_tokens], dtype=torch.int64, device=DEVICE)
    cache = rope_cos_sin_cache(D, MAX_POSITION, 10000.0, device=DEVICE)
    return qkv, q, k, v, k_cache, v_cache, positions, slots, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", ROPE_HEADS)
@pytest.mark.parametrize("in_place", [False, True])
def test_rotary_and_cache_matches_reference(dtype, heads, in_place):
    qkv, q, k, v, k_cache, v_cache, positions, slots, cache = rope_case(heads, dtype)
    before = qkv.clone()
    want_q, want_k, want_v = ref.rotary_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots, NAME[dtype])
    q_out = None if in_place else torch.empty(q.shape, dtype=dtype, device=DEVICE)
    got = rotary.rotary_embedding_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots, q_out=q_out)
    assert got is (q if in_place else q_out)
    assert_within_one_ulp(got, want_q, dtype, "q")
    assert_within_one_ulp(k_cache, want_k, dtype, "k in the pool")        # NaN where nothing was written
    assert np.array_equal(v_cache.float().cpu().numpy(), want_v, equal_nan=True), "v is copied exactly"
    H = heads[0] * heads[2]
    if in_place:
        assert same_bits(qkv[:, H:], before[:, H:]), "only q changes in the merged buffer"
    else:
        assert same_bits(qkv, before), "the merged qkv buffer is left as it was"


def test_rotary_int64_positions_and_validation():
    qkv, q, k, v, k_cache, v_cache, positions, slots, cache = rope_case((6, 2, 16), torch.float16, num_tokens=3)
    got = rotary.rotary_embedding_and_cache(positions.long(), q, k, v, cache, k_cache, v_cache, slots.int(),
                                            q_out=torch.empty(q.shape, dtype=q.dtype, device=DEVICE))
    want_q, _, _ = ref.rotary_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots, "float16")
    assert_within_one_ulp(got, want_q, torch.float16, "int64 positions")
    with pytest.raises(KernelLaunchError, match="positions must lie in"):
        rotary.rotary_embedding_and_cache(positions + MAX_POSITION, q, k, v, cache, k_cache, v_cache, slots)
    with pytest.raises(KernelLaunchError, match="slot_mapping must lie in"):
        rotary.rotary_embedding_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots + 1000)
    with pytest.raises(KernelLaunchError, match="multiple of 16"):
        small = torch.zeros(3, 2, 8, dtype=torch.float16, device=DEVICE)
        rotary.rotary_embedding_and_cache(positions, small, small[:, :1], small[:, :1], cache[:, :8],
                                          k_cache[..., :8].contiguous(), v_cache[..., :8].contiguous(), slots)


def test_rope_cache_and_torch_rotary_equal_hugging_face_bit_for_bit():
    """float32: the cos/sin cache holds HF's values at every position, and the torch path's rotation
    (with the numpy reference's) is HF's apply_rotary_pos_emb bit for bit."""
    import transformers
    from transformers.models.qwen2 import modeling_qwen2

    from pagedattn.layers.rotary import RotaryEmbedding

    D, P, theta = 64, 4096, 1e6
    config = transformers.Qwen2Config(hidden_size=14 * D, num_attention_heads=14, num_key_value_heads=2,
                                      max_position_embeddings=P, rope_theta=theta)
    hf_rope = modeling_qwen2.Qwen2RotaryEmbedding(config)
    positions = torch.arange(P)
    cos, sin = hf_rope(torch.zeros(1, P, D), positions[None])                 # (1, P, D) each
    ours = RotaryEmbedding(D, P, theta)
    assert torch.equal(ours.cos_sin_cache, torch.cat([cos[0, :, :D // 2], sin[0, :, :D // 2]], dim=-1))
    pos = torch.tensor([0, 1, 77, 1000, P - 1])
    q, k = torch.randn(5, 14, D), torch.randn(5, 2, D)
    hf_q, hf_k = modeling_qwen2.apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                                     cos[:, pos], sin[:, pos])  # (1, heads, 5, D)
    our_q, our_k = ours(pos, q, k)
    assert torch.equal(our_q, hf_q[0].transpose(0, 1)) and torch.equal(our_k, hf_k[0].transpose(0, 1))
    assert np.array_equal(ref.rotate(q, pos, ours.cos_sin_cache, "float32"), hf_q[0].transpose(0, 1).numpy())


# ---- the layers and the whole model with the kernels ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_model_with_fused_kernels_matches_torch_path(tiny_checkpoint, dtype):  # noqa: F811
    """The tiny Qwen2 in fp16/bf16 through NumbaBackend (fused norm, rotary + cache write, SiLU-and-mul;
    its head_dim 16 leaves attention to torch) against the same model with the torch backend, both against
    float32. A prefill then decode steps. The kernels round where the torch ops round, so their distance to
    float32 must be the torch path's own rounding noise: at most 2x it."""
    from pagedattn.layers.attention import NumbaBackend, TorchPagedBackend
    from pagedattn.models.loader import load_model

    ids = [5, 9, 17, 3, 77, 41, 8]
    runs = {}
    for label, model_dtype, backend in (("fused", dtype, NumbaBackend()), ("torch", dtype, TorchPagedBackend()),
                                        ("fp32", torch.float32, TorchPagedBackend())):
        model, config = load_model(tiny_checkpoint, DEVICE, model_dtype, backend)
        runner = PagedRunner(model, config, num_blocks=8, block_size=8, dtype=model_dtype, device=DEVICE)
        steps = [runner.step([(0, ids)], num_prefills=1)] + [runner.step([(0, [t])], num_prefills=0) for t in (4, 50)]
        runs[label] = torch.cat(steps).cpu()
    d_fused = (runs["fused"] - runs["fp32"]).abs().max()
    d_torch = (runs["torch"] - runs["fp32"]).abs().max()
    print(f"max |fused - fp32| = {d_fused:.4f}, max |torch {dtype} - fp32| = {d_torch:.4f}")
    assert 0 < d_torch and d_fused <= 2 * d_torch
    assert torch.equal(runs["fused"].argmax(-1), runs["fp32"].argmax(-1))


def test_ops_table_is_chosen_at_build(tiny_checkpoint):  # noqa: F811
    """The backend, device and dtype the model is built with choose its ops table once, and every layer
    holds that table: NumbaBackend on fp16 takes the glue kernels where the tiny model's widths allow
    (head_dim 16, hidden 96, I 160: the rotary, norm and SiLU kernels); float32 and the torch
    backend keep torch ops."""
    from kernels_numba import activation, rmsnorm
    from pagedattn.layers import ops as ops_module
    from pagedattn.layers.attention import NumbaBackend, TorchPagedBackend, fused_rotary_and_cache_write
    from pagedattn.models.loader import load_model

    numba = NumbaBackend()
    model, config = load_model(tiny_checkpoint, DEVICE, torch.float16, numba)
    ops = model.ops
    assert model.attn_backend is numba and ops.backend is numba and ops.attention == numba.attend
    assert ops.rms_norm.func is rmsnorm.rms_norm and ops.add_rms_norm.func is rmsnorm.fused_add_rms_norm
    assert ops.silu_and_mul.func is activation.silu_and_mul
    assert ops.rotary_and_cache_write.func is fused_rotary_and_cache_write
    assert ops.decoder_layer is ops_module.run_layer                 # every layer through its own forward
    layer = model.model.layers[1]
    assert all(m.ops is ops for m in (layer.input_layernorm, layer.mlp.act_fn, layer.mlp.down_proj,
                                      layer.self_attn, model.lm_head))
    for dtype, backend in ((torch.float32, NumbaBackend()), (torch.float16, TorchPagedBackend())):
        ops = load_model(tiny_checkpoint, DEVICE, dtype, backend)[0].ops
        assert ops.rms_norm is ops_module.rms_norm and ops.silu_and_mul is ops_module.silu_and_mul
        assert ops.rotary_and_cache_write.func is ops_module.rotary_then_write
        assert ops.rotary_and_cache_write.args == (backend.write,)
    assert numba.can_capture(torch.float16, 64, 16) and numba.can_capture("bfloat16", 128, 32)
    assert not numba.can_capture(torch.float32, 64, 16) and not numba.can_capture(torch.float16, 16, 16)
    assert not TorchPagedBackend().can_capture(torch.float16, 64, 16)


# ---- codegen: sm_90 PTX without a GPU ------------------------------------------------------------
_SCRIPT = r"""
import json, re, sys, types as _pytypes
import numba.cuda.dispatcher as _dispatcher
_dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, types
from kernels_numba import activation, rmsnorm, rotary

u32, i64, f32 = types.uint32[::1], types.int64, types.float32
NORM = (u32, i64, u32, i64, u32, u32, i64, i64, f32, f32)
KERNELS = {
    "rms_norm_f16": (rmsnorm._make_kernel(False, False), NORM),
    "fused_add_rms_norm_bf16": (rmsnorm._make_kernel(True, True), NORM),
    "silu_and_mul_f16": (activation._make_kernel(False), (u32, i64, u32, i64, i64)),
    "rotary_cache_d64_f16": (rotary._make_kernel(64, False),
                             (types.int32[::1], u32, i64, u32, i64, u32, i64, u32, i64, u32, u32, u32,
                              types.int32[::1], i64, i64, i64)),
    "rotary_cache_d128_bf16": (rotary._make_kernel(128, True),
                               (types.int64[::1], u32, i64, u32, i64, u32, i64, u32, i64, u32, u32, u32,
                                types.int64[::1], i64, i64, i64)),
}
out = {}
for name, (kernel, sig) in KERNELS.items():
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    open(f"{sys.argv[1]}/{name}.ptx", "w").write(ptx)
    out[name] = {
        "ld_global_v4": len(re.findall(r"ld\.global\.v4", ptx)),
        "st_global_v4": len(re.findall(r"st\.global\.v4", ptx)),
        "generic_ld_st": len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:ld|st)\.(?:v\d\.)?[us]\d+", ptx, re.M)),
        "local": bool(re.search(r"\.local\b|ld\.local|st\.local", ptx)),
        "f64": len(re.findall(r"\.f64\b", ptx)),
        "shfl": len(re.findall(r"shfl\.sync", ptx)),
    }
print(json.dumps(out))
"""
# name -> (16-byte loads at least, 16-byte stores at least)
WIDE = {"rms_norm_f16": (2, 1), "fused_add_rms_norm_bf16": (4, 2), "silu_and_mul_f16": (2, 1),
        "rotary_cache_d64_f16": (7, 5), "rotary_cache_d128_bf16": (7, 5)}


@pytest.fixture(scope="module")
def compiled():
    tmp = tempfile.mkdtemp(prefix="glue_ptx_")
    stdout = compile_in_subprocess(_SCRIPT, tmp, timeout=600)
    yield json.loads(stdout.strip().splitlines()[-1]), tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(WIDE))
def test_codegen_16_byte_global_loads_and_stores(compiled, name):
    stats = compiled[0][name]
    loads, stores = WIDE[name]
    assert stats["ld_global_v4"] >= loads and stats["st_global_v4"] >= stores, stats
    assert stats["generic_ld_st"] == 0, f"{name}: loads/stores through generic addresses: {stats}"
    assert not stats["local"] and stats["f64"] == 0, stats
    assert (stats["shfl"] > 0) == name.endswith(("rms_norm_f16", "rms_norm_bf16")), stats


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(WIDE))
def test_codegen_ptxas_no_spills(compiled, name):
    ptx = Path(compiled[1], name + ".ptx").read_text()
    ver = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", ver)
    if m:  # NVVM may write a newer PTX ISA version than this ptxas reads; these kernels use nothing new
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, flags=re.M)
    src = Path(compiled[1], name + ".fixed.ptx")
    src.write_text(ptx)
    proc = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(src), "-o", os.devnull], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stderr + proc.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in report and "0 bytes stack frame" in report, report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 64, report   # many CTAs per SM


# ---- GPU: real shapes, CUDA graphs, the on-disk cache --------------------------------------------
QWEN_05B = dict(hidden=896, heads=14, kv_heads=2, head_dim=64, inter=4864)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 256, 8192])
def test_gpu_kernels_at_real_shapes(dtype, T):
    """Each kernel at Qwen2-0.5B's shapes against the reference (norm, silu) and against torch on the
    GPU in float32 math (rotary: HF's formula with the same float32 cos/sin)."""
    c = QWEN_05B
    x, r = randn(T, c["hidden"], seed=1, dtype=dtype), randn(T, c["hidden"], seed=2, scale=4.0, dtype=dtype)
    w = (1 + randn(c["hidden"], seed=3, scale=0.1, dtype=torch.float32)).to(dtype)
    want, want_r = ref.rms_norm(x, w, 1e-6, NAME[dtype], residual=r)
    out, r = rmsnorm.fused_add_rms_norm(x, r, w, 1e-6)
    assert np.array_equal(r.float().cpu().numpy(), want_r)
    # HF rounds twice (the normalised row to the dtype, then its product with the weight; silu, then its
    # product with up): the GPU's float32 sum of squares (a tree, not numpy's order) and its exp can move the
    # first rounding across a boundary, which the second rounding carries: two units, not one.
    assert_within_one_ulp(out, want, dtype, "fused_add_rms_norm", ulps=2)
    g = randn(T, 2 * c["inter"], seed=4, scale=4.0, dtype=dtype)
    assert_within_one_ulp(activation.silu_and_mul(g), ref.silu_and_mul(g, NAME[dtype]), dtype, "silu_and_mul",
                          ulps=2)
    H, Hkv, D = c["heads"], c["kv_heads"], c["head_dim"]
    qkv = randn(T, (H + 2 * Hkv) * D, seed=5, dtype=dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    cache = rope_cos_sin_cache(D, 32768, 1e6, device="cuda")
    positions = torch.randint(0, 32768, (T,), device="cuda", dtype=torch.int32)
    positions[0] = 32767
    block_size, num_blocks = 16, T // 16 + 2
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:T]
    slots[::5] = -1
    k_cache = torch.full((num_blocks, Hkv, block_size, D), float("nan"), dtype=dtype, device="cuda")
    v_cache = k_cache.clone()
    q_out = torch.empty(T, H, D, dtype=dtype, device="cuda")
    rotary.rotary_embedding_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots, q_out=q_out)
    cos, sin = cache[positions.long()].chunk(2, dim=-1)                      # (T, D/2) each
    rot = lambda t: torch.cat([t[..., :D // 2].float() * cos[:, None] - t[..., D // 2:].float() * sin[:, None],  # noqa: E731
                               t[..., D // 2:].float() * cos[:, None] + t[..., :D // 2].float() * sin[:, None]], -1)
    # where x1 cos - x2 sin nearly cancels, the float32 rounding of the two products (the kernel's fma order
    # against torch's) is all that is left: allow it on top of one unit of the result
    mag = lambda t: torch.cat([(t[..., :D // 2].float() * cos[:, None]).abs() + (t[..., D // 2:].float() * sin[:, None]).abs()] * 2, -1)  # noqa: E731,E501
    fp32 = lambda t: (2.0 ** -23 * mag(t)).cpu().numpy()                      # noqa: E731
    assert_within_one_ulp(q_out, rot(q).to(dtype).float().cpu().numpy(), dtype, "q", slack=fp32(q))
    keep = slots >= 0
    s = slots[keep]
    assert_within_one_ulp(k_cache[s // block_size, :, s % block_size], rot(k)[keep].to(dtype).float().cpu().numpy(),
                          dtype, "k in the pool", slack=fp32(k)[keep.cpu().numpy()])
    assert same_bits(v_cache[s // block_size, :, s % block_size], v[keep])


@pytest.mark.gpu
def test_gpu_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed on new data in the same buffers: the replay computes what an eager call does."""
    T, hidden = 8, 896
    x, r = randn(T, hidden, seed=1), randn(T, hidden, seed=2)
    w = torch.ones(hidden, dtype=torch.float16, device="cuda")
    g = randn(T, 2 * 4864, seed=3)
    out, act = torch.empty_like(x), torch.empty(T, 4864, dtype=torch.float16, device="cuda")
    rmsnorm.fused_add_rms_norm(x, r.clone(), w, 1e-6, out=out, validate=False)  # compile outside the capture
    activation.silu_and_mul(g, out=act, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rmsnorm.fused_add_rms_norm(x, r, w, 1e-6, out=out, validate=True)      # value checks skipped inside
        activation.silu_and_mul(g, out=act, validate=True)
    x.copy_(randn(T, hidden, seed=4))
    r.copy_(randn(T, hidden, seed=5))
    g.copy_(randn(T, 2 * 4864, seed=6))
    want, want_r = ref.rms_norm(x, w, 1e-6, "float16", residual=r)
    want_act = ref.silu_and_mul(g, "float16")
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(r.float().cpu().numpy(), want_r)
    assert_within_one_ulp(out, want, torch.float16, "graph norm")
    assert_within_one_ulp(act, want_act, torch.float16, "graph silu")


_CACHE_SCRIPT = r"""
import json, torch
from kernels_numba import activation, rmsnorm, rotary
from pagedattn.layers.rotary import rope_cos_sin_cache
x = torch.randn(4, 896, device="cuda", dtype=torch.float16)
rmsnorm.fused_add_rms_norm(x, x.clone(), torch.ones(896, device="cuda", dtype=torch.float16), 1e-6)
activation.silu_and_mul(torch.randn(4, 64, device="cuda", dtype=torch.float16))
qkv = torch.randn(4, 18 * 64, device="cuda", dtype=torch.float16)
q, k, v = qkv[:, :14 * 64].view(4, 14, 64), qkv[:, 14 * 64:16 * 64].view(4, 2, 64), qkv[:, 16 * 64:].view(4, 2, 64)
pool = torch.zeros(2, 2, 16, 64, device="cuda", dtype=torch.float16)
rotary.rotary_embedding_and_cache(torch.arange(4, device="cuda"), q, k, v, rope_cos_sin_cache(64, 64, 1e4, "cuda"),
                                  pool, pool.clone(), torch.arange(4, device="cuda"))
torch.cuda.synchronize()
kernels = [rmsnorm._make_kernel(False, True), activation._make_kernel(False), rotary._make_kernel(64, False)]
print(json.dumps([[sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())] for k in kernels]))
"""


@pytest.mark.gpu
def test_gpu_second_process_loads_kernels_from_disk_cache(tmp_path):
    """cache=True: a second process finds every glue kernel in numba's on-disk cache (no compile)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs, seconds = [], []
    for _ in range(2):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        seconds.append(time.monotonic() - start)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"process with compiles: {seconds[0]:.1f} s, process loading from the cache: {seconds[1]:.1f} s "
          "(imports and CUDA start-up included)")
    assert all(hits == 0 and misses >= 1 for hits, misses in runs[0]), runs
    assert all(hits >= 1 and misses == 0 for hits, misses in runs[1]), runs
