"""The HTTP front end: each protocol's routes in front of one shared request path.

    POST /v1/completions, POST /v1/chat/completions   OpenAI (labkit.serve.openai_routes)
    GET  /v1/models, /v1/models/{id}                  OpenAI
    GET  /health, /metrics

A route is an adapter: it parses its protocol's request, turns it into one `EngineWork`,
and answers in its protocol's format, errors included. What every protocol shares lives in
`labkit.serve.request_path`: a request is read with a size limit, checked against the
engine's limits and admission control before anything is submitted, so a bad request costs
no engine work and gets a 4xx; a client that goes away, streaming or not, has its requests
aborted at once, and the engine frees their KV blocks in its next step.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from labkit.serve.access import install_request_ids
from labkit.serve.anthropic_wire import ANTHROPIC_ERRORS
from labkit.serve.engine_client import EngineClient
from labkit.serve.errors import install_error_handlers, register_error_shape
from labkit.serve.openai_routes import openai_router
from labkit.serve.openapi_schema import install_openapi
from labkit.serve.request_path import RequestPath
from labkit.serve.settings import ServeSettings, cache_scope, tenant_of

__all__ = ["ServeSettings", "build_app", "cache_scope", "tenant_of"]


def build_app(client: EngineClient, tokenizer, settings: ServeSettings) -> FastAPI:
    path = RequestPath(client, tokenizer, settings)
    app = FastAPI(title="labkit", lifespan=path.lifespan)
    app.state.client, app.state.metrics, app.state.settings = client, path.metrics, settings
    app.state.admission, app.state.drain, app.state.request_path = path.admission, path.drain, path
    install_error_handlers(app)
    register_error_shape(app, "/v1/messages", ANTHROPIC_ERRORS)  # Anthropic's routes answer in its shape
    install_request_ids(app, settings.log_prompts)
    install_openapi(app)

    @app.get("/health")
    async def health():
        state = client.health()
        status = ("draining" if path.draining.is_set() else "ok" if client.ready else
                  "failed" if state.get("state") == "failed" else "starting")
        return JSONResponse({"status": status, **state}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(path.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_router(path))
    return app
