"""The process helpers the benchmarks and the tuner share (kvpilot.loadgen.process, issue 51):
a free port one can bind, a process's CPU seconds, a server spawned into its log and waited for
until /health answers (or it exits, or time runs out), the stop, and where vLLM's Python is.
The server here is a few lines of http.server: no model, well under a second each."""

import os
import signal
import socket
import sys
import time

import pytest

from kvpilot.loadgen.process import (cpu_seconds, free_port, has_vllm, spawn_logged, stop_process,
                                     venv_vllm_python, wait_healthy)

# GET /health -> 200 on --port PORT; prints "listening" first
HEALTH_SERVER = """
import argparse, http.server
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); a = p.parse_args()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args):
        pass
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
"""


def test_free_port_is_bindable_and_cpu_seconds_count_this_process():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert cpu_seconds(os.getpid()) > before >= 0
    with pytest.raises(FileNotFoundError):
        cpu_seconds(2**22 + 1)  # above Linux's pid_max


def test_a_server_is_waited_for_until_healthy_and_its_output_is_in_the_log(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    proc = spawn_logged([sys.executable, "-c", HEALTH_SERVER, "--port", str(port)], log)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}/health", [proc], timeout_s=30, interval_s=0.05) is None
        assert "listening" in log.read_text()
    finally:
        assert stop_process(proc, 5) == -signal.SIGTERM


def test_an_exit_before_health_names_the_process_and_its_code(tmp_path):
    alive = spawn_logged([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "a.log")
    dead = spawn_logged([sys.executable, "-c", "import sys; print('error: no'); sys.exit(3)"], tmp_path / "b.log",
                        append=True)
    try:
        assert wait_healthy(f"http://127.0.0.1:{free_port()}/health", [alive, dead], 30, 0.05) == (1, 3)
        assert (tmp_path / "b.log").read_text().startswith("\n=== ")  # append: the command heads its output
        with pytest.raises(TimeoutError):
            wait_healthy(f"http://127.0.0.1:{free_port()}/health", [alive], 0.3, 0.05)
    finally:
        assert stop_process(alive, 5) == -signal.SIGTERM


def test_a_process_that_ignores_sigterm_is_killed_with_its_session(tmp_path):
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(60)")
    proc = spawn_logged([sys.executable, "-c", stubborn], tmp_path / "s.log")
    deadline = time.monotonic() + 30
    while "ready" not in (tmp_path / "s.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stop_process(proc, 0.3, kill_session=True) == -signal.SIGKILL


def test_vllm_is_a_python_with_the_vllm_script_beside_it(tmp_path):
    assert venv_vllm_python(tmp_path) is None and not has_vllm(None) and not has_vllm(tmp_path / "python")
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert venv_vllm_python(tmp_path) == python and not has_vllm(python)
    (python.parent / "vllm").write_text("")
    assert has_vllm(python) and has_vllm(str(python))


def test_the_tuners_engine_process_starts_and_stops_through_the_same_helpers(tmp_path):
    """EngineProcess (kvpilot.tuner.local) with a stand-in `serve` that takes any flags: one start
    appends to the log under a "===" command line and answers /health; an exit before health is
    a TrialFailed classified from the log (an upstream engine's: no structured exit code)."""
    from kvpilot.tuner.failures import REJECTED, TrialFailed
    from kvpilot.tuner.local.engine_process import EngineProcess
    from kvpilot.tuner.search.settings import EngineSettings

    lenient = HEALTH_SERVER.replace("a = p.parse_args()", "a = p.parse_known_args()[0]")
    engine = EngineProcess("m", tmp_path / "engine.log", serve_command=[sys.executable, "-c", lenient],
                           startup_timeout_s=30)
    engine.start(EngineSettings())
    try:
        assert engine.running and engine.port > 0 and engine.log_path.read_text().startswith("\n=== ")
    finally:
        engine.stop(timeout_s=5)
    assert not engine.running and engine.proc is None
    refusing = EngineProcess("m", tmp_path / "refused.log", startup_timeout_s=30,
                             serve_command=[sys.executable, "-c", "import sys; print('bad value'); sys.exit(2)"])
    with pytest.raises(TrialFailed) as failed:
        refusing.start(EngineSettings())
    assert failed.value.kind == REJECTED and "engine exited with 2" in failed.value.message


def test_the_checkout_root_is_found_from_every_package_that_names_it():
    """Issue 51 moved files a folder deeper: a `Path(__file__).parents[N]` that still counted the old
    depth would point inside a package and miss the checkout's .venv-vllm."""
    from kvpilot.bench import compare_vllm
    from kvpilot.loadgen import process
    from kvpilot.tuner.local import vllm_runtime

    for root in (process.REPO_ROOT, compare_vllm.REPO_ROOT, vllm_runtime.REPO_ROOT):
        assert (root / "pyproject.toml").is_file() and (root / "engine").is_dir(), root
