"""vLLM's metric table (vllm_metrics_v0.33.json, taken from vLLM's source) and the check
of one /metrics scrape against it, shared by the live-server tests."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.metrics.engine_metrics import build_1_2_5_buckets

TABLE = json.loads((Path(__file__).parent / "vllm_metrics_v0.33.json").read_text())


def families(text: str) -> dict:
    """Metric families by name; the parser names a counter without its `_total`."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def family_name(spec: dict) -> str:
    return spec["name"].removesuffix("_total") if spec["type"] == "counter" else spec["name"]


def label_names(family) -> set[str]:
    names = set()
    for sample in family.samples:
        names |= set(sample.labels) - {"le", "quantile"}
    return names


def bucket_bounds(family) -> list[float]:
    return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})


def check_against_table(got: dict, max_model_len: int, flag: str | None) -> None:
    """Every table metric with its type, label names, pre-created label values and buckets;
    the hidden ones only when `flag` is the version vLLM hid them for."""
    request_tokens = build_1_2_5_buckets(max_model_len)
    for spec in TABLE["metrics"]:
        name = family_name(spec)
        assert name in got, f"{spec['name']} missing from /metrics"
        family = got[name]
        assert family.type == spec["type"], (name, family.type)
        if "labels" in spec:
            assert label_names(family) == set(spec["labels"]), (name, label_names(family))
        else:
            assert set(spec["labels_include"]) <= label_names(family), name
        for label, values in spec.get("label_values", {}).items():
            assert {s.labels[label] for s in family.samples} >= set(values), (name, label)
        if "buckets" in spec:
            expected = request_tokens if spec["buckets"] == "request_tokens" else spec["buckets"]
            assert bucket_bounds(family) == [float(b) for b in expected], name
    for version, specs in TABLE["hidden"].items():
        for spec in specs:
            name = family_name(spec)
            if version == flag:
                assert name in got, f"{spec['name']} missing with --show-hidden-metrics-for-version {flag}"
                assert got[name].type == spec["type"]
                assert label_names(got[name]) == set(spec["labels"])
            else:
                assert name not in got, f"{spec['name']} shown with --show-hidden-metrics-for-version {flag}"
