"""The batch-invariant mode on the GPU (tests marked `gpu`; docs/batch_invariance.md): random weights of the
real Qwen2-0.5B config in fp16 and bf16, the 12 requests of tests/test_batch_invariance.py (greedy, seeded
top-p, seeded n=2 top-k, logprobs) alone, batched, with prefix hits, at a 16-token budget, in a 30-block pool
that preempts and eagerly against the CUDA graphs: the same token ids and logprobs, bit for bit (bf16 with 64-key
attention parts: every request's context over a part boundary); with the mode off some differ."""
import pytest

from test_batch_invariance import PROMPTS, _comparisons

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt():
    from scripts.benchlib import random_checkpoint
    return random_checkpoint("0.5b")


@pytest.mark.parametrize("dtype, part_keys", [("float16", 256), ("bfloat16", 64)])
def test_tokens_and_logprobs_do_not_depend_on_the_batch(ckpt, dtype, part_keys, monkeypatch):
    """part_keys: the mode's attention parts (256 as shipped; 64 puts these short requests, up to ~80 tokens of
    context, across a part boundary, so that the merge of two parts meets every comparison too)."""
    from pagedattn.layers.attention import NumbaBackend

    monkeypatch.setattr(NumbaBackend, "INVARIANT_PART_KEYS", part_keys)
    runs = _comparisons(ckpt, True, device="cuda", dtype=dtype, max_model_len=512)
    for name, outs in runs.items():
        same = sum(o == b for o, b in zip(outs, runs["batched"]))
        assert same == len(PROMPTS), f"{name}: {same}/{len(PROMPTS)} requests identical to the batched run"
    default = _comparisons(ckpt, False, device="cuda", dtype=dtype, max_model_len=512)
    assert any(outs != default["batched"] for outs in default.values()), "the default was meant to differ"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_prompt_row_is_its_decode_at_any_chunk_start(dtype, head_dim):
    """The mode's attention on the GPU (Qwen2-0.5B's 14 / 2 heads: 18-query tiles that cross the 64-key KV
    tiles, 32-key at head_dim 128): every query of a 300-token prompt gets the same bits in the whole prompt,
    in chunks starting at other offsets (a token budget, a prefix-cache hit) and as a one-query decode. The
    softmax's rescale factor must be exactly 1 across a tile masked whole for a row (not ex2 of an FMA's
    rounding); past position 256 a row's keys are in two of the mode's parts, whose log2-sum-exp must not
    depend on the row's place in its CTA (an FMA did: the chunk at 250 differed)."""
    import torch

    from pagedattn.layers.attention import NumbaBackend

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    H, Hkv, BS, L = 14, 2, 16, 300
    nb = -(-L // BS) + 4
    k_cache = torch.randn(nb, Hkv, BS, head_dim, generator=g, device="cuda").to(dt)
    v_cache = torch.randn(nb, Hkv, BS, head_dim, generator=g, device="cuda").to(dt)
    table = torch.randperm(nb, generator=g, device="cuda")[:-(-L // BS)].int()[None]
    q = torch.randn(L, H, head_dim, generator=g, device="cuda").to(dt)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")        # noqa: E731
    mode, scale = NumbaBackend(validate=False, batch_invariant=True), head_dim ** -0.5
    whole = torch.empty_like(q)
    mode.prefill(q, k_cache, v_cache, table, i32([0, L]), i32([L]), scale, whole)
    for start in (1, 37, 64, 100, 250):                 # a chunk [start, L) behind its cached prefix
        chunk = torch.empty(L - start, H, head_dim, dtype=dt, device="cuda")
        mode.prefill(q[start:].contiguous(), k_cache, v_cache, table, i32([0, L - start]), i32([L]), scale, chunk)
        assert torch.equal(chunk, whole[start:]), start
    dec = torch.empty_like(q)                            # every position as a decode, all in one call
    mode.decode(q, k_cache, v_cache, table.expand(L, -1).contiguous(), torch.arange(1, L + 1, dtype=torch.int32,
                device="cuda"), scale, dec)
    assert torch.equal(dec, whole)
