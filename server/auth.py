"""Bearer-token authentication (--api-key): an ASGI middleware in front of the app.

Every /v1/*, /tokenize and /detokenize request must carry `Authorization: Bearer KEY`; the
comparison takes constant time. /health stays open (load balancers poll it). /metrics is open
to loopback clients, and to others with the key.
"""

from __future__ import annotations

import hmac
import json

OPEN = ("/health",)
LOOPBACK = ("127.", "::1", "localhost")


def loopback(host: str | None) -> bool:
    return host is not None and host.startswith(LOOPBACK)


class APIKey:
    def __init__(self, app, key: str):
        self.app, self._key = app, f"Bearer {key}".encode()

    def authorized(self, scope) -> bool:
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        return hmac.compare_digest(given, self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN:
            return await self.app(scope, receive, send)
        client = scope.get("client")
        if scope["path"] == "/metrics" and loopback(client[0] if client else None):
            return await self.app(scope, receive, send)
        if self.authorized(scope):
            return await self.app(scope, receive, send)
        body = json.dumps(
            {
                "error": {
                    "message": "invalid or missing API key: send Authorization: Bearer <key>",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
