"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, for
every failure the server answers: our own `APIError`s, FastAPI's request validation (400,
never FastAPI's raw 422 list), unknown routes and methods (404, 405) and crashes (500)."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.entrypoints.openai.request_fields import extra_field_message

logger = logging.getLogger("kvpilot.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body (OpenAI API reference, "Error codes"; vLLM's
    ErrorInfo): message, type (e.g. invalid_request_error), the offending param, and code
    (an OpenAI code string such as invalid_api_key, else the HTTP status)."""
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body, `{"error": {...}}` (vLLM's ErrorResponse)."""
    error: ErrorInfo


class ErrorJSONResponse(JSONResponse):
    """An error body as ASCII JSON: a message may quote what the client sent (a model name),
    and text from JSON may hold lone surrogates (`"\\ud800"`), which UTF-8 cannot encode."""

    def render(self, content: object) -> bytes:
        """The content as compact ASCII JSON bytes (non-ASCII and surrogates as \\u escapes)."""
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client. `headers` go on the response (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """This error as an OpenAI error body."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> ErrorResponse:
    """The OpenAI error body for an HTTP status: type from the status (invalid_request_error for
    one not listed), code the given one or else the status."""
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"),
                                         param=param, code=code if code is not None else status))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An ErrorJSONResponse with the OpenAI error body, the status and the given headers."""
    return ErrorJSONResponse(error_body(status, message, param, code).model_dump(), status_code=status,
                             headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 invalid_request_error APIError, naming the offending field in param."""
    return APIError(400, message, param=param)


_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")  # API fields are snake_case


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's error list, and the first offending field."""
    parts, param = [], None
    for err in errors[:5]:
        # pydantic names a union's member by its class (TokenizeCompletionRequest): not a field
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _CLASS_NAME.fullmatch(str(x))]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        field = ".".join(loc)
        bound = _bound_text(err)
        if err.get("type") == "missing":
            parts.append(f"missing required field '{field}'")
        elif err.get("type") == "extra_forbidden" and loc:
            parts.append(extra_field_message(loc[-1], err.get("input")) + (f" (at {field})" if len(loc) > 1 else ""))
        elif bound and field:
            parts.append(f"{field} must be {bound}, got {_shown(err.get('input'))}")
        elif field:
            parts.append(f"'{field}': {err.get('msg')}")
        else:
            parts.append(str(err.get("msg")))
        param = param or (loc[0] if loc else None)
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more")
    return "invalid request: " + "; ".join(parts), param


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}


def _bound_text(err: dict) -> str | None:
    """'>= 1', '<= 9223372036854775807', 'a finite number' for pydantic's bound errors."""
    kind = err.get("type")
    if kind == "finite_number":
        return "a finite number"
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"{sign} {err.get('ctx', {}).get(key)}"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Makes every failure of app an OpenAI error body: APIError as raised, request validation as
    400 (describe_validation_errors), Starlette's 404 and 405 naming the route, and any other
    exception as 500 (logged with its traceback)."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return ErrorJSONResponse(exc.body().model_dump(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
