"""The model on the GGUF file's quantized blocks (weights="quantized"): choosing the path, loading it,
its layers against the float32 checkpoint's on real tensors, and the engine's output against HF
transformers on the converted (dequantized) checkpoint."""
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import bundled_gguf, bundled_model_dir, hf_greedy_reference, tiny_checkpoint  # noqa: F401 (session fixtures)
from pagedattn import bundled
from pagedattn.config import EngineConfig
from pagedattn.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def quant_model(bundled_model_dir, bundled_gguf):  # noqa: F811
    from pagedattn.layers.cpu import CpuNumbaBackend
    from pagedattn.models.loader import load_gguf_model

    return load_gguf_model(bundled_model_dir, bundled_gguf, CpuNumbaBackend())


# ---------------------------------------------------------------- weights=: validation and resolution

def test_weights_must_be_a_known_value():
    with pytest.raises(InvalidRequestError, match="weights"):
        EngineConfig(model="x", device="cpu", weights="int8")


@pytest.mark.parametrize("kwargs", [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"tensor_parallel_size": 2}])
def test_quantized_needs_float32_on_one_rank(kwargs):
    with pytest.raises(InvalidRequestError, match="weights='quantized'"):
        EngineConfig(model="x", device="cpu", weights="quantized", **kwargs)


def test_quantized_on_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # the config's check only; nothing runs
    with pytest.raises(InvalidRequestError, match="weights='quantized'.*device='cuda'"):
        EngineConfig(model="x", device="cuda", weights="quantized")


def test_quantized_needs_a_gguf_file(tiny_checkpoint):  # noqa: F811
    config = EngineConfig(model=tiny_checkpoint, device="cpu", weights="quantized")
    with pytest.raises(InvalidRequestError, match="weights='quantized' needs a GGUF file"):
        config.with_model_path(tiny_checkpoint)
    # "auto" on a checkpoint without one: the float32 path, nothing raised
    auto = EngineConfig(model=tiny_checkpoint, device="cpu").with_model_path(tiny_checkpoint)
    assert auto.weights == "float32" and auto.gguf_file is None


def test_bundled_model_weights_resolve(bundled_model_dir, bundled_gguf, monkeypatch):  # noqa: F811
    """"auto" is the bundled GGUF's blocks on the CPU (float32, one rank), the float32 checkpoint otherwise;
    "quantized" and "float32" are taken as asked."""
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", os.path.dirname(bundled_model_dir))
    config = EngineConfig(device="cpu").with_model_path(None)
    assert (config.model, config.weights, config.gguf_file) == (bundled_model_dir, "quantized", bundled_gguf)
    quantized = EngineConfig(device="cpu", weights="quantized").with_model_path(None)
    assert (quantized.weights, quantized.gguf_file) == ("quantized", bundled_gguf)
    f32 = EngineConfig(device="cpu", weights="float32").with_model_path(None)
    assert (f32.weights, f32.gguf_file) == ("float32", None)
    half = EngineConfig(device="cpu", dtype="bfloat16").with_model_path(None)
    assert (half.weights, half.gguf_file) == ("float32", None)
    # the converted directory given by path: its GGUF beside it
    assert EngineConfig(device="cpu").with_model_path(bundled_model_dir).gguf_file == bundled_gguf
    asked = EngineConfig(device="cpu", weights="quantized").with_model_path(bundled_model_dir)
    assert asked.gguf_file == bundled_gguf


def test_auto_without_the_joined_file_stays_float32(tmp_path, monkeypatch):
    """A bundled model whose pieces are not installed (and no joined GGUF): "auto" falls back to float32
    instead of failing; "quantized" says why it cannot."""
    monkeypatch.setattr(bundled, "bundled_model_path", lambda: str(tmp_path))

    def no_pieces(cache_dir=None):
        raise ModelLoadError("bundled model piece x is not installed")
    monkeypatch.setattr(bundled, "bundled_gguf_path", no_pieces)
    assert EngineConfig(device="cpu").with_model_path(None).weights == "float32"
    with pytest.raises(ModelLoadError, match="not installed"):
        EngineConfig(device="cpu", weights="quantized").with_model_path(None)


@pytest.mark.parametrize("kwargs, message", [
    ({"activations": "int4"}, "activations must be 'auto', 'float32' or 'int8'"),
    ({"activations": "int8", "weights": "float32"}, "activations='int8' runs on the quantized weights"),
    ({"activations": "int8", "dtype": "bfloat16"}, "activations='int8' runs on the quantized weights"),
])
def test_activations_are_validated(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(model="x", device="cpu", **kwargs)


def test_int8_activations_need_a_gguf_file(tiny_checkpoint):  # noqa: F811
    with pytest.raises(InvalidRequestError, match="activations='int8'.*no \\*.gguf"):
        EngineConfig(model=tiny_checkpoint, device="cpu", activations="int8").with_model_path(tiny_checkpoint)


@pytest.mark.parametrize("avx2", [True, False])
def test_auto_activations_are_int8_on_quantized_weights_where_the_target_has_avx2(bundled_model_dir, bundled_gguf,
                                                                                  tiny_checkpoint, avx2, monkeypatch):  # noqa: F811
    """activations="auto" (the default): int8 on the GGUF blocks where numba's target has AVX2 (the byte
    multiply-adds that make it fast), float32 without AVX2 and on float32 weights; an explicit value stays."""
    from kernels_numba import cpu_simd

    monkeypatch.setattr(cpu_simd, "target_has_avx2", lambda: avx2)
    auto = EngineConfig(model=bundled_model_dir, device="cpu")
    assert auto.activations == "auto"
    resolved = auto.with_model_path(bundled_model_dir)
    assert (resolved.weights, resolved.activations) == ("quantized", "int8" if avx2 else "float32")
    assert resolved.with_model_path(bundled_model_dir).activations == resolved.activations     # resolved once
    kept = EngineConfig(model=bundled_model_dir, device="cpu", activations="float32").with_model_path(bundled_model_dir)
    assert kept.activations == "float32"
    dense = EngineConfig(model=bundled_model_dir, device="cpu", weights="float32").with_model_path(bundled_model_dir)
    assert (dense.weights, dense.activations) == ("float32", "float32")
    tiny = EngineConfig(model=tiny_checkpoint, device="cpu").with_model_path(tiny_checkpoint)   # no GGUF file
    assert (tiny.weights, tiny.activations) == ("float32", "float32")


def test_kept_gguf_is_joined_when_missing(tmp_path, monkeypatch):
    """An old cache without the joined file: it is joined once from the checked pieces; later calls use it."""
    pieces = [tmp_path / f"p{k}" for k in range(2)]
    for k, p in enumerate(pieces):
        p.write_bytes(bytes([k]) * 100)
    calls = []
    monkeypatch.setattr(bundled, "verify_parts", lambda: calls.append(1) or [str(p) for p in pieces])
    monkeypatch.setattr(bundled, "GGUF_SIZE", 200)
    path = bundled.bundled_gguf_path(tmp_path / "cache")
    assert path == bundled.gguf_cache_path(str(tmp_path / "cache"))
    assert open(path, "rb").read() == bytes([0]) * 100 + bytes([1]) * 100
    assert bundled.bundled_gguf_path(tmp_path / "cache") == path and calls == [1]


def test_conversion_keeps_the_joined_gguf(tmp_path, monkeypatch):
    """The first conversion moves the joined file beside the converted directory instead of deleting it."""
    from test_bundled_model import fake_convert, make_fake_parts

    contents = [bytes([k]) * (50 + k) for k in range(6)]
    table, sha, distribution = make_fake_parts(tmp_path / "site", contents)
    monkeypatch.setattr(bundled, "_distribution", distribution)
    monkeypatch.setattr(bundled, "PARTS", table)
    monkeypatch.setattr(bundled, "GGUF_SHA256", sha)
    monkeypatch.setattr(bundled, "GGUF_SIZE", sum(map(len, contents)))
    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    bundled.bundled_model_path(tmp_path / "cache")
    kept = bundled.gguf_cache_path(str(tmp_path / "cache"))
    assert open(kept, "rb").read() == b"".join(contents)
    monkeypatch.setattr(bundled, "verify_parts", lambda *a: pytest.fail("re-joined a kept file"))
    assert bundled.bundled_gguf_path(tmp_path / "cache") == kept


# ---------------------------------------------------------------- the quantized layers on real tensors

def test_layers_hold_the_gguf_blocks(quant_model):
    from pagedattn.models.gguf_weights import QuantWeight

    model, config = quant_model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert [p.name for p in attn.qkv_proj.weight.parts] == ["blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                                            "blk.0.attn_v.weight"]
    assert [p.name for p in mlp.gate_up_proj.weight.parts] == ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]
    for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, model.model.embed_tokens,
                   model.lm_head):
        assert isinstance(module.weight, QuantWeight) and "weight" not in module._parameters
    assert model.lm_head.weight.parts[0].fmt == "Q8_0" and model.model.embed_tokens.weight.parts[0].fmt == "Q5_0"
    assert isinstance(attn.qkv_proj.bias, torch.nn.Parameter)                # biases stay float32


def test_fused_weights_are_the_checkpoints_bit_for_bit(quant_model, bundled_model_dir):  # noqa: F811
    """Layer 5's fused q/k/v and gate/up dequantize to the converted checkpoint's tensors stacked in
    the order the float32 path loads them (QKVParallelLinear / MergedColumnParallelLinear)."""
    from safetensors import safe_open

    model, _ = quant_model
    layer = model.model.layers[5]
    p = "model.layers.5."
    with safe_open(os.path.join(bundled_model_dir, "model.safetensors"), "pt") as f:
        qkv = torch.cat([f.get_tensor(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_bias = torch.cat([f.get_tensor(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        gate_up = torch.cat([f.get_tensor(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        down = f.get_tensor(p + "mlp.down_proj.weight")
    assert torch.equal(layer.self_attn.qkv_proj.weight.dequantize(), qkv)
    assert torch.equal(layer.self_attn.qkv_proj.bias, qkv_bias)
    assert torch.equal(layer.mlp.gate_up_proj.weight.dequantize(), gate_up)
    assert torch.equal(layer.mlp.down_proj.weight.dequantize(), down)


@pytest.mark.parametrize("rows", [1, 5, 16, 23])
def test_quantized_layers_match_the_float32_layers(quant_model, rows):
    """Each quantized layer of layer 3 against F.linear on its dequantized weight: equal up to the order
    of the float32 sums (tolerance: 8 float32 ulps of the sum of |x w| terms, K values summed)."""
    model, _ = quant_model
    layer = model.model.layers[3]
    g = torch.Generator().manual_seed(rows)
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        w = module.weight.dequantize()
        x = torch.randn(rows, w.shape[1], generator=g)
        with model.ops.step_scope(rows):
            ours = module(x)
        ref = F.linear(x.double(), w.double(), None if module.bias is None else module.bias.double())
        bound = 8 * np.finfo(np.float32).eps * (x.double().abs() @ w.double().abs().T) + 1e-30
        err = (ours.double() - ref).abs()
        assert (err <= bound).all(), f"{module.weight}: max error {err.max():.2e}, bound there {bound.max():.2e}"


def test_embedding_rows_are_the_tables(quant_model, bundled_model_dir):  # noqa: F811
    from safetensors import safe_open

    model, config = quant_model
    ids = torch.tensor([0, 1, 151643, config.vocab_size - 1, 872, 872])
    with safe_open(os.path.join(bundled_model_dir, "model.safetensors"), "pt") as f:
        table = f.get_slice("model.embed_tokens.weight")
        want = torch.stack([table[i:i + 1][0] for i in ids.tolist()])
    assert torch.equal(model.model.embed_tokens(ids), want)


def test_weight_bytes_are_the_files(quant_model, bundled_gguf):
    from pagedattn.engine.metrics import model_weight_bytes

    model, _ = quant_model
    size = os.path.getsize(bundled_gguf)
    assert 0.95 * size < model_weight_bytes(model) < size                  # the blocks, not a float32 copy


def test_a_missing_tensor_is_named(tmp_path, bundled_model_dir, bundled_gguf, monkeypatch):  # noqa: F811
    from pagedattn.models import gguf_weights, loader

    read = gguf_weights.read_gguf
    monkeypatch.setattr(gguf_weights, "read_gguf",
                        lambda path: {k: v for k, v in read(path).items() if k != "blk.7.ffn_up.weight"})
    with pytest.raises(ModelLoadError, match="model.layers.7.mlp.up_proj.weight"):
        loader.load_gguf_model(bundled_model_dir, bundled_gguf)


# ---------------------------------------------------------------- the engine on the blocks

def test_seeded_sampling_is_reproducible(bundled_model_dir, bundled_gguf):  # noqa: F811
    from pagedattn import LLM, SamplingParams

    llm = LLM(bundled_model_dir, device="cpu", weights="quantized", num_blocks=16, max_model_len=256)
    from kernels_numba.cpu_simd import target_has_avx2

    m = llm.metrics()
    assert (m["weights"], m["activations"]) == ("quantized", "int8" if target_has_avx2() else "float32")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=3, seed=7, n=2)
    a, b = (llm.generate(["def fib(n):"], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(c.token_ids) == 3 for c in a.outputs)


def test_int8_activations_on_the_bundled_layers(quant_model):
    """Layer 3's matrices with activations="int8" (QuantWeight(parts, "int8")): off the float32 product by
    at most what rounding x costs, |W| |x_hat - x| (x_hat the reference's dx * xq), plus the float32
    summation bound; the kernel's output over the largest error is printed (docs/cpu.md's figure)."""
    from pagedattn.models.gguf_weights import QuantWeight
    from reference import quant

    model, _ = quant_model
    layer = model.model.layers[3]
    g = torch.Generator().manual_seed(3)
    for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        w = module.weight.dequantize().double()
        x = torch.randn(3, w.shape[1], generator=g)
        y = QuantWeight(module.weight.parts, "int8")(x).double()
        xq, dx, _ = quant.quantize_rows_int8(x.numpy())
        x_hat = torch.from_numpy(xq.astype(np.float64) * np.repeat(dx, 32, 1))
        exact = x.double() @ w.T
        tol = (x_hat - x.double()).abs() @ w.abs().T + 2 * (w.shape[1] + 1) * 2.0 ** -24 * (x_hat.abs() @ w.abs().T)
        err = (y - exact).abs()
        assert (err <= tol).all(), f"{module.weight}: max error {err.max():.2e}"
        print(f"{module.weight.parts[0].name}: int8 activations, max error / max |output| "
              f"{err.max() / exact.abs().max():.1e}")


def test_int8_activations_in_the_engine(bundled_model_dir, bundled_gguf):  # noqa: F811
    """LLM(activations="int8"): every matrix but the embedding's gather takes int8 activations, and greedy
    decoding runs (its tokens are compared with the float32 path's in scripts/bench_cpu.py, not here: a
    different function need not give the same tokens)."""
    from pagedattn import LLM, SamplingParams

    llm = LLM(bundled_model_dir, device="cpu", activations="int8", num_blocks=16, max_model_len=256)
    model = llm.engine.model
    assert llm.engine.config.weights == "quantized" and llm.engine.config.activations == "int8"
    assert model.lm_head.weight.activations == "int8"
    assert model.model.layers[0].mlp.down_proj.weight.activations == "int8"
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


NEAR_TIE = 0.1      # HF's top-two probabilities closer than this: either token is HF's answer up to rounding


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["auto", "float32"])
def test_greedy_matches_hf_generate(bundled_model_dir, bundled_gguf, activations):  # noqa: F811
    """32 greedy tokens of LLM(device="cpu") on the GGUF blocks identical to HF generate(do_sample=False)
    on the converted float32 checkpoint, on the chat prompts of tests/test_bundled_model.py decoded
    together (the 5-row decode steps run the block kernels, the prefill the dequantized tiles): with float32
    activations (the dequantized matrices' products) every token; with the default activations (int8 where
    the target has AVX2, and the prompt's GEMM in bfloat16 where the CPU has it: a slightly different
    function) every token up to a first difference, which must be a near tie of HF's (one such on these
    prompts with bfloat16, HF's probabilities 0.418 / 0.395; none with int8 alone)."""
    from pagedattn import LLM, SamplingParams
    from test_bundled_model import MAX_NEW_TOKENS, PROMPTS

    # HF's answers: computed once per run (test_bundled_model.py compares against the same ones)
    tok, prompts, hf_answers, hf_logits = hf_greedy_reference(bundled_model_dir, PROMPTS, MAX_NEW_TOKENS)
    llm = LLM(bundled_model_dir, device="cpu", weights="quantized", activations=activations, num_blocks=64,
              max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
    for p, (hf_tokens, out) in enumerate(zip(hf_answers, outs)):
        n = len(hf_tokens)
        assert n >= 16, "answers should be long enough to compare"
        ours = list(out.outputs[0].token_ids)
        if activations == "float32" or ours[:n] == hf_tokens:
            assert ours[:n] == hf_tokens, f"prompt {p}: ours {tok.decode(ours[:n])!r}\nhf {tok.decode(hf_tokens)!r}"
            continue
        # The default is not the dequantized matrices' function (int8 activations; a prompt's GEMM in bfloat16
        # where the CPU has it): where its tokens leave HF's, HF's own choice there must be a near tie that
        # ours took the other way (HF's two likeliest tokens within NEAR_TIE of probability); later tokens
        # continue another text and are not compared.
        i = next(j for j in range(n) if ours[j] != hf_tokens[j])
        probs = torch.softmax(hf_logits[p][i].double(), -1)
        top2 = torch.topk(probs, 2)
        print(f"prompt {p}: token {i} is HF's runner-up, HF probabilities {top2.values.tolist()}")
        assert ours[i] == top2.indices[1].item() and (top2.values[0] - top2.values[1]).item() < NEAR_TIE, (
            f"prompt {p}, token {i}: ours {tok.decode(ours[:i + 1])!r}, HF's probabilities {top2.values.tolist()} "
            f"for {tok.decode(top2.indices.tolist())!r}")
