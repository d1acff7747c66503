"""Prometheus metrics of the proxy: latency as the client sees it (docs/design.md, "Metrics"). Proxy process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 20.0, 40.0)


class ProxyMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_proxy:time_to_first_token_seconds",
                              "Time to the first streamed token.", buckets=_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_proxy:time_per_output_token_seconds",
                              "Mean time per output token after the first.", buckets=_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_proxy:inter_token_latency_seconds",
                             "Time between streamed events.", buckets=_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_proxy:e2e_request_latency_seconds", "End-to-end latency.",
                             buckets=_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve_proxy:prefill_latency_seconds",
                                 "Time for the prefill instance to answer.", buckets=_BUCKETS, registry=r)
        self.requests = Counter("pdserve_proxy:requests", "Requests by outcome.", ["outcome"],
                                registry=r)
        self.upstream_errors = Counter("pdserve_proxy:upstream_errors",
                                       "Upstream failures by role.", ["role"], registry=r)
        self.upstream_requests = Counter("pdserve_proxy:upstream_requests",
                                         "Requests sent to each instance, by outcome (ok, refused: a 503 "
                                         "or 5xx, unreachable).", ["role", "upstream", "outcome"], registry=r)
        self.decisions = Counter("pdserve_proxy:pd_decisions",
                                 "Where prompts were prefilled: remote (a producer) or local (decode).",
                                 ["decision"], registry=r)
        self.retries = Counter("pdserve_proxy:retries", "Requests moved to another instance.", ["role"],
                               registry=r)
        self.releases = Counter("pdserve_proxy:lease_releases",
                                "Producer leases the proxy handed back (no decode took the request).",
                                registry=r)
        self.outstanding = Gauge("pdserve_proxy:upstream_outstanding", "Requests in flight per instance.",
                                 ["role", "upstream"], registry=r)
        self.prompt_mismatches = Counter(
            "pdserve_proxy:prompt_token_mismatches",
            "Prompts the proxy tokenized to another length than the producer counted (another template "
            "or tokenizer: routing by blocks misses; answers are unaffected).", registry=r)
        self.prompt_tokens = Counter(
            "pdserve_proxy:prompt_tokens_placed",
            "Prompt tokens of requests placed by the KV index (kv-aware routing, prompt tokenized).", registry=r)
        self.prompt_tokens_cached = Counter(
            "pdserve_proxy:prompt_tokens_cached_anywhere",
            "Of those, the longest prefix any one instance cached when the request was placed: the hit "
            "rate routing could reach at most, beside the instances' own (prompt tokens not computed).",
            registry=r)
        self.healthy = Gauge("pdserve_proxy:upstream_healthy", "1 if the instance answered its last probe.",
                             ["role", "upstream"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
