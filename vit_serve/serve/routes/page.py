"""GET /: the web page (`vit_serve/serve/static/index.html`), when it is installed."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

STATIC = Path(__file__).resolve().parent.parent / "static"
INDEX = STATIC / "index.html"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> Response:
    if not INDEX.is_file():
        return JSONResponse({"detail": f"the web page is not installed here ({INDEX} is missing); the API is at "
                                       f"/classify, /explain and /v2, documented at /docs"}, status_code=404)
    return FileResponse(INDEX, media_type="text/html")
