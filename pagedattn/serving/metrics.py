"""The server's Prometheus metrics (prometheus-client), in their own registry per server.

Two kinds:
  * recorded as requests run, by AsyncLLM's engine thread through the four methods below: TTFT,
    inter-token latency and end-to-end latency histograms, prompt / generation token counters,
    finished requests by reason;
  * read from the engine when scraped (EngineCollector): running / waiting sequences, KV usage and free
    blocks, prefix-cache hit rate and its token counters, preemptions, from AsyncLLM's latest snapshot
    of engine.metrics() (taken by the engine thread, so a scrape never touches the engine itself).

Every name starts with `pagedattn_`; latencies are seconds (measured from the moment AsyncLLM accepted
the request, so they include queueing), KV usage is a fraction in [0, 1].
"""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST

# From 1 ms (a decode step on the GPU) to minutes (a long request on CPU).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServingMetrics:
    """model_name: the `model_name` label on every series. snapshot: a callable returning the engine's
    metrics() dict (AsyncLLM.engine_metrics) plus "num_requests_in_flight", or None until `attach`."""

    def __init__(self, model_name, snapshot=None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("pagedattn_time_to_first_token_seconds", "Time to first token (from acceptance).",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("pagedattn_inter_token_latency_seconds",
                             "Gap between consecutive tokens of one completion.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagedattn_e2e_request_latency_seconds", "Request latency, acceptance to finish.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = Counter("pagedattn_prompt_tokens", "Prompt tokens of requests that started "
                                     "generating.", labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("pagedattn_generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry).labels(model_name)
        self.requests = Counter("pagedattn_request_finished", "Finished requests by finish reason "
                                "(stop, length, abort: the client left, error: a failed step, mixed: n > 1 "
                                "completions that ended differently).", labels + ["finished_reason"],
                                registry=self.registry)
        self.snapshot = snapshot
        self.registry.register(EngineCollector(self))

    def attach(self, snapshot):
        self.snapshot = snapshot

    # ---- recording (AsyncLLM's engine thread) -------------------------------------------------------
    def first_token(self, ttft, num_prompt_tokens):
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def inter_token(self, gap, count=1):
        for _ in range(count):
            self.itl.observe(gap)

    def generated(self, num_tokens):
        self.generation_tokens.inc(num_tokens)

    def finished(self, reason, e2e):
        self.requests.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e)

    def render(self):
        """The Prometheus text exposition of every series (bytes)."""
        return generate_latest(self.registry)


class EngineCollector:
    """Engine state as gauges and counters, read at scrape time from the latest snapshot."""

    GAUGES = [  # (metric, snapshot key, help)
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
    COUNTERS = [
        ("pagedattn_prefix_cache_queries", "prefix_cache_queried_tokens", "Prompt tokens looked up in the "
         "prefix cache."),
        ("pagedattn_prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens the prefix cache served."),
        ("pagedattn_num_preemptions", "num_preemptions", "Sequences preempted for lack of KV blocks."),
    ]

    def __init__(self, owner):
        self.owner = owner

    def collect(self):
        snap = self.owner.snapshot() if self.owner.snapshot is not None else {}
        name = self.owner.model_name
        for metric, key, doc in self.GAUGES:
            if snap.get(key) is not None:
                g = GaugeMetricFamily(metric, doc, labels=["model_name"])
                g.add_metric([name], float(snap[key]))
                yield g
        for metric, key, doc in self.COUNTERS:
            if snap.get(key) is not None:
                c = CounterMetricFamily(metric, doc, labels=["model_name"])
                c.add_metric([name], float(snap[key]))
                yield c
