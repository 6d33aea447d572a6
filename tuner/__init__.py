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
    report.py       the report (JSON and table)
"""
