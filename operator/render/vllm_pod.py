"""What an engine pod of `runtime: vllm` on CPU nodes adds to the common template (pure).

The container starts vllm_cpu_launch.py from the InferenceService's ConfigMap (mounted at
CONFIG_DIR), which sets vLLM's CPU thread binding and KV-cache size from the container's limits
(read through the downward API) and execs `vllm serve ...`. vLLM keeps every CPU it is given
(VLLM_CPU_NUM_OF_RESERVED_CPU=0): by default it holds one back for its frontend, a third of a
2-CPU pod's throughput under load (measured, vLLM 0.32 on 2-core Zen 4), while the pod's limit
already leaves the rest of the node to others. Source: vLLM's CPU installation guide.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.api.spec import InferenceServiceSpec

from kvpilot.operator.render import vllm_cpu_launch
from kvpilot.engine.settings.env import (
    KVPILOT_CPU_LIMIT_MILLICORES, KVPILOT_MEMORY_LIMIT_BYTES, KVPILOT_RANKS_PER_POD, VLLM_CPU_NUM_OF_RESERVED_CPU,
)

CONFIG_DIR = "/etc/kvpilot"  # the ConfigMap's mount
VLLM_CPU_LAUNCH_KEY = "vllm_cpu_launch.py"
VLLM_CPU_ENV_SET = (KVPILOT_CPU_LIMIT_MILLICORES, KVPILOT_MEMORY_LIMIT_BYTES, KVPILOT_RANKS_PER_POD,
                    VLLM_CPU_NUM_OF_RESERVED_CPU)


def vllm_on_cpu(spec: InferenceServiceSpec) -> bool:
    """Upstream vLLM on CPU nodes (runtime vllm without resources.gpu)."""
    return spec.engine.runtime == "vllm" and not spec.resources.gpu


def vllm_cpu_config() -> dict[str, str]:
    """The ConfigMap entry holding the launcher's source."""
    return {VLLM_CPU_LAUNCH_KEY: Path(vllm_cpu_launch.__file__).read_text()}


def vllm_cpu_program() -> list[str]:
    """The container's command; its args are the whole `vllm serve ...` command line. The image's
    own python3 runs it isolated (-I: no PYTHON* variables, no user site, no script directory)."""
    return ["python3", "-I", f"{CONFIG_DIR}/{VLLM_CPU_LAUNCH_KEY}"]


def vllm_cpu_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The container's CPU and memory limits (the downward API: millicores, bytes), the ranks it
    runs, and no CPU reserved."""
    def limit(env: str, resource: str, divisor: str) -> dict[str, Any]:
        return {"name": env, "valueFrom": {"resourceFieldRef": {
            "containerName": "engine", "resource": resource, "divisor": divisor}}}
    return [limit(KVPILOT_CPU_LIMIT_MILLICORES, "limits.cpu", "1m"),
            limit(KVPILOT_MEMORY_LIMIT_BYTES, "limits.memory", "1"),
            {"name": KVPILOT_RANKS_PER_POD, "value": str(spec.ranks_per_pod)},
            {"name": VLLM_CPU_NUM_OF_RESERVED_CPU, "value": "0"}]
