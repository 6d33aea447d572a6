"""`kvpilot serve` states why it stopped by a documented exit code and a JSON line on stderr
(kvpilot.engine.exit_codes), which the tuner reads instead of the log text."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.engine.exit_codes import EXIT_BAD_ARGS, EXIT_KV_CACHE_TOO_SMALL, parse_failure
from kvpilot.tuner.failures import OUT_OF_MEMORY, REJECTED, classify

SERVE = [sys.executable, "-m", "kvpilot.cli.main", "serve", "smollm2-135m-instruct", "--host", "127.0.0.1",
         "--port", "0"]


@pytest.mark.parametrize("flags, code, kind, fragment, tuner_kind", [
    (["--max-num-seqs", "4", "--max-num-batched-tokens", "2"], EXIT_BAD_ARGS, "bad_args",
     "max_num_batched_tokens (2) must be >= max_num_seqs (4)", REJECTED),
    (["--max-model-len", "1024", "--num-gpu-blocks-override", "4", "--dtype", "float32"], EXIT_KV_CACHE_TOO_SMALL,
     "kv_cache_too_small", "64 KV blocks", OUT_OF_MEMORY),
], ids=["bad-args", "kv-cache-too-small"])
def test_serve_exits_with_the_failure_class_and_a_json_line(flags, code, kind, fragment, tuner_kind):
    out = subprocess.run([*SERVE, *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == code, out.stderr[-2000:]
    failure = parse_failure(out.stderr)
    assert failure["kind"] == kind and failure["exit_code"] == code and fragment in failure["message"]
    assert classify(out.returncode, "", structured=True) == tuner_kind  # no log text needed


def test_structured_exit_codes_win_over_misleading_log_text():
    log = "WARNING: connection reset by peer; retrying"  # the regexes would call this transient
    assert classify(EXIT_KV_CACHE_TOO_SMALL, log, structured=True) == OUT_OF_MEMORY
    assert classify(EXIT_BAD_ARGS, log, structured=True) == REJECTED
    assert classify(1, "ValueError: max_num_seqs must be >= 1", structured=True) == "transient"
    assert classify(137, "", structured=True) == OUT_OF_MEMORY
