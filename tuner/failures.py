"""Why a trial failed to start or run, classified from the engine's exit and log.

- out_of_memory: the KV cache or the weights did not fit (the engine's `check_fits`
  message "KV blocks ... are needed", CUDA OOM, the kernel's OOM kill, exit -9/137).
- rejected: the engine refused the flags (argparse exit 2, a ValueError naming a rule).
- transient: anything else that may pass on a second try (port taken, connection reset,
  a timeout waiting for health, a crash with no recognised cause).
Transient failures are retried once; the others are recorded and never tried again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OUT_OF_MEMORY = "out_of_memory"
REJECTED = "rejected"
TRANSIENT = "transient"
KINDS = (OUT_OF_MEMORY, REJECTED, TRANSIENT)

_OOM = re.compile(
    r"KV blocks .* are needed|out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError|oom-kill",
    re.IGNORECASE)
_REJECTED = re.compile(
    r"error: (argument|unrecognized arguments|the following arguments)|invalid choice|"
    r"ValueError: .*(must|exceeds|is smaller than|not supported|unknown)|"
    r"max_num_batched_tokens \(\d+\) (must|is smaller)|must divide|unsupported",
    re.IGNORECASE)
_TRANSIENT = re.compile(r"Address already in use|Connection (reset|refused)|Temporary failure|timed out",
                        re.IGNORECASE)


class TrialFailed(Exception):
    """A trial could not be measured. kind is one of KINDS; message says why."""

    def __init__(self, kind: str, message: str):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.kind == TRANSIENT


def classify(returncode: int | None, log_tail: str) -> str:
    """The failure kind for an engine process that exited with `returncode` (None: still
    running but unhealthy) after writing `log_tail`. Memory wins over rejection because
    the engine's KV-cache refusal is also a ValueError."""
    if _OOM.search(log_tail) or returncode in (-9, 137):
        return OUT_OF_MEMORY
    if _TRANSIENT.search(log_tail):
        return TRANSIENT
    if returncode == 2 or _REJECTED.search(log_tail):
        return REJECTED
    return TRANSIENT


@dataclass(frozen=True)
class FailureRecord:
    """A failure as the study keeps it (trial user attributes)."""

    kind: str
    message: str

    @classmethod
    def of(cls, error: TrialFailed) -> FailureRecord:
        return cls(error.kind, error.message[-2000:])
