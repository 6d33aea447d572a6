"""operator/render/vllm_cpu_launch.py: vLLM's CPU environment from what the pod got, then exec. The
functions on the cases a kubelet produces (an exclusive cpuset of a Guaranteed pod on the static
CPU manager, the shared pool otherwise), and the program itself run as the pod runs it (the
system python3 -I on the file, as the ConfigMap holds it) over a stand-in `vllm` that prints its
environment, so what reaches vLLM is what is checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.operator.render import vllm_cpu_launch as launch
from kvpilot.operator.render.builders import build_configmap, build_deployment

GIB = 1 << 30


def test_an_exclusive_cpuset_is_bound_thread_per_cpu_split_over_the_ranks():
    # static CPU manager: a 4-CPU Guaranteed pod gets 4 CPUs of its own (not 0-3)
    assert launch.cpu_binding([4, 5, 6, 7], 4000, 1) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7"}
    assert launch.cpu_binding([4, 5, 6, 7], 4000, 2) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}
    with pytest.raises(launch.LaunchError, match="cannot run 4 ranks"):
        launch.cpu_binding([2, 3], 2000, 4)


@pytest.mark.parametrize("allowed, millis, ranks, threads", [
    (list(range(64)), 2000, 1, "2"),     # none policy: the whole node is allowed, the limit is 2 CPUs
    (list(range(64)), 1500, 1, "2"),     # fractional: Burstable, the limit rounded up
    ([0, 1], 500, 1, "1"),               # a small share never rounds to 0 threads
    (list(range(64)), 4000, 2, "2"),     # two ranks share the limit
    ([0, 1, 2, 3], 0, 1, "4"),           # no limit: what the container may run on
])
def test_a_shared_pool_is_not_bound_and_runs_as_many_threads_as_the_limit(allowed, millis, ranks, threads):
    assert launch.cpu_binding(allowed, millis, ranks) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                          "OMP_NUM_THREADS": threads}


def test_the_kv_cache_is_the_memory_limits_share_less_weights_and_processes():
    assert launch.kv_cache_space_gib(8 * GIB, 0.9, GIB // 4) == 3      # 7.2 - 0.25 - 3 = 3.95
    assert launch.kv_cache_space_gib(16 * GIB, 0.5, 0) == 5
    with pytest.raises(launch.LaunchError, match="raise spec.resources.memory or set spec.engine.kvCacheMemoryBytes"):
        launch.kv_cache_space_gib(4 * GIB, 0.9, GIB // 2)  # the builtin SmolLM2 in 4 GiB: 0.1 GiB left


def test_environment_reads_the_command_and_leaves_the_users_variables(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (GIB // 1024))  # 1 MiB of "weights"
    (model / "config.json").write_text("{}")
    env = {launch.CPU_LIMIT_ENV: "2000", launch.MEMORY_LIMIT_ENV: str(7 * GIB), launch.RANKS_ENV: "1"}
    argv = ["vllm", "serve", str(model), "--gpu-memory-utilization", "0.75"]
    added = launch.environment(argv, env, list(range(8)))  # 5.25 GiB - 1 MiB - 3 GiB
    assert added == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2"}
    # --kv-cache-memory-bytes sizes the cache itself; the user's own binding keeps its thread count
    user = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0-3", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert launch.environment([*argv, "--kv-cache-memory-bytes", "1G"], user, list(range(8))) == {}


def run_launcher(tmp_path, env: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess:
    """The launcher as the pod runs it, with a `vllm` on PATH that prints its argv and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}))\n")
    fake.chmod(0o755)
    script = tmp_path / "vllm_cpu_launch.py"
    script.write_text(build_configmap("a", "ns", SPEC)["data"]["vllm_cpu_launch.py"])
    return subprocess.run(["python3", "-I", str(script), *argv], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env}, cwd=tmp_path)


SPEC = InferenceServiceSpec.from_dict({"model": {"source": "builtin://smollm2-135m-instruct"},
                                       "engine": {"runtime": "vllm"},
                                       "resources": {"cpu": "2", "memory": "6Gi"}})


def test_the_pod_runs_vllm_serve_through_the_launcher_with_the_cpu_environment(tmp_path):
    container = build_deployment("a", "ns", SPEC)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python3", "-I", "/etc/kvpilot/vllm_cpu_launch.py"]
    assert container["args"][:3] == ["vllm", "serve", "/opt/kvpilot/models/smollm2-135m-instruct"]
    env = {e["name"]: e for e in container["env"]}
    assert env[launch.CPU_LIMIT_ENV]["valueFrom"]["resourceFieldRef"] == {
        "containerName": "engine", "resource": "limits.cpu", "divisor": "1m"}
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"]["value"] == "0"
    # the kubelet's values for this pod (2 CPUs, 6 GiB) on a node whose pool is shared
    done = run_launcher(tmp_path, {launch.CPU_LIMIT_ENV: "2000", launch.MEMORY_LIMIT_ENV: str(6 * GIB),
                                   launch.RANKS_ENV: "1"}, container["args"])
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["argv"] == container["args"][1:]  # exec'd with the command line untouched
    expected_threads = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}
    if sorted(os.sched_getaffinity(0)) == [0, 1]:  # this 2-CPU machine is exactly the pod's limit
        expected_threads = {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert {k: seen["env"].get(k) for k in expected_threads} == expected_threads
    assert seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"  # 5.4 GiB - 3 GiB (no weights at that path here)


def test_too_little_memory_stops_the_pod_with_what_to_change(tmp_path):
    done = run_launcher(tmp_path, {launch.CPU_LIMIT_ENV: "1000", launch.MEMORY_LIMIT_ENV: str(2 * GIB)},
                        ["vllm", "serve", "/nonexistent"])
    assert done.returncode == 2 and done.stdout == ""
    assert "raise spec.resources.memory or set spec.engine.kvCacheMemoryBytes" in done.stderr


def test_gpu_pods_and_the_kvpilot_runtime_do_not_use_the_launcher():
    for body in ({"model": {"source": "/models/x"}, "engine": {"runtime": "vllm"}, "resources": {"gpu": True}},
                 {"model": {"source": "builtin://smollm2-135m-instruct"}}):
        spec = InferenceServiceSpec.from_dict(body)
        container = build_deployment("a", "ns", spec)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] in (["vllm", "serve"], ["kvpilot", "serve"])
        assert "vllm_cpu_launch.py" not in build_configmap("a", "ns", spec)["data"]
        assert launch.CPU_LIMIT_ENV not in {e["name"] for e in container["env"]}
