"""The batch-invariant mode (docs/batch_invariance.md): a request's token ids and logprobs are the same bits
alone, batched, chunked at any token budget, preempted and recomputed, with prefix-cache hits.

Kernel level: the pieces that make it so (a prompt's attention in one-query tiles is its decodes', a
product of any row count is its rows' alone). Engine level: the tiny random Qwen2 (float32 weights: cpu_linear's
products) in the default suite, the bundled model (GGUF blocks, the CPU default) in both suites; each
comparison also runs with the mode off, where the same workload differs, so a comparison that passed by
construction would show.
"""
import os
import random

import numpy as np
import pytest
import torch

from helpers import bundled_gguf, bundled_model_dir, tiny_checkpoint  # noqa: F401 (session fixtures)
from serving_helpers import signal_handlers_kept  # noqa: F401 (autouse: SIGTERM/SIGINT handlers kept)
from kernels_numba import cpu_attention
from kernels_numba.errors import KernelLaunchError
from pagedattn import LLM, SamplingParams
from pagedattn.errors import InvalidRequestError
from pagedattn.layers.cpu import CpuStep


# ---------------------------------------------------------------- kernels

def _pool(num_blocks, Hkv, BS, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, Hkv, BS, D, generator=g), torch.randn(num_blocks, Hkv, BS, D, generator=g))


@pytest.mark.parametrize("lens", [[37], [5, 64, 19], [16, 1, 33]])
def test_a_prompt_in_one_query_tiles_is_its_decodes(lens):
    """With query_tile=1, every query of a prompt (several prompts in one call) gets the bits it gets as a
    decode at its position, alone; with the default tile some query does not (the mode is needed)."""
    H, Hkv, BS, D = 14, 2, 16, 64
    k_cache, v_cache = _pool(24, Hkv, BS, D, seed=1)
    rng = np.random.default_rng(2)
    blocks = rng.permutation(24).astype(np.int32)
    tables, start = [], 0
    for n in lens:
        tables.append(blocks[start:start + -(-n // BS)])
        start += len(tables[-1])
    table = np.full((len(lens), max(len(t) for t in tables)), 0, np.int32)
    for s, t in enumerate(tables):
        table[s, :len(t)] = t
    q = torch.from_numpy(rng.standard_normal((sum(lens), H, D)).astype(np.float32))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ctx = np.array(lens, np.int32)
    outs = {}
    for tile in (1, cpu_attention.QUERY_TILE):
        plan = cpu_attention.make_plan(table, cu, ctx, 24, Hkv, BS, query_tile=tile)
        outs[tile] = cpu_attention.attention(q, k_cache, v_cache, plan, num_threads=2)
    decodes = np.empty_like(outs[1])
    for s, n in enumerate(lens):
        for i in range(n):                                  # query i of prompt s as a decode at context i + 1
            plan = cpu_attention.make_plan(table[s:s + 1], np.array([0, 1], np.int32), np.array([i + 1], np.int32),
                                           24, Hkv, BS)
            decodes[cu[s] + i] = cpu_attention.attention(q[cu[s] + i:cu[s] + i + 1], k_cache, v_cache, plan)[0]
    assert np.array_equal(outs[1].view(np.uint32), decodes.view(np.uint32))
    if max(lens) > cpu_attention.QUERY_TILE:
        assert not np.array_equal(outs[cpu_attention.QUERY_TILE], decodes), "the default tile was meant to differ"


def test_query_tile_must_be_positive():
    with pytest.raises(KernelLaunchError, match="query_tile"):
        cpu_attention.make_plan(np.zeros((1, 1), np.int32), np.array([0, 1], np.int32), np.array([1], np.int32),
                                4, 2, 16, query_tile=0)


def _invariant_step():
    step = CpuStep()
    step.invariant = True
    return step


@pytest.mark.parametrize("M", [1, 3, 4, 16, 17, 45])
def test_dense_products_padded_to_4_rows_are_each_rows_alone(M):
    """cpu_linear's result for a row depends on its place (a group of 4 or a leftover): in the mode every row
    of any call is computed as it is alone (padded to 4)."""
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
    step = _invariant_step()
    with step.scope(M):
        y = step.linear(x, w, b)
        alone = [step.linear(x[i:i + 1], w, b) for i in range(M)]
    assert torch.equal(y, torch.cat(alone))
    assert torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_quantized_products_at_any_row_count_are_each_rows_alone(bundled_model_dir, bundled_gguf):  # noqa: F811
    """A GGUF layer of the bundled model (q/k/v parts in two formats) on 40 rows in the mode (the block kernel
    at any row count): each row's bits as alone, where the default (above 16 rows: dequantized tiles) differs."""
    from pagedattn.models.loader import load_gguf_model

    model, _ = load_gguf_model(bundled_model_dir, bundled_gguf, "cpu", "int8")
    linear = model.ops.linear
    w = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(40, w.weight.shape[1], generator=torch.Generator().manual_seed(3))
    step = model.ops.backend.step
    default = linear(x, w.weight, w.bias)
    step.invariant = True
    try:
        with step.scope(40):
            y = linear(x, w.weight, w.bias)
            alone = torch.cat([linear(x[i:i + 1], w.weight, w.bias) for i in range(40)])
    finally:
        step.invariant = False
    assert torch.equal(y, alone)
    assert not torch.equal(default, alone)


# ---------------------------------------------------------------- the GPU's pieces (in the CUDA simulator)

def test_fixed_row_products_are_each_rows_alone():
    """ops.fixed_rows_linear (the GPU mode's products, here on torch's CPU GEMM, which also changes its sums
    with the row count): any row count, any place in a piece, the bits of the row alone; F.linear's differ."""
    from pagedattn.layers.ops import fixed_rows_linear

    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(96, 200, generator=g), torch.randn(96, generator=g), torch.randn(300, 200, generator=g)
    for bias in (None, b):
        alone = torch.cat([fixed_rows_linear(128, x[i:i + 1], w, bias) for i in range(300)])
        for M in (2, 7, 128, 129, 300):
            assert torch.equal(fixed_rows_linear(128, x[:M], w, bias), alone[:M]), M
        assert torch.equal(fixed_rows_linear(128, x[5:6].expand(128, -1), w, bias), alone[5:6].expand(128, -1))
    plain = torch.cat([torch.nn.functional.linear(x[i:i + 1], w, b) for i in range(300)])
    assert any(not torch.equal(torch.nn.functional.linear(x[:M], w, b), plain[:M]) for M in (7, 128, 300))


def test_invariant_linear_takes_one_call_only_where_the_library_gives_the_pieces_bits(monkeypatch):
    """ops.InvariantLinear over a GEMM library that sums each row alone below 20 rows, in float64 from 20 rows on
    (a split-K's change) and otherwise at every third M: the check finds exactly the row counts where one call
    gives the 16-row pieces' bits, one call runs there, the pieces elsewhere, every result is the pieces' bits;
    each (shape, M) is checked once, and not inside a CUDA-graph capture (the pieces run)."""
    from pagedattn.layers import ops

    def library(x, w, b=None):
        calls.append(x.shape[0])
        if x.shape[0] >= 20:
            return torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
        if x.shape[0] % 3 == 0:
            return torch.nn.functional.linear(x, w, b) * 1.0000001
        return torch.cat([torch.nn.functional.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])

    def pieces(M):                                          # 16-row pieces of `library`: each row alone
        return torch.cat([torch.nn.functional.linear(x[i:i + 1], w, b) for i in range(M)])

    def num_pieces(*ms):
        return [16] * sum(-(-M // 16) for M in ms)          # the last piece padded

    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(100, 40, generator=g)
    lin = ops.InvariantLinear(16, plain=library)
    calls = []
    for M in (7, 5, 30, 100, 7, 30):
        assert torch.equal(lin(x[:M], w, b), pieces(M)), M
    checks = [7, 5, 30, 100]                                # each a one-call against the pieces
    assert sorted(calls) == sorted(checks + num_pieces(*checks) + [7, 5, 7] + num_pieces(30, 100, 30))
    with monkeypatch.context() as patch:
        patch.setattr(ops, "_capturing", lambda t: True)
        calls.clear()
        assert torch.equal(lin(x[:11], w, b), pieces(11)) and calls == [16]
        assert (library, 16, w.shape, w.dtype, w.device, True, 11) not in lin.checked
    assert [lin.one_call(w, b, M) for M in range(1, 101)] == [M < 20 and M % 3 != 0 for M in range(1, 101)]
    calls.clear()
    assert torch.equal(lin(x[:40:2][:10], w, b), pieces(20)[::2][:10])      # strided rows: copied, one call
    assert calls == [10]


def test_invariant_linear_runs_a_short_product_on_a_long_reduction_at_min_rows():
    """min_rows: a one call of fewer rows where K >= 4 N (`down`) runs on min_rows rows (the padding's results
    dropped), checked at min_rows; other products and longer ones run on their own rows; the pieces' bits in
    every case."""
    from pagedattn.layers import ops

    def library(x, w, b=None):
        calls.append(x.shape[0])
        return torch.cat([torch.nn.functional.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])

    g = torch.Generator().manual_seed(7)
    long_k, wide = torch.randn(8, 40, generator=g), torch.randn(24, 40, generator=g)
    x = torch.randn(30, 40, generator=g)
    lin = ops.InvariantLinear(16, plain=library, min_rows=8)
    for w, M, rows in ((long_k, 3, 8), (long_k, 8, 8), (long_k, 11, 11), (wide, 3, 3)):
        want = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(M)])
        calls = []
        assert torch.equal(lin(x[:M], w), want) and lin(x[:M], w).shape == (M, w.shape[0])
        assert calls[-1] == rows and (library, 16, w.shape, w.dtype, w.device, False, rows) in lin.checked, (M, calls)


def test_no_split_k_gives_cublas_no_workspace_and_keeps_a_setting_already_made(monkeypatch):
    """ops.no_split_k: both workspace settings (cuBLAS's and cuBLASLt's) zero when unset; a value the
    environment already holds is kept."""
    from pagedattn.layers import ops

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")      # recorded, so that the teardown restores it
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "1024")
    ops.no_split_k()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0" and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1024"


def test_an_engine_whose_products_fell_back_to_pieces_says_how_to_start_it(monkeypatch, caplog):
    """After a GPU mode's warm-up: products checked to need the pieces (cuBLAS split K in a process that ran a
    GEMM before the engine) give one warning naming them and the environment to start with; none otherwise."""
    import logging

    from pagedattn.engine import llm_engine
    from pagedattn.layers import ops

    ok = {(None, 128, torch.Size([896, 896]), torch.float16, "cuda", False, 1): True}
    monkeypatch.setattr(ops.InvariantLinear, "checked", dict(ok))
    with caplog.at_level(logging.WARNING, logger="pagedattn.startup"):
        llm_engine._note_invariant_products()
    assert not caplog.records
    monkeypatch.setattr(ops.InvariantLinear, "checked", {**ok, (None, 128, torch.Size([896, 4864]), torch.float16,
                                                             "cuda", False, 16): False})
    with caplog.at_level(logging.WARNING, logger="pagedattn.startup"):
        llm_engine._note_invariant_products()
    [record] = caplog.records
    assert "(896, 4864) at 16 rows" in record.message and "CUBLAS_WORKSPACE_CONFIG=:0:0" in record.message


def test_invariant_linear_on_torchs_cpu_gemm_is_the_pieces_bits():
    """The same over torch's own CPU GEMM (which changes its sums with the row count): at every row count the
    pieces' bits, whichever path the check chose."""
    from pagedattn.layers.ops import InvariantLinear, fixed_rows_linear

    g = torch.Generator().manual_seed(6)
    w, b, x = torch.randn(96, 200, generator=g), torch.randn(96, generator=g), torch.randn(300, 200, generator=g)
    lin = InvariantLinear(128)
    for M in (300, *range(1, 300, 7)):
        assert torch.equal(lin(x[:M], w, b), fixed_rows_linear(128, x[:M], w, b)), M


@pytest.mark.parametrize("part_keys,positions", [
    (256, [50]), (64, [50, 79]), pytest.param(64, [0, 41, 42, 63, 64, 65, 79], marks=pytest.mark.slow)])
def test_gpu_mode_a_query_gets_the_same_bits_in_a_prompt_a_chunk_and_a_decode(part_keys, positions, monkeypatch):
    """The GPU mode's attention (the prefill kernel with its keys in parts fixed by position for every call,
    decodes as one-query chunks), in the numba simulator running the kernels' code: a query's row is the same
    bits in the whole prompt, in a chunk after its cached prefix and as a decode beside others; the default
    decode kernel's rows differ (its own reduction order). One 80-token sequence, 3 query heads on 1 KV head:
    42-query tiles, so the tile of queries 42..79 reads the second 64-key tile, which rows 42..63 see masked
    whole; with 64-key parts (instead of the mode's 256) that tile is split in two parts, the second empty
    for rows 42..63, and the decodes of rows of one part and of two are merged from a bound of two parts."""
    from pagedattn.layers.attention import NumbaBackend

    monkeypatch.setattr(NumbaBackend, "INVARIANT_PART_KEYS", part_keys)

    g = torch.Generator().manual_seed(4)
    H, Hkv, D, BS, L = 3, 1, 64, 16, 80
    k_cache = torch.randn(8, Hkv, BS, D, generator=g).half()
    v_cache = torch.randn(8, Hkv, BS, D, generator=g).half()
    table = torch.tensor([[3, 1, 6, 0, 2]], dtype=torch.int32)
    q = torch.randn(L, H, D, generator=g).half()
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)        # noqa: E731
    mode, scale = NumbaBackend(batch_invariant=True), D ** -0.5
    whole, chunk = torch.empty_like(q), torch.empty(20, H, D).half()
    mode.prefill(q, k_cache, v_cache, table, i32(0, L), i32(L), scale, whole)
    mode.prefill(q[60:].contiguous(), k_cache, v_cache, table, i32(0, 20), i32(L), scale, chunk)
    assert torch.equal(chunk, whole[60:])
    decodes = (q[positions].contiguous(), k_cache, v_cache, table.expand(len(positions), -1).contiguous(),
               i32(*[p + 1 for p in positions]), scale)
    for backend, same in ((mode, True), (NumbaBackend(), False)):
        out = torch.empty(len(positions), H, D).half()
        backend.decode(*decodes, out)
        assert torch.equal(out, whole[positions]) == same, backend.batch_invariant


# ---------------------------------------------------------------- the engine: tiny model

PROMPTS = [[random.Random(s).randrange(3, 128) for _ in range(random.Random(s + 100).randrange(2, 70))]
           for s in range(12)]


def _params(i, max_tokens=12):
    """Greedy, seeded top-p and seeded n=2 top-k requests, each asking for its logprobs."""
    if i % 3 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    if i % 3 == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=1000 + i, logprobs=True,
                              ignore_eos=True)
    return SamplingParams(n=2, max_tokens=max_tokens, temperature=1.1, top_k=20, seed=2000 + i, logprobs=True,
                          ignore_eos=True)


def _generate(llm, idx, prompts=PROMPTS):
    outs = llm.generate([prompts[i] for i in idx], [_params(i) for i in idx], use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def _comparisons(model, invariant, device="cpu", **kw):
    """The request outputs of each way of running the 12 prompts that the mode makes equal: name -> list
    (on CUDA also eagerly, against the batched run's CUDA graphs)."""
    def llm(**extra):
        return LLM(model, device=device, batch_invariant=invariant, **{**kw, **extra})

    big = llm(num_blocks=256, block_size=8)
    runs = {"batched": _generate(big, range(len(PROMPTS))),
            "prefix hits": _generate(big, range(len(PROMPTS)))}        # the same prompts again: cached blocks
    assert big.metrics()["prefix_cache_hit_tokens"] > 0
    runs["alone"] = [_generate(big, [i])[0] for i in range(len(PROMPTS))]
    runs["budget 16"] = _generate(llm(num_blocks=256, block_size=8, max_num_batched_tokens=16), range(len(PROMPTS)))
    small = llm(num_blocks=30, block_size=8, max_num_seqs=12)
    runs["tiny pool"] = _generate(small, range(len(PROMPTS)))
    assert small.metrics()["num_preemptions"] > 0, "the tiny pool was meant to preempt"
    if device == "cuda":
        runs["eager"] = _generate(llm(num_blocks=256, block_size=8, enforce_eager=True), range(len(PROMPTS)))
    return runs


def test_tiny_model_tokens_and_logprobs_do_not_depend_on_the_batch(tiny_checkpoint):  # noqa: F811
    runs = _comparisons(tiny_checkpoint, True)
    for name, outs in runs.items():
        same = sum(o == b for o, b in zip(outs, runs["batched"]))
        assert same == len(PROMPTS), f"{name}: {same}/{len(PROMPTS)} requests identical to the batched run"
    default = _comparisons(tiny_checkpoint, False)
    assert any(outs != default["batched"] for outs in default.values()), "the default was meant to differ"


def test_tiny_model_thread_count_changes_nothing(tiny_checkpoint):  # noqa: F811
    """The kernels split outputs and work items over threads, never one output's sums: the 12 requests give
    the same bits on one thread and on two."""
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            llm = LLM(tiny_checkpoint, device="cpu", batch_invariant=True, num_blocks=256, block_size=8)
            runs.append(_generate(llm, range(len(PROMPTS))))
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]


def test_tiny_model_beam_search_does_not_depend_on_the_batch(tiny_checkpoint):  # noqa: F811
    """Beam search (width 3, copy-on-write forks): each request's beams, ids and cumulative logprobs, the same
    alone and beside the others under the mode; not so by default."""
    from pagedattn import BeamSearchParams

    def beams(llm, prompts):
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10))
        return [[(b.output_token_ids, b.cumulative_logprob) for b in o.sequences] for o in outs]

    prompts = PROMPTS[:6]
    for invariant in (True, False):
        llm = LLM(tiny_checkpoint, device="cpu", batch_invariant=invariant, num_blocks=256, block_size=8)
        batched, alone = beams(llm, prompts), [beams(llm, [p])[0] for p in prompts]
        assert (alone == batched) == invariant, f"batch_invariant={invariant}"


def test_served_requests_do_not_depend_on_the_batch(tmp_path):
    """Through the serving front (the engine core on a thread, as `serve --batch-invariant --in-process`):
    text prompts through the tokenizer, each request's tokens and logprobs the same bits alone and among
    concurrent others."""
    import asyncio

    from serving_helpers import write_tiny_chat_checkpoint

    from pagedattn.serving.core_client import CoreClient

    checkpoint = write_tiny_chat_checkpoint(tmp_path / "chat")
    client = CoreClient.in_thread(LLM(checkpoint, device="cpu", batch_invariant=True, num_blocks=128))
    prompts = ["def fib(n):", "The paged KV cache", "Hello world! How are you", "a b c d e f g h i j k l m n o p"]

    async def answer(i):
        outs = [out async for out in client.generate(prompts[i], _params(i))]
        return [(c.token_ids, c.logprobs) for c in outs[-1].outputs]

    async def together():
        return await asyncio.gather(*[answer(i) for i in range(len(prompts))])

    try:
        alone = [asyncio.run(answer(i)) for i in range(len(prompts))]
        assert asyncio.run(together()) == alone
    finally:
        client.shutdown()


# ---------------------------------------------------------------- configuration

@pytest.mark.parametrize("kwargs", [dict(dtype="bfloat16"), dict(attn_backend="torch"),
                                    dict(tensor_parallel_size=2), dict(batch_invariant=1)])
def test_mode_outside_its_conditions_is_refused(kwargs):
    from pagedattn.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="batch_invariant"):
        EngineConfig(device="cpu", **{"batch_invariant": True, **kwargs})


@pytest.mark.parametrize("kwargs", [dict(dtype="float32"), dict(attn_backend="torch"), dict(attn_backend="cpu"),
                                    dict(tensor_parallel_size=2), dict(block_size=64)])
def test_mode_on_a_gpu_outside_its_conditions_is_refused(monkeypatch, kwargs):
    from pagedattn.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig(device="cuda", batch_invariant=True).batch_invariant            # fp16, numba: taken
    assert EngineConfig(device="cuda", dtype="bfloat16", attn_backend="numba", batch_invariant=True).batch_invariant
    with pytest.raises(InvalidRequestError, match="batch_invariant=True"):
        EngineConfig(device="cuda", **{"batch_invariant": True, **kwargs})


def test_gpu_mode_refuses_a_model_its_kernels_do_not_cover():
    """Every op must be one of the numba backend's per-row kernels: a head_dim the prefill kernel lacks (or
    widths the glue kernels lack) is refused when the model is built, naming the mode."""
    from pagedattn.layers.attention import NumbaBackend

    backend = NumbaBackend(batch_invariant=True)
    backend.ops_table("cpu", torch.float16, 896, 4864, 64)                  # covered (the simulator's device)
    with pytest.raises(InvalidRequestError, match=r"batch_invariant=True needs head_dim in \(64, 128\)"):
        backend.ops_table("cpu", torch.float16, 896, 4864, 32)
    with pytest.raises(InvalidRequestError, match="batch_invariant=True needs the glue kernels"):
        backend.ops_table("cpu", torch.float32, 896, 4864, 64)


def test_serve_flag():
    from pagedattn.serving.cli import parse_config

    assert parse_config(["--batch-invariant"]).engine["batch_invariant"] is True
    assert "batch_invariant" not in parse_config([]).engine


# ---------------------------------------------------------------- the engine: the bundled model

CHAT = ["The capital of France is", "Write a Python function that checks whether a number is prime.",
        "Explain what a hash map is in two sentences.", "def fibonacci(n):", "List three sorting algorithms.",
        "What is 17 * 23?", "Translate 'good morning' into German.", "Name a prime number above 100.",
        "Write a haiku about the sea.", "What does HTTP stand for?", "SELECT the five newest rows of orders:",
        "Explain recursion to a child.", "Why is the sky blue?", "Write a Bash loop over *.txt files.",
        "What is a closure in JavaScript?", "Summarise: " + " ".join(f"item{i}" for i in range(120))]


def _bundled_runs(model_dir, prompts, max_tokens, invariant, tiny_pool=False):
    """alone / batched / prefix hits / chunked at 37 tokens (a budget that cuts the prompts' query tiles
    where a whole prompt does not) and, with tiny_pool, a 32-block pool that preempts."""
    llm = LLM(model_dir, batch_invariant=invariant, num_blocks=256)
    tok = llm.get_tokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
           for p in prompts]

    def gen(engine, idx):
        outs = engine.generate([ids[i] for i in idx], [_params(i, max_tokens) for i in idx], use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]

    every = range(len(ids))
    runs = {"batched": gen(llm, every), "prefix hits": gen(llm, every), "alone": [gen(llm, [i])[0] for i in every]}
    runs["budget 37"] = gen(LLM(model_dir, batch_invariant=invariant, num_blocks=256, max_num_batched_tokens=37),
                            every)
    if tiny_pool:
        small = LLM(model_dir, batch_invariant=invariant, num_blocks=32, max_num_batched_tokens=64)
        runs["tiny pool"] = gen(small, every)
        assert small.metrics()["num_preemptions"] > 0, "the tiny pool was meant to preempt"
    return runs


@pytest.mark.slow                   # 20 s; test_bundled_model_16_requests is the larger check
def test_bundled_model_alone_equals_batched(bundled_model_dir, bundled_gguf):  # noqa: F811
    """The CPU default's weights (GGUF blocks, int8 activations where the CPU has AVX2), 4 requests: alone,
    batched, with prefix hits and chunked at 37 tokens, the same bits."""
    runs = _bundled_runs(bundled_model_dir, CHAT[:3] + CHAT[-1:], 8, True)
    for name, outs in runs.items():
        assert outs == runs["batched"], name


@pytest.mark.slow
def test_bundled_model_16_requests(bundled_model_dir, bundled_gguf):  # noqa: F811
    """16 chat requests (greedy, seeded top-p, seeded n=2) x 24 tokens, every comparison of the mode on the
    CPU default's weights; the same workload with the mode off differs."""
    runs = _bundled_runs(bundled_model_dir, CHAT, 24, True, tiny_pool=True)
    for name, outs in runs.items():
        same = sum(o == b for o, b in zip(outs, runs["batched"]))
        assert same == len(CHAT), f"{name}: {same}/{len(CHAT)} identical to the batched run"
    default = _bundled_runs(bundled_model_dir, CHAT, 24, False, tiny_pool=True)
    assert any(outs != default["batched"] for outs in default.values())
