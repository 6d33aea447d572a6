"""The FastAPI application: OpenAI routes, health, version, metrics, and, only with
--enable-admin-routes, the scheduler admin route the tuner uses and (when
VLLM_TORCH_PROFILER_DIR is set) the profiler routes.

/v1/*, /tokenize and /detokenize need `Authorization: Bearer <API key>` when a key is set. The
control routes (/admin/*, /start_profile, /stop_profile) always need `Bearer <$KVPILOT_ADMIN_TOKEN>`, a token
of their own (the public API key does not open them); without --enable-admin-routes they do
not exist (404). /health, /version and /metrics never need a token (probes and Prometheus)."""

from __future__ import annotations

import dataclasses
import hmac
import json
from importlib.metadata import PackageNotFoundError, version

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.entrypoints.errors import APIError, bad_request, error_body, install_error_handlers
from kvpilot.engine.entrypoints.http_metrics import instrument_http
from kvpilot.engine.metrics.engine_metrics import CONTENT_TYPE
from kvpilot.engine.entrypoints.openapi_doc import exact_integer_bounds
from kvpilot.engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SchedulerConfigUpdate,
)
from kvpilot.engine.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvpilot.engine.entrypoints.openai.serving import ServerState
from kvpilot.engine.entrypoints.openai.serving_chat import OpenAIServingChat
from kvpilot.engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvpilot.engine.entrypoints.openai.serving_tokenization import TOKENIZE_PATHS, OpenAIServingTokenization

API_PREFIXES = ("/v1/", *TOKENIZE_PATHS)
CONTROL_PREFIXES = ("/admin/", "/start_profile", "/stop_profile")


def package_version() -> str:
    """The installed kvpilot distribution's version (GET /version, the OpenAPI title), or "unknown"
    when it is not installed (a bare source tree)."""
    try:
        return version("kvpilot")
    except PackageNotFoundError:
        return "unknown"


class BearerTokenMiddleware:
    """Answers 401 before anything else (even before the body is parsed) when a route under
    one of `prefixes` comes without `Authorization: Bearer <token>` (compared in constant time)."""

    def __init__(self, app, token: str, prefixes: tuple[str, ...], what: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.prefixes = prefixes
        self.what = what

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(self.prefixes):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = f"invalid {self.what}" if given else f"missing {self.what}: send 'Authorization: Bearer <key>'"
                code = "invalid_" + self.what.lower().replace(" ", "_")  # invalid_api_key, invalid_admin_token
                body = json.dumps(error_body(401, message, code=code).model_dump()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def scheduler_config_dict(config: SchedulerConfig) -> dict:
    """The scheduler's limits as the JSON answer of /admin/scheduler_config (field: value)."""
    return dataclasses.asdict(config)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over state: OpenAI errors, bearer-token middlewares when a key or admin
    token is set, HTTP metrics, /health (503 while loading, draining or after an engine failure),
    /version, /metrics, the OpenAI and tokenizer routes, and the control routes with an admin token."""
    app = FastAPI(title="kvpilot", version=package_version(), docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    if state.api_key:
        app.add_middleware(BearerTokenMiddleware, token=state.api_key, prefixes=API_PREFIXES, what="API key")
    if state.admin_token:
        app.add_middleware(BearerTokenMiddleware, token=state.admin_token, prefixes=CONTROL_PREFIXES,
                           what="admin token")
    instrument_http(app, state.metrics_registry)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse(error_body(503, "draining").model_dump(), status_code=503)
        if state.engine is None:
            return JSONResponse(error_body(503, "loading the model").model_dump(), status_code=503)
        if not state.engine.is_running:
            return JSONResponse(error_body(503, f"engine failed: {state.engine.errored}").model_dump(),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": package_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        """The server's registry (HTTP and process metrics from the start, the engine's
        once it has loaded) in the classic text format."""
        body = prometheus_client.generate_latest(state.metrics_registry)
        return Response(body, media_type=None, headers={"Content-Type": CONTENT_TYPE})

    add_openai_routes(app, state)
    if state.admin_token:
        add_control_routes(app, state)
    generate_openapi = app.openapi

    def openapi() -> dict:  # the request models' bounds exactly (seed's int64 maximum)
        if app.openapi_schema is None:
            exact_integer_bounds(generate_openapi(), [ChatCompletionRequest, CompletionRequest, DetokenizeRequest])
        return app.openapi_schema

    app.openapi = openapi
    return app


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) and its
    /tokenize, /detokenize, behind the API key when one is set."""

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=state.model_path, max_model_len=state.max_model_len)
                 for name in sorted(state.model_names())]
        return ModelList(data=cards).model_dump()

    serving_completion = OpenAIServingCompletion(state)
    serving_chat = OpenAIServingChat(state)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving_completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving_chat.create_chat_completion(req, raw)

    serving_tokenization = OpenAIServingTokenization(state)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        return serving_tokenization.tokenize(req).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        return serving_tokenization.detokenize(req).model_dump()


def add_control_routes(app: FastAPI, state: ServerState) -> None:
    """The routes that change the running server; only called with an admin token set."""

    @app.get("/admin/scheduler_config")
    async def get_scheduler_config() -> dict:
        engine = state.ready_engine()
        return scheduler_config_dict(await engine.run_on_engine(lambda e: e.scheduler.config))

    @app.post("/admin/scheduler_config")
    async def set_scheduler_config(update: SchedulerConfigUpdate) -> dict:
        """Live change of max_num_seqs, max_num_batched_tokens, enable_chunked_prefill and
        preemption_mode, applied on the engine thread between steps; 400 when invalid."""
        engine = state.ready_engine()
        changes = update.model_dump(exclude_none=True)
        if not changes:
            raise bad_request(f"nothing to change; send any of {sorted(SchedulerConfigUpdate.model_fields)}")
        try:
            return scheduler_config_dict(await engine.update_scheduler_config(**changes))
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    if state.profiler_dir:
        @app.post("/start_profile")
        async def start_profile() -> Response:
            try:
                await state.ready_engine().start_profile(state.profiler_dir)
            except ValueError as exc:
                raise APIError(409, str(exc)) from None
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            try:
                await state.ready_engine().stop_profile()
            except ValueError as exc:
                raise APIError(409, str(exc)) from None
            return Response(status_code=200)
