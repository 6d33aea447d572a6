"""The one table of differences between a `/metrics` scrape of vLLM and of kvpilot serve with
the same metric flags (tests/oracle/test_oracle_metrics.py reads it), and the comparison.

A scrape is reduced to {family: (type, label names, bucket bounds)}; vLLM's `*_created` series
(prometheus-client's creation times, which kvpilot's registry turns off: they are not part of
vLLM's documented set) are dropped first. Every family or label that differs must be a row here
with its reason; a row that no longer differs fails the test too."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# family (as prometheus_client's parser names it: a counter without _total) -> why only one side has it
ONLY_VLLM: dict[str, str] = {}
ONLY_KVPILOT: dict[str, str] = {
    "kvpilot:engine_config_info": "kvpilot's own info gauge: the scheduler limits, parallel sizes, dtype and swap "
                                  "space the tuner confirms a trial by (vLLM has no gauge for them)",
}
# (family, label) -> why only one side has the label
LABEL_ONLY_VLLM: dict[tuple[str, str], str] = {}
LABEL_ONLY_KVPILOT: dict[tuple[str, str], str] = {}
VERSION_LABELS = {
    ("vllm:cache_config_info", "simple_cpu_offload_num_blocks"):
        "a CacheConfig field new in vLLM 0.33 (the reference kvpilot follows); the pinned vLLM 0.32 lacks it",
}


def reduce(text: str) -> dict[str, tuple[str, frozenset[str], tuple[float, ...]]]:
    """{family: (type, label names without le, sorted finite bucket bounds)} of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        labels = frozenset(k for s in family.samples for k in s.labels) - {"le", "quantile"}
        bounds = tuple(sorted({float(s.labels["le"]) for s in family.samples if "le" in s.labels}
                              - {float("inf")}))
        out[family.name] = (family.type, labels, bounds)
    return out


def differences(vllm: dict, ours: dict) -> dict[str, set]:
    """Every difference by kind: families on one side only, types, labels on one side only
    (as (family, label)), bucket bounds."""
    both = vllm.keys() & ours.keys()
    return {
        "only_vllm": set(vllm.keys() - ours.keys()),
        "only_kvpilot": set(ours.keys() - vllm.keys()),
        "type": {f for f in both if vllm[f][0] != ours[f][0]},
        "label_only_vllm": {(f, label) for f in both for label in vllm[f][1] - ours[f][1]},
        "label_only_kvpilot": {(f, label) for f in both for label in ours[f][1] - vllm[f][1]},
        "buckets": {f for f in both if vllm[f][2] != ours[f][2]},
    }


def expected(pinned_is_older: bool = True) -> dict[str, set]:
    """The differences the table explains (the pinned vLLM lacks 0.33's labels)."""
    return {
        "only_vllm": set(ONLY_VLLM),
        "only_kvpilot": set(ONLY_KVPILOT),
        "type": set(),
        "label_only_vllm": set(LABEL_ONLY_VLLM),
        "label_only_kvpilot": set(LABEL_ONLY_KVPILOT) | (set(VERSION_LABELS) if pinned_is_older else set()),
        "buckets": set(),
    }
