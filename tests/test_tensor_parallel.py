"""Tensor parallelism on CPU: 2 ranks over gloo (the parent is rank 0, one spawned worker is rank 1).

The tiny Qwen2 (tests/helpers.py: 6 query heads, 2 KV heads, vocab 128, intermediate 160) splits into
3 query heads + 1 KV head, 64 vocab rows and 80 intermediate columns per rank.

- Greedy token ids at TP=2 equal TP=1 for prompts of 1..40 tokens, 40 new tokens each with 8-token
  blocks (every sequence crosses several block boundaries), chunked prefill (a 32-token budget), a
  prefix-cache hit, and n=2 seeded sampling (forks share blocks: the copy-on-write copies must reach
  the worker too). Exact equality is the check, but the logits are not bit-identical: the all-reduce
  adds the two ranks' partial o_proj / down_proj sums in another order than one matmul, so float32
  logits differ by ~1e-6. On this model no greedy choice is that close to a tie; a model where one
  is could flip a token, which would not be a bug.
- A worker killed mid-life, or one that raises, makes generate raise TensorParallelError in the
  parent within seconds (no hang; the worker's traceback in the message), leaving no child process.
- close() / Ctrl-C stop the workers: no child process remains.
"""
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn import LLM, SamplingParams
from pagedattn.distributed.worker import TensorParallelError
from pagedattn.errors import InvalidRequestError

TP = 2
ENGINE_ARGS = dict(device="cpu", block_size=8, num_blocks=96, max_num_batched_tokens=32)
PROMPT_LENGTHS = [1, 5, 8, 17, 40]
MAX_TOKENS = 40
SHARED = [(5 * i + 7) % 120 + 3 for i in range(19)]         # a shared 19-token prefix


def make_prompts():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in PROMPT_LENGTHS]
    return prompts + [SHARED + [rng.randrange(3, 128) for _ in range(n)] for n in (2, 6)]


PROMPTS = make_prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True)


def run_workload(llm):
    """Token ids of: all prompts greedily (one batch), then the shared-prefix ones again (a prefix-cache
    hit), then n=2 seeded sampling of two prompts."""
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    ids += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[-2:], GREEDY, use_tqdm=False)]
    ids += [c.token_ids for o in llm.generate(PROMPTS[1:3], SAMPLED, use_tqdm=False) for c in o.outputs]
    return ids


def is_gone(pid):
    """True when `pid` no longer runs (exited, or a zombie waiting to be reaped by someone else)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_invalid_tensor_parallel_size_names_the_field(tiny_checkpoint):  # noqa: F811
    cases = [(4, "num_attention_heads"), (3, "num_key_value_heads"), (0, "tensor_parallel_size"),
             ("2", "tensor_parallel_size")]
    for tp, field in cases:
        with pytest.raises(InvalidRequestError, match=field):
            LLM(tiny_checkpoint, device="cpu", tensor_parallel_size=tp)
    assert not multiprocessing.active_children()        # rejected before any process starts


def test_check_names_vocab_and_intermediate():
    from pagedattn.distributed import check_tensor_parallel_size
    from pagedattn.models.qwen2 import Qwen2Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2)
    check_tensor_parallel_size(Qwen2Config(**base), 2)
    with pytest.raises(InvalidRequestError, match="vocab_size"):
        check_tensor_parallel_size(Qwen2Config(**{**base, "vocab_size": 129}), 2)
    with pytest.raises(InvalidRequestError, match="intermediate_size"):
        check_tensor_parallel_size(Qwen2Config(**{**base, "intermediate_size": 161}), 2)


def test_greedy_matches_tp1_and_close_leaves_no_children(tiny_checkpoint):  # noqa: F811
    expected = run_workload(LLM(tiny_checkpoint, **ENGINE_ARGS))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS) as llm:
        group = llm.engine.runner.group
        pids = group.pids
        assert len(pids) == TP - 1
        got = run_workload(llm)
        assert llm.engine.kv_cache.num_kv_heads == 1         # this rank's slice of every block
        assert llm.metrics()["kv_cache_usage"] == 0           # every block returned
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e == g, f"sequence {i}: TP=1 {e} != TP={TP} {g}"
    assert len(got) == len(PROMPTS) + 2 + 4
    assert all(is_gone(pid) for pid in pids) and not multiprocessing.active_children()
    assert [p.exitcode for p in group.context.processes] == [0]   # a clean stop, not a kill
    llm.close()                                                   # idempotent
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)


def test_worker_failure_raises_in_parent(tiny_checkpoint):  # noqa: F811
    llm = LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    (pid,) = llm.engine.runner.group.pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker failed"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert is_gone(pid) and not multiprocessing.active_children()
    llm.close()


def test_worker_exception_surfaces_in_parent(tiny_checkpoint):  # noqa: F811
    """An exception raised inside the worker (here: an op it does not know) reaches the parent with the
    worker's traceback, within seconds."""
    from pagedattn.distributed.worker import send_op

    llm = LLM(tiny_checkpoint, tensor_parallel_size=TP, **ENGINE_ARGS)
    (pid,) = llm.engine.runner.group.pids
    send_op(99, 0, llm.engine.runner.device)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="unknown op 99"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert is_gone(pid) and not multiprocessing.active_children()


CTRL_C_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys
    from pagedattn import LLM, SamplingParams
    if __name__ == "__main__":
        # a terminal's process: Ctrl-C raises KeyboardInterrupt, whatever SIGINT state the test
        # runner's process handed down (what it was is printed, for a failure message)
        print("SIGINT at start:", signal.getsignal(signal.SIGINT), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        llm = LLM(sys.argv[1], device="cpu", block_size=8, num_blocks=64, tensor_parallel_size=2)
        print(*llm.engine.runner.group.pids, flush=True)
        faulthandler.dump_traceback_later(25, exit=True)   # a hang shows where it is (the test fails on it)
        while True:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
""")


def test_ctrl_c_stops_workers(tiny_checkpoint, tmp_path):  # noqa: F811
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, while steps are running."""
    script = tmp_path / "tp_loop.py"
    script.write_text(CTRL_C_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, *sys.path])}
    proc = subprocess.Popen([sys.executable, str(script), tiny_checkpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == TP - 1, proc.stderr.read()
        time.sleep(1.0)                                    # let it get into the generate loop
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Timeout (0:00:25)" not in err, f"still running 25 s after start; its threads:\n{err[-6000:]}"
    assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 10
    while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(is_gone(p) for p in pids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason=f"needs {TP} GPUs")
def test_gpu_nccl_greedy_matches_tp1(tiny_checkpoint):  # noqa: F811
    """The same workload on GPUs: rank r on cuda:r, NCCL all-reduces, float32 (no fp16 near-ties)."""
    args = dict(ENGINE_ARGS, device="cuda", dtype="float32", attn_backend="torch", enforce_eager=True)
    expected = run_workload(LLM(tiny_checkpoint, **args))
    with LLM(tiny_checkpoint, tensor_parallel_size=TP, **args) as llm:
        assert llm.engine.kv_cache.num_kv_heads == 1
        got = run_workload(llm)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e == g, f"sequence {i}: TP=1 {e} != TP={TP} {g}"


def test_throughput_script_tp_mode(tiny_checkpoint, tmp_path):  # noqa: F811
    """scripts/bench_throughput.py --mode tp, on CPU with the tiny model: TP=1 and TP=2 runs of one
    workload, their greedy ids compared (float32 here: identical), the table written."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_throughput

    res = bench_throughput.tp_mode(str(tmp_path), 0, 60.0, 8, 256, ckpt=tiny_checkpoint, device="cpu",
                                   workload=(PROMPTS, [12] * len(PROMPTS)))
    assert not res["errors"], res["errors"]
    assert set(res["tp"]) == {"tp1_eager", "tp2_eager"}
    assert all(r["finished"] == len(PROMPTS) for r in res["tp"].values())
    assert res["greedy"] == {"compared": len(PROMPTS), "identical": len(PROMPTS), "first_divergence": []}
    assert res["speedup_eager"] > 0
    table = (tmp_path / "bench_tp.md").read_text()
    assert "| tp2_eager |" in table and "Greedy ids identical for 7 of 7" in table
    assert bench_throughput.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert bench_throughput.first_divergence([1, 2], [1, 2, 3]) == 2
