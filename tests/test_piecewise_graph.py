"""pagedattn.engine.piecewise_graph: the forward cut into pieces between attentions.

On the CPU the pieces run as plain calls (graphs=False) on the same padded buffers the graphs use: every step
of an engine run (prefills, chunked prompts, prompt chunks beside decoding sequences) gives the same hidden
states through the pieces as through the model's forward, and the engine's tokens are the same. On a GPU
(marker `gpu`) the captured pieces replay the same steps.
"""
import pytest
import torch

from helpers import write_tiny_checkpoint
from pagedattn import LLM, SamplingParams
from pagedattn.engine.piecewise_graph import PiecewiseGraphs, token_ladder


def test_token_ladder():
    assert token_ladder(100) == [16, 32, 64, 100]
    assert token_ladder(64) == [16, 32, 64]
    assert token_ladder(8) == [8]
    with pytest.raises(ValueError):
        token_ladder(0)


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 90, (n,), generator=g)]


def _compare_steps(llm, piecewise):
    """Wrap the runner's run_step: every eager step runs through the pieces first, then through the model's
    forward (whose sampled tokens the engine keeps); returns the list of (rows, padded rows, max |diff|,
    max |hidden|, kinds) per step."""
    runner = llm.engine.runner
    run_step, seen = runner.run_step, []

    def both(step, dev, max_context_len=None, gather=True, piecewise_arg=None, **kw):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return run_step(step, dev, max_context_len, gather)          # a decode graph's capture
        # the step reads in-flight ids from the sampled-token buffer and samples into it: both runs must read
        # the previous step's tokens
        saved = runner.sampled_tokens.clone()
        hp, _ = run_step(step, dev, max_context_len, gather, piecewise=piecewise)
        hp = hp.clone()
        runner.sampled_tokens.copy_(saved)
        he, logits = run_step(step, dev, max_context_len, gather)
        kind = ("prefill" if step.num_prefills else "") + ("+decode" if step.num_seqs > step.num_prefills else "")
        seen.append((step.num_tokens, piecewise.padded(step.num_tokens), float((hp - he).abs().max()),
                     float(he.abs().max()), kind))
        return he, logits

    runner.run_step = both
    return seen


def test_pieces_equal_the_forward_on_every_step(tmp_path):
    """float32 on the CPU, prompts of 3-90 tokens in a 64-token budget (chunked prompts, prompt chunks beside
    decodes, padded sizes 16-64): the pieces' hidden states equal the forward's to float32 rounding (the GEMMs
    see the padded row count; a row's dot products are the same, the BLAS blocking may round differently),
    and the greedy tokens are those of an engine without the pieces."""
    ckpt = write_tiny_checkpoint(tmp_path / "m", max_position_embeddings=512)
    kwargs = dict(device="cpu", max_model_len=256, max_num_seqs=6, max_num_batched_tokens=64, num_blocks=64)
    prompts = _prompts(10, 128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(ckpt, **kwargs).generate(prompts, params, use_tqdm=False)]

    llm = LLM(ckpt, **kwargs)
    pieces = PiecewiseGraphs(llm.engine.model, llm.engine.kv_cache, 64, graphs=False)
    seen = _compare_steps(llm, pieces)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == plain
    kinds = {k for *_, k in seen}
    assert {"prefill", "prefill+decode", "+decode"} <= kinds, kinds
    assert {p for _, p, *_ in seen} >= {16, 64}
    for rows, padded, diff, scale, kind in seen:
        assert diff <= 1e-5 * scale, (rows, padded, diff, scale, kind)
    assert set(pieces.buckets) <= set(pieces.sizes)


@pytest.mark.gpu
def test_captured_pieces_replay_the_forward(tmp_path):
    """fp16 on the GPU, piecewise graphs on: every eager step's hidden states from the replayed pieces are
    within fp16 rounding of the eager forward's (the GEMMs run over the padded rows: cuBLAS may choose other
    kernels), padding rows never write the pool (the eager forward after them agrees), and an engine with
    the graphs gives the same greedy tokens as one without on most requests (near-ties may flip)."""
    ckpt = write_tiny_checkpoint(tmp_path / "m", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=1024)
    kwargs = dict(device="cuda", dtype="float16", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
    prompts = _prompts(16, 128, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(ckpt, piecewise_graphs=False, **kwargs) as eager:
        assert eager.engine.runner.piecewise is None
        plain = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = LLM(ckpt, warmup=False, **kwargs)                  # on by default on CUDA
    runner = llm.engine.runner
    seen = _compare_steps(llm, runner.piecewise)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert seen and runner.piecewise.buckets and all(b.graphs for b in runner.piecewise.buckets.values())
    for rows, padded, diff, scale, kind in seen:
        assert diff <= 2e-2 * scale, (rows, padded, diff, scale, kind)   # fp16: ~1e-3 relative per op
    assert tokens == plain                                   # run_step keeps the eager forward's tokens

    fresh = LLM(ckpt, **kwargs)              # tokens from the replayed pieces themselves; the warm-up captured
    ladder = fresh.engine.runner.piecewise   # every padded size, so no step captures
    assert ladder is not None and sorted(ladder.buckets) == ladder.sizes == [16, 32, 64, 128, 256]
    replayed = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(replayed, plain))
    assert same >= len(prompts) - 2, same


def test_captures_run_without_the_cyclic_collector():
    """A dead graph freed by the collector inside a capture would invalidate it: no_collection collects
    first, keeps the collector off inside (nested too) and restores it after."""
    import gc

    from pagedattn.engine.cuda_graph import no_collection

    class Cycle:
        def __init__(self):
            self.me = self

    freed = []
    c = Cycle()
    import weakref
    weakref.finalize(c, freed.append, 1)
    del c
    assert gc.isenabled()
    with no_collection():
        assert freed == [1] and not gc.isenabled()
        inner = Cycle()                     # garbage made inside: a nested block does not collect it
        weakref.finalize(inner, freed.append, 2)
        del inner
        with no_collection():
            assert not gc.isenabled() and freed == [1]
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.collect()
    assert freed == [1, 2]
