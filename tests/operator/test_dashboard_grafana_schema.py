"""The chart's dashboard type-checks against Grafana's own Dashboard types (@grafana/schema,
`tsc --strict --noEmit`), and the same check fails on a dashboard with a misspelled field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from grafana_tsc import tsc

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"


def test_the_dashboard_passes_grafanas_schema(tmp_path):
    result = tsc({"kvpilot": json.loads(DASHBOARD.read_text())}, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_misspelled_fields_fail_grafanas_schema(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    width = copy.deepcopy(dashboard)
    width["panels"][0]["gridPos"]["wdith"] = width["panels"][0]["gridPos"].pop("w")
    unit = copy.deepcopy(dashboard)
    unit["panels"][1]["fieldConfig"]["defaults"]["unitt"] = unit["panels"][1]["fieldConfig"]["defaults"].pop("unit")
    expr = copy.deepcopy(dashboard)
    expr["annotations"]["list"][1]["target"]["exrp"] = expr["annotations"]["list"][1]["target"].pop("expr")
    result = tsc({"width": width, "unit": unit, "expr": expr}, tmp_path)
    assert result.returncode != 0
    assert "width.ts" in result.stdout and "'\"wdith\"' does not exist" in result.stdout
    assert "unit.ts" in result.stdout and "'\"unitt\"' does not exist" in result.stdout
    assert "expr.ts" in result.stdout and "'\"exrp\"' does not exist" in result.stdout
