"""Checks a Grafana dashboard JSON against Grafana's own generated types (`Dashboard` from
the npm package @grafana/schema) with `tsc --strict --noEmit`, as the dashboard's authors'
TypeScript would. The JSON is written as an object literal, so TypeScript also rejects
unknown (misspelled) keys; its string enums (ThresholdsMode, ...) are read as the union of
their values, since JSON stores the values. Tools: scripts/install-tools.sh ($VENV/node)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

NODE_DIR = Path(sys.prefix) / "node"
TSC = NODE_DIR / "node_modules" / "typescript" / "bin" / "tsc"
HEADER = """import type { AnnotationQuery, Dashboard, DataQuery, Panel, RowPanel } from "@grafana/schema";

// Grafana's Prometheus plugin query (PromQuery in @grafana/prometheus, which @grafana/schema
// leaves open as DataQuery): the fields our panels and annotations use.
interface PromQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  format?: "time_series" | "table" | "heatmap";
  instant?: boolean;
  range?: boolean;
  interval?: string;
  step?: string;
  titleFormat?: string;
  textFormat?: string;
}
type PromDashboard = Omit<Dashboard, "panels" | "annotations"> & {
  panels?: ((Omit<Panel, "targets"> & { targets?: PromQuery[] }) | RowPanel)[];
  annotations?: { list?: AnnotationQuery<PromQuery>[] };
};
// JSON stores TypeScript's string enums (ThresholdsMode, ...) as their values.
type Json<T> = T extends string ? `${T}` : T extends readonly (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;

export const dashboard: Json<PromDashboard> = """


def tsc(dashboards: dict[str, dict], workdir: Path) -> subprocess.CompletedProcess:
    """Type-checks each dashboard (file stem -> JSON) in one tsc run; returncode 0 when all
    pass, else stdout names each error as `stem.ts(line,col): error TS...`."""
    node = shutil.which("node")
    assert node and TSC.exists(), "node and typescript come from scripts/install-tools.sh"
    files = []
    for stem, dashboard in dashboards.items():
        path = workdir / f"{stem}.ts"
        path.write_text(HEADER + json.dumps(dashboard, indent=2) + ";\n")
        files.append(path.name)
    config = {"compilerOptions": {"strict": True, "noEmit": True, "target": "es2022", "module": "esnext",
                                  "moduleResolution": "bundler", "skipLibCheck": True, "types": [],
                                  "paths": {"@grafana/schema": [str(NODE_DIR / "node_modules/@grafana/schema")]}},
              "files": files}
    (workdir / "tsconfig.json").write_text(json.dumps(config))
    return subprocess.run([node, str(TSC), "-p", str(workdir / "tsconfig.json"), "--strict", "--noEmit"],
                          capture_output=True, text=True, timeout=300, cwd=workdir)
