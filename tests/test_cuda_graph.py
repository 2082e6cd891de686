"""CUDA-graph decode: the padded-batch packing (CPU) and graph == eager on the GPU (`gpu`)."""
import numpy as np
import pytest
import torch

from pagedattn.engine.cuda_graph import (DecodeBuffers, DecodeLayout, fill_decode_rows, graph_batch_sizes,
                                         padded_batch_size)


def test_ladder():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 17, 33, 48)] == [1, 4, 8, 32, 48, 48]
    assert padded_batch_size(49, sizes) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_fill_decode_rows_real_and_padding():
    bs, L = 4, DecodeLayout(max_batch=8, max_blocks=5)
    buf = np.full(L.size, 77, dtype=np.int32)           # stale values everywhere
    tokens, positions = [11, 12, 13], [0, 5, 18]
    tables = [[3], [7, 2], [1, 4, 6, 9, 8]]
    n = fill_decode_rows(buf, L, tokens, positions, tables, bs, batch=4)
    assert n == 3
    assert buf[L.ids][:4].tolist() == [11, 12, 13, 0]
    assert buf[L.pos][:4].tolist() == [0, 5, 18, 0]
    assert buf[L.ctx][:4].tolist() == [1, 6, 19, 1]
    # slot = table[pos // bs] * bs + pos % bs; padding writes nowhere
    assert buf[L.slots][:4].tolist() == [3 * 4 + 0, 2 * 4 + 1, 8 * 4 + 2, -1]
    bt = buf[L.tables].reshape(8, 5)
    assert bt[0].tolist() == [3, 0, 0, 0, 0] and bt[1].tolist() == [7, 2, 0, 0, 0]
    assert bt[2].tolist() == [1, 4, 6, 9, 8]
    assert bt[3].tolist() == [0] * 5                     # padding reads block 0 (valid), one token
    assert (bt[4:] == 77).all() and (buf[L.ids][4:] == 77).all()   # rows past the batch untouched
    # a smaller batch after a larger one: stale table entries of the real rows are cleared
    fill_decode_rows(buf, L, [5], [2], [[6]], bs, batch=2)
    assert bt[0].tolist() == [6, 0, 0, 0, 0] and bt[1].tolist() == [0] * 5
    assert buf[L.slots][:2].tolist() == [26, -1] and buf[L.ctx][:2].tolist() == [3, 1]


def test_fill_rejects_oversize():
    L = DecodeLayout(max_batch=4, max_blocks=2)
    buf = np.zeros(L.size, dtype=np.int32)
    with pytest.raises(ValueError):
        fill_decode_rows(buf, L, [1, 2, 3], [0, 0, 0], [[0], [0], [0]], 4, batch=2)
    with pytest.raises(ValueError):
        fill_decode_rows(buf, L, [1], [0], [[0]], 4, batch=8)


def test_decode_buffers_metadata_views_cpu():
    b = DecodeBuffers(max_batch=8, max_blocks=3, device="cpu")
    b.fill([4, 5], [1, 2], [[2], [1]], 4, batch=4)
    meta = b.metadata(4)
    assert meta.decode_only and meta.num_decode_tokens == 4 and meta.num_tokens == 4
    assert meta.slot_mapping.tolist() == [9, 6, -1, -1]
    assert meta.context_lens.tolist() == [2, 3, 1, 1]
    assert meta.block_tables.shape == (4, 3)
    assert b.input_ids[:4].tolist() == [4, 5, 0, 0]
    # views of the one persistent buffer: the next fill updates them in place
    ptr = meta.slot_mapping.data_ptr()
    b.fill([9], [0], [[3]], 4, batch=1)
    assert b.metadata(1).slot_mapping.data_ptr() == ptr and meta.slot_mapping[0].item() == 12


def test_padding_rows_write_nothing_and_read_one_valid_slot(tiny_checkpoint):  # noqa: F811
    """The padded decode batch through the torch backend: real rows match an unpadded run, the cache
    outside the real rows' slots is untouched."""
    from pagedattn.kv_cache import KVCache
    from pagedattn.models.loader import load_model
    model, cfg = load_model(tiny_checkpoint, "cpu", torch.float32, "torch")
    bs = 4
    cache = KVCache(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, bs, cfg.head_dim, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for k, v in zip(cache.k_caches, cache.v_caches):
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    before = [k.clone() for k in cache.k_caches]
    b = DecodeBuffers(max_batch=8, max_blocks=4, device="cpu")
    tokens, positions, tables = [3, 7], [5, 9], [[2, 5], [8, 1, 4]]
    b.fill(tokens, positions, tables, bs, batch=8)
    padded = model.forward(b.input_ids[:8].long(), b.positions[:8].long(), cache, b.metadata(8))
    written = [k.clone() for k in cache.k_caches]
    for k, k0 in zip(cache.k_caches, before):
        k.copy_(k0)
    c = DecodeBuffers(max_batch=2, max_blocks=4, device="cpu")
    c.fill(tokens, positions, tables, bs, batch=2)
    plain = model.forward(c.input_ids.long(), c.positions.long(), cache, c.metadata(2))
    torch.testing.assert_close(padded[:2], plain, rtol=1e-4, atol=1e-5)   # matmul blocking differs by batch
    # real rows: pos 5 -> table[1]=5, offset 1; pos 9 -> table[2]=4, offset 1
    for k_pad, k0 in zip(written, before):
        changed = (k_pad != k0).any(-1).nonzero()    # (block, head, offset) rows that changed
        assert {(b, o) for b, _, o in changed.tolist()} == {(5, 1), (4, 1)}   # padding rows wrote nothing
    assert torch.isfinite(padded).all()


def test_runner_is_eager_on_cpu(tiny_checkpoint):  # noqa: F811
    from pagedattn import LLM, SamplingParams
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=32, block_size=4, max_num_seqs=4)
    assert not llm.engine.runner.use_graphs
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and llm.engine.runner.graph_decoder is None


from helpers import tiny_checkpoint  # noqa: E402,F401


# ---- GPU ----------------------------------------------------------------------------------------
def _random_real_checkpoint():
    from scripts.bench_throughput import write_random_checkpoint
    return write_random_checkpoint()


@pytest.mark.gpu
def test_graph_equals_eager_batch1_tokens():
    """One sequence (graph of size 1, no padding): greedy tokens with graphs == eager, 200 steps."""
    from pagedattn import LLM, SamplingParams
    ckpt = _random_real_checkpoint()
    prompt = np.random.default_rng(1).integers(0, 10000, 300).tolist()
    toks = {}
    for eager in (True, False):
        llm = LLM(ckpt, device="cuda", max_num_seqs=4, max_model_len=1024, num_blocks=256, enforce_eager=eager)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)
        toks[eager] = out[0].outputs[0].token_ids
        del llm
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
    from pagedattn import LLM, SamplingParams
    ckpt = _random_real_checkpoint()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, int(n)).tolist() for n in rng.integers(5, 300, 13)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(10, 60, 13)]
    llm = LLM(ckpt, device="cuda", max_num_seqs=16, max_model_len=512, num_blocks=512, block_size=16,
              max_num_batched_tokens=256)
    runner = llm.engine.runner
    graph_decode = runner._graph_decode
    stats = {"steps": 0, "sizes": set(), "worst": 0.0, "mismatch": 0, "near_ties": 0}

    def checked(sched_out):
        res = graph_decode(sched_out)
        if res is None:
            return None
        g_logits, seqs = res
        g_logits = g_logits.clone()
        step = runner.prepare(sched_out)            # eager, same inputs; rewrites the same slots
        h = runner.model.forward(step.input_ids, step.positions, runner.kv_cache, step.attn_metadata)
        e_logits = runner.model.compute_logits(h[step.logits_indices])
        diff = (g_logits - e_logits).abs().amax(-1)
        top2 = e_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        stats["steps"] += 1
        stats["sizes"].add(len(seqs))
        stats["worst"] = max(stats["worst"], float(diff.max()))
        stats["mismatch"] += int((g_logits.argmax(-1) != e_logits.argmax(-1))[clear].sum())
        stats["near_ties"] += int((~clear).sum())
        return g_logits, seqs

    runner._graph_decode = checked
    llm.generate(prompts, params, use_tqdm=False)
    print(stats)
    assert stats["steps"] > 20 and len(stats["sizes"]) > 3
    assert stats["mismatch"] == 0
    assert stats["worst"] < 1.0, "graph and eager logits differ by more than fp16 noise"
    assert runner.graph_decoder.graphs.keys() == {1, 2, 4, 8, 16}


@pytest.mark.gpu
def test_graph_replay_padding_writes_nowhere():
    """A padded replay changes the pool only at the real rows' slots."""
    from pagedattn import LLM, SamplingParams
    ckpt = _random_real_checkpoint()
    llm = LLM(ckpt, device="cuda", max_num_seqs=8, max_model_len=256, num_blocks=64, block_size=16)
    engine, runner = llm.engine, llm.engine.runner
    dec = runner.capture_graphs()
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       prompt_token_ids=[1, 2, 3, 4, 5])
    engine.step()                                    # prefill (eager)
    before = [k.clone() for k in engine.kv_cache.k_caches]
    seq = next(iter(engine.groups.values())).seqs[0]
    logits = dec.run([seq.token_ids[-1]], [seq.num_tokens - 1], [engine.block_manager.block_table(seq.seq_id)])
    torch.cuda.synchronize()
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()
    table = engine.block_manager.block_table(seq.seq_id)
    pos = seq.num_tokens - 1
    blk, off = table[pos // 16], pos % 16
    for k, k0 in zip(engine.kv_cache.k_caches, before):
        diff = (k != k0).nonzero()
        assert diff.numel() > 0
        assert set(diff[:, 0].tolist()) == {blk} and set(diff[:, 2].tolist()) == {off}
