"""The HTTP metrics `vllm serve` exports, from the same library vLLM uses:
prometheus-fastapi-instrumentator's default set (`http_requests_total{handler, method,
status}` with status grouped as 2xx/4xx/5xx, `http_request_duration_seconds{handler,
method}`, `http_request_duration_highr_seconds`, `http_request_size_bytes` and
`http_response_size_bytes` by handler), with vLLM's excluded handlers; plus the process,
platform and GC collectors that vLLM's default registry carries.
Source: vLLM `vllm/entrypoints/serve/instrumentator/metrics.py`, `vllm/v1/metrics/prometheus.py`."""

from __future__ import annotations

import prometheus_client
from fastapi import FastAPI
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

# vLLM's list; /metrics and the probes would drown the API routes' counts.
EXCLUDED_HANDLERS = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]


def server_registry() -> CollectorRegistry:
    """A registry for one server: the process, platform and GC collectors (what
    prometheus-client's global REGISTRY holds, which `vllm serve` exports), HTTP and
    engine metrics are added to it."""
    prometheus_client.disable_created_metrics()  # no *_created series, for every family
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """Counts every request to `app` but the excluded handlers, into `registry`. Call it
    after the other middleware is added, so that it sees their answers (a 401) too."""
    Instrumentator(excluded_handlers=EXCLUDED_HANDLERS, registry=registry).add().instrument(app)
