"""The fused CPU decoder layer (kernels_numba/cpu_layer.py, pagedattn/layers/cpu_layer.py): SiLU-and-mul
against float64, and a whole small step through the fused layers equal, bit for bit, to the same step
through the layer modules (every hidden state the model returns, prefill chunks and decodes, float32 and
int8 activations), on the bundled model's GGUF blocks."""
import numpy as np
import pytest
import torch

from helpers import bundled_model_dir  # noqa: F401 (session fixture)
from kernels_numba import cpu_layer
from pagedattn.errors import KernelLaunchError


def silu_mul_f64(x):
    g, u = np.split(x.astype(np.float64), 2, axis=1)
    return g / (1.0 + np.exp(-g)) * u


@pytest.mark.parametrize("shape", [(1, 2 * 4864), (3, 2 * 40), (16, 2 * 7)])
def test_silu_and_mul_matches_float64(shape):
    """Within 4 float32 ulps of |silu(g) u| (the polynomial exp's ~1e-7 and four roundings), over gates
    spanning the exponential's whole range: |g| up to a few hundred, where exp(-|g|) is flushed to 0 below
    e^-87 (an absolute error under 1e-35 |u|, which the tolerance's second term allows)."""
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g) * torch.tensor([0.1, 1.0, 10.0, 100.0])[torch.randint(0, 4, shape, generator=g)]
    x[0, :4] = torch.tensor([0.0, -0.0, 87.5, -87.5])[:min(4, shape[1] // 2)]
    ours = cpu_layer.silu_and_mul(x).numpy().astype(np.float64)
    ref = silu_mul_f64(x.numpy())
    u = np.abs(x.numpy()[:, shape[1] // 2:]).astype(np.float64)
    tol = 4 * np.finfo(np.float32).eps * np.abs(ref) + 1e-35 * u
    assert (np.abs(ours - ref) <= tol).all(), np.abs(ours - ref).max()
    # reference/layers.py (HF's two roundings in float32 numpy) within the same bound plus its own roundings
    from reference.layers import silu_and_mul
    theirs = silu_and_mul(x.numpy(), "float32").astype(np.float64)
    assert (np.abs(ours - theirs) <= tol + 2 * np.finfo(np.float32).eps * np.abs(ref)).all()
    torch_silu = torch.nn.functional.silu(x[:, :shape[1] // 2]) * x[:, shape[1] // 2:]
    np.testing.assert_allclose(ours, torch_silu.double().numpy(), rtol=5e-7, atol=1e-33)


def test_silu_and_mul_checks_its_input():
    with pytest.raises(KernelLaunchError, match="x: needs a contiguous"):
        cpu_layer.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(KernelLaunchError, match="x: needs a contiguous"):
        cpu_layer.silu_and_mul(torch.zeros(2, 6, dtype=torch.float64))


@pytest.fixture(scope="module")
def bundled_gguf(bundled_model_dir):  # noqa: F811
    import os

    from pagedattn import bundled

    target = bundled.gguf_cache_path(os.path.dirname(bundled_model_dir))
    if bundled.missing_pieces() and not os.path.isfile(target):
        pytest.skip("the bundled GGUF file is not in the cache and its pieces are not installed")
    return bundled.bundled_gguf_path(os.path.dirname(bundled_model_dir))


PROMPTS = ["def fib(n):", "Write a haiku about paged memory and caches, please.", "2 + 2 ="]


def record_steps(llm, fused):
    """Every hidden-state tensor the model's forward returns while generating PROMPTS greedily (a token
    budget of 12 chunks the prompts, so steps of prefill chunks and decodes together stay small), with
    the fused layers on or off; and the tokens."""
    from pagedattn import SamplingParams

    model = llm.engine.model
    layers, forward, seen = model.cpu_layers, model.forward, []

    class Counting:                                    # the fused layers, counting the steps they run
        steps = 0

        def takes(self, num_rows, kv_cache):
            return layers.takes(num_rows, kv_cache)

        def __call__(self, *args):
            Counting.steps += 1
            return layers(*args)

    model.cpu_layers = Counting() if fused else None

    def recording_forward(input_ids, positions, kv_cache, attn_metadata):
        out = forward(input_ids, positions, kv_cache, attn_metadata)
        seen.append(out.clone())
        return out

    model.forward = recording_forward
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        model.forward, model.cpu_layers = forward, layers
    assert Counting.steps == (len(seen) if fused else 0)     # every step is small here
    return seen, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_fused_layers_equal_the_layer_modules(bundled_model_dir, bundled_gguf, activations):  # noqa: F811
    from pagedattn import LLM

    llm = LLM(bundled_model_dir, device="cpu", weights="quantized", activations=activations, num_blocks=32,
              max_model_len=256, max_num_batched_tokens=12, enable_prefix_caching=False)
    layers = llm.engine.model.cpu_layers
    assert layers is not None
    fused, fused_tokens = record_steps(llm, True)
    plain, plain_tokens = record_steps(llm, False)
    assert layers.kind == cpu_layer.layer_kind(activations)
    assert len(fused) == len(plain) > 6
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {i}: max difference {(a - b).abs().max()}"
    assert fused_tokens == plain_tokens


def test_fused_layers_are_chosen_where_they_apply(bundled_model_dir, bundled_gguf, monkeypatch):  # noqa: F811
    """Quantized weights on the CPU with the numba backend: on; PAGEDATTN_CPU_LAYER=0 or float32 weights:
    off; a step above cpu_quant.MAX_ROWS rows or outside a small step's scope: the layer modules."""
    from kernels_numba import cpu_quant
    from pagedattn.layers.attention import CpuNumbaBackend
    from pagedattn.models.loader import load_gguf_model

    model, _ = load_gguf_model(bundled_model_dir, bundled_gguf, CpuNumbaBackend())
    layers = model.cpu_layers
    assert layers is not None

    class Pools:
        k_caches = [torch.zeros(1, dtype=torch.float32)]

    assert not layers.takes(1, Pools)                     # outside the step's scope
    with model.ops.step_scope(4):
        assert layers.takes(4, Pools)
        assert not layers.takes(cpu_quant.MAX_ROWS + 1, Pools)
        Pools.k_caches = [torch.zeros(1, dtype=torch.bfloat16)]
        assert not layers.takes(4, Pools)
    monkeypatch.setenv("PAGEDATTN_CPU_LAYER", "0")
    assert load_gguf_model(bundled_model_dir, bundled_gguf, CpuNumbaBackend())[0].cpu_layers is None


def test_a_bad_position_is_named(bundled_model_dir, bundled_gguf):  # noqa: F811
    """A position outside the cos/sin cache raises KernelLaunchError naming `positions` (and writes no
    slot: the checks come before any write)."""
    from pagedattn import LLM

    llm = LLM(bundled_model_dir, device="cpu", weights="quantized", num_blocks=8, max_model_len=64)
    model, kv = llm.engine.model, llm.engine.executor.runner.kv_cache
    layers = model.cpu_layers
    layers._prepare(model, kv)
    w, k_cache, v_cache = layers._layers[0]
    cos_sin, H, Hkv, D, scale = layers.geometry
    E = w[0].shape[0]
    x = np.zeros((1, E), np.float32)
    tables, ctx = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    plan_items = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.arange(Hkv, dtype=np.int64))
    before = k_cache.copy()
    first_slot_past_the_pool = k_cache.shape[0] * k_cache.shape[2]
    for positions, slots, field in (([cos_sin.shape[0]], [0], "positions"), ([0], [first_slot_past_the_pool], "slot_mapping")):
        positions, slots = np.array(positions, np.int32), np.array(slots, np.int32)     # the engine's dtypes
        step = (positions, slots, tables, np.array([0, 1], np.int32), ctx, *plan_items, 1)
        with pytest.raises(KernelLaunchError, match=field):
            cpu_layer.run_layer(layers.kind, x, None, w, (k_cache, v_cache, cos_sin, H, Hkv, D, scale), step, 1)
    assert np.array_equal(k_cache, before)
