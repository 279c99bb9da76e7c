"""Fixtures that run the suite against real ``redis-server`` processes.

- ``redis_nodes`` (session): five servers on free loopback ports, started once.
- ``nodes``: the same five, each running, unpaused and empty when the test starts.
- ``redlock_settings``: ``settings.REDLOCK`` pointed at ``nodes``, with short timings.
- ``make_nodes``: a factory for extra servers (say 3 or 7) owned by one test.
- ``hold``: acquire locks for a test, released (if still held) at its end.
- ``api`` / ``other``: a lock owner driving the sync or the async API
  (parametrized ``sync``/``async``, ``tests/_api.py``), and a second one of its kind.
- ``matrix`` / ``matrix_recorder``: the fault-matrix figures (``tests/_matrix.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.nodes import NodeSet
from redlock_django import LockError, Redlock
from tests._api import SyncAPI, make_api
from tests._matrix import matrix, matrix_recorder  # noqa: F401  (fixtures)

NODE_COUNT = 5


@pytest.fixture(scope="session")
def redis_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSet]:
    """Start five redis-servers for the whole session; stop them at its end."""
    node_set = NodeSet.create(NODE_COUNT, tmp_path_factory.mktemp("redis"))
    node_set.start_all()
    try:
        yield node_set
    finally:
        node_set.stop_all()


@pytest.fixture
def nodes(redis_nodes: NodeSet) -> Iterator[NodeSet]:
    """Yield the session's five nodes, all running, unpaused and flushed.

    Whatever an earlier test did to them (paused, killed, stopped, filled with
    keys) is undone first; nodes left paused are resumed at teardown.
    """
    redis_nodes.ensure_running()
    redis_nodes.flush_all()
    try:
        yield redis_nodes
    finally:
        redis_nodes.resume_all()


@pytest.fixture
def redlock_settings(settings: Any, nodes: NodeSet) -> dict[str, Any]:
    """Point ``settings.REDLOCK`` at the five test nodes and return that dict."""
    config: dict[str, Any] = {
        "NODES": nodes.urls,
        "TTL": 10.0,
        # Loopback answers in well under a millisecond, but a 2-core CI box running
        # worker processes or Chromium can stall a node for tens of milliseconds.
        "NODE_TIMEOUT": 0.1,
        "RETRY_DELAY": 0.02,
        "RETRY_JITTER": 0.02,
        "WAIT_TIMEOUT": 2.0,
    }
    settings.REDLOCK = config
    return config


@pytest.fixture
def make_nodes(tmp_path: Path) -> Iterator[Callable[..., NodeSet]]:
    """Return a factory ``make_nodes(count, *, appendfsync_always=False)``.

    Each call starts ``count`` new servers and returns them as a ``NodeSet``;
    all of them are stopped when the test ends.
    """
    created: list[NodeSet] = []

    def factory(count: int, *, appendfsync_always: bool = False) -> NodeSet:
        directory = tmp_path / f"nodes{len(created)}"
        node_set = NodeSet.create(
            count, directory, appendfsync_always=appendfsync_always
        )
        created.append(node_set)
        node_set.start_all()
        return node_set

    try:
        yield factory
    finally:
        for node_set in created:
            node_set.stop_all()


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
