"""The engine on a tiny random Qwen2 (tests/helpers.py): greedy outputs equal HF transformers'
greedy generate under every scheduling condition, with no block leaked.

Conditions: all requests at once (unconstrained), staggered arrivals, chunked prefill with a tiny
token budget, prefix caching (a shared system prompt; the second run hits), preemption with a
pool at ~25% of what the workload needs. Plus seeded sampling, n > 1, stop tokens, aborts, metrics.
"""
import random

import pytest
import torch
from helpers import make_hf_tiny_model, tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn import LLM, SamplingParams
from pagedattn.errors import InvalidRequestError

MAX_TOKENS = 24
SYSTEM = [(7 * i + 3) % 120 + 3 for i in range(37)]         # a shared 37-token "system prompt"


def make_prompts():
    rng = random.Random(0)
    lengths = [1, 5, 15, 17, 33, 40]
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in lengths]
    prompts += [SYSTEM + [rng.randrange(3, 128) for _ in range(n)] for n in (1, 4, 9)]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def hf_greedy():
    """HF transformers' greedy continuation of every prompt (eager attention, float32)."""
    model = make_hf_tiny_model(seed=0)
    outs = []
    with torch.no_grad():
        for p in PROMPTS:
            seq = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
            outs.append(seq)
    return outs


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def assert_clean(llm):
    bm = llm.engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.total_blocks, "blocks leaked"
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_unconstrained_batch_matches_hf(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outs) == hf_greedy
    for o, p in zip(outs, PROMPTS):
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason == ("stop" if o.outputs[0].token_ids[-1] == 2 else "length")
    assert_clean(llm)


def test_lm_head_rows_padded_to_the_graph_ladder_match_hf(tiny_checkpoint, hf_greedy):
    """On CUDA an eager step's LM head runs on its sampling rows padded to the decode graphs' ladder (the
    last row repeated, the extra logits dropped); forced on here (the CPU runs unpadded): the same greedy
    tokens as HF, with 9 sampling rows at first (padded to 16) and fewer as requests end."""
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256)
    runner = llm.engine.runner
    runner.logit_rows = [1, 2, 4, 8, 16]
    calls = []
    lm_head = runner.model.compute_logits
    runner.model.compute_logits = lambda h, **kw: calls.append(h.shape[0]) or lm_head(h, **kw)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, greedy())
    outs = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            outs[o.request_id] = o
    assert [outs[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == hf_greedy
    assert calls and set(calls) <= {1, 2, 4, 8, 16}
    assert_clean(llm)


def test_staggered_arrivals_match_hf(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256, max_num_batched_tokens=64)
    engine, results = llm.engine, {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:                 # a new request every third step
            i, p = pending.pop(0)
            engine.add_request(i, p, greedy())
        for out in engine.step():
            results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(PROMPTS))] == hf_greedy
    assert_clean(llm)


def test_chunked_prefill_tiny_budget_matches_hf(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256, max_num_batched_tokens=7, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outs) == hf_greedy
    assert llm.metrics()["num_steps"] > MAX_TOKENS + sum(len(p) for p in PROMPTS) // 7 - 1
    assert_clean(llm)


def test_prefix_cache_second_run_hits(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256, block_size=8)
    system_prompts = PROMPTS[-3:]
    first = llm.generate(system_prompts[:1], greedy(), use_tqdm=False)
    m1 = llm.metrics()
    second = llm.generate(system_prompts, greedy(), use_tqdm=False)
    m2 = llm.metrics()
    assert ids(first) + ids(second) == hf_greedy[-3:-2] + hf_greedy[-3:]
    hits = m2["prefix_cache_hit_tokens"] - m1["prefix_cache_hit_tokens"]
    assert hits >= 3 * 32                               # 4 full blocks of the 37-token system prompt, each
    assert second[0].num_cached_tokens >= 32
    assert 0 < m2["prefix_cache_hit_rate"] < 1
    assert_clean(llm)


def test_prefix_caching_off_never_hits(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64, enable_prefix_caching=False)
    llm.generate(PROMPTS[-3:], greedy(4), use_tqdm=False)
    llm.generate(PROMPTS[-3:], greedy(4), use_tqdm=False)
    assert llm.metrics()["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_quarter_pool_preempts_and_matches_hf(tiny_checkpoint, hf_greedy, prefix_caching):
    block_size = 8
    need = sum(-(-(len(p) + MAX_TOKENS) // block_size) for p in PROMPTS)
    biggest = max(-(-(len(p) + MAX_TOKENS) // block_size) for p in PROMPTS)
    num_blocks = max(need // 4, biggest)
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=num_blocks, block_size=block_size,
              enable_prefix_caching=prefix_caching)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert ids(outs) == hf_greedy
    assert llm.metrics()["num_preemptions"] > 0
    assert_clean(llm)


def test_seeded_sampling_reproducible_regardless_of_batch(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256)
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], sp, use_tqdm=False)[0]
    others = SamplingParams(n=2, temperature=0.8, max_tokens=20, seed=None)
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[5]], [others, sp, greedy()], use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1   # the n samples are not copies
    assert_clean(llm)


def test_seeded_request_alone_equals_it_in_64_mixed_requests_under_preemption(tiny_checkpoint):
    """A seeded sampled request draws the same tokens alone on a roomy pool and as one of 64 mixed requests
    (greedy, seeded, unseeded, n > 1, top-k / top-p) on a pool so small that requests are preempted and
    recomputed: its random numbers depend on (seed, completion, output position) only."""
    target = SamplingParams(n=2, temperature=0.9, top_k=40, top_p=0.9, seed=77, max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[4]
    alone = LLM(tiny_checkpoint, device="cpu", num_blocks=256, block_size=8).generate([prompt], target,
                                                                                      use_tqdm=False)[0]
    rng = random.Random(5)
    kinds = [greedy(12), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_tokens=10),
             SamplingParams(n=3, temperature=1.2, top_k=5, max_tokens=8, ignore_eos=True)]
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(1, 40))] for _ in range(63)]
    params = [kinds[i % len(kinds)] for i in range(63)]
    prompts.insert(8, prompt)                # (at 8 it is among the newest running when the pool runs out)
    params.insert(8, target)
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=40, block_size=8, max_num_seqs=16, max_num_batched_tokens=64)
    mixed = llm.generate(prompts, params, use_tqdm=False)[8]
    assert mixed.metrics.num_preemptions > 0, "the seeded request was meant to be preempted and recomputed"
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    assert_clean(llm)


def test_parallel_sampling_shares_prompt_blocks_and_copies_on_write(tiny_checkpoint):
    # A 33-token prompt with block_size 8: 4 full blocks + 1 partial block shared by the 4 children.
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64, block_size=8, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("r", PROMPTS[4], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))
    engine.step()                                       # prefill once, fork the 4 completions
    bm = engine.block_manager
    tables = [bm.block_table(s.seq_id) for s in engine.groups["r"].seqs]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert bm.num_used_blocks == 5                      # not 4 x 5
    engine.step()                                       # first decode: 3 copies of the partial block
    tables = [bm.block_table(s.seq_id) for s in engine.groups["r"].seqs]
    assert all(t[:4] == tables[0][:4] for t in tables)  # full blocks still shared
    assert len({t[4] for t in tables}) == 4             # the partial block now private to each
    assert bm.num_used_blocks == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(llm)


def test_parallel_sampling_equals_separate_seeded_runs_greedy(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=128, block_size=8)
    out = llm.generate([PROMPTS[4]], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy[4]] * 3
    assert_clean(llm)


def test_stop_token_ids_and_max_tokens(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64)
    want = hf_greedy[1]
    stop = want[5]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[:want.index(stop) + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[1]], greedy(3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[:3] and out.finish_reason == "length"
    assert_clean(llm)


def test_abort_frees_everything(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64)
    engine = llm.engine
    engine.add_request("a", PROMPTS[5], SamplingParams(n=2, temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPTS[2], greedy(5))
    engine.step()
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["b"]
    assert_clean(llm)


def test_metrics_report_latency_and_usage(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64)
    outs = llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)
    m = llm.metrics()
    for key in ("kv_cache_usage", "kv_fragmentation", "mean_kv_fragmentation", "prefix_cache_hit_rate",
                "num_preemptions", "num_running", "num_waiting", "generation_throughput_tok_s",
                "mean_ttft_s", "mean_itl_s", "peak_kv_usage"):
        assert key in m
    assert m["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert 0 < m["peak_kv_usage"] <= 1 and 0 < m["mean_kv_fragmentation"] < 1
    r = outs[0].metrics
    assert r.ttft > 0 and r.mean_itl > 0 and r.num_prompt_tokens == len(PROMPTS[0])


def test_bad_request_rejected_while_others_run(tiny_checkpoint, hf_greedy):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64)
    engine = llm.engine
    engine.add_request(0, PROMPTS[2], greedy())
    engine.step()
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request(1, [5, 500], greedy())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[2]]
    assert_clean(llm)


def test_wrong_argument_types_name_the_argument(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64)
    cases = [((None,), "prompts"), ((3,), "prompts"), (([None],), "prompt must be"),
             (([[1, 2]], "greedy"), "sampling_params"), (([[1, 2]], [greedy(), greedy()]), "sampling_params")]
    for args, field in cases:
        with pytest.raises(InvalidRequestError, match=field):
            llm.generate(*args, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="params"):
        llm.beam_search([[1, 2]], greedy(), use_tqdm=False)
    assert_clean(llm)


@pytest.mark.parametrize("max_tokens", [6, 16])
def test_beam_search_matches_hf(tiny_checkpoint, max_tokens):
    from pagedattn import BeamSearchParams

    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=128, block_size=8)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=max_tokens), use_tqdm=False)
    model = make_hf_tiny_model(seed=0)
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, num_beams=4, do_sample=False,
                                 length_penalty=1.0, eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
        best = out.sequences[0]
        assert best.output_token_ids == ref[:len(best.output_token_ids)]
        assert len(out.sequences) == 4
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
        assert best.tokens == p + best.output_token_ids
    assert_clean(llm)


def test_beam_search_in_a_tight_pool_runs_prompts_in_groups(tiny_checkpoint):
    from pagedattn import BeamSearchParams

    params = BeamSearchParams(beam_width=4, max_tokens=8)
    roomy = LLM(tiny_checkpoint, device="cpu", num_blocks=128, block_size=8)
    tight = LLM(tiny_checkpoint, device="cpu", num_blocks=4 * 7, block_size=8)   # one 40+8-token prompt's 4 beams
    want = [o.sequences[0].output_token_ids for o in roomy.beam_search(PROMPTS, params, use_tqdm=False)]
    got = [o.sequences[0].output_token_ids for o in tight.beam_search(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert_clean(tight)
    with pytest.raises(InvalidRequestError, match="beam"):
        tight.beam_search([PROMPTS[5]], BeamSearchParams(beam_width=5, max_tokens=8), use_tqdm=False)


def test_max_num_seqs_holds_with_forks(tiny_checkpoint, hf_greedy):
    from pagedattn import BeamSearchParams

    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=256, block_size=8, max_num_seqs=4)
    sched = llm.engine.scheduler
    schedule, seen = sched.schedule, []

    def watched():
        out = schedule()
        seen.append((len(out.scheduled), len(sched.running)))
        return out

    sched.schedule = watched
    params = [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), greedy(), greedy(),
              SamplingParams(n=4, temperature=0.0, max_tokens=MAX_TOKENS)]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], params, use_tqdm=False)
    assert [c.token_ids for c in outs[3].outputs] == [hf_greedy[3]] * 4
    assert ids(outs[1:3]) == hf_greedy[1:3]
    llm.beam_search(PROMPTS[:3], BeamSearchParams(beam_width=2, max_tokens=4), use_tqdm=False)
    assert max(n for n, _ in seen) <= 4 and max(r for _, r in seen) <= 4
    with pytest.raises(InvalidRequestError, match="beam_width=5"):
        llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=5, max_tokens=4), use_tqdm=False)
    assert_clean(llm)


def test_beam_search_while_other_requests_run(tiny_checkpoint, hf_greedy):
    from pagedattn import BeamSearchParams

    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=128, block_size=8)
    bp = BeamSearchParams(beam_width=3, max_tokens=5)
    alone = [o.sequences[0].output_token_ids for o in llm.beam_search(PROMPTS[:2], bp, use_tqdm=False)]
    engine = llm.engine
    engine.add_request("short", PROMPTS[1], greedy(2))        # finishes during the beam search
    engine.add_request("long", PROMPTS[4], greedy())
    mixed = [o.sequences[0].output_token_ids for o in llm.beam_search(PROMPTS[:2], bp, use_tqdm=False)]
    assert mixed == alone
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    assert outs == {"short": hf_greedy[1][:2], "long": hf_greedy[4]}
    assert_clean(llm)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_sampler_reads_the_lm_heads_own_dtype(tiny_checkpoint, dtype):  # noqa: F811
    """The engine hands the sampler the LM head's fp16/bf16 logits (no float32 copy of [N, vocab] per step),
    and that is the same function: greedy and seeded-sampled tokens and their logprobs equal, bit for bit, a
    run whose logits are first converted to float32."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], list(range(20, 45))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=1.3, seed=5, max_tokens=12, ignore_eos=True, logprobs=True)]
    runs = {}
    for float32 in (False, True):
        llm = LLM(tiny_checkpoint, device="cpu", dtype=dtype, num_blocks=64, max_model_len=64)
        model, seen = llm.engine.runner.model, set()
        compute = model.compute_logits

        def logits(hidden, float32=True, _compute=compute, _force=float32):
            out = _compute(hidden, float32=float32 or _force)
            seen.add(out.dtype)
            return out

        model.compute_logits = logits
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[float32] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]
        assert seen == ({torch.float32} if float32 else {getattr(torch, dtype)})
        llm.close()
    assert runs[False] == runs[True]
