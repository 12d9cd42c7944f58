"""The FastAPI application: query API, HTTP ingest, health, OpenAPI at /openapi.json and /docs, and the web
dashboard at /ui/."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Dict, MutableMapping, Optional

from fastapi import Depends, FastAPI
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request

from .. import __version__, dashboard
from ..request_headers import framing_conflict
from ..storage.base import OutOfFiles
from . import openapi as openapi_errors
from . import preflight
from .deps import Services
from .project_slots import ReleaseProjectSlot
from .routes import clusters, gate, health, incidents, runs, search, stream, workflow


def create_app(services: Services, ingest_router: Optional[object] = None) -> FastAPI:
    """Build the app around ``services``; ``ingest_router`` adds ``POST /v1/ingest``."""
    app = FastAPI(title="TrainGuard", version=__version__,
                  description="Capture, classify and root-cause anomalies in PyTorch training jobs.",
                  dependencies=[Depends(preflight.preflight)], docs_url=None, redoc_url=None)
    app.add_route("/docs", _swagger_ui, include_in_schema=False)  # FastAPI's own would load it from a CDN
    app.add_middleware(ReleaseProjectSlot)
    app.add_middleware(RefuseAmbiguousFraming)  # added last: the outermost
    app.state.services = services

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # one readable sentence instead of pydantic's nested list: "query.max_points: ..."
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            if err.get("type") == "json_invalid":  # "body.5: JSON decode error" said neither what nor where
                where = f"body: malformed JSON at char {where.rpartition('.')[2]}"
                parts.append(f"{where}: {(err.get('ctx') or {}).get('error', 'cannot decode')}")
                continue
            parts.append(f"{where}: {err.get('msg')}")
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Any:
        # FastAPI's one sentence for every body it could not decode but JSON syntax: say what it was
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            return JSONResponse({"detail": _body_error(exc.__cause__)}, status_code=400)
        return await http_exception_handler(request, exc)

    @app.exception_handler(OutOfFiles)
    async def _out_of_files(_: Request, exc: OutOfFiles) -> JSONResponse:
        # a new thread's store connection during a burst of connections: retryable, not a 500 (H46)
        detail = f"the server cannot open its stores now: {exc.reason}; retry after 1 s"
        return JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": "1"})

    for module in (health, runs, stream, incidents, workflow, clusters, search, gate):
        app.include_router(module.router)
    if ingest_router is not None:
        app.include_router(ingest_router)  # type: ignore[arg-type]
    _document_checks(app)
    dashboard.mount(app)
    return app


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RefuseAmbiguousFraming:
    """ASGI middleware in front of every route (query API, dashboard, docs, ingest): a request with both
    ``Content-Length`` and ``Transfer-Encoding`` is answered 400 naming both, with ``Connection: close``,
    before any route reads it (uvicorn would read it as chunked; a proxy framing it by ``Content-Length``
    would see the rest as another request). The rule is :func:`~..request_headers.framing_conflict`, which
    the ingest route applies too."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = encoding = None
            for key, value in scope["headers"]:
                if key == b"content-length" and length is None:
                    length = value.decode("latin-1")
                elif key == b"transfer-encoding" and encoding is None:
                    encoding = value.decode("latin-1")
            conflict = framing_conflict(length, encoding)
            if conflict is not None:
                await JSONResponse({"detail": conflict}, status_code=400,
                                   headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _body_error(cause: Optional[BaseException]) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not valid UTF-8 ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "body: JSON nested too deeply to decode (the API's bodies nest a few levels)"
    return f"body: cannot be decoded ({type(cause).__name__}: {cause})" if cause else "body: cannot be read"


async def _swagger_ui(_: Request) -> HTMLResponse:
    """``/docs``: Swagger UI from the assets this process serves (tools/fetch_assets.py puts them beside the
    dashboard's; the server wheel ships them), so it renders on a machine without internet access."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title="TrainGuard API",
                               swagger_js_url="/ui/static/vendor/swagger-ui-bundle.js",
                               swagger_css_url="/ui/static/vendor/swagger-ui.css", swagger_favicon_url="")


def _document_checks(app: FastAPI) -> None:
    """Serve an OpenAPI that states what the app enforces beyond the routes' own declarations."""
    plain = app.openapi

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain()
            preflight.int64_bounds(schema)
            openapi_errors.document_errors(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
