"""What a benchmark's figures depend on besides the code: the CPU model and the load average,
recorded beside every result (a shared 2-core machine's neighbours move the numbers)."""

from __future__ import annotations

import platform
from pathlib import Path


def loadavg() -> str:
    """/proc/loadavg as Linux writes it: the 1, 5 and 15 minute averages, running/total
    tasks and the last pid, e.g. '0.52 0.61 0.70 2/345 6789'."""
    return Path("/proc/loadavg").read_text().strip()


def cpu_model() -> str:
    """The first processor's 'model name' in /proc/cpuinfo (e.g. 'AMD EPYC 9R14'), or
    platform.processor() where /proc/cpuinfo has none."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
