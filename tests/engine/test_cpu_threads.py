"""The engine's CPU threads: how many (the process's cpuset and cgroup CPU quota, a pod's CPU
limit, not the host's core count; OMP_NUM_THREADS wins) and where they are pinned
(VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU with vLLM's meanings)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from kvpilot.engine.cpu.threads import (
    cgroup_cpu_quota,
    configure_cpu_threads,
    parse_cpu_list,
    plan_cpu_threads,
)


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


def test_threads_are_the_quota_rounded_up_at_most_the_cpuset(tmp_path):
    def threads(root):
        return plan_cpu_threads(environ={}, root=root, allowed=[0, 1, 2, 3], online=4).threads

    assert threads(cgroup_v2(tmp_path / "a", "50000 100000")) == 1
    assert threads(cgroup_v2(tmp_path / "b", "150000 100000")) == 2
    assert threads(cgroup_v2(tmp_path / "c", "max 100000")) == 4
    assert threads(cgroup_v2(tmp_path / "d", "6400000 100000")) == 4  # 64 CPUs' quota
    assert plan_cpu_threads(environ={"OMP_NUM_THREADS": "3"}, root=tmp_path / "a", allowed=[0, 1, 2, 3],
                            online=4).threads == 3  # the user's setting stands


def test_auto_pins_only_a_cpuset_of_its_own(tmp_path):
    # the kubelet's static CPU manager: a Guaranteed pod's exclusive cpuset, a quota of its size
    own = plan_cpu_threads(environ={}, root=cgroup_v2(tmp_path / "own", "200000 100000"), allowed=[5, 6], online=8)
    assert (own.threads, own.cpus) == (2, (5, 6))
    assert own.describe().startswith("CPU threads: 2 per rank, bound to CPUs [5, 6] (")
    # taskset / docker --cpuset-cpus without a quota
    assert plan_cpu_threads(environ={}, root=tmp_path, allowed=[2, 3], online=4).cpus == (2, 3)
    # every CPU of the machine: shared with whatever else runs
    shared = plan_cpu_threads(environ={}, root=tmp_path, allowed=[0, 1], online=2)
    assert shared.cpus == () and "shared" in shared.reason
    assert shared.describe().startswith("CPU threads: 2 per rank, not bound (")
    # the shared pool of a node (narrower than the machine) with a fractional limit below it
    pool = plan_cpu_threads(environ={}, root=cgroup_v2(tmp_path / "pool", "50000 100000"), allowed=[0, 1, 2],
                            online=4)
    assert (pool.threads, pool.cpus) == (1, ())
    assert plan_cpu_threads(environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, root=tmp_path, allowed=[2, 3],
                            online=4).cpus == ()


def test_reserved_cpus_and_ranks_share_the_cpuset(tmp_path):
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    one = plan_cpu_threads(environ=env, root=tmp_path, allowed=[4, 5, 6, 7], online=16)
    assert (one.threads, one.cpus) == (3, (4, 5, 6)) and "1 reserved" in one.reason
    # vLLM's default with more than one rank: one CPU reserved for the driver's other work
    ranks = [plan_cpu_threads(2, rank, environ={}, root=tmp_path, allowed=[0, 1, 2, 3, 4], online=8)
             for rank in (0, 1)]
    assert [(p.threads, p.cpus) for p in ranks] == [(2, (0, 1)), (2, (2, 3))]
    # ...unless it would leave a rank without a CPU (two ranks on two CPUs)
    assert plan_cpu_threads(2, 1, environ={}, root=tmp_path, allowed=[0, 1], online=4).cpus == (1,)


def test_explicit_lists_per_rank(tmp_path):
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1,4|2-3"}
    assert plan_cpu_threads(2, 0, environ=env, root=tmp_path, allowed=range(8), online=8).cpus == (0, 1, 4)
    second = plan_cpu_threads(2, 1, environ=env, root=tmp_path, allowed=range(8), online=8)
    assert (second.threads, second.cpus) == (2, (2, 3))


@pytest.mark.parametrize(("env", "world", "message"), [
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, 1, "names 2 CPU lists; give one per rank (1)"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-9"}, 1, "outside this process's cpuset"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "zero"}, 1, "cannot read 'zero'"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "3-1"}, 1, "'3-1' is not a CPU range"),
    ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}, 1, "must be at least 0 and fewer than the 4 CPUs"),
    ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "one"}, 1, "is not a whole number"),
    ({"OMP_NUM_THREADS": "many"}, 1, "OMP_NUM_THREADS='many'"),
])
def test_bad_settings_are_refused_naming_the_variable(tmp_path, env, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_cpu_threads(world, 0, environ=env, root=tmp_path, allowed=[0, 1, 2, 3], online=8)


def test_cpu_lists_read_as_linux_writes_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]


def test_a_limited_pod_runs_as_many_threads_as_its_limit(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with caplog.at_level(logging.INFO, logger="kvpilot.engine.cpu.threads"):
            assert configure_cpu_threads(1, root=cgroup_v1(tmp_path / "cg", 100_000)).threads == 1
        assert torch.get_num_threads() == 1
        assert "CPU threads: 1 per rank" in caplog.text and "cgroup CPU quota 1 CPUs" in caplog.text
        assert "waiting threads" in caplog.text
    finally:
        torch.set_num_threads(saved)


def test_the_openmp_team_is_pinned_where_the_plan_says():
    """In a process whose plan pins its thread to one CPU (an explicit VLLM_CPU_OMP_THREADS_BIND
    list, on any machine; `auto` on a cpuset of its own is checked on the tests' real node,
    tests/images/test_images.py), the engine's OpenMP thread runs on that CPU and the start-up
    line says so."""
    cpu = max(os.sched_getaffinity(0))
    script = (
        "import json\n"
        "from kvpilot.engine.cpu.threads import configure_cpu_threads\n"
        "from kvpilot.kernels.cpu.threads import omp_thread_cpus\n"
        "plan = configure_cpu_threads(1)\n"
        "print(json.dumps({'cpus': plan.cpus, 'line': plan.describe(), 'ran_on': omp_thread_cpus(plan.threads)}))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["cpus"] == [cpu] and out["ran_on"] == [cpu], out
    assert out["line"].startswith(f"CPU threads: 1 per rank, bound to CPUs [{cpu}] (VLLM_CPU_OMP_THREADS_BIND={cpu}")


def test_the_quota_is_the_smallest_from_the_process_own_cgroup_up(tmp_path):
    """On a host (no cgroup namespace) the process's group is below the mount, named by
    /proc/self/cgroup; a pod's limit sits on its container's and its pod's group."""
    v1 = cgroup_v1(tmp_path / "v1", -1)
    (v1 / "cpu" / "pod" / "ctr").mkdir(parents=True)
    for directory, quota in ((v1 / "cpu" / "pod", 150_000), (v1 / "cpu" / "pod" / "ctr", -1)):
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup-v1"
    proc.write_text("4:memory:/other\n3:cpu,cpuacct:/pod/ctr\n")
    assert cgroup_cpu_quota(v1, proc) == 1.5
    v2 = cgroup_v2(tmp_path / "v2", "max 100000")
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    cgroup_v2(v2 / "a", "50000 100000")
    (tmp_path / "cgroup-v2").write_text("0::/a\n")
    assert cgroup_cpu_quota(v2, tmp_path / "cgroup-v2") == 0.5
    (tmp_path / "cgroup-v2").write_text("0::/not-here\n")  # a container's own group at the mount's root
    assert cgroup_cpu_quota(v2, tmp_path / "cgroup-v2") is None
