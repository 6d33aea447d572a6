"""A request's structured-output constraint, from `response_format` or `structured_outputs`
(or, in chat, a required or named `tool_choice`: tool_parsers/calls.py), compiled off the engine loop.

Compiling runs on the server's grammar thread (xgrammar releases the GIL), never on the engine
thread, and is bounded: a spec over MAX_GRAMMAR_BYTES is refused before compiling, and one
that has not compiled in GRAMMAR_COMPILE_TIMEOUT_S answers 400 (its compile finishes in the
background and lands in xgrammar's cache). Either way the request never reaches the engine,
and a schema that cannot compile is a 400 naming the field.
Source: vLLM `ChatCompletionRequest.to_sampling_params` (response_format -> json / json_object),
vLLM `StructuredOutputManager` (compiles on a thread pool)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import _SamplingRequest
from kvpilot.engine.structured_output.params import StructuredOutputsParams

GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# Two threads: one slow schema (bounded by the timeout above, but still running) leaves the
# other to compile the next requests' grammars.
_compile_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpilot-grammar")


def request_spec(req: _SamplingRequest, compact: bool = False) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint that `response_format` or `structured_outputs` asks for, the field that
    asked). compact: the server's disable_any_whitespace, for a request that does not say. 400
    naming the field when both are given or the spec is malformed."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request("give either response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if so is not None:
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object, disable_any_whitespace=compact
                                           if so.disable_any_whitespace is None else so.disable_any_whitespace), \
                "structured_outputs"
        if fmt is None or fmt.type == "text":
            return None, None
        if fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.json_schema is None):
            raise ValueError("a response_format of type json_schema needs json_schema.schema (vLLM's rule; for "
                             "any JSON give type json_object)")
        spec = (StructuredOutputsParams(json=fmt.json_schema.json_schema, disable_any_whitespace=compact)
                if fmt.type == "json_schema" else StructuredOutputsParams(json_object=True, disable_any_whitespace=compact))
        return spec, "response_format"
    except ValueError as exc:
        raise bad_request(f"{'structured_outputs' if so is not None else 'response_format'}: {exc}",
                          param="structured_outputs" if so is not None else "response_format") from None


async def compile_spec(compiler_of, spec: StructuredOutputsParams, param: str,
                       timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> StructuredOutputsParams:
    """spec with its compiled grammar attached, compiled on the grammar thread. compiler_of:
    a callable returning the engine's GrammarCompiler (built on first use, on that thread).
    400 naming `param` when it cannot compile or takes longer than timeout_s."""

    def compile_now():
        return compiler_of().compile(spec)

    future = _compile_pool.submit(compile_now)
    try:
        spec.compiled = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None
    except TimeoutError:
        raise bad_request(f"{param}: the {spec.kind} did not compile within {timeout_s:g} s; simplify it (large "
                          f"maxLength, minItems or repetition counts make big grammars)", param=param) from None
    return spec
