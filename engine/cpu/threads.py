"""How many threads each CPU rank runs, and on which CPUs (vLLM's `VLLM_CPU_OMP_THREADS_BIND` and
`VLLM_CPU_NUM_OF_RESERVED_CPU`, with vLLM's names, meanings and defaults).

Threads: the CPUs this process may use (its affinity mask: a container's cpuset, `taskset`), less
the reserved ones, capped by its cgroup's CPU quota rounded up (what a Kubernetes CPU limit
becomes: `cpu.cfs_quota_us / cpu.cfs_period_us` on cgroup v1, `cpu.max` on v2), shared by the
ranks. torch and OpenMP size their pools from the cores they see, so a pod limited to 1 CPU on a
16-core node would otherwise run 16 threads that CFS bandwidth control throttles for most of each
period, and every decode step would wait on the slowest, throttled thread. The JVM
(JDK-8146115, `-XX:+UseContainerSupport`) and Go (uber-go/automaxprocs) size their pools the same
way. `OMP_NUM_THREADS`, when set, wins, as in torch itself.

Binding (`VLLM_CPU_OMP_THREADS_BIND`):
- `auto` (vLLM's default): each rank's threads pinned one per CPU to consecutive CPUs of the
  process's cpuset when those CPUs are its own, i.e. the cpuset is narrower than the machine's
  online CPUs (the kubelet's static CPU manager gives a Guaranteed pod with whole CPUs an
  exclusive cpuset; `docker --cpuset-cpus` and `taskset` do the same). Where the cpuset covers
  every online CPU the CPUs are shared with other pods and processes, and the threads stay
  unbound: a thread pinned behind a busy neighbour waits there for a whole time slice while
  another CPU idles, and every barrier of the step waits with it; unbound, the kernel moves it
  to the idle CPU. A cpuset larger than the CPU quota is shared too (a Burstable or fractional
  pod in the kubelet's shared pool); an exclusive one has a quota of exactly its size. (vLLM's
  `auto` binds to the rank's NUMA node's physical cores in every case.)
- `nobind`: never pinned.
- an explicit list per rank, `|`-separated, each a CPU list (`0-3,8|4-7,9`): rank r's threads are
  as many as its list names, thread i pinned to its i-th CPU.
`VLLM_CPU_NUM_OF_RESERVED_CPU`: CPUs (the last of the cpuset) left to the rest of the process
(the HTTP server, the tokenizer); unset: 1 with more than one rank where that still leaves a
CPU per rank, else 0 (vLLM: 1 when world_size > 1, else 0).

How a waiting thread waits is set before torch loads (engine/cpu/omp_wait.py); the start-up line
says all three. Source: vLLM `vllm/v1/worker/cpu_worker.py` (`_get_autobind_cpu_ids`,
`VLLM_CPU_NUM_OF_RESERVED_CPU`) and its CPU installation guide ("Related runtime environment
variables"); Kubernetes "Control CPU Management Policies on the Node".
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.settings.env import VLLM_CPU_NUM_OF_RESERVED_CPU, VLLM_CPU_OMP_THREADS_BIND

logger = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")
THREADS_BIND_ENV = VLLM_CPU_OMP_THREADS_BIND
RESERVED_CPU_ENV = VLLM_CPU_NUM_OF_RESERVED_CPU


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """{controller list ("" for v2, e.g. "cpu,cpuacct" for v1): this process's cgroup path} from
    /proc/self/cgroup ("0::/kubepods/..." or "4:cpu,cpuacct:/kubepods/...")."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    return {parts[1]: parts[2] for parts in (line.split(":", 2) for line in lines) if len(parts) == 3}


def _chain(mount: Path, own: str | None) -> list[Path]:
    """The directories from this process's cgroup up to the mount's root, the root alone where the
    own path is not below this mount (a container without a cgroup namespace mounts its own group
    at the root)."""
    if not own or own == "/":
        return [mount]
    leaf = mount / own.lstrip("/")
    if not leaf.is_dir():
        return [mount]
    return [leaf, *[p for p in leaf.parents if p == mount or mount in p.parents]]


def _quota_v2(directory: Path) -> float | None:
    quota, period = (directory / "cpu.max").read_text().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(directory: Path) -> float | None:
    quota_us = int((directory / "cpu.cfs_quota_us").read_text())
    period_us = int((directory / "cpu.cfs_period_us").read_text())
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time per period that this process's cgroup may use (e.g. 1.5), or None
    when it has no quota: the smallest quota from its own cgroup (named by /proc/self/cgroup) up
    to the hierarchy's root, as a pod's container and pod cgroups both carry one. Reads v2's
    `cpu.max` ("max 100000" or "150000 100000"), else v1's `cpu.cfs_quota_us` (-1: none) over
    `cpu.cfs_period_us`; a container sees its own cgroup at the mount's root (runc mounts it
    there). Source: the JDK's container support (JDK-8146115, CgroupV1/V2 subsystems)."""
    own = _own_paths(proc_cgroup)
    if (root / "cpu.max").exists() or (root / "cgroup.controllers").exists():
        hierarchies = [(root, own.get(""), _quota_v2)]
    else:
        hierarchies = [(root / name, next((p for c, p in own.items() if "cpu" in c.split(",")), None), _quota_v1)
                       for name in ("cpu", "cpu,cpuacct")]
    for mount, path, read in hierarchies:
        if not mount.is_dir():
            continue
        quotas = []
        for directory in _chain(mount, path):
            try:
                quotas.append(read(directory))
            except (OSError, ValueError, IndexError):
                continue
        found = [q for q in quotas if q is not None]
        return min(found) if found else None
    return None


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (sched_getaffinity), ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def online_cpu_count() -> int:
    """The machine's online CPUs (what a cpuset narrows), >= 1."""
    return os.sysconf("SC_NPROCESSORS_ONLN") if hasattr(os, "sysconf") else (os.cpu_count() or 1)


def parse_cpu_list(text: str) -> list[int]:
    """A Linux CPU list ("0-3,8", as in cpuset.cpus and taskset -c) as ascending CPU ids.
    Raises ValueError naming the part it cannot read."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"cannot read {part!r} as a CPU or a range of CPUs (e.g. 0-3,8)") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{part!r} is not a CPU range (e.g. 0-3)")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


@dataclass(frozen=True)
class CpuThreadPlan:
    """One rank's threads: how many, the CPU each is pinned to (`cpus[i]` for team thread i;
    empty: not pinned), and why, in words for the start-up line."""

    threads: int
    cpus: tuple[int, ...]
    reason: str

    def describe(self) -> str:
        """The start-up log line: threads per rank, the CPUs they are bound to (or 'not
        bound'), and why."""
        where = f"bound to CPUs {list(self.cpus)}" if self.cpus else "not bound"
        return f"CPU threads: {self.threads} per rank, {where} ({self.reason})"


def _reserved(environ: Mapping[str, str], world_size: int, allowed: int) -> int:
    text = environ.get(RESERVED_CPU_ENV, "").strip()
    if not text:
        return 1 if world_size > 1 and allowed - 1 >= world_size else 0
    try:
        reserved = int(text)
    except ValueError:
        raise ValueError(f"{RESERVED_CPU_ENV}={text!r} is not a whole number of CPUs") from None
    if not 0 <= reserved < allowed:
        raise ValueError(f"{RESERVED_CPU_ENV}={reserved} must be at least 0 and fewer than the {allowed} CPUs "
                         "this process may use")
    return reserved


def _explicit(spec: str, world_size: int, rank: int, allowed: list[int]) -> CpuThreadPlan:
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ValueError(f"{THREADS_BIND_ENV}={spec!r} names {len(lists)} CPU lists; give one per rank "
                         f"({world_size}), separated by '|', or use auto or nobind")
    try:
        cpus = parse_cpu_list(lists[rank])
    except ValueError as exc:
        raise ValueError(f"{THREADS_BIND_ENV}: rank {rank}'s list {lists[rank]!r}: {exc}") from None
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ValueError(f"{THREADS_BIND_ENV}: rank {rank}'s CPUs {outside} are outside this process's "
                         f"cpuset {allowed}")
    return CpuThreadPlan(len(cpus), tuple(cpus), f"{THREADS_BIND_ENV}={spec}")


def plan_cpu_threads(world_size: int = 1, rank: int = 0, environ: Mapping[str, str] | None = None,
                     root: Path = CGROUP_ROOT, allowed: list[int] | None = None,
                     online: int | None = None) -> CpuThreadPlan:
    """Rank `rank`'s threads and their CPUs under the rules of the module docstring.

    Raises ValueError naming the variable for a bad `VLLM_CPU_OMP_THREADS_BIND`,
    `VLLM_CPU_NUM_OF_RESERVED_CPU` or `OMP_NUM_THREADS`."""
    environ = os.environ if environ is None else environ
    allowed = allowed_cpus() if allowed is None else sorted(allowed)
    online = online_cpu_count() if online is None else online
    bind = environ.get(THREADS_BIND_ENV, "").strip() or "auto"
    if bind not in ("auto", "nobind"):
        return _explicit(bind, world_size, rank, allowed)
    reserved = _reserved(environ, world_size, len(allowed))
    usable = allowed[:len(allowed) - reserved]
    quota = cgroup_cpu_quota(root)
    budget = len(usable) if quota is None else max(1, min(len(usable), math.ceil(quota) - reserved))
    threads = max(1, budget // world_size)
    why = [f"cpuset {len(allowed)} of {online} CPUs"]
    if quota is not None:
        why.append(f"cgroup CPU quota {quota:g} CPUs")
    if reserved:
        why.append(f"{reserved} reserved ({RESERVED_CPU_ENV})")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        try:
            threads = max(1, int(omp.split(",")[0]))
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} is not a number of threads") from None
        why.append("OMP_NUM_THREADS")
    if world_size > 1:
        why.append(f"{world_size} ranks")
    mine = usable[rank * threads:(rank + 1) * threads]
    if bind == "nobind":
        return CpuThreadPlan(threads, (), "; ".join([*why, f"{THREADS_BIND_ENV}=nobind"]))
    if len(allowed) >= online or (quota is not None and quota < len(allowed)):
        return CpuThreadPlan(threads, (), "; ".join([*why, "auto: the CPUs are shared with other processes, "
                                                     "so the kernel may move a thread off a busy one"]))
    if len(mine) < threads:
        return CpuThreadPlan(threads, (), "; ".join([*why, "auto: fewer CPUs than threads to give each its own"]))
    return CpuThreadPlan(threads, tuple(mine), "; ".join([*why, "auto: the cpuset is this process's own"]))


def configure_cpu_threads(world_size: int = 1, rank: int = 0, root: Path = CGROUP_ROOT) -> CpuThreadPlan:
    """Applies rank `rank`'s plan to the calling thread (the one that runs the engine's steps):
    torch's intra-op threads, then the pinning, and logs the start-up line with how threads
    wait (engine/cpu/omp_wait.py). Returns the plan. Raises ValueError for bad settings (see
    plan_cpu_threads), OSError when the kernel refuses a CPU of an explicit list."""
    import torch

    from kvpilot.engine.cpu.omp_wait import describe_wait_policy

    from kvpilot.kernels.cpu.threads import bind_omp_threads, set_partition_width

    plan = plan_cpu_threads(world_size, rank, root=root)
    torch.set_num_threads(plan.threads)
    set_partition_width(plan.threads)
    if plan.cpus:
        bind_omp_threads(list(plan.cpus))
    logger.info("%s; %s", plan.describe(), describe_wait_policy())
    return plan
