"""Tensor parallelism on CPU: 2 ranks over gloo (the parent is rank 0, one spawned worker is rank 1).

The tiny Qwen2 (tests/helpers.py: 6 query heads, 2 KV heads, vocab 128, intermediate 160) splits into
3 query heads + 1 KV head, 64 vocab rows and 80 intermediate columns per rank.

- Greedy token ids at TP=2 equal TP=1 for prompts of 1..40 tokens, 40 new tokens each with 8-token
  blocks (every sequence crosses several block boundaries), chunked prefill (a 32-token budget), a
  prefix-cache hit, and n=2 seeded sampling (forks share blocks: the copy-on-write copies must reach
  the worker too). Exact equality is the check, but the logits are not bit-identical: the all-reduce
  adds the two ranks' partial o_proj / down_proj sums in another order than one matmul, so float32
  logits differ by ~1e-6. On this model no greedy choice is that close to a tie; a model where one
  is could flip a token, which would not be a bug.
- A worker killed mid-life, or one that raises, makes generate raise TensorParallelError in the
  parent within seconds (no hang; the worker's traceback in the message), leaving no child process.
- close() / Ctrl-C stop the workers: no child process remains.
- Beam search at TP=2 gives TP=1's beams; an engine idle for longer than the workers' wait timeout keeps
  them (rank 0's heartbeat).

- The fused all-reduce + residual add + RMSNorm (pagedattn/distributed/allreduce_norm.py) equals the
  unfused path on two gloo ranks: the function alone; the model with it wired in (PAGEDATTN_FUSED_ALLREDUCE
  =on against =off), layer by layer and through the forward's halves (PiecewiseGraphs' pieces), bit for
  bit; the engine with it on for every step gives TP=1's greedy ids and beams. Its threshold and the
  environment variable.

Launches by torchrun (the ranks on several hosts) are tests/test_torchrun.py's.
"""
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import is_gone, tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn import LLM, SamplingParams
from pagedattn.distributed.worker import TensorParallelError
from pagedattn.errors import InvalidRequestError

TP = 2
ENGINE_ARGS = dict(device="cpu", block_size=8, num_blocks=96, max_num_batched_tokens=32)
PROMPT_LENGTHS = [1, 5, 8, 17, 40]
MAX_TOKENS = 40
SHARED = [(5 * i + 7) % 120 + 3 for i in range(19)]         # a shared 19-token prefix


def make_prompts():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in PROMPT_LENGTHS]
    return prompts + [SHARED + [rng.randrange(3, 128) for _ in range(n)] for n in (2, 6)]


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True)


def run_workload(llm):
    """Token ids of: all prompts greedily (one batch), then the shared-prefix ones again (a prefix-cache
    hit), then n=2 seeded sampling of two prompts."""
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    ids += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[-2:], GREEDY, use_tqdm=False)]
    ids += [c.token_ids for o in llm.generate(PROMPTS[1:3], SAMPLED, use_tqdm=False) for c in o.outputs]
    return ids


def test_invalid_tensor_parallel_size_names_the_field(tiny_checkpoint):  # noqa: F811
    cases = [(4, "num_attention_heads"), (3, "num_key_value_heads"), (0, "tensor_parallel_size"),
             ("2", "tensor_parallel_size")]
    for tp, field in cases:
        with pytest.raises(InvalidRequestError, match=field):
            LLM(tiny_checkpoint, device="cpu", tensor_parallel_size=tp)
    assert not multiprocessing.active_children()        # rejected before any process starts


def test_check_names_vocab_and_intermediate():
    from pagedattn.distributed import check_tensor_parallel_size
    from pagedattn.models.qwen2 import Qwen2Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)
    check_tensor_parallel_size(Qwen2Config(**base), 2)
    with pytest.raises(InvalidRequestError, match="vocab_size"):
        check_tensor_parallel_size(Qwen2Config(**{**base, "vocab_size": 129}), 2)
    with pytest.raises(InvalidRequestError, match="intermediate_size"):
        check_tensor_parallel_size(Qwen2Config(**{**base, "intermediate_size": 161}), 2)


def test_greedy_matches_tp1_and_close_leaves_no_children(tiny_checkpoint):  # noqa: F811
    expected = run_workload(LLM(tiny_checkpoint, **ENGINE_ARGS))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS) as llm:
        group = llm.engine.runner.workers
        pids = group.pids
        assert len(pids) == TP - 1
        got = run_workload(llm)
        assert llm.engine.kv_cache.num_kv_heads == 1         # this rank's slice of every block
        assert llm.metrics()["kv_cache_usage"] == 0           # every block returned
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e == g, f"sequence {i}: TP=1 {e} != TP={TP} {g}"
    assert len(got) == len(PROMPTS) + 2 + 4
    assert all(is_gone(pid) for pid in pids) and not multiprocessing.active_children()
    assert [p.exitcode for p in group.context.processes] == [0]   # a clean stop, not a kill
    llm.close()                                                   # idempotent
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)


def test_async_scheduling_at_tp2(tiny_checkpoint):  # noqa: F811
    """Every rank samples the same tokens from the same all-gathered logits, so the next step's in-flight
    ids can be read on every rank's device: TP=2 with async scheduling gives TP=1's tokens."""
    expected = run_workload(LLM(tiny_checkpoint, **ENGINE_ARGS))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, async_scheduling=True, **ENGINE_ARGS) as llm:
        assert run_workload(llm) == expected


BEAM_PROMPTS = [[5, 6, 7], list(range(3, 30)), [9], [11, 12] * 9]


def test_beam_search_at_tp2_equals_tp1(tiny_checkpoint):  # noqa: F811
    """Beam rows take their top-2W log-probabilities from the all-gathered logits on every rank (the workers
    compute them too: lm_head's all-gather is a collective), and the forks' copy-on-write copies reach
    every rank: TP=2 gives TP=1's beams, token for token. Cumulative log-probabilities differ by the
    all-reduce's rounding only."""
    from pagedattn.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    expected = LLM(tiny_checkpoint, **ENGINE_ARGS).beam_search(BEAM_PROMPTS, params, use_tqdm=False)
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS) as llm:
        got = llm.beam_search(BEAM_PROMPTS, params, use_tqdm=False)
        assert llm.metrics()["kv_cache_usage"] == 0
    for i, (e, g) in enumerate(zip(expected, got)):
        assert len(e.sequences) == len(g.sequences) == params.beam_width
        for b, (se, sg) in enumerate(zip(e.sequences, g.sequences)):
            assert se.output_token_ids == sg.output_token_ids, f"prompt {i} beam {b}"
            assert sg.cumulative_logprob == pytest.approx(se.cumulative_logprob, rel=1e-5, abs=1e-5)


def test_idle_engine_keeps_its_workers(tiny_checkpoint, monkeypatch):  # noqa: F811
    """A worker waits for rank 0's next message at most CTRL_TIMEOUT_S; an engine left idle longer (a server
    without requests) keeps its workers because rank 0 sends a heartbeat every HEARTBEAT_S. Here the
    timeout is 3 s and the engine idles for 5 s between two requests."""
    from pagedattn.distributed import worker

    monkeypatch.setattr(worker, "CTRL_TIMEOUT_S", 3)
    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS) as llm:
        first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        time.sleep(5)
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == first
        (pid,) = llm.engine.runner.workers.pids
        assert not is_gone(pid)


def test_worker_failure_raises_in_parent(tiny_checkpoint):  # noqa: F811
    llm = LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    (pid,) = llm.engine.runner.workers.pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker failed"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert is_gone(pid) and not multiprocessing.active_children()
    llm.close()


def test_worker_exception_surfaces_in_parent(tiny_checkpoint):  # noqa: F811
    """An exception raised inside the worker (here: an op it does not know) reaches the parent with the
    worker's traceback, within seconds."""
    from pagedattn.distributed.worker import send

    llm = LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS)
    (pid,) = llm.engine.runner.workers.pids
    send(99, None, None, llm.engine.runner.workers.ctrl)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="unknown op 99"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert is_gone(pid) and not multiprocessing.active_children()


FUSED_NORM_TOKENS = [1, 2, 5, 17, 64]       # 1 and 5, 17: fewer rows than ranks, and padding
FUSED_NORM_DTYPES = [torch.float32, torch.bfloat16]


def _fused_norm_rank(rank, world_size, init_method):
    """One gloo rank: the fused reduce-scatter / add-norm / all-gather against all-reduce then add-norm,
    for every FUSED_NORM_TOKENS x FUSED_NORM_DTYPES; raises on the first difference (the parent sees it)."""
    import torch.distributed as dist

    from pagedattn.distributed.allreduce_norm import all_reduce_add_rms_norm, gather_rows, shard_rows, token_rows
    from pagedattn.layers.ops import add_rms_norm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        hidden, eps = 96, 1e-6
        for dtype in FUSED_NORM_DTYPES:
            for T in FUSED_NORM_TOKENS:
                mine = torch.Generator().manual_seed(100 * T + rank)          # this rank's partial sums
                shared = torch.Generator().manual_seed(7 * T)                 # replicated: residual, weight
                partial = torch.randn(T, hidden, generator=mine).to(dtype)
                residual = (3 * torch.randn(T, hidden, generator=shared)).to(dtype)
                weight = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(dtype)
                reduced = partial.clone()
                dist.all_reduce(reduced)
                want_x, want_residual = add_rms_norm(reduced, residual, weight, eps)
                x, residual_rows = all_reduce_add_rms_norm(partial, shard_rows(residual, rank, world_size),
                                                           weight, eps, add_rms_norm)
                assert residual_rows.shape == (token_rows(T, world_size), hidden)
                got_residual = gather_rows(residual_rows, T)
                for name, got, want in (("x", x, want_x), ("residual", got_residual, want_residual)):
                    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
                    diff = (got.float() - want.float()).abs().max().item()
                    assert torch.equal(got, want), f"{dtype} T={T} {name}: max |fused - unfused| = {diff}"
    finally:
        dist.destroy_process_group()


def test_fused_all_reduce_add_rms_norm_equals_unfused_on_gloo():
    """Two gloo ranks: reduce-scatter, add + RMSNorm on each rank's rows, all-gather gives the unfused
    all-reduce + add_rms_norm bit for bit (the same two-term sums, the same row-wise norm), in float32 and
    bfloat16, for token counts below, at and above the rank count, padded or not; the residual stream
    kept as rows gathers back to the unfused residual."""
    import torch.multiprocessing as mp

    from pagedattn.distributed.parallel import free_port

    mp.start_processes(_fused_norm_rank, args=(TP, f"tcp://127.0.0.1:{free_port()}"), nprocs=TP, join=True,
                       start_method="spawn")


# ---- the fused path wired into the model ----------------------------------------------------------
def test_fused_allreduce_threshold_and_setting():
    """auto: on CUDA, steps whose [T, hidden] message is >= FUSED_MIN_BYTES (decode steps of <= 256 rows
    stay below it at every Qwen2 width), off on gloo; on / off / N override it; one rank: never; a bad
    setting is refused by the engine's config, naming the field."""
    from pagedattn.config import EngineConfig
    from pagedattn.distributed import allreduce_norm as arn

    seven_b = arn.fused_allreduce_for(2, "cuda", torch.float16, 3584)
    assert seven_b.min_tokens == 2341 and 2341 * 3584 * 2 >= arn.FUSED_MIN_BYTES > 2340 * 3584 * 2
    assert arn.fused_allreduce_for(2, "cuda", torch.float16, 896).min_tokens == 9363
    assert arn.fused_allreduce_for(2, "cuda", torch.float32, 896).min_tokens == 4682
    assert min(arn.default_min_tokens(h, 2, "cuda") for h in (896, 1536, 3584, 8192)) > 256
    assert arn.fused_allreduce_for(2, "cpu", torch.float32, 64) is None
    assert arn.fused_allreduce_for(1, "cuda", torch.float16, 3584) is None
    for value, want in (("on", 1), ("off", None), ("auto", 2341), (700, 700), (0, None)):
        got = arn.fused_allreduce_for(2, "cuda", torch.float16, 3584, value)
        assert (got and got.min_tokens) == want, (value, got)
    with pytest.raises(ValueError, match="fused_allreduce"):
        arn.fused_allreduce_for(2, "cpu", torch.float32, 64, "sometimes")
    assert arn.fused_allreduce_for(2, "cpu", torch.float32, 64, 3).takes(3)
    assert not arn.fused_allreduce_for(2, "cpu", torch.float32, 64, 3).takes(2)
    for bad in ("sometimes", -1, True, 2.5):
        with pytest.raises(InvalidRequestError, match="fused_allreduce"):
            EngineConfig(device="cpu", fused_allreduce=bad)


FUSED_LAYER_PROMPTS = [1, 5, 17, 40]   # steps of 63 (odd: a padding row), 4 and 1 rows
FUSED_LAYER_CHUNKS = [None, 12]         # whole prompts; 12-token chunks starting mid-block (8-token blocks)


def _fused_sites(model, T, record):
    """Forward hooks recording, per layer, the attention output, the MLP output and the hidden state after the
    layer (x + residual), whole: a step that `model` fuses has self_attn / mlp return partial sums and the
    layer return (partial sum, this rank's residual rows), so the hooks reduce and gather them (collectives
    inside hooks: every rank runs the same hooks in the same order)."""
    import torch.distributed as dist

    from pagedattn.distributed.allreduce_norm import gather_rows, token_rows

    fused = model.fused_allreduce is not None and model.fused_allreduce.takes(T)

    def whole(t):
        t = t.clone()
        if fused:
            dist.all_reduce(t)
        return t

    def layer_out(module, args, output):
        x, residual = output
        if fused:
            assert residual.shape[0] == token_rows(T, dist.get_world_size()), residual.shape   # rows, not all
            residual = gather_rows(residual, T)
        return x if not fused else whole(x), residual

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [layer.self_attn.register_forward_hook(
                        lambda m, a, o, i=i: record.__setitem__(f"L{i} attn", whole(o))),
                    layer.mlp.register_forward_hook(lambda m, a, o, i=i: record.__setitem__(f"L{i} mlp", whole(o))),
                    layer.register_forward_hook(
                        lambda m, a, o, i=i: record.__setitem__(f"L{i} out", torch.add(*layer_out(m, a, o))))]
    return handles


def _run_fused_plan(model, config, plan, tokens, tables, num_blocks, block_size, world_size, piecewise=False):
    """Run the plan's steps through `model` (or through PiecewiseGraphs' pieces, graphs off); returns one
    {site: tensor} per step (the pieces: the final hidden state only)."""
    from pagedattn.engine.piecewise_graph import PiecewiseGraphs
    from pagedattn.kv_cache import KVCache
    from pagedattn.layers.attention import AttentionMetadata

    kv = KVCache(config.num_hidden_layers, num_blocks, config.num_key_value_heads // world_size, block_size,
                 config.head_dim, dtype=torch.float32, device="cpu")
    for pool in kv.k_caches + kv.v_caches:
        pool.fill_(float("nan"))                    # a read past a sequence's end poisons the output
    pieces = PiecewiseGraphs(model, kv, 64, graphs=False) if piecewise else None
    steps = []
    for step in plan:
        ids = torch.tensor([t for s, start, q, _ in step for t in tokens[s][start:start + q]])          # (T,)
        pos = torch.tensor([p for _, start, q, _ in step for p in range(start, start + q)])              # (T,)
        meta = AttentionMetadata.build([q for _, _, q, _ in step], [start + q for _, start, q, _ in step],
                                       [tables[s] for s, *_ in step], block_size,
                                       sum(prefill for *_, prefill in step), "cpu")
        record, T = {}, len(ids)
        with torch.inference_mode(), model.ops.step_scope(T):
            if pieces is not None:
                record["hidden"] = pieces.forward(ids.int(), pos.int(), kv, meta).clone()
            else:
                handles = _fused_sites(model, T, record)
                try:
                    record["hidden"] = model.forward(ids, pos, kv, meta).clone()
                finally:
                    for h in handles:
                        h.remove()
        steps.append(record)
    return steps


def _fused_layers_rank(rank, world_size, init_method, ckpt):
    """One gloo rank: the tiny model loaded twice (fused_allreduce "on", "off") runs the same steps;
    every recorded site of every step must be equal (see the test)."""
    import torch.distributed as dist

    from pagedattn.models.loader import load_model
    from scripts.tp_layer_diff import make_inputs, make_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        models = {}
        for mode in ("on", "off"):
            models[mode], config = load_model(ckpt, "cpu", torch.float32, "auto", rank, world_size,
                                              fused_allreduce=mode)
        assert models["on"].fused_allreduce.min_tokens == 1 and models["off"].fused_allreduce is None
        block_size = 8
        for chunk in FUSED_LAYER_CHUNKS:
            plan = make_plan(FUSED_LAYER_PROMPTS, 2, chunk)
            plan[-1] = plan[-1][:1]                                        # a 1-token step
            tokens, tables, num_blocks = make_inputs(FUSED_LAYER_PROMPTS, 2, config.vocab_size, block_size, 0)
            args = (config, plan, tokens, tables, num_blocks, block_size, world_size)
            runs = {mode: _run_fused_plan(models[mode], *args) for mode in models}
            runs.update({f"{mode} pieces": _run_fused_plan(models[mode], *args, piecewise=True) for mode in models})
            for k, step in enumerate(plan):
                T = sum(q for _, _, q, _ in step)
                want = runs["off"][k]
                for run in ("on", "on pieces", "off pieces"):
                    got = runs[run][k]
                    base = want if run == "on" else runs["off pieces"][k]
                    for site in got:
                        a, b = got[site], base[site]
                        assert a.shape == b.shape, (chunk, k, T, run, site, a.shape, b.shape)
                        assert torch.equal(a, b), (f"chunk {chunk} step {k} (T={T}) {run} {site}: max |diff| "
                                                   f"{(a - b).abs().max().item():.3g} of {b.abs().max().item():.3g}")
                assert len(want) == 3 * config.num_hidden_layers + 1
                assert torch.isfinite(want["hidden"]).all()
                # the pieces' GEMMs see the padded row count: within float32 rounding of the forward
                assert torch.allclose(runs["off pieces"][k]["hidden"], want["hidden"], rtol=0, atol=1e-5 *
                                      float(want["hidden"].abs().max())), (chunk, k)
    finally:
        dist.destroy_process_group()


def test_fused_allreduce_model_equals_unfused_layer_by_layer_on_gloo(tiny_checkpoint):  # noqa: F811
    """Two gloo ranks, the tiny model in float32 loaded with the fused path forced on and off, the same steps:
    ragged whole prompts (63 rows: a padding row), 12-token chunks starting mid-block over cached tokens,
    decode steps of 4 rows and a 1-token step (one real row, rank 1 holds only padding). Every layer's
    attention output, MLP output and hidden state (partial sums reduced and residual rows gathered in the
    hooks) and the final hidden state equal the unfused path's bit for bit: at P = 2 every sum is one
    two-term addition in either path, the norms work row by row and every GEMM sees the same rows, so
    float32 allows no difference. The same through the forward's halves (PiecewiseGraphs' pieces, graphs
    off, padded to 16-64 rows): fused equal to unfused, and within float32 rounding of the forward."""
    import torch.multiprocessing as mp

    from pagedattn.distributed.parallel import free_port

    mp.start_processes(_fused_layers_rank, args=(TP, f"tcp://127.0.0.1:{free_port()}", tiny_checkpoint), nprocs=TP,
                       join=True, start_method="spawn")


ONE_TOKEN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_fused_allreduce_engine_at_tp2_equals_tp1(tiny_checkpoint):  # noqa: F811
    """The engine at TP=2 with the fused path forced on for every step (fused_allreduce="on", which both ranks'
    model builds read from the engine's config): the workload (ragged prompts, padding rows, chunked prefill, a prefix-cache
    hit, n=2 forks), a 1-token prompt alone (1-row steps) and beam search give TP=1's token ids, float32."""
    from pagedattn.sampling_params import BeamSearchParams

    beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    tp1 = LLM(tiny_checkpoint, **ENGINE_ARGS)
    expected = (run_workload(tp1), tp1.generate([[9]], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids,
                tp1.beam_search(BEAM_PROMPTS, beams, use_tqdm=False))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, fused_allreduce="on", **ENGINE_ARGS) as llm:
        model = llm.engine.runner.model
        assert model.fused_allreduce.min_tokens == 1
        assert model.model.layers[0].mlp.down_proj.fused is model.model.norm.fused is model.fused_allreduce
        got = (run_workload(llm), llm.generate([[9]], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids,
               llm.beam_search(BEAM_PROMPTS, beams, use_tqdm=False))
        assert llm.metrics()["kv_cache_usage"] == 0
    for i, (e, g) in enumerate(zip(expected[0], got[0])):
        assert e == g, f"sequence {i}: TP=1 {e} != TP={TP} fused {g}"
    assert expected[1] == got[1]
    for i, (e, g) in enumerate(zip(expected[2], got[2])):
        for b, (se, sg) in enumerate(zip(e.sequences, g.sequences)):
            assert se.output_token_ids == sg.output_token_ids, f"prompt {i} beam {b}"
            assert sg.cumulative_logprob == pytest.approx(se.cumulative_logprob, rel=1e-5, abs=1e-5)


@pytest.mark.slow
def test_bench_allreduce_norm_runs_on_gloo():
    """scripts/bench_allreduce_norm.py (the GPU timing of the fused step) on two CPU ranks, tiny shapes: it
    checks the fused path against the unfused one before timing, and reports both."""
    from scripts.bench_allreduce_norm import main

    rows = main(device="cpu", hidden=64, tokens=(1, 5), dtype="float32", iters=2)
    assert [r["tokens"] for r in rows] == [1, 5]
    assert all(r["equal"] and r["unfused_us"] > 0 and r["fused_us"] > 0 for r in rows), rows


@pytest.mark.slow
def test_bench_tp_fused_norm_runs_on_gloo(tiny_checkpoint, tmp_path):  # noqa: F811
    """scripts/bench_tp_fused_norm.py (the engine at TP=2, fused path on against off) on two CPU ranks with the
    tiny model: both modes run, the fused one with every step fused, their greedy ids agree, results saved."""
    from scripts.bench_tp_fused_norm import main

    res = main(device="cpu", model=tiny_checkpoint, prefill_tokens=(8, 24), decode_batch=(1, 3), decode_prompt=6,
               decode_tokens=4, repeats=1, out=str(tmp_path))
    assert [(r["mode"], r["min_tokens"]) for r in res["rows"]] == [("off", None), ("on", 1)]
    assert res["ratios"][0]["greedy_equal"] == "4/4", res["ratios"]
    assert all(v > 0 for r in res["rows"] for v in [*r["prefill_ms"].values(), *r["decode_tok_s"].values()])
    assert "| model | on |" in (tmp_path / "bench_tp_fused_norm.md").read_text()


CTRL_C_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys
    from pagedattn import LLM, SamplingParams
    if __name__ == "__main__":
        # a terminal's process: Ctrl-C raises KeyboardInterrupt, whatever SIGINT state the test
        # runner's process handed down (what it was is printed, for a failure message)
        print("SIGINT at start:", signal.getsignal(signal.SIGINT), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        llm = LLM(sys.argv[1], device="cpu", block_size=8, num_blocks=64, tensor_parallel_size=2)
        print(*llm.engine.runner.workers.pids, flush=True)
        faulthandler.dump_traceback_later(25, exit=True)   # a hang shows where it is (the test fails on it)
        while True:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
""")


def test_ctrl_c_stops_workers(tiny_checkpoint, tmp_path):  # noqa: F811
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while steps are running."""
    script = tmp_path / "tp_loop.py"
    script.write_text(CTRL_C_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, *sys.path])}
    proc = subprocess.Popen([sys.executable, str(script), tiny_checkpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == TP - 1, proc.stderr.read()
        time.sleep(1.0)                                    # let it get into the generate loop
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Timeout (0:00:25)" not in err, f"still running 25 s after start; its threads:\n{err[-6000:]}"
    assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 10
    while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(is_gone(p) for p in pids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs")
@pytest.mark.parametrize("fused", ["off", "on"])
def test_gpu_nccl_greedy_matches_tp1(tiny_checkpoint, fused):  # noqa: F811
    """The same workload on GPUs: rank r on cuda:r, NCCL all-reduces, float32 (no fp16 near-ties), eager. fused
    on: every step, decodes included (1-7 rows: padding rows), through NCCL's reduce-scatter + all-gather."""
    args = dict(ENGINE_ARGS, device="cuda", dtype="float32", attn_backend="torch", enforce_eager=True,
                fused_allreduce=fused)
    expected = run_workload(LLM(tiny_checkpoint, **args))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **args) as llm:
        assert llm.engine.kv_cache.num_kv_heads == 1
        got = run_workload(llm)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e == g, f"sequence {i}: TP=1 {e} != TP={TP} {g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs")
@pytest.mark.parametrize("chunk", [None, 48])
def test_gpu_layer_by_layer_at_qwen2_0p5b_shapes(chunk):
    """TP=2 against TP=1 on the 0.5B shapes in fp16 with the numba kernels (7 query heads / 1 KV head per
    rank), ragged prompts, optionally in 48-token chunks that start mid-block, then decode steps: every
    attention, MLP and layer output stays within the noise of TP=1 against a float32 reference
    (scripts/tp_layer_diff.py's rule), and the greedy tokens agree. The fused all-reduce stays off (its
    hooks read self_attn's and mlp's outputs as whole sums; the fused path is compared layer by layer in
    test_fused_allreduce_model_equals_unfused_layer_by_layer_on_gloo)."""
    from scripts.tp_layer_diff import main

    res = main(device="cuda", backend="numba", config="0.5b", dtype="float16", chunk=chunk)
    assert res["first_jump"] is None, res["first_jump"]
    assert all(r["tp2_eq_tp1"] == r["chunks"] for r in res["argmax"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs")
@pytest.mark.parametrize("fused", ["auto", "on"])
def test_gpu_engine_tp2_equals_tp1_at_qwen2_0p5b_shapes(fused):
    """The whole engine path at TP=2 (rank 0's workers, the broadcast step, each rank's pool and runner) on the
    0.5B shapes in float32 (no fp16 near-ties): 64 mixed requests give TP=1's greedy ids, every one. fused:
    the fused_allreduce option (on: every eager step through NCCL's reduce-scatter + all-gather, the decode
    graphs with their all-reduce)."""
    from scripts.benchlib import nano_vllm_workload, random_checkpoint

    ckpt = random_checkpoint("0.5b")
    prompts, _ = nano_vllm_workload(64, 20, 300)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    args = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=1024)
    with LLM(ckpt, **args) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(ckpt, tensor_parallel_size=TP, fused_allreduce=fused, **args) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(e == g for e, g in zip(expected, got))
    assert same == len(prompts), f"{same} of {len(prompts)} identical"
