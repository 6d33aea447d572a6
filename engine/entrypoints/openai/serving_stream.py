"""The way back up for an admitted request: an SSE stream (stream=true) or the final
outputs of its engine requests; either way its engine requests are aborted when the client
leaves, and the admission taken by `serving.admit` is closed exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvpilot.engine.engine.async_engine import AsyncLLMEngine, RequestAborted
from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.limits import Admission
from kvpilot.engine.entrypoints.openai.serving import ServerState, SubRequest, merged_outputs
from kvpilot.engine.outputs import RequestError, RequestOutput

logger = logging.getLogger("kvpilot.server")


def streaming_response(request: Request, state: ServerState, engine: AsyncLLMEngine, subs: list[SubRequest],
                       request_id: str, events: AsyncIterator[str]) -> Response:
    """stream=true: an SSE response over a handler's `events` (see `stream_events`)."""
    admission = subs[0].admission
    try:
        return AdmittedStreamingResponse(admission, stream_events(request, state, engine, subs, events),
                                         media_type="text/event-stream", headers={"X-Request-Id": request_id})
    except BaseException:
        admission.close()
        raise


async def collect_finals(request: Request, state: ServerState, engine: AsyncLLMEngine,
                         subs: list[SubRequest]) -> Response | dict[int, RequestOutput]:
    """stream=false: the final output of every sub-request, by index, or the answer for a
    client that left. Bad input found by the engine becomes HTTP 400; a request past
    --request-deadline-s gets 408."""
    admission = subs[0].admission
    try:
        return await collect_unless_disconnected(request, _collect_finals(engine, subs))
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except RequestError as exc:  # it failed alone in the engine (logged there); the engine goes on
        raise APIError(500, str(exc), code="request_failed") from None
    except RequestAborted as exc:
        if admission.timed_out:
            raise admission.deadline_error() from None
        return aborted_answer(state, exc)
    finally:
        admission.close()


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
    """One server-sent event, `data: <JSON>\\n\\n` (non-ASCII kept as UTF-8). A model is dumped with
    its nulls, less a null `usage` (OpenAI sends usage only in the last chunk); a str goes as is
    (`[DONE]`)."""
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
    except RequestError as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": 500}})
        yield "data: [DONE]\n\n"
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
