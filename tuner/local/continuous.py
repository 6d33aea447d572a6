"""`kvpilot tune --local --continuous`: continuous tuning (`kvpilot.tuner.continuous`) of one
local engine process serving live traffic that something else sends to its --port.

Every trial observes the live traffic for --live-seconds (as an InferenceService's `workload:
live` does), cut short when it clearly breaks an SLO; scheduler-only changes apply to the
running engine (POST /admin/scheduler_config), others restart it, which fails the requests
in flight (a cluster rolls pods instead). After each study the engine keeps running the
study's outcome, and the watcher reads the engine's /metrics (or --prometheus-url) every
--watch-seconds. Each study's report goes to REPORT_DIR/STUDY/, the session's timeline to
REPORT_DIR/timeline.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import optuna

from kvpilot.api.tuning_metrics import TunerMetrics
from kvpilot.tuner.report import tuning_report as reports
from kvpilot.tuner.continuous import ContinuousConfig, Timeline, run_continuous, watch_window
from kvpilot.tuner.search.feasibility import resolve_model
from kvpilot.tuner.local.runner import LocalRunner
from kvpilot.tuner.local.session import hardware_for, local_engine, progress_printer
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import Measurement
from kvpilot.tuner.measure.promql import PrometheusSource
from kvpilot.tuner.search.reseed import prepare
from kvpilot.tuner.measure.scrape import ScrapeSource
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.shape import WorkloadShape
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.watch import WatchConfig


class LocalSite:
    """The continuous session's Site for one local engine process (see the module doc)."""

    def __init__(self, a: argparse.Namespace, storage: optuna.storages.BaseStorage, base_name: str,
                 metrics: TunerMetrics):
        self.a, self.storage, self.base_name, self.metrics = a, storage, base_name, metrics
        self.model, self.hardware = resolve_model(a.model), hardware_for(a)
        self.base, self.engine = local_engine(a, self.hardware)
        self.name = a.model.removeprefix("builtin://")
        self.space = a.space.pin(a.pinned)
        self.runner = LocalRunner(self.engine, a.workload, None, a.slo, self.name, source_for=self.source_for,
                                  live=not a.no_live, live_seconds=a.live_seconds)

    def source_for(self, url: str) -> ScrapeSource | PrometheusSource:
        """The measurement source: the engine's /metrics, or --prometheus-url scoped to it."""
        if self.a.prometheus_url:
            selector = ",".join(s for s in (f'model_name="{self.name}"', self.a.prometheus_selector) if s)
            return PrometheusSource(self.a.prometheus_url, selector)
        return ScrapeSource(url, {"model_name": self.name})

    def run_study(self, name: str, running: EngineSettings, n_trials: int) -> tuple[optuna.Study, EngineSettings]:
        """Site.run_study on the live traffic: seeds study `name` from the journal, runs it, writes its
        report under --report-dir/NAME and serves the winner when the decision replaces `running`."""
        a = self.a
        study = open_study(name, self.storage, a.objective, a.sampler, a.seed)
        prepare(study, self.storage, self.base_name, running, self.space, self.model, a.pinned)
        tuner = Tuner(study, self.space, running, self.model, self.hardware, a.slo, self.runner,
                      TunerConfig(objective=a.objective, latency=a.latency, n_trials=n_trials,
                                  remeasure_top=a.remeasure_top, guided=a.guide),
                      on_trial=progress_printer(n_trials, self.metrics, [study]))
        print(f"study {name}: {n_trials} trials on live traffic from {running.describe()}", file=sys.stderr, flush=True)
        tuner.run()
        rep = reports.build(study, a.slo, a.objective, {"mode": "local-continuous", "model": self.name})
        reports.write(rep, a.report_dir / name)
        replace = rep.get("best") and (rep.get("decision") or {}).get("replace", True)
        final = EngineSettings(**rep["best"]["settings"]) if replace else running
        if not (self.engine.running and self.engine.settings == final):  # vLLM: no restart for nothing
            self.runner.apply(final)  # the engine serves the outcome while the watcher looks on
        print(f"study {name} done: serving {final.describe()} ({(rep.get('decision') or {}).get('reason', '')})",
              file=sys.stderr, flush=True)
        return study, final

    def observe(self) -> tuple[Measurement, WorkloadShape]:
        """One watch window (--watch-seconds, grown until WatchConfig.min_requests) of the engine's traffic."""
        return watch_window(self.source_for(self.engine.base_url), self.a.slo, self.a.watch_seconds,
                            WatchConfig().min_requests)

    def publish(self, status: dict[str, Any]) -> None:
        """A progress line on stderr for a watch window (attainment, breaches, req/s, token p50s); else nothing."""
        watch = status.get("watch")
        if watch:
            shape = watch["shape"]
            print(f"[watch] attainment {watch['attainment']}, breached {watch['breached_windows']}, "
                  f"{shape.get('arrival_rps') or 0:.2f} req/s, prompt p50 {shape.get('prompt_tokens_p50')}, "
                  f"output p50 {shape.get('output_tokens_p50')}" + (f" (held: {watch['held']})" if watch["held"] else ""),
                  file=sys.stderr, flush=True)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        """A `[reason] message` line on stderr (where a cluster posts a Kubernetes Event)."""
        print(f"[{reason}] {message}", file=sys.stderr, flush=True)


def watch_config(a: argparse.Namespace) -> WatchConfig:
    """The watcher's settings from `kvpilot tune`'s flags."""
    return WatchConfig(window_s=a.watch_seconds, breach_windows=a.breach_windows, shift_ratio=a.shift_ratio,
                       cooldown_s=a.cooldown_s, max_studies_per_hour=a.max_studies_per_hour)


def run_local_continuous(a: argparse.Namespace) -> Timeline:
    """Runs the session until --max-windows windows (or Ctrl-C); writes the timeline."""
    name = a.model.removeprefix("builtin://")
    storage = optuna.storages.get_storage(a.storage) if a.storage else optuna.storages.InMemoryStorage()
    metrics = TunerMetrics("local", name)
    metrics.set_slo(a.slo)
    if a.metrics_port:
        metrics.serve(a.metrics_port)
    site = LocalSite(a, storage, a.study_name or f"kvpilot-local-{name}", metrics)
    config = ContinuousConfig(watch=watch_config(a), first_trials=a.trials, retune_trials=a.retune_trials,
                              max_windows=a.max_windows)
    timeline = Timeline()
    try:
        run_continuous(site, storage, site.base_name, site.base, a.slo, config, metrics, timeline=timeline)
    except KeyboardInterrupt:
        pass
    finally:
        site.runner.close()
        (a.report_dir / "timeline.json").write_text(json.dumps(timeline.entries, indent=1))
    return timeline
