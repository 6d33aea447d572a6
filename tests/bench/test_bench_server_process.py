"""The benchmarks' server harness (bench/harness/server_process.py) starts, waits and stops
through the load library's process helpers (kvpilot.loadgen.process), as the tuner's
EngineProcess does: one `kvpilot serve` command, one spawn and health wait (issue 51)."""

import sys

import pytest

from kvpilot.bench.harness.server_process import ServerProcess, ServerRefused
from kvpilot.loadgen.process import KVPILOT_SERVE

# serves the files of the folder given first, on --port PORT: a file named "health" answers /health
FILE_SERVER = ("import functools, http.server, sys; port = int(sys.argv[sys.argv.index('--port') + 1]); "
               "handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1]); "
               "http.server.HTTPServer(('127.0.0.1', port), handler).serve_forever()")


def test_the_server_harness_waits_for_health_and_reports_a_refusal(tmp_path):
    """bench's ServerProcess appends --port; a refusal carries the exit code and the error line."""
    (tmp_path / "health").write_text("ok")
    with ServerProcess([sys.executable, "-c", FILE_SERVER, str(tmp_path)], tmp_path / "ok.log") as server:
        assert server.proc is not None and server.startup_s > 0
        proc = server.proc
    assert proc.returncode is not None and server.proc is None  # stopped on leaving
    with pytest.raises(ServerRefused) as refused:
        ServerProcess([sys.executable, "-c", "import sys; print('error: bad flag'); sys.exit(2)"],
                      tmp_path / "no.log").start()
    assert refused.value.exit_code == 2 and refused.value.message == "error: bad flag"
    assert KVPILOT_SERVE[1:] == ["-m", "kvpilot.cli.main", "serve"]  # what the tuner's EngineProcess starts too
