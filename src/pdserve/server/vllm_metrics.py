"""vLLM's own metric names beside pdserve's (docs/design.md, "Metrics").

Server process. Routers and dashboards built for vLLM (vllm-router, llm-d's scheduler, aiperf,
Grafana boards) look for `vllm:*` with the labels `model_name` and `engine` (the engine index, "0"
here: one engine per instance), and for vLLM's histogram buckets. The serving layer observes each
value once, through a `Twin` that feeds pdserve's metric and vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENGINE = "0"
LABELS = ["model_name", "engine"]
# vLLM's buckets (vllm/v1/metrics/loggers.py), so `le` thresholds in existing dashboards exist here too.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 series for counts (it stops at the model's context length; one series for all here)
_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))
_N_BUCKETS = (1, 2, 5, 10, 20)
# the phases of a finished request: (key, vLLM's name, vLLM's help)
_PHASES = (("queue", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
           ("prefill", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
           ("decode", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
           ("inference", "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request."))


class VLLMMetrics:
    def __init__(self, model_name: str, r: CollectorRegistry):
        self.model = model_name
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             LABELS, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             LABELS, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              LABELS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r)
        self.requests = Counter("vllm:request_success", "Count of successfully processed requests.",
                                LABELS + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=_TTFT_BUCKETS, registry=r)
        # vLLM exports inter-token latency under both names (time_per_output_token is the older one)
        self.itl = (Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              LABELS, buckets=_ITL_BUCKETS, registry=r),
                    Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", LABELS, buckets=_ITL_BUCKETS,
                              registry=r))
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=_REQUEST_BUCKETS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", LABELS,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", LABELS, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   LABELS, registry=r)
        self.phases = {key: Histogram(name, doc, LABELS, buckets=_REQUEST_BUCKETS, registry=r)
                       for key, name, doc in _PHASES}
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               LABELS, buckets=_COUNT_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", LABELS,
                                                   buckets=_COUNT_BUCKETS, registry=r)
        self.request_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", LABELS,
                                   buckets=_N_BUCKETS, registry=r)
        self.request_max_tokens = Histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", LABELS,
                                            buckets=_COUNT_BUCKETS, registry=r)
        self._seen = {"num_prefix_cache_queries": 0, "num_prefix_cache_hits": 0, "num_preemptions": 0}
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.ttft, *self.itl, self.e2e, self.prefix_queries, self.prefix_hits, self.preemptions,
                       *self.phases.values(), self.request_prompt_tokens, self.request_generation_tokens,
                       self.request_n, self.request_max_tokens):
            metric.labels(model_name, ENGINE)  # exported from the start, at zero, as vLLM does
        for reason in ("stop", "length", "abort"):
            self.requests.labels(model_name, ENGINE, reason)

    def update_engine(self, stats: dict) -> None:
        """The engine's state at scrape time; its cumulative counts move vLLM's counters by the change."""
        m = self.model
        self.running.labels(m, ENGINE).set(stats["num_running"])
        self.waiting.labels(m, ENGINE).set(stats["num_waiting"] + stats["num_waiting_for_remote_kv"])
        self.kv_usage.labels(m, ENGINE).set(1 - stats["num_free_blocks"] / stats["num_blocks"])
        for key, counter in (("num_prefix_cache_queries", self.prefix_queries),
                             ("num_prefix_cache_hits", self.prefix_hits), ("num_preemptions", self.preemptions)):
            counter.labels(m, ENGINE).inc(max(0, stats[key] - self._seen[key]))
            self._seen[key] = stats[key]

    def request_started(self, n: int, max_tokens: int | None) -> None:
        self.request_n.labels(self.model, ENGINE).observe(n)
        if max_tokens is not None:
            self.request_max_tokens.labels(self.model, ENGINE).observe(max_tokens)

    def request_finished(self, num_prompt_tokens: int, num_generated: int, arrival: float | None,
                         scheduled: float | None, first_token: float | None, now: float) -> None:
        """vLLM's per-request histograms, from one engine request's times on the server's monotonic
        clock: queue (arrival to first run), prefill (first run to first token), decode (first token
        to the end), inference (first run to the end). A request that never ran has no phases."""
        m = self.model
        self.request_prompt_tokens.labels(m, ENGINE).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(m, ENGINE).observe(num_generated)
        if arrival is None or scheduled is None:
            return
        phases = {"queue": scheduled - arrival, "inference": now - scheduled}
        if first_token is not None:
            phases.update(prefill=first_token - scheduled, decode=now - first_token)
        for key, seconds in phases.items():
            self.phases[key].labels(m, ENGINE).observe(max(0.0, seconds))


class Twin:
    """pdserve's metric and vLLM's, observed together: `labels(model, *rest)` gives a child whose
    `inc`/`observe` reaches both (vLLM's with its `engine` label after the model)."""

    def __init__(self, ours, *theirs):
        self.ours, self.theirs = ours, theirs

    def labels(self, model: str, *rest: str) -> "_TwinChild":
        return _TwinChild([self.ours.labels(model, *rest), *(t.labels(model, ENGINE, *rest) for t in self.theirs)])


class _TwinChild:
    def __init__(self, children: list):
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)
