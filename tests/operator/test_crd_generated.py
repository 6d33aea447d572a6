"""Both CRD copies are `kvpilot crd`'s output, byte for byte: the engine settings' schema and
CEL rules come from kvpilot.engine.settings, the rest from operator/render/crd_base.yaml."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import celpy
import pytest

from kvpilot.engine import settings
from kvpilot.operator.render.crd import COPIES, build_crd, guarded_cel, render_crd

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("relative", COPIES, ids=str)
def test_each_crd_copy_is_the_generators_output(relative):
    assert (ROOT / relative).read_text() == render_crd(), f"run `kvpilot crd --write` to regenerate {relative}"


def test_kvpilot_crd_write_regenerates_both_copies(tmp_path):
    for relative in COPIES:
        (tmp_path / relative).parent.mkdir(parents=True)
    out = subprocess.run([sys.executable, "-m", "kvpilot.cli.main", "crd", "--write", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.count("wrote ") == 2
    assert all((tmp_path / r).read_bytes() == (ROOT / r).read_bytes() for r in COPIES)


def test_the_crd_carries_every_setting_with_its_bounds_default_and_rules():
    engine = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"]
    defaults = settings.crd_defaults()
    assert {n for n, v in defaults.items() if v != settings.deploy_defaults()[n]} == {"block_size"}
    assert defaults["block_size"] is None  # the operator fills it by runtime and devices (kvpilot.api.spec)
    for name, field in settings.CRD_FIELDS.items():
        s, schema = settings.BY_NAME[name], engine["properties"][field]
        assert s.flag in schema["description"]
        low = None if s.minimum is None else min((s.minimum, *s.special))  # maxModelLen: -1 is auto
        assert schema.get("default") == defaults[name] and schema.get("minimum") == low, field
        assert schema.get("enum") == (list(s.choices) if s.choices else None)
    assert [r["rule"] for r in engine["x-kubernetes-validations"]] == [guarded_cel(r) for r in settings.RULES]
    assert all(r.cel in guarded_cel(r) and "!has(self." in guarded_cel(r) for r in settings.RULES)
    assert list(engine["properties"])[:3] == ["runtime", "image", "imagePullPolicy"]


def test_max_model_len_takes_auto_as_minus_one_and_nothing_else_below_16():
    """vLLM's `--max-model-len -1` (auto) passes the CRD's rule; 0-15 do not (the schema's
    minimum is -1, so the field's CEL rule is what refuses them)."""
    engine = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"]
    field = engine["properties"]["maxModelLen"]
    env = celpy.Environment()
    program = env.program(env.compile(field["x-kubernetes-validations"][0]["rule"]))
    for value in (-1, 0, 1, 15, 16, 2048):
        assert bool(program.evaluate({"self": celpy.json_to_cel(value)})) == (value == -1 or value >= 16), value
        assert (settings.BY_NAME["max_model_len"].problem(value) is None) == (value == -1 or value >= 16), value
    for name in ("performanceMode", "kvCacheMemoryBytes"):
        assert settings.BY_CRD[name].flag in engine["properties"][name]["description"]
    assert engine["properties"]["performanceMode"]["enum"] == ["balanced", "interactivity", "throughput"]


def test_the_nnodes_rule_on_spec_is_the_settings_tables():
    """spec's CEL for nnodes is rendered from kvpilot.engine.settings.NNODES_RULE (issue 51): the
    hand-written base holds none, and the rendered rule refuses what the table's check refuses."""
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r for r in spec["x-kubernetes-validations"] if r.get("fieldPath") == ".parallelism.nnodes"]
    rule = settings.NNODES_RULE
    assert rules == [{"rule": guarded_cel(rule), "message": rule.message(lambda k: settings.SPEC_PATHS[k.rstrip(":")]),
                      "fieldPath": ".parallelism.nnodes", "reason": "FieldValueInvalid"}]
    assert rule.cel in rules[0]["rule"] and "% self.parallelism.nnodes" not in (ROOT / "operator/render/crd_base.yaml").read_text()
    env = celpy.Environment()
    program = env.program(env.compile(rules[0]["rule"]))
    for tp, pp, nnodes in [(1, 1, 1), (1, 2, 2), (3, 1, 2), (2, 2, 4), (3, 2, 4), (1, 2, 3)]:
        obj = {"engine": {"tensorParallelSize": tp, "pipelineParallelSize": pp}, "parallelism": {"nnodes": nnodes}}
        assert bool(program.evaluate({"self": celpy.json_to_cel(obj)})) == settings.nnodes_divides(tp * pp, nnodes)
    for partial in ({}, {"engine": {}}, {"parallelism": {"nnodes": 2}}, {"engine": {"tensorParallelSize": 3}}):
        assert bool(program.evaluate({"self": celpy.json_to_cel(partial)}))  # absent: checked after defaulting


def test_every_crd_default_outside_the_engine_is_the_spec_dataclasss():
    """Issue 51: one source per default. spec.engine's come from the settings table (above); the
    other sections' defaults written in crd_base.yaml must equal api/spec.py's dataclasses (what
    the operator and the tuner apply to a spec the API server did not default, and what the
    tuner's watcher starts from: tuner/watch.py WatchConfig reads TuningSpec)."""
    from dataclasses import fields, is_dataclass

    from kvpilot.api.spec import InferenceServiceSpec

    spec_schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    checked = 0
    for section in fields(InferenceServiceSpec):
        if section.name in ("model", "engine") or not callable(section.default_factory):
            continue
        instance = section.default_factory()
        assert is_dataclass(instance), section.name
        for name, schema in spec_schema[section.name]["properties"].items():
            if "default" in schema:
                value = getattr(instance, name)
                assert schema["default"] == (list(value) if isinstance(value, tuple) else value), f"{section.name}.{name}"
                checked += 1
    assert checked >= 10, checked  # the tuning and SLO sections' defaults at least
