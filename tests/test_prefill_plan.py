"""The prefill work list made once per step (NumbaBackend.attend, AttentionMetadata.prefill_plans).

The plan kernel's work list depends only on a step's cu_seqlens_q and the kernel's tile shape, the same for
every layer: the first layer's attention builds it into the step's metadata, the other layers reuse it. Here,
in numba's CUDA simulator (CPU) and on the GPU:

* two layers of one step (prefill chunks behind cached prefixes and a decode) give the same outputs, bit for
  bit, as each layer planning for itself, and the plan kernel runs once for the step (launches counted);
* a new step (a new metadata object) plans again, and its outputs match the float64 reference;
* a plans dict never hands out a work list built for other sizes, another cu_seqlens_q, or across the
  border of a CUDA-graph capture (`gpu`: a step's layers captured in one graph, the plan inside it).
"""
import numpy as np
import pytest
import torch

from kernels_numba import paged_prefill_fa2 as fa, prefill_journey_fa2 as fj
from pagedattn.layers.attention import AttentionMetadata, NumbaBackend
from reference.attention import paged_decode_attention, paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0**-11  # fp16 unit roundoff


def make_layers(query_lens, context_lens, num_prefills, num_layers, seed, num_heads=7, num_kv_heads=1, head_dim=64,
                block_size=16):
    """A step's metadata over a shuffled pool and per layer (q [T, H, D], k_cache, v_cache) in fp16, every
    slot of every sequence written (the step's K/V included) and the unused ones NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(c + block_size - 1) // block_size for c in context_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(blocks))]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, num_prefills, device=DEVICE)
    layers = []
    for _ in range(num_layers):
        caches = []
        for _ in range(2):
            cache = torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=torch.float16)
            for table, ctx in zip(tables, context_lens):
                pos = torch.arange(ctx)
                cache[torch.tensor(table)[pos // block_size], :, pos % block_size] = torch.randn(
                    ctx, num_kv_heads, head_dim, generator=g).half()  # (ctx, Hkv, D)
            caches.append(cache.to(DEVICE))
        q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g).half().to(DEVICE)
        layers.append((q, *caches))
    return meta, layers


def fresh(meta):
    """The same step's metadata as a new object (its own, empty, plans)."""
    return AttentionMetadata(meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens, meta.slot_mapping,
                             meta.context_lens, meta.block_tables, meta.cu_seqlens_q, meta.max_context_len)


@pytest.fixture
def plan_launches(monkeypatch):
    """Counts the plan kernel's launches (kernels_numba.launcher.launch as paged_prefill_fa2 calls it)."""
    count = [0]
    launch = fa.launch_kernel

    def counting(kernel, *args, **kwargs):
        count[0] += kernel is fa.make_plan_kernel()
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(fa, "launch_kernel", counting)
    return count


def reference(q, k_cache, v_cache, meta):
    P, Np = meta.num_prefills, meta.num_prefill_tokens
    parts = [paged_prefill_attention(q[:Np], k_cache, v_cache, meta.block_tables[:P], meta.cu_seqlens_q,
                                     meta.context_lens[:P])]
    if meta.num_decode_tokens:
        parts.append(paged_decode_attention(q[Np:], k_cache, v_cache, meta.block_tables[P:], meta.context_lens[P:]))
    return np.concatenate(parts)


def check(out, ref, v_cache):
    # the prefill kernels' tolerance (tests/test_prefill_fa2.py): twice the output's rounding plus P's
    # rounding to fp16 before P V
    tol = 1e-5 + 2 * U * np.abs(ref) + U * float(np.nanmax(np.abs(v_cache.double().cpu().numpy())))
    err = np.abs(out.double().cpu().numpy() - ref)
    assert (err <= tol).all(), f"max err {err.max():.3g}"


# GQA 7 (one KV head: one CTA a launch in the simulator, ~5 s of CPU each): a 2-token chunk behind a prefix of
# 15 (its keys cross into a second block), then one decode of a 9-token context. Several sequences per plan:
# test_a_new_step_plans_again (slow), and the plan kernel's own tests in test_prefill_fa2.py
STEP = ([2, 1], [17, 9], 1)


def test_one_plan_per_step_same_outputs(plan_launches):
    backend = NumbaBackend(validate=False)
    meta, layers = make_layers(*STEP, num_layers=2, seed=0)
    shared = [backend.attend(q, k, v, meta) for q, k, v in layers]
    assert plan_launches[0] == 1, "the step's second layer planned again"
    assert len(meta.prefill_plans) == 1
    for out, (q, k, v) in zip(shared, layers):
        check(out, reference(q, k, v, meta), v)
    # the second layer planning for itself (the same step as a new metadata object: it plans again) gives the
    # same bits as the reused plan (the first layer planned for itself already)
    q, k, v = layers[1]
    assert torch.equal(backend.attend(q, k, v, fresh(meta)), shared[1])
    assert plan_launches[0] == 2


@pytest.mark.slow
def test_a_new_step_plans_again(plan_launches):
    backend = NumbaBackend(validate=False)
    meta, layers = make_layers(*STEP, num_layers=1, seed=1)
    backend.attend(*layers[0], meta)
    # the next step: other chunk lengths (a chunk of 19: two q tiles of 18 queries), a new metadata object
    meta2, layers2 = make_layers([19, 2], [19, 40], 2, num_layers=2, seed=2)
    outs = [backend.attend(q, k, v, meta2) for q, k, v in layers2]
    assert plan_launches[0] == 2
    for out, (q, k, v) in zip(outs, layers2):
        check(out, reference(q, k, v, meta2), v)


def test_decode_only_steps_plan_nothing(plan_launches):
    backend = NumbaBackend(validate=False)
    meta, layers = make_layers([1, 1], [5, 17], 0, num_layers=1, seed=3)
    out = backend.attend(*layers[0], meta)
    assert plan_launches[0] == 0 and meta.prefill_plans == {}
    check(out, reference(*layers[0], meta), layers[0][2])


def test_plans_are_keyed_on_what_the_plan_depends_on():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    plans = {}
    bq = fa.BM // 7  # GQA 7: 18 queries a tile
    work, planned = fa.work_list(plans, cu, 8, 2, bq, cu.device)
    assert not planned and len(plans) == 1
    again, planned = fa.work_list(plans, cu, 8, 2, bq, cu.device)
    assert planned and again is work
    # other sizes, another tile shape (GQA 4: 32 queries a tile), another cu_seqlens_q: a plan of their own
    assert not fa.work_list(plans, cu, 9, 2, bq, cu.device)[1]
    assert not fa.work_list(plans, cu, 8, 2, fa.BM // 4, cu.device)[1]
    assert not fa.work_list(plans, cu.clone(), 8, 2, bq, cu.device)[1]
    assert len(plans) == 4
    # v9 has v7's tiles, so it reads v7's work list (the same key); the versions that search (v4-v6) have no
    # work list to share: a launch of v6 leaves the step's plans as they were
    assert fj.tile_rows(9, 64) == fj.tile_rows(9, 128) == fa.BM
    meta, ((q, k, v),) = make_layers([2], [17], 1, num_layers=1, seed=5)
    fj.launch_torch(6, q, k, v, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, plans=plans)
    assert len(plans) == 4


@pytest.mark.gpu
def test_gpu_step_captured_in_one_graph(plan_launches):
    # Qwen2-0.5B's heads (14/2, d=64), 3 layers: eagerly (the plan once), then the same step's layers captured
    # in one CUDA graph with the same metadata: the eager plan is not reused inside the capture (its key holds
    # the capture state), the graph holds one plan launch and replays to the same outputs
    backend = NumbaBackend(validate=False)
    meta, layers = make_layers([100, 7, 1], [150, 7, 64], 2, num_layers=3, seed=4, num_heads=14, num_kv_heads=2)
    eager = [backend.attend(q, k, v, meta) for q, k, v in layers]
    assert plan_launches[0] == 1
    outs = [torch.full_like(q, float("nan")) for q, _, _ in layers]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for (q, k, v), out in zip(layers, outs):
            backend.attend(q, k, v, meta, out=out)
    assert plan_launches[0] == 2 and len(meta.prefill_plans) == 2
    graph.replay()
    torch.cuda.synchronize()
    for a, b, (q, k, v) in zip(eager, outs, layers):
        assert torch.equal(a, b)
        check(b, reference(q, k, v, meta), v)
