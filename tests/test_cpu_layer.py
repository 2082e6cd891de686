"""The fused CPU decoder layer (kernels_numba/cpu_layer.py, the CPU backend's `decoder_layer`): SiLU-and-mul
against float64, and a whole small step through the fused layers equal, bit for bit, to the same step
through the layer modules (every hidden state the model returns, prefill chunks and decodes): the bundled
model's GGUF blocks with float32 and int8 activations, and float32 weights (a tiny random checkpoint)."""
import numpy as np
import pytest
import torch

from helpers import ROOT, bundled_gguf, bundled_model_dir, tiny_checkpoint  # noqa: F401 (session fixtures)
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


PROMPTS = [[97, 11, 18, 0], [78, 39, 13, 52, 11, 32, 27, 15, 82, 13, 120, 40, 107, 42, 36],
           [17, 48, 22, 17, 28]]                      # token ids (4, 15 and 5 of them) within the tiny vocabulary


def record_steps(llm, fused, monkeypatch):
    """Every hidden-state tensor the model's forward returns while generating PROMPTS greedily (a token
    budget of 12 chunks the prompts, so steps of prefill chunks and decodes together stay small), with
    the fused layers on (the CPU backend's decoder_layer) or off (each layer's own forward); and the tokens."""
    from pagedattn import SamplingParams
    from pagedattn.layers.ops import run_layer

    model = llm.engine.model
    keep, forward, seen, calls = model.ops.decoder_layer, model.forward, [], [0]
    run = cpu_layer.run_layer
    monkeypatch.setattr(cpu_layer, "run_layer", lambda *a: calls.__setitem__(0, calls[0] + 1) or run(*a))
    if not fused:
        model.ops.decoder_layer = run_layer

    def recording_forward(input_ids, positions, kv_cache, attn_metadata):
        out = forward(input_ids, positions, kv_cache, attn_metadata)
        seen.append(out.clone())
        return out

    model.forward = recording_forward
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        model.forward, model.ops.decoder_layer = forward, keep
        monkeypatch.setattr(cpu_layer, "run_layer", run)
    num_layers = len(model.model.layers)
    assert calls[0] == (len(seen) * num_layers if fused else 0)     # every step is small here
    return seen, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("weights, activations", [("quantized", "float32"), ("quantized", "int8"), ("float32", None)])
def test_fused_layers_equal_the_layer_modules(request, weights, activations, monkeypatch):
    from pagedattn import LLM
    from pagedattn.layers.cpu import _fused_weights

    if weights == "quantized":
        request.getfixturevalue("bundled_gguf")
        path, kw = request.getfixturevalue("bundled_model_dir"), dict(activations=activations)
    else:
        path, kw = request.getfixturevalue("tiny_checkpoint"), {}
    llm = LLM(path, device="cpu", weights=weights, num_blocks=32, max_model_len=256, max_num_batched_tokens=12,
              enable_prefix_caching=False, **kw)
    model = llm.engine.model
    assert model.ops.decoder_layer == model.attn_backend.decoder_layer
    fused, fused_tokens = record_steps(llm, True, monkeypatch)
    plain, plain_tokens = record_steps(llm, False, monkeypatch)
    assert _fused_weights(model.model.layers[0])[0] == cpu_layer.layer_kind(activations)
    assert len(fused) == len(plain) > 6
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {i}: max difference {(a - b).abs().max()}"
    assert fused_tokens == plain_tokens


def test_fused_layers_are_chosen_where_they_apply(tiny_checkpoint, monkeypatch):  # noqa: F811
    """The CPU backend in float32: its decoder_layer; the torch backend, bfloat16: each layer's own forward.
    Within it, the fused call runs in a small step's scope on float32 pools; a step above cpu_quant.MAX_ROWS
    rows, outside a small step's scope or on a 16-bit pool, or a layer whose weights are not of one kind, runs
    the layer's own forward."""
    from kernels_numba import cpu_quant
    from pagedattn import LLM
    from pagedattn.layers.ops import run_layer

    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=8, max_model_len=64)
    model, kv = llm.engine.model, llm.engine.runner.kv_cache
    backend = model.attn_backend
    assert model.ops.decoder_layer == backend.decoder_layer
    class Fused(Exception):
        pass

    def fused(*args):
        raise Fused

    monkeypatch.setattr(cpu_layer, "run_layer", fused)
    monkeypatch.setattr(type(model.model.layers[0]), "forward", lambda *a: "module")
    layer, k, v = model.model.layers[0], kv.k_caches[0], kv.v_caches[0]

    def which(rows, k_cache=k):
        from pagedattn.kv_cache import AttentionMetadata
        meta = AttentionMetadata.build([1] * rows, [1] * rows, [[0]] * rows, kv.block_size, 0)
        x = torch.zeros(rows, model.config.hidden_size)
        try:
            return "module" if backend.decoder_layer(layer, torch.zeros(rows, dtype=torch.int32), x, None, k_cache,
                                                     v, meta) == "module" else "?"
        except Fused:
            return "fused"

    assert which(4) == "module"                                      # outside the step's scope
    with model.ops.step_scope(4):
        assert which(4) == "fused"
        assert which(cpu_quant.MAX_ROWS + 1) == "module"
        assert which(4, torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)) == "module"
        backend._layers.clear()                                      # weights of two kinds: the module, remembered
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data.half()
        assert which(4) == "module" and backend._layers[layer] is None
    assert LLM(tiny_checkpoint, device="cpu", attn_backend="torch", num_blocks=8,
               max_model_len=64).engine.model.ops.decoder_layer is run_layer
    bf16 = LLM(tiny_checkpoint, device="cpu", dtype="bfloat16", num_blocks=8, max_model_len=64)
    assert bf16.engine.model.ops.decoder_layer is run_layer


def _layer_args(llm):
    """(kind, weights, pool) of the bundled model's first layer as cpu_layer.run_layer takes them."""
    import math

    from pagedattn.layers.cpu import _fused_weights

    model, kv = llm.engine.model, llm.engine.runner.kv_cache
    layer = model.model.layers[0]
    kind, w = _fused_weights(layer)
    attn = layer.self_attn
    pool = (kv.k_caches[0].numpy(), kv.v_caches[0].numpy(), attn.rotary_emb.cos_sin_cache.numpy(), attn.num_heads,
            attn.num_kv_heads, attn.head_dim, np.float32(1.0 / math.sqrt(attn.head_dim)))
    return kind, w, pool


def test_a_bad_position_is_named(bundled_model_dir, bundled_gguf):  # noqa: F811
    """A position outside the cos/sin cache raises KernelLaunchError naming `positions` (and writes no
    slot: the checks come before any write)."""
    from pagedattn import LLM

    llm = LLM(bundled_model_dir, device="cpu", weights="quantized", num_blocks=8, max_model_len=64)
    kind, w, pool = _layer_args(llm)
    k_cache, cos_sin, Hkv = pool[0], pool[2], pool[4]
    E = w[0].shape[0]
    x = np.zeros((1, E), np.float32)
    tables, ctx = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    plan_items = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.arange(Hkv, dtype=np.int64))
    before = k_cache.copy()
    first_slot_past_the_pool = k_cache.shape[0] * k_cache.shape[2]
    for positions, slots, field in (([cos_sin.shape[0]], [0], "positions"),
                                    ([0], [first_slot_past_the_pool], "slot_mapping")):
        positions, slots = np.array(positions, np.int32), np.array(slots, np.int32)     # the engine's dtypes
        step = (positions, slots, tables, np.array([0, 1], np.int32), ctx, *plan_items, 1, 1)   # 1 thread, tile 1
        with pytest.raises(KernelLaunchError, match=field):
            cpu_layer.run_layer(kind, x, None, w, pool, step, 1)
    assert np.array_equal(k_cache.view(np.uint32), before.view(np.uint32))      # bits (the pool is uninitialised)


_FIRST_LOOP = """
import math, sys
import numpy as np
from pagedattn import LLM
from pagedattn.layers.cpu import _fused_weights
from kernels_numba import cpu_layer
llm = LLM(sys.argv[1], device="cpu", weights="quantized", num_blocks=8, max_model_len=64)
kv, layer = llm.engine.runner.kv_cache, llm.engine.model.model.layers[0]
kind, w = _fused_weights(layer)
attn = layer.self_attn
pool = (kv.k_caches[0].numpy(), kv.v_caches[0].numpy(), attn.rotary_emb.cos_sin_cache.numpy(), attn.num_heads,
        attn.num_kv_heads, attn.head_dim, np.float32(1.0 / math.sqrt(attn.head_dim)))
x = np.ones((1, w[0].shape[0]), np.float32)
step = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.array([0, 1], np.int32),
        np.ones(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), np.arange(pool[4], dtype=np.int64), 2, 1)
out, res = cpu_layer.run_layer(kind, x, None, w, pool, step, 2)
print("finite", bool(np.isfinite(out).all()))
"""


def test_a_layer_may_be_the_first_parallel_loop_of_a_process(bundled_model_dir, bundled_gguf):  # noqa: F811
    """A fresh process whose first numba parallel loop runs inside a compiled layer (called directly, not
    through the engine, which starts the pool itself): numba's pool is started first, no crash. Twice, so
    that the second process loads the layer from the disk cache (a compile starts the pool; a load does not)."""
    import subprocess
    import sys

    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _FIRST_LOOP, bundled_model_dir], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
        assert r.returncode == 0 and "finite True" in r.stdout, r.stderr[-3000:]
