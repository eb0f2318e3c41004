"""Who may call the API: an optional API key and CORS for browsers (docs/server.md, "Access").

The key is checked before anything else runs, routing included (an unknown route without the
key is a 401, not a 404 that maps the API for a stranger), on every path but /health, which a
load balancer's probe must reach without one. CORS is off unless origins are given: a browser
page on another origin then gets no answer it may read. When on, Starlette's CORSMiddleware
runs outermost, so a preflight (which carries no key, by the standard) is answered before the
key is asked for, and a 401 still carries the headers that let the page read why.
"""
from __future__ import annotations

import hmac
import re

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from .protocol import ApiError

OPEN_PATHS = frozenset({"/health"})
# an origin as a browser sends it: scheme://host[:port], no path (a trailing "/" never matches)
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")
_KEY = re.compile(r"[\x21-\x7e]+")  # what a Bearer header carries intact: no spaces, ASCII


def check_api_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError("api_key: must be printable ASCII without spaces (it travels in an "
                         "HTTP header as 'Authorization: Bearer KEY')")
    return key


def check_origins(origins) -> tuple:
    origins = (origins,) if isinstance(origins, str) else tuple(origins or ())
    for o in origins:
        if not isinstance(o, str) or not (o == "*" or _ORIGIN.fullmatch(o)):
            raise ValueError(f"cors origin {o!r}: must be '*' or scheme://host[:port] as a "
                             "browser sends it (no path, no trailing '/')")
    return origins


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class ApiKeyMiddleware:
    """401 in OpenAI's shape for a request without `Authorization: Bearer KEY` (pure ASGI: a
    BaseHTTPMiddleware would buffer the streams it passes through)."""

    def __init__(self, app, key: str):
        self.app = app
        self._key = check_api_key(key).encode("ascii")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _bearer(Headers(scope=scope).get("authorization"))
        # constant time: how much of a guess matched must not show in how long a 401 takes
        if given is not None and hmac.compare_digest(given.encode("utf-8", "replace"), self._key):
            return await self.app(scope, receive, send)
        msg = ("this server needs an API key: send it as 'Authorization: Bearer KEY'"
               if given is None else "the API key given is not this server's")
        err = ApiError(401, msg, type="invalid_request_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS, its refused preflight answered with an OpenAI error object as every
    other error is (its own is plain text)."""

    def __init__(self, app, origins):
        # every request header allowed: the openai JS client sends its own x-stainless-* ones
        super().__init__(app, allow_origins=check_origins(origins), allow_methods=("GET", "POST"),
                         allow_headers=("*",))

    def preflight_response(self, request_headers):
        r = super().preflight_response(request_headers)
        if r.status_code == 200:
            return r
        keep = {k: v for k, v in r.headers.items()
                if k.lower() not in ("content-length", "content-type")}
        return ApiError(r.status_code, f"CORS preflight refused: {r.body.decode()}",
                        code="cors_refused", headers=keep).response()


def add_access(app, api_key: str | None, cors_origins) -> None:
    """The key's check, then CORS around it (Starlette: the middleware added last runs first)."""
    if api_key:
        app.add_middleware(ApiKeyMiddleware, key=api_key)
    if cors_origins:
        app.add_middleware(Cors, origins=cors_origins)
