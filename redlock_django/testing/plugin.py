"""pytest plugin: real Redis (or Valkey) nodes for a Django project's own tests.

Installed with redlock-django through the ``pytest11`` entry point (named like this
module, so ``-p redlock_django.testing.plugin`` and the entry point never load it
twice). Harmless until used: no server starts and neither Django settings nor
pytest-django are touched unless a test asks for one of these fixtures:

- ``redlock_servers`` (session): N servers on free loopback ports, started at first
  use and stopped when the session ends (``--redlock-nodes`` / ini ``redlock_nodes``,
  default 3; ``--redlock-server redis|valkey|PATH`` / ``REDLOCK_TEST_SERVER`` / ini
  ``redlock_server``, default redis).
- ``redlock_nodes``: the same servers, each running, unpaused and empty when the
  test starts; nodes a test paused are resumed at its end, stopped ones restarted
  before the next test that asks.
- ``redlock_settings``: ``REDLOCK`` pointed at ``redlock_nodes`` with short test
  timings, through pytest-django's ``settings`` when that plugin is active, else
  ``django.test.override_settings``; returns the dict.
- ``make_redlock_nodes``: ``make_redlock_nodes(count)`` starts a separate set of
  servers owned by one test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import redlock_config
from .binary import SERVER_ENV, ServerNotFoundError, find_redis_server
from .servers import NodeSet

DEFAULT_NODE_COUNT = 3


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--redlock-nodes`` and ``--redlock-server`` and their ini twins."""
    group = parser.getgroup("redlock", "redlock-django test nodes")
    group.addoption(
        "--redlock-nodes",
        dest="redlock_nodes",
        default=None,
        metavar="N",
        help=f"how many servers redlock_servers starts (default {DEFAULT_NODE_COUNT})",
    )
    group.addoption(
        "--redlock-server",
        dest="redlock_server",
        default=None,
        metavar="redis|valkey|PATH",
        help=f"the server binary the nodes run (default: ${SERVER_ENV}, else redis)",
    )
    parser.addini(
        "redlock_nodes",
        f"how many servers redlock_servers starts (default {DEFAULT_NODE_COUNT})",
        default=str(DEFAULT_NODE_COUNT),
    )
    parser.addini(
        "redlock_server",
        f"redis, valkey or a server binary's path; --redlock-server and ${SERVER_ENV} "
        "win over it",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a bad node count or server path at once, before any test runs.

    Only a path given by the option or the ini file is checked here: ``redis``,
    ``valkey`` and ``$REDLOCK_TEST_SERVER`` are looked up when a test first asks
    for nodes, so a suite that uses none needs no server.
    """
    node_count(config)
    choice = config.getoption("redlock_server")
    if not choice and not os.environ.get(SERVER_ENV):
        choice = _ini_server(config)
    if choice and choice not in ("redis", "valkey"):
        try:
            find_redis_server(choice)
        except ServerNotFoundError as exc:
            raise pytest.UsageError(f"redlock-django test nodes: {exc}") from None


def _ini_server(config: pytest.Config) -> str:
    """The ini file's ``redlock_server``; a relative path is the ini file's."""
    value = str(config.getini("redlock_server") or "")
    if value in ("", "redis", "valkey") or os.path.isabs(value):
        return value
    base = config.inipath.parent if config.inipath else Path.cwd()
    return str(base / value)


def node_count(config: pytest.Config) -> int:
    """Return the number of servers asked for (option, else ini, else 3)."""
    raw = config.getoption("redlock_nodes") or config.getini("redlock_nodes")
    try:
        count = int(str(raw).strip())
    except ValueError:
        count = 0
    if count < 1:
        raise pytest.UsageError(
            f"--redlock-nodes / redlock_nodes must be a whole number >= 1, got {raw!r}"
        )
    return count


def server_choice(config: pytest.Config) -> str | None:
    """Return the server asked for: option, else ``REDLOCK_TEST_SERVER``, else ini."""
    value = (
        config.getoption("redlock_server")
        or os.environ.get(SERVER_ENV)
        or _ini_server(config)
    )
    return str(value) if value else None


def _create(config: pytest.Config, count: int, directory: Path, **kw: Any) -> NodeSet:
    try:
        return NodeSet.create(count, directory, server=server_choice(config), **kw)
    except ServerNotFoundError as exc:
        pytest.fail(f"redlock-django test nodes: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def redlock_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeSet]:
    """Start N servers for the whole session; stop them when it ends."""
    config = request.config
    node_set = _create(config, node_count(config), tmp_path_factory.mktemp("redlock"))
    node_set.start_all()
    try:
        yield node_set
    finally:
        node_set.stop_all()


@pytest.fixture
def redlock_nodes(redlock_servers: NodeSet) -> Iterator[NodeSet]:
    """Yield the session's servers, each running, unpaused and empty.

    Whatever an earlier test did to them (paused, killed, stopped, filled with
    keys) is undone first; nodes left paused are resumed at teardown.
    """
    redlock_servers.ensure_running()
    redlock_servers.flush_all()
    try:
        yield redlock_servers
    finally:
        redlock_servers.resume_all()


@pytest.fixture
def redlock_settings(
    request: pytest.FixtureRequest, redlock_nodes: NodeSet
) -> Iterator[dict[str, Any]]:
    """Point ``settings.REDLOCK`` at ``redlock_nodes`` for one test; yield the dict.

    Change a value with pytest-django's ``settings``:
    ``settings.REDLOCK = {**redlock_settings, "TTL": 1.0}``.
    """
    config = redlock_config(redlock_nodes)
    if request.config.pluginmanager.has_plugin("django"):
        settings = request.getfixturevalue("settings")
        settings.REDLOCK = config
        yield config
        return
    from django.test import override_settings

    with override_settings(REDLOCK=config):
        yield config


@pytest.fixture
def make_redlock_nodes(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., NodeSet]]:
    """Return ``make_redlock_nodes(count, *, appendfsync_always=False)``.

    Each call starts ``count`` new servers and returns them as a ``NodeSet``; all
    are stopped when the test ends. With ``appendfsync_always`` a node keeps its
    keys across :meth:`~redlock_django.testing.RedisNode.kill`.
    """
    created: list[NodeSet] = []

    def factory(count: int, *, appendfsync_always: bool = False) -> NodeSet:
        directory = tmp_path / f"redlock-nodes{len(created)}"
        node_set = _create(
            request.config, count, directory, appendfsync_always=appendfsync_always
        )
        created.append(node_set)
        node_set.start_all()
        return node_set

    try:
        yield factory
    finally:
        for node_set in created:
            node_set.stop_all()
