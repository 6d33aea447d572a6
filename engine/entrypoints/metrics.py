"""Prometheus metrics with vLLM v1's names, labels and buckets, so that vLLM dashboards,
autoscaling rules and our tuner read them unchanged.

Every metric carries `model_name` and `engine` ("0"). Served in the classic text format
(0.0.4): a Prometheus that negotiates OpenMetrics with prometheus-client >= 0.23 would
store `vllm:x` as `vllm_x`. All recording happens on the engine thread; prometheus-client
is thread-safe for the scrape. Source: vLLM `vllm/v1/metrics/loggers.py`."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.llm_engine import StepStats
from kvpilot.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def config_info_labels(config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> dict[str, str]:
    """The running configuration as `vllm:cache_config_info` labels (vLLM's cache-config
    names plus the scheduler limits the tuner changes), booleans spelled as vLLM does."""
    c, s, p = config.cache, config.scheduler, config.parallel
    return {
        "block_size": str(c.block_size),
        "gpu_memory_utilization": str(c.gpu_memory_utilization),
        "swap_space": str(c.swap_space),
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": str(num_cpu_blocks),
        "max_model_len": str(s.max_model_len),
        "max_num_seqs": str(s.max_num_seqs),
        "max_num_batched_tokens": str(s.max_num_batched_tokens),
        "enable_chunked_prefill": str(s.enable_chunked_prefill),
        "preemption_mode": s.preemption_mode,
        "tensor_parallel_size": str(p.tensor_parallel_size),
        "pipeline_parallel_size": str(p.pipeline_parallel_size),
        "dtype": str(config.model.dtype).removeprefix("torch."),
    }


class EngineMetrics:
    """The engine's Prometheus metrics in their own registry. Call `record_step` after each
    engine step, `record_finished` / `record_aborted` once per request, `set_config` at
    start and after every live config change."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 registry: CollectorRegistry | None = None) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series, as in vLLM
        self.registry = registry if registry is not None else CollectorRegistry()
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        labels = {"model_name": config.served_model_name, "engine": "0"}
        names = list(labels)
        max_len = config.scheduler.max_model_len
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = gauge("vllm:num_requests_swapped", "Number of requests swapped to host memory.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=reg)
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               build_1_2_5_buckets(max_len))
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   build_1_2_5_buckets(max_len))
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.",
                                            build_1_2_5_buckets(max_len))
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        phase = "Histogram of time spent in {} phase for request."
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", phase.format("WAITING"),
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", phase.format("RUNNING"),
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", phase.format("PREFILL"),
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", phase.format("DECODE"),
                                     REQUEST_LATENCY_BUCKETS)
        self._labels = labels
        self._info_names = names + list(config_info_labels(config, 0, 0))
        self._info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", self._info_names,
                           registry=reg)
        self._info_labels: dict[str, str] | None = None
        self.set_config(config)
        self._last_token_s: dict[str, float] = {}
        self._prefix_seen = (0, 0)

    def set_config(self, config: EngineConfig) -> None:
        """Replaces the `vllm:cache_config_info` series with the running configuration (the
        new series first, so that a scrape never finds none)."""
        new = {**self._labels, **config_info_labels(config, self.num_gpu_blocks, self.num_cpu_blocks)}
        self._info.labels(**new).set(1)
        if self._info_labels is not None and self._info_labels != new:
            self._info.remove(*(self._info_labels[name] for name in self._info_names))
        self._info_labels = new

    def record_scheduler_state(self, num_running: int, num_waiting: int, num_swapped: int, kv_usage: float,
                               prefix_queries: int, prefix_hits: int) -> None:
        """Gauges from the scheduler and block manager; prefix counts are cumulative."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.swapped.set(num_swapped)
        self.kv_usage.set(kv_usage)
        seen_q, seen_h = self._prefix_seen
        self.prefix_queries.inc(max(prefix_queries - seen_q, 0))
        self.prefix_hits.inc(max(prefix_hits - seen_h, 0))
        self._prefix_seen = (prefix_queries, prefix_hits)

    def record_step(self, step: StepStats, outputs: list[RequestOutput], now: float) -> None:
        """Per-step counters, TTFT at each request's first token (when its prompt tokens
        are counted, once per request as vLLM does) and the inter-token latencies."""
        self.preemptions.inc(step.num_preemptions)
        self.iteration_tokens.observe(step.num_prompt_tokens + step.num_generation_tokens)
        for out in outputs:
            n = len(out.new_token_ids)
            if not n:
                continue
            self.generation_tokens.inc(n)
            last = self._last_token_s.get(out.request_id)
            if last is None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.metrics is not None:
                    self.ttft.observe(now - out.metrics.arrival_s)
            else:
                self.itl.observe(now - last)
            self._last_token_s[out.request_id] = now

    def record_finished(self, out: RequestOutput, max_tokens: int | None) -> None:
        self._last_token_s.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason or "abort"
        self.success[reason].inc()
        m = out.metrics
        if m is None or m.finished_s is None or m.first_token_s is None:
            return
        scheduled = m.first_scheduled_s if m.first_scheduled_s is not None else m.arrival_s
        num_generated = len(out.outputs[0].token_ids)
        self.e2e.observe(m.finished_s - m.arrival_s)
        self.queue_time.observe(scheduled - m.arrival_s)
        self.inference_time.observe(m.finished_s - scheduled)
        self.prefill_time.observe(m.first_token_s - scheduled)
        self.decode_time.observe(m.finished_s - m.first_token_s)
        if num_generated > 1:
            self.tpot.observe((m.finished_s - m.first_token_s) / (num_generated - 1))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(num_generated)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)

    def record_aborted(self, request_id: str) -> None:
        self._last_token_s.pop(request_id, None)
        self.success["abort"].inc()

    def render(self) -> bytes:
        """The registry in Prometheus' classic text format (serve with CONTENT_TYPE)."""
        return prometheus_client.generate_latest(self.registry)
