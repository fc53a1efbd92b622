"""``GET /playground``: a static page to try the routes from a browser.

The page holds no secret (it asks for an API key and keeps it in the tab), so the path is
public. Its inline script and style are pinned by hash in a strict Content-Security-Policy:
the page may talk to this origin only, and load nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response


def _hashes(html: str, tag: str) -> str:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
    return " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'" for b in bodies
    )


@cache
def _page() -> tuple[bytes, dict[str, str]]:
    html = files("gateway").joinpath("playground.html").read_text(encoding="utf-8")
    csp = (
        f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }
    return html.encode(), headers


async def playground(request: Request) -> Response:
    body, headers = _page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
