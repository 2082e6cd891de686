"""A heterogeneous batch gives each sequence the same result as running it alone.

Prompts of lengths 1..40 (some sharing a prefix), run (a) one at a time in a fresh engine and
(b) all together with staggered arrivals, a small token budget (prefill chunks share steps with
decodes) and prefix caching. Every logits row a sequence produces must match its solo run within
float32 noise (1e-4 absolute on logits of magnitude ~10), and the greedy ids must be identical.
"""
import random

from helpers import tiny_checkpoint  # noqa: F401

from pagedattn import LLM, SamplingParams

rng = random.Random(1)
PREFIX = [rng.randrange(3, 128) for _ in range(20)]
PROMPTS = [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 2, 7, 16, 17, 40)]
PROMPTS += [PREFIX + [rng.randrange(3, 128) for _ in range(n)] for n in (1, 5)]
MAX_TOKENS = 12


def record_logits(llm):
    """{(request_id, tokens known when sampled): logits row} for every sampled row."""
    rows, last = {}, []
    engine, model = llm.engine, llm.engine.runner.model
    compute, launch = model.compute_logits, engine._launch

    def compute_logits(hidden, **kw):
        last.append(compute(hidden, **kw))
        return last[-1]

    def launched():
        last.clear()
        out = launch()
        if out is not None and last:
            plan, _ = out
            for i, r in enumerate(plan.sample_rows):
                rows[(r.seq.request_id, r.seq.num_tokens)] = last[0][i].clone()
        return out

    model.compute_logits, engine._launch = compute_logits, launched
    return rows


def test_batch_equals_each_sequence_alone(tiny_checkpoint):  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo_ids, solo_rows = [], {}
    for i, p in enumerate(PROMPTS):
        llm = LLM(tiny_checkpoint, device="cpu", num_blocks=32, block_size=8)
        rows = record_logits(llm)
        llm.engine.add_request(i, p, params)
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                solo_ids.append(out.outputs[0].token_ids)
        solo_rows.update(rows)

    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=64, block_size=8, max_num_batched_tokens=24)
    rows = record_logits(llm)
    engine, results, pending, step = llm.engine, {}, list(enumerate(PROMPTS)), 0
    schedule, steps = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(i, p, params)
        for o in engine.step():
            results[o.request_id] = o.outputs[0].token_ids
        step += 1
    assert any(0 < s.num_prefills < len(s.scheduled) for s in steps), "no step mixed prefills and decodes"
    assert [results[i] for i in range(len(PROMPTS))] == solo_ids
    assert rows.keys() == solo_rows.keys()
    worst = max(float((rows[k] - solo_rows[k]).abs().max()) for k in rows)
    assert worst < 1e-4, f"batched logits differ from solo by {worst:.2e}"
    assert llm.metrics()["prefix_cache_hit_tokens"] > 0
    assert llm.engine.block_manager.num_free_blocks == 64
