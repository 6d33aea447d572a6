"""Why `kvpilot serve` stopped, for the process that started it (the tuner, a kubelet, a
script): one documented exit code per failure class, and the same as one JSON line on
stderr. Torch-free, so the tuner reads the codes from here.

    0  shut down on request (SIGTERM drained, or SIGINT)
    1  the engine failed for another reason (see the log)
    2  bad arguments: argparse's code, and any setting or rule of `kvpilot.engine.settings`
    3  the KV cache cannot hold one max_model_len sequence (KVCacheTooSmallError)
    4  out of memory while loading or profiling (torch.OutOfMemoryError, MemoryError)
    5  the engine loop died while serving (an error in what all requests share: the model
       step, the scheduler, the KV cache); errors of one request end that request only

The JSON line is `{"kvpilot_failure": {"kind": ..., "exit_code": ..., "message": ...}}`,
the last line the process writes; kind is one of KINDS. Exit codes above 128 (or negative
ones from Python's subprocess) are signals: -9 / 137 is the kernel's OOM killer.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_ARGS = 2
EXIT_KV_CACHE_TOO_SMALL = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_ENGINE_DIED = 5

KINDS = {
    EXIT_FAILED: "failed",
    EXIT_BAD_ARGS: "bad_args",
    EXIT_KV_CACHE_TOO_SMALL: "kv_cache_too_small",
    EXIT_OUT_OF_MEMORY: "out_of_memory",
    EXIT_ENGINE_DIED: "engine_died",
}
FAILURE_KEY = "kvpilot_failure"


class KVCacheTooSmallError(ValueError):
    """Not even one max_model_len sequence fits in the KV cache the memory budget allows.
    A ValueError (a setting must change), with its own exit code."""


def report_failure(exit_code: int, message: str, stream: TextIO | None = None) -> int:
    """Writes the JSON failure line for `exit_code` to stream (stderr) and returns the code."""
    line = json.dumps({FAILURE_KEY: {"kind": KINDS[exit_code], "exit_code": exit_code, "message": message}})
    print(line, file=stream or sys.stderr, flush=True)
    return exit_code


def parse_failure(log_text: str) -> dict | None:
    """The last failure line in `log_text` as {'kind', 'exit_code', 'message'}, or None."""
    for line in reversed(log_text.splitlines()):
        if FAILURE_KEY in line:
            try:
                return json.loads(line[line.index("{"):])[FAILURE_KEY]
            except (ValueError, KeyError):
                continue
    return None
