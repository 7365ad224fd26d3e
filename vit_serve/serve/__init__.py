"""The serving gateway (FastAPI): `create_app(settings)`, `ServeSettings`; run it with `vit-serve serve REPO`.

Layout: settings (ServeSettings), app (factory + lifespan), gateway (the running parts), discovery (what a
repository holds), repository (the loaded versions: model control, polling, load / unload), model_version (one
loaded version), runner (batching or direct), inference (the Task), images (decode / overlay), uploads, store
(recent images), security (API keys), v2_protocol (KServe v2 wire format), metrics, middleware, errors, schemas,
deps; routes/ (classify, explain, health, metrics, models, v2, repository, page); backends/ (base, torch,
onnxruntime, tensorrt, triton, sidecar).
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
