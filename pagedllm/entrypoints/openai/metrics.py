"""GET /metrics: Prometheus text under vLLM's names, so vLLM's dashboards and alerts work as they are.

Every series carries vLLM's labels ``model_name`` (the first served name) and ``engine``: "0" for
one engine core, "0" .. "N-1" for ``--data-parallel-size N``, where each replica's engine series
are its own and each request's series (latencies, finish reasons, tokens) go to the replica that
served it, as vLLM's per-engine loggers do; sum over ``engine`` for the whole server. Counters get
Prometheus' ``_total`` suffix, as vLLM's do; buckets are vLLM's.
Three sources feed it:

* the engine's counters and gauges (``LLMEngine.get_metrics()``, a dict keyed ``pagedllm:*``),
  read on the engine thread at scrape time and renamed here (:data:`_ENGINE_SERIES`);
* AsyncLLM's per-request latencies (``RequestStats``: TTFT, inter-token gaps, e2e, queue time);
* what the server sees of each finished request (:meth:`ServerMetrics.observe`): its finish
  reason, token counts, ``n`` and ``max_tokens``, and its prefill / decode / inference times;
* every engine step (``LLMEngine.step_observers``): the tokens it computed.

A pagedllm counter with no vLLM counterpart keeps its ``pagedllm:`` name (prompt tokens
actually computed, recompute included); any engine key not listed is exported as a gauge under
its own name, so a new engine metric shows up without a change here.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.engine.async_engine import AsyncLLM, RequestStats
from pagedllm.outputs import RequestOutput

LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")

# engine key -> (exported name, "counter" | "gauge", help); a key may feed several series.
_ENGINE_SERIES: dict[str, list[tuple[str, str, str]]] = {
    "pagedllm:num_requests_running": [("vllm:num_requests_running", "gauge",
                                       "Number of requests in model execution batches.")],
    "pagedllm:num_requests_waiting": [("vllm:num_requests_waiting", "gauge",
                                       "Number of requests waiting to be processed.")],
    "pagedllm:kv_cache_usage_perc": [
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
        # vLLM's older name, still read by its example Grafana dashboard.
        ("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. DEPRECATED: use vllm:kv_cache_usage_perc.")],
    "pagedllm:num_preemptions": [("vllm:num_preemptions", "counter",
                                  "Cumulative number of preemption from the engine.")],
    "pagedllm:prefix_cache_queries": [("vllm:prefix_cache_queries", "counter",
                                       "Prefix cache queries, in terms of number of queried tokens.")],
    "pagedllm:prefix_cache_hits": [("vllm:prefix_cache_hits", "counter",
                                    "Prefix cache hits, in terms of number of cached tokens.")],
    "pagedllm:prompt_tokens": [("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.")],
    "pagedllm:pooling_input_tokens": [("pagedllm:pooling_input_tokens", "counter",
                                        "Input tokens of pooling requests (embed, classify, score).")],
    "pagedllm:pooling_requests": [("pagedllm:pooling_requests", "counter",
                                          "Pooling requests finished with their vector.")],
    "pagedllm:generation_tokens": [("vllm:generation_tokens", "counter",
                                    "Number of generation tokens processed.")],
    "pagedllm:spec_decode_num_drafts": [("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.")],
    "pagedllm:spec_decode_num_draft_tokens": [("vllm:spec_decode_num_draft_tokens", "counter",
                                               "Number of draft tokens.")],
    "pagedllm:spec_decode_num_accepted_tokens": [("vllm:spec_decode_num_accepted_tokens", "counter",
                                                  "Number of accepted tokens.")],
    "pagedllm:prompt_tokens_computed": [("pagedllm:prompt_tokens_computed", "counter",
                                         "Prompt tokens run through the model (recompute included).")],
    "pagedllm:dp_requests_routed": [("pagedllm:dp_requests_routed", "counter",
                                     "Requests the data-parallel router sent to this engine.")],
    "pagedllm:dp_requests_routed_by_prefix": [
        ("pagedllm:dp_requests_routed_by_prefix", "counter",
         "Of those, requests sent here because this engine held their first prompt block.")],
}
# Read for other series (finish reasons, cache_config_info), not exported under their own name.
_CONSUMED = {"pagedllm:request_success", "pagedllm:request_aborted", "pagedllm:num_gpu_blocks"}


# attribute -> (name, help, bucket kind); vLLM's names and help texts.
_HISTOGRAMS: dict[str, tuple[str, str, str]] = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "tpot"),
    "tpot_old": ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                 "DEPRECATED: use vllm:inter_token_latency_seconds.", "tpot"),
    "request_tpot": ("vllm:request_time_per_output_token_seconds",
                     "Histogram of time_per_output_token_seconds per request.", "tpot"),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "latency"),
    "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              "latency"),
    "inference": ("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", "latency"),
    "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                "latency"),
    "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
               "latency"),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    "generation_tokens": ("vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    "max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",
                                  "Histogram of maximum number of requested generation tokens.", "tokens"),
    "params_n": ("vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    "params_max_tokens": ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                          "tokens"),
    "iteration_tokens": ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                         "iteration"),
}
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Yields the latest engine snapshots (one per ``engine`` label) as metric families at every
    scrape: one family per series, a sample per engine."""

    def __init__(self, model_name: str, cache_info: dict[str, str], engines: list[str]) -> None:
        self.model_name = model_name
        self.cache_info = cache_info
        self.snapshots: dict[str, dict[str, float]] = {}  # engine label -> its metrics
        self.success = {e: dict.fromkeys(FINISH_REASONS, 0.0) for e in engines}
        # engine label -> draft position -> times accepted
        self.accepted_per_pos: dict[str, dict[int, int]] = {e: {} for e in engines}
        self.max_lora = 0  # max_loras when the engine serves adapters
        # engine label -> (time, running adapters, waiting adapters) of its last step
        self.lora_info: dict[str, tuple[float, str, str]] = {}

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for engine, snap in self.snapshots.items():
            for key, value in snap.items():
                if key in _CONSUMED:
                    continue
                for name, kind, doc in _ENGINE_SERIES.get(key, [(key, "gauge", f"Engine metric {key}.")]):
                    family = families.get(name)
                    if family is None:
                        family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                        family = families[name] = family_cls(name, doc, labels=LABELS)
                    family.add_metric([self.model_name, engine], value)
        yield from families.values()
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=(*LABELS, "finished_reason"))
        for engine, finished in self.success.items():
            aborted = self.snapshots.get(engine, {}).get("pagedllm:request_aborted", 0.0)
            counts = {**finished, "abort": float(aborted)}
            for reason in FINISH_REASONS:
                success.add_metric([self.model_name, engine, reason], counts[reason])
        yield success
        if any(self.accepted_per_pos.values()):
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=(*LABELS, "position"))
            for engine, per_pos in self.accepted_per_pos.items():
                for pos, count in sorted(per_pos.items()):
                    family.add_metric([self.model_name, engine, str(pos)], count)
            yield family
        if self.max_lora:
            yield self._lora_requests_info()
        labels = sorted({*self.cache_info, "engine", "num_gpu_blocks"})
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=labels)
        for engine in self.success:
            info = dict(self.cache_info, engine=engine)
            blocks = self.snapshots.get(engine, {}).get("pagedllm:num_gpu_blocks")
            info["num_gpu_blocks"] = str(int(blocks)) if blocks is not None else info.get("num_gpu_blocks", "None")
            family.add_metric([info[k] for k in labels], 1.0)
        yield family


    def _lora_requests_info(self) -> Metric:
        """vLLM's ``lora_requests_info``: the adapters running and waiting, as labels (names
        joined by commas), valued at the time of the step that reported them."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=("max_lora", "running_lora_adapters", "waiting_lora_adapters",
                                           "engine"))
        for engine, (when, running, waiting) in self.lora_info.items():
            family.add_metric([str(self.max_lora), running, waiting, engine], when)
        return family


class ServerMetrics:
    def __init__(self, llm: AsyncLLM, model_name: str, cache_info: dict[str, str] | None = None) -> None:
        self.llm = llm
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.engines = [str(i) for i in range(getattr(llm, "data_parallel_size", 1))]
        self._engine = _EngineCollector(model_name, cache_info or {}, self.engines)
        lora_config = getattr(getattr(llm.engine, "config", None), "lora_config", None)
        self._engine.max_lora = lora_config.max_loras if lora_config and lora_config.enable_lora else 0
        self.registry.register(self._engine)
        token_buckets = build_1_2_5_buckets(max(1, llm.max_model_len))

        buckets = {"ttft": _TTFT_BUCKETS, "tpot": _TPOT_BUCKETS, "latency": _REQUEST_LATENCY_BUCKETS,
                   "n": _N_BUCKETS, "tokens": token_buckets, "iteration": _ITERATION_BUCKETS}
        # self.ttft, self.itl, ...: one per entry, {engine label: its child series}, every
        # engine's created now so each shows up (at zero) from the first scrape, as vLLM's.
        for attr, (name, doc, kind) in _HISTOGRAMS.items():
            family = Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets[kind])
            setattr(self, attr, {e: family.labels(model_name, e) for e in self.engines})
        cached = Counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.", LABELS,
                         registry=self.registry)
        self.prompt_tokens_cached = {e: cached.labels(model_name, e) for e in self.engines}
        llm.stat_loggers.append(self.observe_latency)
        # Every step, on the engine thread, wherever the core runs (its own process, replicas).
        llm.engine.output_observers.append(self.observe_step)

    def observe_step(self, core_outputs: Any) -> None:
        """One engine step of one replica: the tokens it computed (prompt chunks and generated
        tokens), and which draft positions its verifications accepted."""
        stats = core_outputs.scheduler_stats
        engine = str(core_outputs.engine_index)
        if engine not in self.iteration_tokens:
            return  # a replica this registry was not built for
        if self._engine.max_lora:
            self._engine.lora_info[engine] = (time.time(), ",".join(stats.running_lora_adapters),
                                              ",".join(stats.waiting_lora_adapters))
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            self.iteration_tokens[engine].observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        per_pos = self._engine.accepted_per_pos[engine]
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[pos] = per_pos.get(pos, 0) + count

    def observe_latency(self, stats: RequestStats) -> None:
        """AsyncLLM's per-request latencies (called as each request finishes)."""
        engine = stats.engine if stats.engine in self._engine.success else "0"
        self.e2e[engine].observe(stats.e2e)
        if stats.ttft is not None:
            self.ttft[engine].observe(stats.ttft)
        if stats.queue is not None:
            self.queue[engine].observe(stats.queue)
        itl, tpot_old = self.itl[engine], self.tpot_old[engine]
        for t in stats.inter_token:
            itl.observe(t)
            tpot_old.observe(t)

    def observe(self, out: RequestOutput, num_generated: list[int], n: int, max_tokens: int | None) -> None:
        """One finished request as the server saw it; ``num_generated``: tokens per choice."""
        label = getattr(self.llm, "engine_label", None)
        engine = label(out.request_id) if label is not None else "0"
        success = self._engine.success.get(engine) or self._engine.success["0"]
        for c in out.outputs:
            if c.finish_reason in success:
                success[c.finish_reason] += 1
        self.params_n[engine].observe(n)
        if max_tokens is not None:
            self.params_max_tokens[engine].observe(max_tokens)
        self.prompt_tokens[engine].observe(len(out.prompt_token_ids))
        self.prompt_tokens_cached[engine].inc(out.num_cached_tokens)
        for count in num_generated:
            self.generation_tokens[engine].observe(count)
        self.max_num_generation_tokens[engine].observe(max(num_generated, default=0))
        m = out.metrics
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            return
        last = m.last_token_time or m.first_token_time
        decode = max(0.0, last - m.first_token_time)
        self.prefill[engine].observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.decode[engine].observe(decode)
        self.inference[engine].observe(max(0.0, last - m.first_scheduled_time))
        most = max(num_generated, default=0)
        if most > 1:
            self.request_tpot[engine].observe(decode / (most - 1))

    async def render(self) -> bytes:
        by_engine = getattr(self.llm, "get_metrics_by_engine", None)
        try:
            self._engine.snapshots = (await by_engine() if by_engine is not None
                                      else {"0": await self.llm.get_metrics()})
        except Exception:  # noqa: BLE001 - a dead engine still serves its histograms
            self._engine.snapshots = {}
        return generate_latest(self.registry)
