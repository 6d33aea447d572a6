"""Renders spec.engine as a `vllm serve`-style command line, and hashes the configuration.

kvpilot's engine and upstream vLLM take the same flags, so runtime only picks the program:
`kvpilot serve MODEL ...` or `vllm serve MODEL ...`.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from .spec import EngineSpec, InferenceServiceSpec

# The flags the operator renders from spec.engine; extraArgs may not repeat them.
RENDERED_FLAGS = (
    "--model", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
    "--gpu-memory-utilization", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--tensor-parallel-size", "--pipeline-parallel-size", "--block-size", "--swap-space",
    "--preemption-mode", "--enable-prefix-caching", "--dtype", "--seed", "--port", "--api-key",
    "--show-hidden-metrics-for-version",
)

API_KEY_ENV = "KVPILOT_API_KEY"

PROGRAMS = {"kvpilot": ["kvpilot", "serve"], "vllm": ["vllm", "serve"]}


def _number(value: float) -> str:
    """2.0 -> '2', 0.9 -> '0.9': flags read the same as a person would type them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render_engine_args(engine: EngineSpec) -> list[str]:
    """The flags after `serve MODEL`, in a fixed order, then extraArgs verbatim.

    The API key is the literal `$(KVPILOT_API_KEY)`: the kubelet expands it from the env var
    that the Deployment fills from the Secret, so the key never appears in a spec or status.
    """
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
    if engine.showHiddenMetricsForVersion:  # vLLM's deprecated metric names, for older dashboards
        args += ["--show-hidden-metrics-for-version", engine.showHiddenMetricsForVersion]
    if engine.apiKeySecret is not None:
        args += ["--api-key", f"$({API_KEY_ENV})"]
    return args + list(engine.extraArgs)


def engine_command(spec: InferenceServiceSpec) -> list[str]:
    """The whole command line: program, `serve`, the model source, then the flags."""
    return PROGRAMS[spec.engine.runtime] + [spec.model.source] + render_engine_args(spec.engine)


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able configuration (sorted keys), 16 hex digits."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
