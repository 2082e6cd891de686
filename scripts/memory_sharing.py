"""KV blocks used with and without sharing, for parallel sampling (n = 2, 4, 8) and beam search (width 4).

With sharing, the n completions of a prompt (or the beams) point at the same physical blocks for
the prompt (and for the common part of beams' histories); only the partial last block is copied on
write. Without sharing, every sequence would hold its own copy of every block of its table. After
every engine step we record

    physical = blocks held by some sequence          (BlockManager.num_used_blocks)
    logical  = sum over live sequences of len(block table)   (= blocks without sharing)

and report the saving 1 - physical / logical at the step where `logical` peaks and averaged over
steps. Prefix caching is off, so the only sharing is the forks'.

The PagedAttention paper (Kwon et al., SOSP 2023, section 6.3) reports savings of 6.1-9.8% for
parallel sampling and 37.6-55.2% for beam search on the Alpaca trace (16.2-30.5% and 44.3-66.3% on
ShareGPT), with OPT-13B and much longer outputs than here; the saving grows with the prompt's share
of each sequence's tokens.

    python scripts/memory_sharing.py                       # bundled model, CPU, ~3-6 min on 2 cores
    python scripts/memory_sharing.py --max-tokens 16 --out OUT     # also OUT/memory_sharing.{json,md}
"""
import os
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import benchlib  # noqa: E402

QUESTIONS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain the difference between a process and a thread, with an example.",
    "Write a C function that counts the set bits of an unsigned integer.",
    "What does the SQL GROUP BY clause do? Show a short query that uses it.",
]
PAPER = {"parallel": "6.1-9.8% (Alpaca), 16.2-30.5% (ShareGPT)", "beam": "37.6-55.2% (Alpaca), 44.3-66.3% (ShareGPT)"}


class BlockMeter:
    """Wraps engine.step to sample physical vs logical block counts after every step."""

    def __init__(self, engine):
        self.engine, self.samples = engine, []
        self._step = engine.step
        engine.step = self.step

    def step(self):
        out = self._step()
        bm = self.engine.block_manager
        logical = sum(len(table) for table in bm.sequence_blocks.values())     # every sequence's own copy
        if logical:
            self.samples.append((bm.num_used_blocks, logical))
        return out

    def result(self):
        physical, logical = max(self.samples, key=lambda s: s[1])
        mean = sum(1 - p / q for p, q in self.samples) / len(self.samples)
        return dict(peak_physical_blocks=physical, peak_logical_blocks=logical,
                    saving_at_peak=1 - physical / logical, mean_saving=mean, steps=len(self.samples))

    def close(self):
        self.engine.step = self._step


def measure(llm, run, kind, width):
    """One workload under a BlockMeter: its row (block counts, savings, seconds)."""
    meter = BlockMeter(llm.engine)
    watch = benchlib.Stopwatch()
    try:
        run()
    finally:
        meter.close()
    return dict(kind=kind, width=width, seconds=watch.elapsed(), **meter.result())


def main(model=None, device="cpu", max_tokens=32, widths=(2, 4, 8), beam_width=4, out=None, prompts=None):
    """Every parallel-sampling width and beam search on the same prompts; prints the table, writes
    <out>/memory_sharing.{json,md} when out is given. prompts: token-id lists (default: the chat
    template applied to QUESTIONS). Returns the rows."""
    from pagedattn import LLM, BeamSearchParams, SamplingParams

    llm = LLM(model, device=device, enable_prefix_caching=False, max_model_len=1024, max_num_seqs=64)
    if prompts is None:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True)) for q in QUESTIONS]
    n_prompt = sum(map(len, prompts)) / len(prompts)
    rows = []
    for n in widths:
        params = SamplingParams(n=n, temperature=0.8, top_p=0.95, seed=0, max_tokens=max_tokens)
        rows.append(measure(llm, lambda: llm.generate(prompts, params, use_tqdm=False), "parallel sampling", n))
    beam = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens)
    rows.append(measure(llm, lambda: llm.beam_search(prompts, beam, use_tqdm=False), "beam search", beam_width))
    for r in rows:
        r["paper"] = PAPER["beam" if r["kind"] == "beam search" else "parallel"]
    md = (f"{len(prompts)} prompts, mean {n_prompt:.0f} tokens; up to {max_tokens} new tokens; block_size "
          f"{llm.metrics()['block_size']}. Blocks: physical (shared) and logical (every sequence's own copy) at "
          "the step where logical peaks; saving = 1 - physical / logical.\n\n" + benchlib.markdown_table(
              rows, ["kind", "width", "peak_physical_blocks", "peak_logical_blocks", "saving_at_peak", "mean_saving",
                     "steps", "seconds", "paper"],
              floatfmt={"saving_at_peak": "{:.1%}", "mean_saving": "{:.1%}", "seconds": "{:.1f}"}))
    print(md)
    if out:
        benchlib.save(out, "memory_sharing", rows, dict(max_tokens=max_tokens, mean_prompt_tokens=n_prompt,
                                                         paper=PAPER), md)
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF Qwen2 directory (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write memory_sharing.json / .md here")
    a = ap.parse_args()
    main(a.model, a.device, a.max_tokens, beam_width=a.beam_width, out=a.out)
