"""Table and JSON of run.sh's results: per side (before / after the move) and concurrency, each
round's output tokens/s, median TTFT and median ITL from `kvpilot bench serve`'s result files
(vLLM's keys), their median over rounds, and after / before."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows: dict[tuple[str, int], list[dict]] = {}
for path in sorted(out.glob("*.json")):
    if path.name == "summary.json":
        continue
    r = json.loads(path.read_text())
    side, conc, _ = path.stem.split("_")
    rows.setdefault((side, int(conc[1:])), []).append(r)
keys = [("output_throughput", "out tok/s"), ("median_ttft_ms", "median TTFT ms"), ("median_itl_ms", "median ITL ms")]
summary = {}
lines = ["| concurrency | side | rounds | " + " | ".join(label for _, label in keys) + " |",
         "|---|---|---:|" + "---:|" * len(keys)]
for conc in sorted({c for _, c in rows}):
    for side in ("before", "after"):
        runs = rows.get((side, conc), [])
        if not runs:
            continue
        med = {k: statistics.median(r[k] for r in runs) for k, _ in keys}
        summary[f"{side}_c{conc}"] = {"rounds": [{k: r[k] for k, _ in keys} for r in runs], "median": med}
        cells = [" / ".join(f"{r[k]:.1f}" for r in runs) + f" (median {med[k]:.1f})" for k, _ in keys]
        lines.append(f"| {conc} | {side} | {len(runs)} | " + " | ".join(cells) + " |")
    if f"before_c{conc}" in summary and f"after_c{conc}" in summary:
        ratio = {k: summary[f"after_c{conc}"]["median"][k] / summary[f"before_c{conc}"]["median"][k] for k, _ in keys}
        summary[f"ratio_c{conc}"] = ratio
        lines.append(f"| {conc} | after / before | | " + " | ".join(f"{ratio[k]:.3f}" for k, _ in keys) + " |")
machine = (out / "machine.txt").read_text() if (out / "machine.txt").exists() else ""
summary["machine"] = machine.splitlines()
(out / "summary.json").write_text(json.dumps(summary, indent=2))
(out / "summary.md").write_text("\n".join(lines) + "\n")
print(machine)
print("\n".join(lines))
