"""The engine container's entry point for `runtime: vllm` on CPU nodes: sets vLLM's CPU
environment from what the pod actually got, then execs `vllm serve ...` (its arguments).

Run by the image's own `python3 -I` from the InferenceService's ConfigMap (mounted at
/etc/kvpilot), so it works in any vLLM CPU image: standard library only, never imports kvpilot.
Why a program and not fixed variables: what vLLM's CPU guide asks for depends on the node.
- VLLM_CPU_OMP_THREADS_BIND: a Guaranteed pod with whole CPUs on a kubelet with the static CPU
  manager policy runs on an exclusive cpuset, which its threads are bound to (one list per rank
  of the pod, `|`-separated, as vLLM parses it); anywhere else the CPUs are shared (the kubelet's
  `none` policy, or a fractional request), so `nobind` with OMP_NUM_THREADS the CPU limit rounded
  up, split over the pod's ranks. The container cannot ask the kubelet for its policy: a cpuset of
  exactly the limit's size is taken as exclusive (under `none` the cpuset is the whole node).
  vLLM's `auto` would instead bind a thread to every core of the node's NUMA node, however few
  CPUs the pod may use.
- VLLM_CPU_KVCACHE_SPACE (GiB; vLLM turns it into kv_cache_memory_bytes and then skips its check
  of gpu_memory_utilization against the whole node's free memory): gpu_memory_utilization of the
  container's memory limit, less the model's weights and RESERVED_BYTES for vLLM's three processes
  (API server, engine core, worker: 3.1 GiB together without the KV cache, measured in a pod with
  SmolLM2-135M on vLLM 0.32; with 2 GiB reserved, a 4 GiB pod failed vLLM's own check at start,
  "Available memory on node 0 (0.9/4.0 GiB) ... is less than requested memory for kv (1.0 GiB)").
  Not set when the command gives --kv-cache-memory-bytes.
A variable already in the environment (spec.engine.env) is left as the user set it.
Sources: vLLM's CPU installation guide ("Related runtime environment variables"), vLLM
`vllm/utils/ompmultiprocessing.py`, `vllm/platforms/cpu.py`; Kubernetes "Control CPU Management
Policies on the Node".
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

GIB = 1 << 30
RESERVED_BYTES = 3 * GIB
CPU_LIMIT_ENV = "KVPILOT_CPU_LIMIT_MILLICORES"    # the downward API's limits.cpu, divisor 1m
MEMORY_LIMIT_ENV = "KVPILOT_MEMORY_LIMIT_BYTES"   # the downward API's limits.memory, divisor 1
RANKS_ENV = "KVPILOT_RANKS_PER_POD"               # tensor x pipeline parallel ranks in this pod
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default (CacheConfig)


class LaunchError(ValueError):
    """The pod's resources cannot run the command; the message says what to change."""


def cpu_binding(allowed: list[int], cpu_limit_millis: int, ranks: int) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND (and OMP_NUM_THREADS under nobind) for a container whose
    threads may run on the CPU ids `allowed`, with a limit of cpu_limit_millis (0: none) and
    `ranks` worker processes. Raises LaunchError when an exclusive cpuset has fewer CPUs than
    ranks."""
    whole = cpu_limit_millis > 0 and cpu_limit_millis % 1000 == 0
    if whole and len(allowed) == cpu_limit_millis // 1000:
        if len(allowed) < ranks:
            raise LaunchError(f"{len(allowed)} CPUs cannot run {ranks} ranks with a thread each: raise "
                              "spec.resources.cpu or lower tensorParallelSize x pipelineParallelSize")
        per_rank = len(allowed) // ranks
        lists = [allowed[i * per_rank:(i + 1) * per_rank] for i in range(ranks)]
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus)) for cpus in lists)}
    cpus = math.ceil(cpu_limit_millis / 1000) if cpu_limit_millis > 0 else len(allowed)
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, cpus // ranks))}


def kv_cache_space_gib(memory_limit_bytes: int, utilization: float, weights_bytes: int) -> int:
    """Whole GiB of KV cache: utilization x the memory limit, less the weights and
    RESERVED_BYTES. Raises LaunchError below 1 GiB."""
    space = int((utilization * memory_limit_bytes - weights_bytes - RESERVED_BYTES) // GIB)
    if space < 1:
        raise LaunchError(
            f"spec.resources.memory ({memory_limit_bytes / GIB:.1f} GiB) x gpuMemoryUtilization ({utilization}) "
            f"leaves less than 1 GiB for vLLM's KV cache after the weights ({weights_bytes / GIB:.2f} GiB) and "
            f"{RESERVED_BYTES // GIB} GiB for vLLM's processes: raise spec.resources.memory or set "
            "spec.engine.kvCacheMemoryBytes")
    return space


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value argv gives `flag` (`--flag V` or `--flag=V`; the last wins), or None. The settings
    table's flag_value by flag name: this file runs alone in the pod and cannot import it."""
    found = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def weights_bytes(model: str) -> int:
    """Bytes of weight files under the model directory (or the file itself); 0 when it is not a
    local path (vLLM downloads it, and the weights are not known here)."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def environment(argv: list[str], env: dict[str, str], allowed: list[int]) -> dict[str, str]:
    """The variables to add for `argv` (`vllm serve MODEL ...`) in environment `env`."""
    ranks = int(env.get(RANKS_ENV) or 1)
    added = cpu_binding(allowed, int(env.get(CPU_LIMIT_ENV) or 0), ranks)
    memory = int(env.get(MEMORY_LIMIT_ENV) or 0)
    if flag_value(argv, "--kv-cache-memory-bytes") is None and memory > 0:
        utilization = float(flag_value(argv, "--gpu-memory-utilization") or DEFAULT_UTILIZATION)
        model = argv[2] if len(argv) > 2 and argv[1] == "serve" else ""
        added["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib(memory, utilization, weights_bytes(model)))
    if "VLLM_CPU_OMP_THREADS_BIND" in env:  # the user's binding: their thread count too
        added.pop("OMP_NUM_THREADS", None)
    return {k: v for k, v in added.items() if k not in env}


def main(argv: list[str]) -> None:
    """Execs `argv` (`vllm serve MODEL ...`) with the CPU variables `environment` adds (logged on stdout);
    never returns. Exits 1 with the usage when argv is empty, 2 on a LaunchError (resources it cannot run in)."""
    if not argv:
        sys.exit("usage: vllm_cpu_launch.py vllm serve MODEL [FLAGS...]")
    try:
        added = environment(argv, dict(os.environ), sorted(os.sched_getaffinity(0)))
    except LaunchError as exc:
        print(f"kvpilot: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    print("kvpilot: vLLM CPU environment: " + " ".join(f"{k}={v}" for k, v in sorted(added.items())), flush=True)
    os.execvpe(argv[0], argv, {**os.environ, **added})


if __name__ == "__main__":
    main(sys.argv[1:])
