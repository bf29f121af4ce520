"""The web page: static files shipped in the package, served at /ui/ (and / sends you there).
The page carries no data of its own, so it needs no key; every call it makes to /v1 does."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
# The page runs its own scripts only and talks to its own origin only.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def home() -> RedirectResponse:
    return RedirectResponse("/ui/")


class PageFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"  # revalidated (ETag), so an upgrade shows at once
        return response


def page_files() -> PageFiles:
    return PageFiles(directory=UI_DIR, html=True)
