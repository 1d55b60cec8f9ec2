"""The FastAPI application: routes, API-key check, request-size limit, error handlers, and an
OpenAPI schema true to what the server sends (400s in OpenAI's error JSON, never FastAPI's 422)."""
import asyncio
import contextlib
import dataclasses
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from burstserve.engine import LLM
from burstserve.server.async_engine import AsyncEngine
from burstserve.server.chat import create_chat_completion
from burstserve.server.completions import create_completion
from burstserve.server.context import ServerContext
from burstserve.server.errors import ErrorResponse, error_response, install_handlers
from burstserve.server.fast_json import FastJSONRoute
from burstserve.server.metrics import Metrics
from burstserve.server.prompts import warn_if_default_chat_template
from burstserve.server.protocol import ChatCompletionRequest, CompletionRequest
from burstserve.server.stats_log import log_stats_while_busy
from burstserve.server.timeline import ReceiveClock

log = logging.getLogger(__name__)


class BodySizeLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before the app reads it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"the request body is larger than {self.limit} bytes")
        await response(scope, receive, send)


class ApiKeyCheck:
    """ASGI middleware: /v1/* needs 'Authorization: Bearer KEY' (a plain ASGI layer, so handlers
    still see the client's disconnect)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _errors(*statuses: int) -> dict:
    """The `responses` entry documenting OpenAI's error JSON for these statuses."""
    return {s: {"model": ErrorResponse, "description": "an error in OpenAI's JSON"} for s in statuses}


SSE_EVENT = {"type": "object", "required": ["data"], "description": "one server-sent event",   # per event (3.1)
             "properties": {"data": {"type": "string", "description": "a chunk or an error as JSON, or [DONE]"}}}
POST_RESPONSES = {
    200: {"description": "the completion as JSON, or with `stream: true` server-sent events of chunks "
                         "ending in `data: [DONE]`",
          "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}}},
    **_errors(400, 401, 404, 413, 429, 503)}
EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"


def build_app(llm: LLM, model_name: str, api_key: str | None = None, max_waiting: int = 256,
              max_body_bytes: int = 128 << 20, log_requests: bool = True, log_stats_interval: float = 10.0) -> FastAPI:
    metrics = Metrics(model_name)
    engine = AsyncEngine(llm, metrics, max_waiting, log_requests)
    ctx = ServerContext(llm, engine, model_name)
    warn_if_default_chat_template(llm.tokenizer, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.loop = asyncio.get_running_loop()   # for the SIGTERM handler (server/cli.py)
        stats = asyncio.create_task(log_stats_while_busy(engine, log_stats_interval)) if log_stats_interval > 0 else None
        yield
        if stats is not None:
            stats.cancel()
        log.info("shutting down the engine")
        llm.shutdown()

    app = FastAPI(title="burstserve", lifespan=lifespan)
    app.router.route_class = FastJSONRoute      # bodies parsed by pydantic-core (server/fast_json.py)
    app.state.ctx = ctx
    install_handlers(app)

    @app.get("/health", response_class=Response, responses={200: {"description": "serving (an empty body)"},
                                                            **_errors(503)})
    async def health():
        if engine.healthy:
            return Response(status_code=200)
        return error_response(503, f"the engine is not running: {llm.dead_reason.splitlines()[0]}")

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus exposition text", "content": {EXPOSITION: {"schema": {"type": "string"}}}}})
    async def prometheus():
        stats = dataclasses.replace(llm.stats, waiting=engine.waiting)   # the front's queue too
        return Response(metrics.render(stats), media_type=EXPOSITION)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "burstserve",
                "max_model_len": llm.max_model_len, "vocab_size": llm.model_config.vocab_size,
                "sp_strategy": llm.engine.sp_strategy, "overlap": llm.engine.overlap,
                "devices": llm.engine.devices, "kernel": llm.kernel}

    @app.get("/v1/models", responses=_errors(401))
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def model(model_id: str):
        ctx.check_model(model_id)
        return JSONResponse(model_card())

    @app.post("/v1/completions", responses=POST_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", responses=POST_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, req, raw)

    app.openapi = lambda: _openapi(app)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.add_middleware(BodySizeLimit, limit=max_body_bytes)
    app.add_middleware(ReceiveClock)     # the last added runs first: before the body is read
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422 responses (validation errors are OpenAI's 400s here)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema
