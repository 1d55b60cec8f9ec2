"""HTTP errors in OpenAI's JSON shape; every error a user can cause is raised as an APIError (or an
engine error) where it is found and turned into a response in one place (`install_handlers`)."""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engine.errors import BurstServeError, EngineDeadError, InvalidRequestError, PromptTooLongError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


class ClientGone(Exception):
    """The client closed the connection before a non-streaming response was ready."""


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def as_api_error(exc: Exception) -> APIError:
    """The HTTP status and message a user sees for an error raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (InvalidRequestError,)):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), "prompt")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {str(exc).splitlines()[0]}")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", None)
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    async def _known(request: Request, exc: Exception):
        err = as_api_error(exc)
        return error_response(err.status, err.message, err.param, err.headers)

    async def _gone(request: Request, exc: Exception):   # nobody is listening; 499 as nginx logs it
        return JSONResponse({"error": None}, status_code=499)

    app.add_exception_handler(APIError, _known)
    app.add_exception_handler(BurstServeError, _known)
    app.add_exception_handler(ClientGone, _gone)
