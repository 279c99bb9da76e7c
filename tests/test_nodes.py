"""Node connections: URLs with credentials, django-redis cache aliases, our timeouts."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff

from harness.held import lock_key
from harness.nodes import NodeSet, RedisNode, find_redis_server
from redlock_django import QuorumUnavailableError, Redlock
from redlock_django import nodes as node_pools
from redlock_django.conf import get_settings


def test_lock_reuses_a_django_redis_cache_alias(
    settings: Any, nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": nodes[0].url,
            "OPTIONS": {"SOCKET_TIMEOUT": 5},
        },
    }
    settings.REDLOCK = {**redlock_settings, "NODES": ["locks", *nodes.urls[1:3]]}
    with Redlock("aliased"):
        assert [n.client().exists(lock_key("aliased")) for n in nodes[:3]] == [1] * 3


def test_lock_runs_on_valkey_servers_named_by_url_and_by_django_valkey_alias(
    settings: Any, tmp_path: Any, redlock_settings: dict[str, Any]
) -> None:
    """Three real valkey-servers: a valkey:// URL, a django-valkey alias, a redis://."""
    valkeys = NodeSet(
        RedisNode(tmp_path / f"v{i}", server=find_redis_server("valkey"))
        for i in range(3)
    )
    valkeys.start_all()
    try:
        settings.CACHES = {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "locks": {
                "BACKEND": "django_valkey.cache.ValkeyCache",
                "LOCATION": valkeys[1].url.replace("redis://", "valkey://"),
            },
        }
        urls = [
            valkeys[0].url.replace("redis://", "valkey://"),
            "locks",
            valkeys[2].url,
        ]
        settings.REDLOCK = {**redlock_settings, "NODES": urls}
        with Redlock("on-valkey", fencing=True) as lock:
            held = [n.client().exists(lock_key("on-valkey")) for n in valkeys]
            assert lock.fencing_token == 1
        assert held == [1, 1, 1]
        assert not any(n.client().exists(lock_key("on-valkey")) for n in valkeys)
        [version] = {n.client().info("server")["valkey_version"] for n in valkeys}
        assert version.startswith("9.")
    finally:
        valkeys.stop_all()


def test_pools_use_the_node_timeout_and_never_retry(
    settings: Any, nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": nodes[0].url,
            "OPTIONS": {"SOCKET_TIMEOUT": 5, "SOCKET_CONNECT_TIMEOUT": 5},
        },
    }
    settings.REDLOCK = {**redlock_settings, "NODES": ["locks", nodes.urls[1]]}
    conf = get_settings()
    for pool in node_pools.sync_pools(conf.nodes, 0.05):
        kwargs = pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.05
        assert kwargs["socket_connect_timeout"] == 0.05
        retry = kwargs["retry"]
        assert retry._retries == 0 and isinstance(retry._backoff, NoBackoff)


def test_password_in_the_url_authenticates_and_never_reaches_errors(
    settings: Any, make_nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    secured = make_nodes(3)
    good = secured.require_password("s3cret-pass")
    settings.REDLOCK = {**redlock_settings, "NODES": good}
    with Redlock("secured") as lock:
        assert lock.owned()
    bad = [f"redis://:wrong-pass@127.0.0.1:{n.port}/0" for n in secured]
    settings.REDLOCK = {**redlock_settings, "NODES": bad}
    with pytest.raises(QuorumUnavailableError) as info:
        Redlock("secured").acquire()
    text = str(info.value) + repr(info.value.failed)
    assert "wrong-pass" not in text and "s3cret" not in text
    assert len(info.value.failed) == 3
    assert all(name.startswith("redis://127.0.0.1:") for name in info.value.failed)


def test_lock_works_over_a_unix_socket(
    settings: Any, tmp_path: Any, redlock_settings: dict[str, Any]
) -> None:
    socket_path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [
            find_redis_server(),
            "--port",
            "0",
            "--unixsocket",
            str(socket_path),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            assert time.monotonic() < deadline, "redis-server did not open its socket"
            time.sleep(0.02)
        url = f"unix://{socket_path}?db=2"
        settings.REDLOCK = {**redlock_settings, "NODES": [url]}
        with Redlock("over-unix") as lock:
            assert lock.owned()
            client = redis.Redis(unix_socket_path=str(socket_path), db=2)
            assert client.hget(lock_key("over-unix"), "token") is not None
        assert client.exists(lock_key("over-unix")) == 0
    finally:
        server.kill()
        server.wait(timeout=10)


def test_the_connections_of_a_closed_event_loop_are_closed_not_kept(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """Each event loop gets its own connections (``async_clients``), which refer
    to their loop: kept per loop, they kept every loop and its sockets alive, one
    per node for each ``asyncio.run()`` (an ``async_to_sync`` call, a task), until
    the process ran out of descriptors. Once a new loop comes, those of the
    loops closed since are closed, quietly: redis-py 5.0's connection ``__del__``
    would close them through the closed loop and print "Exception ignored ...
    Event loop is closed"."""
    import asyncio
    import gc
    import sys

    async def cycle() -> None:
        async with Redlock("loop-gone"):
            pass

    ignored: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: ignored.append(
        f"{u.exc_type.__name__}: {u.exc_value}"
    )
    try:
        asyncio.run(cycle())
        before = len(nodes[0].client().client_list())
        for _ in range(20):
            asyncio.run(cycle())
        gc.collect()
        after = len(nodes[0].client().client_list())
    finally:
        sys.unraisablehook = previous
    assert after <= before, f"{after - before} more connections after 20 event loops"
    assert len(node_pools._async) <= 1
    assert ignored == []


def test_a_settings_change_closes_the_idle_connections_of_a_running_loop(
    settings: Any, redlock_settings: dict[str, Any], make_nodes: Any
) -> None:
    """A settings change (``nodes.reset()``) forgot a running loop's clients
    without closing them: their sockets stayed open until the garbage collector
    found them, each with an "unclosed Connection" warning. They are closed on
    their loop now."""
    import asyncio
    import gc
    import warnings

    fresh = make_nodes(3)

    def open_connections() -> int:
        with fresh[0].client() as client:
            me = client.client_id()
            return sum(1 for c in client.client_list() if int(c["id"]) != me)

    counts: dict[str, int] = {}

    async def main() -> None:
        lock = Redlock("settings-changed", nodes=fresh.urls)
        assert await lock.aacquire(blocking=False)
        await lock.arelease()
        counts["before"] = open_connections()
        settings.REDLOCK = {**redlock_settings, "TTL": 9.0}
        await asyncio.sleep(0.5)
        counts["after"] = open_connections()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()
        counts["unclosed"] = sum("unclosed" in str(w.message) for w in caught)

    gc.collect()
    gc.disable()  # the collector would close them by chance, at any time
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    assert counts["before"] >= 1, counts
    assert counts["after"] == 0 and counts["unclosed"] == 0, counts


# Under uvloop (an adversarial review of the asyncio driver; both tests failed on
# the code before its fix): closing the connections of a finished loop called
# shutdown() on the transport's socket, which uvloop hands out as a PseudoSocket
# that raises TypeError: every other uvloop.run() failed to lock, and a settings
# change stopped closing pools midway.


@pytest.fixture
def uvloop() -> Any:
    return pytest.importorskip("uvloop")


@pytest.fixture
def forget_closed_loops() -> Iterator[None]:
    """After the test, drop the cached clients of closed loops without closing
    them, so the settings fixture's own reset at teardown does not hit the bug
    under test a second time (an ERROR at teardown)."""
    yield
    for loop in list(node_pools._async):
        if loop.is_closed():
            node_pools._async.pop(loop, None)


async def _acquire_and_release(name: str) -> bool:
    lock = Redlock(name, ttl=10)
    got = await lock.aacquire(blocking=False)
    if got:
        await lock.arelease()
    return got


def test_uvloop_run_called_repeatedly_acquires_every_time(
    settings: Any,
    nodes: NodeSet,
    redlock_settings: Any,
    uvloop: Any,
    forget_closed_loops: None,
) -> None:
    """One uvloop.run() per operation (what asyncio.run() per call is under
    uvloop): every run acquires and releases. The first call on a new loop
    closes the connections of the loops closed since (nodes.async_clients ->
    _close_without_loop), and there a uvloop transport's socket is a
    PseudoSocket whose shutdown() raises TypeError, not the OSError that is
    suppressed: that aacquire() raises TypeError instead of locking, so every
    other run fails."""
    settings.REDLOCK = {**redlock_settings, "WAKE_UPS": False, "AUTO_EXTEND": False}
    results = []
    for n in range(4):
        try:
            results.append(uvloop.run(_acquire_and_release(f"nodes:uvloop-{n}")))
        except Exception as exc:  # the assertion shows it
            results.append(repr(exc))
    assert results == [True] * 4, results


def test_a_settings_change_after_a_uvloop_run_closes_its_clients_quietly(
    settings: Any,
    nodes: NodeSet,
    redlock_settings: Any,
    uvloop: Any,
    forget_closed_loops: None,
) -> None:
    """After a uvloop.run() that locked, changing REDLOCK (nodes.reset(), from
    the setting_changed receiver) closes that closed loop's connections. It
    raises TypeError from the PseudoSocket's shutdown() instead, which stops
    reset() midway: the other cached loops' pools are neither closed nor
    forgotten, and Django's send_robust logs the receiver's error."""
    settings.REDLOCK = {**redlock_settings, "WAKE_UPS": False, "AUTO_EXTEND": False}
    assert uvloop.run(_acquire_and_release("nodes:uvloop-reset"))
    try:
        node_pools.reset()
        error = None
    except Exception as exc:  # the assertion shows it
        error = exc
    assert error is None, repr(error)
