"""Real Redis (or Valkey) nodes for your own tests: no fakes, no mocks.

:class:`NodeSet` and :class:`RedisNode` start, stop, kill and pause real
``redis-server`` / ``valkey-server`` processes on free loopback ports. The pytest
plugin (:mod:`redlock_django.testing.plugin`, loaded through the ``pytest11``
entry point) turns them into fixtures: ``redlock_nodes``, ``redlock_settings``,
``redlock_servers`` and ``make_redlock_nodes``. Importing this package needs
neither pytest nor Django settings.
"""

from __future__ import annotations

from .binary import (
    SERVER_ENV,
    ServerNotFoundError,
    find_redis_server,
    find_valkey_server,
)
from .servers import HOST, NodeSet, RedisNode, RedisNodeError, free_port

#: ``REDLOCK`` values for tests: fail and retry fast, wait at most two seconds.
TEST_TIMINGS: dict[str, float] = {
    "TTL": 10.0,
    # Loopback answers in well under a millisecond, but a 2-core CI box running
    # workers or a browser can stall a node for tens of milliseconds.
    "NODE_TIMEOUT": 0.1,
    "RETRY_DELAY": 0.02,
    "RETRY_JITTER": 0.02,
    "WAIT_TIMEOUT": 2.0,
}


def redlock_config(nodes: NodeSet, **overrides: object) -> dict[str, object]:
    """Return a ``REDLOCK`` settings dict for ``nodes`` with :data:`TEST_TIMINGS`.

    ``overrides`` replace or add keys (``TTL=1.0``, ``KEY_PREFIX="x"``).
    """
    return {"NODES": nodes.urls, **TEST_TIMINGS, **overrides}


__all__ = [
    "HOST",
    "SERVER_ENV",
    "TEST_TIMINGS",
    "NodeSet",
    "RedisNode",
    "RedisNodeError",
    "ServerNotFoundError",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "redlock_config",
]
