"""spec.engine.showHiddenMetricsForVersion: rendered as vLLM's flag (default 0.11, so that
dashboards on vllm:time_per_output_token_seconds keep working), off when empty, rejected by
the CRD schema when it is not a version, and the same in both CRD copies."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from kvpilot.operator.render.engine_args import render_engine_args
from kvpilot.api.spec import InferenceServiceSpec

ROOT = Path(__file__).resolve().parents[2]
CRDS = [ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml",
        ROOT / "charts" / "kvpilot" / "crds" / "inferenceservices.kvpilot.dev.yaml"]


def field_schema(path: Path) -> dict:
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["engine"]["properties"]["showHiddenMetricsForVersion"]


def flags(engine: dict) -> list[str]:
    return render_engine_args(InferenceServiceSpec.from_dict({"model": {"source": "/m"}, "engine": engine}).engine)


def test_the_default_renders_one_version_back_and_empty_renders_nothing():
    args = flags({})
    assert args[args.index("--show-hidden-metrics-for-version") + 1] == "0.11"
    assert "--show-hidden-metrics-for-version" not in flags({"showHiddenMetricsForVersion": ""})
    args = flags({"showHiddenMetricsForVersion": "0.10"})
    assert args[args.index("--show-hidden-metrics-for-version") + 1] == "0.10"


@pytest.mark.parametrize("path", CRDS, ids=["crds", "chart"])
def test_the_crd_documents_defaults_and_checks_the_field(path):
    schema = field_schema(path)
    assert schema == field_schema(CRDS[0])
    assert schema["default"] == InferenceServiceSpec.from_dict({"model": {"source": "/m"}}).engine \
        .showHiddenMetricsForVersion
    assert "--show-hidden-metrics-for-version" in schema["description"]
    for good in ("0.11", "0.10", ""):
        jsonschema.validate(good, schema)
    for bad in ("latest", "0.11; rm -rf /", "v0.11", "0.11.0"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
