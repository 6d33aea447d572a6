"""The two info gauges of the running configuration (value 1, the configuration in labels).

- `vllm:cache_config_info`: vLLM's, with vLLM's labels and nothing else: every field of
  vLLM 0.33's `CacheConfig` (`CacheConfig.metrics_info()` is `{k: str(v) for k, v in
  self.__dict__.items()}`) plus `engine`, values spelled as `str()` spells them in Python
  ("True", "None", "[]", "0.9"). Fields for features kvpilot lacks (Mamba, KV offloading,
  sliding windows) carry the values vLLM reports for a Llama without them.
- `kvpilot:engine_config_info`: kvpilot's, with `model_name` and `engine` and the settings the
  tuner confirms a rollout or a live change by (scheduler limits, parallel sizes, dtype, swap
  space; vLLM has no gauge for them). `tuner/measure/scrape.py` reads both.

Both are replaced, never added to, on a live change (`POST /admin/scheduler_config`).
Source: vLLM `vllm/config/cache.py` (`CacheConfig`), `vllm/v1/metrics/loggers.py`
(`PrometheusStatLogger.log_metrics_info`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.settings import BY_NAME

CACHE_CONFIG_INFO = "vllm:cache_config_info"
ENGINE_CONFIG_INFO = "kvpilot:engine_config_info"
# vLLM 0.33's CacheConfig fields that kvpilot has no feature for, as vLLM 0.32 reports them on
# SmolLM2 (a Llama): a live scrape, tests/oracle/test_oracle_metrics.py
_VLLM_FIXED = {
    "_block_size_resolved": "True", "cache_dtype": "auto", "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False", "hash_block_size": "None", "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None", "kv_offloading_backend": "native",
    "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
    "mamba_cache_dtype": "auto", "mamba_cache_mode": "none", "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "float32", "prefix_cache_retention_interval": "0", "prefix_match_unit": "None",
    "replayssm_buffer_len": "16", "simple_cpu_offload_num_blocks": "None", "skip_page_size_padded": "None",
    "sliding_window": "None", "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
}
# kvpilot's prefix-cache block hash is Python's tuple hash: the value older vLLM releases named "builtin"
PREFIX_CACHING_HASH_ALGO = "builtin"


def cache_config_info_labels(config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> dict[str, str]:
    """vLLM's `vllm:cache_config_info` labels (without `engine`) for the running engine.
    kv_cache_size_tokens = blocks x block_size; kv_cache_max_concurrency = blocks / blocks of one
    max_model_len request (vLLM's `get_max_concurrency_for_kv_cache_config` for full attention);
    num_cpu_blocks: the swap blocks (vLLM v1 has none: "None" there, and here without swap space);
    user_specified_block_size: whether block_size differs from the default (kvpilot keeps no
    record of which flags were given)."""
    c, max_model_len = config.cache, config.scheduler.max_model_len
    per_request = -(-max_model_len // c.block_size)
    return {
        **_VLLM_FIXED,
        "block_size": str(c.block_size),
        "user_specified_block_size": str(c.block_size != BY_NAME["block_size"].default),
        "effective_attention_block_size": str(c.block_size),
        "gpu_memory_utilization": str(c.gpu_memory_utilization),
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "prefix_caching_hash_algo": PREFIX_CACHING_HASH_ALGO,
        "num_gpu_blocks_override": str(c.num_gpu_blocks_override),
        "kv_cache_memory_bytes": str(c.kv_cache_memory_bytes),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_cpu_blocks": str(num_cpu_blocks) if num_cpu_blocks else "None",
        "kv_cache_size_tokens": str(num_gpu_blocks * c.block_size),
        "kv_cache_max_concurrency": str(num_gpu_blocks / per_request),
    }


def engine_config_info_labels(config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int) -> dict[str, str]:
    """kvpilot's `kvpilot:engine_config_info` labels (without model_name and engine): the
    settings a trial sets, named as the settings table names them, booleans as "True"/"False"."""
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


class _InfoGauge:
    """One info gauge whose single series is replaced as the configuration changes (the new
    series first, so that a scrape never finds none)."""

    def __init__(self, name: str, doc: str, label_names: list[str], registry: CollectorRegistry) -> None:
        self.label_names = label_names
        self.gauge = Gauge(name, doc, label_names, registry=registry)
        self.current: dict[str, str] | None = None

    def set(self, labels: dict[str, str]) -> None:
        self.gauge.labels(**labels).set(1)
        if self.current is not None and self.current != labels:
            self.gauge.remove(*(self.current[name] for name in self.label_names))
        self.current = labels


class ConfigInfo:
    """Both info gauges in `registry`; `set_config` at start and after every live change.
    `labels`: the common model_name / engine labels."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int,
                 registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.engine = labels["engine"]
        self.labels = labels
        self.cache = _InfoGauge(CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                [*cache_config_info_labels(config, 0, 0), "engine"], registry)
        self.kvpilot = _InfoGauge(ENGINE_CONFIG_INFO, "kvpilot's running engine configuration: the settings the "
                                  "tuner sets (scheduler limits, parallel sizes, dtype, swap space)",
                                  [*labels, *engine_config_info_labels(config, 0, 0)], registry)
        self.set_config(config)

    def set_config(self, config: EngineConfig) -> None:
        """Replaces both series with the running configuration."""
        blocks = (config, self.num_gpu_blocks, self.num_cpu_blocks)
        self.cache.set({**cache_config_info_labels(*blocks), "engine": self.engine})
        self.kvpilot.set({**self.labels, **engine_config_info_labels(*blocks)})
