"""A synthetic device for measuring the serving stack: the real engine (scheduler, block manager, output
processing) with its model runner replaced by one that takes a fixed time per step and samples random tokens.

    llm = LLM(tiny_checkpoint, device="cpu", ...)
    install_fake_runner(llm, step_ms=2.0)          # every step now "runs" 2 ms, whatever its size
    install_fake_runner(llm, 2.0, prefill_ms=40)   # ... and a step with a prompt chunk 40 ms more

What it stands for: a GPU that runs each launched step in `step_ms` (one step after another, like a
stream) while the host is free, and hands back one token per sampling row. The host's own work (building
the step, processing its tokens, and everything the server does around it) costs what it costs, so a
served / offline ratio measured on it is the serving stack's overhead at that step period. The tokens
are uniform over the vocabulary without the end-of-sequence ids (so requests run to max_tokens), with
log-probability -1; beam search is not supported. prefill_ms stands for what a step holding a prompt
chunk costs beyond a decode step on a GPU (there such a step runs eagerly, launch by launch, while a
pure-decode step replays a CUDA graph): it makes the admission policy of the engine core measurable.

A served engine core gets it through ServeConfig's engine hook, which calls install_fake_runner on the
core's LLM before it serves (the core process imports this file as `scripts.fake_engine`: start the
server from the repository's root, or with it on PYTHONPATH):

    python -m pagedattn serve --model DIR --device cpu \
        --engine-hook scripts.fake_engine:install_fake_runner --engine-hook-arg step_ms=2
    python scripts/bench_serving.py --model DIR --device cpu --fake-step-ms 2 --out OUT    # (passes the hook)
"""
import time

import numpy as np

now = time.perf_counter


class _FakeResult:
    """What StepResult.wait() gives, once the step's time has passed."""

    def __init__(self, tokens, logprobs, ready_at):
        self.tokens, self.logprobs, self.ready_at = tokens, logprobs, ready_at

    def wait(self):
        delay = self.ready_at - now()
        if delay > 0:
            time.sleep(delay)
        return self.tokens, self.logprobs, None


class FakeRunner:
    """Stands in for the engine's ModelRunner. inner: the real runner (its model config and pool size are
    kept). step_ms: device time per step. vocab_size: sampled ids are in [0, vocab_size) minus `exclude`."""

    world_size = 1

    def __init__(self, inner, step_ms, vocab_size, exclude=(), seed=0, prefill_ms=0.0):
        if not step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {step_ms!r}")
        if not prefill_ms >= 0:
            raise ValueError(f"prefill_ms must be >= 0, got {prefill_ms!r}")
        self.prefill_s = prefill_ms / 1000.0
        self.inner, self.model_config, self.num_blocks = inner, inner.model_config, inner.num_blocks
        self.step_s = step_ms / 1000.0
        self.allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int32), np.asarray(list(exclude), np.int32))
        self.rng = np.random.default_rng(seed)
        self.device_free_at = 0.0       # the previous launched step's end (steps run one after another)

    @property
    def model(self):
        return self.inner.model

    @property
    def kv_cache(self):
        return self.inner.kv_cache

    def execute(self, step):
        if step.num_beams:
            raise NotImplementedError("the fake executor does not do beam search")
        n = step.num_samples
        ready = max(now(), self.device_free_at) + self.step_s + (self.prefill_s if step.num_prefills else 0.0)
        self.device_free_at = ready
        tokens = self.allowed[self.rng.integers(0, len(self.allowed), n)]
        return _FakeResult(tokens, np.full(n, -1.0, np.float32), ready)

    def close(self):
        self.inner.close()


def install_fake_runner(llm, step_ms, seed=0, prefill_ms=0.0):
    """Replace `llm`'s model runner (an LLM built on the CPU, normally a tiny checkpoint) by a FakeRunner."""
    engine = llm.engine
    engine.runner = FakeRunner(engine.runner, step_ms, engine.vocab_size, engine.eos_token_ids, seed,
                               prefill_ms=prefill_ms or 0.0)
    return llm


HOOK = "scripts.fake_engine:install_fake_runner"


def serve_flags(step_ms, prefill_ms=None):
    """`python -m pagedattn serve`'s arguments that put every engine core on the synthetic device."""
    flags = ["--engine-hook", HOOK, "--engine-hook-arg", f"step_ms={step_ms}"]
    return flags + (["--engine-hook-arg", f"prefill_ms={prefill_ms}"] if prefill_ms else [])
