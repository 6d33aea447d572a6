"""How many threads the engine runs on CPU: the CPUs this process may use (its affinity mask),
capped by its cgroup's CPU quota rounded up, which is what a Kubernetes CPU limit becomes
(`cpu.cfs_quota_us / cpu.cfs_period_us` on cgroup v1, `cpu.max` on v2). torch and OpenMP size
their pools from the cores they see, so a pod limited to 1 CPU on a 16-core node would run 16
threads that the kernel's CFS bandwidth control then throttles for most of each period; every
decode step would wait on the slowest, throttled thread. The JVM (JDK-8146115,
`-XX:+UseContainerSupport`) and Go (uber-go/automaxprocs) size their pools the same way.
`OMP_NUM_THREADS`, when set, wins, as in torch itself."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time per period that this process's cgroup may use (e.g. 1.5), or None
    when it has no quota. Reads v2's `cpu.max` ("max 100000" or "150000 100000"), else v1's
    `cpu/cpu.cfs_quota_us` (-1: none) over `cpu/cpu.cfs_period_us`; a container sees its own
    cgroup at these paths (runc mounts it there)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for directory in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            period_us = int((directory / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def available_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may run on (sched_getaffinity), at most ceil(cgroup quota); >= 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def configure_cpu_threads(world_size: int = 1, root: Path = CGROUP_ROOT) -> int:
    """Sets torch's intra-op threads to available_cpus() // world_size unless OMP_NUM_THREADS is
    set, and logs the choice once with its reason; returns the thread count in effect."""
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()
    threads = max(1, available_cpus(root) // world_size)
    if threads != torch.get_num_threads():
        quota = cgroup_cpu_quota(root)
        reason = f"cgroup CPU quota {quota:g} CPUs" if quota is not None else "CPU affinity"
        logger.info("CPU threads: %d per rank (%s; torch counted %d; OMP_NUM_THREADS overrides)", threads, reason,
                    torch.get_num_threads())
        torch.set_num_threads(threads)
    return threads
