"""Validation layer 3: the attention the runtime actually runs equals the float64 reference.

The engine serves a workload built to make its steps awkward: staggered arrivals, chunked prefill
(a 7-token budget), prefix-cache hits, n=2 forks (copy-on-write), a scrambled free list (requests
that ran and finished first) and a KV pool poisoned with NaN, so a read of a slot the runtime never
wrote shows up. Every attention call of every layer is recorded (q, the step's k/v, the metadata, the
pool after the write, the output) and checked against:

* the slot mapping the reference derives from the block tables: new K/V sit exactly there;
* reference.paged_prefill_attention / paged_decode_attention (per-token loops through the block
  table, float64) on the same pool and metadata.

Tolerance: float32 attention vs float64 over at most ~100 keys: 1e-5 absolute + 1e-5 relative.
"""
import numpy as np
import torch
from helpers import tiny_checkpoint  # noqa: F401

from pagedattn import LLM, SamplingParams
from reference.attention import paged_decode_attention, paged_prefill_attention


class Recorder:
    """Wraps the model's attention backend; keeps what each layer's write + attend saw and returned."""

    def __init__(self, inner):
        self.inner, self.calls, self.written = inner, [], None
        self.recording = False

    def __getattr__(self, name):                    # validate, copy_blocks, ...: the inner backend's
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def ops_table(self, *args, **kwargs):
        """The model's ops through this recorder: torch ops, its write and attend."""
        from pagedattn.layers.ops import torch_ops

        return torch_ops(self)

    def write(self, k, v, k_cache, v_cache, slot_mapping):
        self.inner.write(k, v, k_cache, v_cache, slot_mapping)
        self.written = (k.clone(), v.clone())

    def attend(self, q, k_cache, v_cache, attn_metadata, out=None, scale=None):
        out = self.inner.attend(q, k_cache, v_cache, attn_metadata, out=out, scale=scale)
        if not self.recording:
            return out
        k, v = self.written
        self.calls.append(dict(q=q.clone(), k=k, v=v, k_cache=k_cache.clone(),
                               v_cache=v_cache.clone(), meta=attn_metadata, out=out.clone()))
        return out


def run_workload(ckpt):
    from pagedattn.layers.attention import get_backend
    rec = Recorder(get_backend("torch", "cpu"))
    llm = LLM(ckpt, device="cpu", num_blocks=48, block_size=4, max_num_batched_tokens=7, attn_backend=rec)
    engine = llm.engine
    # Scramble the free list: run and finish a few requests first.
    llm.generate([[9] * 11, [4, 5, 6] * 3, [7] * 5], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    for k, v in zip(engine.kv_cache.k_caches, engine.kv_cache.v_caches):
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    engine.block_manager.block_hash.clear()          # the poisoned blocks must not be served as cache hits
    engine.block_manager.block_key.clear()
    engine.block_manager.cached_blocks.clear()
    rec.recording = True
    system = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    arrivals = [(0, system + [20, 21], SamplingParams(temperature=0, max_tokens=6)),
                (2, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], SamplingParams(temperature=0, max_tokens=5)),
                (4, system + [50], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6)),
                (9, system + [20, 21, 60], SamplingParams(temperature=0, max_tokens=4)),
                (10, [70], SamplingParams(temperature=0, max_tokens=8))]
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            engine.add_request(f"r{step}", prompt, params)
        engine.step()
        step += 1
    return llm, rec.calls


def test_runtime_attention_equals_reference(tiny_checkpoint):  # noqa: F811
    llm, calls = run_workload(tiny_checkpoint)
    bs = llm.engine.config.block_size
    mixed = [c for c in calls if c["meta"].num_prefills and c["meta"].num_decode_tokens]
    assert mixed, "the workload should produce steps mixing prefill chunks and decodes"
    assert any(int(c["meta"].context_lens[:c["meta"].num_prefills].max()) >
               int((c["meta"].cu_seqlens_q[1:] - c["meta"].cu_seqlens_q[:-1]).max()) for c in mixed), \
        "some prefill chunk should start after cached tokens"
    assert llm.metrics()["prefix_cache_hit_tokens"] > 0
    worst = 0.0
    for c in calls:
        m = c["meta"]
        P, Np = m.num_prefills, m.num_prefill_tokens
        tables, ctx = m.block_tables.long(), m.context_lens.long()
        # The slot of every new token follows from the block table and its position.
        q_lens = torch.cat([m.cu_seqlens_q[1:] - m.cu_seqlens_q[:-1], torch.ones(m.num_decode_tokens, dtype=torch.int32)]).long()
        seq = torch.repeat_interleave(torch.arange(m.num_seqs), q_lens)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)[:-1]])
        pos = ctx[seq] - q_lens[seq] + (torch.arange(m.num_tokens) - starts[seq])
        slots = tables[seq, pos // bs] * bs + pos % bs
        assert torch.equal(slots, m.slot_mapping.long())
        assert torch.equal(c["k_cache"][slots // bs, :, slots % bs], c["k"])
        assert torch.equal(c["v_cache"][slots // bs, :, slots % bs], c["v"])
        # The attention output vs the float64 per-token reference.
        want = np.empty(c["out"].shape)
        if P:
            want[:Np] = paged_prefill_attention(c["q"][:Np], c["k_cache"], c["v_cache"], tables[:P],
                                                m.cu_seqlens_q, ctx[:P])
        if m.num_decode_tokens:
            want[Np:] = paged_decode_attention(c["q"][Np:], c["k_cache"], c["v_cache"], tables[P:], ctx[P:])
        got = c["out"].double().numpy()
        assert np.isfinite(got).all(), "the runtime read a slot it never wrote (NaN poison)"
        err = np.abs(got - want)
        worst = max(worst, float(err.max()))
        assert (err <= 1e-5 + 1e-5 * np.abs(want)).all(), f"max err {err.max():.2e}, mean {err.mean():.2e}"
    bm = llm.engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.total_blocks
