"""Prometheus metrics of one server (its own registry, no module globals).

Server process. Latency histograms are observed by the serving layer as tokens stream out; engine
and connector state is read from the engine thread at scrape time. Names follow vLLM's
(`vllm:*` -> `pdserve:*`, `nixl_*` kept), and the ones routers and dashboards read are exported
a second time under vLLM's own names, labels and buckets (`vllm_metrics.py`), so they read pdserve unchanged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdserve.server.vllm_metrics import Twin, VLLMMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0)
_BYTES_BUCKETS = tuple(2 ** i for i in range(12, 34, 2))


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name
        self.vllm = v = VLLMMetrics(model_name, r)
        self.ttft = Twin(Histogram("pdserve:time_to_first_token_seconds", "Time to first token.",
                                   labels, buckets=_LATENCY_BUCKETS, registry=r), v.ttft)
        self.itl = Twin(Histogram("pdserve:inter_token_latency_seconds", "Time between output tokens.",
                                  labels, buckets=_LATENCY_BUCKETS, registry=r), *v.itl)
        self.e2e = Twin(Histogram("pdserve:e2e_request_latency_seconds", "End-to-end request latency.",
                                  labels, buckets=_LATENCY_BUCKETS, registry=r), v.e2e)
        self.prompt_tokens = Twin(Counter("pdserve:prompt_tokens", "Prompt tokens processed.", labels,
                                          registry=r), v.prompt_tokens)
        self.generation_tokens = Twin(Counter("pdserve:generation_tokens", "Tokens generated.", labels,
                                              registry=r), v.generation_tokens)
        self.requests = Twin(Counter("pdserve:request_success", "Finished requests by reason.",
                                     labels + ["finished_reason"], registry=r), v.requests)
        self.errors = Counter("pdserve:request_errors", "Rejected or failed requests by HTTP status.",
                              labels + ["status"], registry=r)
        g = {}
        for name, doc in [
            ("num_requests_running", "Requests in the running batch."),
            ("num_requests_waiting", "Requests queued for prefill."),
            ("num_requests_waiting_for_remote_kv", "P/D consumer requests waiting for their KV."),
            ("kv_blocks_free", "Free KV blocks."),
            ("kv_blocks_spare", "Free KV blocks reused first: caching nothing, or a spare copy of KV "
                                "another instance keeps (kv_transfer_params.spare_copy)."),
            ("kv_blocks_used", "KV blocks in use (owned, leased or quarantined)."),
            ("kv_blocks_quarantined", "KV blocks of expired leases kept out of reuse."),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use."),
            ("num_preemptions", "Preemptions since start."),
            ("kv_leases_active", "P/D producer requests holding blocks for a reader."),
            ("kv_transfer_warnings", "Conditions that make KV transfers slow (e.g. no shared-memory "
                                     "transport to a peer on this host); listed by /health."),
        ]:
            g[name] = Gauge(f"pdserve:{name}", doc, labels, registry=r)
        self.gauges = g
        # KV transfer (docs/design.md, "Metrics"); vLLM's NixlConnector names where they exist.
        self.xfer_time = Histogram("pdserve:nixl_xfer_time_seconds", "KV transfer duration.",
                                   labels, buckets=_TRANSFER_BUCKETS, registry=r)
        self.xfer_bytes = Histogram("pdserve:nixl_bytes_transferred", "Bytes per KV transfer.",
                                    labels, buckets=_BYTES_BUCKETS, registry=r)
        self.xfer_descs = Histogram("pdserve:nixl_num_descriptors", "Descriptors per KV transfer.",
                                    labels, buckets=_BYTES_BUCKETS[:8], registry=r)
        self.xfer_gbps = Histogram("pdserve:kv_transfer_throughput_gbps", "Throughput per transfer.",
                                   labels, buckets=(0.1, 0.5, 1, 2, 4, 8, 16, 32), registry=r)
        self.handshake_latency = Histogram("pdserve:nixl_handshake_latency_seconds",
                                           "Side-channel handshake latency.", labels,
                                           buckets=_TRANSFER_BUCKETS, registry=r)
        self._counter_docs = dict([
            ("nixl_handshakes", "Handshakes (one per distinct producer engine id)."),
            ("nixl_handshake_round_trips", "Side-channel round trips made for handshakes."),
            ("nixl_handshake_failures", "Failed handshakes."),
            ("nixl_num_failed_transfers", "Failed KV transfers."),
            ("nixl_num_failed_notifications", "Notifications received that could not be decoded."),
            ("kv_transfers", "Completed KV transfers (consumer side)."),
            ("kv_blocks_read", "KV blocks this instance READ from a peer."),
            ("kv_blocks_read_skipped", "KV blocks a READ skipped: the prompt's blocks this instance already "
                                       "cached (hashes agreeing with the producer's)."),
            ("kv_blocks_pulled", "KV blocks this producer READ from an instance caching a later turn's "
                                 "history (a decode instance) instead of computing them."),
            ("kv_blocks_claimed", "KV blocks other instances' producers claimed from this instance's "
                                  "prefix cache to READ."),
            ("kv_leases_expired", "Producer leases that expired before every read was notified."),
            ("kv_leases_released", "Producer leases released by the consumer (abort or failure)."),
            ("kv_heartbeats", "Heartbeats sent (consumer)."),
            ("kv_heartbeats_acked", "Heartbeats answered (producer)."),
            ("kv_notifications_ignored", "Unknown, late or duplicate notifications."),
            ("prompt_tokens_computed", "Prompt tokens this instance's model computed (not served "
                                       "by the prefix cache or a KV transfer)."),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's)."),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's)."),
        ])
        self._counter_values: dict[str, float] = {}
        r.register(self)  # collect() below: the engine's cumulative counts, as counters

    def update_engine(self, stats: dict) -> None:
        m = self.model
        g = self.gauges
        g["num_requests_running"].labels(m).set(stats["num_running"])
        g["num_requests_waiting"].labels(m).set(stats["num_waiting"])
        g["num_requests_waiting_for_remote_kv"].labels(m).set(stats["num_waiting_for_remote_kv"])
        free, total = stats["num_free_blocks"], stats["num_blocks"]
        g["kv_blocks_free"].labels(m).set(free)
        g["kv_blocks_spare"].labels(m).set(stats.get("num_spare_blocks", 0))
        g["kv_blocks_used"].labels(m).set(total - free)
        g["kv_blocks_quarantined"].labels(m).set(stats["num_quarantined_blocks"])
        g["kv_cache_usage_perc"].labels(m).set((total - free) / total)
        g["num_preemptions"].labels(m).set(stats["num_preemptions"])
        self.vllm.update_engine(stats)
        self._counter_values["prompt_tokens_computed"] = stats["num_prompt_tokens_computed"]
        self._counter_values["prefix_cache_queries"] = stats["num_prefix_cache_queries"]
        self._counter_values["prefix_cache_hits"] = stats["num_prefix_cache_hits"]
        kv = stats.get("kv_transfer")
        if kv:
            g["kv_leases_active"].labels(m).set(kv["leases_active"])
            g["kv_transfer_warnings"].labels(m).set(len(kv["warnings"]))
            self._counter_values.update(kv["counters"])
            for t in kv["transfers"]:
                self.xfer_time.labels(m).observe(t["duration_s"])
                self.xfer_bytes.labels(m).observe(t["num_bytes"])
                self.xfer_descs.labels(m).observe(t["num_descriptors"])
                if t["duration_s"] > 0:
                    self.xfer_gbps.labels(m).observe(t["num_bytes"] / t["duration_s"] / 1e9)
            for s in kv["handshake_latencies"]:
                self.handshake_latency.labels(m).observe(s)

    def collect(self):
        """Counters kept by the engine (and its connector), reported as they stand."""
        for name, doc in self._counter_docs.items():
            family = CounterMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            family.add_metric([self.model], self._counter_values.get(name, 0))
            yield family

    def render(self) -> bytes:
        return generate_latest(self.registry)
