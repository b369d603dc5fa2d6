"""The HTTP application of ``strata serve``: routes, API-key check, body limits, error bodies.

Every error, whatever raised it, is answered with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. Request bodies are read here, not by
FastAPI, so that size, encoding, JSON and schema errors each get their own clear 4xx.
"""

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from strata.launch.async_engine import AsyncEngine
from strata.launch.server.metrics import ServerMetrics
from strata.launch.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from strata.launch.server.completions import ChatCompletions, Completions
from strata.launch.server.models import ServedModels
from strata.launch.server.reasoning_parsers import reasoning_format
from strata.launch.server.responses import Responses
from strata.launch.server.responses_protocol import ResponsesRequest
from strata.launch.server.streams import json_response
from strata.launch.server.tokenization import Tokenization
from strata.launch.server.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
PREFIX_CACHE_ISOLATION = ("none", "per-api-key")
_MAX_REPORTED_ERRORS = 5  # a hostile body can fail validation thousands of times over
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; it never reaches anyone

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class AppOptions:
    """What the application needs besides the engine. ``served_model_name=None``: see
    ``default_model_name``. ``api_keys``: any of them opens ``/v1`` (none: it is open).
    ``prefix_cache_isolation="per-api-key"`` salts every request's prefix cache with its key.
    ``tool_call_parser``: how chat outputs are read for tool calls under ``tool_choice: auto``.
    ``reasoning_parser``: how chat and Responses outputs are split into reasoning and answer
    (None: no reasoning is split off)."""

    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enable_debug_endpoints: bool = False
    prefix_cache_isolation: str = "none"
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if any(key == "" for key in self.api_keys):
            raise ValueError("api_key must not be empty")
        if self.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
            raise ValueError(
                f"prefix_cache_isolation must be one of {', '.join(PREFIX_CACHE_ISOLATION)}, "
                f"got {self.prefix_cache_isolation!r}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        reasoning_format(self.reasoning_parser)  # raises ValueError naming the choices


def build_app(engine: AsyncEngine, options: AppOptions) -> FastAPI:
    """The FastAPI application serving ``engine``. ``/health`` and ``/metrics`` stay open;
    ``/v1`` and ``/tokenize``, ``/detokenize`` beside it need the API key when one is set."""
    app = FastAPI(title="strata", docs_url=None, redoc_url=None, openapi_url=None)
    model_name = options.served_model_name or default_model_name(engine)
    metrics = ServerMetrics(engine.replica_stats, engine.args.max_loras if engine.args.lora_enabled else 0)
    completions = Completions(engine, model_name, metrics)
    chat = ChatCompletions(engine, model_name, metrics, options.tool_call_parser, options.reasoning_parser)
    responses = Responses(chat)
    tokenization = Tokenization(engine, model_name, options.tool_call_parser)
    models = ServedModels(engine, model_name)

    def require_api_key(request: Request) -> None:
        if not options.api_keys:
            return
        token = _bearer_token(request).encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(token, key.encode()) for key in options.api_keys]
        if not any(matches):
            raise APIError(401, "missing or incorrect API key", "authentication_error", code="invalid_api_key")

    def tenant_salt(request: Request) -> str | None:
        if options.prefix_cache_isolation != "per-api-key":
            return None
        # A digest, not the key: the salt travels to the EngineCore and into its state.
        return "api-key:" + hashlib.sha256(_bearer_token(request).encode()).hexdigest()

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.post("/completions")
    async def create_completion(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, options.max_request_bytes)
        return await completions.handle(body, request, tenant_salt(request))

    @v1.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, options.max_request_bytes)
        return await chat.handle(body, request, tenant_salt(request))

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        body = await read_body(request, ResponsesRequest, options.max_request_bytes)
        return await responses.handle(body, request, tenant_salt(request))

    @v1.get("/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=models.cards()))

    @v1.get("/models/{model}")
    async def retrieve_model(model: str) -> Response:
        return json_response(models.card(model))

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await read_body(request, LoadLoRAAdapterRequest, options.max_request_bytes)
        return PlainTextResponse(await models.load(body))

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await read_body(request, UnloadLoRAAdapterRequest, options.max_request_bytes)
        return PlainTextResponse(models.unload(body))

    app.include_router(v1)

    # Beside /v1, where vLLM serves them.
    tokens = APIRouter(dependencies=[Depends(require_api_key)])

    @tokens.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        text = await read_text(request, options.max_request_bytes)
        form = TokenizeChatRequest if _names_field(text, "messages") else TokenizeCompletionRequest
        return json_response(await engine.off_loop(tokenization.tokenize, parse_body(text, form)))

    @tokens.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_body(request, DetokenizeRequest, options.max_request_bytes)
        return json_response(await engine.off_loop(tokenization.detokenize, body))

    app.include_router(tokens)

    @app.get("/health")
    async def health() -> Response:
        try:
            replicas = await engine.check_health()
        except (RuntimeError, TimeoutError) as error:  # EngineDeadError is a RuntimeError
            raise APIError.unavailable(str(error) or type(error).__name__) from None
        if len(replicas) == 1:
            return JSONResponse({"status": "ok"})
        # Still 200 while any replica serves, so load balancers keep sending traffic.
        degraded = any(state != "ok" for state in replicas.values())
        return JSONResponse({"status": "degraded" if degraded else "ok", "replicas": {str(r): s for r, s in replicas.items()}})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if options.enable_debug_endpoints:

        @app.get("/debug/state")
        async def debug_state() -> Response:
            """The EngineCore's scheduler state (for tests and debugging; off by default)."""
            return JSONResponse(await engine.debug_state())

    _add_error_handlers(app)
    return app


def default_model_name(engine: AsyncEngine) -> str:
    """The name clients use for the model unless told otherwise: ``--model``'s directory
    name or GGUF file stem; for the default model, its GGUF file's stem."""
    if engine.args.model is not None:
        path = Path(engine.args.model)
        return path.stem if path.suffix == ".gguf" else path.name
    # The default model is a GGUF converted into a cache directory named "<stem>-<hash>".
    return engine.config.model_path.name.rsplit("-", 1)[0]


async def read_body(request: Request, model: type[ModelT], limit: int) -> ModelT:
    """Parse the body as ``model``: 413 over ``limit`` bytes (refused from Content-Length
    before reading when the client sends one), 400 for invalid UTF-8, JSON or fields."""
    return parse_body(await read_text(request, limit), model)


async def read_text(request: Request, limit: int) -> str:
    """The body as text: 413 over ``limit`` bytes, 400 if it is not UTF-8."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the body is not valid UTF-8: {error}") from None


def parse_body(text: str, model: type[ModelT]) -> ModelT:
    """``text`` as ``model``: 400 for invalid JSON or fields."""
    try:
        return model.model_validate_json(text)
    except ValidationError as error:
        raise _invalid(error) from None


def _names_field(text: str, field: str) -> bool:
    """Whether ``text`` is a JSON object with ``field`` (invalid JSON: no; parsing it reports that)."""
    try:
        body = from_json(text)
    except ValueError:
        return False
    return isinstance(body, dict) and field in body


def _invalid(error: ValidationError) -> APIError:
    problems = error.errors(include_url=False, include_input=False, include_context=False)
    if problems[0]["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {problems[0]['msg']}")
    described = [
        f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}" for problem in problems[:_MAX_REPORTED_ERRORS]
    ]
    if len(problems) > _MAX_REPORTED_ERRORS:
        described.append(f"and {len(problems) - _MAX_REPORTED_ERRORS} more")
    first_field = problems[0]["loc"][0] if problems[0]["loc"] else None
    return APIError(400, "; ".join(described), param=None if first_field is None else str(first_field))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        # The access line gives only the status; the reason goes to the log beside it.
        info = error.body.error
        logger.info("%s %s refused with %d (%s): %s", request.method, request.url.path, error.status, info.type, info.message)
        return json_response(error.body, error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        # Starlette's own errors: unknown path (404), wrong method (405).
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return json_response(ErrorResponse(error=ErrorInfo(message=str(error.detail), type=kind)), error.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        logger.exception("internal error serving %s %s", request.method, request.url.path)
        body = ErrorResponse(error=ErrorInfo(message=f"internal error: {error!r}", type="server_error"))
        return json_response(body, 500)


def _bearer_token(request: Request) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header ("" without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
