"""Online serving benchmark: Poisson arrivals at several request rates against `python -m pagedattn serve`,
beside the offline LLM.generate throughput on the same requests, in one run.

Requests: the nano-vllm workload (scripts/benchlib.py): --num-requests prompts of random token ids with
lengths uniform in [--min-len, --max-len] and output lengths drawn the same way, greedy, ignore_eos
(every request generates exactly its output length, so served and offline runs do the same work).

1. Offline: LLM(...) in this process, a warm-up, then LLM.generate on all requests at once:
   output tokens / wall seconds. The LLM is then freed.
2. Online: the server as a subprocess with the same engine settings (prefix caching off in both, as every
   rate replays the same prompts; its log goes to <out>/server_stream_interval_<K>.log),
   a warm-up, then for each rate in --rates (requests/s; "inf" = all at once): requests sent at Poisson
   arrival times (seeded), each a streamed /v1/completions call with
   stream_options.continuous_usage_stats, so every chunk says how many tokens it brings. Measured on the
   client: TTFT (send -> first chunk with a token), ITL (each chunk's gap since the previous one, split
   evenly over the tokens it brings), end-to-end latency (send -> [DONE]), and throughput
   (output tokens / (last [DONE] - first send)). After every rate the server's /metrics must show every
   KV block free again.
3. The saturating rate again on a server started with --stream-interval K for each K of
   --extra-stream-intervals (default 8): a chunk per K tokens, so the HTTP thread's share of the GIL
   shrinks; the difference to the K = 1 row is what per-token chunks cost.

The "inf" row is the saturated server: its throughput over the offline one is the `served / offline`
column (goal >= 0.9). Table (markdown) + JSON + PNG under --out.

    python scripts/bench_serving.py --out OUT                          # the bundled model, GPU defaults
    python scripts/bench_serving.py --model random --out OUT           # random Qwen2.5-0.5B weights (no tokenizer)
    python scripts/bench_serving.py --smoke --out OUT                  # seconds on CPU: tiny random model
"""
import argparse
import asyncio
import gc
import json
import math
import os
import random
import socket
import subprocess
import sys
import time

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import benchlib  # noqa: E402

now = time.perf_counter
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


# ---- the requests ------------------------------------------------------------------------------------
def workload(num_requests, min_len, max_len, vocab_size, seed=0):
    """(prompts as token-id lists, output lengths): benchlib's nano-vllm workload, ids folded into the vocab."""
    prompts, out_lens = benchlib.nano_vllm_workload(num_requests, min_len, max_len, seed)
    return [[t % vocab_size for t in p] for p in prompts], out_lens


def arrival_times(n, rate, seed=0):
    """Seconds after the start at which each of n requests is sent: a Poisson process of `rate` per second
    (exponential gaps), or all at 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---- the client ----------------------------------------------------------------------------------------
async def stream_one(client, url, model, prompt, max_tokens):
    """One streamed completion; returns {ok, tokens, ttft, itls, e2e, start, end, error}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    res = {"ok": False, "tokens": 0, "ttft": None, "itls": [], "e2e": None, "error": None}
    start = now()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            buf = b""
            async for data in r.aiter_bytes():
                t = now()
                buf += data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    payload = event.removeprefix(b"data: ")
                    if payload == b"[DONE]":
                        res["ok"] = res["error"] is None
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        res["error"] = chunk["error"]["message"]
                        continue
                    total = chunk["usage"]["completion_tokens"]
                    new = total - res["tokens"]
                    if new <= 0:
                        continue
                    if last is None:
                        res["ttft"] = t - start
                    else:
                        res["itls"] += [(t - last) / new] * new
                    last, res["tokens"] = t, total
    except Exception as e:              # noqa: BLE001 (reported per request)
        res["error"] = repr(e)
    res["start"], res["end"] = start, now()
    res["e2e"] = res["end"] - start
    return res


async def run_rate(url, model, prompts, out_lens, rate, seed=0):
    """Send every request at its Poisson arrival time; returns the per-request results."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        t0 = now()
        tasks = []
        for prompt, n, at in zip(prompts, out_lens, arrival_times(len(prompts), rate, seed)):
            delay = t0 + at - now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(stream_one(client, url, model, prompt, n)))
        return await asyncio.gather(*tasks)


def summarize(results, out_lens, rate):
    """One table row from a rate's results (latencies in ms)."""
    ok = [r for r, n in zip(results, out_lens) if r["ok"] and r["tokens"] == n]
    errors = [r["error"] or f"{r['tokens']} tokens" for r in results if r not in ok]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    row = {"rate": "inf" if math.isinf(rate) else rate, "requests": len(results), "failed": len(errors),
           "seconds": span, "req_s": len(results) / span, "output_tok_s": tokens / span}
    for name, xs in [("ttft", [r["ttft"] for r in ok if r["ttft"] is not None]),
                     ("itl", [x for r in ok for x in r["itls"]]), ("e2e", [r["e2e"] for r in ok])]:
        for q, v in benchlib.percentiles([1000 * x for x in xs]).items():
            row[f"{name}_{q}_ms"] = v
    return row, errors


# ---- the server ----------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, engine_args, log_path, timeout_s, extra_args=()):
    """`python -m pagedattn serve` as a subprocess; returns (Popen, base url) once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "pagedattn", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", "bench", "--log-level", "warning", *engine_args, *extra_args]
    log = open(log_path, "w")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"the server exited with code {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not answer /health within {timeout_s} s; log: {log_path}")
        time.sleep(0.5)


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_blocks(url):
    """(free KV blocks, pool size) from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              for s in f.samples}
    return values.get("pagedattn_kv_cache_free_blocks"), values.get("pagedattn_kv_cache_blocks")


def wait_until_free(url, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = free_blocks(url)
        if free == total or time.monotonic() > deadline:
            return free, total
        time.sleep(0.1)


# ---- offline -------------------------------------------------------------------------------------------
def offline_throughput(model_dir, llm_kwargs, prompts, out_lens, warmup):
    """Output tok/s of LLM.generate on all requests at once (after a warm-up generate of `warmup` of them)."""
    import torch

    from pagedattn import LLM, SamplingParams

    llm = LLM(model_dir, **llm_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:warmup], params[:warmup], use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = now()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = now() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(out_lens), f"offline run generated {tokens} tokens, expected {sum(out_lens)}"
    num_blocks = llm.engine.num_blocks
    llm.close()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rate": "offline", "requests": len(prompts), "failed": 0, "seconds": seconds,
            "req_s": len(prompts) / seconds, "output_tok_s": tokens / seconds}, num_blocks


# ---- main ----------------------------------------------------------------------------------------------
def resolve_model(model, smoke):
    if smoke:
        import torch
        return benchlib.random_checkpoint(TINY, dtype=torch.float32, device="cpu"), TINY["vocab_size"]
    if model == "random":
        import torch
        cfg = benchlib.QWEN2_CONFIGS["0.5b"]
        return benchlib.random_checkpoint("0.5b", dtype=torch.float16), cfg["vocab_size"]
    if model in (None, "bundled"):
        from pagedattn.bundled import bundled_model_path
        model = bundled_model_path()
    with open(os.path.join(model, "config.json")) as f:
        return model, json.load(f)["vocab_size"]


def serve_rates(model_dir, engine_args, out, log_name, server_timeout_s, server_args, prompts, out_lens, rates, warmup,
                seed):
    """Start a server, warm it up, run every rate; returns (rows, {rate: errors}). The server is stopped."""
    proc, url = start_server(model_dir, engine_args, os.path.join(out, log_name), server_timeout_s, server_args)
    rows, failures = [], {}
    try:
        asyncio.run(run_rate(url, "bench", prompts[:warmup], out_lens[:warmup], math.inf, seed))
        for rate in rates:
            results = asyncio.run(run_rate(url, "bench", prompts, out_lens, rate, seed))
            row, errors = summarize(results, out_lens, rate)
            free, total = wait_until_free(url)
            row["kv_blocks_free_after"] = f"{free:.0f}/{total:.0f}"
            if free != total:
                errors.append(f"{total - free:.0f} KV blocks still held after the run")
            rows.append(row)
            if errors:
                failures[row["rate"]] = errors[:5]
            nan = float("nan")
            print(f"{log_name}: rate {row['rate']}: {row['output_tok_s']:.1f} output tok/s, TTFT p50 "
                  f"{row.get('ttft_p50_ms', nan):.1f} ms, ITL p50 {row.get('itl_p50_ms', nan):.2f} ms, "
                  f"failed {row['failed']}", flush=True)
    finally:
        stop_server(proc)
    return rows, failures


def main(out, model="bundled", rates=(4.0, 16.0, 32.0, math.inf), num_requests=256, min_len=100, max_len=1024,
         device="auto", max_model_len=2048, max_num_seqs=256, num_blocks=None, warmup=8, server_timeout_s=600,
         server_args=(), extra_stream_intervals=(8,), smoke=False, seed=0):
    """Run the benchmark; returns the table rows (also written under `out`).

    The server runs every rate with --stream-interval 1 (a chunk per token, what OpenAI clients expect),
    then once more per entry of extra_stream_intervals, at the saturating rate (inf) only: how much of the
    gap to offline is the HTTP thread's per-chunk work."""
    if smoke:
        rates, num_requests, min_len, max_len, device = (8.0, math.inf), 12, 4, 24, "cpu"
        max_model_len, max_num_seqs, num_blocks, warmup, extra_stream_intervals = 64, 8, num_blocks or 64, 2, (4,)
    model_dir, vocab = resolve_model(model, smoke)
    prompts, out_lens = workload(num_requests, min_len, max_len, vocab, seed)
    if num_blocks is None:              # enough for every sequence at full length: no preemption in either run
        num_blocks = max_num_seqs * -(-max_model_len // 16)
    # prefix caching off in both: every rate replays the same prompts, which a warm cache would skip
    llm_kwargs = dict(device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                      enable_prefix_caching=False)
    print(benchlib.env_line())
    print(f"model {model_dir}: {num_requests} requests, prompts {min_len}-{max_len} tokens, outputs "
          f"{min_len}-{max_len} tokens ({sum(out_lens)} in all), engine {llm_kwargs}", flush=True)

    offline, num_blocks = offline_throughput(model_dir, llm_kwargs, prompts, out_lens, warmup)
    print(f"offline LLM.generate: {offline['output_tok_s']:.1f} output tok/s ({offline['seconds']:.2f} s)", flush=True)

    os.makedirs(out, exist_ok=True)
    engine_args = ["--device", device, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                   "--num-blocks", str(num_blocks), "--no-prefix-caching"]
    rows, failures = [], {}
    for interval in (1, *extra_stream_intervals):
        config_rates = rates if interval == 1 else (math.inf,)
        got, errs = serve_rates(model_dir, engine_args, out, f"server_stream_interval_{interval}.log",
                                server_timeout_s, [*server_args, "--stream-interval", str(interval)], prompts,
                                out_lens, config_rates, warmup, seed)
        for row in got:
            row["stream_interval"] = interval
        rows += got
        failures.update({f"{rate} (stream interval {interval})": e for rate, e in errs.items()})
    for row in rows:
        row["served_over_offline"] = row["output_tok_s"] / offline["output_tok_s"]
    rows.append(offline)

    columns = ["rate", "stream_interval", "requests", "failed", "seconds", "req_s", "output_tok_s",
               "served_over_offline", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
               "itl_p99_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "kv_blocks_free_after"]
    table = benchlib.markdown_table(rows, columns)
    meta = dict(model=model_dir, num_requests=num_requests, min_len=min_len, max_len=max_len, seed=seed,
                engine=llm_kwargs, server_args=list(server_args), total_output_tokens=sum(out_lens),
                failures=failures, smoke=smoke)
    benchlib.save(out, "bench_serving", rows, meta, table)
    served = [r for r in rows if r["rate"] != "offline" and r["stream_interval"] == 1]
    xs = [r["rate"] if r["rate"] != "inf" else 2 * max([x for x in rates if not math.isinf(x)], default=1)
          for r in served]
    benchlib.save_plot(os.path.join(out, "bench_serving.png"), xs,
                       {"served output tok/s": [r["output_tok_s"] for r in served],
                        "offline LLM.generate": [offline["output_tok_s"]] * len(served)},
                       "request rate (req/s; the last point: all at once)", "output tok/s",
                       "Served throughput vs offline", logx=True)
    benchlib.save_plot(os.path.join(out, "bench_serving_latency.png"), xs,
                       {"TTFT p50": [r.get("ttft_p50_ms") for r in served],
                        "TTFT p99": [r.get("ttft_p99_ms") for r in served],
                        "ITL p50": [r.get("itl_p50_ms") for r in served],
                        "ITL p99": [r.get("itl_p99_ms") for r in served]},
                       "request rate (req/s; the last point: all at once)", "ms", "Latency vs request rate",
                       logx=True, logy=True)
    print()
    print(table)
    if failures:
        raise SystemExit(f"failed requests: {json.dumps(failures)[:2000]}")
    return rows


def _rates(text):
    return tuple(math.inf if r.strip() == "inf" else float(r) for r in text.split(","))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for bench_serving.{json,md,png} and server.log")
    ap.add_argument("--model", default="bundled", help="bundled | random (Qwen2.5-0.5B shapes) | a Qwen2 directory")
    ap.add_argument("--rates", type=_rates, default=(4.0, 16.0, 32.0, math.inf), help="req/s list, e.g. 4,16,inf")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--server-args", default="", help="extra `serve` options, e.g. '--switch-interval-ms 0.5'")
    ap.add_argument("--extra-stream-intervals", default="8",
                    help="after the rates at --stream-interval 1, the saturating rate again at each of these "
                         "(comma-separated; '' for none)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on CPU, 12 requests, two rates")
    a = ap.parse_args()
    main(a.out, a.model, a.rates, a.num_requests, a.min_len, a.max_len, a.device, a.max_model_len, a.max_num_seqs,
         a.num_blocks, server_args=a.server_args.split(),
         extra_stream_intervals=tuple(int(k) for k in a.extra_stream_intervals.split(",") if k), smoke=a.smoke)
