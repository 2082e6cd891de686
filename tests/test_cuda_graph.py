"""Validation layer 3: the packed step and the CUDA-graph decode path.

CPU: the step packing (build_step_inputs: slots, in-flight ids, sampling rows, the seed's alignment) and
the padding of a decode step into a graph's fixed-size input, against plain loops.
GPU (`gpu`): graphs vs eager — greedy and seeded sampling tokens identical at batch 1; every graphed step of
a mixed workload re-run eagerly on the same state (logits within fp16 noise, argmax equal wherever the
margin is clear); a padded replay writes only the real rows' slots; every dtype x backend either replays
graphs or runs eagerly by design (float32 / the torch backend: eager), never crashes.
"""
from array import array

import numpy as np
import pytest
import torch
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn.block_manager import BlockManager
from pagedattn.engine.cuda_graph import decode_header, graph_batch_sizes, pad_decode_step, padded_batch_size
from pagedattn.engine.scheduler import SchedulerOutput
from pagedattn.engine.sequence import Sequence
from pagedattn.engine.step_inputs import SampleRow, StepInputs, _padded_tables, build_step_inputs, layout
from pagedattn.sampling_params import SamplingParams


def test_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert [padded_batch_size(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def make_step(bs=4):
    """A mixed step: a 6-token prefill chunk starting at 3, and two decodes (one with an in-flight token)."""
    bm = BlockManager(32, bs)
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**63 - 5)         # near the top of the allowed range
    a = Sequence(0, "a", list(range(10, 20)), 10, p, key=p.seed)
    b = Sequence(1, "b", [1, 2, 3, 4, 5], 3, p, index=2, key=7)
    c = Sequence(2, "c", [9, 8, 7], 2, SamplingParams(temperature=0), key=11)
    for s, n in ((a, 9), (b, 5), (c, 4)):
        bm.allocate_blocks(s.seq_id, -(-n // bs))
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 3, 4, 3
    c.num_inflight, c.inflight_row = 1, 6           # c's 4th token is still on the device (row 6)
    out = SchedulerOutput(scheduled=[(a, 6), (b, 1), (c, 1)], num_prefills=1, block_copies=[(3, 9)])
    rows = [SampleRow(b, 2), SampleRow(c, 0)]
    return build_step_inputs(out, bm, rows, [], 0), bm, (a, b, c)


def test_build_step_inputs_matches_a_loop():
    step, bm, (a, b, c) = make_step()
    f = step.fields()
    bs = 4
    want_ids, want_pos, want_slots, want_src = [], [], [], []
    for s, n in ((a, 6), (b, 1), (c, 1)):
        table = bm.block_table(s.seq_id)
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
            known = pos < len(s.token_ids)
            want_ids.append(s.token_ids[pos] if known else 0)
            want_src.append(-1 if known else s.inflight_row)
            want_pos.append(pos)
            want_slots.append(table[pos // bs] * bs + pos % bs)
    assert f["input_ids"].tolist() == want_ids and f["input_src"].tolist() == want_src
    assert f["positions"].tolist() == want_pos and f["slot_mapping"].tolist() == want_slots
    assert f["context_lens"].tolist() == [9, 5, 4] and f["cu_seqlens_q"].tolist() == [0, 6]
    assert f["sample_rows"].tolist() == [6, 7]                      # each sequence's last row
    assert f["comp_index"].tolist() == [2, 0] and f["position"].tolist() == [2, 2]   # outputs before each draw
    assert np.allclose(f["temperature"], [0.7, 0.0]) and f["top_k"].tolist() == [5, 0]
    assert f["seed"].view(np.uint64).tolist() == [7, 11]
    assert f["block_copies"].tolist() == [[3, 9]]
    tables = [bm.block_table(s.seq_id) for s in (a, b, c)]                     # 3, 2 and 1 blocks
    assert f["block_tables"].tolist() == [t + [0] * (3 - len(t)) for t in tables]
    assert step.max_context_len == 9 and not step.pure_decode
    assert layout(step.header)["seed"][0] % 2 == 0                  # int64 view needs 8-byte alignment
    assert torch.from_numpy(step.data)[layout(step.header)["seed"][0]:].view(torch.int64)[0] == 7
    again = StepInputs.from_header_array(step.header_array(), step.data.copy())   # what a worker rebuilds
    assert again.header == step.header


def test_padded_tables_from_arrays_and_lists():
    """The tables are packed from the BlockManager's arrays as they are; a list table (built by hand) too."""
    rng = np.random.default_rng(0)
    tables = [array("i", rng.integers(1, 1000, n).tolist()) for n in (5, 0, 17, 1, 17)] + [[4, 5, 6]]
    got = _padded_tables(tables)
    want = np.zeros((6, 17), np.int32)
    for i, t in enumerate(tables):
        want[i, :len(t)] = list(t)
    assert got.dtype == np.int32 and got.shape == (6, 17) and (got == want).all()
    assert _padded_tables([array("i"), []]).shape == (2, 0)


def test_short_context_graphs_where_the_decode_plan_differs():
    """A batch gets a second decode graph for contexts of <= 512 tokens exactly where v10 plans them otherwise
    (small batches: no split); a step replays the graph of the smallest bound holding its longest context."""
    from pagedattn.engine.cuda_graph import CudaGraphRunner
    from pagedattn.layers.attention import NumbaBackend
    from pagedattn.layers.torch_attention import TorchPagedBackend

    numba_backend = NumbaBackend(validate=False)
    bounds = {b: numba_backend.decode_context_bounds(b, 2, 7, 4096, "cuda:0") for b in (1, 8, 32, 64, 128, 256)}
    assert bounds == {1: [512, 4096], 8: [512, 4096], 32: [512, 4096], 64: [4096], 128: [4096], 256: [4096]}
    assert numba_backend.decode_context_bounds(1, 2, 7, 512, "cuda:0") == [512]          # nothing longer to split
    assert TorchPagedBackend().decode_context_bounds(1, 2, 7, 4096, "cpu") == [4096]

    graphs = CudaGraphRunner.__new__(CudaGraphRunner)       # its choice of graph only (capture needs a GPU)
    graphs.sizes, graphs.bounds = [1, 2, 4], {1: [512, 4096], 2: [512, 4096], 4: [4096]}
    step = lambda n, longest: StepInputs(dict(decode_header(n, 4), max_context_len=longest), None)  # noqa: E731
    assert graphs.key(step(1, 512)) == (1, 512) and graphs.key(step(1, 513)) == (1, 4096)
    assert graphs.key(step(2, 17)) == (2, 512) and graphs.key(step(3, 17)) == (4, 4096)


def test_pad_decode_step():
    bm = BlockManager(16, 4)
    seqs = [Sequence(i, i, [1] * (3 + i), 3, SamplingParams(temperature=0.5, seed=i), key=i) for i in range(3)]
    for s in seqs:
        bm.allocate_blocks(s.seq_id, 2)
        s.num_computed_tokens = s.num_tokens - 1
    out = SchedulerOutput(scheduled=[(s, 1) for s in seqs])
    step = build_step_inputs(out, bm, [SampleRow(s, 0) for s in seqs], [], 0)
    assert step.pure_decode
    data = pad_decode_step(step, 4, 5)
    f = StepInputs(decode_header(4, 5), data).fields()
    g = step.fields()
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "seed", "temperature"):
        assert f[name][:3].tolist() == g[name].tolist(), name
    assert (f["block_tables"][:3, :2] == g["block_tables"]).all() and (f["block_tables"][3:] == 0).all()
    assert f["slot_mapping"][3] == -1 and f["context_lens"][3] == 1 and f["input_src"][3] == -1
    assert f["temperature"][3] == 0 and f["sample_rows"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        pad_decode_step(step, 2, 5)
    padded = StepInputs(decode_header(4, 5), pad_decode_step(step, 4, 5, pad_block=16)).fields()  # (the step kernel)
    assert (padded["block_tables"][3] == 16).all() and (padded["block_tables"][:3, :2] == g["block_tables"]).all()
    assert padded["slot_mapping"][3] == -1 and padded["positions"][3] == 0


def test_runner_is_eager_on_cpu(tiny_checkpoint):  # noqa: F811
    from pagedattn import LLM
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=32, block_size=4, max_num_seqs=4)
    assert not llm.engine.runner.use_graphs
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.engine.runner.graphs is None


# ---- GPU ----------------------------------------------------------------------------------------
def _random_real_checkpoint():
    from scripts.benchlib import random_checkpoint
    return random_checkpoint("0.5b")


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len, piecewise", [(300, True), (400, True), (400, False)],
                         ids=["300", "400", "400-no-piecewise"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=200,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_graph_equals_eager_batch1_tokens(params, prompt_len, piecewise):
    """One sequence (graph of size 1, no padding): the same tokens with graphs as eager, 200 steps. From a
    400-token prompt the contexts cross the short-context bound: the graph of bound 512, then the one of
    1024, under async scheduling (the step after the switch reads the previous step's token on the device).
    The prompt runs through the piecewise graphs, or eagerly (piecewise_graphs=False)."""
    from pagedattn import LLM
    ckpt = _random_real_checkpoint()
    prompt = np.random.default_rng(1).integers(0, 10000, prompt_len).tolist()
    toks = {}
    for eager in (True, False):
        with LLM(ckpt, device="cuda", max_num_seqs=4, max_model_len=1024, num_blocks=256, enforce_eager=eager,
                 piecewise_graphs=piecewise) as llm:
            toks[eager] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert (llm.engine.runner.graphs is None) == eager
            if not eager:
                assert llm.engine.runner.graphs.bounds[1] == [512, 1024]
    assert toks[True] == toks[False]


@pytest.mark.gpu
def test_graph_equals_eager_mixed_workload():
    """Every graphed decode step of a mixed workload (prompts of many lengths, a small token budget so
    prefill chunks run beside decodes, batch sizes 13..1 that hit padded graphs as requests finish) is
    also run eagerly on the same state: logits agree to fp16 noise, and the greedy token agrees
    wherever the top-2 margin exceeds twice the difference (where rounding cannot flip it).

    Exact token equality over a whole multi-sequence run is not a sound test: a padded batch runs
    cuBLAS at another M (other blocking, other rounding) and the decode kernel's split plan differs,
    so a near-tie somewhere in hundreds of greedy steps can flip and the sequences then diverge.
    """
    from pagedattn import LLM
    ckpt = _random_real_checkpoint()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, int(n)).tolist() for n in rng.integers(5, 300, 13)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(10, 60, 13)]
    llm = LLM(ckpt, device="cuda", max_num_seqs=16, max_model_len=512, num_blocks=512, block_size=16,
              max_num_batched_tokens=256, async_scheduling=False)
    runner = llm.engine.runner
    graphs = runner.capture_graphs()
    replay = graphs.run
    stats = {"steps": 0, "sizes": set(), "worst": 0.0, "mismatch": 0, "near_ties": 0}

    def checked(step):
        n = step.num_seqs
        g_logits = replay(step)[:n].clone()
        dev = torch.from_numpy(step.data).to(runner.device)
        _, e_logits = runner.run_step(step, dev, max_context_len=step.max_context_len)   # rewrites the same slots
        diff = (g_logits - e_logits).abs().amax(-1)
        top2 = e_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        stats["steps"] += 1
        stats["sizes"].add(n)
        stats["worst"] = max(stats["worst"], float(diff.max()))
        stats["mismatch"] += int((g_logits.argmax(-1) != e_logits.argmax(-1))[clear].sum())
        stats["near_ties"] += int((~clear).sum())
        return g_logits

    graphs.run = checked
    llm.generate(prompts, params, use_tqdm=False)
    print(stats)
    assert stats["steps"] > 20 and len(stats["sizes"]) > 3
    assert stats["mismatch"] == 0
    assert stats["worst"] < 1.0, "graph and eager logits differ by more than fp16 noise"
    assert graphs.graphs.keys() == {(b, 512) for b in (1, 2, 4, 8, 16)}      # max_model_len 512: one bound each


@pytest.mark.gpu
def test_graph_replay_padding_writes_nowhere():
    """A padded replay (one real row in a graph of 2) changes the pool only at the real row's slot."""
    from pagedattn import LLM
    ckpt = _random_real_checkpoint()
    llm = LLM(ckpt, device="cuda", max_num_seqs=8, max_model_len=256, num_blocks=64, block_size=16,
              async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.capture_graphs()
    graphs.sizes = [2, 4, 8]                         # force padding for a batch of 1
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()                                    # prefill (eager) samples token 6
    seq = engine.groups["a"].seqs[0]
    before = [k.clone() for k in engine.kv_cache.k_caches]
    engine.step()                                    # one decode row, replayed in the graph of 2
    torch.cuda.synchronize()
    pos = seq.num_tokens - 2
    table = engine.block_manager.block_table(seq.seq_id)
    blk, off = table[pos // 16], pos % 16
    for k, k0 in zip(engine.kv_cache.k_caches, before):
        diff = (k != k0).nonzero()
        assert diff.numel() > 0
        assert set(diff[:, 0].tolist()) == {blk} and set(diff[:, 2].tolist()) == {off}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_every_dtype_and_backend_runs(dtype, backend):
    """Graphs where the backend can be captured (numba kernels, 16-bit), eager by design elsewhere; the
    same greedy tokens as enforce_eager either way, never a crash (float32 on CUDA used to crash inside
    the capture)."""
    from pagedattn import LLM
    ckpt = _random_real_checkpoint()
    prompts = [[5, 6, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    toks = {}
    for eager in (True, False):
        with LLM(ckpt, device="cuda", max_model_len=256, dtype=dtype, attn_backend=backend, enforce_eager=eager,
                 num_blocks=64, block_size=16, max_num_seqs=4) as llm:
            toks[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            capturable = backend == "numba" and dtype != "float32"
            assert llm.engine.runner.use_graphs == (capturable and not eager)
    assert toks[True] == toks[False]
