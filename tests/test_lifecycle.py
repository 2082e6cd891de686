"""An LLM gives every byte back: `close()`, the end of `with LLM(...)`, and `del llm` (no close).

What is checked, by weak references (CPU) and by the allocator (GPU): after each of them (and
gc.collect()), the engine's model, its KV pool tensors and the kernels' cached views and scratch it made
are gone, while a second LLM that is still open keeps working with the same tokens as before.
"""
import gc
import weakref

import pytest
import torch

from pagedattn import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
ROUNDS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    """head_dim 64: the numba kernels (the CUDA simulator on the CPU) cover it, so they cache views."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny64"), hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=1)


def tokens(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def held(llm):
    """Weak references to what an LLM's memory is: the engine, the model, every KV pool tensor."""
    engine = llm.engine
    refs = {"engine": weakref.ref(engine), "model": weakref.ref(engine.model)}
    for i, (k, v) in enumerate(zip(engine.kv_cache.k_caches, engine.kv_cache.v_caches)):
        refs[f"k_cache[{i}]"], refs[f"v_cache[{i}]"] = weakref.ref(k), weakref.ref(v)
    return refs


def alive(refs):
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None)


@pytest.mark.parametrize("how", ["del", "close", "with"])
def test_create_use_release_three_times_beside_a_live_llm(ckpt, how):
    keeper = LLM(ckpt, device="cpu", num_blocks=64, max_model_len=64)
    expected = tokens(keeper)
    for _ in range(ROUNDS):
        if how == "with":
            with LLM(ckpt, device="cpu", num_blocks=64, max_model_len=64) as llm:
                assert tokens(llm) == expected
                refs = held(llm)
                refs.pop("engine")           # `llm` still names the LLM after the block; its engine stays
            assert alive(refs) == []
        else:
            llm = LLM(ckpt, device="cpu", num_blocks=64, max_model_len=64)
            assert tokens(llm) == expected
            refs = held(llm)
            if how == "close":
                llm.close()
                refs.pop("engine")
                assert alive(refs) == []
                with pytest.raises(RuntimeError, match="closed"):
                    tokens(llm)
            del llm
            assert alive(refs) == []
        assert tokens(keeper) == expected     # the live one is untouched
    keeper.close()


def test_close_is_idempotent_and_del_after_close_is_quiet(ckpt):
    llm = LLM(ckpt, device="cpu", num_blocks=64, max_model_len=64)
    refs = held(llm)
    llm.close()
    llm.close()
    del llm
    assert alive(refs) == []


@pytest.mark.slow                   # 35 s
def test_kernel_caches_are_released_per_engine(ckpt64):
    """The numba kernels' cached views (the KV pool's words, activations) and scratch belong to the engines
    that used them: deleting one engine frees what only it held, and nothing a live engine still uses."""
    bridge = pytest.importorskip("kernels_numba.bridge")
    if not (bridge.SIMULATOR or torch.cuda.is_available()):
        pytest.skip("the numba kernels run on a GPU or in the CUDA simulator")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype="float16", attn_backend="numba", num_blocks=16, max_model_len=32, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    before = {id(t) for t in bridge.cached_tensors()}
    keeper = LLM(ckpt64, **kw)
    expected = tokens(keeper, PROMPTS[:1], params)
    kept = [weakref.ref(t) for t in bridge.cached_tensors() if id(t) not in before]
    assert kept, "the engine's steps cached no kernel view: this test would check nothing"
    before_second = {id(t) for t in bridge.cached_tensors()}
    llm = LLM(ckpt64, **kw)
    assert tokens(llm, PROMPTS[:1], params) == expected
    pool = {t.data_ptr() for t in llm.engine.kv_cache.k_caches + llm.engine.kv_cache.v_caches}
    new = [t for t in bridge.cached_tensors() if id(t) not in before_second]      # only the second engine's
    assert any(t.untyped_storage().data_ptr() in pool for t in new), "no cached view of its KV pool"
    mine = {f"cached {tuple(t.shape)} {t.dtype} #{i}": weakref.ref(t) for i, t in enumerate(new)}
    del new
    refs = {**held(llm), **mine}
    del llm
    assert alive(refs) == []
    assert all(r() is not None for r in kept)          # the live engine's views and scratch stay
    assert tokens(keeper, PROMPTS[:1], params) == expected
    keeper.close()
    gc.collect()
    assert all(r() is None for r in kept)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["del", "close"])
def test_gpu_memory_returns_to_its_start(ckpt64, how):
    """Create, use and release an LLM three times in one process, the caller collecting nothing:
    torch.cuda.memory_allocated() is back at its start after each close() (weights, KV pool, CUDA graphs and
    their pool, kernel scratch), and every next LLM sizes its pool like the first (after `del` too: the
    new LLM collects what the old one left in reference cycles before it measures free memory).

    Other processes on the GPU (the GPU suite runs a dozen at once) change the free memory between rounds, so
    each pool is compared per byte of the room this process had when it started: the device's free memory
    plus what this process's allocator holds (a leaked engine's memory counts as room: the pool must get it
    back)."""
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    blocks, room = [], []
    for _ in range(ROUNDS):
        room.append(torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved())
        llm = LLM(ckpt64, device="cuda", dtype="float16", max_model_len=256, max_num_seqs=8)
        blocks.append(llm.engine.num_blocks / room[-1])
        tokens(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        if how == "close":
            llm.close()                           # no gc.collect() of ours: close() and the next LLM() do it
            assert torch.cuda.memory_allocated() == start
        del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == start
    assert blocks[-1] >= 0.95 * blocks[0] and blocks[1] >= 0.95 * blocks[0], (blocks, room)
