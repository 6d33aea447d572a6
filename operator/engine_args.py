"""Renders spec.engine as a `vllm serve`-style command line, and hashes the configuration.

kvpilot's engine and upstream vLLM take the same flags, so runtime only picks the program:
`kvpilot serve MODEL ...` or `vllm serve MODEL ...`.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.api.spec import EngineSpec, InferenceServiceSpec

# The engine reads its API key from this variable (as vLLM does); extraArgs may not repeat
# any flag rendered here (operator/extra_args.py).
API_KEY_ENV = "VLLM_API_KEY"
ADMIN_TOKEN_ENV = "KVPILOT_ADMIN_TOKEN"  # the control routes' own token, from the operator's Secret

PROGRAMS = {"kvpilot": ["kvpilot", "serve"], "vllm": ["vllm", "serve"]}


def _number(value: float) -> str:
    """2.0 -> '2', 0.9 -> '0.9': flags read the same as a person would type them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_engine_args(engine: EngineSpec) -> list[str]:
    """The flags after `serve MODEL`, in a fixed order, then extraArgs verbatim.

    No secret is ever a flag: the API key reaches the engine as $VLLM_API_KEY from the Secret
    (a flag would show in `ps` inside the pod, and in the ConfigMap and status)."""
    args = [
        "--max-model-len", str(engine.maxModelLen),
        "--max-num-seqs", str(engine.maxNumSeqs),
        "--max-num-batched-tokens", str(engine.maxNumBatchedTokens),
        "--gpu-memory-utilization", _number(engine.gpuMemoryUtilization),
        "--enable-chunked-prefill" if engine.enableChunkedPrefill else "--no-enable-chunked-prefill",
        "--tensor-parallel-size", str(engine.tensorParallelSize),
        "--pipeline-parallel-size", str(engine.pipelineParallelSize),
        "--block-size", str(engine.blockSize),
        "--swap-space", _number(engine.swapSpace),
        "--preemption-mode", engine.preemptionMode,
    ]
    if engine.enablePrefixCaching:
        args.append("--enable-prefix-caching")
    args += ["--dtype", engine.dtype, "--seed", str(engine.seed), "--port", str(engine.port)]
    if engine.runtime == "kvpilot":  # behind $KVPILOT_ADMIN_TOKEN; upstream vLLM has no such flag
        args.append("--enable-admin-routes")
    if engine.showHiddenMetricsForVersion:  # vLLM's deprecated metric names, for older dashboards
        args += ["--show-hidden-metrics-for-version", engine.showHiddenMetricsForVersion]
    return args + list(engine.extraArgs)


def engine_command(spec: InferenceServiceSpec) -> list[str]:
    """The whole command line: program, `serve`, the model source, `--served-model-name`, then
    the flags. The served name is spec.model.name (or the source's last part), so that clients,
    the tuner's requests and its `model_name` metric selectors all use the same name, as
    `vllm serve --served-model-name` does."""
    return (PROGRAMS[spec.engine.runtime] + [spec.model.source, "--served-model-name", spec.model.display_name]
            + render_engine_args(spec.engine))


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able configuration (sorted keys), 16 hex digits."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
