"""The web dashboard, served by the same process as the query API (no separate front-end server).

``/ui/`` is a single page (``static/index.html`` + ``static/app.js``; ``static/ranks.js``: the per-rank step
time views) that reads everything from the query API with the read token the user enters once (kept in the
browser's localStorage). Charts are ECharts,
served from ``static/vendor/`` (fetched from the npm registry at install time by tools/fetch_assets.py;
nothing is loaded from a CDN at run time).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("trainguard.dashboard")


def mount(app: FastAPI) -> None:
    """Serve the dashboard at ``/ui/`` (and redirect ``/`` there)."""
    if not (STATIC / "vendor" / "echarts.min.js").is_file():
        log.warning("dashboard: %s/vendor/echarts.min.js is missing (python tools/fetch_assets.py): pages "
                    "load, charts do not", STATIC)

    @app.get("/", include_in_schema=False)
    def _root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui/", include_in_schema=False)
    def _index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/ui/static", StaticFiles(directory=STATIC), name="dashboard-static")
