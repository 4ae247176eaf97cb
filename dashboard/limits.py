"""What a request may send the dashboard, and how much of it an answer may quote back.

- A request body is at most MAX_BODY_BYTES (a plan request is a few hundred bytes): a larger one is answered 413,
  by its Content-Length alone when it declares one, else as soon as that many bytes have come, and the rest is
  never read (the connection is closed), so no request grows the server's memory with its size.
- /api/curves answers for at most MAX_COMPARE runs at once (more: 422); the /runs page draws the first
  MAX_COMPARE it is given.
- A validation error (a body or query of the wrong shape, answered in words by dashboard.errors) quotes at most
  an excerpt of the input it refused (`quoted`), and names at most MAX_ERRORS problems: FastAPI's own answer
  quotes the input whole. A name that is not found (an id in a query) is repeated up to MAX_NAMED_CHARS
  characters.
"""

from __future__ import annotations

import json
from typing import Any

from agoq.units import EXCERPT_CHARS, excerpt

MAX_BODY_BYTES = 64 * 1024
MAX_ERRORS = 8
MAX_COMPARE = 12  # the most runs one request compares
MAX_NAMED_CHARS = 200  # the most of a name a request gave (an id in a query) that an answer repeats


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 without reading the rest; a body
    within it is read (at most `limit` bytes held) and handed on to `app` whole."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        handed = False

        async def replay() -> dict:
            nonlocal handed
            if handed:
                return await receive()
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        text = json.dumps({"detail": f"the request body is larger than {self.limit} bytes, the most this dashboard "
                                     "reads: send the fields it asks for (a plan request is a few hundred bytes)"})
        body = text.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"x-content-type-options", b"nosniff")]})
        await send({"type": "http.response.body", "body": body})


def clipped(name: Any, limit: int = MAX_NAMED_CHARS) -> str:
    """str(name), cut to `limit` characters and marked so when longer: what an answer repeats of a name it was
    asked for (an id, an option)."""
    text = str(name)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: Any) -> Any:
    """`value` as an error may quote it: itself when its JSON is short, else a short excerpt (a string)."""
    try:
        short = len(json.dumps(value)) <= EXCERPT_CHARS
    except (TypeError, ValueError):
        short = False
    return value if short else excerpt(value)
