"""kvpilot's paged-attention engine (vLLM v1 design at small size)."""

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.llm import LLM
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
