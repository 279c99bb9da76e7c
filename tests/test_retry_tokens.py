"""Every acquisition attempt writes its own token (issue 10, hole 2).

A failed attempt's clean-up is a RELEASE of that attempt's token. If every attempt
of one ``acquire()`` wrote the same token, a clean-up delayed in the network (a
segment retransmitted after the client gave up on its connection) would delete
the key that the next attempt counted toward its quorum: two holders. Attempt k
writes ``<base>.<k>``; ACQUIRE takes over a key only from an earlier attempt of
the same base, so a lost clean-up still never blocks the next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.held import lock_key, token_on
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import Redlock
from redlock_django.scripts import ACQUIRE_SCRIPT, RELEASE_SCRIPT
from tests._api import SyncAPI, make_api

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def proxy(nodes: NodeSet) -> Iterator[FaultProxy]:
    """A fault proxy in front of node 0, closed at teardown."""
    with FaultProxy(nodes[0].port) as fault_proxy:
        yield fault_proxy


# --- end to end: a delayed clean-up ------------------------------------------------


async def test_delayed_cleanup_of_a_failed_attempt_never_deletes_the_next_attempts_key(
    api: SyncAPI,
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    proxy: FaultProxy,
) -> None:
    """Timeline (node 0 behind the proxy, nodes 2-4 held by another owner):

    1. attempt 1 is granted nodes 0 and 1 only and fails; its clean-up reaches
       node 1, but on node 0 it is held back in the network; the client gives up
       on that connection after NODE_TIMEOUT;
    2. node 2 is freed; attempt 2 is granted nodes 0, 1, 2 and wins;
    3. the other owner leaves nodes 3 and 4; the held clean-up reaches node 0.

    Node 0 still holds attempt 2's key, and a second client is refused: it finds
    a quorum only if the late clean-up deleted a key the holder counted."""
    resource = "retry-tokens"
    key = lock_key(resource)
    settings.REDLOCK = {
        **redlock_settings,
        "NODES": [proxy.url, *nodes.urls[1:]],
        "NODE_TIMEOUT": 0.25,
        "RETRY_DELAY": 0.3,
        "RETRY_JITTER": 0.0,
        "WAKE_UPS": False,
        "AUTO_EXTEND": False,
    }
    for node in nodes[2:]:
        node.clog(key)
    # The asyncio driver cleans up by EVAL; the sync driver by EVALSHA, with the
    # source written behind it (held too) once node 0 did not answer.
    sync_driver = api.mode == "sync"
    release = RELEASE_SCRIPT.sha if sync_driver else RELEASE_SCRIPT.source
    proxy.hold_request(release.encode())
    holder = Redlock(resource)
    other = make_api(api.mode)
    rival = Redlock(resource, nodes=nodes.urls)
    acquiring = asyncio.ensure_future(api.acquire(holder, timeout=5.0))
    try:
        assert await asyncio.to_thread(proxy.wait_for_held, 5.0), (
            "attempt 1 sent no clean-up to node 0"
        )
        with nodes[2].client() as client:
            client.delete(key)
        assert await acquiring
        won = [token_on(node, resource) for node in nodes]
        assert won[0] == won[1] == won[2] not in (None, b"foreign"), won
        for node in nodes[3:]:
            with node.client() as client:
                client.delete(key)
        reply = await asyncio.to_thread(proxy.deliver_held)
        after = token_on(nodes[0], resource)
        rival_won = await other.acquire(rival, blocking=False)
        holder_believes = await api.look(holder, "validity") > 0
        # Old code: (b':1\r\n', None, True, True): the late clean-up deleted the
        # key attempt 2 counted, and the rival took nodes 0, 3, 4. Every reply of
        # the late clean-up (one or two commands) is 0: it deleted nothing.
        assert reply.startswith(b":0\r\n"), reply
        assert (reply.replace(b":0\r\n", b""), after, rival_won, holder_believes) == (
            b"",
            won[0],
            False,
            True,
        )
    finally:
        if not acquiring.done():
            acquiring.cancel()
        with contextlib.suppress(BaseException):
            await acquiring
        with contextlib.suppress(Exception):
            await api.release(holder)
        with contextlib.suppress(Exception):
            await other.release(rival)
        await other.aclose()
    assert [token_on(node, resource) for node in nodes] == [None] * 5


# --- the scripts: which leftover ACQUIRE may take over ------------------------------


def acquire_on(client: redis.Redis, key: str, token: str) -> Any:
    return client.eval(ACQUIRE_SCRIPT.source, 1, key, token, 10000, "{}")


def release_on(client: redis.Redis, key: str, token: str) -> Any:
    return client.eval(RELEASE_SCRIPT.source, 1, key, token)


@pytest.mark.parametrize(
    ("held", "asked", "granted"),
    [
        ("base.1", "base.2", True),  # an earlier attempt of ours: taken over
        ("base.9", "base.10", True),  # attempt numbers compare as numbers
        ("base.2", "base.2", True),  # the same attempt again (a resent command)
        ("base.3", "base.2", False),  # a later attempt of ours: never stolen
        ("base.10", "base.9", False),
        ("other.1", "base.2", False),  # another owner's token
        ("xbase.1", "base.2", False),  # a base that only ends like ours
        ("base", "base.2", False),  # a token without an attempt number
        ("base.1", "base", False),  # a request without an attempt number
    ],
)
def test_acquire_takes_over_only_an_earlier_attempt_of_the_same_base(
    nodes: NodeSet, held: str, asked: str, granted: bool
) -> None:
    """ACQUIRE replaces a key holding an earlier attempt of the same base (a
    clean-up that never arrived) and answers -1, leaving the key as it was, for a
    later attempt of that base or any other token."""
    key = lock_key("takeover")
    with nodes[0].client() as client:
        client.hset(key, mapping={"token": held, "meta": "old"})
        client.pexpire(key, 60000)
        reply = acquire_on(client, key, asked)
        stored = client.hget(key, "token")
        meta = client.hget(key, "meta")
        pttl = client.pttl(key)
    if granted:
        assert (reply, stored, meta) == (0, asked.encode(), b"{}")
        assert 0 < pttl <= 10000
    else:
        assert (reply, stored, meta) == (-1, held.encode(), b"old")
        assert pttl > 10000


def test_release_of_an_earlier_attempt_leaves_the_key_a_later_attempt_took(
    nodes: NodeSet,
) -> None:
    """After attempt 2 took over attempt 1's leftover, attempt 1's clean-up (late)
    deletes nothing; attempt 2's own clean-up does."""
    key = lock_key("takeover")
    with nodes[0].client() as client:
        assert acquire_on(client, key, "base.1") == 0
        assert acquire_on(client, key, "base.2") == 0
        assert release_on(client, key, "base.1") == 0
        assert client.hget(key, "token") == b"base.2"
        # A late ACQUIRE of attempt 1 cannot take the key back either.
        assert acquire_on(client, key, "base.1") == -1
        assert release_on(client, key, "base.2") == 1
        assert client.exists(key) == 0
