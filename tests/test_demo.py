"""The demo (pagedattn/demo.py): the stream printer on scripted outputs, and a short end-to-end run on the
bundled model whose output must show every answer in full, a prefix-cache hit in round 2 and blocks
saved by the n=3 completions."""
import io
import re
from types import SimpleNamespace

import torch

from helpers import bundled_model_dir  # noqa: F401 (session fixture)
from pagedattn import demo


def fake_output(prompt_index, completions, finished=False):
    """A RequestOutput-like object: completions = [(index, cumulative text, delta token count, finish)]."""
    return SimpleNamespace(prompt_index=prompt_index, finished=finished, outputs=[
        SimpleNamespace(index=i, text=text, delta_token_ids=[0] * n, finish_reason=fin)
        for i, text, n, fin in completions])


def test_stream_printer_shows_one_answer_at_a_time():
    """Answer 2 finishes first while answer 1 is on screen: its text waits, then appears whole in its turn;
    answer 1's tokens appear as they come; completion 1 of request 1 (n=2) streams live after both."""
    written = []
    items = [("first", 0, 0), ("second", 1, 0), ("third", 1, 1)]
    p = demo.StreamPrinter(items, written.append, live=False)
    steps = [
        fake_output(0, [(0, "Hel", 1, None)]),
        fake_output(1, [(0, "Done ", 1, None), (1, "x", 1, None)]),
        fake_output(1, [(0, "Done early.", 2, "stop"), (1, "xy", 1, None)]),
        fake_output(0, [(0, "Hello", 1, None)]),
        fake_output(0, [(0, "Hello world", 2, "length")], finished=True),
        fake_output(1, [(0, "Done early.", 0, "stop"), (1, "xyz", 1, "stop")], finished=True),
    ]
    screens = []
    for out in steps:
        p.update(out)
        screens.append("".join(written))
    assert "Done" not in screens[1], "a later answer was printed while the first was on screen"
    assert screens[0].endswith("Hel") and screens[3].endswith("Hello")
    assert screens[4].index("Hello world") < screens[4].index("[2/3] second") < screens[4].index("Done early.")
    assert screens[4].endswith("xy"), "the third answer's buffered text then waits for more"
    final = screens[-1]
    assert final.count("Hello world") == 1 and final.count("Done early.") == 1 and final.count("xyz") == 1
    assert "[length]" in final and final.count("[stop]") == 2
    assert p.tokens == 10


def test_stream_printer_live_status_is_erased():
    written = []
    p = demo.StreamPrinter([("only", 0, 0)], written.append, live=True)
    p.update(fake_output(0, [(0, "ab", 2, None)]))
    assert "2 tokens" in written[-1] and "0/1 answers done" in written[-1] and written[-1].startswith("\033[2m")
    p.update(fake_output(0, [(0, "abc", 1, None)]))
    assert "\033[K" in written, "the old status must be erased before new text"
    assert "3 tokens" in written[-1]


def test_demo_end_to_end(bundled_model_dir):
    """Both rounds with 8 tokens per answer on the real model, on the CPU backend. One torch thread: on a
    shared 2-core machine a descheduled OpenMP thread stalls every GEMM (see test_bundled_model)."""
    buf = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = demo.main(max_tokens=8, device="cpu", out=buf)
    finally:
        torch.set_num_threads(threads)
    text = buf.getvalue()
    round1, round2 = results
    assert len(round1) == len(demo.DEFAULT_PROMPTS) and len(round2) == 2
    # Every completion's final text is on screen, after its own header, in display order.
    at = 0
    for outs in results:
        for o in outs:
            for c in o.outputs:
                at = text.index(c.text, at)
    m1 = re.search(r"round 1: .* (\d+) of (\d+) prompt tokens", text)
    m2 = re.search(r"round 2: .* (\d+) of (\d+) prompt tokens \(([\d.]+)%\) from the prefix cache", text)
    assert m1 and int(m1.group(1)) == 0, "round 1 prefills every prompt in one step: no hits possible"
    assert m2 and int(m2.group(1)) > 0 and float(m2.group(3)) > 0, "round 2 must reuse the system prompt's blocks"
    assert sum(o.num_cached_tokens for o in round2) == int(m2.group(1))
    saved = re.search(r"n=3 completions of one prompt hold (\d+) block-table entries in (\d+) physical blocks", text)
    assert saved and int(saved.group(1)) > int(saved.group(2))
    assert len(round2[1].outputs) == demo.NAMING_N
    assert "(model loading and warm-up not counted)" in text
    # the weights' resident size is stated: the GGUF file's blocks by default on the CPU (~463 MiB)
    weights = re.search(r"weights: (\d+) MiB \(the GGUF file's quantized blocks, (int8|float32) activations\)", text)
    assert weights and 400 < int(weights.group(1)) < 500
    for column in ("prompt tok", "cached tok", "generated", "finish", "TTFT s"):
        assert column in text
