"""reference/step.py, the float64 decode step: first against HF transformers' Qwen2 in float64 (the reference
run token by token from an empty pool is HF's forward over the whole sequence), then the paged model's float32
decode step against it."""
import numpy as np
import torch

from helpers import PagedRunner, make_hf_tiny_model, tiny_checkpoint  # noqa: F401 (session fixture)
from reference.step import decode_step, load_config, load_weights

# HF's Qwen2 computes RMSNorm (and the rotary angles) in float32 whatever the model's dtype, so its float64
# model's logits carry float32 rounding: measured max |diff| 8.1e-7 over these steps (logits up to 3.2). 1e-5
# keeps 12x room and still sees a real difference: a position off by one moves the logits by 0.6.
HF_ATOL = 1e-5
# the paged float32 step against float64: measured max |diff| 9.7e-7 (logits up to 3.0; float32 rounding
# through two layers of width 96 and a 128-way head); 1e-4 keeps 100x room, far below a real difference.
F32_ATOL = 1e-4


def _pools(config, num_blocks, block_size):
    shape = (num_blocks, config["num_kv_heads"], block_size, config["head_dim"])
    return [np.zeros(shape) for _ in range(config["num_layers"])], [np.zeros(shape) for _ in range(config["num_layers"])]


def test_token_by_token_equals_hf_float64(tiny_checkpoint):  # noqa: F811
    """Three sequences of different lengths decoded one token a step from an empty pool (scattered blocks):
    every step's logits equal HF's float64 forward over the sequence so far."""
    weights, config = load_weights(tiny_checkpoint), load_config(tiny_checkpoint)
    hf = make_hf_tiny_model().double()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 128, n).tolist() for n in (5, 19, 11)]
    block_size, num_blocks = 4, 32
    tables = rng.permutation(num_blocks)[:3 * 6].reshape(3, 6)                  # 6 blocks of 4 per sequence
    k_pools, v_pools = _pools(config, num_blocks, block_size)
    with torch.no_grad():
        for pos in range(max(len(s) for s in seqs)):
            live = [i for i, s in enumerate(seqs) if pos < len(s)]
            logits, k_pools, v_pools = decode_step(weights, config, [seqs[i][pos] for i in live], [pos] * len(live),
                                                   k_pools, v_pools, tables[live])
            for row, i in enumerate(live):
                want = hf(torch.tensor([seqs[i][:pos + 1]])).logits[0, -1].numpy()
                np.testing.assert_allclose(logits[row], want, rtol=0, atol=HF_ATOL)


def test_paged_float32_step_against_the_reference(tiny_checkpoint):  # noqa: F811
    """The model on the paged cache (float32, the CPU backend): prefill three prompts, then one decode step; its
    logits and the K/V it wrote against decode_step on the pool as the prefill left it."""
    from pagedattn.models.loader import load_model

    model, model_config = load_model(tiny_checkpoint, dtype=torch.float32, attn_backend="cpu")
    weights, config = load_weights(tiny_checkpoint), load_config(tiny_checkpoint)
    runner = PagedRunner(model, model_config, num_blocks=32, block_size=8)
    prompts = [[7, 9, 11], list(range(20, 61)), list(range(3, 20))]
    first = runner.step(list(enumerate(prompts)), num_prefills=3).argmax(-1).tolist()
    k_before = [k.clone() for k in runner.kv_cache.k_caches]
    v_before = [v.clone() for v in runner.kv_cache.v_caches]
    tables = np.zeros((3, max(len(t) + 1 for t in runner.tables.values())), np.int64)
    positions = [len(p) for p in prompts]
    for s in range(3):
        while len(runner.tables[s]) * runner.block_size <= positions[s]:            # room for the new token
            runner.tables[s].append(runner.free.pop())
        tables[s, :len(runner.tables[s])] = runner.tables[s]
    ours = runner.step([(s, [first[s]]) for s in range(3)], num_prefills=0).numpy()
    want, k_want, v_want = decode_step(weights, config, first, positions, k_before, v_before, tables)
    np.testing.assert_allclose(ours, want, rtol=0, atol=F32_ATOL)
    assert (ours.argmax(-1) == want.argmax(-1)).all()
    for layer in range(config["num_layers"]):
        np.testing.assert_allclose(runner.kv_cache.k_caches[layer].numpy(), k_want[layer], rtol=0, atol=F32_ATOL)
        np.testing.assert_allclose(runner.kv_cache.v_caches[layer].numpy(), v_want[layer], rtol=0, atol=F32_ATOL)

