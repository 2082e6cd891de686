"""The batch-invariant mode on the GPU (tests marked `gpu`; docs/batch_invariance.md): random weights of the
real Qwen2-0.5B config in fp16 and bf16, the 12 requests of tests/test_batch_invariance.py (greedy, seeded
top-p, seeded n=2 top-k, logprobs) alone, batched, with prefix hits, at a 16-token budget, in a 30-block pool
that preempts and eagerly against the CUDA graphs: the same token ids and logprobs, bit for bit; with the mode
off some differ."""
import pytest

from test_batch_invariance import PROMPTS, _comparisons

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt():
    from scripts.benchlib import random_checkpoint
    return random_checkpoint("0.5b")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tokens_and_logprobs_do_not_depend_on_the_batch(ckpt, dtype):
    runs = _comparisons(ckpt, True, device="cuda", dtype=dtype, max_model_len=512)
    for name, outs in runs.items():
        same = sum(o == b for o, b in zip(outs, runs["batched"]))
        assert same == len(PROMPTS), f"{name}: {same}/{len(PROMPTS)} requests identical to the batched run"
    default = _comparisons(ckpt, False, device="cuda", dtype=dtype, max_model_len=512)
    assert any(outs != default["batched"] for outs in default.values()), "the default was meant to differ"
