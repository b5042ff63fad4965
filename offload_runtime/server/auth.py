"""API keys, as vLLM's and llama-server's `--api-key`: a request to a guarded route (every `/v1`
route, and `/metrics` when asked) must carry `Authorization: Bearer KEY` with one of the keys, or is
answered 401 in OpenAI's error shape. Starlette's `AuthenticationMiddleware` runs the check before
the route, so a stranger's body is never read; `/health` stays open for load balancers."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse

from offload_runtime.server import schemas


class APIKeys(AuthenticationBackend):
    """Checks the bearer token of requests whose path is, or is under, one of `guarded`."""

    def __init__(self, keys: Sequence[str], guarded: Sequence[str]) -> None:
        if not keys or not all(keys):
            raise ValueError("API keys must be non-empty strings")
        self.keys = [key.encode() for key in keys]
        self.guarded = tuple(guarded)

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        path = conn.scope["path"].removeprefix(conn.scope.get("root_path", ""))  # as routed, when mounted
        if not any(path == route or path.startswith(route + "/") for route in self.guarded):
            return None
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("no API key given; send it as the header `Authorization: Bearer KEY`")
        given = token.strip().encode("latin-1")  # the header's bytes, as the client sent them
        # compare with every key (no early exit), each in constant time
        if not any([secrets.compare_digest(given, key) for key in self.keys]):
            raise AuthenticationError("incorrect API key provided")
        return AuthCredentials(["api_key"]), SimpleUser("api_key")


def unauthorized(_conn: HTTPConnection, exc: Exception) -> JSONResponse:
    """`AuthenticationMiddleware`'s answer to a refused request."""
    return JSONResponse(schemas.error_body(str(exc), code="invalid_api_key"), 401,
                        headers={"WWW-Authenticate": "Bearer"})

