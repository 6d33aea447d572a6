"""CPU cgroups for the shared-node benchmark: "two pods with equal CPU requests on one node"
and "a pod under a CPU limit" made on one machine.

A pod's CPU request becomes its cgroup's weight and its limit a CFS quota (Kubernetes
"Resource Management for Pods and Containers"; the kubelet's cgroup driver writes cgroup v1
`cpu.shares` = millicores x 1024 / 1000 and `cpu.cfs_quota_us` per `cpu.cfs_period_us`, or
v2 `cpu.weight` and `cpu.max`). The kernel divides CPU between sibling groups by weight,
whatever the nice values inside them, so two sibling groups of equal weight are two pods with
equal requests. Both hierarchies are handled: v2 where the unified hierarchy has the cpu
controller (`/sys/fs/cgroup/cgroup.controllers`), else v1's `cpu` controller. Needs root (or
a delegated subtree); `CgroupUnavailable` says which file could not be written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000  # the kubelet's default cpu.cfs_period_us (100 ms)


class CgroupUnavailable(RuntimeError):
    """No writable cpu controller: the message names the path and what to change."""


def _cpu_hierarchy(root: Path = CGROUP_ROOT) -> tuple[Path, int]:
    """(the directory new cpu groups go under, its version 1 or 2)."""
    try:
        if "cpu" in (root / "cgroup.controllers").read_text().split():
            return root, 2
    except OSError:
        pass
    for name in ("cpu", "cpu,cpuacct"):
        if (root / name / "cpu.shares").exists():
            return root / name, 1
    raise CgroupUnavailable(f"no cpu controller under {root} (neither cgroup v2's cgroup.controllers nor v1's "
                            "cpu/cpu.shares): run on Linux with cgroups mounted")


@dataclass
class CpuGroup:
    """One child cpu cgroup, made on enter and removed on exit (its processes moved back)."""

    name: str
    root: Path = CGROUP_ROOT

    def __post_init__(self) -> None:
        self.parent, self.version = _cpu_hierarchy(self.root)
        self.path = self.parent / self.name

    def __enter__(self) -> CpuGroup:
        try:
            self.path.mkdir(exist_ok=True)
            if self.version == 2:  # a v2 child gets the cpu controller only when its parent delegates it
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
            self.set_weight_millicores(1000)
            self.set_quota(None)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot make cpu cgroup {self.path}: {exc}; run as root or in a delegated "
                                    "cgroup") from exc
        return self

    def set_weight_millicores(self, millicores: int) -> None:
        """The weight a pod with this CPU request gets (v1 shares = m x 1024 / 1000, min 2; v2 weight by the
        kubelet's conversion from shares: 1 + (shares - 2) x 9999 / 262142)."""
        shares = max(2, millicores * 1024 // 1000)
        if self.version == 1:
            (self.path / "cpu.shares").write_text(str(shares))
        else:
            (self.path / "cpu.weight").write_text(str(1 + (shares - 2) * 9999 // 262142))

    def set_quota(self, cpus: float | None) -> None:
        """A CPU limit of `cpus` CPUs per 100 ms period; None removes it."""
        quota = -1 if cpus is None else max(1000, int(cpus * CFS_PERIOD_US))
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {CFS_PERIOD_US}")

    def add(self, pid: int) -> None:
        """Moves a process (every thread of it) into this group; its later threads stay in it."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The pids in the group (cgroup.procs), or [] when the group is gone or unreadable."""
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def stat(self) -> dict[str, int]:
        """cpu.stat as numbers: nr_periods, nr_throttled, throttled_time (ns) on v1; v2's *_usec keys."""
        try:
            return {k: int(v) for k, v in (line.split() for line in (self.path / "cpu.stat").read_text().splitlines())}
        except OSError:
            return {}

    def __exit__(self, *exc: object) -> None:
        for pid in self.pids():
            try:
                (self.parent / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # the process has exited
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a process that just exited may still be counted


def busy_loops(count: int, group: CpuGroup) -> list:
    """`count` processes that spin (`while True: pass`) in `group`: neighbours that use all the
    CPU their weight gives them. Returns the Popen objects; the caller kills them."""
    import subprocess
    import sys

    procs = []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        group.add(proc.pid)
        procs.append(proc)
    return procs


def stop_all(procs: list) -> None:
    """SIGKILLs every process of `procs` (subprocess.Popen, e.g. busy_loops') still running and
    waits for all of them."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
