"""Serving benchmark: the multi-process server (engine core in its own process, N API servers) and the
in-process one, at saturation and at light load, beside offline LLM.generate on the same requests, in one run.

Servers (--servers, in this order; one row per server and load):
  mp<N>    `python -m pagedattn serve ... --api-server-count N`: one engine core process and N API
           processes on one port (docs/serving.md)
  inproc   `python -m pagedattn serve --in-process`: the engine core on a thread of the HTTP process
Every server runs with the offline run's engine settings (prefix caching off in both: the loads replay
prompts), --stream-interval 1 by default; its log goes to <out>/server_<name>.log.

Loads (--loads):
  chat   a chat user load (needs a tokenizer): --chat-requests streamed /v1/chat/completions calls,
         temperature 0.8, top_p 0.95, max_tokens 256, varied short user messages (chat_messages: templates x
         topics x asks, deterministic), --concurrency streams at once (closed loop: a stream that finishes
         sends the next request)
  nano   the nano-vllm workload (scripts/benchlib.py): random token-id prompts on /v1/completions, lengths
         uniform in [--min-len, --max-len], outputs the same, greedy, ignore_eos; all sent at once
  light  one request at a time: a --light-prompt-len-token prompt (distinct random ids), 16 tokens; its
         TTFT p50 is the light-load figure
With --model random (no tokenizer) chat is skipped.

The load generator is not the bottleneck: --client-processes processes (spawned once, before the first
load), each running its share of the streams on asyncio with a raw HTTP/1.1 client (asyncio streams, one
connection per request, chunked transfer decoding and SSE splitting on bytes, the token count read from
each chunk's usage with a regex: no JSON parse, no h11, no pydantic per chunk). Every request asks for
stream_options.include_usage and continuous_usage_stats, so each chunk says how many tokens it brings.
--client openai drives the same requests through the official `openai` client instead (AsyncOpenAI, one per
client process, a chunk parsed into its pydantic model: what an application pays; give it more processes).
Measured on the client: TTFT (send -> first chunk with a token), ITL (a chunk's gap since the previous
one, split evenly over the tokens it brings), e2e (send -> [DONE]), throughput (output tokens / (last
[DONE] - first send)). After every load the server's /metrics must show every KV block free again.
The load generator runs on CPUs of its own (--cpu-split auto, with >= 8 CPUs: the second half of the physical
cores; the first half for this process, its offline engine and the servers): in production the clients are
other machines; here they would otherwise compete with the server's processes for the same CPUs.
Measured on the server (Linux /proc): the CPU time the engine core(s) and the API server(s) spent during the
load, per 1000 output tokens, and the busiest one's share of a CPU (near 1.0: that process is the limit);
from /metrics: the engine's steps during the load, its mean step and the share of the time it was stepping
(the same for the offline rows, from the engine's counters).

Offline (one LLM in this process, before any server; freed afterwards): LLM.generate on each load's
requests (chat: the messages through the tokenizer's chat template, as the server does), and the decode
step: 256 sequences (100-token prompts, ignore_eos) stepped by hand, the median wall time of the steps
after every prompt is in (the engine's step period at that batch: what an ITL compares to); with the light
load, the engine's own TTFT (add_request to the first streamed step output, one prompt at a time: the part
of a served light-load TTFT that is not the server's).

Goals, checked per row in the `goals` list of the JSON and the markdown: at 256 streams, served >= 0.95x
offline on nano and >= 0.9x on chat, the engine's mean step <= 1.05x the offline engine's on the same load,
TTFT p50 <= the offline TTFT p50 + 50 ms where every request arrives at once (no more requests than streams;
the offline one: LLM.generate's requests, all added at once), ITL p50
<= 1.2x the offline decode step, the API processes' CPU <= 11 ms per 1000 tokens (servers with core processes);
at light load, TTFT p50 <= 25 ms.

    python scripts/bench_serving.py --out OUT                          # the bundled model, GPU defaults
    python scripts/bench_serving.py --model DIR --out OUT              # a converted checkpoint (e.g. /tmp/model)
    python scripts/bench_serving.py --model random --out OUT           # random Qwen2.5-0.5B weights: nano + light
    python scripts/bench_serving.py --smoke --out OUT                  # CPU, tiny random model, small loads
    python scripts/bench_serving.py --smoke --model DIR --out OUT      # CPU, a tiny checkpoint with a tokenizer
    python scripts/bench_serving.py --model DIR --device cpu --fake-step-ms 2 --out OUT   # the serving stack's
                                           # own cost on a CPU: 2 ms steps of random tokens (scripts/fake_engine.py)
"""
import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Nothing heavy at module level: the client processes import this module (spawn) and need asyncio only.
now = time.monotonic                # one clock for every process of the machine
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
GOALS = dict(served_over_offline={"nano": 0.95, "chat": 0.9}, itl_over_decode_step=1.2, light_ttft_p50_ms=25.0,
             step_over_offline=1.05, ttft_over_offline_ms=50.0, api_cpu_ms_per_ktok=11.0)


# ---- the requests ------------------------------------------------------------------------------------
_TEMPLATES = [
    "Explain {t} in two sentences.", "What is {t}?", "Give me three facts about {t}.",
    "Write a haiku about {t}.", "How would you teach {t} to a beginner?", "Summarize the history of {t}.",
    "What are common mistakes people make with {t}?", "Compare {t} with something similar.",
    "Write a short Python function related to {t}.", "List the pros and cons of {t}.",
    "Why does {t} matter?", "Describe {t} to a ten-year-old.", "What is a good book about {t}?",
    "Tell me a fun story involving {t}.", "What questions should I ask an expert on {t}?",
    "Give an analogy for {t}.",
]
_TOPICS = [
    "hash tables", "photosynthesis", "the Roman empire", "binary search", "black holes", "sourdough bread",
    "TCP congestion control", "jazz improvisation", "garbage collection", "plate tectonics", "chess openings",
    "vaccines", "compound interest", "the French revolution", "neural networks", "coffee roasting",
]
_ASKS = ["", " Keep it short.", " Be precise.", " Use simple words."]


def chat_messages(n, seed=0):
    """n user conversations ([{"role": "user", "content": ...}]): templates x topics x asks (1024 distinct),
    in a seeded order."""
    combos = [(a, b, c) for a in range(len(_TEMPLATES)) for b in range(len(_TOPICS)) for c in range(len(_ASKS))]
    random.Random(seed).shuffle(combos)
    return [[{"role": "user", "content": _TEMPLATES[a].format(t=_TOPICS[b]) + _ASKS[c]}]
            for a, b, c in (combos[i % len(combos)] for i in range(n))]


def nano_workload(num_requests, min_len, max_len, vocab_size, seed=0):
    """(prompts as token-id lists, output lengths): benchlib's nano-vllm workload, ids folded into the vocab."""
    from scripts import benchlib

    prompts, out_lens = benchlib.nano_vllm_workload(num_requests, min_len, max_len, seed)
    return [[t % vocab_size for t in p] for p in prompts], out_lens


def light_prompts(n, length, vocab_size, seed=0):
    """n distinct prompts of `length` random token ids (no shared prefix with each other)."""
    rng = random.Random(seed + 7919)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


CHAT_SAMPLING = dict(temperature=0.8, top_p=0.95)
USAGE = {"include_usage": True, "continuous_usage_stats": True}


def chat_specs(messages, max_tokens):
    """Request specs (path, body bytes, expected tokens or None) for the chat load."""
    return [("/v1/chat/completions", json.dumps({"model": "bench", "messages": m, **CHAT_SAMPLING,
                                                  "max_tokens": max_tokens, "stream": True,
                                                  "stream_options": USAGE}).encode(), None) for m in messages]


def completion_specs(prompts, out_lens):
    """Request specs for token-id prompts, greedy, ignore_eos: each must bring exactly its output length."""
    return [("/v1/completions", json.dumps({"model": "bench", "prompt": p, "max_tokens": n, "temperature": 0,
                                            "ignore_eos": True, "stream": True, "stream_options": USAGE}).encode(), n)
            for p, n in zip(prompts, out_lens)]


# ---- the client (runs in the client processes) -----------------------------------------------------------
class SSEReader:
    """Bytes of a streamed HTTP response body in (chunked transfer encoding or not), SSE payloads out."""

    def __init__(self, chunked):
        self.chunked, self.raw, self.buf, self.done = chunked, b"", b"", False

    def feed(self, data):
        """The payloads (bytes after 'data: ') of every event completed by `data`."""
        if self.chunked:
            self.raw += data
            parts = []
            while not self.done:
                i = self.raw.find(b"\r\n")
                if i < 0:
                    break
                size = int(self.raw[:i].split(b";")[0], 16)
                if size == 0:
                    self.done = True
                    break
                if len(self.raw) < i + size + 4:
                    break
                parts.append(self.raw[i + 2:i + 2 + size])
                self.raw = self.raw[i + size + 4:]
            data = b"".join(parts)
        self.buf += data
        *events, self.buf = self.buf.split(b"\n\n")
        return [e[6:] if e.startswith(b"data: ") else e for e in events if e.strip()]


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


class Tally:
    """One stream's tokens as chunks report their running count: TTFT (start -> the first chunk with a token)
    and an ITL per later token (a chunk's gap since the previous one, split evenly over the tokens it brings)."""

    def __init__(self):
        self.start, self.tokens, self.ttft, self.itls, self.last = now(), 0, None, [], None

    def seen(self, t, total):
        new = total - self.tokens
        if new <= 0:
            return
        if self.last is None:
            self.ttft = t - self.start
        else:
            self.itls += [(t - self.last) / new] * new
        self.last, self.tokens = t, total

    def result(self, error, done):
        """(error or None, tokens, ttft, itls, start, end, done): what a client returns per request."""
        return error, self.tokens, self.ttft, self.itls, self.start, now(), done


async def stream_one(host, port, path, body, timeout_s):
    """One streamed request on a fresh connection; returns (error or None, tokens, ttft, itls, start, end, done)."""
    tally, error, done = Tally(), None, False
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d"
                         b"\r\nConnection: close\r\n\r\n%s" % (path.encode(), host.encode(), port, len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            sse = SSEReader(b"transfer-encoding: chunked" in head.lower())
            if status != 200:
                return tally.result(f"HTTP {status}: {(await reader.read(400))!r}", False)
            while not sse.done:
                data = await reader.read(1 << 16)
                if not data:
                    break
                t = now()
                for payload in sse.feed(data):
                    if payload == b"[DONE]":
                        done = True
                        continue
                    if payload.startswith(b'{"error"'):
                        error = payload[:300].decode(errors="replace")
                        continue
                    m = None
                    for m in _COMPLETION_TOKENS.finditer(payload):
                        pass
                    if m is not None:
                        tally.seen(t, int(m.group(1)))
    except (Exception, asyncio.CancelledError) as e:     # noqa: BLE001 (reported per request; TimeoutError too)
        error = error or repr(e)
    finally:
        if writer is not None:
            writer.close()
    if not done and error is None:
        error = "the stream ended without [DONE]"
    return tally.result(error, done)


_STANDARD = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs",
             "top_logprobs", "presence_penalty", "frequency_penalty"}


async def stream_openai(api, path, body, timeout_s):
    """One streamed request through the official `openai` client (`api`: an AsyncOpenAI); the same result as
    stream_one. Fields the client's signature does not name (ignore_eos, stream_options with
    continuous_usage_stats) travel in extra_body; every chunk's usage says how many tokens it brings."""
    tally, error, done = Tally(), None, False
    request = json.loads(body)
    request.pop("stream", None)
    kwargs = {k: v for k, v in request.items() if k in _STANDARD}
    extra = {k: v for k, v in request.items() if k not in _STANDARD}
    create = api.chat.completions.create if path.endswith("/chat/completions") else api.completions.create
    try:
        async with asyncio.timeout(timeout_s):
            stream = await create(**kwargs, stream=True, extra_body=extra)
            async for chunk in stream:
                if chunk.usage is not None:
                    tally.seen(now(), chunk.usage.completion_tokens)
            done = True
    except (Exception, asyncio.CancelledError) as e:     # noqa: BLE001 (reported per request; TimeoutError too)
        error = repr(e)[:300]
    return tally.result(error, done)


async def run_specs(host, port, specs, concurrency, timeout_s, client="raw"):
    """Closed loop: `concurrency` workers take the next spec until none is left. Results in spec order.
    client: raw (stream_one) | openai (stream_openai, one AsyncOpenAI for the process's streams)."""
    results = [None] * len(specs)
    queue = list(range(len(specs)))[::-1]
    api = None
    if client == "openai":
        import httpx2
        import openai
        api = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="bench", max_retries=0,
                                 timeout=timeout_s,
                                 http_client=openai.DefaultAsyncHttpxClient(
                                     limits=httpx2.Limits(max_connections=concurrency,
                                                          max_keepalive_connections=concurrency)))

    async def worker():
        while queue:
            i = queue.pop()
            path, body, _ = specs[i]
            results[i] = await (stream_one(host, port, path, body, timeout_s) if api is None
                                else stream_openai(api, path, body, timeout_s))

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(specs))))))
    finally:
        if api is not None:
            await api.close()
    return results


def client_process(conn, cpus=None):
    """A load-generator process: ("run", host, port, specs, concurrency, timeout_s) -> results; None: exit.
    cpus: the CPUs it may run on (cpu_split)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        _, host, port, specs, concurrency, timeout_s, client = cmd
        conn.send(asyncio.run(run_specs(host, port, specs, concurrency, timeout_s, client)))


class ClientPool:
    """`processes` spawned load-generator processes; run() spreads the requests and the streams over them."""

    def __init__(self, processes, cpus=None, client="raw"):
        self.client = client
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(processes):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_process, args=(child, cpus), name=f"bench-client-{i}", daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, url, specs, concurrency, processes=None, timeout_s=600.0):
        """Every spec streamed with `concurrency` streams in all (split evenly over the processes that get
        requests); returns the results in spec order."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        k = max(1, min(processes or len(self.conns), len(self.conns), concurrency, len(specs)))
        shares = [list(range(len(specs)))[j::k] for j in range(k)]
        for j, conn in enumerate(self.conns[:k]):
            streams = concurrency // k + (j < concurrency % k)
            conn.send(("run", host, int(port), [specs[i] for i in shares[j]], streams, timeout_s, self.client))
        results = [None] * len(specs)
        for j, conn in enumerate(self.conns[:k]):
            for i, r in zip(shares[j], conn.recv()):
                results[i] = r
        return results

    def close(self):
        for conn, p in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()


def summarize(results, specs):
    """One row's figures from a load's results (latencies in ms) and its errors."""
    from scripts import benchlib

    ok, errors = [], []
    for (error, tokens, *_rest), (_, _, expect) in zip(results, specs):
        if error is None and tokens > 0 and (expect is None or tokens == expect):
            ok.append(True)
        else:
            ok.append(False)
            errors.append(error or f"{tokens} tokens, expected {expect}")
    span = max(r[5] for r in results) - min(r[4] for r in results)
    tokens = sum(r[1] for r in results)
    row = {"requests": len(results), "failed": len(errors), "seconds": span, "output_tokens": tokens,
           "output_tok_s": tokens / span}
    good = [r for r, g in zip(results, ok) if g]
    for name, xs in [("ttft", [r[2] for r in good if r[2] is not None]), ("itl", [x for r in good for x in r[3]]),
                     ("e2e", [r[5] - r[4] for r in good])]:
        for q, v in benchlib.percentiles([1000 * x for x in xs]).items():
            row[f"{name}_{q}_ms"] = v
    return row, errors


# ---- the CPUs -------------------------------------------------------------------------------------------
def physical_cores(cpus, sysfs="/sys/devices/system/cpu"):
    """The CPUs `cpus` grouped by physical core (hyperthread siblings together, from sysfs), in CPU order."""
    cores = {}
    for c in sorted(cpus):
        try:
            with open(f"{sysfs}/cpu{c}/topology/thread_siblings_list") as f:
                siblings = _cpu_list(f.read())
        except (OSError, ValueError):
            siblings = {c}
        cores.setdefault(min(siblings), set()).add(c)
    return [sorted(v) for _, v in sorted(cores.items())]


def _cpu_list(text):
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_split(mode, cpus=None, min_cpus=8, sysfs="/sys/devices/system/cpu"):
    """(server CPUs, client CPUs), or None to share them all. In production the clients are other machines;
    here they share the host, and a client process on a server process's CPU (or its hyperthread sibling)
    takes time from it. mode "auto": with at least min_cpus CPUs, the first half of the
    physical cores (with their siblings) for the server side (this process: the offline engine; the
    servers it starts), the rest for the load generator; "off": no split; "S:C": explicit CPU lists."""
    if mode == "off":
        return None
    if mode != "auto":
        server, _, client = mode.partition(":")
        if not client:
            raise ValueError(f"--cpu-split must be auto, off or SERVER:CLIENT CPU lists (0-7:8-15), got {mode!r}")
        return sorted(_cpu_list(server)), sorted(_cpu_list(client))
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < min_cpus:
        return None
    cores = physical_cores(cpus, sysfs)
    half = -(-len(cores) // 2)
    return [c for core in cores[:half] for c in core], [c for core in cores[half:] for c in core]


def pin_server(root_pid, cpus):
    """Pin server `root_pid`'s processes (every thread of each): the engine cores one CPU each (the first of
    `cpus`, in pid order), the API servers and the launcher the rest. Returns {process key: CPUs}."""
    keys = server_cpu_s(root_pid)                     # "<name> (pid N)" for every process under the server
    cores = sorted(k for k in keys if k.startswith("pagedattn-core"))
    others = sorted(k for k in keys if not k.startswith("pagedattn-core"))
    rest = cpus[len(cores):] or cpus
    placed = {k: [cpus[i % len(cpus)]] for i, k in enumerate(cores)}
    placed.update({k: list(rest) for k in others})
    for key, mask in placed.items():
        pid = root_pid if key == "launcher" else int(key.rsplit("pid ", 1)[1].rstrip(")"))
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), mask)
        except OSError:
            pass                                      # a thread that ended meanwhile
    return placed


# ---- the servers ---------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name, model_dir, port, engine_args):
    """The command line of server `name`: mpN (`pagedattn serve`: the engine core in its own process, N API
    servers) or inproc (`pagedattn serve --in-process`: the engine on a thread of the HTTP process)."""
    cmd = [sys.executable, "-m", "pagedattn", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", "bench", "--log-level", "warning", *engine_args]
    if name == "inproc":
        return cmd + ["--in-process"]
    m = re.fullmatch(r"mp(\d+)(?:@([0-9.]+))?((?:-eager|-h11)*)", name)
    if not m:
        raise ValueError(f"unknown server {name!r}: mp<N> (the engine core and N API servers), mp<N>@<F> (and "
                         f"--prefill-delay-factor F), with -eager (--no-piecewise-graphs) and/or -h11 "
                         f"(--http-impl h11), or inproc")
    cmd += ["--api-server-count", m.group(1)]
    if "-eager" in m.group(3):
        cmd += ["--no-piecewise-graphs"]
    if "-h11" in m.group(3):
        cmd += ["--http-impl", "h11"]
    return cmd + (["--prefill-delay-factor", m.group(2)] if m.group(2) is not None else [])


def start_server(name, model_dir, engine_args, log_path, timeout_s):
    """Server `name` as a subprocess; returns (Popen, base url) once /health answers 200."""
    import httpx

    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(server_command(name, model_dir, port, engine_args), stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server {name} exited with code {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"server {name} did not answer /health within {timeout_s} s; log: {log_path}")
        time.sleep(0.25)


def stop_server(proc):
    """SIGTERM (the launcher stops its API servers, then its core), then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_cpu_s(root_pid):
    """{"launcher" or "<process name> (pid <pid>)": CPU seconds (user + system) so far} for the server process
    `root_pid` and every process under it, read from /proc (Linux; {} elsewhere). The launcher names its
    children pagedattn-core<R> and pagedattn-api<I>, which is how the rows tell the engine core from the API
    servers; the pid keeps apart two processes whose names /proc cuts to the same 15 bytes (core1, core10)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats = {}
    try:
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        text = f.read()
                except OSError:
                    continue
                name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
                stats[int(pid)] = (name, int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
    except OSError:
        return {}
    tree, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in stats:
            name, _, cpu = stats[pid]
            key = f"{name} (pid {pid})" if pid != root_pid else "launcher"
            tree[key] = tree.get(key, 0.0) + cpu
            todo += [p for p, (_, ppid, _) in stats.items() if ppid == pid]
    return tree


def cpu_columns(before, after, seconds, tokens):
    """Row columns from two server_cpu_s readings around a load: CPU ms per 1000 output tokens and the
    busy fraction of one CPU over the load, for the engine core(s) and the API server(s) (the busiest
    one's fraction: a process near 1.0 is the bottleneck), and each process's busy fraction by name (JSON
    only: how the load spread over several API processes)."""
    row = {}
    for kind in ("core", "api"):
        used = {n: after[n] - before.get(n, 0.0) for n in after if n.startswith(f"pagedattn-{kind}")}
        if used and tokens:
            row[f"{kind}_cpu_ms_per_ktok"] = 1e6 * sum(used.values()) / tokens
            row[f"{kind}_busy_max"] = max(used.values()) / seconds
            row[f"{kind}_busy_each"] = {n: round(u / seconds, 3) for n, u in sorted(used.items())}
    return row


def scrape(url):
    """{sample name: value} of the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
            for s in f.samples}


def engine_counters(values):
    """{steps, step_s, computed}: the engine's step counters in a /metrics reading (summed over cores)."""
    return {"steps": values.get("pagedattn_engine_steps_total"),
            "step_s": values.get("pagedattn_engine_step_seconds_total"),
            "computed": values.get("pagedattn_engine_computed_tokens_total")}


def step_columns(before, after, seconds, tokens):
    """Row columns from two step-counter readings around a load ({steps, step_s, computed}, as
    settled's first value or engine_stats): the engine's steps, its mean step (ms), the share of the load's
    wall time it spent inside steps (summed over cores), and output tokens per step. A served row whose
    mean step matches the offline one but whose stepping share is low waited for requests; one whose
    steps are slower had them slowed (a busier host, more prefill steps)."""
    if not before or not after or None in before.values() or None in after.values():
        return {}
    steps = after["steps"] - before["steps"]
    step_s = after["step_s"] - before["step_s"]
    if steps <= 0 or not seconds:
        return {}
    return {"engine_steps": int(steps), "engine_step_ms": 1000 * step_s / steps, "engine_stepping": step_s / seconds,
            "tokens_per_step": tokens / steps, "computed_per_step": (after["computed"] - before["computed"]) / steps}


def engine_stats(llm):
    st = llm.engine.stats
    return {"steps": st.num_steps, "step_s": st.step_time, "computed": st.num_computed_tokens}


def settled(url, timeout_s=60, poll_s=0.1):
    """(step counters, free KV blocks, pool size) once the server is idle. An engine core sends its metrics
    every 50 ms while busy and once as it goes idle, so a reading taken as the last stream ends can still be
    the one from before a short load: idle means no request in flight at the front, every block free, and
    the step counter unchanged over two readings poll_s apart."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        values = scrape(url)
        free, total = values.get("pagedattn_kv_cache_free_blocks"), values.get("pagedattn_kv_cache_blocks")
        idle = values.get("pagedattn_num_requests_in_flight") == 0 and free is not None and free == total
        steps = values.get("pagedattn_engine_steps_total")
        if (idle and last is not None and steps == last) or time.monotonic() > deadline:
            return engine_counters(values), free, total
        last = steps if idle else None
        time.sleep(poll_s)


# ---- offline -------------------------------------------------------------------------------------------
def decode_step_ms(llm, vocab_size, batch, prompt_len, max_tokens):
    """Median wall ms of engine.step() while `batch` sequences decode (prompts in, before the last steps):
    the offline step period an ITL at that many streams compares to."""
    from pagedattn import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(light_prompts(batch, prompt_len, vocab_size, seed=12345)):
        engine.add_request(f"decode-step-{i}", p, params)
    times, settled = [], 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if engine.scheduler.waiting:
            settled = 0
            continue
        settled += 1
        if settled > 2:                 # the last prompt chunk and the step overlapping it are done
            times.append(dt)
    times = times[:-2] if len(times) > 4 else times
    return 1000 * sorted(times)[len(times) // 2]


def light_ttft_ms(llm, prompts):
    """Median ms from engine.add_request to the first step output with a token, one prompt at a time (16
    tokens each, streamed): the engine's own share of a light-load TTFT."""
    from pagedattn import SamplingParams

    engine, times = llm.engine, []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"light-ttft-{i}", p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           stream=True)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(c.delta_token_ids for o in outs for c in o.outputs):
                first = time.perf_counter() - t0
        times.append(first)
    return 1000 * sorted(times)[len(times) // 2]


def offline_runs(model_dir, llm_kwargs, loads, vocab_size, batch, fake_step_ms=None, light=None, fake_prefill_ms=None):
    """{load: offline row} for every load with an `offline` entry, plus the decode step (ms); light: the
    light load's prompts (then a "light" row with the engine's own TTFT p50).
    fake_step_ms: the synthetic device (scripts/fake_engine.py) instead of the model."""
    import gc

    import torch

    from pagedattn import LLM, SamplingParams
    from scripts import benchlib

    llm = LLM(model_dir, **llm_kwargs)
    if fake_step_ms:
        from scripts.fake_engine import install_fake_runner
        install_fake_runner(llm, fake_step_ms, prefill_ms=fake_prefill_ms or 0.0)
    rows = {}
    for name, load in loads.items():
        if load.get("offline") is None:
            continue
        prompts, params = load["offline"](llm, SamplingParams)
        # warm-up: every prompt (every prefill shape, the full batch), a few tokens each
        llm.generate(prompts, [dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in params],
                     use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stats0 = engine_stats(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft = benchlib.percentiles([1000 * o.metrics.ttft for o in outs if o.metrics and o.metrics.ttft is not None])
        rows[name] = {"server": "offline", "load": name, "requests": len(prompts), "concurrency": batch,
                      "failed": 0, "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                      **{f"ttft_{q}_ms": v for q, v in ttft.items()},
                      **step_columns(stats0, engine_stats(llm), seconds, tokens)}
        print(f"offline {name}: {tokens / seconds:.1f} output tok/s ({seconds:.2f} s, {tokens} tokens; engine: "
              f"{rows[name].get('engine_steps')} steps of {rows[name].get('engine_step_ms', 0):.2f} ms)", flush=True)
    max_len = llm.engine.max_model_len
    step = decode_step_ms(llm, vocab_size, batch, min(100, max_len // 4), min(128, max_len // 2))
    print(f"offline decode step at {batch} sequences: {step:.3f} ms", flush=True)
    if light is not None:
        ttft = light_ttft_ms(llm, light)
        print(f"offline light-load TTFT p50 (engine.step, one request at a time): {ttft:.1f} ms", flush=True)
        rows["light"] = {"server": "offline", "load": "light", "requests": len(light), "concurrency": 1,
                         "failed": 0, "ttft_p50_ms": ttft}
    num_blocks = llm.engine.num_blocks
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, step, num_blocks


def replay_offline(model_dir, llm_kwargs, load, offline_of, arrivals, fake_step_ms=None, fake_prefill_ms=None):
    """The offline engine fed a load's requests at the times a server received them (`arrivals`: seconds
    after the first request was sent, per request, from the served run's clients) instead of all at t = 0:
    what the engine alone does under the served arrival shape. Steps as LLM.generate does; a row like the
    offline one (output tok/s from the first arrival to the last finish)."""
    import gc

    import torch

    from pagedattn import LLM, SamplingParams

    llm = LLM(model_dir, **llm_kwargs)
    if fake_step_ms:
        from scripts.fake_engine import install_fake_runner
        install_fake_runner(llm, fake_step_ms, prefill_ms=fake_prefill_ms or 0.0)
    prompts, params = offline_of(llm, SamplingParams)
    llm.generate(prompts, [dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in params],
                 use_tqdm=False)                                     # the same warm-up as the offline run
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    engine, order = llm.engine, sorted(range(len(prompts)), key=lambda i: arrivals[i])
    tokens, nxt = 0, 0
    stats0 = engine_stats(llm)
    t0 = time.perf_counter()
    while nxt < len(order) or engine.has_unfinished_requests():
        t = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= t:
            i = order[nxt]
            engine.add_request(f"replay-{i}", prompts[i], params[i])
            nxt += 1
        if engine.has_unfinished_requests():
            tokens += sum(len(c.token_ids) for o in engine.step() if o.finished for c in o.outputs)
        else:
            time.sleep(max(0.0, arrivals[order[nxt]] - t))
    seconds = time.perf_counter() - t0
    steps = step_columns(stats0, engine_stats(llm), seconds, tokens)
    llm.close()
    del llm
    gc.collect()
    print(f"offline, served arrivals, {load}: {tokens / seconds:.1f} output tok/s ({seconds:.2f} s, {tokens} tokens)",
          flush=True)
    return {"load": load, "requests": len(prompts), "failed": 0, "seconds": seconds, "output_tokens": tokens,
            "output_tok_s": tokens / seconds, **steps}


def save_results(out, rows, failures, step_ms, meta, final):
    """Write bench_serving.{json,md} under out (after every server too, so a run cut short leaves its rows);
    returns the markdown."""
    from scripts import benchlib

    goals = goal_lines(rows, step_ms)
    columns = ["server", "load", "requests", "concurrency", "failed", "seconds", "output_tok_s", "offline_tok_s",
               "served_over_offline", "ttft_p50_ms", "ttft_p99_ms", "ttft_over_offline_ms", "itl_p50_ms", "itl_p99_ms",
               "itl_over_decode_step", "e2e_p50_ms", "e2e_p99_ms", "engine_steps", "engine_step_ms",
               "step_over_offline", "engine_stepping", "tokens_per_step",
               "core_cpu_ms_per_ktok", "core_busy_max", "api_cpu_ms_per_ktok", "api_busy_max",
               "kv_blocks_free_after", "server_start_s", "skipped"]
    table = benchlib.markdown_table(rows, columns)
    table += (f"\n\nOffline decode step at {meta['decode_step_batch']} sequences: {step_ms:.3f} ms. Stream interval "
              f"{meta['stream_interval']}; {meta['client_processes']} client processes ({meta.get('client', 'raw')} client)."
              f"{'' if final else ' (partial: the run is not over)'}\n\nGoals:\n\n"
              + "\n".join(f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in goals) + "\n")
    meta = dict(meta, offline_decode_step_ms=step_ms, goals=[{"goal": t, "met": ok} for t, ok in goals],
                failures=failures, final=final)
    benchlib.save(out, "bench_serving", rows, meta, table)
    return table


# ---- main ----------------------------------------------------------------------------------------------
def resolve_model(model, smoke):
    """(checkpoint dir, vocab size, has a chat template)."""
    if smoke and model in (None, "bundled", "random"):
        import torch

        from scripts import benchlib
        return benchlib.random_checkpoint(TINY, dtype=torch.float32, device="cpu"), TINY["vocab_size"], False
    if model == "random":
        import torch

        from scripts import benchlib
        cfg = benchlib.QWEN2_CONFIGS["0.5b"]
        return benchlib.random_checkpoint("0.5b", dtype=torch.float16), cfg["vocab_size"], False
    if model in (None, "bundled"):
        from pagedattn.bundled import bundled_model_path
        model = bundled_model_path()
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    chat = any(os.path.exists(os.path.join(model, n)) for n in ("chat_template.jinja", "chat_template.json"))
    if not chat and os.path.exists(os.path.join(model, "tokenizer_config.json")):
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            chat = bool(json.load(f).get("chat_template"))
    return model, vocab, chat


def against_offline(row, off, step_ms):
    """A served row's figures against the offline row of its load: throughput, the engine's mean step, the
    TTFT p50 (ms more than offline's, when every request arrives at once in both: no more requests than
    streams), the ITL p50 against the decode step."""
    out = {"offline_tok_s": off["output_tok_s"], "served_over_offline": row["output_tok_s"] / off["output_tok_s"]}
    if row.get("engine_step_ms") and off.get("engine_step_ms"):
        out["step_over_offline"] = row["engine_step_ms"] / off["engine_step_ms"]
    at_once = row["requests"] <= row["concurrency"] and off["requests"] <= off["concurrency"]
    if at_once and row.get("ttft_p50_ms") is not None and off.get("ttft_p50_ms") is not None:
        out["ttft_over_offline_ms"] = row["ttft_p50_ms"] - off["ttft_p50_ms"]
    if row.get("itl_p50_ms") is not None:
        out["itl_over_decode_step"] = row["itl_p50_ms"] / step_ms
    return out


def goal_lines(rows, step_ms):
    """Each serving goal against the rows that measure it: (text, met)."""
    lines = []
    for r in rows:
        if r["server"].startswith("offline") or r.get("skipped"):      # offline@<server>: a measurement, no goal
            continue
        name = f"{r['server']} {r['load']}"
        if r["load"] in ("chat", "nano") and r.get("served_over_offline") is not None:
            v, goal = r["served_over_offline"], GOALS["served_over_offline"][r["load"]]
            lines.append((f"{name}: served / offline {v:.3f} (goal >= {goal})", v >= goal))
        if r["load"] in ("chat", "nano") and r.get("step_over_offline") is not None:
            v, goal = r["step_over_offline"], GOALS["step_over_offline"]
            lines.append((f"{name}: the engine's mean step {r['engine_step_ms']:.2f} ms = {v:.2f}x offline's "
                          f"(goal <= {goal}x)", v <= goal))
        if r["load"] in ("chat", "nano") and r.get("ttft_over_offline_ms") is not None:
            v, goal = r["ttft_over_offline_ms"], GOALS["ttft_over_offline_ms"]
            lines.append((f"{name}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, offline's {v:+.1f} ms (goal <= {goal:+g} ms)",
                          v <= goal))
        if r["load"] in ("chat", "nano") and r.get("itl_over_decode_step") is not None:
            v = r["itl_over_decode_step"]
            lines.append((f"{name}: ITL p50 {r['itl_p50_ms']:.2f} ms = {v:.2f}x the offline decode "
                          f"step {step_ms:.2f} ms (goal <= {GOALS['itl_over_decode_step']}x)",
                          v <= GOALS["itl_over_decode_step"]))
        if r["load"] in ("chat", "nano") and None not in (r.get("core_cpu_ms_per_ktok"), r.get("api_cpu_ms_per_ktok")):
            v, goal = r["api_cpu_ms_per_ktok"], GOALS["api_cpu_ms_per_ktok"]       # (a server with core processes)
            lines.append((f"{name}: API CPU {v:.1f} ms per 1000 tokens (goal <= {goal:g})", v <= goal))
        if r["load"] == "light" and r.get("ttft_p50_ms") is not None:
            v = r["ttft_p50_ms"]
            lines.append((f"{r['server']} light: TTFT p50 {v:.1f} ms (goal <= {GOALS['light_ttft_p50_ms']} ms)",
                          v <= GOALS["light_ttft_p50_ms"]))
    return lines


def main(out, model="bundled", servers=None, loads=("chat", "nano", "light"),
         device="auto", dtype=None, chat_requests=1024, chat_max_tokens=256, concurrency=256, client_processes=8,
         nano_requests=256, min_len=100, max_len=1024, light_requests=20, light_prompt_len=100, max_model_len=2048,
         max_num_seqs=256,
         num_blocks=None, stream_interval=1, warmup=16, server_timeout_s=600, time_budget_s=None,
         request_timeout_s=600.0, smoke=False, seed=0, fake_step_ms=None, fake_prefill_ms=None,
         replay_arrivals=False, cpus="auto", pin=False, client="raw"):
    """Run the benchmark; returns the table rows (also written under `out`). time_budget_s: a server row is
    skipped (and marked so) when the time spent so far plus the longest server row so far would pass it.
    servers: default mp1, mp2, mp4, inproc (smoke: mp2, inproc). fake_step_ms: every engine (offline and
    served, the servers through their engine hook) on the synthetic device of scripts/fake_engine.py: steps
    of that many ms, random tokens (the serving stack's own overhead, measurable on a CPU); fake_prefill_ms:
    what a step with a prompt chunk costs on top there (a GPU's eager mixed step). A server mp<N>@<F> is mp<N>
    with --prefill-delay-factor F;
    mp<N>-eager: with --no-piecewise-graphs; mp<N>-h11: with --http-impl h11 (combinable). replay_arrivals: after the servers, the offline
    engine is fed the chat and nano requests at the times the first server's clients sent them (a row
    "offline@<server>": the engine alone under the served arrival shape). cpus: cpu_split's mode (the load
    generator on CPUs of its own). pin: with a CPU split, each server's engine core on a CPU of its own and
    its other processes on the rest of the server side (pin_server). client: the load generator's HTTP client,
    raw (stream_one) or openai (the official client, stream_openai)."""
    from scripts import benchlib

    t_start = time.monotonic()
    if smoke:
        servers = servers or ("mp2", "inproc")
        device, chat_requests, concurrency, client_processes, nano_requests = "cpu", 12, 8, 2, 8
        min_len, max_len, light_requests, light_prompt_len, max_model_len, chat_max_tokens = 4, 24, 3, 12, 128, 24
        max_num_seqs, num_blocks, warmup, request_timeout_s = 8, num_blocks or 64, 2, 120.0
    servers = tuple(servers or ("mp1", "mp2", "mp4", "inproc"))
    if dtype is None:
        dtype = "float32" if device == "cpu" else "float16"
    model_dir, vocab, has_chat = resolve_model(model, smoke)
    if not has_chat:
        loads = tuple(x for x in loads if x != "chat")
    if num_blocks is None:              # enough for every sequence at full length: no preemption in either run
        num_blocks = max_num_seqs * -(-max_model_len // 16)
    llm_kwargs = dict(device=device, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      num_blocks=num_blocks, enable_prefix_caching=False)
    os.makedirs(out, exist_ok=True)
    print(benchlib.env_line())
    print(f"model {model_dir}; loads {loads}; servers {servers}; engine {llm_kwargs}", flush=True)

    # the loads: request specs for the clients, and (prompts, SamplingParams) for LLM.generate
    specs = {}
    offline_of = {}
    if "chat" in loads:
        messages = chat_messages(chat_requests, seed)
        specs["chat"] = (chat_specs(messages, chat_max_tokens), concurrency, None,
                         chat_specs(messages[:warmup], chat_max_tokens))

        def chat_offline(llm, SamplingParams):
            tok = llm.get_tokenizer()
            prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
            return prompts, [SamplingParams(**CHAT_SAMPLING, max_tokens=chat_max_tokens)] * len(prompts)
        offline_of["chat"] = chat_offline
    if "nano" in loads:
        prompts, out_lens = nano_workload(nano_requests, min_len, max_len, vocab, seed)
        specs["nano"] = (completion_specs(prompts, out_lens), concurrency, None,
                         completion_specs(prompts[:warmup], [min(n, 32) for n in out_lens[:warmup]]))

        def nano_offline(llm, SamplingParams, prompts=prompts, out_lens=out_lens):
            return prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
        offline_of["nano"] = nano_offline
    if "light" in loads:
        lp = light_prompts(light_requests, light_prompt_len, vocab, seed)
        specs["light"] = (completion_specs(lp, [16] * len(lp)), 1, 1,
                          completion_specs(light_prompts(2, light_prompt_len, vocab, seed + 1), [16, 16]))

    meta_base = dict(model=model_dir, loads=list(specs), servers=list(servers), engine=llm_kwargs,
                     chat_requests=chat_requests if "chat" in specs else 0, chat_max_tokens=chat_max_tokens,
                     chat_sampling=CHAT_SAMPLING, concurrency=concurrency,
                     decode_step_batch=min(max_num_seqs, concurrency),
                     client_processes=client_processes, nano_requests=nano_requests, min_len=min_len,
                     max_len=max_len, light_requests=light_requests, light_prompt_len=light_prompt_len,
                     stream_interval=stream_interval, smoke=smoke, seed=seed, fake_step_ms=fake_step_ms,
                     fake_prefill_ms=fake_prefill_ms, client=client,
                     env=benchlib.env_line())
    split = cpu_split(cpus) if hasattr(os, "sched_setaffinity") else None
    meta_base["cpu_split"] = {"server": split[0], "client": split[1]} if split else "off"
    if split:
        print(f"CPUs: server side (this process, the offline engine, the servers) {split[0]}, load generator "
              f"{split[1]}", flush=True)
    pool = ClientPool(client_processes, split[1] if split else None, client)   # before the offline LLM: CUDA-free
    if split:
        os.sched_setaffinity(0, split[0])           # the servers started from here inherit it
    try:
        offline, step_ms, num_blocks = offline_runs(model_dir, llm_kwargs,
                                                    {k: {"offline": offline_of.get(k)} for k in specs}, vocab,
                                                    min(max_num_seqs, concurrency), fake_step_ms,
                                                    lp if "light" in specs else None, fake_prefill_ms)
        llm_kwargs["num_blocks"] = num_blocks
        engine_args = ["--device", device, "--dtype", dtype, "--max-model-len", str(max_model_len),
                       "--max-num-seqs", str(max_num_seqs), "--num-blocks", str(num_blocks), "--no-prefix-caching",
                       "--stream-interval", str(stream_interval)]
        if fake_step_ms:
            from scripts import fake_engine
            engine_args += fake_engine.serve_flags(fake_step_ms, fake_prefill_ms)
        rows, failures, longest, arrivals = [], {}, 0.0, {}
        for name in servers:
            elapsed = time.monotonic() - t_start
            if time_budget_s is not None and elapsed + longest > time_budget_s:
                print(f"server {name}: skipped ({elapsed:.0f} s spent, the longest server took {longest:.0f} s, "
                      f"budget {time_budget_s} s)", flush=True)
                rows += [{"server": name, "load": load, "skipped": "time budget"} for load in specs]
                continue
            t0 = time.monotonic()
            proc, url = start_server(name, model_dir, engine_args, os.path.join(out, f"server_{name}.log"),
                                     server_timeout_s)
            started = time.monotonic() - t0
            if pin and split:
                print(f"server {name} pinned: {pin_server(proc.pid, split[0])}", flush=True)
            try:
                for load, (load_specs, conc, procs, warm_specs) in specs.items():
                    warm, _ = summarize(pool.run(url, warm_specs, min(conc, warmup), procs, request_timeout_s),
                                        warm_specs)
                    if warm["failed"]:
                        print(f"server {name} {load}: {warm['failed']} warm-up requests failed", flush=True)
                    steps0, _, _ = settled(url)
                    cpu0 = server_cpu_s(proc.pid)
                    results = pool.run(url, load_specs, conc, procs, request_timeout_s)
                    cpu1 = server_cpu_s(proc.pid)
                    row, errors = summarize(results, load_specs)
                    if replay_arrivals and load in offline_of and load not in arrivals:
                        first = min(r[4] for r in results)
                        arrivals[load] = (name, [r[4] - first for r in results])
                    row = {"server": name + ("-pinned" if pin and split else ""), "load": load, "concurrency": conc,
                           **row,
                           **cpu_columns(cpu0, cpu1, row["seconds"], row["output_tokens"])}
                    steps1, free, total = settled(url)
                    row.update(step_columns(steps0, steps1, row["seconds"], row["output_tokens"]))
                    row["kv_blocks_free_after"] = f"{free:.0f}/{total:.0f}" if free is not None else "no metric"
                    if free is None or free != total:
                        errors.append(f"KV blocks not all free after the load: {row['kv_blocks_free_after']}")
                    if "output_tok_s" in offline.get(load, {}):
                        row.update(against_offline(row, offline[load], step_ms))
                    row["server_start_s"] = started
                    rows.append(row)
                    if errors:
                        failures[f"{name} {load}"] = errors[:5]
                    nan = float("nan")
                    print(f"server {name} {load}: {row['output_tok_s']:.1f} output tok/s"
                          f" ({row.get('served_over_offline', nan):.3f}x offline), TTFT p50 "
                          f"{row.get('ttft_p50_ms', nan):.1f} ms, ITL p50 {row.get('itl_p50_ms', nan):.2f} ms, "
                          f"CPU ms per 1000 tokens: core {row.get('core_cpu_ms_per_ktok', nan):.0f}, API "
                          f"{row.get('api_cpu_ms_per_ktok', nan):.0f} (busiest API {row.get('api_busy_max', nan):.2f}), "
                          f"engine: {row.get('engine_steps', 0)} steps of {row.get('engine_step_ms', nan):.2f} ms, "
                          f"stepping {row.get('engine_stepping', nan):.2f} of the time, "
                          f"failed {row['failed']}, KV free {row['kv_blocks_free_after']}", flush=True)
            finally:
                stop_server(proc)
            longest = max(longest, time.monotonic() - t0)
            save_results(out, rows + list(offline.values()), failures, step_ms,
                         dict(meta_base, wall_s=time.monotonic() - t_start), final=False)
        for load, (name, times) in arrivals.items():
            row = replay_offline(model_dir, llm_kwargs, load, offline_of[load], times, fake_step_ms, fake_prefill_ms)
            row = {"server": f"offline@{name}", **row, "concurrency": min(max_num_seqs, concurrency)}
            if "output_tok_s" in offline.get(load, {}):
                row["offline_tok_s"] = offline[load]["output_tok_s"]
                row["served_over_offline"] = row["output_tok_s"] / row["offline_tok_s"]
            rows.append(row)
    finally:
        pool.close()
    rows += list(offline.values())
    table = save_results(out, rows, failures, step_ms, dict(meta_base, wall_s=time.monotonic() - t_start), final=True)
    print()
    print(table)
    if failures:
        raise SystemExit(f"failed requests: {json.dumps(failures)[:2000]}")
    return rows


def _names(text):
    return tuple(x.strip() for x in text.split(",") if x.strip())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for bench_serving.{json,md} and the server logs")
    ap.add_argument("--model", default="bundled", help="bundled | random (Qwen2.5-0.5B shapes) | a Qwen2 directory")
    ap.add_argument("--servers", type=_names, default=None,
                    help="comma-separated, run in this order: mp<N> (engine core + N API servers) | inproc "
                         "(default mp1,mp2,mp4,inproc; --smoke: mp2,inproc)")
    ap.add_argument("--loads", type=_names, default=("chat", "nano", "light"), help="chat,nano,light")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default: float16 (float32 on --device cpu)")
    ap.add_argument("--chat-requests", type=int, default=1024)
    ap.add_argument("--chat-max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256, help="streams at once (chat and nano loads)")
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--client", choices=("raw", "openai"), default="raw",
                    help="the load generator's client: raw (asyncio bytes) | openai (the official client)")
    ap.add_argument("--nano-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--light-requests", type=int, default=20)
    ap.add_argument("--light-prompt-len", type=int, default=100)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: skip the remaining servers when the next would likely pass it")
    ap.add_argument("--smoke", action="store_true", help="CPU, small loads; the tiny random model unless --model DIR")
    ap.add_argument("--fake-step-ms", type=float, default=None,
                    help="a synthetic device (steps of this many ms, random tokens): the serving overhead on a CPU")
    ap.add_argument("--fake-prefill-ms", type=float, default=None,
                    help="with --fake-step-ms: extra ms for a step holding a prompt chunk (a GPU's eager step)")
    ap.add_argument("--replay-arrivals", action="store_true",
                    help="after the servers, the offline engine fed the chat and nano requests at the times the "
                         "first server received them (the engine alone under the served arrival shape)")
    ap.add_argument("--cpu-split", default="auto",
                    help="auto: with >= 8 CPUs, half the physical cores for the server side (offline engine, "
                         "servers) and half for the load generator; off: shared; or SERVER:CLIENT lists (0-7:8-15)")
    ap.add_argument("--pin-server", action="store_true",
                    help="with a CPU split: each engine core on a CPU of its own, the API servers on the rest")
    a = ap.parse_args()
    main(a.out, a.model, a.servers, a.loads, a.device, a.dtype, a.chat_requests, a.chat_max_tokens, a.concurrency,
         a.client_processes, a.nano_requests, a.min_len, a.max_len, a.light_requests, a.light_prompt_len,
         a.max_model_len, a.max_num_seqs, a.num_blocks, a.stream_interval, a.warmup, time_budget_s=a.time_budget,
         smoke=a.smoke, fake_step_ms=a.fake_step_ms, fake_prefill_ms=a.fake_prefill_ms,
         replay_arrivals=a.replay_arrivals, cpus=a.cpu_split,
         pin=a.pin_server, client=a.client)
