"""Quorum behaviour on real redis-servers that are clogged, stopped, paused or killed.

The sweeps follow redsync's ``TestMutexQuorum``: for N = 3 and N = 5, every subset of
nodes is made unavailable (held by a foreign token, or stopped) and a non-blocking
acquisition must succeed exactly when the healthy nodes reach ``N // 2 + 1``. The
other tests freeze nodes with SIGSTOP (a slow or partitioned master: the TCP
handshake still completes, nothing is answered) or SIGKILL them, and check that
every call stays bounded by NODE_TIMEOUT and leaves nothing of ours behind.

Observed about paused nodes: a command the client wrote to a frozen node before its
reply timed out is *not* lost. The client drops the connection, but the bytes are
already in the server's socket buffer, and the server runs them when it resumes,
in the order the connections were opened: a late acquisition lands, and the
clean-up release queued behind it removes it again. That release is sent by
EVALSHA, so it only works on a node that has the release script cached (see
``test_cleanup_reaches_a_resumed_node_that_never_ran_the_release_script``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import redis

from harness.held import lock_key
from harness.nodes import NodeSet, RedisNode
from redlock_django import LockLostError, QuorumUnavailableError, Redlock
from redlock_django.protocol import quorum
from redlock_django.scripts import (
    ACQUIRE_SCRIPT,
    EXTEND_SCRIPT,
    FENCE_SCRIPT,
    PTTL_SCRIPT,
    RELEASE_SCRIPT,
)
from redlock_django.signals import lock_acquired
from tests._api import SyncAPI

FOREIGN = b"foreign-token"
#: Foreign leases outlast ours (10 s), so a foreign key we refreshed would show it.
FOREIGN_TTL = 30.0
NODE_TIMEOUT = 0.05
#: Slack over NODE_TIMEOUT for one call, on a loaded 2-core CI box.
SLACK = 0.25
#: How long a resumed node may take to run the commands queued while it was frozen.
DRAIN_TIMEOUT = 2.0


@pytest.fixture
def resource() -> str:
    """A resource name no other test (or earlier hold of this thread) uses."""
    return f"quorum-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fast_fail(settings: Any, redlock_settings: dict[str, Any]) -> dict[str, Any]:
    """REDLOCK with a 30 s wait: an outage must still fail at once, not wait."""
    settings.REDLOCK = {
        **redlock_settings,
        "NODE_TIMEOUT": NODE_TIMEOUT,
        "WAIT_TIMEOUT": 30.0,
    }
    return settings.REDLOCK


@pytest.fixture(params=[3, 5], ids=["N3", "N5"])
def cluster(
    request: pytest.FixtureRequest,
    nodes: NodeSet,
    make_nodes: Callable[..., NodeSet],
    redlock_settings: dict[str, Any],
) -> Iterator[NodeSet]:
    """Three fresh servers, or the session's five; all running again afterwards."""
    node_set = nodes if request.param == 5 else make_nodes(3)
    try:
        yield node_set
    finally:
        node_set.ensure_running()


# --- looking at the nodes -----------------------------------------------------------

# One plain client per port for the checks, kept for the module: a new TCP
# connection per check would make the sweeps several times slower. Its pool
# reconnects by itself after a node restarts.
_clients: dict[int, redis.Redis] = {}


def peek(node: RedisNode) -> redis.Redis:
    client = _clients.get(node.port)
    if client is None:
        client = _clients[node.port] = node.client()
    return client


@pytest.fixture(autouse=True, scope="module")
def _close_clients() -> Iterator[None]:
    yield
    for client in _clients.values():
        client.close()
    _clients.clear()


def holder(node: RedisNode, key: str) -> bytes | None:
    """Return the token holding ``key`` on ``node`` (string or hash), else None."""
    client = peek(node)
    kind = client.type(key)
    if kind == b"none":
        return None
    if kind == b"string":
        value: bytes | None = client.get(key)
        return value
    token: bytes | None = client.hget(key, "token")
    return token


def holders(nodes: Iterable[RedisNode], key: str) -> list[bytes | None]:
    return [holder(node, key) for node in nodes]


def pttl(node: RedisNode, key: str) -> int:
    return int(peek(node).pttl(key))


def script_calls(node: RedisNode) -> int:
    """Return how many EVAL/EVALSHA commands ``node`` has run (failed ones too)."""
    stats = peek(node).info("commandstats")
    return sum(
        stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("eval", "evalsha")
    )


def load_scripts(nodes: Iterable[RedisNode]) -> None:
    """Cache every lock script on ``nodes``, as a node in steady use has them."""
    scripts = (ACQUIRE_SCRIPT, EXTEND_SCRIPT, FENCE_SCRIPT, PTTL_SCRIPT, RELEASE_SCRIPT)
    for node in nodes:
        for script in scripts:
            assert peek(node).script_load(script.source) == script.sha


def wait_until(predicate: Callable[[], bool], timeout: float = DRAIN_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def drain(paused: dict[RedisNode, int]) -> None:
    """Resume ``paused`` nodes and wait until each ran its queued script commands.

    ``paused`` maps each node to the EVAL/EVALSHA count it must reach: without this
    barrier a check right after SIGCONT could run before the queued commands.
    """
    for node in paused:
        node.resume()
    for node, expected in paused.items():
        assert wait_until(lambda n=node, e=expected: script_calls(n) >= e), (
            f"{node!r} ran {script_calls(node)} script commands after resuming, "
            f"expected {expected}"
        )


def clog_hash(node: RedisNode, key: str) -> None:
    """Hold ``key`` the way another Redlock client would: a hash with its token."""
    peek(node).hset(key, mapping={"token": FOREIGN, "meta": "{}"})
    peek(node).pexpire(key, int(FOREIGN_TTL * 1000))


def clog(node: RedisNode, key: str, kind: str) -> None:
    if kind == "string":
        node.clog(key, FOREIGN, ttl=FOREIGN_TTL)
    else:
        clog_hash(node, key)


def assert_foreign_untouched(nodes: Iterable[RedisNode], key: str) -> None:
    for node in nodes:
        assert holder(node, key) == FOREIGN, node
        # Our lease is 10 s: a foreign 30 s lease that we refreshed would be shorter.
        assert pttl(node, key) > (FOREIGN_TTL - 5) * 1000, node


def assert_ours_exactly_on(every: NodeSet, ours: list[RedisNode], key: str) -> bytes:
    """Our token (one token, with our metadata) is on ``ours`` and on no other node."""
    tokens = {node: holder(node, key) for node in every}
    mine = {tokens[node] for node in ours}
    assert len(mine) == 1, tokens
    token = mine.pop()
    assert token not in (None, FOREIGN), tokens
    for node in every:
        if node not in ours:
            assert tokens[node] != token, (node, tokens)
    meta = json.loads(peek(ours[0]).hget(key, "meta"))
    assert meta["pid"] == os.getpid()
    return token


def assert_nothing_of_ours(nodes: Iterable[RedisNode], key: str) -> None:
    for node in nodes:
        assert holder(node, key) in (None, FOREIGN), node


async def atimed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = await call()
    return result, time.monotonic() - start


def masks(count: int) -> list[int]:
    """Every subset of ``count`` nodes as a bit mask, in Gray-code order.

    Consecutive masks differ in one node, so a sweep of stopped nodes stops or
    starts one server per step instead of up to ``count``.
    """
    return [i ^ (i >> 1) for i in range(1 << count)]


def members(node_set: NodeSet, mask: int) -> list[RedisNode]:
    return [node for i, node in enumerate(node_set) if mask & (1 << i)]


# --- exhaustive sweeps --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["string", "hash"])
def test_nonblocking_acquire_wins_exactly_when_a_quorum_is_not_clogged(
    cluster: NodeSet, resource: str, kind: str
) -> None:
    """For every subset of nodes held by a foreign token, acquire(blocking=False)
    returns True exactly when the free nodes make a quorum; foreign keys are never
    touched, a failed attempt leaves nothing of ours, a won one is on the free nodes.
    """
    count = len(cluster)
    needed = quorum(count)
    outcomes = {}
    for mask in masks(count):
        for node in cluster:
            peek(node).flushall()
        name = f"{resource}-{mask}"
        key = lock_key(name)
        clogged = members(cluster, mask)
        free = [node for node in cluster if node not in clogged]
        for node in clogged:
            clog(node, key, kind)
        lock = Redlock(name, nodes=cluster.urls)

        won = lock.acquire(blocking=False)

        outcomes[mask] = won
        assert won is (len(free) >= needed), (mask, holders(cluster, key))
        assert_foreign_untouched(clogged, key)
        if won:
            assert lock.owned()
            assert_ours_exactly_on(cluster, free, key)
            lock.release()
            assert holders(free, key) == [None] * len(free)
            assert_foreign_untouched(clogged, key)
        else:
            assert not lock.owned()
            assert holders(free, key) == [None] * len(free)
    # Both outcomes happened, so neither branch above was vacuous.
    assert any(outcomes.values())
    assert not all(outcomes.values())


def test_acquire_wins_exactly_when_a_quorum_runs_for_every_set_of_stopped_nodes(
    cluster: NodeSet, resource: str
) -> None:
    """For every subset of stopped nodes, acquire(blocking=False) wins exactly when
    a quorum runs; otherwise it raises QuorumUnavailableError (an outage, not a False
    return) naming the stopped nodes, with the right granted and quorum counts, and
    leaves nothing on the running nodes.
    """
    count = len(cluster)
    needed = quorum(count)
    stopped_before = 0
    for mask in masks(count):
        # Gray code: exactly one node changes state per step.
        for i, node in enumerate(cluster):
            if (mask ^ stopped_before) & (1 << i):
                if mask & (1 << i):
                    node.stop()
                else:
                    node.start()
        stopped_before = mask
        down = members(cluster, mask)
        up = [node for node in cluster if node not in down]
        for node in up:
            peek(node).flushall()
        name = f"{resource}-{mask}"
        key = lock_key(name)
        lock = Redlock(name, nodes=cluster.urls)

        if len(up) >= needed:
            assert lock.acquire(blocking=False) is True, mask
            # A node slower than the quorum (a loaded machine) may still be
            # running its write when acquire returns: give it a moment. A quorum
            # is what a grant promises; every running node is what is expected.
            wait_until(lambda k=key, u=up: all(holder(n, k) for n in u), 1.0)
            granted = [n for n in up if holder(n, key) is not None]
            assert len(granted) >= needed, (mask, granted)
            assert_ours_exactly_on(NodeSet(up), granted, key)
            lock.release()
            assert holders(up, key) == [None] * len(up)
            continue

        with pytest.raises(QuorumUnavailableError) as caught:
            lock.acquire(blocking=False)
        error = caught.value
        assert set(error.failed) == {node.url for node in down}, mask
        for reason in error.failed.values():
            assert reason.startswith("ConnectionError"), reason
        assert error.granted == len(up)
        assert error.quorum == needed
        assert error.nodes == count
        assert error.resource == name
        assert not lock.owned()
        assert holders(up, key) == [None] * len(up)


# --- paused nodes (SIGSTOP) ---------------------------------------------------------


@pytest.mark.parametrize("frozen", [(0, 1), (3, 4)], ids=["first", "last"])
async def test_acquire_extend_release_succeed_in_node_timeout_with_two_of_five_paused(
    api: SyncAPI,
    nodes: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    frozen: tuple[int, ...],
) -> None:
    """With two of five nodes frozen, acquire, extend and release (and their async
    twins) each succeed within NODE_TIMEOUT (not redis-py's 5 s default): once the
    three live nodes decided, the frozen ones are not waited for. Once they resume
    and run what was queued for them, nothing of ours is left.

    Each step waits past NODE_TIMEOUT before the next, as a busy machine's do:
    the acquire and the extend left owing a reply on the frozen nodes are then
    given up, their connections reset, so neither ever runs there; the release, a
    clean-up, is closed in order and runs when they resume (the sync driver's by
    EVALSHA with its source written behind it, so twice: the second finds nothing
    to delete; the asyncio driver's by EVAL, once). (Steps run within
    NODE_TIMEOUT of each other leave all three queued: that count depended on the
    machine's speed, and under ``pytest -n 2`` the acquire was given up first.)
    """
    load_scripts(nodes)
    key = lock_key(resource)
    paused = [nodes[i] for i in frozen]
    live = [node for node in nodes if node not in paused]
    runs = 2 if api.mode == "sync" else 1
    expected = {node: script_calls(node) + runs for node in paused}
    for node in paused:
        node.pause()
    lock = Redlock(resource)

    won, took_acquire = await atimed(lambda: api.acquire(lock))
    await asyncio.sleep(2 * NODE_TIMEOUT)  # the asyncio driver gives up its calls
    assert won is True
    assert_ours_exactly_on(NodeSet(live), live, key)
    extended, took_extend = await atimed(lambda: api.extend(lock, 5.0))
    await asyncio.sleep(2 * NODE_TIMEOUT)
    assert extended is True
    assert 4_000 < pttl(live[0], key) <= 5_000
    _, took_release = await atimed(lambda: api.release(lock))
    await asyncio.sleep(2 * NODE_TIMEOUT)
    assert holders(live, key) == [None] * len(live)

    for took in (took_acquire, took_extend, took_release):
        assert took < NODE_TIMEOUT + SLACK, (took_acquire, took_extend, took_release)
    # Only the release runs once they resume.
    drain(expected)
    assert holders(nodes, key) == [None] * len(nodes)
    time.sleep(0.05)  # a reset connection's commands would have run by now
    assert {node: script_calls(node) for node in paused} == expected


@pytest.mark.parametrize("frozen", [(0, 1, 2), (2, 3, 4)], ids=["first", "last"])
async def test_quorum_unavailable_is_raised_at_once_with_three_of_five_paused(
    api: SyncAPI,
    nodes: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    frozen: tuple[int, ...],
) -> None:
    """With three of five nodes frozen, acquire() (or aacquire) raises
    QuorumUnavailableError after about NODE_TIMEOUT even with a 30 s WAIT_TIMEOUT;
    once the frozen nodes resume, nothing of ours is left on any node.

    The frozen nodes' hosts acknowledged our acquire and our clean-up release. The
    sync driver keeps those connections (each owes its reply) until it next uses
    the node, so a node resumed before then runs them all, the clean-up (by
    EVALSHA, its source written behind it) undoing the acquisition; the asyncio
    driver gives up its calls at once: it resets the acquire's connection, which
    the frozen node had not accepted yet, so its kernel discards the acquire
    unrun, and closes the clean-up's in order, so the clean-up runs (undoing
    nothing) when the node resumes.
    """
    load_scripts(nodes)
    key = lock_key(resource)
    paused = [nodes[i] for i in frozen]
    live = [node for node in nodes if node not in paused]
    queued = 3 if api.mode == "sync" else 1
    expected = {node: script_calls(node) + queued for node in paused}
    for node in paused:
        node.pause()
    lock = Redlock(resource)

    start = time.monotonic()
    with pytest.raises(QuorumUnavailableError) as caught:
        await api.acquire(lock)
    took = time.monotonic() - start
    # One round to the nodes and one clean-up round, never a retry.
    assert took < NODE_TIMEOUT + SLACK, took
    error = caught.value
    assert error.failed == {node.url: "timed out" for node in paused}
    assert error.granted == 2
    assert error.quorum == 3
    assert error.nodes == 5
    assert not lock.owned()
    assert holders(live, key) == [None, None]

    drain(expected)
    assert holders(nodes, key) == [None] * len(nodes)
    time.sleep(0.05)  # a reset connection's commands would have run by now
    assert {node: script_calls(node) for node in paused} == expected


#: The retry delay of the every-node-silent tests: far longer than an attempt and its
#: clean-up (two node timeouts), so nodes resumed halfway through it can only be met
#: by a retry.
SILENT_RETRY = 1.0


@pytest.fixture
def slow_retry(settings: Any, fast_fail: dict[str, Any]) -> dict[str, Any]:
    """``fast_fail`` with a long, unjittered retry delay."""
    settings.REDLOCK = {**fast_fail, "RETRY_DELAY": SILENT_RETRY, "RETRY_JITTER": 0.0}
    return settings.REDLOCK


@pytest.fixture
def attempts() -> Iterator[list[int]]:
    """The ``attempts`` of every ``lock_acquired`` signal sent during the test."""
    seen: list[int] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs["attempts"])

    lock_acquired.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        lock_acquired.disconnect(receiver)


async def test_every_node_silent_for_one_attempt_is_tried_again_not_an_outage(
    api: SyncAPI,
    nodes: NodeSet,
    slow_retry: dict[str, Any],
    attempts: list[int],
    resource: str,
) -> None:
    """Every node frozen through one attempt and its clean-up, then resumed: the
    acquisition retries and wins (two attempts), it does not raise
    QuorumUnavailableError. No node answered, so none showed it is down: a host
    too busy to run any of them (a CI machine's cluster run) looks just the same.
    """
    load_scripts(nodes)
    key = lock_key(resource)
    for node in nodes:
        node.pause()
    timer = threading.Timer(SILENT_RETRY / 2, lambda: [n.resume() for n in nodes])
    timer.start()
    lock = Redlock(resource)
    try:
        won = await api.acquire(lock)
    finally:
        timer.join()
    assert won is True
    assert attempts == [2]
    assert len([h for h in holders(nodes, key) if h is not None]) >= quorum(5)
    await api.release(lock)
    assert wait_until(lambda: holders(nodes, key) == [None] * len(nodes))


async def test_every_node_silent_twice_is_an_outage_and_a_single_try_once(
    api: SyncAPI, nodes: NodeSet, slow_retry: dict[str, Any], resource: str
) -> None:
    """Every node frozen for good: a waiting acquisition raises QuorumUnavailableError
    after exactly two silent attempts (one retry delay between them), never after
    its 30 s wait; a non-blocking one after its only attempt; locked() after two
    looks. Each names every node as timed out.

    The retry delay (1 s) dwarfs an attempt and its clean-up (two node timeouts),
    so the time taken counts the retries: one too many or too few is a second off.
    """
    load_scripts(nodes)
    for node in nodes:
        node.pause()
    try:
        for kwargs, retries in (({}, 1), ({"blocking": False}, 0)):
            lock = Redlock(f"{resource}-{retries}")
            start = time.monotonic()
            with pytest.raises(QuorumUnavailableError) as caught:
                await api.acquire(lock, **kwargs)
            took = time.monotonic() - start
            assert retries * SILENT_RETRY <= took, (kwargs, took)
            assert took < retries * SILENT_RETRY + SILENT_RETRY / 2, (kwargs, took)
            assert caught.value.failed == {n.url: "timed out" for n in nodes}
            assert caught.value.granted == 0
        start = time.monotonic()
        with pytest.raises(QuorumUnavailableError) as caught:
            await api.locked(Redlock(resource))
        took = time.monotonic() - start
        assert SILENT_RETRY <= took < SILENT_RETRY * 1.5, took
        assert caught.value.failed == {n.url: "timed out" for n in nodes}
    finally:
        for node in nodes:
            node.resume()


def test_command_queued_on_a_paused_node_runs_when_it_resumes(
    nodes: NodeSet, fast_fail: dict[str, Any], resource: str
) -> None:
    """A node frozen during acquire() is given up on, yet the acquisition written
    to its socket lands when it resumes: the lock shows up there late, and only a
    release (or the lease) removes it. This is why every clean-up goes to all nodes.
    """
    load_scripts(nodes)
    key = lock_key(resource)
    late = nodes[4]
    expected = {late: script_calls(late) + 1}
    late.pause()
    lock = Redlock(resource)
    assert lock.acquire(blocking=False) is True
    drain(expected)

    # Negative control for the clean-up tests: the frozen node now holds our token.
    token = assert_ours_exactly_on(nodes, list(nodes), key)
    assert holder(late, key) == token
    lock.release()
    assert holders(nodes, key) == [None] * len(nodes)


def test_cleanup_reaches_a_resumed_node_that_never_ran_the_release_script(
    fast_fail: dict[str, Any],
    make_nodes: Callable[..., NodeSet],
    resource: str,
) -> None:
    """The clean-up after a failed acquisition removes what the acquisition queued
    on frozen nodes even when those nodes (just restarted, say) have only ever run
    the acquire script: otherwise a lock nobody owns blocks the resource for a TTL.
    """
    fresh = make_nodes(5)
    key = lock_key(resource)
    # A first lock on the fresh nodes caches ACQUIRE there (EVALSHA, NOSCRIPT, EVAL)
    # but not RELEASE: it is still held.
    other = Redlock(f"{resource}-other", nodes=fresh.urls)
    assert other.acquire(blocking=False)
    paused = list(fresh[2:])
    expected = {node: script_calls(node) + 2 for node in paused}
    for node in paused:
        node.pause()
    lock = Redlock(resource, nodes=fresh.urls)
    try:
        with pytest.raises(QuorumUnavailableError):
            lock.acquire()
        drain(expected)
    finally:
        fresh.resume_all()
        other.release()

    assert holders(fresh, key) == [None] * len(fresh)
    assert not Redlock(resource, nodes=fresh.urls).locked()


def test_release_reaches_a_resumed_node_that_never_ran_the_release_script(
    fast_fail: dict[str, Any],
    make_nodes: Callable[..., NodeSet],
    resource: str,
) -> None:
    """A release that a frozen node answers only after the others decided it still
    deletes the lock there when the node resumes, although that node has only ever
    run the acquire script (a release by EVALSHA alone would be answered NOSCRIPT,
    to nobody, and the lock would stay for its whole lease). The connection that
    owed the late replies then carries the next lock's commands as usual."""
    fresh = make_nodes(5)
    key = lock_key(resource)
    lock = Redlock(resource, nodes=fresh.urls, ttl=60.0)
    assert lock.acquire(blocking=False)  # caches ACQUIRE on the fresh nodes only
    late = fresh[4]
    # At least the release's command, and the source after a NOSCRIPT if one came.
    expected = {late: script_calls(late) + 1}
    late.pause()
    try:
        lock.release()
    finally:
        drain(expected)
    assert wait_until(lambda: holders(fresh, key) == [None] * len(fresh)), holders(
        fresh, key
    )

    again = Redlock(resource, nodes=fresh.urls)
    assert again.acquire(blocking=False)
    assert_ours_exactly_on(fresh, list(fresh), key)
    again.release()
    assert holders(fresh, key) == [None] * len(fresh)


# --- killed and restarted nodes -----------------------------------------------------


@pytest.mark.parametrize("dead", [(0, 1, 2), (2, 3, 4)], ids=["first", "last"])
async def test_quorum_unavailable_is_raised_at_once_with_three_of_five_killed(
    api: SyncAPI,
    nodes: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    dead: tuple[int, ...],
) -> None:
    """With three of five nodes crashed, acquire() (or aacquire) raises
    QuorumUnavailableError naming them, without waiting out the 30 s WAIT_TIMEOUT,
    and leaves nothing of ours on the two live nodes."""
    key = lock_key(resource)
    killed = [nodes[i] for i in dead]
    live = [node for node in nodes if node not in killed]
    for node in killed:
        node.kill()
    lock = Redlock(resource)

    start = time.monotonic()
    with pytest.raises(QuorumUnavailableError) as caught:
        await api.acquire(lock)
    took = time.monotonic() - start

    assert took < NODE_TIMEOUT + SLACK, took
    error = caught.value
    assert set(error.failed) == {node.url for node in killed}
    assert error.granted == 2
    assert error.quorum == 3
    assert not lock.owned()
    assert holders(live, key) == [None, None]


@pytest.mark.parametrize("dead", [(1, 3), (0, 4)], ids=["inner", "outer"])
async def test_acquire_extend_release_work_with_two_of_five_killed(
    api: SyncAPI,
    nodes: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    dead: tuple[int, ...],
) -> None:
    """With two of five nodes crashed, the other three are a quorum: acquire,
    extend and release (and their async twins) all work, quickly, and release
    clears the live nodes."""
    key = lock_key(resource)
    killed = [nodes[i] for i in dead]
    live = [node for node in nodes if node not in killed]
    for node in killed:
        node.kill()
    lock = Redlock(resource)

    won, took_acquire = await atimed(lambda: api.acquire(lock))
    await asyncio.sleep(2 * NODE_TIMEOUT)  # the asyncio driver gives up its calls
    assert won is True
    assert_ours_exactly_on(NodeSet(live), live, key)
    extended, took_extend = await atimed(lambda: api.extend(lock, 5.0))
    assert extended is True
    assert all(4_000 < pttl(node, key) <= 5_000 for node in live)
    _, took_release = await atimed(lambda: api.release(lock))

    assert holders(live, key) == [None] * len(live)
    for took in (took_acquire, took_extend, took_release):
        assert took < NODE_TIMEOUT + SLACK, (took_acquire, took_extend, took_release)


def test_extend_fails_and_release_warns_when_three_of_five_die_while_held(
    nodes: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once a majority crashed, extend() returns False and leaves the lease as it
    was; release() still clears the live nodes and logs that it reached a minority.
    """
    key = lock_key(resource)
    lock = Redlock(resource)
    assert lock.acquire()
    validity = lock.validity
    for node in nodes[:3]:
        node.kill()

    assert lock.extend(30.0) is False
    assert lock.validity <= validity
    with caplog.at_level(logging.WARNING, logger="redlock_django"):
        lock.release()

    assert holders(nodes[3:], key) == [None, None]
    assert "released on 2/5 nodes" in caplog.text


@pytest.fixture
def durable(make_nodes: Callable[..., NodeSet]) -> NodeSet:
    """Five fresh nodes that fsync every write, so a lock survives a restart."""
    return make_nodes(5, appendfsync_always=True)


def test_release_clears_nodes_restarted_while_the_lock_was_held(
    durable: NodeSet,
    fast_fail: dict[str, Any],
    resource: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restart of three of five nodes between acquire and release breaks the
    pooled connections and empties the script caches; release still reaches every
    node and the lock (kept across the restart by the append-only file) is gone.
    """
    key = lock_key(resource)
    lock = Redlock(resource, nodes=durable.urls)
    assert lock.acquire()
    token = assert_ours_exactly_on(durable, list(durable), key)
    for node in durable[:3]:
        node.restart()
    # Negative control: the restarted nodes still hold the lock, only release can
    # remove it before its lease ends.
    assert holders(durable, key) == [token] * len(durable)

    with caplog.at_level(logging.WARNING, logger="redlock_django"):
        lock.release()

    assert holders(durable, key) == [None] * len(durable)
    assert "released on" not in caplog.text


def test_release_after_a_node_restarted_empty_clears_the_live_nodes(
    nodes: NodeSet, fast_fail: dict[str, Any], resource: str
) -> None:
    """A node that crashed and came back empty while the lock was held does not
    stop release() from clearing every node."""
    key = lock_key(resource)
    lock = Redlock(resource)
    assert lock.acquire()
    nodes[2].kill()
    nodes[2].start()
    assert holder(nodes[2], key) is None

    lock.release()

    assert holders(nodes, key) == [None] * len(nodes)


async def test_next_acquire_recovers_connections_broken_by_node_restarts(
    api: SyncAPI, nodes: NodeSet, fast_fail: dict[str, Any], resource: str
) -> None:
    """After three of five nodes restarted under the pool's idle connections (sync
    or asyncio), the next acquisition succeeds on all five: broken connections are
    replaced, not reported as failed nodes (three failures would be a
    QuorumUnavailableError)."""
    first = Redlock(f"{resource}-first")
    assert await api.acquire(first)
    for node in nodes[:3]:
        node.restart()

    second = Redlock(f"{resource}-second")
    assert await api.acquire(second, blocking=False) is True

    key = lock_key(f"{resource}-second")
    assert_ours_exactly_on(nodes, list(nodes), key)
    await api.release(second)
    # The restarts (no persistence) dropped first's keys on 3 of 5 nodes.
    with pytest.raises(LockLostError):
        await api.release(first)
    assert holders(nodes, key) == [None] * len(nodes)


# --- asyncio ------------------------------------------------------------------------


async def test_async_release_clears_nodes_restarted_while_the_lock_was_held(
    durable: NodeSet, fast_fail: dict[str, Any], resource: str
) -> None:
    """arelease reaches three of five nodes restarted while the lock was held
    (their lock kept by the append-only file) once the event loop has seen the old
    connections close; the lock is gone from every node."""
    key = lock_key(resource)
    lock = Redlock(resource, nodes=durable.urls)
    assert await lock.aacquire()
    token = assert_ours_exactly_on(durable, list(durable), key)
    for node in durable[:3]:
        node.restart()
    assert holders(durable, key) == [token] * len(durable)
    # No pause here: the first command on a connection the server closed fails,
    # and the driver retries it once on a new connection.
    await lock.arelease()

    assert holders(durable, key) == [None] * len(durable)


# --- CLIENT PAUSE: the server stops serving clients, the process keeps running ------


@pytest.mark.parametrize("paused", [2, 3])
def test_client_pause_on_a_minority_is_tolerated_and_on_a_majority_fails_fast(
    nodes: NodeSet, fast_fail: dict[str, Any], resource: str, paused: int
) -> None:
    """CLIENT PAUSE (Redis's own fault, unlike SIGSTOP the server still accepts
    connections): two of five paused, the lock is granted and released by the
    three others; three paused, the attempt fails at once with the quorum error."""
    key = lock_key(resource)
    pause_ms = 1000
    for node in nodes[-paused:]:
        with node.client() as client:
            client.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
    began = time.monotonic()
    lock = Redlock(resource)
    try:
        if paused == 2:
            assert lock.acquire(timeout=0)
            assert holders(nodes[:3], key) == [holders(nodes[:1], key)[0]] * 3
            lock.release()
            assert holders(nodes[:3], key) == [None] * 3
        else:
            with pytest.raises(QuorumUnavailableError) as caught:
                lock.acquire(timeout=0)
            assert caught.value.granted <= 2
            assert holders(nodes[:2], key) == [None] * 2
        # Bounded by the node timeout, far below the 1 s pause.
        assert time.monotonic() - began < 0.8
    finally:
        # A paused server also holds back CLIENT UNPAUSE from a new connection
        # (its handshake is paused too): let the pause run out instead.
        time.sleep(max(0.0, began + pause_ms / 1000 + 0.05 - time.monotonic()))
