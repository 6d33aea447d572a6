"""Async streaming client for OpenAI-compatible servers, timing every token chunk.

One call, one request: POST to /v1/completions or /v1/chat/completions with
`stream: true` and `stream_options.include_usage`, parse the Server-Sent Events, and
return a `RequestResult` with TTFT, the inter-token gaps, E2E latency and the server's
token count, or the failure classified by kind. Timing follows vLLM's
`vllm/benchmarks/lib/endpoint_request_func.py`: every event with a non-empty `choices`
list is a token arrival (text may be empty, e.g. for special tokens); the trailing usage
event is not, and latency ends at the last token event.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpilot.loadgen.metrics import RequestResult


class SSEDecoder:
    """Incremental Server-Sent Events parser (WHATWG event-stream rules, data only).

    Feed raw bytes as they arrive; get back the `data` payload of each complete event.
    Handles events split across chunks and multi-byte UTF-8 split across chunks, LF, CRLF
    and CR line ends, multi-line data (joined with "\\n"), comment lines (":" pings), and
    ignores event/id/retry fields."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the data of every event completed by them, in order."""
        self._buffer += self._decoder.decode(chunk)
        # A trailing "\r" may be the first half of "\r\n": keep it until more arrives.
        cut = len(self._buffer) - 1 if self._buffer.endswith("\r") else len(self._buffer)
        text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop() + self._buffer  # the unterminated last line
        events = []
        for line in lines:
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """End of stream: return an event left without its closing blank line, if any."""
        events = self.feed(self._decoder.decode(b"", final=True).encode() + b"\n\n")
        self._buffer = ""
        return events


@dataclass
class RequestInput:
    """One request to send. api_url is the full endpoint URL; `chat` selects the chat
    payload (messages) instead of the completions payload (prompt); prompt_len in tokens;
    output_len is max_tokens; extra_body is merged into the JSON payload."""

    prompt: str
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    chat: bool = False
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def endpoint_is_chat(api_url: str) -> bool:
    """True for a chat-completions URL, False for a completions URL.
    Raises ValueError for any other path."""
    path = api_url.split("?")[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return True
    if path.endswith("/completions"):
        return False
    raise ValueError(f"endpoint {api_url!r} must end with /completions or /chat/completions")


def build_payload(req: RequestInput) -> dict[str, Any]:
    """The JSON body vLLM's benchmark sends. Chat requests carry both
    `max_completion_tokens` (current OpenAI name) and `max_tokens` (what older servers
    such as llama.cpp's read), so every server stops at the same length."""
    body: dict[str, Any] = {"model": req.model, "stream": True, "stream_options": {"include_usage": True}}
    if req.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
        body["max_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if req.ignore_eos:
        body["ignore_eos"] = True
    body.update(req.extra_body)
    return body


class _StreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def send_request(
    client: httpx.AsyncClient,
    req: RequestInput,
    *,
    timeout_s: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    keep_partial: bool = False,
) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network faults.

    Error kinds: "http_<status>" (non-200 answer), "connect" (refused or unreachable),
    "timeout" (no answer within httpx's timeouts or `timeout_s` seconds overall),
    "disconnect" (the stream broke off), "error_event" (the server streamed an error
    object), "bad_event" (an event that is not JSON), "no_tokens" (the stream ended before
    any token), "other". `on_done` is called with the result (e.g. to advance a bar).
    A failed result has no timings, unless `keep_partial`: then the TTFT and gaps of the
    tokens that arrived before the failure stay (a benchmark cut short by its time budget)."""
    result = RequestResult(prompt_len=req.prompt_len)
    result.start_time = time.perf_counter()
    try:
        if timeout_s is None:
            await _stream(client, req, result)
        else:
            await asyncio.wait_for(_stream(client, req, result), timeout_s)
    except _StreamError as exc:
        result.error_kind, result.error = exc.kind, str(exc)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        result.error_kind, result.error = "timeout", f"timed out: {exc!r}"
    except httpx.ConnectError as exc:
        result.error_kind, result.error = "connect", f"cannot connect to {req.api_url}: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        result.error_kind, result.error = "disconnect", f"stream broke off: {exc!r}"
    except Exception as exc:  # a benchmark records every failure instead of aborting the run
        result.error_kind, result.error = "other", f"{type(exc).__name__}: {exc}"
    result.success = not result.error_kind
    if not result.success and not keep_partial:
        result.ttft, result.itl, result.latency = 0.0, [], 0.0
    if on_done is not None:
        on_done(result)
    return result


async def _stream(client: httpx.AsyncClient, req: RequestInput, result: RequestResult) -> None:
    start = result.start_time
    last = start
    got_token = False
    text_parts: list[str] = []
    headers = {"Content-Type": "application/json", **req.headers}
    async with client.stream("POST", req.api_url, json=build_payload(req), headers=headers) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            raise _StreamError(f"http_{response.status_code}", f"HTTP {response.status_code}: {body[:500]}")
        decoder = SSEDecoder()
        async for chunk in response.aiter_bytes():  # decoded if the server compresses
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                if _handle_event(data, req.chat, result, text_parts):
                    if got_token:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                        got_token = True
                    last = now
        for data in decoder.close():
            _handle_event(data, req.chat, result, text_parts)
    if not got_token:
        raise _StreamError("no_tokens", "the stream ended without any token")
    result.latency = last - start
    result.generated_text = "".join(text_parts)


def _handle_event(data: str, chat: bool, result: RequestResult, text_parts: list[str]) -> bool:
    """Apply one SSE data payload to the result; True if it carried a token."""
    data = data.strip()
    if not data or data == "[DONE]":
        return False
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        raise _StreamError("bad_event", f"event is not JSON: {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise _StreamError("bad_event", f"event is not a JSON object: {data[:200]!r}")
    if event.get("error"):
        err = event["error"]
        raise _StreamError("error_event", f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
    if usage := event.get("usage"):
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            result.prompt_len = int(usage["prompt_tokens"])
    choices = event.get("choices")
    if not choices:
        return False
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        if "content" not in delta and not choice.get("finish_reason"):
            return False  # a role-only opening chunk: no token yet
        text_parts.append(delta.get("content") or "")
    else:
        text_parts.append(choice.get("text") or "")
    return True
