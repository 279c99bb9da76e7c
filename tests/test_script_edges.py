"""The Lua scripts (scripts.py) and the reading of their replies (protocol.py) on
odd states of the nodes, against real redis-server processes.

Found by an adversarial review (each failed on the code before its fix): a fair
lock was granted to a newcomer ahead of a live waiter when 16 or more expired
entries were ahead of it (one call drops at most 16, and the rest looked like an
empty queue); a negative fencing counter made ACQUIRE write the lock and answer
-1, which reads as "held by another", so the key was left for its TTL; and
``locked()`` said free for a foreign value without a TTL that every acquisition
is refused by. The others pin what held up: wrong tokens, expired keys, odd
resource names, RESP3 nodes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from harness.held import fence_key, held_on, lock_key, tokens
from harness.nodes import NodeSet
from redlock_django import LockError, Redlock
from redlock_django.keys import queue_keys
from redlock_django.scripts import (
    ACQUIRE_SCRIPT,
    EXTEND_SCRIPT,
    RELEASE_SCRIPT,
)

pytestmark = pytest.mark.django_db(transaction=False)

PREFIX = "redlock"


def node_ms(client: Any) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


@pytest.mark.parametrize("dead", [15, 16, 17])
def test_fair_lock_is_not_granted_past_a_live_waiter_behind_dead_entries(
    nodes: NodeSet, redlock_settings: dict[str, Any], dead: int
) -> None:
    """fairness.md: a node grants a free fair lock only to the first *live* entry
    of its queue. ``dead`` entries of killed waiters (expired) sit ahead of one
    live waiter: a newcomer must be refused, not granted (15 is the control)."""
    resource = "edge-fair-dead-head"
    queue, waiters, ticket = queue_keys(resource, PREFIX)
    for node in nodes:
        with node.client() as client:
            now = node_ms(client)
            for i in range(dead):
                member = f"{i:016x}"
                client.zadd(queue, {member: i + 1})
                client.zadd(waiters, {member: now - 1000})  # expired
            client.zadd(queue, {"ffffffffffffffff": 50})
            client.zadd(waiters, {"ffffffffffffffff": now + 60_000})  # alive
            client.set(ticket, 50)
            for key in (queue, waiters, ticket):
                client.pexpire(key, 120_000)
    newcomer = Redlock(resource, fair=True, ttl=5.0)
    got = newcomer.acquire(blocking=False)
    try:
        assert not got, (
            "a newcomer was granted the fair lock ahead of a live waiter "
            f"(held on {held_on(nodes, resource)}/5 nodes)"
        )
    finally:
        if got:
            newcomer.release()


def test_a_negative_fencing_counter_is_a_clear_error_and_leaves_no_key(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """A counter of -2 made ACQUIRE write the lock and answer -1, the code for
    "held by another": the client skipped the clean-up and left the key. It is
    refused like any counter that is not a number, before anything is written."""
    resource = "negative-fence"
    for node in nodes:
        with node.client() as client:
            client.set(fence_key(resource), -2)
    lock = Redlock(resource, fencing=True, ttl=5.0)
    with pytest.raises(LockError) as info:
        lock.acquire(blocking=False)
    assert "is not a number" in str(info.value), str(info.value)
    assert held_on(nodes, resource) == 0, tokens(nodes, resource)


def test_wrongtype_fencing_counter_is_a_clear_per_node_error(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    resource = "edge-wrongtype-fence"
    for node in nodes[:3]:
        with node.client() as client:
            client.hset(fence_key(resource), "x", "1")
    lock = Redlock(resource, fencing=True, ttl=5.0)
    with pytest.raises(LockError) as info:
        lock.acquire(blocking=False)
    message = str(info.value)
    assert "WRONGTYPE" in message, message
    assert held_on(nodes, resource) == 0


def test_release_and_extend_with_a_wrong_token_leave_the_lock(
    nodes: NodeSet, hold: Any
) -> None:
    resource = "edge-wrong-token"
    lock = hold(resource, ttl=5.0)
    key = lock_key(resource)
    for node in nodes:
        with node.client() as client:
            before = client.pttl(key)
            owner = client.hget(key, "token")
            wrong = owner[:-1] + (b"x" if owner[-1:] != b"x" else b"y")
            assert client.eval(RELEASE_SCRIPT.source, 1, key, wrong, "rid") == 0
            assert client.eval(EXTEND_SCRIPT.source, 1, key, wrong, 60_000, 99) == 0
            assert client.eval(EXTEND_SCRIPT.source, 1, key, wrong, 1) == 0
            assert client.hget(key, "token") == owner
            assert 0 < client.pttl(key) <= before
    assert lock.locked()


def test_extend_never_recreates_an_expired_key(nodes: NodeSet) -> None:
    key = lock_key("edge-extend-expired")
    with nodes[0].client() as client:
        assert client.eval(ACQUIRE_SCRIPT.source, 1, key, "abc.1", 5, "{}") == 0
        time.sleep(0.05)
        assert client.exists(key) == 0
        assert client.eval(EXTEND_SCRIPT.source, 1, key, "abc.1", 60_000, 1) == 0
        assert client.exists(key) == 0


@pytest.mark.parametrize(
    "resource", ["with space", "ünï{cödé}", "{tag}x", "a}b{c", "emoji 🔒 lock"]
)
def test_odd_resource_names_lock_fence_and_release(
    nodes: NodeSet, redlock_settings: dict[str, Any], resource: str
) -> None:
    lock = Redlock(resource, fencing=True, ttl=5.0)
    assert lock.acquire(blocking=False)
    assert held_on(nodes, resource) == 5
    first = lock.fencing_token
    other = Redlock(resource, fencing=True, ttl=5.0, reentrant=False)
    assert not other.acquire(blocking=False)
    lock.release()
    assert held_on(nodes, resource) == 0
    assert other.acquire(blocking=False)
    assert other.fencing_token > first
    other.release()


def test_locked_agrees_with_acquire_about_a_foreign_value_without_ttl(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """Every script reads a key of another type as held by someone else, so
    acquire() is refused on every node; locked() must not call it free."""
    resource = "edge-foreign-persistent"
    for node in nodes:
        with node.client() as client:
            client.set(lock_key(resource), "not a lock")
    lock = Redlock(resource, ttl=5.0)
    assert not lock.acquire(blocking=False)
    assert lock.locked(), "acquire() says held by another, locked() says free"


@pytest.mark.parametrize("fair", [False, True])
def test_resp3_nodes_lock_fence_and_release(
    nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any, fair: bool
) -> None:
    urls = [f"{url}?protocol=3" for url in nodes.urls]
    settings.REDLOCK = {**redlock_settings, "NODES": urls}
    resource = "edge-resp3"
    lock = Redlock(resource, fencing=True, ttl=5.0, fair=fair)
    assert lock.acquire(blocking=False)
    first = lock.fencing_token
    assert first and first > 0
    assert lock.extend(5.0)
    assert lock.locked()
    other = Redlock(resource, fencing=True, ttl=5.0, fair=fair, reentrant=False)
    assert not other.acquire(blocking=False)
    lock.release()
    assert held_on(nodes, resource) == 0
    assert other.acquire(blocking=False)
    assert other.fencing_token > first
    other.release()
