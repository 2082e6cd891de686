"""Where an engine step's host time goes, with the model forward taken out (CPU only, no GPU needed).

The engine runs as usual (scheduler, block manager with prefix caching, step packing, output processing);
only the model is replaced: the runner does its host-side work for the step (the metadata
views, the host checks, AttentionMetadata over the packed array) and returns token 0 for every sampling
row. So what is timed is exactly what a GPU step adds on the host before and after its kernels. Phases,
per step (median of --reps steps, milliseconds):

    schedule     Scheduler.schedule(): admission, block allocation, prefix-cache lookups
    pack         build_step_inputs(): the StepInputs array
    runner       the model runner's host work on the packed step (no forward)
    update       Scheduler.update(): computed counters, prefix-cache commits of full blocks
    process      the tokens back: append, stop checks, RequestOutputs
    other        the rest of step(): sampling-row plan, metrics, fragmentation
    step         the whole engine.step()

Workloads: one prefill step of 8 x 1024 and of 64 x 128 fresh prompts (random ids, no cache hit), and a
pure-decode step of 256 sequences (128-token prompts).

    python scripts/profile_host.py                  # all three, table on stdout
    python scripts/profile_host.py --reps 50 --out prof_out
"""
import os
import contextlib
import random
import statistics
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

# The forward is never run: the smallest Qwen2 that loads (the engine reads only its vocabulary).
TINY = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
PHASES = ("schedule", "pack", "runner", "update", "process", "other", "step")


class _Done:
    """A StepResult whose tokens are ready: token 0, logprob 0 for every sampling row."""

    def __init__(self, n):
        self.n = n

    def wait(self):
        return np.zeros(self.n, np.int32), np.zeros(self.n, np.float32), None


class HostOnlyRunner:
    """Stands in for the engine's ModelRunner: its host-side work on the step, no forward."""

    def __init__(self, runner):
        self.runner, self.num_blocks = runner, runner.num_blocks

    def execute(self, step):
        from pagedattn.kv_cache import AttentionMetadata

        host = step.fields()
        slots, tables = host["slot_mapping"], host["block_tables"]          # the runner's host checks
        len(slots) and (int(slots.max()), int(slots.min()))
        tables.size and (int(tables.max()), int(tables.min()))
        bool((host["input_src"] >= 0).any())                      # the gather decision
        f = step.fields(torch.from_numpy(step.data))              # the views the forward reads
        AttentionMetadata(num_prefills=step.num_prefills, num_prefill_tokens=step.num_prefill_tokens,
                          num_decode_tokens=step.num_seqs - step.num_prefills, slot_mapping=f["slot_mapping"],
                          context_lens=f["context_lens"], block_tables=f["block_tables"],
                          cu_seqlens_q=f["cu_seqlens_q"], max_context_len=step.max_context_len)
        return _Done(step.num_samples)

    def close(self):
        self.runner.close()


class PhaseTimer:
    """Wraps callables so their time accumulates under a phase name for the current step."""

    def __init__(self):
        self.now = {}

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def phases(engine):
    """Inside the block, engine.step()'s phases accumulate in the yielded PhaseTimer's `now` (seconds):
    schedule, pack, runner (runner.execute: on a real runner, the host work *and* the forward's launches),
    update, process. The engine is restored on exit."""
    from pagedattn.engine import llm_engine

    timer = PhaseTimer()
    sched, ex = engine.scheduler, engine.runner
    saved = [(sched, "schedule"), (sched, "update"), (ex, "execute"), (engine, "_process")]
    originals = [(obj, name, obj.__dict__.get(name)) for obj, name in saved]
    build = llm_engine.build_step_inputs
    for (obj, name), phase in zip(saved, ("schedule", "update", "runner", "process")):
        setattr(obj, name, timer.wrap(phase, getattr(obj, name)))
    llm_engine.build_step_inputs = timer.wrap("pack", build)
    try:
        yield timer
    finally:
        llm_engine.build_step_inputs = build
        for obj, name, original in originals:
            if original is None:
                delattr(obj, name)                  # back to the class's method
            else:
                setattr(obj, name, original)


def make_engine(max_num_seqs, max_num_batched_tokens, num_blocks=16384, max_model_len=2048):
    """An LLMEngine on the tiny checkpoint, CPU, prefix caching on, with the HostOnlyRunner in place."""
    from pagedattn.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine

    ckpt = benchlib.random_checkpoint(TINY, dtype=torch.float32, device="cpu")
    cfg = EngineConfig(model=ckpt, device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, num_blocks=num_blocks,
                       max_model_len=max_model_len, async_scheduling=False)
    engine = LLMEngine(cfg)
    engine.runner = HostOnlyRunner(engine.runner)
    return engine


def timed_step(engine, timer):
    """One engine.step(): {phase: ms}."""
    timer.now = {}
    t0 = time.perf_counter()
    engine.step()
    total = time.perf_counter() - t0
    ms = {k: 1e3 * timer.now.get(k, 0.0) for k in PHASES[:-2]}
    ms["step"] = 1e3 * total
    ms["other"] = ms["step"] - sum(ms[k] for k in PHASES[:-2])
    return ms


def prefill_rows(num_seqs, prompt_len, reps, seed=0):
    """Per-phase ms of one step prefilling `num_seqs` fresh prompts of `prompt_len` tokens (median of reps)."""
    from pagedattn import SamplingParams

    engine = make_engine(max(num_seqs, 8), num_seqs * prompt_len)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    samples = []
    with phases(engine) as timer:
        for r in range(reps + 2):
            ids = [f"p{r}-{i}" for i in range(num_seqs)]
            for rid in ids:
                engine.add_request(rid, None, params,
                                   prompt_token_ids=[rng.randrange(10000) for _ in range(prompt_len)])
            ms = timed_step(engine, timer)
            assert engine.stats.num_computed_tokens >= num_seqs * prompt_len
            for rid in ids:
                engine.abort_request(rid)
            if r >= 2:                                            # the first steps warm caches
                samples.append(ms)
    engine.shutdown()
    return _median(samples)


def decode_rows(batch, prompt_len, reps, seed=0):
    """Per-phase ms of one pure-decode step of `batch` sequences (median of reps)."""
    from pagedattn import SamplingParams

    engine = make_engine(batch, max(2048, batch))
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=reps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", None, params, prompt_token_ids=[rng.randrange(10000) for _ in range(prompt_len)])
    while any(s.num_new_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    with phases(engine) as timer:
        samples = [timed_step(engine, timer) for _ in range(reps)]
    engine.shutdown()
    return _median(samples)


def _median(samples):
    return {k: statistics.median(s[k] for s in samples) for k in PHASES}


def main(reps=20, out=None):
    """Prints (and with out, saves) one row per workload: the median ms of every phase."""
    rows = []
    for name, fn in (("prefill 8 x 1024", lambda: prefill_rows(8, 1024, reps)),
                     ("prefill 64 x 128", lambda: prefill_rows(64, 128, reps)),
                     ("decode 256", lambda: decode_rows(256, 128, reps))):
        rows.append({"workload": name, **fn()})
        print(rows[-1], flush=True)
    md = benchlib.markdown_table(rows, ["workload", *PHASES], floatfmt="{:.2f}")
    if out:
        benchlib.save(out, "profile_host", rows, dict(reps=reps), md)
    print(benchlib.env_line() + "\n\n" + md)
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="steps measured per workload (median)")
    ap.add_argument("--out", default=None, help="folder for profile_host.{json,md}")
    a = ap.parse_args()
    main(a.reps, a.out)
