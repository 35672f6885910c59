"""The server's own ASGI middleware: the API key, request ids, and the request body limit."""

from __future__ import annotations

import hmac
import uuid

from fastapi.responses import JSONResponse

from kiln.entrypoints.openai.protocol import APIError

# Routes a load balancer or a scraper reads without credentials; every other route needs the key.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on every route but ``OPEN_PATHS`` (CORS preflights pass):
    unlike vLLM, whose key guards ``/v1`` only, ``/generate``, ``/tokenize`` and ``/detokenize`` need it too.

    The comparison takes the same time wherever the given key first differs, so response times
    do not leak the key a prefix at a time."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            given = dict(scope["headers"]).get(b"authorization", b"")
            if path not in OPEN_PATHS and not hmac.compare_digest(given, self.expected):
                error = APIError("invalid or missing API key", status=401)
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echoes ``X-Request-Id`` (or a new one) on every response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Answers 413 to a body over ``max_bytes`` (``--max-request-body-bytes``), whether it declares its
    length or arrives chunked, before the app parses any of it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        # Read the body here, counting, so a chunked upload is stopped at the limit too.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def receive_again():
            return next(replay, None) or await receive()

        await self.app(scope, receive_again, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = APIError(f"the request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)", status=413)
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
