"""Helpers shared by the decorator tests: requests through Django's ASGIHandler
(as an ASGI server sends them, for async views a client disconnect cancels), and a
probe of whether another owner could take a lock right now."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from django.core.handlers.asgi import ASGIHandler

from redlock_django import Redlock

__all__ = ["asgi_request", "asgi_scope", "free_for_another_owner"]


def asgi_scope(method: str, path_: str) -> dict[str, Any]:
    """The ASGI scope of a plain HTTP request to ``path_`` on the test server."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path_,
        "raw_path": path_.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }


async def asgi_request(
    method: str, path_: str, disconnect: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    """Run one request through Django's ASGIHandler; return the sent messages.

    When ``disconnect`` is given, the client goes away once it is set.
    """
    incoming = [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        if disconnect is None:
            await asyncio.Event().wait()
        else:
            await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ASGIHandler()(asgi_scope(method, path_), receive, send)
    return sent


def free_for_another_owner(resource: str) -> bool:
    """Try the lock once from a fresh thread (a fresh owner); release if taken."""
    taken: list[bool] = []

    def attempt() -> None:
        lock = Redlock(resource)
        taken.append(lock.acquire(blocking=False))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(10)
    return taken == [True]
