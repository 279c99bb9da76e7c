"""The sync driver without redis-py's internals: the portable path (issue 14).

The blocking driver's fast path reads redis-py internals (``conn._sock``,
``conn._parser`` and hiredis' reader). A connection class that does not have them
(here one that keeps its socket and parser inside a connection it forwards to, as a
redis-py with other internals would) must take the portable path, built on
redis-py's public connection API only; ``REDLOCK_SYNC_DRIVER=portable`` forces that
path for every connection (``make test-portable`` runs the lock suite on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.held import lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import Redlock, sync, wire
from redlock_django import nodes as node_pools
from redlock_django.conf import get_settings
from redlock_django.protocol import Fanout, NodeReply
from redlock_django.scripts import Script

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
NODE_TIMEOUT = 0.1
# KEYS[1] unused; ARGV[1] a word; returns the word: each call's own reply.
ECHO_SCRIPT = Script("echo", "return ARGV[1]")


class ForwardingConnection(redis.Connection):
    """A connection with no ``_sock`` or ``_parser``: it forwards the public API.

    Its socket and parser belong to a plain ``redis.Connection`` it owns, out of
    the driver's reach, as they would be in a redis-py whose internals moved. Its
    ``read_response`` declares no ``timeout=`` (as in redis-py 5.0 and 6.4), so
    the driver waits with ``can_read`` before reading.
    """

    def __init__(self, **kwargs: Any) -> None:  # no super(): no internals here
        self._inner = redis.Connection(**kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __del__(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<ForwardingConnection {self._inner!r}>"

    def connect(self) -> None:
        self._inner.connect()

    def disconnect(self, *args: Any, **kwargs: Any) -> None:
        self._inner.disconnect(*args, **kwargs)

    def pack_command(self, *args: Any) -> Any:
        return self._inner.pack_command(*args)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._inner.send_packed_command(command, check_health=check_health)

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self._inner.send_command(*args, **kwargs)

    def can_read(self, timeout: float = 0) -> bool:
        return bool(self._inner.can_read(timeout))

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.read_response(*args, **kwargs)


def forwarding_caches(nodes: NodeSet, count: int) -> dict[str, Any]:
    """CACHES with one Django RedisCache alias per node, on ForwardingConnection."""
    caches: dict[str, Any] = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    }
    for i in range(count):
        caches[f"node{i}"] = {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": nodes[i].url,
            "OPTIONS": {"connection_class": ForwardingConnection},
        }
    return caches


def test_a_connection_without_redis_py_internals_takes_the_portable_path(
    settings: Any, nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """Three cache aliases whose connections hide ``_sock``: the lock still works."""
    settings.CACHES = forwarding_caches(nodes, 3)
    settings.REDLOCK = {**redlock_settings, "NODES": ["node0", "node1", "node2"]}
    with Redlock("hidden", fencing=True) as lock:
        assert [n.client().exists(lock_key("hidden")) for n in nodes[:3]] == [1] * 3
        assert lock.fencing_token == 1
    assert [n.client().exists(lock_key("hidden")) for n in nodes[:3]] == [0] * 3
    path = wire.PATHS[ForwardingConnection]
    assert path.name == "portable"
    assert "has no _sock" in path.why or wire.FORCED  # make test-portable forces it


def test_redis_py_connections_take_the_path_this_run_asks_for(
    redlock_settings: dict[str, Any],
) -> None:
    """redis-py's own Connection: fast, or portable under ``make test-portable``
    (so that run really is on the portable path)."""
    with Redlock("plain"):
        pass
    expected = "portable" if wire.FORCED else "fast"
    assert wire.PATHS[redis.Connection].name == expected, wire.PATHS[redis.Connection]


def test_portable_path_leaves_a_frozen_node_behind_and_drops_its_late_reply(
    settings: Any, nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """A SIGSTOPped node costs at most NODE_TIMEOUT on the portable path, and the
    reply it sends once resumed is thrown away, never read by a later call."""
    settings.CACHES = forwarding_caches(nodes, 3)
    settings.REDLOCK = {
        **redlock_settings,
        "NODES": ["node0", "node1", "node2"],
        "NODE_TIMEOUT": NODE_TIMEOUT,
    }
    config = get_settings()
    pools = node_pools.sync_pools(config.nodes, config.node_timeout)
    sync.fanout(pools, echo(0, need=0), NODE_TIMEOUT)  # connected, probed
    with nodes[2].paused():
        started = time.monotonic()
        replies = sync.fanout(pools, echo(1, need=0), NODE_TIMEOUT)
        took = time.monotonic() - started
        assert replies[:2] == [NodeReply(b"call-1")] * 2
        assert replies[2].value is None, replies[2]
        # NODE_TIMEOUT, plus room for a loaded 2-core host; not the socket's 5 s.
        assert NODE_TIMEOUT <= took < NODE_TIMEOUT + 1.0, took
    for n in range(2, 12):  # node 2 answers call-1 now: nobody may read it
        assert (
            sync.fanout(pools, echo(n, need=0), 1.0)
            == [NodeReply(f"call-{n}".encode())] * 3
        )
    assert wire.PATHS[ForwardingConnection].name == "portable"


def echo(n: int, need: int) -> Fanout:
    return Fanout(ECHO_SCRIPT, ("echo",), (f"call-{n}",), need=need, wins=bool)


def test_one_portable_connection_makes_the_whole_round_wait_portably(
    settings: Any, nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """Fast nodes and one portable one in a fan-out, a fifth node 10 ms slower
    than the rest: every call reads its own reply, in one round trip for the
    quorum, and the slow node's late replies keep its connections."""
    with FaultProxy(nodes.ports[4]) as proxy:
        # 10 ms: a busy 2-core host delays the fast replies by a few ms as well
        # (with 3 ms it was left behind in only 80 of 180 quorum calls).
        proxy.delay(0.01)
        settings.CACHES = forwarding_caches(nodes, 1)
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": ["node0", *nodes.urls[1:4], proxy.url],
            "NODE_TIMEOUT": NODE_TIMEOUT,
        }
        config = get_settings()
        pools = node_pools.sync_pools(config.nodes, config.node_timeout)
        unawaited = 0
        for n in range(200):
            need = 0 if n % 10 == 9 else 3
            replies = sync.fanout(pools, echo(n, need), NODE_TIMEOUT)
            word = f"call-{n}".encode()
            assert all(r.value in (None, word) for r in replies), (n, replies)
            if need == 0:
                assert replies == [NodeReply(word)] * 5, (n, replies)
            unawaited += replies[4].value is None
        assert unawaited > 100  # the slow node really was left behind
        assert proxy.connections <= 40, proxy.connections  # not one per fan-out
    assert wire.PATHS[ForwardingConnection].name == "portable"


# One fan-out on the lock's own pools to the nodes named in argv, then the path
# each connection class took, as JSON.
CHILD = """
import json, sys
from redlock_django import sync, wire
from redlock_django.address import parse_node
from redlock_django.nodes import sync_pools
from redlock_django.protocol import Fanout
from redlock_django.scripts import PTTL_SCRIPT

pools = sync_pools([parse_node(url, i) for i, url in enumerate(sys.argv[1:])], 1.0)
replies = sync.fanout(pools, Fanout(PTTL_SCRIPT, ("child",), ()), 1.0)
print(json.dumps({
    "replies": [list(reply) for reply in replies],
    "paths": {k.__qualname__: list(p) for k, p in wire.PATHS.items()},
}))
"""


def run_child(urls: list[str], driver: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(wire.ENV, None)  # make test-portable sets it for the whole run
    if driver is not None:
        env[wire.ENV] = driver
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-c", CHILD, *urls],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_this_redis_py_takes_the_fast_path_and_the_switch_forces_the_portable_one(
    nodes: NodeSet,
) -> None:
    """By default redis-py's own Connection takes the fast path (poll() and the
    hiredis reader); REDLOCK_SYNC_DRIVER=portable sends it the portable way."""
    urls = nodes.urls[:3]
    fast = run_child(urls, None)
    assert fast.returncode == 0, fast.stderr
    out = json.loads(fast.stdout)
    assert out["replies"] == [[-2, None]] * 3  # PTTL of a missing key, every node
    name, direct, why = out["paths"]["Connection"]
    assert (name, direct) == ("fast", True), why
    forced = run_child(urls, "Portable ")
    assert forced.returncode == 0, forced.stderr
    out = json.loads(forced.stdout)
    assert out["replies"] == [[-2, None]] * 3
    assert out["paths"]["Connection"] == [
        "portable",
        False,
        "REDLOCK_SYNC_DRIVER=portable",
    ]


def test_an_unknown_driver_switch_is_refused_by_name(nodes: NodeSet) -> None:
    """A misspelt REDLOCK_SYNC_DRIVER stops the import with a message that names
    the variable and its values, and nothing is sent to the nodes."""
    before = scripts_run(nodes)
    child = run_child(nodes.urls[:1], "portabel")
    assert child.returncode != 0
    assert (
        "ValueError: REDLOCK_SYNC_DRIVER must be 'auto' (the default: redis-py's "
        "internals where they are as expected) or 'portable' (redis-py's public API "
        "only), not 'portabel'"
    ) in child.stderr
    assert scripts_run(nodes) == before


def scripts_run(nodes: NodeSet) -> int:
    """EVAL and EVALSHA calls node 0 has run since it started."""
    stats = nodes[0].client().info("commandstats")
    return sum(
        stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha")
    )
