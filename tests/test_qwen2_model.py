"""Our Qwen2 on the paged cache against Hugging Face transformers' Qwen2 (same tiny random weights).

Tolerance: both sides compute in float32 and differ only in summation order (matmul blocking, softmax
over padded/gathered keys vs a dense causal mask). Activations and logits are O(1)-O(10), float32 eps
is 1.2e-7; measured differences are <= 2.2e-6 on logits (6e-7 per attention layer). ATOL = 2e-5 keeps
~10x headroom for other CPUs' kernels, while a wrong rotary position, bias, mask or KV head moves
outputs by > 1e-2.
"""
import pytest
import torch
import transformers

from helpers import PagedRunner, TINY_CONFIG, tiny_checkpoint, write_tiny_checkpoint  # noqa: F401 (fixture)
from pagedattn.layers.attention import AttentionMetadata
from pagedattn.errors import ModelLoadError
from pagedattn.kv_cache import KVCache
from pagedattn.models.loader import load_model
from pagedattn.models.qwen2 import Qwen2Config

ATOL = 2e-5
PROMPT_LEN = 37
CHUNKS = [5, 11, 16, 5]                   # chunked prefill of the 37-token prompt
BLOCK_SIZES = [16, 5]


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    ours, config = load_model(tiny_checkpoint, attn_backend="torch")
    return hf, ours, config


def prompt(n=PROMPT_LEN, seed=1):
    return torch.randint(3, TINY_CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0].float()                     # (T, vocab)


def assert_close(ours, ref, what):
    err = (ours - ref).abs()
    assert err.max() <= ATOL, f"{what}: max err {err.max():.3e}, mean err {err.mean():.3e}"


@pytest.mark.parametrize("layer", range(TINY_CONFIG["num_hidden_layers"]))
@pytest.mark.parametrize("split", [0, 13])
@torch.no_grad()
def test_attention_layer_matches_hf(models, layer, split):
    """Same hidden states and positions into one attention layer: ours (paged, the first `split` tokens
    cached by an earlier step) vs HF's Qwen2Attention with rotary embeddings and a causal mask."""
    hf, ours, config = models
    T, offset = 29, 4                            # positions offset..offset+T-1 (rotary beyond 0)
    x = torch.randn(T, config.hidden_size, generator=torch.Generator().manual_seed(layer))
    pos = torch.arange(offset, offset + T)
    # HF: [1, T, hidden] with an additive causal mask [1, 1, T, T]
    hf_attn = hf.model.layers[layer].self_attn
    cos_sin = hf.model.rotary_emb(x[None], pos[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ref = hf_attn(x[None], position_embeddings=cos_sin, attention_mask=mask)[0][0]  # (T, hidden)
    # Ours: rotary angles of `pos`; the cache holds these T tokens in slots 0..T-1 of the sequence
    # (attention depends only on their order), written by one or two prefill steps.
    attn = ours.model.layers[layer].self_attn
    cache = KVCache(1, 8, config.num_key_value_heads, 8, config.head_dim, dtype=torch.float32)
    table = [[3, 0, 6, 1, 7]]                   # shuffled blocks
    out = []
    for lo, hi in ([(0, split)] if split else []) + [(split, T)]:
        meta = AttentionMetadata.build([hi - lo], [hi], table, 8, num_prefills=1)
        out.append(attn(pos[lo:hi], x[lo:hi], cache.k_caches[0], cache.v_caches[0], meta))
    assert_close(torch.cat(out), ref, f"layer {layer} attention")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@torch.no_grad()
def test_one_prefill_matches_hf(models, block_size):
    hf, ours, config = models
    ids = prompt()
    runner = PagedRunner(ours, config, num_blocks=16, block_size=block_size)
    table = list(range(16))[::-1][: -(-len(ids) // block_size)]          # descending block ids
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], block_size, num_prefills=1)
    hidden = ours(torch.tensor(ids), torch.arange(len(ids)), runner.kv_cache, meta)
    assert_close(ours.compute_logits(hidden), hf_logits(hf, ids), "one prefill, every position")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_prefill_matches_hf(models, block_size):
    hf, ours, config = models
    ids, ref = prompt(), hf_logits(hf, prompt())
    runner = PagedRunner(ours, config, num_blocks=16, block_size=block_size)
    end = 0
    for n in CHUNKS:
        logits = runner.step([(0, ids[end:end + n])], num_prefills=1)
        end += n
        assert_close(logits[0], ref[end - 1], f"chunk ending at {end}")
    assert end == len(ids)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_then_decode_matches_hf(models, block_size):
    hf, ours, config = models
    ids = prompt()
    ref = hf_logits(hf, ids)
    runner = PagedRunner(ours, config, num_blocks=16, block_size=block_size)
    assert_close(runner.step([(0, ids[:9])], num_prefills=1)[0], ref[8], "prefill of 9")
    for t in range(9, len(ids)):
        assert_close(runner.step([(0, [ids[t]])], num_prefills=0)[0], ref[t], f"decode at position {t}")


def test_mixed_batch_matches_hf_per_sequence(models):
    """Prefill chunks of two sequences and decodes of two others in the same steps."""
    hf, ours, config = models
    seqs = {s: prompt(n, seed=s) for s, n in [(0, 37), (1, 20), (2, 3), (3, 17)]}
    refs = {s: hf_logits(hf, ids) for s, ids in seqs.items()}
    runner = PagedRunner(ours, config, num_blocks=32, block_size=8)
    # step 1: prefill 2 and 3 whole, 0 partly; step 2..: 0 continues its prefill while 2 and 3 decode
    got = runner.step([(0, seqs[0][:10]), (2, seqs[2][:2]), (3, seqs[3][:12])], num_prefills=3)
    for row, (s, end) in enumerate([(0, 10), (2, 2), (3, 12)]):
        assert_close(got[row], refs[s][end - 1], f"seq {s} step 1")
    got = runner.step([(0, seqs[0][10:30]), (1, seqs[1]), (2, [seqs[2][2]]), (3, [seqs[3][12]])], num_prefills=2)
    for row, (s, end) in enumerate([(0, 30), (1, 20), (2, 3), (3, 13)]):
        assert_close(got[row], refs[s][end - 1], f"seq {s} step 2")
    got = runner.step([(0, seqs[0][30:]), (3, [seqs[3][13]])], num_prefills=1)
    for row, (s, end) in enumerate([(0, 37), (3, 14)]):
        assert_close(got[row], refs[s][end - 1], f"seq {s} step 3")


def test_tied_embeddings(tmp_path):
    path = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    ours, config = load_model(path)
    assert config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids = prompt(11)
    logits = PagedRunner(ours, config, num_blocks=4).step([(0, ids)], num_prefills=1)
    assert_close(logits[0], hf_logits(hf, ids)[-1], "tied lm_head")


def test_config_from_dict_styles_and_validation():
    base = {k: v for k, v in TINY_CONFIG.items() if k != "rope_parameters"}
    base["model_type"] = "qwen2"
    assert Qwen2Config.from_dict({**base, "rope_theta": 1e6}).rope_theta == 1e6          # transformers 4 style
    assert Qwen2Config.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
                                 ).rope_theta == 5e5                                       # transformers 5 style
    assert Qwen2Config.from_dict(base).head_dim == 96 // 6
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        Qwen2Config.from_dict({**base, "num_key_value_heads": 4})
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        Qwen2Config.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="lacks"):
        Qwen2Config.from_dict({k: v for k, v in base.items() if k != "hidden_size"})


# ---- tensor parallelism: each rank loads its shard -----------------------------------------------
TP_PROMPTS = [prompt(23, seed=5), prompt(9, seed=6)]


def tp_logits(model, config, tp_size):
    """Logits of a chunked prefill of two prompts, then three decode steps of both: [10, vocab]."""
    from dataclasses import replace

    shard_config = replace(config, num_key_value_heads=config.num_key_value_heads // tp_size)  # this rank's pool
    runner = PagedRunner(model, shard_config, num_blocks=16, block_size=8)
    a, b = TP_PROMPTS
    rows = [runner.step([(0, a[:14]), (1, b)], num_prefills=2), runner.step([(0, a[14:])], num_prefills=1)]
    for t in range(3):
        rows.append(runner.step([(0, [a[t]]), (1, [b[t]])], num_prefills=0))
    return torch.cat(rows)


def _tp_rank_main(rank, world_size, init_method, ckpt, results):
    import torch.distributed as dist

    from pagedattn.distributed.parallel import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, init_method, "cpu", 120)
    try:
        model, config = load_model(ckpt, attn_backend="torch", tp_rank=rank, tp_size=world_size)
        # a numpy copy travels by value: a tensor would travel as a shared-memory handle that is gone
        # when this process exits before the parent reads it
        results.put((rank, tp_logits(model, config, world_size).numpy()))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_shards_match_tp1(tiny_checkpoint):  # noqa: F811
    """Two CPU ranks over gloo, each loading only its shard (load_model(tp_rank, tp_size)), give TP=1's
    logits up to the all-reduce's summation order: float32 partial sums of o_proj / down_proj added in
    another order move logits by ~1e-6 (measured <= 2e-6), well inside ATOL; a wrong head, slice or
    missing all-reduce moves them by > 1e-2. Both ranks hold the same all-gathered logits."""
    import multiprocessing

    from pagedattn.distributed.parallel import free_port

    want = tp_logits(*load_model(tiny_checkpoint, attn_backend="torch"), 1)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_tp_rank_main, args=(r, 2, init, tiny_checkpoint, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {rank: torch.from_numpy(logits) for rank, logits in (results.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert torch.equal(got[0], got[1])
    print(f"max |TP=2 - TP=1| = {(got[0] - want).abs().max():.2e}")
    assert_close(got[0], want, "TP=2 vs TP=1")
