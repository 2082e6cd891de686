"""The server's Prometheus metrics, in their own prometheus-client registry per server.

Two kinds, both exposed at scrape time by one custom collector:
  * recorded as requests run, by the engine's front (CoreClient, as it processes each step's tokens) through
    the four methods below: TTFT, inter-token latency and end-to-end latency histograms, prompt /
    generation token counters, finished requests by reason. These are plain Python numbers written under
    the front's lock, not prometheus-client's locked metric objects: an observation costs a bisect and an
    addition, which matters at one inter-token observation per token per stream;
  * read from the engine: running / waiting sequences, KV usage and free blocks, prefix-cache hit rate
    and its token counters, preemptions, engine steps, from the latest snapshot each engine core sent of
    its engine.metrics(), summed over the data-parallel ranks (aggregate_metrics), so a scrape never
    touches an engine.

Every name starts with `pagedattn_`; latencies are seconds (measured from the moment the front accepted
the request, so they include queueing), KV usage is a fraction in [0, 1].

Once the engine has stopped (a core died or the front was shut down: what makes /health answer 503),
`pagedattn_engine_alive` is 0 and the series read from the engine are left out: their last values would
be a dead engine's, stale for good. The scrape itself still succeeds (200), so the server's own series
(latencies, finished requests by reason, errors included) stay visible; alert on
`pagedattn_engine_alive == 0`.
"""
import bisect
import itertools

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST

# From 1 ms (a decode step on the GPU) to minutes (a long request on CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


# Engine metrics that add up over data-parallel ranks; the ratios are recomputed from the sums.
_SUMMED = ("num_blocks", "num_free_blocks", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
           "num_preemptions", "num_running", "num_waiting", "num_steps", "num_computed_tokens",
           "num_generated_tokens", "num_finished_requests", "step_time_s", "generation_throughput_tok_s",
           "total_throughput_tok_s")


def aggregate_metrics(snapshots):
    """One engine-metrics dict for several ranks' engine.metrics() dicts: counts summed (throughputs too:
    the ranks run side by side), KV usage and prefix-cache hit rate recomputed from the sums, the other
    ratios the worst rank's (fragmentation, peak KV usage) or the mean over ranks (latencies)."""
    snapshots = [s for s in snapshots if s]
    if not snapshots:
        return {}
    out = {"data_parallel_size": len(snapshots), "block_size": snapshots[0].get("block_size")}
    for key in _SUMMED:
        values = [s[key] for s in snapshots if s.get(key) is not None]
        if values:
            out[key] = sum(values)
    if out.get("num_blocks"):
        out["kv_cache_usage"] = 1.0 - out["num_free_blocks"] / out["num_blocks"]
    queried = out.get("prefix_cache_queried_tokens", 0)
    out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
    for key in ("kv_fragmentation", "mean_kv_fragmentation", "peak_kv_usage", "step_time_s"):
        values = [s[key] for s in snapshots if s.get(key) is not None]
        if values:
            out[key] = max(values)
    for key in ("mean_ttft_s", "mean_itl_s"):
        values = [s[key] for s in snapshots if s.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


class Histogram:
    """Bucket counts and a sum, written by one thread; `snapshot()` from any thread."""

    def __init__(self, bounds=LATENCY_BUCKETS):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)      # the last one: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value, count=1):
        self.counts[bisect.bisect_left(self.bounds, value)] += count     # first bound >= value: le semantics
        self.sum += value * count

    def snapshot(self):
        """([(le, cumulative count)] ending with "+Inf", sum)."""
        cumulative = list(itertools.accumulate(list(self.counts)))
        return [(repr(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])], self.sum

    @property
    def count(self):
        return sum(self.counts)


class ServingMetrics:
    """model_name: the `model_name` label on every series. snapshot: a callable returning the engine's
    metrics() dict (CoreClient.engine_metrics) plus "num_requests_in_flight", or None until `attach`.
    alive: a callable returning whether the engine still serves (CoreClient.is_alive), or None: then no
    pagedattn_engine_alive series and the engine's series are always shown."""

    HISTOGRAMS = [  # (metric, attribute, help)
        ("pagedattn_time_to_first_token_seconds", "ttft", "Time to first token (from acceptance)."),
        ("pagedattn_inter_token_latency_seconds", "itl", "Gap between consecutive tokens of one completion."),
        ("pagedattn_e2e_request_latency_seconds", "e2e", "Request latency, acceptance to finish."),
    ]

    def __init__(self, model_name, snapshot=None, alive=None):
        self.model_name = model_name
        self.snapshot = snapshot
        self.alive = alive
        self.ttft, self.itl, self.e2e = Histogram(), Histogram(), Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests = {}     # finish reason -> count
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    def attach(self, snapshot, alive=None):
        self.snapshot, self.alive = snapshot, alive

    # ---- recording (the front, under its lock) -------------------------------------------------------
    def first_token(self, ttft, num_prompt_tokens):
        self.ttft.observe(ttft)
        self.prompt_tokens += num_prompt_tokens

    def inter_token(self, gap, count=1):
        self.itl.observe(gap, count)

    def generated(self, num_tokens):
        self.generation_tokens += num_tokens

    def finished(self, reason, e2e):
        self.finished_requests[reason] = self.finished_requests.get(reason, 0) + 1
        self.e2e.observe(e2e)

    def render(self):
        """The Prometheus text exposition of every series (bytes)."""
        return generate_latest(self.registry)


class _Collector:
    """Everything ServingMetrics exposes, built at scrape time."""

    ENGINE_GAUGES = [  # (metric, snapshot key, help)
        ("pagedattn_num_requests_in_flight", "num_requests_in_flight",
         "Requests accepted and not finished (queued, running or waiting)."),
        ("pagedattn_num_requests_running", "num_running",
         "Sequences the scheduler is running (a request with n completions counts n)."),
        ("pagedattn_num_requests_waiting", "num_waiting", "Sequences waiting for KV blocks."),
        ("pagedattn_kv_cache_usage", "kv_cache_usage", "Fraction of the KV pool's blocks in use (0..1)."),
        ("pagedattn_kv_cache_free_blocks", "num_free_blocks", "Free KV blocks."),
        ("pagedattn_kv_cache_blocks", "num_blocks", "KV blocks in the pool."),
        ("pagedattn_prefix_cache_hit_rate", "prefix_cache_hit_rate",
         "Prompt tokens served by the prefix cache / prompt tokens looked up, since start."),
    ]
    FRONT_KEYS = ("num_requests_in_flight",)   # snapshot keys the front itself counts, not the engine
    ENGINE_COUNTERS = [
        ("pagedattn_prefix_cache_queries", "prefix_cache_queried_tokens",
         "Prompt tokens looked up in the prefix cache."),
        ("pagedattn_prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens the prefix cache served."),
        ("pagedattn_num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks."),
        ("pagedattn_engine_steps", "num_steps", "Engine steps run (summed over data-parallel ranks)."),
        ("pagedattn_engine_step_seconds", "step_time_s",
         "Seconds spent inside engine steps (summed over data-parallel ranks): with the steps, the mean step."),
        ("pagedattn_engine_computed_tokens", "num_computed_tokens",
         "Tokens run through the model: prompt chunks and decoded tokens."),
    ]

    def __init__(self, owner):
        self.owner = owner

    def collect(self):
        m = self.owner
        label = [m.model_name]
        for metric, attr, doc in m.HISTOGRAMS:
            buckets, total = getattr(m, attr).snapshot()
            h = HistogramMetricFamily(metric, doc, labels=["model_name"])
            h.add_metric(label, buckets, total)
            yield h
        for metric, value, doc in [
                ("pagedattn_prompt_tokens", m.prompt_tokens, "Prompt tokens of requests that started generating."),
                ("pagedattn_generation_tokens", m.generation_tokens, "Generated tokens.")]:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(label, value)
            yield c
        c = CounterMetricFamily("pagedattn_request_finished", "Finished requests by finish reason (stop, length, "
                                "abort: the client left, error: the request failed in the engine or its step failed, mixed: n > 1 "
                                "completions that ended differently); every accepted request counts once.", labels=["model_name", "finished_reason"])
        for reason, value in sorted(dict(m.finished_requests).items()):
            c.add_metric(label + [reason], value)
        yield c
        snap = m.snapshot() if m.snapshot is not None else {}
        if m.alive is not None:
            alive = bool(m.alive())
            g = GaugeMetricFamily("pagedattn_engine_alive", "1 while the engine serves; 0 once it has stopped "
                                  "(/health answers 503, the engine's own series are left out).", labels=["model_name"])
            g.add_metric(label, float(alive))
            yield g
            if not alive:               # a dead engine's last snapshot: stale for good; the front's count stays
                snap = {k: v for k, v in snap.items() if k in self.FRONT_KEYS}
        for metric, key, doc in self.ENGINE_GAUGES:
            if snap.get(key) is not None:
                g = GaugeMetricFamily(metric, doc, labels=["model_name"])
                g.add_metric(label, float(snap[key]))
                yield g
        for metric, key, doc in self.ENGINE_COUNTERS:
            if snap.get(key) is not None:
                c = CounterMetricFamily(metric, doc, labels=["model_name"])
                c.add_metric(label, float(snap[key]))
                yield c
