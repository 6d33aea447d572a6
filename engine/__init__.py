"""kvpilot's paged-attention engine (vLLM v1 design at small size).

The public names load on first use (PEP 562), so that torch-free submodules such as
`kvpilot.engine.settings` (which the operator imports) do not pull in torch, and so
that the OpenMP wait policy is in the environment before torch loads libgomp (cpu/omp_wait.py)."""

from importlib import import_module

from kvpilot.engine.cpu import omp_wait

omp_wait.apply()  # before anything loads torch (and with it libgomp, which reads the wait policy once)

_EXPORTS = {
    "EngineArgs": "kvpilot.engine.arg_utils",
    "LLM": "kvpilot.engine.entrypoints.llm",
    "LLMEngine": "kvpilot.engine.engine.llm_engine",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
