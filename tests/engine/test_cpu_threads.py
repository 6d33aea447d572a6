"""The engine's CPU thread count follows the process's cgroup CPU quota (a pod's CPU limit) and
affinity, not the host's core count; OMP_NUM_THREADS wins."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from kvpilot.engine.cpu_threads import available_cpus, cgroup_cpu_quota, configure_cpu_threads

AFFINITY = len(os.sched_getaffinity(0))


def cgroup_v1(root, quota_us: int, period_us: int = 100_000):
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return root


def cgroup_v2(root, line: str):
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(line + "\n")
    return root


@pytest.mark.parametrize(("make", "quota"), [
    (lambda r: cgroup_v1(r, 150_000), 1.5),
    (lambda r: cgroup_v1(r, -1), None),
    (lambda r: cgroup_v1(r, 50_000, 50_000), 1.0),
    (lambda r: cgroup_v2(r, "250000 100000"), 2.5),
    (lambda r: cgroup_v2(r, "max 100000"), None),
    (lambda r: r, None),  # no cpu controller mounted
])
def test_the_quota_is_read_from_cgroup_v1_and_v2(tmp_path, make, quota):
    assert cgroup_cpu_quota(make(tmp_path / "cg")) == quota


def test_available_cpus_is_the_quota_rounded_up_at_most_the_affinity(tmp_path):
    assert available_cpus(cgroup_v2(tmp_path / "a", "50000 100000")) == 1
    assert available_cpus(cgroup_v2(tmp_path / "b", "max 100000")) == AFFINITY
    assert available_cpus(cgroup_v2(tmp_path / "c", "6400000 100000")) == AFFINITY  # 64 CPUs' quota


def test_a_limited_pod_runs_as_many_threads_as_its_limit(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with caplog.at_level(logging.INFO, logger="kvpilot.engine.cpu_threads"):
            assert configure_cpu_threads(1, cgroup_v1(tmp_path / "cg", 100_000)) == 1
        assert torch.get_num_threads() == 1
        assert "cgroup CPU quota 1 CPUs" in caplog.text
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert configure_cpu_threads(1, tmp_path / "cg") == 3  # the user's setting stands
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(saved)
