"""The server's state, and the way down for one HTTP request: admission (loading, draining,
--max-queue-len) and fan-out into engine requests (batched prompts, n > 1) whose outputs
come back merged. The OpenAI handlers on top are in `serving_engine.py` and its subclasses;
the way back up (SSE or collected answers, client disconnects) in `serving_stream.py`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvpilot.engine.engine.async_engine import AsyncLLMEngine
from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.http_metrics import server_registry
from kvpilot.engine.entrypoints.limits import Admission
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """Shared by all handlers. `engine` is None while the model loads."""

    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int = 0
    engine: AsyncLLMEngine | None = None
    tokenizer: object = None
    api_key: str | None = None
    admin_token: str | None = None
    max_queue_len: int | None = None
    request_deadline_s: float | None = None
    log_requests: bool = True
    profiler_dir: str | None = None
    draining: bool = False
    num_in_flight: int = 0
    num_reserved: int = 0  # admitted engine requests not yet handed to the engine
    metrics_registry: CollectorRegistry = field(default_factory=server_registry)
    show_hidden_metrics_for_version: str | None = None
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None  # --tool-call-parser (tool_parsers.TOOL_PARSERS)
    disable_any_whitespace: bool = False  # --structured-outputs-config's, for requests that do not say
    max_logprobs: int = 20  # --max-logprobs: most logprobs per token a request may ask for (-1: the vocabulary)

    def model_names(self) -> set[str]:
        """The names a request's `model` may give (404 model_not_found for any other): the served one."""
        return {self.served_model_name}

    def ready_engine(self) -> AsyncLLMEngine:
        """The engine when it can take requests; raises 503 while loading or draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests",
                           headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if self.engine is None:
            raise APIError(503, "the model is still loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if not self.engine.is_running:
            raise APIError(503, f"the engine is not running: {self.engine.errored}")
        return self.engine


@dataclass
class SubRequest:
    """One engine request of an HTTP request: choice `index`."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1  # choices per prompt: indices p*n .. p*n+n-1 share prompt p
    admission: Admission | None = None

    def started(self) -> None:
        """Called in the same event-loop step as engine.generate's first step."""
        if self.admission is not None:
            self.admission.started()


def admit(state: ServerState, subs: list[SubRequest]) -> AsyncLLMEngine:
    """Admits an HTTP request's engine requests and counts it in flight (the drain waits for
    it); `serving_stream` closes the admission. 503 with Retry-After while loading or
    draining, or when the waiting queue would pass --max-queue-len: waiting counts the
    scheduler's queue, requests on their way to it and admitted ones not yet sent, all read
    in this one synchronous step, so concurrent requests cannot slip past the cap. Starts
    the --request-deadline-s clock."""
    engine = state.ready_engine()
    if state.max_queue_len is not None and len(subs) > max(state.max_queue_len, 1):
        raise bad_request(f"this request asks for {len(subs)} sequences (n x prompts) but the server queues at "
                          f"most {state.max_queue_len} (--max-queue-len); split it into smaller requests",
                          param="n")
    waiting = engine.num_waiting + state.num_reserved
    if state.max_queue_len is not None and waiting + len(subs) > state.max_queue_len:
        if engine.metrics is not None:
            engine.metrics.record_admission_rejection("max_num_queued_reqs")
        raise APIError(503, f"the server is overloaded: {waiting} requests are waiting "
                       f"(--max-queue-len {state.max_queue_len}); retry later",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    admission = Admission(state, len(subs))
    state.num_in_flight += 1
    state.num_reserved += len(subs)
    for sub in subs:
        sub.admission = admission
    admission.start_deadline(lambda reason: [engine.abort(sub.request_id, reason) for sub in subs])
    return engine


async def merged_outputs(engine: AsyncLLMEngine, subs: list[SubRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all sub-requests as (choice index, output), as they come. Raises the
    first error (ValueError -> 400 by the caller); leaving early aborts them all."""
    record_parent = _parent_recorder(engine, subs)
    if len(subs) == 1:
        sub = subs[0]
        gen = engine.generate(sub.request_id, sub.prompt_token_ids, sub.params)
        sub.started()
        try:
            async for out in gen:
                if out.finished:
                    record_parent(sub.index, out)
                yield sub.index, out
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(sub: SubRequest) -> None:
        sub.started()
        try:
            async for out in engine.generate(sub.request_id, sub.prompt_token_ids, sub.params):
                queue.put_nowait((sub.index, out))
        except BaseException as exc:  # handed to the consumer below
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in subs]
    unfinished = {s.index: s.request_id for s in subs}
    try:
        while unfinished:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1].finished:
                unfinished.pop(item[0], None)
                record_parent(*item)
            yield item
    finally:
        for task in tasks:
            task.cancel()
        for request_id in unfinished.values():
            engine.abort(request_id)


def _parent_recorder(engine: AsyncLLMEngine, subs: list[SubRequest]) -> Callable[[int, RequestOutput], None]:
    """`record(index, final_output)`: once all n choices of a prompt are final, records n and
    their most generated tokens (vllm:request_params_n, vllm:request_max_num_generation_tokens)."""
    n_of = {s.index: s.n for s in subs}
    done: dict[int, list[int]] = {}

    def record(index: int, out: RequestOutput) -> None:
        n = n_of[index]
        tokens = done.setdefault(index // n, [])
        tokens.append(len(out.outputs[0].token_ids))
        if len(tokens) == n and engine.metrics is not None:
            engine.metrics.record_parent(n, tokens)

    return record
