"""The engine loop's stat loggers without an engine: the periodic throughput line (vLLM's
`LoggingStatLogger` wording) and the manager that feeds every logger."""

import logging
from types import SimpleNamespace

from kvpilot.engine.metrics.loggers import (
    LoggingStatLogger,
    PrometheusStatLogger,
    SchedulerState,
    StatLoggerBase,
    StatLoggerManager,
)


def output(num_prompt: int, num_new: int, first: bool):
    metrics = SimpleNamespace(first_token_s=1.0, last_token_s=1.0 if first else 2.0)
    return SimpleNamespace(prompt_token_ids=[0] * num_prompt, new_token_ids=[0] * num_new, metrics=metrics)


def test_the_line_gives_throughput_over_the_interval_then_goes_quiet_when_idle(caplog):
    stat_logger = LoggingStatLogger(interval_s=10.0, now_s=0.0)
    caplog.set_level(logging.INFO, logger="kvpilot.engine.async")
    stat_logger.record_step(None, [output(40, 1, first=True), output(40, 3, first=False)], 1.0)
    stat_logger.record_scheduler_state(SchedulerState(num_running=2, kv_usage=0.25, prefix_queries=4,
                                                      prefix_hits=1))
    stat_logger.log(5.0)
    assert not caplog.records  # the interval has not passed
    stat_logger.log(10.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Engine 000: Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 0.4 tokens/s")
    assert "Running: 2 reqs" in line and "GPU KV cache usage: 25.0%" in line and "Prefix cache hit rate: 25.0%" in line
    stat_logger.record_scheduler_state(SchedulerState())
    stat_logger.log(20.0)  # idle: one line saying so
    stat_logger.log(30.0)  # still idle: nothing
    assert len(caplog.records) == 2
    assert "Avg prompt throughput: 0.0 tokens/s" in caplog.records[1].getMessage()


def test_the_manager_hands_each_hook_to_every_logger_and_skips_missing_steps_for_prometheus():
    calls = []

    class Recorder(StatLoggerBase):
        def record_step(self, step, outputs, now_s):
            calls.append(("step", step))

        def record_aborted(self, request_id):
            calls.append(("aborted", request_id))

    metrics = SimpleNamespace(record_step=lambda *a: calls.append(("prometheus step",)),
                              record_aborted=lambda request_id: calls.append(("prometheus aborted", request_id)))
    manager = StatLoggerManager([Recorder(), PrometheusStatLogger(metrics), Recorder()])
    manager.record_step(None, [], 0.0)
    manager.record_aborted("r1")
    assert calls == [("step", None), ("step", None),
                     ("aborted", "r1"), ("prometheus aborted", "r1"), ("aborted", "r1")]
    assert [type(x).__name__ for x in StatLoggerManager.for_server(None, True, 5.0).loggers] == ["LoggingStatLogger"]
    assert StatLoggerManager.for_server(None, False, 5.0).loggers == []
