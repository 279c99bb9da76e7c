"""What the Redis nodes hold for a resource, read directly, for assertions.

Tests look at the nodes themselves (the key, its token, how many nodes hold it)
rather than trusting the lock's own view. Keys are built by
:mod:`redlock_django.keys`, the one place the key layout is spelled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redlock_django import keys

#: The default ``KEY_PREFIX``.
PREFIX = "redlock"


def lock_key(resource: str, prefix: str = PREFIX) -> str:
    """Return the key of ``resource``'s lock hash under ``prefix``."""
    return keys.lock_key(resource, prefix)


def fence_key(resource: str, prefix: str = PREFIX) -> str:
    """Return the key of ``resource``'s fencing counter under ``prefix``."""
    return keys.fence_key(resource, prefix)


def token_on(node: Any, resource: str, prefix: str = PREFIX) -> bytes | None:
    """Return the lock token on ``node``; a foreign string value reads as b"foreign"."""
    with node.client() as client:
        key = lock_key(resource, prefix)
        if client.type(key) == b"string":
            return b"foreign"
        value: bytes | None = client.hget(key, "token")
        return value


def tokens(
    nodes: Iterable[Any], resource: str, prefix: str = PREFIX
) -> list[bytes | None]:
    """Return the lock token on each node, in order (``None``: not held there)."""
    return [token_on(node, resource, prefix) for node in nodes]


def held_on(nodes: Iterable[Any], resource: str, prefix: str = PREFIX) -> int:
    """Return on how many nodes a lock key for ``resource`` exists right now."""
    count = 0
    for node in nodes:
        with node.client() as client:
            count += int(client.exists(lock_key(resource, prefix)))
    return count
