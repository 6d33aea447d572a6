"""Table and JSON of the shared-node rounds in DIR (`kvpilot bench shared-node --peers kvpilot`
run from each checkout in turn, files SIDE_rN.json): per arrangement and side, each round's
median ITL, p95 ITL and burst tokens/s, their median over rounds, after / before, and each
side's neighbour and quota figures against its own alone."""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
keys = [("median_itl_ms", "median ITL ms"), ("p95_itl_ms", "p95 ITL ms"), ("burst_output_throughput", "burst tok/s")]
runs: dict[str, list[dict]] = {"before": [], "after": []}
for path in sorted(out.glob("*_r*.json")):
    runs[path.stem.split("_")[0]].append(json.loads(path.read_text())["peers"]["kvpilot"])
summary: dict = {}
lines = ["| arrangement | side | rounds | " + " | ".join(label for _, label in keys) + " |",
         "|---|---|---:|" + "---:|" * len(keys)]
for arrangement in ("alone", "neighbours", "quota"):
    for side in ("before", "after"):
        rows = [r[arrangement] for r in runs[side]]
        med = {k: statistics.median(r[k] for r in rows) for k, _ in keys}
        summary[f"{side}_{arrangement}"] = med
        cells = [" / ".join(f"{r[k]:.1f}" for r in rows) + f" (median {med[k]:.1f})" for k, _ in keys]
        lines.append(f"| {arrangement} | {side} | {len(rows)} | " + " | ".join(cells) + " |")
    ratio = {k: summary[f"after_{arrangement}"][k] / summary[f"before_{arrangement}"][k] for k, _ in keys}
    summary[f"ratio_{arrangement}"] = ratio
    lines.append(f"| {arrangement} | after / before | | " + " | ".join(f"{ratio[k]:.3f}" for k, _ in keys) + " |")
lines += ["", "| side | neighbours / alone: median ITL | p95 ITL | burst tok/s | quota / alone: median ITL |",
          "|---|---:|---:|---:|---:|"]
for side in ("before", "after"):
    a, n, q = (summary[f"{side}_{x}"] for x in ("alone", "neighbours", "quota"))
    lines.append(f"| {side} | {n['median_itl_ms'] / a['median_itl_ms']:.2f} | {n['p95_itl_ms'] / a['p95_itl_ms']:.2f} | "
                 f"{n['burst_output_throughput'] / a['burst_output_throughput']:.2f} | "
                 f"{q['median_itl_ms'] / a['median_itl_ms']:.2f} |")
(out / "summary.json").write_text(json.dumps(summary, indent=2))
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
