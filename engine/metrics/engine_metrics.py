"""Prometheus metrics with vLLM v1's names, labels and buckets, so that vLLM dashboards,
autoscaling rules and our tuner read them unchanged.

The set is vLLM 0.33's default one (tests/server/vllm_metrics_v0.33.json lists it with its
source); families for features kvpilot lacks (external KV transfer, multi-modal cache, sleep
mode) are exported at their idle values, as vLLM does when the feature is off. Deprecated
names come back with `--show-hidden-metrics-for-version` (hidden.py); the MFU counters,
KV-block residency and tool-parser families follow their flags (optional.py); the
histograms' buckets follow `--custom-histogram-buckets` (options.py); the running
configuration is in `vllm:cache_config_info` and `kvpilot:engine_config_info` (config_info.py).

Every metric carries `model_name` and `engine` ("0"). Served in the classic text format
(0.0.4): a Prometheus that negotiates OpenMetrics with prometheus-client >= 0.23 would
store `vllm:x` as `vllm_x`. Recording happens on the engine thread (and `record_parent` /
`record_admission_rejection` on the event loop); prometheus-client is thread-safe.
Source: vLLM `vllm/v1/metrics/loggers.py`, `vllm/v1/metrics/stats.py`."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.metrics.config_info import ConfigInfo
from kvpilot.engine.metrics.families import (  # noqa: F401  (CONTENT_TYPE, buckets: re-exported)
    ADMISSION_REASONS,
    CACHE_HIT_SOURCES,
    CONTENT_TYPE,
    FINISH_REASONS,
    PROMPT_SOURCES,
    SLEEP_STATES,
    TTFT_BUCKETS,
    MetricFactory,
    build_1_2_5_buckets,
)
from kvpilot.engine.metrics.options import MetricOptions
from kvpilot.engine.metrics.hidden import hidden_metrics_shown
from kvpilot.engine.metrics.optional import OptionalMetrics
from kvpilot.engine.engine.llm_engine import StepStats
from kvpilot.engine.outputs import RequestOutput


class EngineMetrics:
    """The engine's Prometheus metrics. Call `record_step` after each engine step,
    `record_finished` / `record_aborted` once per engine request, `record_parent` once per
    prompt when its n choices are done, `set_config` at start and after every live config
    change. `options`: the metric flags (MetricOptions); `show_hidden_for` alone stands for
    `--show-hidden-metrics-for-version` when no options are given."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 registry: CollectorRegistry | None = None, show_hidden_for: str | None = None,
                 options: MetricOptions | None = None) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series (not part of vLLM's documented set)
        self.registry = registry if registry is not None else CollectorRegistry()
        options = options if options is not None else MetricOptions(show_hidden_for=show_hidden_for)
        labels = {"model_name": config.served_model_name, "engine": "0"}
        f = MetricFactory(self.registry, labels)
        self._buckets = options.buckets
        token_buckets = options.buckets("request_tokens", config.scheduler.max_model_len)
        self._declare_state(f)
        self._declare_tokens(f, token_buckets)
        self._declare_latencies(f, token_buckets)
        self._declare_hidden(f, hidden_metrics_shown(options.show_hidden_for))
        self.optional = OptionalMetrics(f, config, options)
        self.config_info = ConfigInfo(config, num_gpu_blocks, num_cpu_blocks, self.registry, labels)
        self._last_token_s: dict[str, float] = {}
        self._prefix_seen = (0, 0)

    def _declare_state(self, f: MetricFactory) -> None:
        """Gauges of the scheduler and cache, and the prefix-cache counters."""
        self.running = f.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = f.by_label(
            Gauge, "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: "
            "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints.",
            "reason", ("capacity", "deferred"))
        sleep = f.by_label(Gauge, "vllm:engine_sleep_state", "Engine sleep state; awake = 1 means engine is awake.",
                           "sleep_state", SLEEP_STATES)
        sleep["awake"].set(1)  # kvpilot has no sleep mode
        self.kv_usage = f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = f.counter("vllm:prefix_cache_queries",
                                        "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = f.counter("vllm:prefix_cache_hits",
                                     "Prefix cache hits, in terms of number of cached tokens.")
        for name, doc in (("external_prefix_cache_queries", "External prefix cache queries from KV connector."),
                          ("external_prefix_cache_hits", "External prefix cache hits from KV connector."),
                          ("mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
                          ("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")):
            f.counter(f"vllm:{name}", doc)  # features kvpilot lacks: always 0, as in vLLM without them

    def _declare_tokens(self, f: MetricFactory, token_buckets: list[int]) -> None:
        """Token and request counters, and the per-request token histograms."""
        self.preemptions = f.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = f.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = f.by_label(Counter, "vllm:prompt_tokens_by_source",
                                           "Number of prompt tokens by source.", "source", PROMPT_SOURCES)
        self.prompt_cached = f.counter("vllm:prompt_tokens_cached",
                                       "Number of cached prompt tokens (local + external).")
        self.cached_by_source = f.by_label(Counter, "vllm:prompt_tokens_cached_by_source",
                                           "Prefix-cache hit tokens by the cache tier that supplied them.",
                                           "source", CACHE_HIT_SOURCES)
        self.generation_tokens = f.counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = f.by_label(Counter, "vllm:request_success", "Count of successfully processed requests.",
                                  "finished_reason", FINISH_REASONS)
        self.admission_rejections = f.by_label(
            Counter, "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            "reason", ADMISSION_REASONS, base=["model_name"])
        self.request_prompt_tokens = f.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                                 token_buckets)
        self.request_generation_tokens = f.histogram("vllm:request_generation_tokens",
                                                     "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = f.histogram("vllm:iteration_tokens_total",
                                            "Histogram of number of tokens per engine_step.",
                                            self._buckets("iteration_tokens"))
        self.max_num_generation_tokens = f.histogram("vllm:request_max_num_generation_tokens",
                                                     "Histogram of maximum number of requested generation tokens.",
                                                     token_buckets)
        self.params_n = f.histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                    self._buckets("request_params_n"))
        self.request_max_tokens = f.histogram("vllm:request_params_max_tokens",
                                              "Histogram of the max_tokens request parameter.", token_buckets)

    def _declare_latencies(self, f: MetricFactory, token_buckets: list[int]) -> None:
        """Per-token and per-request latency histograms."""
        self.ttft = f.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                self._buckets("time_to_first_token"))
        self.itl = f.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               self._buckets("inter_token_latency"))
        self.tpot = f.histogram("vllm:request_time_per_output_token_seconds",
                                "Histogram of time_per_output_token_seconds per request.",
                                self._buckets("inter_token_latency"))
        phase = "Histogram of time spent in {} phase for request."
        self.e2e = f.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               self._buckets("request_latency"))
        self.queue_time = f.histogram("vllm:request_queue_time_seconds", phase.format("WAITING"),
                                      self._buckets("request_latency"))
        self.inference_time = f.histogram("vllm:request_inference_time_seconds", phase.format("RUNNING"),
                                          self._buckets("request_latency"))
        self.prefill_time = f.histogram("vllm:request_prefill_time_seconds", phase.format("PREFILL"),
                                        self._buckets("request_latency"))
        self.decode_time = f.histogram("vllm:request_decode_time_seconds", phase.format("DECODE"),
                                       self._buckets("request_latency"))
        self.request_preemptions = f.histogram("vllm:request_num_preemptions",
                                               "Histogram of the number of times a request was preempted.",
                                               self._buckets("request_num_preemptions"))
        self.prefill_kv_computed = f.histogram("vllm:request_prefill_kv_computed_tokens",
                                               "Histogram of new KV tokens computed during prefill "
                                               "(excluding cached tokens).", token_buckets)

    def _declare_hidden(self, f: MetricFactory, hidden: frozenset[str]) -> None:
        """Deprecated names, declared only when --show-hidden-metrics-for-version shows them."""

        def maybe(name: str, make):
            return make() if name in hidden else None

        deprecated = "DEPRECATED: Use vllm:{} instead."
        self.swapped = maybe("vllm:num_requests_swapped", lambda: f.gauge(
            "vllm:num_requests_swapped", "Number of requests swapped to CPU. DEPRECATED: KV cache offloading is "
            "not used in V1"))
        self.gpu_cache_usage = maybe("vllm:gpu_cache_usage_perc", lambda: f.gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage." +
            deprecated.format("kv_cache_usage_perc")))
        self.gpu_prefix_queries = maybe("vllm:gpu_prefix_cache_queries", lambda: f.counter(
            "vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried tokens. " +
            deprecated.format("prefix_cache_queries")))
        self.gpu_prefix_hits = maybe("vllm:gpu_prefix_cache_hits", lambda: f.counter(
            "vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens. " +
            deprecated.format("prefix_cache_hits")))
        self.time_per_output_token = maybe("vllm:time_per_output_token_seconds", lambda: f.histogram(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds." +
            deprecated.format("inter_token_latency_seconds"),
            self._buckets("inter_token_latency")))

    def set_config(self, config: EngineConfig) -> None:
        """Replaces the `vllm:cache_config_info` and `kvpilot:engine_config_info` series with
        the running configuration (the new series first, so that a scrape never finds none)."""
        self.config_info.set_config(config)

    def record_scheduler_state(self, num_running: int, num_waiting: int, num_swapped: int, kv_usage: float,
                               prefix_queries: int, prefix_hits: int) -> None:
        """Gauges from the scheduler and block manager; prefix counts are cumulative."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.waiting_by_reason["capacity"].set(num_waiting)  # kvpilot defers nothing
        self.kv_usage.set(kv_usage)
        seen_q, seen_h = self._prefix_seen
        queries, hits = max(prefix_queries - seen_q, 0), max(prefix_hits - seen_h, 0)
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.cached_by_source["device"].inc(hits)
        self._prefix_seen = (prefix_queries, prefix_hits)
        if self.swapped is not None:
            self.swapped.set(num_swapped)
        if self.gpu_cache_usage is not None:
            self.gpu_cache_usage.set(kv_usage)
        if self.gpu_prefix_queries is not None:
            self.gpu_prefix_queries.inc(queries)
            self.gpu_prefix_hits.inc(hits)

    def record_step(self, step: StepStats, outputs: list[RequestOutput], now: float) -> None:
        """Per-step counters, TTFT at each request's first token (when its prompt tokens
        are counted, once per request as vLLM does) and the inter-token latencies."""
        self.preemptions.inc(step.num_preemptions)
        self.optional.record_step(step)
        self.iteration_tokens.observe(step.num_prompt_tokens + step.num_generation_tokens)
        for out in outputs:
            n = len(out.new_token_ids)
            if not n:
                continue
            self.generation_tokens.inc(n)
            last = self._last_token_s.get(out.request_id)
            if last is None:
                num_prompt = len(out.prompt_token_ids)
                cached = min(out.metrics.num_cached_tokens, num_prompt) if out.metrics is not None else 0
                self.prompt_tokens.inc(num_prompt)
                self.prompt_by_source["local_compute"].inc(num_prompt - cached)
                self.prompt_by_source["local_cache_hit"].inc(cached)
                self.prompt_cached.inc(cached)
                if out.metrics is not None:
                    self.ttft.observe(now - out.metrics.arrival_s)
            else:
                self.itl.observe(now - last)
                if self.time_per_output_token is not None:
                    self.time_per_output_token.observe(now - last)
            self._last_token_s[out.request_id] = now

    def record_finished(self, out: RequestOutput, max_tokens: int | None) -> None:
        """The per-request histograms of a finished engine request. The mean time per
        output token excludes the first token and is 0 for a one-token request, as in vLLM
        (`IterationStats.update_from_finished_request`)."""
        self._last_token_s.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason or "abort"
        self.success[reason].inc()
        m = out.metrics
        if m is None or m.finished_s is None or m.first_token_s is None:
            return
        scheduled = m.first_scheduled_s if m.first_scheduled_s is not None else m.arrival_s
        num_generated = len(out.outputs[0].token_ids)
        num_prompt = len(out.prompt_token_ids)
        self.e2e.observe(m.finished_s - m.arrival_s)
        self.queue_time.observe(scheduled - m.arrival_s)
        self.inference_time.observe(m.finished_s - scheduled)
        self.prefill_time.observe(m.first_token_s - scheduled)
        decode_s = m.finished_s - m.first_token_s
        self.decode_time.observe(decode_s)
        self.tpot.observe(decode_s / (num_generated - 1) if num_generated > 1 else 0.0)
        self.request_preemptions.observe(m.num_preemptions)
        self.prefill_kv_computed.observe(num_prompt - max(m.num_cached_tokens, 0))
        self.request_prompt_tokens.observe(num_prompt)
        self.request_generation_tokens.observe(num_generated)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)

    def record_parent(self, n: int, num_generation_tokens: list[int]) -> None:
        """Once per prompt, when all its n choices finished: the n parameter and the most
        tokens any choice generated (vLLM's `ParentRequest.observe_finished_request`)."""
        self.params_n.observe(n)
        self.max_num_generation_tokens.observe(max(num_generation_tokens, default=0))

    def record_admission_rejection(self, reason: str) -> None:
        """A request refused by a queue limit (`--max-queue-len` is vLLM's max_num_queued_reqs)."""
        self.admission_rejections[reason].inc()

    def record_aborted(self, request_id: str) -> None:
        """An aborted request: counts vllm:request_success{finished_reason="abort"}, forgets its timing."""
        self._last_token_s.pop(request_id, None)
        self.success["abort"].inc()

    def render(self) -> bytes:
        """The registry in Prometheus' classic text format (serve with CONTENT_TYPE)."""
        return prometheus_client.generate_latest(self.registry)
