"""Extensions of one hold never race: the lease is the one the nodes applied last.

A manual ``extend()`` and the watchdog both extend the same hold. Run at once, the
nodes apply them in one order and the holder may hear them back in the other:
before issue 10 (hole 3) the holder kept whichever *finished* last, so it could
count on a 1.2 s lease while every node held 0.3 s, and act after another client
took the lock. Each test here builds that interleaving for real: five nodes behind
fault proxies that run the watchdog's extension at once but hold back its replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import LockLostError, Redlock

TTL = 1.2
#: The watchdog's EXTEND carries the TTL in ms as a bulk string of its own.
WATCHDOG_EXTEND = b"$4\r\n1200\r\n"
SHORT = 0.3
#: How long the watchdog's replies are held back after both extensions ran.
HELD_FOR = 0.25


@pytest.fixture
def proxies(
    nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any
) -> Iterator[list[FaultProxy]]:
    """Every node behind its own fault proxy, and REDLOCK pointed at the proxies."""
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


def majority_pttl(nodes: NodeSet, resource: str) -> float:
    """Seconds until fewer than a majority of nodes hold the key (0 if they don't)."""
    left = sorted(
        (max(0, node.client().pttl(lock_key(resource))) for node in nodes),
        reverse=True,
    )
    return left[len(nodes) // 2] / 1000


def hold_watchdog_replies(proxies: list[FaultProxy]) -> None:
    for proxy in proxies:
        proxy.hold_reply_to(WATCHDOG_EXTEND)


def wait_until_watchdog_held(proxies: list[FaultProxy]) -> None:
    """Block until the watchdog's extension ran on every node, replies held."""
    for proxy in proxies:
        assert proxy.wait_for_held_replies(1, timeout=3), "the watchdog never extended"


def release_later(proxies: list[FaultProxy]) -> threading.Timer:
    timer = threading.Timer(
        HELD_FOR, lambda: [proxy.release_held_replies() for proxy in proxies]
    )
    timer.start()
    return timer


def settled(proxies: list[FaultProxy]) -> None:
    """Wait until every held reply was delivered, then a moment for the holder."""
    deadline = time.monotonic() + 3
    while any(proxy.held_replies for proxy in proxies):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.03)


def test_manual_extension_racing_the_watchdog_keeps_the_lease_the_nodes_hold(
    proxies: list[FaultProxy], nodes: NodeSet
) -> None:
    """The watchdog's 1.2 s extension runs on every node, its replies late; a
    manual ``extend(0.3)`` in the meantime: the holder's validity never exceeds
    what a majority of nodes holds, and once they dropped the key the holder
    no longer claims the lock while another client takes it."""
    lock = Redlock("race", ttl=TTL, auto_extend=True, max_hold=None)
    assert lock.acquire()
    try:
        assert lock.extend()  # loads the script: no NOSCRIPT round trip later
        hold_watchdog_replies(proxies)
        wait_until_watchdog_held(proxies)
        timer = release_later(proxies)
        assert lock.extend(SHORT)
        timer.join()
        settled(proxies)
        claimed, held = lock.validity, majority_pttl(nodes, "race")
        assert claimed <= held + 0.05, (claimed, held)
        time.sleep(held + 0.05)
        other = Redlock("race", reentrant=False)
        if lock.owned():  # then nobody else may get it
            assert not other.acquire(blocking=False), "two holders"
        elif other.acquire(blocking=False):
            other.release()
    finally:
        for proxy in proxies:
            proxy.release_held_replies()
        if lock.depth:
            # A lease that ran out reports its loss at release: expected here.
            with contextlib.suppress(LockLostError):
                lock.release()


async def test_async_manual_extension_racing_the_watchdog_keeps_the_nodes_lease(
    proxies: list[FaultProxy], nodes: NodeSet
) -> None:
    """The asyncio twin: ``aextend(0.3)`` racing the watchdog task."""
    lock = Redlock("arace", ttl=TTL, auto_extend=True, max_hold=None)
    assert await lock.aacquire()
    try:
        assert await lock.aextend()  # loads the script: no NOSCRIPT later
        hold_watchdog_replies(proxies)
        await asyncio.to_thread(wait_until_watchdog_held, proxies)
        timer = release_later(proxies)
        assert await lock.aextend(SHORT)
        await asyncio.to_thread(timer.join)
        await asyncio.to_thread(settled, proxies)
        claimed, held = lock.validity, majority_pttl(nodes, "arace")
        assert claimed <= held + 0.05, (claimed, held)
        await asyncio.sleep(held + 0.05)
        other = Redlock("arace", reentrant=False)
        if lock.owned():
            assert not await other.aacquire(blocking=False), "two holders"
        elif await other.aacquire(blocking=False):
            await other.arelease()
    finally:
        for proxy in proxies:
            proxy.release_held_replies()
        if lock.depth:
            with contextlib.suppress(LockLostError):
                await lock.arelease()


def test_a_late_older_extension_never_replaces_a_later_lease(nodes: NodeSet) -> None:
    """EXTEND numbered 2 (30 s) then a delayed EXTEND numbered 1 (0.3 s) arriving
    after it: the node refuses the older one and keeps the 30 s lease; a resend
    of number 2 is applied again (idempotent), an unnumbered one as before."""
    from redlock_django.scripts import EXTEND_SCRIPT

    client = nodes[0].client()
    key = lock_key("late-extension")
    client.hset(key, mapping={"token": "tok.1"})
    client.pexpire(key, 5000)

    def extend(*args: object) -> int:
        return int(client.eval(EXTEND_SCRIPT.source, 1, key, "tok.1", *args))

    assert extend(30000, 2) == 1
    assert extend(300, 1) == 0
    assert client.pttl(key) > 29000
    assert extend(30000, 2) == 1
    assert extend(20000) == 1  # no number: the plain rule
    assert extend(300, 3) == 1 and client.pttl(key) <= 300
    assert int(client.eval(EXTEND_SCRIPT.source, 1, key, "other", 300, 9)) == 0
