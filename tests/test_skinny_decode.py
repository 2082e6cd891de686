"""The few-row layer path (pagedattn/layers/skinny_decode.py): a decoder layer's norms and SiLU-and-mul run
inside the skinny GEMM (kernels_numba/skinny_gemm.py) for steps of at most `max_rows` rows.

CPU: a small Qwen2 (hidden 16, 2 query heads on 1 KV head, head_dim 8, I 16, two layers) in fp16 with the
numba backend under numba's CUDA simulator: a decode step of T = 1, 3, 8 sequences (contexts of different
lengths over the same random cached K/V) through the fused path against the same step unfused, both against
the same model in float32 (torch backend); the row threshold; where the path is never taken (tensor parallelism,
float32, the torch and CPU backends, widths not in 16-byte pieces); the codegen of the kernels a
Qwen2-0.5B step launches. GPU (`gpu`): an engine with CUDA graphs, fused against unfused greedy tokens,
and the launches per layer of one batch-1 graph replay.

Tolerance. The fused path rounds to fp16 where the unfused one does (the residual sum, the normed row, each
GEMM's output after its bias, silu(gate), the product); only the order of float32 sums differs (the tensor
cores' k order against torch's, the norm's sum of squares), which can move a rounding by one unit, and such a
unit then travels through the layers exactly like the unfused path's own rounding errors do. So, per token
and per recorded site (each layer's attention output, MLP output and residual stream, the final hidden
state), ||fused - unfused|| <= 2 ||unfused - float32||: the fused path may differ from the unfused one by
no more than twice the unfused path's own fp16 rounding noise at that point (two independent noises of the
same size differ by ~1.4x one of them). A wrong row, a lost bias or residual add, or gate and up swapped
moves a site by O(1), hundreds of times that noise.
"""
import json
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import torch

from helpers import TINY_CONFIG, compile_in_subprocesses, write_tiny_checkpoint
from pagedattn.kv_cache import KVCache
from pagedattn.layers import skinny_decode
from pagedattn.layers.attention import AttentionMetadata, NumbaBackend, TorchPagedBackend
from pagedattn.models.loader import build_model, load_model
from pagedattn.models.qwen2 import Qwen2Config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: numba's CUDA simulator (conftest)
SLOW = pytest.mark.slow
# every GEMM one or two CTAs under the simulator (~0.5 s per simulated CTA of 128 threads): qkv 2 tiles of 16
# rows, o_proj and down 1, gate_up 2 (8 gate + 8 up rows each); GQA (2 query heads on 1 KV head); head_dim 8
# takes torch's rotary + K/V write, the same op on both paths
SMALL = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
BLOCK = 8
NOISE_FACTOR = 2.0
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("skinny_decode_ckpt"), seed=3, **SMALL)


class Recorder:
    """Forward hooks on every layer, its self_attn and its mlp; `sites` maps "L0 attn" / "L0 mlp" / "L0 out" /
    "L0 residual" to float64 CPU copies of what the module returned."""

    def __init__(self, model):
        self.sites = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles += [layer.self_attn.register_forward_hook(self._hook(f"L{i} attn")),
                             layer.mlp.register_forward_hook(self._hook(f"L{i} mlp")),
                             layer.register_forward_hook(self._hook(f"L{i} out"))]

    def _hook(self, name):
        def record(module, args, output):
            if isinstance(output, tuple):                       # a layer: (output, residual stream)
                self.sites[name.replace("out", "residual")] = output[1].detach().double().cpu()
                output = output[0]
            self.sites[name] = output.detach().double().cpu()
        return record

    def close(self):
        for h in self.handles:
            h.remove()


class DecodeStep:
    """One decode step of T sequences with contexts of different lengths: the KV pool (shuffled blocks) holds
    random fp16 values, the same in every model's dtype, so that the models differ only in the step itself.
    `run(max_rows)` restores the pool and runs the step (fused when max_rows >= T); it returns {site:
    [T, hidden] float64} with "hidden" the final normed hidden state."""

    def __init__(self, model, config, dtype, T):
        self.model, self.T = model, T
        rng = np.random.default_rng(T)
        lens = rng.integers(1, 3 * BLOCK, T)                                     # tokens cached before the step
        need = [int(n) // BLOCK + 1 for n in lens]                               # blocks with the step's token
        order = rng.permutation(sum(need)).tolist()
        tables = [[order.pop() for _ in range(n)] for n in need]
        D, Hkv = config.head_dim, config.num_key_value_heads
        self.kv_cache = KVCache(config.num_hidden_layers, sum(need), Hkv, BLOCK, D, dtype=dtype, device=DEVICE)
        g = torch.Generator().manual_seed(T)
        self.saved = [torch.randn(c.shape, generator=g).to(torch.float16).to(dtype).to(DEVICE)
                      for c in self.kv_cache.k_caches + self.kv_cache.v_caches]
        self.meta = AttentionMetadata.build([1] * T, [int(n) + 1 for n in lens], tables, BLOCK, 0, DEVICE)
        self.ids = torch.tensor(rng.integers(3, SMALL["vocab_size"], T), device=DEVICE)
        self.positions = torch.tensor(lens, device=DEVICE)

    def run(self, max_rows=None):
        for c, saved in zip(self.kv_cache.k_caches + self.kv_cache.v_caches, self.saved):
            c.copy_(saved)
        if max_rows is not None:
            self.model.skinny.max_rows = max_rows
        recorder = Recorder(self.model)
        try:
            with torch.no_grad():
                hidden = self.model(self.ids, self.positions, self.kv_cache, self.meta)
        finally:
            recorder.close()
        return {**recorder.sites, "hidden": hidden.double().cpu()}


@pytest.fixture(scope="module")
def steps(small_checkpoint):
    """steps(T) -> (the fp16 numba model's DecodeStep, the float32 torch model's, config), made once per T."""
    fp16, config = load_model(small_checkpoint, DEVICE, torch.float16, NumbaBackend())
    fp32, _ = load_model(small_checkpoint, DEVICE, torch.float32, TorchPagedBackend())
    made = {}

    def get(T):
        if T not in made:
            made[T] = (DecodeStep(fp16, config, torch.float16, T), DecodeStep(fp32, config, torch.float32, T), config)
        return made[T]
    return get


class Spy:
    """Counts the model's skinny GEMM calls (and makes them)."""

    def __init__(self, skinny):
        self.calls, self._inner = [], skinny._skinny_linear
        skinny._skinny_linear = self

    def __call__(self, x, weight, bias=None, **kw):
        self.calls.append((tuple(x.shape), tuple(weight.shape), bias is not None,
                           {k for k, v in kw.items() if v is not None and v is not False and k != "validate"}))
        return self._inner(x, weight, bias, **kw)


def assert_within_noise(fused, unfused, ref, what):
    """Per token t: ||fused_t - unfused_t|| <= NOISE_FACTOR ||unfused_t - ref_t|| (the module docstring)."""
    diff = (fused - unfused).flatten(1).norm(dim=1)                                       # (T,)
    noise = (unfused - ref).flatten(1).norm(dim=1)
    assert bool((noise > 0).all()), f"{what}: the fp16 path equals float32 exactly: no noise to compare with"
    ratio = diff / noise
    assert bool((ratio <= NOISE_FACTOR).all()), (
        f"{what}: ||fused - unfused|| / ||unfused - float32|| per token {ratio.tolist()}; max |fused - unfused| "
        f"{(fused - unfused).abs().max().item():.3e}, max |unfused - float32| {(unfused - ref).abs().max().item():.3e}")
    return ratio.max().item()


@pytest.mark.parametrize("T", [3, pytest.param(1, marks=SLOW), pytest.param(8, marks=SLOW)])
def test_fused_decode_step_matches_unfused_within_its_noise(steps, T):
    """One decode step of T sequences through the fused layers: every hooked site (so also the hooks' view
    of the layer: self_attn returns o_proj's output, mlp down_proj's, the layer (output, residual)) within
    twice the unfused path's fp16 noise of the unfused value; the fused path calls the skinny GEMM 4 times a
    layer with the fusions the module docstring lists, the unfused step never."""
    step, ref_step, config = steps(T)
    model = step.model
    assert model.skinny is not None
    spy = Spy(model.skinny)
    try:
        unfused = step.run(max_rows=0)
        assert spy.calls == []
        fused = step.run(max_rows=T)
    finally:
        model.skinny._skinny_linear = spy._inner
    ref = ref_step.run()
    E, I, q = config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim
    qkv = q + 2 * config.num_key_value_heads * config.head_dim
    layer0 = [((T, E), (qkv, E), True, {"norm_weight", "eps"}), ((T, q), (E, q), False, set()),
              ((T, E), (2 * I, E), False, {"norm_weight", "eps", "norm_residual", "residual_out", "silu"}),
              ((T, I), (E, I), False, set())]
    later = [(layer0[0][0], layer0[0][1], True, {"norm_weight", "eps", "norm_residual", "residual_out"})] + layer0[1:]
    assert spy.calls == layer0 + later * (config.num_hidden_layers - 1)
    assert fused.keys() == unfused.keys() == ref.keys()
    worst = {site: assert_within_noise(fused[site], unfused[site], ref[site], f"T={T} {site}") for site in fused}
    same = {site: bool(torch.equal(fused[site], unfused[site])) for site in fused}
    print(f"T={T}: max ||fused - unfused|| / ||unfused - float32|| per site {worst}; bit-equal sites {same}")
    if same["L0 attn"]:   # layer 0's output stream: round(embedding + attention output), the same one rounding
        assert same["L0 residual"]


@SLOW
def test_noise_bound_catches_a_lost_bias(steps):
    """The bound has teeth: the same fused step with the q/k/v bias dropped leaves it at the first site."""
    step, ref_step, _ = steps(3)
    skinny = step.model.skinny
    inner = skinny._skinny_linear
    skinny._skinny_linear = lambda x, weight, bias=None, **kw: inner(x, weight, None, **kw)
    try:
        broken = step.run(max_rows=3)
    finally:
        skinny._skinny_linear = inner
    unfused, ref = step.run(max_rows=0), ref_step.run()
    with pytest.raises(AssertionError, match="L0 attn"):
        assert_within_noise(broken["L0 attn"], unfused["L0 attn"], ref["L0 attn"], "L0 attn")


def test_threshold_rows_above_it_run_unfused(steps):
    """max_rows = 2: a step of 3 rows makes no skinny call and gives the unfused path's bits."""
    step = steps(3)[0]
    skinny = step.model.skinny
    spy = Spy(skinny)
    try:
        off = step.run(max_rows=0)
        above = step.run(max_rows=2)
    finally:
        skinny._skinny_linear = spy._inner
    assert spy.calls == []
    assert all(torch.equal(above[site], off[site]) for site in off)
    assert not skinny.takes(3) and skinny.takes(2) and skinny.takes(1)


def test_where_the_path_applies(monkeypatch):
    """Only the numba backend's glue kernels (fp16/bf16 on their device), tensor_parallel_size 1 and widths
    in 16-byte pieces; max_rows from the argument, PAGEDATTN_SKINNY_ROWS or the default (DEFAULT_ROWS: off)."""
    fp16 = torch.float16
    monkeypatch.delenv(skinny_decode.ENV_ROWS, raising=False)

    def built(dtype=fp16, backend=None, tp_size=1, rows=None, **overrides):
        cfg = Qwen2Config.from_dict({**TINY_CONFIG, **SMALL, "model_type": "qwen2", **overrides})
        model = build_model(cfg, DEVICE, dtype, backend or NumbaBackend(), 0, tp_size)
        if rows is not None:
            return skinny_decode.skinny_decode_for(model.ops, cfg, tp_size, DEVICE, dtype, rows)
        layers = [m.skinny for layer in model.model.layers for m in (layer, layer.self_attn, layer.mlp)]
        assert all(s is model.skinny for s in layers), "every layer holds the model's SkinnyDecode"
        return model.skinny

    on_gpu = DEVICE == "cuda"
    assert built().max_rows == skinny_decode.DEFAULT_ROWS == 0
    assert built(torch.bfloat16, rows=5).max_rows == 5
    assert built(tp_size=2, num_key_value_heads=2) is None            # row-parallel outputs need the all-reduce
    assert built(torch.float32) is None
    assert built(backend=TorchPagedBackend()) is None
    assert built(backend="cpu" if not on_gpu else "torch") is None
    assert built(intermediate_size=36) is None                        # down_proj's K = 36: not 16-byte pieces
    monkeypatch.setenv(skinny_decode.ENV_ROWS, "4")
    assert built().max_rows == 4
    monkeypatch.setenv(skinny_decode.ENV_ROWS, "0")
    assert built().max_rows == 0 and not built().takes(1)
    for bad in ("eight", "17", "-1"):
        monkeypatch.setenv(skinny_decode.ENV_ROWS, bad)
        with pytest.raises(ValueError, match="PAGEDATTN_SKINNY_ROWS|0 to 16"):
            built()


def test_layer_kernels_follow_the_launch_plan():
    """The kernels a 0.5B few-row step launches (the launch's own flags): the norm prologue on qkv (with the
    residual add after the first layer) and gate_up, SiLU-and-mul on gate_up only, the bias on qkv only,
    no residual epilogue; two-group kernels only when steps of more than 8 rows are fused."""
    cfg = Qwen2Config(**QWEN_05B)
    kernels = skinny_decode.layer_kernels(cfg, False)
    names = ("is_bf16", "two_groups", "kwarps", "bias", "silu", "resid", "l1_no_allocate", "norm", "add")
    flags = {name: dict(zip(names, f)) for name, f in kernels.items()}
    assert set(flags) == {"qkv_norm_bias", "qkv_norm_add_bias", "o", "gate_up_norm_add_silu", "down"}
    for name, f in flags.items():
        assert f["norm"] == ("norm" in name) and f["add"] == ("add" in name) and f["silu"] == ("silu" in name)
        assert f["bias"] == name.startswith("qkv") and not f["resid"] and not f["two_groups"] and f["l1_no_allocate"]
    assert flags["down"]["kwarps"] == 16 and flags["o"]["kwarps"] == 4            # plan_v2: K 4864 vs 896
    assert set(skinny_decode.layer_kernels(cfg, True, max_rows=16)) == set(kernels) | {n + "_m16" for n in kernels}


# ---- codegen: the kernels of a Qwen2-0.5B step, compiled for sm_90 ---------------------------------
# "v2_<layer_kernels name>_<f16|bf16>"; the default run compiles the two fused ones in fp16, `slow` the rest
CODEGEN_NAMES = [f"v2_{name}_{dt}" for dt in ("f16", "bf16") for name in
                 ("qkv_norm_bias", "qkv_norm_add_bias", "o", "gate_up_norm_add_silu", "down")]
CODEGEN_DEFAULT = ("v2_qkv_norm_add_bias_f16", "v2_gate_up_norm_add_silu_f16")
CODEGEN_PARAMS = [n if n in CODEGEN_DEFAULT else pytest.param(n, marks=SLOW) for n in CODEGEN_NAMES]


@pytest.fixture(scope="module")
def compiled_layer(request):
    """PTX of the kernels of layer_kernels(Qwen2-0.5B) that this run selected, compiled in parallel
    subprocesses: (flags by name, PTX counts by name, folder)."""
    from test_skinny_gemm import _SCRIPT

    picked = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    cfg = Qwen2Config(**QWEN_05B)
    every = {f"v2_{name}_{'bf16' if bf16 else 'f16'}": flags for bf16 in (False, True)
             for name, flags in skinny_decode.layer_kernels(cfg, bf16).items()}
    assert set(every) == set(CODEGEN_NAMES)
    wanted = {n: every[n] for n in picked}
    tmp = tempfile.mkdtemp(prefix="pa_skinny_decode_ptx_")
    stats = {}
    try:
        parts = compile_in_subprocesses(_SCRIPT, sorted(wanted),
                                        lambda names: (json.dumps({n: wanted[n] for n in names}), tmp), timeout=900)
        for stdout in parts:
            stats.update(json.loads(stdout.strip().splitlines()[-1]))
        yield wanted, stats, tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", CODEGEN_PARAMS)
def test_codegen_of_the_layer_kernels(compiled_layer, name):
    """A kernel a 0.5B few-row step launches, compiled for sm_90: v2's loads, mma and barriers, the norm
    prologue's shuffles and (with the add) its 4 stores of the new residual, the SiLU epilogue's exp only
    on gate_up; no fp64, no local memory; ptxas (where installed): no spills, <= 128 registers."""
    from test_skinny_gemm import assert_v2_ptx

    wanted, stats, tmp = compiled_layer
    is_bf16, two_groups, kwarps, bias, silu, resid, l1, norm, add = wanted[name]
    assert_v2_ptx(stats[name], two_groups, l1, norm, add, name)
    assert (stats[name]["ex2"] > 0) == silu, (name, stats[name])
    if shutil.which("ptxas"):
        _ptxas_no_spills(os.path.join(tmp, name + ".ptx"))


def _ptxas_no_spills(path):
    import re

    ptx = open(path).read()
    m = re.search(r"release (\d+)\.(\d+)", subprocess.run(["ptxas", "--version"], capture_output=True,
                                                          text=True).stdout)
    if m:  # NVVM may write a newer PTX ISA than this ptxas reads; the kernel uses nothing new
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {int(m.group(1)) - 4}.{m.group(2)}", ptx, flags=re.M)
    fixed = path + ".fixed.ptx"
    open(fixed, "w").write(ptx)
    proc = subprocess.run(["ptxas", "-arch=sm_90", "-v", fixed, "-o", os.devnull], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stderr + proc.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 128, report


# ---- the bench's pieces that need no GPU (scripts/bench_skinny_decode.py) --------------------------------
def test_bench_helpers_name_kernels_and_compare_tokens():
    from scripts import bench_skinny_decode as bench

    mangled = ("_ZN6cudapy13kernels_numba11skinny_gemm15_gemm_kernel_v212_3clocals_3e21skinny_gemm_v2_kernel"
               "B3v15B94cw51cXTLSUwv1sDUaKaAVUMUACRCZAE5ArrayIjLi1E1C7mutable7alignedE")
    assert bench.short_name(mangled) == "skinny_gemm_v2_kernel"
    assert bench.short_name("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64", 20) == "sm90_xmma_gemm_f16f1"
    a = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5], [-0.5, -0.6])]
    b = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 7], [-0.5, -0.65])]
    cmp = bench.compare_tokens(a, b)
    assert cmp["requests"] == 2 and cmp["same"] == 1 and cmp["parted"][0]["at"] == 1
    assert abs(cmp["parted"][0]["gap"] - 0.05) < 1e-12
    # the tail of one step (its last layer, the final norm, LM head, sampling), then a whole step of 4 layers
    layer = ["rotary_cache_kernel", "paged_attention", "o", "gate_up", "down", "qkv"]
    names = layer[:5] + ["norm", "lm_head", "sample", "embedding", "qkv"] + layer * 3 + layer[:5] + ["norm"]
    launches = bench.layer_counts(names)
    assert launches["per_layer"] == 6 and launches["layers"] == 5 and launches["layer"] == layer
    assert launches["outside"] == len(names) - 30
    check = dict(steps=30, fused_steps=20, sizes=[1, 2, 4], worst=0.01, mismatch=0, near_ties=1)
    run = lambda rows, tok_s: dict(rows=rows, startup_s=1.0, launches=launches, check=check, rates=[
        dict(kind="greedy", batch=1, wall_ms=1.0, tok_s=tok_s, gpu_ms=0.9, kernels=100)])
    md, rows = bench.markdown(run(8, 1100.0), run(0, 1000.0), cmp, dict(model="m", config="0.5b", num_layers=4,
                                                                        steps=30, profile_steps=3))
    assert rows[0]["speedup"] == pytest.approx(1.1) and "1 of 2 requests identical" in md


# ---- on the GPU: the engine with CUDA graphs ------------------------------------------------------------
# head_dim 64 (the decode kernel's, so that decode steps replay graphs); lm_head weights give clear top-1 margins
GPU_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2)


@pytest.mark.gpu
def test_gpu_engine_fused_path_tokens_and_launches_per_layer(monkeypatch):
    """A small random Qwen2 (fp16, CUDA graphs) with the few-row path at its default threshold and with
    PAGEDATTN_SKINNY_ROWS=0. Every decode step of a greedy run (requests of different lengths: the batch
    shrinks through every graph size) is also run eagerly through the unfused path on the same state: the
    argmax agrees wherever the top-2 margin exceeds twice the logits' difference, which stays within fp16
    noise. The two engines' greedy tokens agree on most requests (a near-tie may flip and the request then
    goes its own way: counted). One batch-1 decode step (one graph replay) launches <= 7 kernels per layer
    with the path, fewer than without it."""
    from pagedattn import LLM
    from scripts import benchlib
    from scripts import bench_skinny_decode as bench
    from pagedattn.models.loader import read_config

    ckpt = benchlib.random_checkpoint(GPU_CONFIG)
    cfg = read_config(ckpt)
    requests = bench.validation_requests(16, vocab=GPU_CONFIG["vocab_size"])
    runs = {}
    for rows in (skinny_decode.FUSED_ROWS, 0):
        monkeypatch.setenv(skinny_decode.ENV_ROWS, str(rows))
        with LLM(ckpt, device="cuda", max_num_seqs=16, max_model_len=512) as llm:
            skinny = llm.engine.runner.model.skinny
            assert skinny is not None and skinny.max_rows == rows
            tokens, check = bench.greedy_run(llm, *requests)
            _, launches = bench.decode_rate(llm, cfg, 1, dict(temperature=0), steps=2, profile_steps=1, seed=1,
                                            launches=True)
        runs[rows] = dict(tokens=tokens, check=check, launches=launches)
        print(f"rows {rows}: {check}; {launches}")
    on, off = runs[skinny_decode.FUSED_ROWS], runs[0]
    for run in (on, off):
        c = run["check"]
        assert c["steps"] > 20 and len(c["sizes"]) >= 4, c
        assert c["mismatch"] == 0 and c["worst"] < 1.0, c
    assert on["check"]["fused_steps"] > 10 and off["check"]["fused_steps"] == 0
    same = bench.compare_tokens(on["tokens"], off["tokens"])
    print(same)
    assert same["same"] >= 12, same
    assert on["launches"]["layers"] >= GPU_CONFIG["num_hidden_layers"], on["launches"]
    assert on["launches"]["per_layer"] <= 7, on["launches"]
    assert on["launches"]["per_layer"] <= off["launches"]["per_layer"] - 3, (on["launches"], off["launches"])
