"""Why a trial failed to start or run.

- out_of_memory: the KV cache or the weights did not fit, or the kernel's OOM killer
  stopped the engine (exit -9/137).
- rejected: the engine refused the flags.
- transient: anything else that may pass on a second try (port taken, connection reset,
  a timeout waiting for health, a crash with no recognised cause).
Transient failures are retried once; the others are recorded and never tried again.

kvpilot's engine says why it stopped by its exit code (`kvpilot.engine.exit_codes`: 2 bad
arguments, 3 KV cache too small, 4 out of memory), so `classify_exit` needs no log text.
Upstream `vllm serve` exits 1 for all of these; for it (and for a kvpilot engine that
exits 1) `classify` falls back to reading the log tail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.tuner.search.objective import Measurement

from kvpilot.engine import exit_codes

OUT_OF_MEMORY = "out_of_memory"
REJECTED = "rejected"
TRANSIENT = "transient"
KINDS = (OUT_OF_MEMORY, REJECTED, TRANSIENT)

# vLLM 0.32 on CPU: "... KV cache is needed, which is larger than the available KV cache memory" (the
# cache cannot hold one max_model_len request) and "Available memory on node N ... is less than
# requested memory for kv" (--kv-cache-memory-bytes or --gpu-memory-utilization beyond what is free)
_OOM = re.compile(
    r"KV blocks .* are needed|out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError|oom-kill|"
    r"larger than the available KV cache memory|is less than requested memory for kv",
    re.IGNORECASE)
_REJECTED = re.compile(
    r"error: (argument|unrecognized arguments|the following arguments)|invalid choice|"
    r"ValueError: .*(must|exceeds|is smaller than|not supported|unknown)|"
    r"max_num_batched_tokens \(\d+\) (must|is smaller)|must divide|unsupported|"
    r"No common block size",  # vLLM 0.32's CPU attention: block sizes that are multiples of 32 only
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
        """Whether the tuner runs the trial once more (transient failures only: they say nothing of the settings)."""
        return self.kind == TRANSIENT


_BY_EXIT_CODE = {
    exit_codes.EXIT_BAD_ARGS: REJECTED,
    exit_codes.EXIT_KV_CACHE_TOO_SMALL: OUT_OF_MEMORY,
    exit_codes.EXIT_OUT_OF_MEMORY: OUT_OF_MEMORY,
    -9: OUT_OF_MEMORY,  # SIGKILL as subprocess reports it: the kernel's OOM killer
    137: OUT_OF_MEMORY,  # the same through a shell or a container runtime (128 + 9)
}


def classify_exit(returncode: int | None) -> str | None:
    """The failure kind that kvpilot's engine states by its exit code, or None when the code
    states none (1: see the log; None: still running)."""
    return _BY_EXIT_CODE.get(returncode) if returncode is not None else None


def classify(returncode: int | None, log_tail: str, structured: bool = False) -> str:
    """The failure kind for an engine process that exited with `returncode` (None: still
    running but unhealthy) after writing `log_tail`. structured: the engine is kvpilot's, whose
    exit code is the answer (any code that names no class is transient). Otherwise (upstream
    vLLM) the log decides; memory wins over rejection because the KV-cache refusal is also a
    ValueError."""
    if structured:
        return classify_exit(returncode) or TRANSIENT
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
        """The record of `error`: its kind and the last 2,000 characters of its message."""
        return cls(error.kind, error.message[-2000:])


class TrialCutShort(Exception):
    """A live-traffic trial stopped early because it clearly breaks an SLO; carries the
    partial measurement (the tuner records the trial as pruned)."""

    def __init__(self, measurement: Measurement, reason: str):
        super().__init__(reason)
        self.measurement, self.reason = measurement, reason
