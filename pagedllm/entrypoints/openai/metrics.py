"""GET /metrics: Prometheus text from the server's own CollectorRegistry.

The engine's counters and gauges (LLMEngine.get_metrics(), named ``pagedllm:*``) are read at scrape
time, on the engine thread; the latency histograms are fed by AsyncLLM as requests finish.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.engine.async_engine import AsyncLLM, RequestStats

# Monotonic engine metrics (exported with Prometheus' ``_total`` suffix); the rest are gauges.
_COUNTERS = {
    "pagedllm:num_preemptions": "Requests preempted (recomputed later) since start.",
    "pagedllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "pagedllm:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "pagedllm:prompt_tokens": "Prompt tokens of the requests added.",
    "pagedllm:prompt_tokens_computed": "Prompt tokens run through the model (recompute included).",
    "pagedllm:generation_tokens": "Tokens generated.",
    "pagedllm:request_success": "Requests finished (stopped or length-capped).",
    "pagedllm:request_aborted": "Requests aborted because their client went away.",
    "pagedllm:spec_decode_num_draft_tokens": "Draft tokens verified (speculative decoding).",
    "pagedllm:spec_decode_num_accepted_tokens": "Draft tokens accepted (speculative decoding).",
}
_GAUGES = {
    "pagedllm:num_requests_running": "Requests in the running batch.",
    "pagedllm:num_requests_waiting": "Requests waiting to be scheduled.",
    "pagedllm:kv_cache_usage_perc": "Share of KV cache blocks in use (0..1).",
    "pagedllm:num_gpu_blocks": "KV cache blocks allocated.",
}
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Yields the latest engine snapshot as metric families at every scrape."""

    def __init__(self) -> None:
        self.snapshot: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        for name, value in self.snapshot.items():
            if name in _COUNTERS:
                yield CounterMetricFamily(name, _COUNTERS[name], value=value)
            else:  # unknown names are gauges: a gauge may go either way, a counter may not
                yield GaugeMetricFamily(name, _GAUGES.get(name, f"Engine metric {name}."), value=value)


class ServerMetrics:
    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, registry=self.registry, buckets=_LATENCY_BUCKETS)

        self.ttft = histogram("pagedllm:time_to_first_token_seconds", "Time to the first token.")
        self.itl = histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("pagedllm:request_queue_time_seconds", "Arrival to first scheduled.")
        llm.stat_loggers.append(self.observe)

    def observe(self, stats: RequestStats) -> None:
        self.e2e.observe(stats.e2e)
        if stats.ttft is not None:
            self.ttft.observe(stats.ttft)
        if stats.queue is not None:
            self.queue.observe(stats.queue)
        for t in stats.inter_token:
            self.itl.observe(t)

    async def render(self) -> bytes:
        try:
            self._engine.snapshot = await self.llm.get_metrics()
        except Exception:  # noqa: BLE001 - a dead engine still serves its histograms
            self._engine.snapshot = {}
        return generate_latest(self.registry)
