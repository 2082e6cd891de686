"""The overlapped engine (async scheduling) against the serial one, streaming, and the detokenizer.

Async scheduling launches step N+1 before step N's tokens reach the host; its sequences read in-flight
ids on the device. Forced on here on the CPU (the pipeline is the same code; only the overlap is not), it
must give exactly the serial engine's tokens and finish reasons — greedy and seeded sampling, with
preemption (a pool far too small), prefix caching, chunked prefill, n > 1, stop tokens and stop strings,
aborts, beam search beside it — and leave no block behind.

Streaming: every streamed request's deltas concatenate to its final token ids and text (so no character
split over tokens is ever emitted in pieces: a piece would decode differently from the whole); a stop
string never appears in any delta.
"""
import random

import pytest
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)
from serving_helpers import write_tiny_chat_checkpoint

from pagedattn import LLM, BeamSearchParams, SamplingParams
from pagedattn.engine.detokenizer import IncrementalDetokenizer

SYSTEM = [(7 * i + 3) % 120 + 3 for i in range(37)]


def prompts(n=10, seed=0):
    rng = random.Random(seed)
    out = [[rng.randrange(3, 128) for _ in range(rng.randrange(1, 60))] for _ in range(n)]
    return out + [SYSTEM + [rng.randrange(3, 128) for _ in range(k)] for k in (1, 4, 9)]


def mixed_params(n):
    kinds = [SamplingParams(temperature=0, max_tokens=20),
             SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=17, ignore_eos=True),
             SamplingParams(n=3, temperature=1.0, top_k=20, seed=5, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0.7, max_tokens=13, stop_token_ids=[17, 40, 99]),
             SamplingParams(temperature=0, max_tokens=1)]
    return [kinds[i % len(kinds)] for i in range(n)]


def run(ckpt, async_scheduling, **kw):
    args = dict(device="cpu", block_size=8, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=8)
    llm = LLM(ckpt, async_scheduling=async_scheduling, **{**args, **kw})
    ps = prompts()
    outs = llm.generate(ps, mixed_params(len(ps)), use_tqdm=False)
    m = llm.metrics()
    bm = llm.engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.total_blocks and not llm.engine.has_unfinished_requests()
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], m


@pytest.mark.parametrize("caching", [pytest.param(True, marks=pytest.mark.slow), False])      # True: 26 s
def test_async_equals_serial_under_preemption(tiny_checkpoint, caching):  # noqa: F811
    serial, ms = run(tiny_checkpoint, False, enable_prefix_caching=caching)
    overlapped, mo = run(tiny_checkpoint, True, enable_prefix_caching=caching)
    assert ms["num_preemptions"] > 0, "the pool was meant to be too small"
    assert overlapped == serial


def test_async_equals_serial_with_room(tiny_checkpoint):  # noqa: F811
    serial, _ = run(tiny_checkpoint, False, num_blocks=400, max_num_seqs=32)
    overlapped, m = run(tiny_checkpoint, True, num_blocks=400, max_num_seqs=32)
    assert overlapped == serial and m["num_preemptions"] == 0


def test_async_with_aborts_and_beams(tiny_checkpoint):  # noqa: F811
    llm = LLM(tiny_checkpoint, device="cpu", block_size=8, num_blocks=200, async_scheduling=True)
    engine = llm.engine
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("y", [8, 9], SamplingParams(temperature=0.5, seed=1, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pending is not None                  # a step is in flight
    assert engine.abort_request("x")                   # its in-flight token is dropped, its blocks freed
    bp = BeamSearchParams(beam_width=3, max_tokens=5)
    beams = llm.beam_search([[5, 6, 7]], bp, use_tqdm=False)           # the engine drains, then runs serially
    alone = LLM(tiny_checkpoint, device="cpu", block_size=8, num_blocks=200).beam_search([[5, 6, 7]], bp,
                                                                                          use_tqdm=False)
    assert [s.output_token_ids for s in beams[0].sequences] == [s.output_token_ids for s in alone[0].sequences]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    assert set(outs) == {"y"} and len(outs["y"].token_ids) == 30
    assert engine.block_manager.num_free_blocks == engine.block_manager.total_blocks


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


def test_stop_strings_async_equals_serial(chat_checkpoint):
    tok = LLM(chat_checkpoint, device="cpu").get_tokenizer()
    texts = ["def fib(n):", "The paged KV cache", "Café crème", "SELECT name"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, stop=["e", "ca", " ("]) for i in range(4)]
    res = {}
    for mode in (False, True):
        llm = LLM(chat_checkpoint, device="cpu", num_blocks=64, block_size=8, async_scheduling=mode)
        outs = llm.generate(texts, params, use_tqdm=False)
        res[mode] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    assert res[True] == res[False]
    for text, ids, reason in res[False]:
        assert not any(s in text for s in ("e", "ca", " (")), text
        assert text == tok.decode(ids, skip_special_tokens=True).split("e")[0].split("ca")[0].split(" (")[0] \
            or reason == "stop"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stream_deltas_add_up(chat_checkpoint, async_scheduling):
    llm = LLM(chat_checkpoint, device="cpu", num_blocks=64, block_size=8, async_scheduling=async_scheduling)
    texts = ["Café crème, naïve", "emoji 🙂", "for i in range(10):", "中文"]
    params = [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=48, stop=["🚀", "\n\n"]) for i in range(3)]
    params.append(SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=30))
    final = {(o.request_id, c.index): c for o in llm.generate(texts, params, use_tqdm=False) for c in o.outputs}
    text, ids, last = {}, {}, {}
    for out in llm.stream(texts, params):
        for c in out.outputs:
            key = (out.prompt_index, c.index)
            assert "🚀" not in c.delta_text
            text[key] = text.get(key, "") + c.delta_text
            ids[key] = ids.get(key, []) + c.delta_token_ids
            last[key] = c
    assert len(last) == 5
    for (i, j), c in last.items():
        ref = final[(f"gen-{i}", j)]
        assert c.finished and c.text == text[(i, j)] == ref.text and c.token_ids == ids[(i, j)] == ref.token_ids


def test_detokenizer_holds_back_stop_prefixes(chat_checkpoint):
    tok = LLM(chat_checkpoint, device="cpu").get_tokenizer()
    ids = tok.encode("abc stop here, then more", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["stop here"])
    released = []
    for t in ids:
        if d.add(t):
            break
        released.append(d.releasable)
        assert "stop" not in d.releasable
    assert d.stopped and d.finish() == "abc " and all(r.startswith(prev) for prev, r in zip(released, released[1:]))


def test_detokenizer_matches_decode_on_random_ids(chat_checkpoint):
    """Random ids split multi-byte characters anywhere: the streamed text is always a prefix of the
    full decode, and finish() is the full decode."""
    tok = LLM(chat_checkpoint, device="cpu").get_tokenizer()
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        d = IncrementalDetokenizer(tok)
        for t in ids:
            d.add(t)
            assert tok.decode(d.token_ids, skip_special_tokens=True).startswith(d.releasable)
        assert d.finish() == tok.decode(ids, skip_special_tokens=True)
