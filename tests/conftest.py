"""Fixtures that run the suite against real ``redis-server`` processes.

The servers come from the shipped pytest plugin (``redlock_django.testing.plugin``,
loaded with ``-p`` in pyproject), under the names this suite has always used:

- ``redis_nodes`` (session): five servers on free loopback ports, started once.
- ``nodes``: the same five, each running, unpaused and empty when the test starts.
- ``redlock_settings`` (the plugin's): ``settings.REDLOCK`` pointed at ``nodes``,
  with short timings.
- ``proxies``: every node behind its own fault proxy (``harness/proxy.py``), with
  ``settings.REDLOCK`` pointed at the proxies (a test module may define its own).
- ``make_nodes``: a factory for extra servers (say 3 or 7) owned by one test.
- ``hold``: acquire locks for a test, released (if still held) at its end.
- ``api`` / ``other``: a lock owner driving the sync or the async API
  (parametrized ``sync``/``async``, ``tests/_api.py``), and a second one of its kind.
- ``matrix`` / ``matrix_recorder``: the fault-matrix figures (``tests/_matrix.py``).
- ``spawn`` / ``acquisitions``: fair waiter processes and the test's ``lock_acquired``
  signals (``tests/_waiting.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import LockError, Redlock
from tests._api import SyncAPI, make_api
from tests._matrix import matrix, matrix_recorder  # noqa: F401  (fixtures)
from tests._waiting import acquisitions, spawn  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def redis_nodes(redlock_servers: NodeSet) -> NodeSet:
    """The plugin's session servers (five: ``redlock_nodes = 5`` in pyproject)."""
    return redlock_servers


@pytest.fixture
def nodes(redis_nodes: NodeSet, redlock_nodes: NodeSet) -> NodeSet:
    """The five nodes, each running, unpaused and flushed (the plugin's fixture).

    Asks for ``redis_nodes`` too, so teardown code reaching for it (test_faults)
    finds it active instead of making a new request, which pytest deprecates.
    """
    return redlock_nodes


#: ``REDLOCK_TEST_FAIR=1``: every test's ``settings.REDLOCK`` holds ``FAIR: True``,
#: so the fault matrix runs on fair locks too (``make test-fair``).
FAIR_ENV = "REDLOCK_TEST_FAIR"


@pytest.fixture
def redlock_settings(redlock_settings: dict[str, Any], settings: Any) -> dict[str, Any]:
    """The plugin's settings for the session's nodes, fair when ``FAIR_ENV`` says."""
    if os.environ.get(FAIR_ENV, "") not in ("", "0"):
        redlock_settings = {**redlock_settings, "FAIR": True}
        settings.REDLOCK = redlock_settings
    return redlock_settings


@pytest.fixture
def proxies(
    nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any
) -> Iterator[list[FaultProxy]]:
    """Every node behind its own fault proxy, and REDLOCK pointed at the
    proxies (NODE_TIMEOUT 0.8 s, no wake-ups)."""
    started = [FaultProxy(node.port).start() for node in nodes]
    settings.REDLOCK = {
        **redlock_settings,
        "NODES": [proxy.url for proxy in started],
        "NODE_TIMEOUT": 0.8,
        "WAKE_UPS": False,
    }
    try:
        yield started
    finally:
        for proxy in started:
            proxy.close()


@pytest.fixture
def make_nodes(make_redlock_nodes: Callable[..., NodeSet]) -> Callable[..., NodeSet]:
    """``make_nodes(count, *, appendfsync_always=False)``: the plugin's factory."""
    return make_redlock_nodes


@pytest.fixture
def hold(redlock_settings: dict[str, Any]) -> Iterator[Callable[..., Redlock]]:
    """Return ``hold(resource, **options)``: acquire a lock, released at teardown."""
    held: list[Redlock] = []

    def acquire(resource: str, **options: Any) -> Redlock:
        lock = Redlock(resource, **options)
        assert lock.acquire(blocking=False)
        held.append(lock)
        return lock

    yield acquire
    for lock in reversed(held):
        # Some tests force-release or delete the keys: the lock may be gone.
        with contextlib.suppress(LockError):
            lock.release()


@pytest.fixture(params=["sync", "async"])
async def api(
    request: pytest.FixtureRequest, redlock_settings: dict[str, Any]
) -> AsyncIterator[SyncAPI]:
    owner = make_api(request.param)
    yield owner
    await owner.aclose()


@pytest.fixture
async def other(api: SyncAPI) -> AsyncIterator[SyncAPI]:
    """A second owner of the same kind (another thread, or another task)."""
    owner = make_api(api.mode)
    yield owner
    await owner.aclose()
