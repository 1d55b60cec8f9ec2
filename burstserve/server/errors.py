"""HTTP errors in OpenAI's JSON shape; every error a user can cause is raised as an APIError (or an
engine error) where it is found and turned into a response in one place (`install_handlers`).

The body is always `{"error": {"message", "type", "param", "code"}}` with OpenAI's string codes
(`model_not_found`, `invalid_api_key`, `context_length_exceeded`, ...) or a null code: clients
such as litellm map an error to its exception class by these strings."""
import functools

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from burstserve.engine.core.errors import BurstServeError, EngineDeadError, InvalidRequestError, PromptTooLongError

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "invalid_request_error", 500: "server_error", 503: "server_error"}
UNION_TAGS = {"system", "developer", "user", "assistant", "tool",   # the chat message roles
              "text", "json_object", "json_schema"}                  # the response_format types
DEFAULT_CODES = {401: "invalid_api_key", 405: "method_not_allowed", 413: "request_too_large",
                 429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body (documented in /openapi.json for every error status)."""
    error: ErrorDetail


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.code = code if code is not None else DEFAULT_CODES.get(status)


class ClientGone(Exception):
    """The client closed the connection before a non-streaming response was ready."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else DEFAULT_CODES.get(status)}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def api_error_response(err: APIError) -> JSONResponse:
    return error_response(err.status, err.message, err.param, err.headers, err.code)


def as_api_error(exc: Exception) -> APIError:
    """The HTTP status and message a user sees for an error raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "prompt", code="context_length_exceeded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {str(exc).splitlines()[0]}")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def body_error(request: Request, exc: RequestValidationError) -> APIError | None:
    """A complaint about the body as a whole as a 400 that says what to send: a body FastAPI did not read as
    JSON because its Content-Type does not say JSON (curl's `-d` sends a form's) names the header; JSON
    that is not an object says so. None for a complaint about a field."""
    errors = exc.errors()
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    kind = request.headers.get("content-type", "")
    if "json" not in kind.lower():
        return APIError(400, f"the request body must be JSON, sent with `Content-Type: application/json` "
                             f"(this request's Content-Type: {kind or 'none'})")
    return APIError(400, "the request body must be a JSON object of the request's fields")


UNKNOWN_FIELD = ("not a field this server takes: OpenAI's request fields and vLLM's top_k, ignore_eos, "
                 "stop_token_ids and return_tokens_as_token_ids are (GET /openapi.json lists them)")


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's complaint about the first bad field as a 400 naming it (OpenAI answers 400, not
    FastAPI's 422). A field of several types (`prompt`, `stop`, `content`) gets one complaint per
    type, each under the type's name: the field is their common location, and the complaint shown
    is the one that is not just a type mismatch, when there is one."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    same_field = [(e, loc) for e, loc in zip(errors, locs) if loc[:1] == locs[0][:1]]
    common = functools.reduce(_common_prefix, [loc for _, loc in same_field])
    chosen = next((e for e, _ in same_field if not str(e.get("type", "")).endswith("_type")), same_field[0][0])
    # a tagged union adds its tag after the index ("messages.0.user.content"): name the field as sent
    loc = [str(p) for i, p in enumerate(common) if not (i and isinstance(common[i - 1], int) and p in UNION_TAGS)]
    param = ".".join(loc) or None
    message = str(chosen.get("msg", "invalid request")).removeprefix("Value error, ")
    if chosen.get("type") == "extra_forbidden":
        message = UNKNOWN_FIELD
    return APIError(400, f"{param or 'body'}: {message}", param)


def _common_prefix(a: list, b: list) -> list:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return api_error_response(body_error(request, exc) or validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):   # unknown routes, wrong methods
        if exc.status_code == 404:
            return error_response(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"Method {request.method} is not allowed on {request.url.path}",
                                  headers=dict(exc.headers or {}))
        return error_response(exc.status_code, str(exc.detail))

    async def _known(request: Request, exc: Exception):
        return api_error_response(as_api_error(exc))

    async def _gone(request: Request, exc: Exception):   # nobody is listening; 499 as nginx logs it
        return JSONResponse({"error": None}, status_code=499)

    app.add_exception_handler(APIError, _known)
    app.add_exception_handler(BurstServeError, _known)
    app.add_exception_handler(ClientGone, _gone)
