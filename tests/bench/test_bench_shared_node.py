"""`kvpilot bench shared-node` runs the server the image runs (`kvpilot serve` of the builtin
model, its own thread sizing) in a cpu cgroup of its own, alone, beside busy neighbours in a
second cgroup of equal weight, and under a CPU quota, and leaves no cgroup or process behind.
Needs root (cgroups), as CI has."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from kvpilot.bench import shared_node
from kvpilot.bench.harness.cgroups import CgroupUnavailable, CpuGroup, busy_loops, stop_all
from kvpilot.loadgen.process import cpu_seconds
from kvpilot.bench.shared_node_report import meets, ratios

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cpu cgroups need root (CI runs as root)")


def test_a_group_takes_a_pods_weight_and_limit_and_is_removed():
    with CpuGroup(f"kvpilot-test-{os.getpid()}") as group:
        group.set_weight_millicores(500)
        group.set_quota(1.5)
        if group.version == 1:
            assert (group.path / "cpu.shares").read_text().strip() == "512"  # the kubelet's 500m
            assert (group.path / "cpu.cfs_quota_us").read_text().strip() == "150000"
        else:
            assert (group.path / "cpu.max").read_text().split() == ["150000", "100000"]
        procs = busy_loops(1, group)
        try:
            assert group.pids() == [procs[0].pid]
            start = cpu_seconds(procs[0].pid)
            time.sleep(0.5)
            assert cpu_seconds(procs[0].pid) > start  # it spins
        finally:
            stop_all(procs)
        path = group.path
    assert not path.exists()


def test_the_benchmark_measures_every_arrangement_against_alone(tmp_path, capsys):
    out = tmp_path / "shared.json"
    code = shared_node.main(["--peers", "kvpilot", "--stream-requests", "1", "--stream-output-len", "8",
                             "--num-prompts", "2", "--max-output-len", "8", "--max-model-len", "256",
                             "--output-json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    report = json.loads(out.read_text())
    figures = report["peers"]["kvpilot"]
    for arrangement in ("alone", "neighbours", "quota"):
        f = figures[arrangement]
        assert f["failed"] == 0 and f["burst_failed"] == 0, f
        assert f["median_itl_ms"] > 0 and f["burst_output_throughput"] > 0 and f["tokens"] == 8, f
    assert set(figures["vs_alone"]) == {"neighbours", "quota"}
    assert figures["vs_alone"]["neighbours"]["median_itl_ms"] > 0
    # the server the image runs, sizing its own threads (no OMP_NUM_THREADS from the benchmark)
    assert report["commands"]["kvpilot"][3:5] == ["serve", "smollm2-135m-instruct"]
    assert any(line.startswith("CPU threads: ") for line in figures["thread_lines"]), figures["thread_lines"]
    assert "Shared node: 1 busy neighbour(s)" in capsys.readouterr().out
    leftovers = [p for p in os.listdir("/sys/fs/cgroup/cpu") if p.startswith("kvpilot-bench-")] \
        if os.path.isdir("/sys/fs/cgroup/cpu") else []
    assert leftovers == []
    assert subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True).returncode == 1


def test_ratios_and_goals():
    figures = {"alone": {"median_itl_ms": 10.0, "p95_itl_ms": 12.0, "burst_output_throughput": 100.0},
               "neighbours": {"median_itl_ms": 26.0, "p95_itl_ms": 30.0, "burst_output_throughput": 45.0}}
    vs = ratios(figures, ["alone", "neighbours"])["neighbours"]
    assert vs == {"median_itl_ms": 2.6, "p95_itl_ms": 2.5, "burst_output_throughput": 0.45}
    assert meets("neighbours", vs) == {"median_itl_ms": False, "p95_itl_ms": True, "burst_output_throughput": True}


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        shared_node.main(["--arrangements", "quota,alone"])
    assert exc.value.code == 2 and "alone first" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        shared_node.main(["--peers", "llama-cpp-python", "--llama-cpp-python", "/nonexistent/python"])
    assert exc.value.code == 2 and "llama_cpp is not importable" in capsys.readouterr().err


def test_no_cgroups_is_a_clear_error(tmp_path):
    with pytest.raises(CgroupUnavailable, match="no cpu controller"):
        CpuGroup("x", root=tmp_path)
