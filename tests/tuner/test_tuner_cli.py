"""`kvpilot tune` flag handling (no engine): bad flags exit 2, good ones build the space,
SLOs and workload; the top-level CLI routes `tune` here; the tuner's own metrics."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvpilot.api.tuning_metrics import TunerMetrics
from kvpilot.cli.main import main as kvpilot_main
from kvpilot.tuner import cli
from kvpilot.tuner.demo import BURST, CACHE_REQUESTS, Cache, Calibration, demo_args


@pytest.mark.parametrize("argv", [
    [],                                                    # neither --local nor a resource
    ["--local", "--namespace", "default", "--name", "x"],  # both
    ["--namespace", "default"],                            # no --name
    ["--local", "--max-num-seqs", "64"],                   # not LOW:HIGH
    ["--local", "--max-num-seqs", "0:64"],                 # bounds must be > 0
    ["--local", "--chunked-prefill", "maybe"],
    ["--local", "--objective", "latency"],
    ["--local", "--trials", "0"],
    ["--local", "--request-rate", "0"],
    ["--local", "--prometheus-url", "http://127.0.0.1:9090"],  # which engine port does it scrape?
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(argv)
    assert exit_.value.code == 2
    assert "kvpilot tune" in capsys.readouterr().err


def test_flags_build_the_space_slos_and_workload(tmp_path):
    a = cli.parse(["--local", "--max-num-batched-tokens", "256:2048", "--max-num-seqs", "4:32",
                   "--gpu-memory-utilization", "0.6:0.9", "--chunked-prefill", "on", "--slo-ttft-ms", "500",
                   "--engine-arg=--num-gpu-blocks-override=64", "--num-requests", "5", "--report-dir", str(tmp_path)])
    assert a.space.max_num_batched_tokens == (256, 2048) and a.space.max_num_seqs == (4, 32)
    assert a.space.gpu_memory_utilization == (0.6, 0.9) and a.space.enable_chunked_prefill == (True,)
    assert a.slo.ttft_p95_ms == 500 and a.slo.itl_p95_ms == 200
    assert a.engine_args == ["--num-gpu-blocks-override", "64"]
    assert a.workload.num_requests == 5 and math.isinf(a.workload.request_rate)
    assert a.report_dir == tmp_path and a.api_key


CACHE = Cache(num_blocks=20, block_size=16, token_bytes=23040, dtype="bfloat16")
CALIBRATION = Calibration(ttft_s=0.2, tpot_s=0.04)  # unloaded, on some machine: 64-token replies take 2.7 s


def test_demo_flags_parse(tmp_path):
    a = cli.parse(demo_args(CALIBRATION, CACHE, tmp_path))
    assert a.local and a.trials >= 3 and a.engine_args == ["--kv-cache-memory-bytes", str(20 * 16 * 23040)]
    assert a.workload.num_requests == BURST and math.isinf(a.workload.request_rate)  # one burst per window
    # not one at a time: a window would take BURST request-times
    assert a.space.enable_chunked_prefill == (True,) and a.space.max_num_seqs[0] == 2
    # the guide's first remedy is in the search too: up to KV_CACHE_GROWTH times the demo's cache
    assert a.space.kv_cache_memory_bytes == (CACHE.kv_cache_memory_bytes, 4 * CACHE.kv_cache_memory_bytes)


def test_demo_slos_come_from_the_calibration():
    a = cli.parse(demo_args(CALIBRATION, CACHE, Path("/tmp")))
    rounds = -(-BURST // CACHE_REQUESTS) + 1  # the burst passes through a cache of CACHE_REQUESTS at a time
    assert CALIBRATION.max_output_len == 64 and CALIBRATION.latency_s == pytest.approx(0.2 + 63 * 0.04)
    assert a.slo.ttft_p95_ms == pytest.approx(200 + rounds * (200 + 63 * 40), abs=1)
    # an inter-token gap may hold one other request's prefill step (~ the unloaded TTFT)
    assert a.slo.itl_p95_ms == pytest.approx(200 + 2 * 40, abs=1) and a.slo.itl_p95_ms > 200
    assert a.slo.max_preemptions_per_min == 0


def test_a_slow_machine_gets_shorter_replies_not_a_longer_demo():
    slow = Calibration(ttft_s=1.0, tpot_s=0.6)  # a busy 2-core machine
    assert slow.max_output_len == 32 and Calibration(ttft_s=0.3, tpot_s=0.06).max_output_len == 45
    a = cli.parse(demo_args(slow, CACHE, Path("/tmp")))
    assert a.workload.max_output_len == 32


def test_top_level_cli_routes_tune_and_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        kvpilot_main(["tune", "--bogus"])
    assert exit_.value.code == 2


def test_tuner_metrics_carry_the_dashboard_names_and_labels():
    metrics = TunerMetrics("default", "smollm2")
    metrics.record(3, "measured", 1.25)
    metrics.record(4, "pruned", None)
    text = generate_latest(metrics.registry).decode()
    assert 'kvpilot_tuning_trial{inferenceservice="smollm2",namespace="default"} 4.0' in text
    assert 'kvpilot_tuning_best_objective{inferenceservice="smollm2",namespace="default"} 1.25' in text
    assert 'verdict="pruned"' in text


def test_daemon_builds_its_session_flags_from_the_environment():
    from kvpilot.tuner.cluster.daemon import session_args, wants_tuning

    env = {"KVPILOT_TUNER_ARGS": "--num-requests 16 --target-url 'http://engine:8000'",
           "KVPILOT_PROMETHEUS_URL": "http://prometheus:9090"}
    argv = session_args("prod", "llm", env)
    a = cli.parse(argv)
    assert (a.namespace, a.name, a.num_requests, a.target_url, a.prometheus_url) == \
        ("prod", "llm", 16, "http://engine:8000", "http://prometheus:9090")
    assert a.trials is None and a.objective is None  # the resource's spec.tuning decides
    assert wants_tuning(spec={"tuning": {"enabled": True}}, status={})
    assert not wants_tuning(spec={"tuning": {"enabled": True}}, status={"tuning": {"phase": "Done"}})
    assert not wants_tuning(spec={"tuning": {"enabled": False}}, status={})
    # continuous mode: the daemon keeps watching after a study, and starts on a resource switched to it
    assert wants_tuning(spec={"tuning": {"enabled": True, "mode": "continuous"}}, status={"tuning": {"phase": "Done"}})
    assert not wants_tuning(spec={"tuning": {"enabled": False, "mode": "continuous"}}, status={})


def test_a_searched_setting_given_as_an_engine_arg_is_not_repeated_after_the_trials_flags():
    """The demo sizes the defaults' cache with --engine-arg=--kv-cache-memory-bytes=N and searches
    the same setting: every trial's own flags carry it, and the fixed arguments must not repeat N
    after them (argparse's last value would win and no trial would get another cache)."""
    from kvpilot.tuner.local.session import base_settings, fixed_engine_args

    a = cli.parse(demo_args(CALIBRATION, CACHE, Path("/tmp")) + ["--engine-arg=--num-gpu-blocks-override=64"])
    assert base_settings(a).kv_cache_memory_bytes == CACHE.kv_cache_memory_bytes
    assert fixed_engine_args(a.engine_args) == ["--num-gpu-blocks-override", "64"]


def test_the_limits_running_before_tuning_are_the_defaults_trial_and_not_repeated():
    from kvpilot.tuner.local.session import base_settings, fixed_engine_args

    a = cli.parse(["--local", "--engine-arg=--max-num-batched-tokens=64", "--engine-arg=--max-num-seqs=16",
                   "--engine-arg=--num-gpu-blocks-override=64"])
    base = base_settings(a)
    assert (base.max_num_batched_tokens, base.max_num_seqs) == (64, 16)
    assert fixed_engine_args(a.engine_args) == ["--num-gpu-blocks-override", "64"]


def test_continuous_flags_are_checked():
    ok = ["--local", "--continuous", "--live-seconds", "30", "--port", "8000"]
    assert cli.parse(ok + ["--pin", "max_num_seqs"]).pinned == ("max_num_seqs",)
    for bad in (["--local", "--continuous", "--port", "8000"], ok + ["--shift-ratio", "1"],
                ok + ["--pin", "max_model_len"], ["--namespace", "n", "--name", "x", "--continuous"]):
        with pytest.raises(SystemExit) as e:
            cli.parse(bad)
        assert e.value.code == 2, bad
