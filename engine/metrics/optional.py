"""The metric families that vLLM's flags switch on, beside the default set (engine_metrics.py):

- `vllm:estimated_flops_per_gpu_total`, `vllm:estimated_read_bytes_per_gpu_total`,
  `vllm:estimated_write_bytes_per_gpu_total`: always registered; they count each step's
  estimate (kvpilot/engine/metrics/perf.py) only with `--enable-mfu-metrics`. MFU in PromQL:
  rate(vllm:estimated_flops_per_gpu_total[1m]) / peak FLOP/s.
- `vllm:kv_block_lifetime_seconds`, `vllm:kv_block_idle_before_evict_seconds`,
  `vllm:kv_block_reuse_gap_seconds`: only with `--kv-cache-metrics`, fed by the block
  manager's sampled residency events (kvpilot/engine/core/kv_cache_residency.py).
- `vllm:tool_call_parser_invocations_total`: only with `--tool-call-parser` (tool_parsers.py).
Source: vLLM `vllm/v1/metrics/perf.py` (`PerfMetricsProm`), `vllm/v1/metrics/loggers.py`
(KV cache residency metrics), `vllm/entrypoints/launchers/api_server/app_state.py`."""

from __future__ import annotations

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.metrics.families import MetricFactory
from kvpilot.engine.metrics.options import MetricOptions
from kvpilot.engine.metrics.tool_parsers import init_parser_metrics
from kvpilot.engine.core.kv_cache_residency import KVCacheResidency
from kvpilot.engine.engine.llm_engine import StepStats
from kvpilot.engine.metrics.perf import PerfEstimator

SAMPLED = " Sampled metrics (controlled by --kv-cache-metrics-sample)."


class OptionalMetrics:
    """The flag-dependent families in `f`'s registry. `residency`: the collector to attach to
    the engine's block manager (`BlockManager.residency`), None without --kv-cache-metrics."""

    def __init__(self, f: MetricFactory, config: EngineConfig, options: MetricOptions) -> None:
        per_gpu = "(for Model Flops Utilization calculations)."
        self.flops = f.counter("vllm:estimated_flops_per_gpu_total",
                               f"Estimated number of floating point operations per GPU {per_gpu}")
        self.read_bytes = f.counter("vllm:estimated_read_bytes_per_gpu_total",
                                    f"Estimated number of bytes read from memory per GPU {per_gpu}")
        self.write_bytes = f.counter("vllm:estimated_write_bytes_per_gpu_total",
                                     f"Estimated number of bytes written to memory per GPU {per_gpu}")
        self.perf = PerfEstimator(config) if options.enable_mfu_metrics else None
        self.residency: KVCacheResidency | None = None
        if options.kv_cache_metrics:
            self.residency = KVCacheResidency(options.kv_cache_metrics_sample)
            buckets = options.buckets("kv_cache_residency")
            self.lifetime = f.histogram("vllm:kv_block_lifetime_seconds", "Histogram of KV cache block lifetime "
                                        "from allocation to eviction." + SAMPLED, buckets)
            self.idle = f.histogram("vllm:kv_block_idle_before_evict_seconds", "Histogram of idle time before KV "
                                    "cache block eviction." + SAMPLED, buckets)
            self.reuse_gap = f.histogram("vllm:kv_block_reuse_gap_seconds", "Histogram of time gaps between "
                                         "consecutive KV cache block accesses. Only the most recent accesses are "
                                         "recorded (ring buffer)." + SAMPLED, buckets)
        init_parser_metrics(f.registry if options.tool_call_parser else None, f.labels["model_name"])

    def record_step(self, step: StepStats) -> None:
        """The step's MFU estimate (with --enable-mfu-metrics) and the residency events since
        the last step (with --kv-cache-metrics)."""
        if self.perf is not None and step.batch:
            perf = self.perf.step(step.batch)
            if perf.flops or perf.read_bytes or perf.write_bytes:
                self.flops.inc(perf.flops)
                self.read_bytes.inc(perf.read_bytes)
                self.write_bytes.inc(perf.write_bytes)
        if self.residency is not None:
            for event in self.residency.drain():
                self.lifetime.observe(event.lifetime_s)
                self.idle.observe(event.idle_s)
                for gap in event.reuse_gaps_s:
                    self.reuse_gap.observe(gap)
