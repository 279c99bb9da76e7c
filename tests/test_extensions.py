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
from typing import Any

from harness.held import lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import LockError, LockLostError, Redlock

TTL = 1.2
#: The watchdog's EXTEND carries the TTL in ms as a bulk string of its own.
WATCHDOG_EXTEND = b"$4\r\n1200\r\n"
SHORT = 0.3
#: How long the watchdog's replies are held back after both extensions ran.
HELD_FOR = 0.25


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
        # The nodes first: a pause between the two reads (a busy host, a long
        # collection) then only shrinks what the holder claims.
        held = majority_pttl(nodes, "race")
        claimed = lock.validity
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
        # The nodes first: a pause between the two reads (a busy host, a long
        # collection) then only shrinks what the holder claims.
        held = majority_pttl(nodes, "arace")
        claimed = lock.validity
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


#: The EXTEND of a 0.3 s lease carries "300" as a bulk string of its own.
SHORT_EXTEND = b"$3\r\n300\r\n"


async def test_a_cancelled_aextend_leaves_the_holder_the_shorter_lease(
    proxies: list[FaultProxy], nodes: NodeSet
) -> None:
    """``aextend(0.3)`` runs on every node (the replies are late) and the caller
    is cancelled (``asyncio.timeout``) before they arrive. The nodes now hold a
    0.3 s lease; the holder must not go on claiming its old 10 s one (it did:
    once the keys expired, another owner took the lock while the first still
    said ``owned()``, two holders)."""
    lock = Redlock("cancel-extend", ttl=10.0)
    assert await lock.aacquire()
    try:
        assert await lock.aextend()  # loads the script: no NOSCRIPT round trip
        for proxy in proxies:
            proxy.hold_reply_to(SHORT_EXTEND)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                await lock.aextend(0.3)
        for proxy in proxies:
            proxy.release_held_replies()
        await asyncio.sleep(0.4)  # the nodes' 0.3 s lease has run out
        assert majority_pttl(nodes, "cancel-extend") == 0.0
        other = Redlock("cancel-extend", ttl=10.0)

        def take_and_give_back() -> bool:
            # One thread: the owner of the acquisition releases it.
            got = other.acquire(blocking=False)
            if got:
                other.release()
            return got

        claimed = lock.owned(), round(lock.validity, 1)
        got = await asyncio.to_thread(take_and_give_back)
        assert not (claimed[0] and got), (
            f"two holders: the first claims owned()={claimed[0]} with "
            f"validity {claimed[1]}s, the second acquired={got}"
        )
    finally:
        for proxy in proxies:
            proxy.release_held_replies()
        if lock.depth:
            with contextlib.suppress(LockError):
                await lock.arelease()


def test_an_interrupted_extend_leaves_the_holder_the_shorter_lease(
    proxies: list[FaultProxy], nodes: NodeSet
) -> None:
    """The blocking twin: a KeyboardInterrupt (Ctrl-C, or a signal handler
    raising) lands while ``extend(0.3)`` waits for its replies."""
    import _thread

    assert threading.current_thread() is threading.main_thread()
    lock = Redlock("interrupt-extend", ttl=10.0)
    assert lock.acquire()
    try:
        assert lock.extend()
        for proxy in proxies:
            proxy.hold_reply_to(SHORT_EXTEND)
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        with contextlib.suppress(KeyboardInterrupt):
            lock.extend(0.3)
            time.sleep(5)  # not reached if the interruption hit extend()
        timer.join()
        for proxy in proxies:
            proxy.release_held_replies()
        time.sleep(0.4)
        assert majority_pttl(nodes, "interrupt-extend") == 0.0
        got: list[bool] = []
        done = threading.Event()
        other = Redlock("interrupt-extend", ttl=10.0)

        def second_owner() -> None:
            got.append(other.acquire(blocking=False))
            done.wait(5)
            if got[0]:
                other.release()

        worker = threading.Thread(target=second_owner)
        worker.start()
        try:
            while not got:
                time.sleep(0.01)
            assert not (lock.owned() and got[0]), (
                f"two holders: owned()={lock.owned()} validity="
                f"{lock.validity:.1f}s while another thread acquired"
            )
        finally:
            done.set()
            worker.join()
    finally:
        for proxy in proxies:
            proxy.release_held_replies()
        if lock.depth:
            with contextlib.suppress(LockError):
                lock.release()


def test_the_watchdog_does_not_cut_short_a_longer_manual_extension(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``extend(10)`` on an auto-extended lock with a 1 s TTL: the watchdog's next
    extension shrank the lease back to 1 s. It now waits a third of the lease
    the owner asked for."""
    lock = Redlock("manual-long", ttl=1.0, auto_extend=True)
    assert lock.acquire()
    try:
        assert lock.extend(10.0)
        assert lock.validity > 9.5
        time.sleep(0.5)
        assert lock.validity > 9.0, f"validity {lock.validity:.2f}s after extend(10)"
    finally:
        with contextlib.suppress(LockError):
            lock.release()


def test_a_manual_extension_past_max_hold_is_the_owners_and_outlives_the_cap(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``max_hold`` caps the watchdog's extensions, not the owner's: ``extend(10)``
    was cut at the 1.5 s cap by the watchdog's last, shorter extension, and the
    release raised LockLostError."""
    lock = Redlock("manual-cap", ttl=1.0, auto_extend=True, max_hold=1.5)
    assert lock.acquire()
    assert lock.extend(10.0)
    time.sleep(2.0)  # well inside the 10 s asked for, past max_hold
    held = majority_pttl(nodes, "manual-cap")
    owned = lock.owned()
    lock.release()  # raises LockLostError if the lease was cut at the cap
    assert owned and held > 5, (owned, held)


def test_the_watchdogs_last_capped_extension_never_shortens_an_owners_lease(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """TTL 1.5 s, max_hold 3.3 s; the owner extends to 4 s at once (its lease
    ends at ~3.96 s). The watchdog woke at ~2.96 s and sent its last extension,
    to the cap (0.34 s): the owner's lease was cut to ~3.3 s. It now leaves a
    lease that already runs past the cap alone."""
    lock = Redlock("owner-past-cap", ttl=1.5, auto_extend=True, max_hold=3.3)
    assert lock.acquire()
    try:
        began = time.monotonic()
        assert lock.extend(4.0)
        promised = lock.validity
        time.sleep(max(0.0, 3.1 - (time.monotonic() - began)))
        elapsed = time.monotonic() - began
        left, held = lock.validity, majority_pttl(nodes, "owner-past-cap")
        assert left >= promised - elapsed - 0.1, (
            f"the owner's lease had {promised - elapsed:.2f}s left; "
            f"validity {left:.2f}s, nodes {held:.2f}s"
        )
    finally:
        with contextlib.suppress(LockLostError):
            lock.release()
