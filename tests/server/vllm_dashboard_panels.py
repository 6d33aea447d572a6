"""vLLM's generated Grafana dashboards as the chart ships them (charts/kvpilot/dashboards/vllm/),
their panel queries with Grafana's variables substituted, and the one table of queries that
cannot answer against kvpilot, each with its reason (test_server_vllm_dashboards.py reads it:
a listed query that answers fails, an unlisted one that does not answer fails).

A query is (dashboard file, panel title, refId); a collapsed row's panels are included.
Substitution is Grafana's for the dashboards' defaults: every query variable set to All (the
values Prometheus knows for it, joined `a|b` as Grafana's regex format does; one value here),
the custom SLO variables at their current values, `$__rate_interval` as Grafana derives it for
a 1 s scrape interval over a short range (4 x the scrape interval), `$__range` the window."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "kvpilot" / "dashboards" / "vllm"
FILES = ("vllm_overview.json", "vllm_instances.json", "vllm_kv_cache.json", "vllm_service_status.json")
RATE_INTERVAL = "4s"  # Grafana: max($__interval + scrape interval, 4 x scrape interval), scrape 1 s

LORA = "LoRA adapters: kvpilot serves no LoRA (vllm:lora_requests_info exists only with --enable-lora)"
SLEEP_OPS = ("sleep mode and RL weight updates: kvpilot has neither API (vllm:sleep_mode_operation_duration_seconds, "
             "vllm:rl_weight_update_operation_duration_seconds)")
KV_CONNECTOR = ("KV connector (--kv-transfer-config): kvpilot has no KV transfer, so its external prefix cache "
                "counters stay 0 and the ratio's `> 0` guard leaves no sample, as in vLLM without a connector")
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage: registered only for a KV-consumer --kv-transfer-config"
MULTIMODAL = ("multimodal cache: SmolLM2 takes text only, so vllm:mm_cache_queries stays 0 and the ratio has no "
              "sample, as in vLLM with a text-only model")
NIXL = "NixlConnector transfers: kvpilot has no KV connector (vllm:nixl_* exist only with it)"
OFFLOAD = "OffloadingConnector: kvpilot has no KV offloading (vllm:kv_offload_* exist only with it)"
SIMPLE_OFFLOAD = "SimpleCPUOffloadConnector: kvpilot has no KV offloading (vllm:simple_kv_offload_* exist only with it)"


def _rows(file: str, title: str, refs: str, reason: str) -> dict:
    return {(file, title, ref): reason for ref in refs}


NOT_ANSWERING: dict[tuple[str, str, str], str] = {
    **_rows("vllm_instances.json", "LoRA adapters", "A", LORA),
    **_rows("vllm_instances.json", "Sleep mode and weight update operations (since process start)", "ABC", SLEEP_OPS),
    **_rows("vllm_overview.json", "Cache hit rates", "B", KV_CONNECTOR),
    **_rows("vllm_overview.json", "Cache hit rates", "C", MULTIMODAL),
    **_rows("vllm_kv_cache.json", "Cache hit rates", "B", KV_CONNECTOR),
    **_rows("vllm_kv_cache.json", "Cache hit rates", "C", MULTIMODAL),
    **_rows("vllm_kv_cache.json", "External prefix cache hit rate", "A", KV_CONNECTOR),
    **_rows("vllm_kv_cache.json", "Requests waiting on KV loads", "A", KV_FETCH),
    **_rows("vllm_kv_cache.json", "Transfer duration", "ABCD", NIXL),
    **_rows("vllm_kv_cache.json", "Transfer throughput", "AB", NIXL),
    **_rows("vllm_kv_cache.json", "Transfers / s", "A", NIXL),
    **_rows("vllm_kv_cache.json", "Bytes per transfer", "ABCD", NIXL),
    **_rows("vllm_kv_cache.json", "Transfer post time", "ABCD", NIXL),
    **_rows("vllm_kv_cache.json", "Descriptors per transfer", "ABCD", NIXL),
    **_rows("vllm_kv_cache.json", "Transfer failures / s", "ABCD", NIXL),
    **_rows("vllm_kv_cache.json", "Offload throughput", "AB", OFFLOAD),
    **_rows("vllm_kv_cache.json", "Offload transfer bandwidth", "AB", OFFLOAD),
    **_rows("vllm_kv_cache.json", "Mean offload transfer size", "AB", OFFLOAD),
    **_rows("vllm_kv_cache.json", "Offload lookup latency p99", "AB", OFFLOAD),
    **_rows("vllm_kv_cache.json", "CPU offload buffer usage", "ABC", OFFLOAD),
    **_rows("vllm_kv_cache.json", "Failed and skipped stores / s", "AB", OFFLOAD),
    **_rows("vllm_kv_cache.json", "Store admission outcomes", "A", SIMPLE_OFFLOAD),
    **_rows("vllm_kv_cache.json", "Blocks restored from offload / s", "A", SIMPLE_OFFLOAD),
    **_rows("vllm_kv_cache.json", "Offload pool blocks", "AB", SIMPLE_OFFLOAD),
}


def load(file: str) -> dict:
    return json.loads((DASHBOARDS / file).read_text())


def panels(dashboard: dict):
    """Every panel, a collapsed row's own panels included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())


def queries() -> list[tuple[tuple[str, str, str], str]]:
    """((file, panel title, refId), expr) of every panel query of the four dashboards."""
    return [((file, panel["title"], target["refId"]), target["expr"])
            for file in FILES for panel in panels(load(file)) for target in panel.get("targets", ())]


def variable_values(file: str, label_values) -> dict[str, str]:
    """Grafana's value of each variable of the dashboard: a query variable set to All is its
    `label_values(...)` answer (label_values(query, label) -> list, earlier variables already
    substituted) joined with `|`; a custom one its current value."""
    values: dict[str, str] = {}
    for var in load(file)["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"])
            found = label_values(substitute(match.group(1), values), match.group(2))
            values[var["name"]] = "|".join(found) if len(found) < 2 else "(" + "|".join(found) + ")"
        elif var["type"] == "custom":
            values[var["name"]] = var["current"]["value"]
    return values


def substitute(expr: str, values: dict[str, str], range_s: int | None = None) -> str:
    """expr with `$name` / `${name}` and Grafana's interval variables replaced."""
    builtins = {"__rate_interval": RATE_INTERVAL, **({"__range": f"{range_s}s"} if range_s else {})}
    table = {**builtins, **values}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: table.get(m.group(1), m.group(0)), expr)
