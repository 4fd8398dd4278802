"""The chat page at `/`: one self-contained HTML file (no CDN, no network fetch) that talks to
this server's own /v1/models and /v1/chat/completions (streamed), keeping the conversation in
the browser."""
from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

PAGE = "chat.html"


def page_html() -> str:
    return resources.files(__package__).joinpath("static", PAGE).read_text(encoding="utf-8")


async def chat_page(request: Request) -> HTMLResponse:
    return HTMLResponse(page_html())


def routes() -> list:
    """The page's routes, for create_app."""
    return [Route("/", chat_page, methods=["GET"])]


__all__ = ["routes", "page_html"]
