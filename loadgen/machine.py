"""The machine block of benchmark JSON: what a figure depends on besides the code, recorded
beside every result of `kvpilot bench` and of the tuner's benchmarks (a shared 2-core
machine's neighbours move the numbers).

One spelling (issue 51): `"machine": machine_info(...)`, a dict
    {"cpu": "AMD EPYC 9R14", "flags": ["avx", "avx2", ...], "cores": 2,
     "loadavg": [1m, 5m, 15m]}                     (one sample: the load when it was taken)
or, for a run that samples the load before and after,
     "loadavg_before": [1m, 5m, 15m], "loadavg_after": [1m, 5m, 15m]
in place of "loadavg". A run record that samples the load around itself (one rate, one
concurrency) carries the same "loadavg_before" / "loadavg_after" keys. The load averages are
os.getloadavg()'s (Linux's /proc/loadavg: runnable and uninterruptible tasks, exponentially
averaged over 1, 5 and 15 minutes), rounded to 0.01.

Results recorded before this spelling (benchmarks/results) stay as they were: "loadavg_before"
as /proc/loadavg's text, "load_1m_before" (the 1-minute figure alone), "load_avg_at_start",
"load_at_start", "load_avg", "load_average_before" / "load_average" (the operator's benchmarks).
`recorded_load`, `load_1m` and `recorded_machine` read every one.

Source of the CPU fields: /proc/cpuinfo's "model name" and "flags" (kvpilot.kernels.cpu.cpu_flags,
the ISA flags that decide kernels and dtypes). Standard library only; torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kvpilot.kernels.cpu.cpu_flags import ISA_FLAGS, detect_cpu

# each recorded spelling of (the first sample, the last sample), newest first
_LOAD_KEYS = (("loadavg_before", "loadavg_after"), ("loadavg", "loadavg"), ("load_1m_before", "load_1m_after"),
              ("load_avg_at_start", "load_avg_at_end"), ("load_at_start", "load_at_end"), ("load_avg", "load_avg"),
              ("load_average_before", "load_average"), ("load_average", "load_average"))


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages now (os.getloadavg(), rounded to 0.01). Raises
    OSError where the platform has none."""
    return [round(x, 2) for x in os.getloadavg()]


def cores() -> int | None:
    """How many CPUs this process may run on: its affinity mask (os.sched_getaffinity, Linux;
    a container's cpuset), else os.cpu_count() (None where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def machine_info(loadavg_before: Sequence[float] | None = None) -> dict[str, Any]:
    """The machine block: the CPU model, its ISA flags that matter (kvpilot.kernels.cpu.cpu_flags's
    ISA_FLAGS present here, sorted), the cores this process may run on (its CPU affinity, else
    os.cpu_count()) and the load average now as
    "loadavg"; given `loadavg_before` (a `loadavg()` taken when the run began), the two samples
    as "loadavg_before" and "loadavg_after" instead."""
    cpu = detect_cpu()
    block: dict[str, Any] = {"cpu": cpu.model_name, "flags": sorted(f for f in ISA_FLAGS if f in cpu.flags),
                             "cores": cores()}
    if loadavg_before is None:
        block["loadavg"] = loadavg()
    else:
        block.update(loadavg_before=list(loadavg_before), loadavg_after=loadavg())
    return block


def _sample(value: Any) -> list[float] | float | None:
    """A recorded load as [1m, 5m, 15m] (from a list, or from /proc/loadavg's text), or the one
    number an old record kept (its 1-minute figure); None for anything else."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return [float(x) for x in value.split()[:3]] or None
    if isinstance(value, (list, tuple)) and value:
        return [float(x) for x in value[:3]]
    return None


def recorded_load(record: dict[str, Any], when: str = "before") -> list[float] | float | None:
    """The load average of a recorded run or machine block at its first sample (when="before")
    or its last (when="after"), whichever spelling it was recorded in (the module doc): [1m, 5m,
    15m], or a bare 1-minute number from an old "load_1m_*" record; None when it has none.
    Raises ValueError for another `when`."""
    if when not in ("before", "after"):
        raise ValueError(f"when must be 'before' or 'after', not {when!r}")
    for keys in _LOAD_KEYS:
        key = keys[0] if when == "before" else keys[1]
        if key in record:
            return _sample(record[key])
    return None


def load_1m(record: dict[str, Any], when: str = "before") -> float | None:
    """The 1-minute load average of `recorded_load(record, when)` (None when it has none)."""
    value = recorded_load(record, when)
    return value[0] if isinstance(value, list) else value


def recorded_machine(doc: dict[str, Any]) -> dict[str, Any]:
    """The machine block of a benchmark JSON document (or of its "env" part) in this module's
    spelling, from a new record's "machine" or an old one's loose keys ("cpu" as a name or as
    CpuInfo.as_dict(), "cpus"/"cpu_count"/"cores", "isa_flags", the load keys above): "cpu",
    "flags", "cores", "loadavg_before", "loadavg_after" (`recorded_load`), each None when the
    record has none."""
    block = doc["machine"] if isinstance(doc.get("machine"), dict) else doc
    cpu = block.get("cpu")
    if isinstance(cpu, dict):
        cpu = cpu.get("model_name")
    cores = next((block[k] for k in ("cores", "cpus", "cpu_count") if k in block), None)
    return {"cpu": cpu, "flags": block.get("flags", block.get("isa_flags")), "cores": cores,
            "loadavg_before": recorded_load(block, "before"), "loadavg_after": recorded_load(block, "after")}
