"""Tensor parallelism launched by torchrun, on CPU (gloo), with the tiny checkpoint of tests/helpers.py.

Every rank runs the same script (RANK_SCRIPT below): it writes its pid, then calls LLM(..., tensor_parallel_size=
WORLD_SIZE). On rank 0 that returns and the script generates; on every other rank LLM(...) runs the worker loop
and exits the process when rank 0 closes. The script checks that nothing after LLM(...) runs on a worker rank.

- `torchrun --standalone --nproc-per-node 2` (one host, two ranks): greedy ids equal TP=1's, torchrun and
  both ranks exit 0, no process is left.
- slow: two "nodes", two `torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d` invocations meeting at a
  rendezvous endpoint on 127.0.0.1 (each one's agent sees one rank, so a dead peer is noticed by our code,
  not by torchrun tearing down its own local workers): the same equality and clean exit; the worker rank
  SIGKILLed while rank 0 generates -> rank 0 raises TensorParallelError and both torchruns exit non-zero;
  rank 0 SIGKILLed -> the worker rank raises TensorParallelError and exits non-zero. Within a bounded wait,
  no process left behind.
- slow: `torchrun --standalone --nproc-per-node 2 -m pagedattn serve --tensor-parallel-size 2`: rank 0 serves
  a completion; SIGTERM to torchrun ends every process of the launch.
"""
import json
import os
import urllib.request
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, is_gone, tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn.distributed.parallel import free_port

from pagedattn import LLM, SamplingParams

ENGINE_ARGS = dict(device="cpu", block_size=8, num_blocks=96, max_num_batched_tokens=32)
PROMPTS = [[5, 6, 7], list(range(3, 30)), [9], [11, 12] * 9]
MAX_TOKENS = 24
EXIT_WAIT_S = 120            # a bounded wait for every process to end (start-up included); no timing asserts

RANK_SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    from pagedattn import LLM, SamplingParams

    ckpt, out, mode = sys.argv[1:4]
    with open(f"{{out}}.rank{{os.environ['RANK']}}.pid", "w") as f:
        f.write(str(os.getpid()))
    llm = LLM(ckpt, tensor_parallel_size=int(os.environ["WORLD_SIZE"]), **{ENGINE_ARGS!r})
    if os.environ["RANK"] != "0":
        sys.exit("LLM(...) returned on a worker rank")
    params = SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, ignore_eos=True)
    if mode == "once":
        ids = [o.outputs[0].token_ids for o in llm.generate({PROMPTS!r}, params, use_tqdm=False)]
        with open(out, "w") as f:
            json.dump(ids, f)
        llm.close()
    else:                                   # generate until killed (or until a rank fails)
        open(out + ".ready", "w").close()
        while True:
            llm.generate({PROMPTS!r}, params, use_tqdm=False)
""")


def tp1_ids(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(checkpoint, **ENGINE_ARGS).generate(PROMPTS, params, use_tqdm=False)]


def descendants(pid):
    """Pids of the live (non-zombie) processes below `pid` (torchrun starts its ranks in sessions of their
    own, so a process group does not hold them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()          # state, ppid, ...
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc, known=()):
    """SIGKILL a torchrun, everything below it, and the pids in `known` (seen below it earlier)."""
    pids = set(known)
    if proc.poll() is None:
        pids |= set(descendants(proc.pid))
        proc.kill()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Launch:
    """torchrun invocations of RANK_SCRIPT, each in its own session (so a failed test can kill it all)."""

    def __init__(self, tmp_path, checkpoint, mode, torchrun_args):
        script = tmp_path / "rank_script.py"
        script.write_text(RANK_SCRIPT)
        self.out = str(tmp_path / "out")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "OMP_NUM_THREADS": "1"}
        self.logs = [open(tmp_path / f"torchrun{i}.log", "w+") for i in range(len(torchrun_args))]
        self.procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(script), checkpoint,
                                        self.out, mode], stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=tmp_path, start_new_session=True)
                      for args, log in zip(torchrun_args, self.logs)]

    def rank_pid(self, rank):
        with open(f"{self.out}.rank{rank}.pid") as f:
            return int(f.read())

    def wait_for(self, path):
        deadline = time.monotonic() + EXIT_WAIT_S
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"{path} never appeared\n{self.output()}"
            assert all(p.poll() is None for p in self.procs), f"a torchrun exited early\n{self.output()}"
            time.sleep(0.2)

    def wait(self):
        """Every torchrun's exit code, after a bounded wait (a hang fails the test with the logs)."""
        deadline = time.monotonic() + EXIT_WAIT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"torchrun still running {EXIT_WAIT_S} s on\n{self.output()}")
        return [p.returncode for p in self.procs]

    def output(self, tail=6000):
        text = []
        for i, log in enumerate(self.logs):
            log.seek(0)
            text.append(f"--- torchrun {i} ---\n" + (log.read() if tail is None else log.read()[-tail:]))
        return "\n".join(text)

    def kill_all(self):
        ranks = []
        for rank in (0, 1):
            try:
                ranks.append(self.rank_pid(rank))
            except FileNotFoundError:
                pass
        for p in self.procs:
            kill_tree(p, ranks)
        for log in self.logs:
            log.close()


def two_nodes(port):
    """Two torchrun invocations, one rank each, meeting at a c10d rendezvous on 127.0.0.1:port (the first
    hosts the rendezvous store). torchrun numbers the ranks in the order the nodes join.

    --monitor-interval 3: each agent polls the store every interval while its rank is healthy, and the store
    leaves with the first agent; at torchrun's default (0.1 s) the second agent may SIGTERM its rank before
    that rank has noticed the dead peer itself (a busy 2-core machine), and these tests check the rank's own
    report."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "tp-test", "--monitor-interval", "3"]
    return [common + ["--rdzv-conf", "is_host=true"], common + ["--rdzv-conf", "is_host=false"]]


def check_greedy_run(launch, checkpoint):
    codes = launch.wait()
    assert codes == [0] * len(codes), launch.output()
    pids = [launch.rank_pid(r) for r in (0, 1)]
    assert all(is_gone(pid) for pid in pids)
    with open(launch.out) as f:
        got = json.load(f)
    expected = tp1_ids(checkpoint)
    for i, (e, g) in enumerate(zip(expected, got)):
        assert e == g, f"prompt {i}: TP=1 {e} != torchrun TP=2 {g}"
    assert len(got) == len(PROMPTS)


def test_standalone_two_ranks_equal_tp1_and_exit_cleanly(tiny_checkpoint, tmp_path):  # noqa: F811
    launch = Launch(tmp_path, tiny_checkpoint, "once", [["--standalone", "--nproc-per-node", "2"]])
    try:
        check_greedy_run(launch, tiny_checkpoint)
    finally:
        launch.kill_all()


@pytest.mark.slow
def test_two_nodes_equal_tp1_and_exit_cleanly(tiny_checkpoint, tmp_path):  # noqa: F811
    launch = Launch(tmp_path, tiny_checkpoint, "once", two_nodes(free_port()))
    try:
        check_greedy_run(launch, tiny_checkpoint)
    finally:
        launch.kill_all()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_two_nodes_killed_rank_stops_the_other_with_an_error(tiny_checkpoint, tmp_path, victim):  # noqa: F811
    """SIGKILL one rank while rank 0 generates in a loop: the other rank's collective fails (its socket to
    the dead peer closes), it raises TensorParallelError and exits non-zero; so do both torchruns."""
    launch = Launch(tmp_path, tiny_checkpoint, "loop", two_nodes(free_port()))
    try:
        launch.wait_for(launch.out + ".ready")
        time.sleep(0.5)                                   # inside the generate loop
        survivor = launch.rank_pid(1 - victim)
        os.kill(launch.rank_pid(victim), signal.SIGKILL)
        codes = launch.wait()
        assert all(c != 0 for c in codes), launch.output()
        expected = ("tensor-parallel step failed on rank 0" if victim == 1
                    else "tensor-parallel rank 1 of 2 failed")
        assert "TensorParallelError: " + expected in launch.output(tail=None), launch.output()
        assert is_gone(survivor)
    finally:
        launch.kill_all()


TORCHRUN_ENV = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29500")


def test_torchrun_launch_reads_the_environment():
    from pagedattn.distributed.worker import Launch as Placement, torchrun_launch

    assert torchrun_launch(TORCHRUN_ENV) == Placement(rank=0, world_size=4, local_rank=0, local_world_size=2)
    assert torchrun_launch({**TORCHRUN_ENV, "RANK": "3", "LOCAL_RANK": "1"}).local_rank == 1
    assert torchrun_launch({**TORCHRUN_ENV, "WORLD_SIZE": "1"}) is None      # a world of one: no launch
    for missing in ("RANK", "MASTER_PORT"):
        assert torchrun_launch({k: v for k, v in TORCHRUN_ENV.items() if k != missing}) is None


def test_tensor_parallel_size_must_equal_world_size(tiny_checkpoint, monkeypatch):  # noqa: F811
    """Checked before any group is joined (nothing listens at MASTER_PORT here)."""
    from pagedattn.errors import InvalidRequestError

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(InvalidRequestError, match="WORLD_SIZE=4"):
        LLM(tiny_checkpoint, tensor_parallel_size=2, **ENGINE_ARGS)


@pytest.mark.slow
def test_serve_under_torchrun(tiny_checkpoint, tmp_path):  # noqa: F811
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "pagedattn", "serve", "--model", tiny_checkpoint, "--device", "cpu",
                             "--tensor-parallel-size", "2", "--port", str(port), "--num-blocks", "64",
                             "--block-size", "8", "--max-model-len", "128"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)

    def output():
        log.seek(0)
        return log.read()[-6000:]

    below = []
    try:
        deadline = time.monotonic() + EXIT_WAIT_S
        while True:
            below = descendants(proc.pid) or below
            assert proc.poll() is None, f"torchrun exited early\n{output()}"
            assert time.monotonic() < deadline, f"no server after {EXIT_WAIT_S} s\n{output()}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            name = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.load(r)
        assert answer["usage"]["completion_tokens"] == 8, answer
        below = descendants(proc.pid)
        assert len(below) >= 3, output()      # rank 0 (the server, its engine core and API processes), rank 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=EXIT_WAIT_S)
        deadline = time.monotonic() + 30
        while not all(is_gone(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(is_gone(pid) for pid in below), output()
    finally:
        kill_tree(proc, below)
        log.close()
