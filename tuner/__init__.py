"""kvpilot's SLO tuner: searches engine settings with Optuna against latency SLOs.

    search/     what to try, pure of I/O: settings.py (EngineSettings: one trial's flags, as CLI
                flags / spec.engine / params), space.py (SearchSpace: bounds, Optuna suggestions),
                feasibility.py (the engine's rules and KV-cache arithmetic, before anything runs),
                objective.py (SLO, Measurement, slack, objective values), study.py (the Optuna study),
                loop.py (Tuner: ask and tell), guide.py, decision.py, capacity.py, reseed.py
    measure/    what a trial measured: window.py (histogram_quantile, deltas), scrape.py
                (ScrapeSource: /metrics directly), promql.py (PrometheusSource), shape.py (the
                workload's shape), workload.py (ShareGPT / trace load through kvpilot.loadgen),
                trial_window.py (WindowMeasurer, TrialCutShort's test: both runners use it)
    local/      local mode (`kvpilot tune --local`): runner.py, session.py, continuous.py,
                engine_process.py, vllm_runtime.py
    cluster/    cluster mode (client: kvpilot.api.kube; `kvpilot tune --namespace --name`):
                runner.py, session.py, continuous.py, journal.py (a study in a ConfigMap),
                daemon.py (the in-cluster tuner, a Kopf daemon), slo_metrics.py (kvpilot_slo_*),
                remote_tokenizer.py
    report/     tuning_report.py, artifacts.py, story.py: report.json/.txt, plots, the tuned YAML
    benchmark/  `kvpilot bench tuning` and `bench retune`
    continuous.py, watch.py   re-tuning on a workload shift (spec.tuning.mode continuous)
    failures.py     why a trial failed (and TrialCutShort)
    cli.py, demo.py the `kvpilot tune` command and `make demo`'s session
The search imports no Kubernetes client, no load generator and no runner (.importlinter).
Nothing here imports `kvpilot.operator` or `kvpilot.bench`: the spec types, the CRD's identity
and the kvpilot_slo_* / kvpilot_tuning_* series (the dashboard's SLO lines and tuner panels) come
from `kvpilot.api`, the load a trial drives from the load library `kvpilot.loadgen`.
"""
