"""`stepgraph serve --api-key`: ``RequireKey``, the ASGI layer that answers 401 to a ``/v1/``
request without ``Authorization: Bearer KEY`` (compared in constant time; ``/health`` and
``/metrics`` stay open, as in vLLM), and ``exposure_warning``: the line the server prints when
it listens beyond this machine with no key (pure; CPU-tested)."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from starlette.responses import JSONResponse

from .. import env
from .errors import Unauthorized, error_body

KEY_ENV = env.API_KEY
GUARDED = "/v1"  # the OpenAI API; /health and /metrics are for probes and scrapers


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (the scheme in any case)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def guarded(path: str) -> bool:
    return path == GUARDED or path.startswith(GUARDED + "/")


class RequireKey:
    """ASGI middleware: ``/v1`` and below need ``Authorization: Bearer <key>``, else a 401 with
    OpenAI's error object; every other path, and the lifespan, pass through untouched."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and guarded(scope["path"]):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not bearer_matches(auth, self.key):
                err = Unauthorized(
                    "missing or incorrect API key: send the server's key as the header "
                    "'Authorization: Bearer <key>' (the OpenAI client's api_key)."
                )
                answer = JSONResponse(
                    error_body(err), status_code=err.status, headers={"WWW-Authenticate": "Bearer"}
                )
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(address: str) -> bool:
    """Whether a bound address (``getsockname()[0]``) is reached from this machine only."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def exposure_warning(address: str, api_key: str | None) -> str | None:
    """The one-line warning for a server bound to ``address`` with no key, or None (a key, or
    an address of this machine only)."""
    if api_key or is_loopback(address):
        return None
    return (
        f"warning: listening on {address}, beyond this machine, with no API key: anyone who "
        f"reaches it can use the model; pass --api-key KEY (or set {KEY_ENV})"
    )


__all__ = ["KEY_ENV", "RequireKey", "bearer_matches", "exposure_warning", "is_loopback"]
