"""kernels_numba.cpu_layer's glue (a small CPU step's RMSNorm and rotary + KV write) against reference/layers.py.

Tolerances: rotary is the reference's float32 formula element by element, x1 cos - x2 sin with two
roundings; the kernel may contract one product into an FMA, so it is within 2 ulp of the result
(|x| |cos| + |x| |sin| <= 2 |x|: 4 u |x| absolute). RMSNorm sums E squares in another order than numpy's
pairwise sum: relative E u on the mean square, half of that on its inverse square root.
"""
import numpy as np
import pytest
import torch
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)

from kernels_numba import cpu_layer as cpu_glue
from pagedattn.errors import KernelLaunchError
from pagedattn.layers.rotary import rope_cos_sin_cache
from reference import layers as ref

U = 2.0 ** -24


@pytest.mark.parametrize("T, E", [(1, 896), (5, 64), (16, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(T, E, with_residual):
    g = torch.Generator().manual_seed(T * E)
    x, w = torch.randn(T, E, generator=g) * 3, torch.rand(E, generator=g) + 0.5
    res = torch.randn(T, E, generator=g) if with_residual else None
    want, want_r = ref.rms_norm(x, w, 1e-6, "float32", residual=res)
    res_before = None if res is None else res.clone()
    got = cpu_glue.add_rms_norm(x, res, w, 1e-6)
    if with_residual:
        got, got_r = got
        assert got_r is res                                       # the sum went into residual, in place
        assert np.array_equal(got_r.numpy(), (x + res_before).numpy())
        assert np.array_equal(got_r.numpy(), want_r)
    tol = E * U * np.abs(want) + 1e-30
    err = np.abs(got.numpy() - want)
    assert (err <= tol).all(), f"max err {err.max():.3g}"


@pytest.mark.parametrize("T, H, Hkv, D", [(1, 14, 2, 64), (7, 4, 4, 32), (16, 6, 2, 128)])
def test_rotary_cache_matches_reference(T, H, Hkv, D):
    g = torch.Generator().manual_seed(T + H + D)
    num_blocks, BS = 6, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    cache = rope_cos_sin_cache(D, 4096, 1e6)
    positions = torch.randint(0, 4096, (T,), generator=g, dtype=torch.int32)
    slots = torch.randperm(num_blocks * BS, generator=g)[:T].to(torch.int32)
    slots[T // 2] = -1                                            # padding: written nowhere
    k_cache = torch.full((num_blocks, Hkv, BS, D), float("nan"))
    v_cache = torch.full((num_blocks, Hkv, BS, D), float("nan"))
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    want_q, want_k, want_v = ref.rotary_and_cache(positions, q, k, v, cache, k_cache, v_cache, slots, "float32")
    got_q = cpu_glue.rotary_cache(positions, qkv, H, Hkv, D, cache, k_cache, v_cache, slots)
    assert got_q.shape == (T, H, D)
    assert np.allclose(got_q.numpy(), want_q, rtol=0, atol=4 * U * np.abs(q.numpy()).max())
    written = ~np.isnan(want_k)
    assert np.array_equal(written, ~np.isnan(k_cache.numpy()))   # exactly the slots asked for
    assert np.allclose(k_cache.numpy()[written], want_k[written], rtol=0, atol=4 * U * np.abs(k.numpy()).max())
    assert np.array_equal(v_cache.numpy()[written], want_v[written])


def test_bad_inputs_raise_before_writing():
    H, Hkv, D = 2, 1, 8
    qkv = torch.randn(2, (H + 2 * Hkv) * D)
    cache = rope_cos_sin_cache(D, 16, 1e4)
    kc, vc = torch.zeros(2, Hkv, 4, D), torch.zeros(2, Hkv, 4, D)
    with pytest.raises(KernelLaunchError, match="^positions:"):
        cpu_glue.rotary_cache(torch.tensor([0, 16], dtype=torch.int32), qkv, H, Hkv, D, cache, kc, vc,
                              torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(KernelLaunchError, match="^slot_mapping:"):
        cpu_glue.rotary_cache(torch.tensor([0, 1], dtype=torch.int32), qkv, H, Hkv, D, cache, kc, vc,
                              torch.tensor([0, 8], dtype=torch.int32))
    assert not kc.any() and not vc.any()
    with pytest.raises(KernelLaunchError, match="^qkv:"):
        cpu_glue.rotary_cache(torch.tensor([0, 1]), qkv[:, 1:], H, Hkv, D, cache, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(KernelLaunchError, match="^residual:"):
        cpu_glue.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(KernelLaunchError, match="^x:"):
        cpu_glue.add_rms_norm(torch.randn(2, 8).half(), None, torch.ones(8), 1e-6)


def test_model_step_on_the_cpu_glue_equals_the_torch_path(tiny_checkpoint, monkeypatch):  # noqa: F811
    """The engine on the CPU backend gives the torch backend's greedy tokens on the tiny model, with its
    small steps' layers as modules (GEMM kernel, glue kernels: each called) and as one call a layer (the
    default, kernels_numba/cpu_layer.py)."""
    from kernels_numba import cpu_linear
    from pagedattn import LLM, SamplingParams
    from pagedattn.layers.ops import run_layer

    calls = {"norm": 0, "rotary": 0, "gemm": 0}
    for mod, name, key in [(cpu_glue, "add_rms_norm", "norm"), (cpu_glue, "rotary_cache", "rotary"),
                           (cpu_linear, "linear", "gemm")]:
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _k=key, **kw: calls.__setitem__(_k, calls[_k] + 1) or _fn(*a, **kw))

    prompts = [[(7 * i + j) % 120 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for run, backend in (("modules", "cpu"), ("one call a layer", "cpu"), ("torch", "torch")):
        llm = LLM(tiny_checkpoint, device="cpu", block_size=8, num_blocks=64, attn_backend=backend)
        if run == "modules":
            llm.engine.model.ops.decoder_layer = run_layer
        outs[run] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if run == "modules":
            assert min(calls.values()) > 0, calls              # the decode steps took the kernels
    assert outs["modules"] == outs["one call a layer"] == outs["torch"]

