"""Real ``redis-server`` nodes: the shipped :mod:`redlock_django.testing`, by name.

The node code ships with the package (users' test suites get it through the pytest
plugin); tests, the demo and the benchmarks keep importing it from here.
"""

from __future__ import annotations

from redlock_django.testing import (  # noqa: F401  (re-exported)
    HOST,
    SERVER_ENV,
    NodeSet,
    RedisNode,
    RedisNodeError,
    ServerNotFoundError,
    find_redis_server,
    find_valkey_server,
    free_port,
)
