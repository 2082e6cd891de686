"""scripts/bench_serving.py on CPU: its SSE reader and chat prompts, and --smoke end to end: the offline
run, the multi-process server through the launcher (two API servers) and the in-process one, driven by the
multi-process load generator with the chat, nano-vllm and light loads, and the files it writes. Timings
on a shared CPU mean nothing; what must hold is that every request completed whole and the pool was freed."""
import contextlib
import json
import os
import random
import signal
import time

import pytest
from serving_helpers import write_tiny_chat_checkpoint

from scripts import bench_serving


def _chunked(body, sizes):
    """`body` in HTTP/1.1 chunked transfer encoding, cut into chunks of the given sizes, then the last chunk."""
    out, i = b"", 0
    for n in sizes:
        if i >= len(body):
            break
        part = body[i:i + n]
        out += b"%x\r\n%s\r\n" % (len(part), part)
        i += n
    if i < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - i, body[i:])
    return out + b"0\r\n\r\n"


def test_server_cpu_s_keeps_same_named_children_apart():
    import subprocess
    import sys

    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        tree = bench_serving.server_cpu_s(os.getpid())
        mine = [k for k in tree if any(k.endswith(f"(pid {c.pid})") for c in children)]
        assert "launcher" in tree and len(mine) == 2 and all(tree[k] >= 0 for k in mine)
    finally:
        for c in children:
            c.kill()
            c.wait()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two CPUs")
def test_pin_server_puts_the_core_on_a_cpu_of_its_own():
    """The engine core (named as the launcher names it) alone on the first CPU, every thread of it; the
    other processes of the tree on the rest."""
    import subprocess
    import sys

    code = ("import ctypes, threading, time; ctypes.CDLL(None).prctl(15, b'pagedattn-core0', 0, 0, 0); "
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); print('up', flush=True); "
            "time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             f"c = subprocess.Popen([sys.executable, '-c', {code!r}]); time.sleep(30)"])
    cpus = sorted(os.sched_getaffinity(0))[:2]
    try:
        deadline = time.monotonic() + 20
        while not any(k.startswith("pagedattn-core0") for k in bench_serving.server_cpu_s(root.pid)):
            assert time.monotonic() < deadline, "the child did not name itself"
            time.sleep(0.1)
        time.sleep(0.5)                                  # its second thread is up
        placed = bench_serving.pin_server(root.pid, cpus)
        core = next(k for k in placed if k.startswith("pagedattn-core0"))
        assert placed[core] == [cpus[0]] and placed["launcher"] == [cpus[1]]
        pid = int(core.rsplit("pid ", 1)[1].rstrip(")"))
        tids = os.listdir(f"/proc/{pid}/task")
        assert len(tids) >= 2 and all(os.sched_getaffinity(int(t)) == {cpus[0]} for t in tids)
        assert os.sched_getaffinity(root.pid) == {cpus[1]}
    finally:
        for key in bench_serving.server_cpu_s(root.pid):
            if key != "launcher":
                with contextlib.suppress(OSError):
                    os.kill(int(key.rsplit("pid ", 1)[1].rstrip(")")), signal.SIGKILL)
        root.kill()
        root.wait()


def test_cpu_columns_per_kind_and_per_process():
    """CPU ms per 1000 tokens over a kind's processes, the busiest one's share, and every process's share."""
    before = {"pagedattn-core0": 1.0, "pagedattn-api0": 2.0, "pagedattn-api1": 0.5, "launcher": 9.0}
    after = {"pagedattn-core0": 3.0, "pagedattn-api0": 3.5, "pagedattn-api1": 1.0, "launcher": 9.5}
    row = bench_serving.cpu_columns(before, after, seconds=2.0, tokens=1000)
    assert row["core_cpu_ms_per_ktok"] == pytest.approx(2000.0) and row["core_busy_max"] == pytest.approx(1.0)
    assert row["api_cpu_ms_per_ktok"] == pytest.approx(2000.0) and row["api_busy_max"] == pytest.approx(0.75)
    assert row["api_busy_each"] == {"pagedattn-api0": 0.75, "pagedattn-api1": 0.25}
    assert bench_serving.cpu_columns({}, {"launcher": 1.0}, 1.0, 100) == {}


def test_step_columns_from_two_counter_readings():
    """The engine's steps over a load: their count, the mean step, the share of the wall time inside steps."""
    before = {"steps": 10, "step_s": 0.5, "computed": 1000}
    after = {"steps": 110, "step_s": 0.8, "computed": 7400}
    row = bench_serving.step_columns(before, after, seconds=0.4, tokens=6000)
    assert row == {"engine_steps": 100, "engine_step_ms": pytest.approx(3.0), "engine_stepping": pytest.approx(0.75),
                   "tokens_per_step": pytest.approx(60.0), "computed_per_step": pytest.approx(64.0)}
    missing = dict(after, steps=None)               # a server without the counters: no columns, no error
    assert bench_serving.step_columns(before, missing, 0.4, 6000) == {}
    assert bench_serving.step_columns(before, before, 0.4, 0) == {}


def _fake_topology(root, siblings):
    for cpu, group in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(group + "\n")


def test_cpu_split_keeps_hyperthread_siblings_together(tmp_path):
    # 8 physical cores, 2 threads each, numbered as Linux does on many hosts: cpu c and c + 8 are siblings
    _fake_topology(tmp_path, {c: f"{c % 8},{c % 8 + 8}" for c in range(16)})
    assert bench_serving.physical_cores(range(16), str(tmp_path)) == [[c, c + 8] for c in range(8)]
    server, client = bench_serving.cpu_split("auto", range(16), sysfs=str(tmp_path))
    assert server == [0, 8, 1, 9, 2, 10, 3, 11] and client == [4, 12, 5, 13, 6, 14, 7, 15]
    assert not set(server) & set(client)
    # too few CPUs to split, explicitly off, explicit lists; a bad list names the option
    assert bench_serving.cpu_split("auto", range(4), sysfs=str(tmp_path)) is None
    assert bench_serving.cpu_split("off", range(16)) is None
    assert bench_serving.cpu_split("0-2,5:3-4") == ([0, 1, 2, 5], [3, 4])
    with pytest.raises(ValueError, match="--cpu-split"):
        bench_serving.cpu_split("0-3")


def test_cpu_split_without_topology_counts_each_cpu_as_a_core(tmp_path):
    server, client = bench_serving.cpu_split("auto", range(9), sysfs=str(tmp_path / "missing"))
    assert server == [0, 1, 2, 3, 4] and client == [5, 6, 7, 8]


@pytest.mark.parametrize("chunked", [True, False])
def test_sse_reader_yields_every_event_whatever_the_cuts(chunked):
    events = [json.dumps({"choices": [{"text": t}], "usage": {"completion_tokens": k}}).encode()
              for k, t in enumerate(["a", "b\n\nc", "é", "data: x", ""], 1)] + [b"[DONE]"]
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    rng = random.Random(0)
    for _ in range(50):
        wire = _chunked(body, [rng.randint(1, 40) for _ in range(len(body))]) if chunked else body
        reader, got, i = bench_serving.SSEReader(chunked), [], 0
        while i < len(wire):                         # the socket hands the bytes over in arbitrary pieces
            n = rng.randint(1, 30)
            got += reader.feed(wire[i:i + n])
            i += n
        # json.dumps escapes the newlines inside strings, so an event never holds a bare blank line
        assert got == events
        assert reader.done == chunked


def test_chat_messages_are_varied_and_deterministic():
    msgs = bench_serving.chat_messages(1024, seed=3)
    assert msgs == bench_serving.chat_messages(1024, seed=3)
    assert msgs != bench_serving.chat_messages(1024, seed=4)
    texts = [m[0]["content"] for m in msgs]
    assert len(set(texts)) == 1024 and all(m[0]["role"] == "user" and len(m) == 1 for m in msgs)
    assert bench_serving.chat_messages(1030)[1024:] == bench_serving.chat_messages(1030)[:6]


def test_server_commands():
    mp4 = bench_serving.server_command("mp4", "M", 123, ["--device", "cpu"])
    assert mp4[1:4] == ["-m", "pagedattn", "serve"] and mp4[-2:] == ["--api-server-count", "4"]
    inproc = bench_serving.server_command("inproc", "M", 123, [])
    assert inproc[1:4] == ["-m", "pagedattn", "serve"] and inproc[-1] == "--in-process"
    held0 = bench_serving.server_command("mp4@0", "M", 123, [])
    assert held0[-4:] == ["--api-server-count", "4", "--prefill-delay-factor", "0"]
    eager = bench_serving.server_command("mp1@0-eager", "M", 123, [])
    assert eager[-5:] == ["--api-server-count", "1", "--no-piecewise-graphs", "--prefill-delay-factor", "0"]
    h11 = bench_serving.server_command("mp2-eager-h11", "M", 123, [])
    assert h11[-5:] == ["--api-server-count", "2", "--no-piecewise-graphs", "--http-impl", "h11"]
    for bad in ("mpx", "mp4@", "mp4@x", "mp1eager", "mp1-h2", "mp1-a4"):
        with pytest.raises(ValueError):
            bench_serving.server_command(bad, "M", 123, [])


@pytest.mark.slow          # the offline LLM, a launcher (core + 2 API servers), the in-process server: ~1-2 min CPU
def test_smoke_run(tmp_path):
    model = write_tiny_chat_checkpoint(tmp_path / "model")
    rows = bench_serving.main(str(tmp_path / "out"), model=model, smoke=True, replay_arrivals=True)
    replayed = [r for r in rows if r["server"] == "offline@mp2"]
    rows = [r for r in rows if r["server"] != "offline@mp2"]
    served = [r for r in rows if r["server"] != "offline"]
    assert [(r["server"], r["load"]) for r in rows] == [
        ("mp2", "chat"), ("mp2", "nano"), ("mp2", "light"), ("inproc", "chat"), ("inproc", "nano"),
        ("inproc", "light"), ("offline", "chat"), ("offline", "nano"), ("offline", "light")]
    # the offline engine fed at the served arrival times: every request, the same greedy nano tokens
    assert [r["load"] for r in replayed] == ["chat", "nano"]
    assert all(r["requests"] == expected_requests for r, expected_requests in zip(replayed, (12, 8)))
    assert replayed[1]["output_tokens"] == sum(bench_serving.nano_workload(8, 4, 24, 512)[1])
    assert all(r["served_over_offline"] > 0 for r in replayed)
    expected = {"chat": 12, "nano": 8, "light": 3}
    for r in served:
        assert r["failed"] == 0 and r["requests"] == expected[r["load"]]
        assert r["kv_blocks_free_after"] == "64/64"
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] > 0 and r["e2e_p50_ms"] >= r["ttft_p50_ms"]
        if r["load"] != "light":
            assert r["served_over_offline"] > 0 and r["itl_over_decode_step"] > 0
        # the engine's counters over the load (from /metrics): a step gives at most one token to each of the
        # max_num_seqs = 8 sequences; steps take time, never more of it than the wall time (one core)
        assert r["engine_steps"] > 0 and 0 < r["tokens_per_step"] <= 8 and r["engine_step_ms"] > 0
        assert 0 < r["engine_stepping"] <= 1.0
        if r["load"] == "light":        # one request at a time: a step per token, give or take one a request
            # (a reading taken before the warm-up's last snapshot reached the front counted its 32 steps too)
            assert r["engine_steps"] <= r["output_tokens"] + r["requests"], r
    nano_tokens = sum(bench_serving.nano_workload(8, 4, 24, 512)[1])
    assert [r["output_tokens"] for r in rows if r["load"] == "nano"] == [nano_tokens] * 3
    assert [r["output_tokens"] for r in served if r["load"] == "light"] == [3 * 16] * 2
    for r in rows:
        if r["server"] == "offline" and r["load"] != "light":
            assert r["engine_steps"] > 0 and 0 < r["engine_stepping"] <= 1.0
    offline_light = rows[-1]                  # the engine's own TTFT, one request at a time
    assert offline_light["requests"] == expected["light"] and offline_light["ttft_p50_ms"] > 0
    for r in rows:
        if r["load"] == "chat":
            assert 12 <= r["output_tokens"] <= 12 * 24
    data = json.loads((tmp_path / "out" / "bench_serving.json").read_text())
    assert data["meta"]["failures"] == {} and data["meta"]["offline_decode_step_ms"] > 0
    kinds = {"served / offline", "mean step", "ITL p50"}             # each served chat and nano row's goals
    goals = [g["goal"] for g in data["meta"]["goals"]]
    for r in served:
        name = f"{r['server']} {r['load']}: "
        mine = {k for k in kinds | {"API CPU", "TTFT p50"} for g in goals if g.startswith(name) and k in g}
        if r["load"] == "light":
            light = f"{name}TTFT p50 {r['ttft_p50_ms']:.1f} ms (goal <= 25.0 ms)"
            assert [g for g in goals if g.startswith(name)] == [light]
            continue
        # the API processes' CPU where the engine runs in processes of its own (mp2, not inproc); the TTFT
        # against offline's where every request arrives at once (nano's 8 requests, not chat's 12, at 8 streams)
        want = set(kinds)
        want |= {"API CPU"} if r["server"] == "mp2" else set()
        want |= {"TTFT p50"} if r["load"] == "nano" else set()
        assert mine == want, (name, goals)
        assert (r.get("ttft_over_offline_ms") is not None) == (r["load"] == "nano")
    for name in ("bench_serving.md", "server_mp2.log", "server_inproc.log"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_openai_client_counts_what_the_raw_client_counts(tmp_path):
    """--client openai: the same greedy requests through the official client give the same token counts, a
    TTFT and ITLs per token as the raw reader's; a request the server refuses is an error in its row."""
    import asyncio

    from serving_helpers import ServerThread

    from pagedattn import LLM
    from pagedattn.serving.app import build_app
    from pagedattn.serving.core_client import CoreClient

    model = write_tiny_chat_checkpoint(tmp_path / "model")
    prompts, out_lens = bench_serving.nano_workload(6, 4, 24, 512, seed=1)
    specs = bench_serving.completion_specs(prompts, out_lens)
    specs += bench_serving.chat_specs(bench_serving.chat_messages(3), 12)
    bad = json.dumps({"model": "bench", "prompt": [1, 2], "max_tokens": -1, "stream": True}).encode()
    specs.append(("/v1/completions", bad, None))
    client = CoreClient.in_thread(LLM(model, device="cpu", dtype="float32", max_model_len=128, num_blocks=64,
                                      max_num_seqs=8))
    try:
        with ServerThread(build_app(client, "bench")) as srv:
            host, port = srv.url.removeprefix("http://").rsplit(":", 1)
            raw, api = (asyncio.run(bench_serving.run_specs(host, int(port), specs, 4, 60.0, kind))
                        for kind in ("raw", "openai"))
    finally:
        client.shutdown()
    for r, o, (_, _, n) in zip(raw[:6], api[:6], specs):
        assert r[0] is None and o[0] is None and r[6] and o[6]
        # an ITL per token after the first chunk (a chunk may bring several tokens when the client is behind)
        assert r[1] == o[1] == n and len(o[3]) <= n - 1 and o[2] > 0
    assert sum(len(o[3]) for o in api[:6]) > 0                  # (not every stream in one chunk)
    for r, o in zip(raw[6:9], api[6:9]):      # sampled chat: counts differ, each between 1 and max_tokens
        assert r[0] is None and o[0] is None and 1 <= r[1] <= 12 and 1 <= o[1] <= 12 and len(o[3]) <= o[1] - 1
    assert "max_tokens" in raw[9][0] and "max_tokens" in api[9][0] and not api[9][6]
