"""GET /: the web page (`vit_serve/serve/static/index.html`), when it is installed."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

STATIC = Path(__file__).resolve().parent.parent / "static"
INDEX = STATIC / "index.html"

router = APIRouter()
log = logging.getLogger("vit_serve.serve")


@router.get("/", include_in_schema=False)
async def page() -> Response:
    if not INDEX.is_file():
        # No file path in the answer (it is open to anyone): the log says which file is missing.
        log.warning("GET /: the web page is not installed (%s is missing)", INDEX)
        return JSONResponse({"detail": "the web page is not installed with this gateway; the API is at /classify, "
                                       "/explain and /v2, documented at /docs"}, status_code=404)
    return FileResponse(INDEX, media_type="text/html")
