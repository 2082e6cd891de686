"""Reliability: every bad input is a clear error raised before anything starts, the engine keeps
serving the others, and memory pressure loses nothing (docs/reliability.md lists the inputs).
"""
import json

import pytest
import torch
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn import LLM, BeamSearchParams, SamplingParams
from pagedattn.errors import InvalidRequestError, KernelLaunchError, ModelLoadError

MAX_MODEL_LEN = 64
NUM_BLOCKS = 12
BLOCK_SIZE = 4        # the pool holds 48 tokens: less than max_model_len, so "never fits" is reachable


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):  # noqa: F811
    return LLM(tiny_checkpoint, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)


def greedy(max_tokens=4, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# (prompt, params, words the message must contain)
BAD_REQUESTS = [
    ([], greedy(), ["prompt", "at least 1 token"]),
    ([5] * (MAX_MODEL_LEN + 1), greedy(), ["prompt", f"max_model_len={MAX_MODEL_LEN}"]),
    ([5] * MAX_MODEL_LEN, greedy(1), ["prompt has 64 tokens", "no room to generate",
                                      f"< max_model_len={MAX_MODEL_LEN}"]),
    ([5] * (NUM_BLOCKS * BLOCK_SIZE), greedy(1), ["prompt has 48 tokens", "no room to generate in the KV pool",
                                                 "must be < 48"]),
    ([5] * 40, greedy(30), ["max_tokens", f"max_model_len={MAX_MODEL_LEN}", "[1, 24]"]),   # (40 < the pool's 48)
    ([5, -1, 6], greedy(), ["token id -1", "[0, 128)"]),
    ([5, 128], greedy(), ["token id 128", "[0, 128)"]),
    ([5, 2.5], greedy(), ["token ids must be ints"]),
    ([5, 6, True], greedy(), ["token ids must be ints, got True at position 2"]),
    ([5, 6, 7, -3], greedy(), ["token id -3 at position 3"]),
    ([5] * 40, greedy(20), ["never fit", f"num_blocks={NUM_BLOCKS}", "max_tokens must be <= 8"]),
    ("a string", greedy(), ["no tokenizer"]),
    (42, greedy(), ["prompt must be a str or a list of token ids"]),
    ([5, 6], "greedy please", ["sampling_params must be a SamplingParams"]),
    ([5, 6], SamplingParams(n=300, temperature=1.0), ["n=300", "max_num_seqs"]),
]


def assert_untouched(llm, steps_before):
    engine = llm.engine
    assert not engine.groups and not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.total_blocks
    assert engine.stats.num_steps == steps_before


@pytest.mark.parametrize("prompt,params,words", BAD_REQUESTS)
def test_generate_rejects_bad_request_before_starting_any(llm, prompt, params, words):
    steps = llm.engine.stats.num_steps
    good = [[7, 8, 9], [10, 11]]
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(good + [prompt], [greedy(), greedy(), params], use_tqdm=False)
    msg = str(e.value)
    assert msg.startswith("request 2: "), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert isinstance(e.value, ValueError)
    assert_untouched(llm, steps)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-5), "top_k"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop=["ok", ""]), "stop"),
])
def test_bad_sampling_values_name_field_and_range(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs)
    assert any(r in str(e.value) for r in ("must be", "must hold"))


def test_beam_width_and_never_fitting_beams(llm):
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    steps = llm.engine.stats.num_steps
    with pytest.raises(InvalidRequestError, match="request 1: .*4 beams"):
        llm.beam_search([[5, 6], [5] * 10], BeamSearchParams(beam_width=4, max_tokens=4), use_tqdm=False)
    assert_untouched(llm, steps)


def test_add_request_rejects_bad_one_while_others_run(llm):
    engine = llm.engine
    engine.add_request("ok-1", [3, 4, 5], greedy(20))
    engine.add_request("ok-2", [6, 7], greedy(20))
    engine.step()
    for i, (prompt, params, _) in enumerate(BAD_REQUESTS):
        with pytest.raises(InvalidRequestError):
            engine.add_request(f"bad-{i}", prompt, params)
        engine.step()
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("ok-1", [3], greedy())
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    solo = {rid: llm.generate([p], greedy(20), use_tqdm=False)[0].outputs[0].token_ids
            for rid, p in (("ok-1", [3, 4, 5]), ("ok-2", [6, 7]))}
    assert outs == solo
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_abort_anywhere_frees_everything(llm):
    engine = llm.engine
    engine.add_request("a", [3] * 9, SamplingParams(n=2, temperature=1.0, max_tokens=8))
    engine.add_request("b", [4] * 9, greedy(8))
    engine.add_request("c", [5] * 30, greedy(8))      # waits: the pool is small
    engine.step()
    assert engine.abort_request("c")                  # waiting
    engine.step()
    assert engine.abort_request("a")                  # running, forked
    assert not engine.abort_request("nope")
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="Qwen2"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"), (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(dtype="float8"), "dtype"),
])
def test_bad_engine_arguments(tiny_checkpoint, kwargs, field):  # noqa: F811
    with pytest.raises(InvalidRequestError, match=field):
        LLM(tiny_checkpoint, device="cpu", **kwargs)


def test_gpu_memory_share_from_the_environment(monkeypatch):
    """gpu_memory_utilization: the argument, else PAGEDATTN_GPU_MEMORY_UTILIZATION, else 0.9; a bad value names
    the variable."""
    from pagedattn.config import GPU_MEMORY_ENV, EngineConfig

    monkeypatch.delenv(GPU_MEMORY_ENV, raising=False)
    assert EngineConfig(device="cpu").gpu_memory_utilization == 0.9
    monkeypatch.setenv(GPU_MEMORY_ENV, "0.25")
    assert EngineConfig(device="cpu").gpu_memory_utilization == 0.25
    assert EngineConfig(device="cpu", gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    for bad in ("half", "1.5"):
        monkeypatch.setenv(GPU_MEMORY_ENV, bad)
        with pytest.raises(InvalidRequestError, match="PAGEDATTN_GPU_MEMORY_UTILIZATION|gpu_memory_utilization"):
            EngineConfig(device="cpu")


def test_attention_launch_with_mismatched_shapes_is_caught(llm):
    from pagedattn.layers.attention import AttentionMetadata, get_backend

    cache = torch.zeros(4, 2, 4, 16)
    meta = AttentionMetadata.build([1], [1], [[0]], 4, num_prefills=0)
    q, k = torch.zeros(1, 6, 16), torch.zeros(1, 2, 8)        # k has the wrong head_dim
    with pytest.raises(KernelLaunchError):
        get_backend("torch", "cpu")(q, k, k, cache, cache, meta)


MIX = [[3 + i % 50 for i in range(n)] for n in (5, 9, 14, 20, 26, 31)]
SHARED = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51] + [60 + i] for i in range(3)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_quarter_pool_loses_nothing(tiny_checkpoint, prefix_caching):  # noqa: F811
    """~25% of the blocks the workload needs: preemption and recompute, identical greedy outputs,
    n > 1 in the mix, every block free at the end."""
    prompts = MIX + SHARED
    params = [greedy(16, ignore_eos=True)] * len(MIX) + [SamplingParams(n=2, temperature=0.0, max_tokens=16,
                                                                         ignore_eos=True)] * len(SHARED)
    roomy = LLM(tiny_checkpoint, device="cpu", num_blocks=256, block_size=BLOCK_SIZE)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    need = sum(p.n * -(-(len(x) + 16) // BLOCK_SIZE) for x, p in zip(prompts, params))
    tight = LLM(tiny_checkpoint, device="cpu", num_blocks=need // 4, block_size=BLOCK_SIZE,
                enable_prefix_caching=prefix_caching)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    m = tight.metrics()
    assert m["num_preemptions"] > 0
    bm = tight.engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.total_blocks
    # Beam search in the same tight pool: prompts run in groups that fit; the result is unchanged.
    bp = BeamSearchParams(beam_width=3, max_tokens=8)
    assert ([o.sequences[0].output_token_ids for o in tight.beam_search(MIX[:4], bp, use_tqdm=False)] ==
            [o.sequences[0].output_token_ids for o in roomy.beam_search(MIX[:4], bp, use_tqdm=False)])
    bm.check()
    assert bm.num_free_blocks == bm.total_blocks


def test_seeded_output_independent_of_batch(tiny_checkpoint):  # noqa: F811
    llm = LLM(tiny_checkpoint, device="cpu", num_blocks=128, block_size=BLOCK_SIZE)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)
    alone = llm.generate([MIX[2]], sp, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(MIX, [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [sp] + [greedy(9)] * 3,
                         use_tqdm=False)[2].outputs[0].token_ids
    assert alone == crowd
