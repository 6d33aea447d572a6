"""Seconds from process start to the first `/health` 200 of `kvpilot serve` with default
flags, and the server's resident memory then (VmRSS) and its peak (VmHWM), for one or
more source trees side by side (alternating A, B, A, B so load changes hit both).

    python measure_startup.py --tree before=/tmp/before --tree after= --rounds 2 --out startup.json

A tree is a directory put first on PYTHONPATH that holds a `kvpilot` package (empty: the
installed one). Uses the current interpreter; each server gets a free port.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvpilot.engine.settings import flag_words


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure(tree: str, timeout_s: float, extra: list[str]) -> dict:
    port = _free_port()
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "kvpilot.cli.main", "serve", *flag_words("port", port), *extra]
    t0 = time.monotonic()
    cpu0 = os.times()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"no /health 200 within {timeout_s} s")
        ready_s = time.monotonic() - t0
        rss, hwm = _status_kib(proc.pid, "VmRSS"), _status_kib(proc.pid, "VmHWM")
        cpu_s = _proc_cpu_s(proc.pid)
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    blocks = [line for line in (err or "").splitlines() if "# KV blocks" in line or "dtype auto" in line]
    del cpu0
    return {"ready_s": ready_s, "server_cpu_s_until_ready": cpu_s, "rss_mib": rss / 1024,
            "peak_rss_mib": hwm / 1024, "log": blocks}


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR (DIR empty: installed kvpilot)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default="startup.json")
    p.add_argument("extra", nargs="*", help="flags passed to kvpilot serve after --")
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    load = [os.getloadavg()]
    for _ in range(a.rounds):
        for name, tree in trees.items():
            r = measure(tree, a.timeout_s, a.extra)
            runs[name].append(r)
            print(f"{name}: /health 200 after {r['ready_s']:.1f} s ({r['server_cpu_s_until_ready']:.1f} s CPU), "
                  f"RSS {r['rss_mib']:.0f} MiB, peak {r['peak_rss_mib']:.0f} MiB; {r['log']}", flush=True)
            load.append(os.getloadavg())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    Path(a.out).write_text(json.dumps({"cpu": cpu, "nproc": os.cpu_count(), "loadavg": load, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
