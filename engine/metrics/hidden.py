"""`--show-hidden-metrics-for-version X.Y`: every deprecated metric name that vLLM has
hidden since release X.Y, so that one value serves a dashboard written for vLLM X.Y.

vLLM's policy (docs/usage/metrics.md, "Deprecation Policy"): a metric deprecated in X.Y is
hidden in X.(Y+1) behind `--show-hidden-metrics-for-version=X.Y` and removed in X.(Y+2);
vLLM compares the flag's string with its previous minor version
(`vllm/version.py::_prev_minor_version_was`), so its flag brings back only what the release
right after X.Y hid. kvpilot exports vLLM 0.33's set (tests/server/vllm_metrics_v0.33.json)
and keeps, for each older X.Y, the names vLLM X.(Y+1) re-enabled with that flag; a value
brings back the names of every X.Y it is not newer than (0.10 shows 0.10's and 0.11's), which
goes beyond vLLM: a dashboard of vLLM 0.10 reads both `vllm:gpu_cache_usage_perc` and
`vllm:time_per_output_token_seconds`. A version newer than the last hiding (0.12 and on)
shows nothing, as in vLLM.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from kvpilot.engine.settings import BY_NAME

# flag value -> names that the vLLM release after it showed only with the flag
HIDDEN_METRICS: dict[str, tuple[str, ...]] = {
    # vllm/engine/metrics.py (V0) in 0.9: "Deprecated in 0.8 - KV cache offloading is not used in V1"
    "0.8": ("vllm:num_requests_swapped",),
    # vllm/v1/metrics/loggers.py in 0.11.0: "Deprecated in 0.9.2 - Renamed as vllm:kv_cache_usage_perc /
    # vllm:prefix_cache_queries / vllm:prefix_cache_hits. With 0.11.x you can enable with
    # --show-hidden-metrics-for-version=0.10"
    "0.10": ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"),
    # vllm/v1/metrics/loggers.py in 0.12.0: "Deprecated in 0.11 - Renamed as vllm:inter_token_latency_seconds.
    # With 0.12.x you can enable with --show-hidden-metrics-for-version=0.11"
    "0.11": ("vllm:time_per_output_token_seconds",),
}


def check_version(value: str | None) -> str | None:
    """Returns `value` unchanged when it is None or a version string; raises ValueError
    (with what to write instead) otherwise, as vLLM's ObservabilityConfig validator does."""
    if value is None:
        return None
    try:
        Version(value)
    except InvalidVersion:
        raise ValueError(f"{BY_NAME['show_hidden_metrics_for_version'].flag} must be a version such as 0.11, "
                         f"got {value!r}") from None
    return value


def _minor(version: str) -> tuple[int, int]:
    """'0.10' -> (0, 10); '0.10.2' -> (0, 10): hiding happens per minor release."""
    release = Version(version).release
    return release[0], (release[1] if len(release) > 1 else 0)


def hidden_metrics_shown(version: str | None) -> frozenset[str]:
    """The deprecated names `--show-hidden-metrics-for-version version` re-enables: those
    hidden after every release from `version` on (a metric deprecated in K and hidden in
    K+1 is in a dashboard of any release up to K). Raises ValueError on a non-version."""
    if version is None:
        return frozenset()
    since = _minor(check_version(version))
    return frozenset(name for deprecated_in, names in HIDDEN_METRICS.items()
                     if _minor(deprecated_in) >= since for name in names)
