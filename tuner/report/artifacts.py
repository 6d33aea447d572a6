"""What the report folder holds besides report.json/report.txt: the tuned InferenceService
as YAML ready for `kubectl apply`, Optuna's plots (optimization history, parameter
importances, the Pareto front for a multi-objective study) and the latency CDFs of the
defaults against the best, as PNG (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml

from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.search.settings import EngineSettings

logger = logging.getLogger("kvpilot.tuner")


def tuned_inferenceservice(name: str, model_source: str, settings: EngineSettings, slo: SLO,
                           base: dict[str, Any] | None = None, extra_args: list[str] | None = None) -> dict[str, Any]:
    """An InferenceService manifest with `settings` in spec.engine (and its pod count in
    spec.parallelism.nnodes when it spans pods or the base sets it). base: an existing
    resource whose spec is kept otherwise (cluster mode); else a minimal one."""
    spec = dict((base or {}).get("spec") or {})
    spec.setdefault("model", {"source": model_source})
    engine = dict(spec.get("engine") or {})
    engine.update(settings.to_engine_spec())
    if extra_args and not engine.get("extraArgs"):
        engine["extraArgs"] = list(extra_args)
    spec["engine"] = engine
    if settings.nnodes > 1 or "parallelism" in spec:
        spec["parallelism"] = {**(spec.get("parallelism") or {}), "nnodes": settings.nnodes}
    spec.setdefault("slo", {"ttftP95Ms": slo.ttft_p95_ms, "itlP95Ms": slo.itl_p95_ms, "e2eP95Ms": slo.e2e_p95_ms,
                            "maxPreemptionsPerMin": slo.max_preemptions_per_min})
    meta = (base or {}).get("metadata") or {}
    metadata = {"name": meta.get("name", name)}
    if meta.get("namespace"):
        metadata["namespace"] = meta["namespace"]
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": metadata, "spec": spec}


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Writes `manifest` (tuned_inferenceservice) to FOLDER/inferenceservice.yaml, ready for
    `kubectl apply -f`; returns its path."""
    path = folder / "inferenceservice.yaml"
    path.write_text("# The tuned settings; apply with: kubectl apply -f inferenceservice.yaml\n"
                    + yaml.safe_dump(manifest, sort_keys=False))
    return path


def write_plots(folder: Path, study: optuna.Study, report: dict[str, Any]) -> list[Path]:
    """Writes the PNGs it can (a plot that needs more trials is skipped with a log line)."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("no plots: matplotlib is not installed (pip install 'kvpilot[bench]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as oplt

    written = []
    sign = 1 if study.directions[0] == optuna.study.StudyDirection.MINIMIZE else -1  # importances look for low values
    plots = {"history.png": lambda: oplt.plot_optimization_history(study, target=lambda t: t.values[0],
                                                                   target_name="objective"),
             "importances.png": lambda: oplt.plot_param_importances(study, target=lambda t: sign * t.values[0],
                                                                  target_name="objective")}
    if len(study.directions) > 1:
        plots = {"pareto.png": lambda: oplt.plot_pareto_front(study, target_names=["throughput", "p95 latency ms"])}
    for name, make in plots.items():
        try:
            with warnings.catch_warnings():  # experimental plots; the importance target's sign is handled
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.simplefilter("ignore", UserWarning)
                ax = make()
            ax.figure.savefig(folder / name, dpi=100, bbox_inches="tight")
            plt.close(ax.figure)
            written.append(folder / name)
        except (ValueError, RuntimeError, IndexError, TypeError) as e:
            logger.info("no %s: %s", name, e)
    path = _latency_cdfs(folder, report, plt)
    if path:
        written.append(path)
    return written


def _latency_cdfs(folder: Path, report: dict[str, Any], plt) -> Path | None:
    """TTFT and E2E latency CDFs of the defaults' and the best trial's requests."""
    trials = {t["number"]: t for t in report["trials"]}
    picks = [("defaults", (report.get("defaults") or {}).get("number")),
             ("best", (report.get("best") or {}).get("number"))]
    series = []
    for label, number in picks:
        client = ((trials.get(number) or {}).get("measurement") or {}).get("extra", {}).get("client") or {}
        latencies = client.get("extra", {}).get("latencies")
        if latencies:
            series.append((f"{label} (#{number})", latencies))
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        for label, lat in series:
            values = sorted(lat[key])
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.set_title(title)
        ax.legend()
    path = folder / "latency_cdf.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
