"""The chat page at `/`: one self-contained HTML file (no CDN, no network fetch) that talks to
this server's own /v1/models and /v1/chat/completions (streamed), keeping the conversation in
the browser. It is served with a Content-Security-Policy that lets the browser run only the
page's own script and style (by their hashes) and connect only to this server: text an answer
smuggles in as HTML could neither run nor call out."""
from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

PAGE = "chat.html"


@functools.cache
def page_html() -> str:
    return resources.files(__package__).joinpath("static", PAGE).read_text(encoding="utf-8")


def _hashes(html: str, tag: str) -> str:
    """The CSP sources of the page's inline <tag> elements: their sha256 hashes."""
    bodies = re.findall(rf"<{tag}\b[^>]*>(.*?)</{tag}>", html, re.S)
    return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'"
                    for b in bodies)


@functools.cache
def content_security_policy() -> str:
    html = page_html()
    return (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


async def chat_page(request: Request) -> HTMLResponse:
    return HTMLResponse(page_html(), headers={"Content-Security-Policy": content_security_policy(),
                                              "X-Content-Type-Options": "nosniff"})


def routes() -> list:
    """The page's routes, for create_app."""
    return [Route("/", chat_page, methods=["GET"])]


__all__ = ["routes", "page_html", "content_security_policy"]
