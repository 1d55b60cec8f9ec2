"""Prometheus metrics, named like vLLM's under a `burstserve:` prefix, label `model_name`."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from burstserve.engine.core.messages import EngineFigures
from burstserve.engine.core.outputs import PrefillStats, StepOutput

disable_created_metrics()   # no `_created` series beside each counter and histogram (as vLLM)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                   320.0, 640.0, 1280.0)          # prompts of a million tokens take minutes
TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
THROUGHPUT_BUCKETS = (100, 1e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2e5, 4e5, 8e5, 1.6e6)
FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("burstserve:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("burstserve:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("burstserve:time_per_output_token_seconds", "Time between output tokens.", lab,
                              buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.prefill = Histogram("burstserve:request_prefill_time_seconds", "Prefill time measured on the workers.",
                                 lab, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_tps = Histogram("burstserve:prefill_throughput_tokens_per_second",
                                     "Prompt tokens per second of prefill.", lab, buckets=THROUGHPUT_BUCKETS, registry=r)
        self.ring_exchange = Histogram("burstserve:ring_exchange_seconds",
                                       "Per prefill: the ring's K/V exchanges, timed alone.", lab,
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ring_exposed = Histogram("burstserve:ring_exchange_exposed_seconds",
                                      "Per prefill: time compute waited for K/V exchanges.", lab,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ring_hidden = Histogram("burstserve:ring_exchange_hidden_fraction",
                                     "Per prefill: share of the exchange time hidden behind attention.", lab,
                                     buckets=FRACTION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("burstserve:prompt_tokens", "Prompt tokens of requests, those taken from the "
                                     "prefix cache included (prefix_cache_hits_total counts those).", lab, registry=r)
        self.generation_tokens = Counter("burstserve:generation_tokens", "Generated tokens.", lab, registry=r)
        self.success = Counter("burstserve:request_success", "Finished requests.", lab + ["finished_reason"],
                               registry=r)
        self.running = Gauge("burstserve:num_requests_running", "Requests decoding.", lab, registry=r)
        self.waiting = Gauge("burstserve:num_requests_waiting", "Requests waiting for prefill.", lab, registry=r)
        self.preemptions = Counter("burstserve:num_preemptions", "Sequences preempted (KV cache full) and "
                                   "recomputed later.", lab, registry=r)
        self.preemptions.labels(self.model_name)   # exported as 0 from the start (dashboards graph a rate of it)
        self._preemptions_seen = 0
        self.prefix_queries = Counter("burstserve:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", lab, registry=r)
        self.prefix_hits = Counter("burstserve:prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(not prefilled again).", lab, registry=r)
        self.recomputed = Counter("burstserve:num_recomputed_tokens", "Tokens prefilled again to resume "
                                  "preempted sequences (those found in the prefix cache not counted).", lab, registry=r)
        # the KV host tier (--kv-offload-gb, engine/pages/host_pool.py)
        self.host_hits = Counter("burstserve:prefix_cache_host_hits", "Prompt tokens restored from the KV host "
                                 "tier (also counted in prefix_cache_hits).", lab, registry=r)
        self.host_evicted = Counter("burstserve:kv_host_evicted_tokens", "Tokens evicted from the KV host tier.",
                                    lab, registry=r)
        self.offload_stored = Counter("burstserve:kv_offload_stored_bytes", "Bytes copied to the KV host tier "
                                      "(worker 0's).", lab, registry=r)
        self.offload_restored = Counter("burstserve:kv_offload_restored_bytes", "Bytes restored from the KV host "
                                        "tier (worker 0's).", lab, registry=r)
        self.restore_seconds = Histogram("burstserve:kv_offload_restore_seconds", "Per prompt restored from the KV "
                                         "host tier: the copy's time (worker 0's).", lab, buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.host_usage = Gauge("burstserve:kv_host_cache_usage_perc", "KV host tier usage per worker (0-1): tokens "
                                "held over capacity.", lab + ["worker"], registry=r)
        self.host_capacity = Gauge("burstserve:kv_host_cache_capacity_tokens", "KV host tier capacity per worker, "
                                   "tokens (0: no tier).", lab, registry=r)
        self._counters = {"prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                          "num_recomputed_tokens": self.recomputed, "prefix_cache_host_hits": self.host_hits,
                          "kv_host_evicted_tokens": self.host_evicted, "kv_offload_stored_bytes": self.offload_stored,
                          "kv_offload_restored_bytes": self.offload_restored}
        for counter in self._counters.values():
            counter.labels(self.model_name)
        self._seen = dict.fromkeys(self._counters, 0)
        self.kv_usage = Gauge("burstserve:kv_cache_usage_perc", "KV cache usage per worker (0-1).",
                              lab + ["worker"], registry=r)

    def first_token(self, item: StepOutput, arrival: float, prompt_tokens: int) -> None:
        m = self.model_name
        self.ttft.labels(m).observe(item.time - arrival)
        stats = item.prefill or PrefillStats()
        if not stats.shared_prefill:   # a choice that forked a running prompt's K/V prefilled nothing
            self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc()
        if stats.prefill_seconds:
            self.prefill.labels(m).observe(stats.prefill_seconds)
            self.prefill_tps.labels(m).observe(prompt_tokens / stats.prefill_seconds)
        if stats.exchange_seconds is not None:
            self.ring_exchange.labels(m).observe(stats.exchange_seconds)
            self.ring_exposed.labels(m).observe(stats.exposed_seconds)
            self.ring_hidden.labels(m).observe(stats.hidden_fraction)
        if stats.restore_seconds is not None:
            self.restore_seconds.labels(m).observe(stats.restore_seconds)

    def next_token(self, gap_seconds: float) -> None:
        self.tpot.labels(self.model_name).observe(gap_seconds)
        self.generation_tokens.labels(self.model_name).inc()

    def finished(self, reason: str, e2e_seconds: float) -> None:
        self.e2e.labels(self.model_name).observe(e2e_seconds)
        self.success.labels(self.model_name, reason).inc()

    def render(self, figures: EngineFigures) -> bytes:
        """The exposition text, with the gauges refreshed from worker 0's latest figures."""
        m = self.model_name
        self.running.labels(m).set(figures.running)
        self.waiting.labels(m).set(figures.waiting)
        capacity = figures.kv_capacity_per_worker
        for worker, tokens in enumerate(figures.kv_tokens_per_worker):
            self.kv_usage.labels(m, str(worker)).set(tokens / capacity if capacity else 0.0)
        if figures.num_preemptions > self._preemptions_seen:   # worker 0 counts; the counter follows it
            self.preemptions.labels(m).inc(figures.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = figures.num_preemptions
        host_capacity = figures.kv_host_capacity_per_worker
        self.host_capacity.labels(m).set(host_capacity)
        for worker, tokens in enumerate(figures.kv_host_tokens_per_worker):
            self.host_usage.labels(m, str(worker)).set(tokens / host_capacity if host_capacity else 0.0)
        for key, counter in self._counters.items():
            value = getattr(figures, key)
            if value > self._seen[key]:        # worker 0 counts; the counters follow it
                counter.labels(m).inc(value - self._seen[key])
                self._seen[key] = value
        return generate_latest(self.registry)
