"""The serving gateway (FastAPI, gRPC) over `vit_serve.runtime`: `create_app(settings)`, `ServeSettings`; run it
with `vit-serve serve REPO`.

Layout: settings (ServeSettings and its groups: limits, triton, repository, security, explain_store), setting_scopes
(each setting's scope: the server's own, or a model default), app (factory +
lifespan), gateway (the running parts), repository (the loaded versions: model control, polling, load / unload),
model_version (one loaded version), runner (batching or direct), uploads, keys and security (API keys), caller
(whose upload is whose), stores/ (recent images for GET /explain: memory, redis, the store secret), errors (runtime
errors -> HTTP statuses and gRPC codes in one table, and the one /v2 error envelope), v2_protocol (the KServe v2 wire
format) and v2_model (what HTTP /v2 and gRPC share), grpc, metrics, middleware, tracing, schemas, deps; routes/
(classify, embed, explain and what they share, image_request; health, metrics, models, page; v2: all of /v2 as one
router group, the repository extension included). Backends, discovery, decode and postprocessing are the
runtime's (`vit_serve.runtime`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeSettings", "create_app"]


def __getattr__(name: str) -> Any:  # lazy: backends import this package without needing FastAPI loaded
    if name == "create_app":
        from vit_serve.serve.app import create_app

        return create_app
    if name == "ServeSettings":
        from vit_serve.serve.settings import ServeSettings

        return ServeSettings
    raise AttributeError(name)
