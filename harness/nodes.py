"""Real ``redis-server`` nodes: the shipped :mod:`redlock_django.testing`, by name.

The node code ships with the package (users' test suites get it through the pytest
plugin); tests, the demo and the benchmarks keep importing it from here.
"""

from __future__ import annotations

from redlock_django.testing.binary import (
    INSTALL_HINT,
    SERVER_ENV,
    ServerNotFoundError,
    find_redis_server,
    find_valkey_server,
)
from redlock_django.testing.servers import (
    HOST,
    PORT_ATTEMPTS,
    START_TIMEOUT,
    STOP_TIMEOUT,
    NodeSet,
    RedisNode,
    RedisNodeError,
    free_port,
)

__all__ = [
    "HOST",
    "INSTALL_HINT",
    "PORT_ATTEMPTS",
    "SERVER_ENV",
    "START_TIMEOUT",
    "STOP_TIMEOUT",
    "NodeSet",
    "RedisNode",
    "RedisNodeError",
    "ServerNotFoundError",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
]
