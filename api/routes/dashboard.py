"""The web dashboard: `/` serves the single page, `/static/...` its assets (plain ES modules, no build step).

The files are package data (`api/static/`), found next to this package, so an installed wheel serves them
too. The page holds no secret: it asks for an API key and keeps it in the browser session only, and talks
to the same `/v1` API as every other client.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# Everything the page loads comes from this origin; no inline script or style, nothing framed.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-cache",  # a new release's page (and so its asset list) is picked up at once
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def install(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)
