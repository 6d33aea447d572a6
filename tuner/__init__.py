"""kvpilot's SLO tuner: searches engine settings with Optuna against latency SLOs.

    settings.py     EngineSettings: one trial's flags, as CLI flags / spec.engine / params
    space.py        SearchSpace: bounds and Optuna suggestions
    feasibility.py  the engine's rules and KV-cache arithmetic, before anything runs
    objective.py    SLO, Measurement, constraint slack, objective values
    study.py        the Optuna study (durable storage, samplers, resuming)
    loop.py         Tuner: the ask-and-tell loop
    window.py       metrics over a window (histogram_quantile, deltas)
    scrape.py       ScrapeSource: the engine's /metrics directly
    promql.py       PrometheusSource: the same through PromQL
    failures.py     classifying a trial that failed to start
    workload.py     ShareGPT / trace load through the load library's run loop (kvpilot.loadgen)
    capacity.py     the highest request rate within the SLOs
    engine_process.py, local.py, local_session.py   local mode (`kvpilot tune --local`)
    cluster.py, cluster_session.py  cluster mode (client: kvpilot.api.kube) (`kvpilot tune --namespace --name`)
    journal.py      a study kept in a ConfigMap (Optuna journal backend)
    slo_metrics.py  a Kopf event handler exporting every resource's spec.slo (kvpilot_slo_*)
    daemon.py       the in-cluster tuner: a Kopf daemon per resource with spec.tuning.enabled
    report.py, artifacts.py   report.json/.txt, plots, the tuned InferenceService YAML
    cli.py, demo.py the `kvpilot tune` command and `make demo`'s session
Nothing here imports `kvpilot.operator` or `kvpilot.bench`: the spec types, the CRD's identity
and the kvpilot_slo_* / kvpilot_tuning_* series (the dashboard's SLO lines and tuner panels) come
from `kvpilot.api`, the load a trial drives from the load library `kvpilot.loadgen`.
"""
