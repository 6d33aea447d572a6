"""What completions and chat completions share: the server's state, admission (loading,
draining, queue limit), request validation into `SamplingParams`, fan-out of one HTTP
request into engine requests (batched prompts, n > 1), client-disconnect aborts, SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from kvpilot.engine.entrypoints.async_engine import AsyncLLMEngine, RequestAborted
from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.limits import Admission, check_request_limits
from kvpilot.engine.entrypoints.http_metrics import server_registry
from kvpilot.engine.entrypoints.protocol import UsageInfo, _SamplingRequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.server")

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
    started_s: float = field(default_factory=time.time)
    metrics_registry: CollectorRegistry = field(default_factory=server_registry)
    show_hidden_metrics_for_version: str | None = None

    def model_names(self) -> set[str]:
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


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names():
        raise APIError(404, f"The model `{model}` does not exist. Served models: {sorted(state.model_names())}",
                       param="model", code="model_not_found")


def reject_unsupported(req: _SamplingRequest) -> None:
    if req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1.0:
        raise bad_request("presence_penalty, frequency_penalty and repetition_penalty are not supported; "
                          "leave them at 0, 0 and 1", param="presence_penalty")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if not 1 <= req.n <= 16:
        raise bad_request(f"n must be between 1 and 16, got {req.n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    check_request_limits(req)


def sampling_params(state: ServerState, req: _SamplingRequest, prompt_len: int, max_tokens: int | None,
                    default_max_tokens: int | None, logprobs: int | None, index: int = 0) -> SamplingParams:
    """Builds the engine's sampling parameters for one prompt. 400 when max_tokens is not
    positive, when prompt + max_tokens exceeds max_model_len, or a value is out of range."""
    limit = state.max_model_len
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if prompt_len >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt_len} "
            f"tokens; it must be shorter than {limit} to leave room for at least one output token. Please "
            f"reduce the length of the prompt.", param="prompt")
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the length of the prompt or max_tokens.", param="max_tokens")
    if max_tokens is None:
        room = limit - prompt_len
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    seed = None if req.seed is None else req.seed + index
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop or [],
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


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
    it); `stream_or_collect` closes the admission. 503 with Retry-After while loading or
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


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (uvicorn answers http.disconnect once the body has
    been read and the connection closes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_unless_disconnected(request: Request, coro) -> object:
    """Awaits coro, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            logger.info("request aborted: the client disconnected before the answer")
            raise RequestAborted("the client disconnected")
        return task.result()
    finally:
        watcher.cancel()


async def stream_or_collect(request: Request, state: ServerState, engine: AsyncLLMEngine, subs: list[SubRequest],
                            request_id: str, events: Callable[[], AsyncIterator[str]] | None
                            ) -> Response | dict[int, RequestOutput]:
    """The shared tail of the completion handlers. With `events` (stream=true): an SSE
    response over them. Without: the final output of every sub-request, by index, or the
    answer for a client that left. Bad input found by the engine becomes HTTP 400; a request
    past --request-deadline-s gets 408. The admission taken by `admit` is closed either way."""
    admission = subs[0].admission
    if events is not None:
        try:
            return AdmittedStreamingResponse(admission, stream_events(request, state, engine, subs, events()),
                                             media_type="text/event-stream", headers={"X-Request-Id": request_id})
        except BaseException:
            admission.close()
            raise
    try:
        return await collect_unless_disconnected(request, _collect_finals(engine, subs))
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except RequestAborted as exc:
        if admission.timed_out:
            raise admission.deadline_error() from None
        return aborted_answer(state, exc)
    finally:
        admission.close()


class AdmittedStreamingResponse(StreamingResponse):
    """Closes the admission when the response ends in any way, even when the client left
    before the body iterator ever started (its `finally` would then never run)."""

    def __init__(self, admission: Admission, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.close()


async def _collect_finals(engine: AsyncLLMEngine, subs: list[SubRequest]) -> dict[int, RequestOutput]:
    finals = {}
    async for index, out in merged_outputs(engine, subs):
        if out.finished:
            finals[index] = out
    return finals


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump(exclude_none=False)
        if data.get("usage") is None:
            data.pop("usage", None)
        payload = data
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


async def stream_events(request: Request, state: ServerState, engine: AsyncLLMEngine, subs: list[SubRequest],
                        events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wraps a handler's SSE events: in flight until the last byte, aborts its engine
    requests when the client disconnects, ends errors as an error event, then [DONE].
    Releases the admission taken by `admit`."""

    client_gone = False

    async def on_disconnect() -> None:
        nonlocal client_gone
        await wait_for_disconnect(request)
        client_gone = True
        for sub in subs:
            engine.abort(sub.request_id)

    watcher = asyncio.ensure_future(on_disconnect())
    done = False
    try:
        async for event in events:
            yield event
        done = True
        yield "data: [DONE]\n\n"
    except RequestAborted as exc:
        if client_gone:  # our watcher saw the client leave
            _log_disconnect(subs)
        elif subs[0].admission.timed_out:
            error = subs[0].admission.deadline_error()
            yield sse({"error": {"message": error.message, "type": "timeout_error", "param": None,
                                 "code": error.status}})
            yield "data: [DONE]\n\n"
        else:  # the server aborted it (drain timeout): tell the client
            yield sse({"error": {"message": str(exc), "type": "service_unavailable_error", "param": None,
                                 "code": 503}})
            yield "data: [DONE]\n\n"
    except asyncio.CancelledError:  # Starlette's did
        _log_disconnect(subs)
        raise
    except (ValueError, APIError) as exc:
        message = exc.message if isinstance(exc, APIError) else str(exc)
        yield sse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}})
        yield "data: [DONE]\n\n"
    except Exception as exc:
        logger.exception("stream failed")
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None,
                             "code": 500}})
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if not done:  # the engine requests may still run
            for sub in subs:
                engine.abort(sub.request_id)
        subs[0].admission.close()


def aborted_answer(state: ServerState, exc: RequestAborted) -> Response:
    """The answer to a non-streaming request that was aborted: nobody is listening when the
    client left (499, as nginx logs it); 503 when the server aborted it on shutdown."""
    if state.draining:
        raise APIError(503, str(exc), headers={"Connection": "close"})
    return Response(status_code=499)


def _log_disconnect(subs: list[SubRequest]) -> None:
    logger.info("request %s aborted: the client disconnected", subs[0].request_id.rsplit("-", 1)[0])


def log_request(state: ServerState, request_id: str, subs: list[SubRequest]) -> None:
    if state.log_requests:
        logger.info("Received request %s: %d prompt(s), prompt tokens %s, params: %s", request_id, len(subs),
                    [len(s.prompt_token_ids) for s in subs], subs[0].params)


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                   top_n: int) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """Per output token: its text, its logprob, and the top_n most likely (text, logprob).
    The engine's entries hold the chosen token first, then the top-N tokens."""
    entries = []
    for i, tid in enumerate(token_ids):
        entry = logprobs[i] if logprobs is not None and i < len(logprobs) else {}
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append((tokenizer.decode([tid]), entry.get(tid),
                        [(tokenizer.decode([t]), lp) for t, lp in top]))
    return entries
