"""Wake-ups (hub, reader threads) and fair-queue liveness under faults.

Every fault is injected from outside: signals to waiter processes, CLIENT KILL of
the reader's subscriber connections, FaultProxy, nodes killed or paused, fork().
Bounds are generous (a 2-core host shared with other test runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import LockLostError, Redlock, signals, wake
from redlock_django.keys import handoff_key, lock_key
from redlock_django.protocol import QUEUE_LIFE
from tests._forked import in_forked_child
from tests._waiting import (
    SLOW_RETRY,
    queued,
    result,
    wait_for,
    wait_until_queued,
    wake_hub,
)

pytestmark = pytest.mark.django_db(transaction=False)


# --------------------------------------------------------------------------- helpers


def _holders(nodes: NodeSet, resource: str) -> list[bytes | None]:
    key = lock_key(resource, "redlock")
    return [node.client().hget(key, "token") for node in nodes]


def _fair_channel() -> bytes:
    config = Redlock("x", fair=True)._resolve()
    return (config.spec.wake_head + wake.process_tag()).encode()


def _parked(
    nodes: NodeSet, resources: list[str], settle: float = 0.0, what: str = "subscribed"
) -> None:
    """Until each resource's waiter is queued on every node and this process's
    reader listens on its fair waiters' channel on every node; then ``settle``
    seconds more, so the waiters are asleep in their waits."""
    for resource in resources:
        wait_until_queued(nodes, resource, 1)
    hub, channel = wake_hub(), _fair_channel()
    wait_for(lambda: all(hub.listening(i, channel) for i in range(len(nodes))), what)
    if settle:
        time.sleep(settle)


def _start_waiters(
    resources: list[str],
    errors: list[BaseException],
    lost: dict[str, LockLostError] | None = None,
) -> list[threading.Thread]:
    """One started thread per resource that waits for it (fair, 30 s retry) and
    releases it at once. Errors go to ``errors``; with ``lost``, a release that
    finds the lease ran out goes there instead (see ``_burst``)."""

    def waiter(resource: str) -> None:
        try:
            lock = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
            assert lock.acquire(timeout=60)
            try:
                lock.release()
            except LockLostError as exc:
                if lost is None:
                    raise
                lost[resource] = exc
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(r,)) for r in resources]
    for t in threads:
        t.start()
    return threads


def _kill_subscribers(nodes: NodeSet, which: range | list[int] | None = None) -> int:
    """CLIENT KILL every pub/sub connection on the given nodes; return how many."""
    killed = 0
    for i, node in enumerate(nodes):
        if which is not None and i not in which:
            continue
        client = node.client()
        for c in client.client_list():
            if int(c.get("sub", 0)) > 0 or int(c.get("psub", 0)) > 0:
                with contextlib.suppress(Exception):
                    client.client_kill_filter(_id=c["id"])
                    killed += 1
    return killed


# ------------------------------------------------------------ dead / frozen waiters


def test_a_killed_first_waiter_delays_a_slow_retrying_next_waiter_by_queue_life_only(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    spawn: Callable[..., Any],
    hold: Callable[..., Redlock],
) -> None:
    """docs/fairness.md: a waiter that dies while first in line delays the others
    by less than QUEUE_LIFE plus a round trip: "the next waiter tries again just
    after that entry's expiry (each refusal told it when)". Step 3: a waiter behind
    the first "tries again when its entry is due for a refresh ... or just after
    the first entry expires". The next waiter here has a RETRY_DELAY (6 s) longer
    than QUEUE_LIFE (2 s): it should still get the lock about QUEUE_LIFE after the
    first waiter died, not after its own retry delay."""
    resource = "rw:dead-head-slow-retry"
    holder = hold(resource, fair=True)
    first = spawn("first", resource, "--retry-delay", "0.05")
    wait_until_queued(nodes, resource, 1)
    second = spawn("second", resource, "--retry-delay", "6")
    wait_until_queued(nodes, resource, 2)
    time.sleep(0.3)  # both parked
    os.kill(first.pid, signal.SIGKILL)
    killed = time.monotonic()
    first.wait(5)
    holder.release()
    got = result(second)
    assert got["event"] == "acquired", got
    delay = got["at"] - killed
    assert delay < QUEUE_LIFE + 1.5, f"next waiter waited {delay:.2f}s"


def test_a_waiter_behind_a_live_first_waiter_makes_no_attempt_until_woken(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    spawn: Callable[..., Any],
    hold: Callable[..., Redlock],
) -> None:
    """The cap above is for a first waiter that stopped refreshing its entry. One
    that lives keeps refreshing it: the waiter behind it (30 s retry) learns so
    at its own refreshes and keeps waiting for the release, whose hand-off is its
    only wake-up after the first one (its subscription's confirmation). It makes
    no attempt of its own every QUEUE_LIFE while the lock is held three times
    that long."""
    resource = "rw:live-head-slow-retry"
    # Held through two waiter processes' start-ups and 3 x QUEUE_LIFE: on a busy
    # host (pytest -n 2, a CPU hog) that outlasted the suite's 10 s TTL.
    holder = hold(resource, fair=True, ttl=60)
    first = spawn("first", resource, "--retry-delay", str(SLOW_RETRY))
    wait_until_queued(nodes, resource, 1)
    second = spawn("second", resource, "--retry-delay", str(SLOW_RETRY))
    wait_until_queued(nodes, resource, 2)
    time.sleep(3 * QUEUE_LIFE)
    holder.release()
    a, b = result(first), result(second)
    assert a["event"] == b["event"] == "acquired", (a, b)
    assert a["at"] < b["at"]
    for got in (a, b):
        assert got["wakeups"] == got["attempts"] - 1 + got["handed"], got


def test_a_frozen_waiter_handed_the_lock_never_holds_it_together_with_the_next(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    spawn: Callable[..., Any],
    hold: Callable[..., Redlock],
) -> None:
    """The release hands the lock to a SIGSTOPped first waiter (its reader still
    listens). The next waiter takes the lock once the handed lease ran out; the
    frozen one is resumed while the next holds it. Their holds must not overlap:
    the resumed waiter must not believe the stale hand-off is its grant."""
    resource = "rw:frozen-handed"
    holder = hold(resource, fair=True)
    first = spawn("first", resource, "--retry-delay", "0.05", "--hold", "0.5")
    wait_until_queued(nodes, resource, 1)
    second = spawn("second", resource, "--retry-delay", "0.05", "--hold", "2.5")
    wait_until_queued(nodes, resource, 2)
    time.sleep(0.3)
    os.kill(first.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    holder.release()
    handed = _majority_token(nodes, resource)
    assert handed is not None  # handed to the frozen waiter
    # the next waiter got the lock: another token on a majority
    wait_for(lambda: _majority_token(nodes, resource) not in (None, handed),
              "the second waiter holds", 10)  # fmt: skip
    time.sleep(0.2)
    os.kill(first.pid, signal.SIGCONT)
    a, b = result(first), result(second)
    assert a["event"] == b["event"] == "acquired", (a, b)
    assert b["at"] - stopped < QUEUE_LIFE + 1.5, b["at"] - stopped
    # no overlap: the first's hold starts after the second's 2.5 s hold ended
    assert a["at"] >= b["at"] + 2.5 - 0.05, (a, b)


def _majority_token(nodes: NodeSet, resource: str) -> bytes | None:
    held = [h for h in _holders(nodes, resource) if h is not None]
    for token in set(held):
        if held.count(token) >= len(nodes) // 2 + 1:
            return token.rsplit(b".", 1)[0]
    return None


# ------------------------------------------------------------ reader connection loss


@pytest.mark.parametrize("how", ["client-kill", "node-restart"])
def test_a_reader_whose_connections_dropped_reconnects_and_wakes_later_waiters(
    how: str,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """A waiter is parked (30 s retry); every subscriber connection of the reader
    is killed (CLIENT KILL) or the nodes restart. The reader must reconnect and
    resubscribe; a release after that wakes the waiter at once."""
    resource = "rw:reader-drop-" + how
    holder = Redlock(resource)
    assert holder.acquire(blocking=False)
    waiter = Redlock(resource, retry_delay=SLOW_RETRY)
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(waiter.acquire(timeout=40)))
    t.start()
    hub = wake_hub()
    channel = lock_key(resource, "redlock").encode()
    wait_for(lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
              "subscribed")  # fmt: skip
    time.sleep(0.2)
    if how == "client-kill":
        assert _kill_subscribers(nodes) >= len(nodes)
    else:
        for node in nodes[:2]:  # a minority: the lock survives on the rest
            node.crash_and_restart()
        _kill_subscribers(nodes, [2, 3, 4])
    wait_for(lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
              "resubscribed", 10)  # fmt: skip
    released = time.monotonic()
    holder.release()
    t.join(40)
    assert results == [True]
    took = acquisitions[-1]["waited"]
    assert time.monotonic() - released < 5, "woken only by the 30 s retry"
    assert took < SLOW_RETRY


@pytest.mark.parametrize("how", ["client-kill", "minority-restart"])
def test_a_fair_waiter_whose_reader_was_killed_while_parked_is_woken_after_reconnect(
    how: str,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """As above, a fair waiter (its process channel), with the hand-off."""
    resource = "rw:fair-reader-drop"
    holder = Redlock(resource, fair=True)
    assert holder.acquire(blocking=False)
    waiter = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(waiter.acquire(timeout=40)))
    t.start()
    _parked(nodes, [resource], 0.2)
    hub, channel = wake_hub(), _fair_channel()
    if how == "client-kill":
        assert _kill_subscribers(nodes) >= len(nodes)
    else:
        for node in nodes[:2]:
            node.crash_and_restart()
    wait_for(lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
              "resubscribed", 10)  # fmt: skip
    released = time.monotonic()
    holder.release()
    t.join(40)
    assert results == [True]
    assert time.monotonic() - released < 5
    assert acquisitions[-1]["handed"] is True


def test_a_waiter_killed_right_after_it_was_handed_the_lock_delays_the_next_briefly(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    spawn: Callable[..., Any],
    hold: Callable[..., Redlock],
) -> None:
    """The release hands the lock to the first waiter, which is SIGKILLed as soon
    as it reports the lock (before its handed lease is extended to the TTL at half
    of it). The handed lease is at most what was left of its queue entry: the next
    waiter gets the lock within about QUEUE_LIFE."""
    resource = "rw:killed-after-handoff"
    holder = hold(resource, fair=True)
    # A long retry delay: the first in line must get the lock handed over by the
    # release, not win it with a retry of its own that crosses the release (then
    # its lease is the whole TTL and the bound below does not apply).
    first = spawn("first", resource, "--retry-delay", "30", "--hold", "30")
    wait_until_queued(nodes, resource, 1)
    second = spawn("second", resource, "--retry-delay", "0.05")
    wait_until_queued(nodes, resource, 2)
    time.sleep(0.3)
    holder.release()
    assert first.stdout is not None
    line = json.loads(first.stdout.readline())
    os.kill(first.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert line["event"] == "acquired" and line["handed"] is True, line
    got = result(second)
    assert got["event"] == "acquired", got
    assert got["at"] - killed < QUEUE_LIFE + 1.0, got["at"] - killed


# ----------------------------------------------------------------------------- fork


def test_a_forked_child_waits_with_its_own_reader_and_leaves_the_parents_wake_ups(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    hold: Callable[..., Redlock],
    acquisitions: list[dict[str, Any]],
) -> None:
    """The parent has a fair waiter parked (its reader thread runs) when it forks.
    The child waits for another fair lock: the parent's release wakes it through a
    reader of the child's own (30 s retry otherwise). The parent's own waiter is
    still woken by its release afterwards (the child consumed nothing of it)."""
    a_holder = hold("rw:fork-a", fair=True)
    b_holder = hold("rw:fork-b", fair=True)
    parent_results: list[bool] = []
    pw = Redlock("rw:fork-a", fair=True, retry_delay=SLOW_RETRY)

    def parent_wait() -> None:
        parent_results.append(pw.acquire(timeout=40))
        if parent_results[-1]:
            pw.release()

    t = threading.Thread(target=parent_wait)
    t.start()
    _parked(nodes, ["rw:fork-a"], what="parent subscribed")
    parent_tag = wake.process_tag()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            got: dict[str, Any] = {}

            def on(**kwargs: Any) -> None:
                got.update(handed=kwargs["handed"], wakeups=kwargs["wakeups"],
                           attempts=kwargs["attempts"])  # fmt: skip

            signals.lock_acquired.connect(on, weak=False)
            lock = Redlock("rw:fork-b", fair=True, retry_delay=SLOW_RETRY)
            began = time.monotonic()
            ok = lock.acquire(timeout=40)
            got.update(ok=ok, took=time.monotonic() - began, tag=wake.process_tag())
            if ok:
                lock.release()
            os.write(w, json.dumps(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        wait_until_queued(nodes, "rw:fork-b", 1)
        time.sleep(0.5)  # the child's reader subscribed (else the retry would show)
        # the parent's release first: its waiter must be woken at once
        released = time.monotonic()
        a_holder.release()
        t.join(10)
        assert parent_results == [True]
        assert time.monotonic() - released < 5
        b_holder.release()
        _, status = os.waitpid(pid, 0)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    child = json.loads(data)
    assert child["ok"] is True
    assert child["tag"] != parent_tag
    assert child["took"] < 10, child  # woken, not its 30 s retry
    assert child["wakeups"] >= 1, child


# ------------------------------------------------------- many waiters, one process


def test_many_fair_waiters_of_one_process_on_one_and_many_locks_are_each_served(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """Twelve waiters share one hub: six on one lock, six each on a lock of its
    own. Every one is woken by the release it waits for (30 s retry otherwise),
    the six on one lock in the order they queued, and the hub's counter of
    watching waiters is back to 0 at the end."""
    same = "rw:many-same"
    others = [f"rw:many-{k}" for k in range(6)]
    holders = {r: Redlock(r, fair=True) for r in [same, *others]}
    for lock in holders.values():
        assert lock.acquire(blocking=False)
    order: list[int] = []
    errors: list[BaseException] = []

    def wait_same(k: int) -> None:
        try:
            lock = Redlock(same, fair=True, retry_delay=SLOW_RETRY)
            assert lock.acquire(timeout=60)
            order.append(k)
            time.sleep(0.02)
            lock.release()
        except BaseException as exc:
            errors.append(exc)

    threads = []
    for k in range(6):
        t = threading.Thread(target=wait_same, args=(k,))
        t.start()
        threads.append(t)
        wait_until_queued(nodes, same, k + 1)
    for resource in others:
        threads += _start_waiters([resource], errors)
        wait_until_queued(nodes, resource, 1)
    time.sleep(0.5)
    began = time.monotonic()
    for lock in holders.values():
        lock.release()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert order == list(range(6))
    assert time.monotonic() - began < 15, "someone slept out its 30 s retry"
    assert len(acquisitions) == 7 + 12  # the holders and the waiters
    for got in acquisitions:
        assert got["waited"] < SLOW_RETRY, got
    wait_for(lambda: wake.watching() == 0, "no waiter watches any more", 5)


# ------------------------------------------------ giving up while handed the lock


def test_a_waiter_whose_timeout_races_the_hand_off_never_strands_the_lock(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
) -> None:
    """The first waiter's timeout runs out around the moment the release hands it
    the lock. Whatever it returns, the lock must end up with the next waiter (30 s
    retry) promptly: a give-up deletes the lock handed to it and wakes the next,
    and a success releases normally. Repeated with release times around the
    deadline."""
    slow: list[tuple[float, float]] = []
    for k, offset in enumerate([-0.06, -0.03, -0.015, -0.005, 0.0, 0.005, 0.015,
                                0.03, 0.06]):  # fmt: skip
        resource = f"rw:timeout-race-{k}"
        holder = Redlock(resource, fair=True)
        assert holder.acquire(blocking=False)
        first = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
        second = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
        outcome: dict[str, Any] = {}

        def run_first(
            first: Redlock = first, outcome: dict[str, Any] = outcome
        ) -> None:
            outcome["first"] = first.acquire(timeout=1.0)
            outcome["first_done"] = time.monotonic()
            if outcome["first"]:
                first.release()

        def run_second(
            second: Redlock = second, outcome: dict[str, Any] = outcome
        ) -> None:
            outcome["second"] = second.acquire(timeout=40)
            outcome["second_at"] = time.monotonic()
            if outcome["second"]:
                second.release()

        began = time.monotonic()
        t1 = threading.Thread(target=run_first)
        t1.start()
        wait_until_queued(nodes, resource, 1)
        t2 = threading.Thread(target=run_second)
        t2.start()
        wait_until_queued(nodes, resource, 2)
        pause = began + 1.0 + offset - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        holder.release()
        t1.join(40)
        t2.join(40)
        assert outcome.get("second") is True, (offset, outcome)
        lag = outcome["second_at"] - outcome["first_done"]
        if lag > 3:
            slow.append((offset, lag))
        wait_for(lambda r=resource: _holders(nodes, r) == [None] * len(nodes),
                  "the lock is free", 5)  # fmt: skip
    assert not slow, slow


def test_asyncio_waiters_cancelled_around_the_hand_off_never_strand_the_lock(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
) -> None:
    """An asyncio fair waiter is cancelled at various moments around the release
    that hands it the lock; the next waiter (30 s retry) must get the lock
    promptly, and no key may be left behind."""
    slow: list[tuple[float, float, bool]] = []

    async def one(k: int, offset: float) -> None:
        resource = f"rw:acancel-{k}"
        holder = Redlock(resource, fair=True)
        assert await holder.aacquire(blocking=False)
        first = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
        second = Redlock(resource, fair=True, retry_delay=SLOW_RETRY)
        got_first = False

        async def run_first() -> None:
            nonlocal got_first
            assert await first.aacquire(timeout=20)
            got_first = True
            try:
                await asyncio.sleep(0.05)
            finally:
                await first.arelease()

        async def run_second() -> float:
            assert await second.aacquire(timeout=40)
            at = time.monotonic()
            await second.arelease()
            return at

        t1 = asyncio.create_task(run_first())
        while min(queued(nodes, resource)) < 1:
            await asyncio.sleep(0.01)
        t2 = asyncio.create_task(run_second())
        while min(queued(nodes, resource)) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        await holder.arelease()
        if offset > 0:
            await asyncio.sleep(offset)
        t1.cancel()
        cancelled = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await t1
        at = await asyncio.wait_for(t2, 40)
        if at - cancelled > 3:
            slow.append((offset, at - cancelled, got_first))
        for _ in range(200):
            if _holders(nodes, resource) == [None] * len(nodes):
                break
            await asyncio.sleep(0.02)
        assert _holders(nodes, resource) == [None] * len(nodes), resource

    async def main() -> None:
        for k, offset in enumerate([0, 0, 0.0005, 0.001, 0.002, 0.004, 0.008]):
            await one(k, offset)

    asyncio.run(main())
    assert not slow, slow


# ------------------------------------- a release heard between an attempt and a wait


def test_a_release_heard_between_a_refused_attempt_and_the_wait_ends_the_wait(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """Hub.watch: "A release for it heard after monotonic time ``since`` wakes it
    at once: the waiter's last attempt could not see it, and it was not yet
    listening." The lock's channel is still subscribed in this process (an earlier
    waiter left it less than LINGER ago). A (non-fair) waiter's first attempt is
    refused; its reply from one node is late (held by a proxy), and while it waits
    for it the holder releases: this process's reader hears the release. The
    waiter then starts waiting: the release it could not see should end the wait
    at once, not its 30 s retry delay (capped here by its 8 s timeout)."""
    from redlock_django.scripts import ACQUIRE_SCRIPT

    resource = "rw:gap"
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(node.port)) for node in nodes]
        settings.REDLOCK = {**redlock_settings, "NODES": [p.url for p in proxies],
                            "NODE_TIMEOUT": 0.5}  # fmt: skip
        hub = wake_hub()
        channel = Redlock(resource)._resolve().spec.key.encode()
        # An earlier waiter subscribes the channel, gets the lock, and leaves.
        first_holder = Redlock(resource)
        assert first_holder.acquire(blocking=False)
        early = Redlock(resource, retry_delay=SLOW_RETRY)
        got: list[bool] = []

        def early_wait() -> None:
            got.append(early.acquire(timeout=10))
            early.release()

        t = threading.Thread(target=early_wait)
        t.start()
        wait_for(lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
                  "subscribed")  # fmt: skip
        first_holder.release()
        t.join(10)
        assert got == [True]
        # The channel lingers subscribed (LINGER); the lock is taken again.
        holder = Redlock(resource)
        assert holder.acquire(blocking=False)
        assert all(hub.listening(i, channel) for i in range(len(nodes)))
        proxies[4].hold_reply_to(ACQUIRE_SCRIPT.sha.encode(), count=1)
        waiter = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
        results: list[bool] = []
        began = time.monotonic()
        w = threading.Thread(target=lambda: results.append(waiter.acquire(timeout=8)))
        w.start()
        assert proxies[4].wait_for_held_replies(1, 5)
        holder.release()  # heard by this process's reader at once
        time.sleep(0.05)
        proxies[4].release_held_replies()
        w.join(20)
        took = time.monotonic() - began
        assert results == [True]
        assert all(hub.listening(i, channel) for i in range(len(nodes)))
        assert took < 4, f"the waiter slept {took:.2f}s although the lock was free"
        with contextlib.suppress(Exception):
            waiter.release()


# ------------------------------------- many releases for one process at once


#: The bursts' NODE_TIMEOUT: 256 threads and five servers on two busy cores can
#: keep three nodes' replies past the suite's 0.1 s, and a majority that did not
#: answer in time is an outage (QuorumUnavailableError), which is not what these
#: tests are about. (0.2 s: QUEUE_LIFE must be at least ten of them.)
BURST_NODE_TIMEOUT = 0.2


def _burst(
    nodes: NodeSet, acquisitions: list[dict[str, Any]], count: int
) -> tuple[float, list[dict[str, Any]]]:
    """``count`` fair locks, each with one waiter of this process parked (30 s
    retry), released at the same moment by ``count`` holder threads. Returns how
    long until every waiter had its lock, and the waiters' ``lock_acquired``."""
    resources = [f"rw:burst-{count}-{k}" for k in range(count)]
    barrier = threading.Barrier(count + 1)
    go = threading.Event()
    errors: list[BaseException] = []
    lost: dict[str, LockLostError] = {}

    def holder(resource: str) -> None:
        try:
            lock = Redlock(resource, fair=True)
            # Nobody else wants these locks yet; a timeout, not blocking=False,
            # so that a first attempt late on a busy host is tried again.
            assert lock.acquire(timeout=10)
            barrier.wait(30)
            go.wait(60)
            lock.release()
        except BaseException as exc:
            errors.append(exc)

    # A handed lease is what was left of the waiter's queue entry
    # (docs/fairness.md): a waiter thread that reaches its grant late (256 threads
    # on 2 busy cores in CI) may hold little of it, and its release says honestly
    # that it ran out. It was woken and held its lock, which is what this checks;
    # a lost hold that was not handed over (a TTL of 10 s) fails below.
    holders = [threading.Thread(target=holder, args=(r,)) for r in resources]
    for t in holders:
        t.start()
    barrier.wait(30)
    waiters = _start_waiters(resources, errors, lost)
    _parked(nodes, resources, 1.0)
    began = time.monotonic()
    go.set()
    for t in holders + waiters:
        t.join(60)
    assert not errors, errors
    took = time.monotonic() - began
    got = [a for a in acquisitions if a["resource"] in resources and a["attempts"]]
    handed = {a["resource"] for a in got if a["handed"]}
    assert set(lost) <= handed, {r: lost[r] for r in set(lost) - handed}
    if lost:
        print(f"{len(lost)} of {count} handed holds ran out before their release")
    waited = [
        {k: a[k] for k in ("resource", "handed", "attempts", "wakeups", "waited")}
        for a in got
        if a["waited"] > 0.5
    ]
    assert len(waited) == count, len(waited)
    return took, waited


@pytest.mark.parametrize("queue_life", [None, 30.0], ids=["default", "no-refresh"])
def test_many_simultaneous_fair_releases_for_one_process_each_wake_their_waiter(
    queue_life: float | None,
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """128 fair locks, one waiter of this process each (30 s retry), released at
    once (more releases in flight than ``wake.SEEN`` was, 32): every release
    names its waiter, so every waiter must be woken (with a hand-off or not) and
    hold its lock within seconds. None may be left to sleep out its retry delay:
    nothing was missed, every message reached this process's reader.
    ("no-refresh": a QUEUE_LIFE of 30 s, so that no waiter's timed wait runs out
    around the releases.)"""
    settings.REDLOCK = {**redlock_settings, "NODE_TIMEOUT": BURST_NODE_TIMEOUT}
    if queue_life is not None:
        settings.REDLOCK = {**settings.REDLOCK, "QUEUE_LIFE": queue_life}
    took, waited = _burst(nodes, acquisitions, 128)
    stalled = [a for a in waited if a["waited"] - 1.0 > 8]
    assert not stalled and took < 10, (round(took, 2), len(stalled), stalled[:3])


def test_many_simultaneous_fair_releases_for_one_process_each_hand_over(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """Twenty-four fair locks released at once, each handing its lock to the waiter
    it names (docs/fairness.md, "The hand-off"; none of the listed reasons for no
    hand-off applies): every waiter should hold its lock handed over. (A QUEUE_LIFE
    of 30 s: a handed lease is what is left of the entry, and with 2 s a waiter
    thread starved on a busy host could read its messages after it ran out, a
    listed reason.)"""
    settings.REDLOCK = {
        **redlock_settings,
        "QUEUE_LIFE": 30.0,
        "NODE_TIMEOUT": BURST_NODE_TIMEOUT,
    }
    took, waited = _burst(nodes, acquisitions, 24)
    assert took < 10, (took, waited)
    not_handed = [a for a in waited if not a["handed"]]
    assert not not_handed, f"{len(not_handed)}/24 not handed: {not_handed[:4]}"


@pytest.mark.parametrize(
    "records", ["kept", "lost-on-the-fast-nodes"], ids=["records", "fast-lost"]
)
def test_a_fair_release_reaching_the_nodes_at_different_times_still_hands_over(
    records: str,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """The fair variant of test_wake's "release reaching the nodes at different
    times": the holder reaches three of five nodes through proxies that hold its
    requests 50 ms (a holder thread descheduled mid-release does the same). Every
    node names the same waiter, and each hands it the lock: the waiter should hold
    it handed over (docs/fairness.md: "the waiter holds it without an attempt of its
    own"; "nodes that named different waiters" is the listed exception, not this),
    not be woken by wake.GRACE after the first two messages into an attempt that
    the still-held majority refuses. ("fast-lost": the two fast nodes lost the
    waiter's hand-off record, as a node restarted empty does, so their messages
    name it without a hand-off; the three late ones still hand it over.)"""
    resource = "rw:fair-partial"
    with contextlib.ExitStack() as stack:
        slow = [stack.enter_context(FaultProxy(node.port)) for node in list(nodes)[2:]]
        urls = [node.url for node in list(nodes)[:2]] + [proxy.url for proxy in slow]
        holder = Redlock(resource, nodes=urls, fair=True)
        assert holder.acquire(blocking=False)
        waiter = Redlock(resource, fair=True, retry_delay=SLOW_RETRY, retry_jitter=0)
        assert waiter._resolve().spec.key == holder._resolve().spec.key
        results: list[bool] = []

        def wait() -> None:
            results.append(waiter.acquire(timeout=20))
            waiter.release()

        t = threading.Thread(target=wait)
        t.start()
        _parked(nodes, [resource], 0.3)
        if records != "kept":
            for node in list(nodes)[:2]:
                assert node.client().delete(handoff_key(resource, "redlock")) == 1
        for proxy in slow:
            proxy.delay(0, requests=0.05)
        holder.release()
        t.join(20)
    assert results == [True]
    got = [a for a in acquisitions if a["lock"] is waiter][-1]
    seen = {k: got[k] for k in ("handed", "attempts", "wakeups", "waited")}
    assert got["handed"] is True, seen
    # its first refused attempt, and at most one more after its subscription's
    # confirmation woke it (tests/test_fair.py allows the same)
    assert got["attempts"] <= 2, seen


# ------------------------------------- asyncio: a wake-up that meets the wait's timer


def test_an_asyncio_hand_off_delivered_while_the_loop_was_busy_is_not_dropped(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """An asyncio fair waiter (30 s retry, first in line) is parked; its event loop
    is then busy for 0.9 s (a blocking call in some other task), long enough for
    its wait's refresh timer to fall due. During that time the holder releases and
    hands it the lock; the reader delivers the hand-off and wakes the waiter
    (``AsyncWatch.fire``). When the loop runs again, the waiter must take the lock
    it was handed (or at least try at once): the wake-up was heard. It must not
    go on sleeping towards its 30 s retry while the whole queue waits."""
    resource = "rw:async-busy-loop"
    holder = Redlock(resource, fair=True)
    assert holder.acquire(blocking=False)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    waiter = Redlock(resource, fair=True, retry_delay=SLOW_RETRY, retry_jitter=0)

    async def take() -> float:
        assert await waiter.aacquire(timeout=12)
        at = time.monotonic()
        await waiter.arelease()
        return at

    try:
        future = asyncio.run_coroutine_threadsafe(take(), loop)
        _parked(nodes, [resource], 0.5)  # parked, past its subscription's confirmation
        # Busy longer than a refresh period (QUEUE_LIFE / 3), well within the
        # handed lease (at least QUEUE_LIFE * 2 / 3 at the release).
        loop.call_soon_threadsafe(time.sleep, 0.9)
        time.sleep(0.15)
        released = time.monotonic()
        holder.release()
        at = future.result(timeout=40)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
    got = [a for a in acquisitions if a["lock"] is waiter][-1]
    seen = {k: got[k] for k in ("handed", "attempts", "wakeups", "waited")}
    assert at - released < 5, (at - released, seen)


def test_a_frozen_first_waiter_resumed_within_its_handed_lease_takes_the_lock(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    spawn: Callable[..., Any],
    hold: Callable[..., Redlock],
) -> None:
    """The thread flavour of the busy loop: the first waiter's process (30 s retry)
    is frozen with SIGSTOP for 1 s, across its refresh timer; the release during
    the freeze hands it the lock (its reader still listens). Resumed well within
    the handed lease, its reader reads the hand-off and wakes it: it should hold
    the lock at once, not sleep on towards its retry (capped by an 8 s timeout)
    while everyone behind it waits. Repeated: the wake-up races the timer."""
    stalls = []
    for k in range(4):
        resource = f"rw:frozen-resumed-{k}"
        holder = hold(resource, fair=True)
        first = spawn("first", resource, "--retry-delay", str(SLOW_RETRY),
                      "--timeout", "8")  # fmt: skip
        wait_until_queued(nodes, resource, 1)
        time.sleep(0.8)  # parked, past its subscription's confirmation
        os.kill(first.pid, signal.SIGSTOP)
        time.sleep(0.3)
        holder.release()
        time.sleep(0.7)
        os.kill(first.pid, signal.SIGCONT)
        resumed = time.monotonic()
        got = result(first)
        if got["event"] != "acquired" or got["at"] - resumed > 3:
            stalls.append((k, got, got.get("at", 0) - resumed))
    assert not stalls, stalls


def test_forty_fair_releases_in_flight_at_once_for_one_process_wake_every_waiter(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """Forty fair locks, one waiter of this process each (30 s retry). The holders
    are tasks of one event loop that release all forty at once; they reach nodes
    2, 3 and 4 through proxies that hold requests 0.1, 0.2 and 0.3 s (slow links:
    each release's messages come from nodes 0-1 first, then one node at a time).
    Every release names its waiter, and every message reaches this process's
    reader: every waiter must be woken and hold its lock within seconds, not
    sleep out its 30 s retry."""
    count = 40
    resources = [f"rw:inflight-{k}" for k in range(count)]
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    errors: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        slow = [stack.enter_context(FaultProxy(node.port)) for node in list(nodes)[2:]]
        urls = [node.url for node in list(nodes)[:2]] + [proxy.url for proxy in slow]
        go = asyncio.Event()

        async def hold_all() -> None:
            locks = [Redlock(r, fair=True, nodes=urls) for r in resources]

            async def one(lock: Redlock) -> None:
                # Blocking: forty first attempts at once, three nodes through the
                # proxies' threads, can miss NODE_TIMEOUT on a busy host (CI).
                assert await lock.aacquire(timeout=10)
                await go.wait()
                await lock.arelease()

            tasks = [asyncio.create_task(one(lock)) for lock in locks]
            await asyncio.gather(*tasks)

        holding = asyncio.run_coroutine_threadsafe(hold_all(), loop)
        for r in resources:
            wait_for(lambda r=r: all(h is not None for h in _holders(nodes, r)),
                      "held")  # fmt: skip

        waiters = _start_waiters(resources, errors)
        _parked(nodes, resources, 1.0)
        for k, proxy in enumerate(slow, start=1):
            proxy.delay(0, requests=0.1 * k)  # nodes 2, 3, 4: 0.1, 0.2, 0.3 s late
        began = time.monotonic()
        loop.call_soon_threadsafe(go.set)
        holding.result(30)
        for t in waiters:
            t.join(60)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(5)
    loop.close()
    assert not errors, errors
    took = time.monotonic() - began
    stalled = [
        {k: a[k] for k in ("resource", "handed", "attempts", "wakeups", "waited")}
        for a in acquisitions
        if a["resource"] in resources and a["waited"] > 9
    ]
    assert not stalled and took < 10, (round(took, 2), len(stalled), stalled[:3])


def test_waiters_behind_a_holder_kept_past_queue_life_sleep_instead_of_polling(
    redlock_settings: dict[str, Any],
    settings: Any,
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """A waiter that was handed the lock keeps its queue entry at the head while
    it holds, unrefreshed: QUEUE_LIFE later the entry has expired, and the
    refusals the waiters behind get (-1, held) still count it ahead of them with
    no life left. Those waiters must keep sleeping (a release wakes them), not
    retry every BEHIND_SLACK: here the holder keeps the lock 2 s, three times
    QUEUE_LIFE, and the waiter behind must not try more than its retry delay
    allows (0.2 s: about 10 attempts)."""
    settings.REDLOCK = {
        **redlock_settings,
        "FAIR": True,
        "QUEUE_LIFE": 0.6,
        "RETRY_DELAY": 0.2,
        "RETRY_JITTER": 0.0,
    }
    resource = "rw:long-hold"
    first = Redlock(resource)
    assert first.acquire(blocking=False)
    second = Redlock(resource)
    third = Redlock(resource)
    held = threading.Event()
    results: list[bool] = []

    def hold_long() -> None:
        results.append(second.acquire(timeout=20))
        held.set()
        time.sleep(2.0)
        second.release()

    def wait_behind() -> None:
        results.append(third.acquire(timeout=20))
        third.release()

    holder = threading.Thread(target=hold_long)
    holder.start()
    wait_until_queued(nodes, resource, 1)
    first.release()
    assert held.wait(10)
    behind = threading.Thread(target=wait_behind)
    behind.start()
    holder.join(20)
    behind.join(20)
    assert results == [True, True]
    got = [a for a in acquisitions if a["lock"] is third][-1]
    assert got["attempts"] <= 20, {k: got[k] for k in ("attempts", "wakeups")}


class _Interrupted(Exception):
    """What the test's signal handler raises (as Celery's soft time limit does)."""


def _thread_creation_line() -> int:
    """The line of ``Thread.start`` that creates the OS thread."""
    lines, first = inspect.getsourcelines(threading.Thread.start)
    for offset, line in enumerate(lines):
        if "_start_new_thread(" in line or "_start_joinable_thread(" in line:
            return first + offset
    raise AssertionError("Thread.start creates no thread this test knows of")


def _reader_start_interrupted(urls: list[str]) -> tuple[str, int, float]:
    """In a forked child: a signal handler raises only when it lands in a wake-up
    reader's ``Thread.start`` before the thread exists; each round is a new set of
    pools (so a new hub, whose first waiter starts its reader). After the first
    round so interrupted, a waiter on the same hub (30 s retry delay) waits for a
    release at most 0.2 s away: return how that went, the round and the wait."""
    from redlock_django.readers import Reader

    creation = _thread_creation_line()
    start_code = threading.Thread.start.__code__

    ticking: list[bool] = []

    def raise_in_reader_start(signum: int, frame: Any) -> None:
        # One-shot, armed again as the handler ends while ``ticking``: ticks of an
        # interval timer starve the program once a handler outlasts one (a slower
        # machine, Python 3.13: test_holds' woken-grant sweeps did).
        shot = (
            frame is not None
            and frame.f_code is start_code
            and frame.f_lineno < creation
            and isinstance(frame.f_locals.get("self"), Reader)
        )
        if shot:
            ticking.clear()
            raise _Interrupted("interrupted by a signal handler")
        if ticking:
            signal.setitimer(signal.ITIMER_REAL, 0.00002)

    signal.signal(signal.SIGALRM, raise_in_reader_start)
    for round_ in range(200):
        # A pool set (and hub) of its own: NODE_TIMEOUT is part of its key.
        config: dict[str, Any] = {
            "nodes": urls,
            "node_timeout": 1 + round_ / 1000,
            "reentrant": False,
        }
        holder = Redlock("wl:reader-start", **config)
        assert holder.acquire(blocking=False)
        waiter = Redlock("wl:reader-start", retry_delay=SLOW_RETRY, **config)
        try:
            ticking.append(True)
            signal.setitimer(signal.ITIMER_REAL, 0.00002)
            waiter.acquire(timeout=0.02)
        except _Interrupted:
            break
        finally:
            ticking.clear()
            signal.setitimer(signal.ITIMER_REAL, 0)
        holder.release()
    else:
        return "never interrupted", round_, 0.0
    holder.release()
    held = threading.Event()

    def hold_briefly() -> None:  # a lock is released by the thread holding it
        with Redlock("wl:reader-start", **config):
            held.set()
            time.sleep(0.2)

    releaser = threading.Thread(target=hold_briefly)
    releaser.start()
    held.wait(5)
    next_waiter = Redlock("wl:reader-start", retry_delay=SLOW_RETRY, **config)
    began = time.monotonic()
    got = next_waiter.acquire(timeout=5)
    took = time.monotonic() - began
    releaser.join()
    if got:
        next_waiter.release()
    return ("acquired" if got else "timed out"), round_, took


def test_a_waiter_interrupted_while_starting_the_reader_leaves_wake_ups_working(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A signal handler's exception (Ctrl-C, a Celery soft time limit) landing in
    the wake-up reader's ``Thread.start`` before the thread exists ends that
    ``acquire()``, and the hub must not keep the reader that never ran: it did,
    and every later waiter of that process (a Celery worker's child runs many
    tasks) slept out its retry delay, woken by no release, for good."""
    report = in_forked_child(
        functools.partial(_reader_start_interrupted, nodes.urls[:1]), 90
    )
    assert report.outcome == "done", report
    outcome, rounds, took = report.value
    assert outcome == "acquired", (outcome, rounds)
    assert took < 2.0, f"the next waiter was woken after {took:.2f} s (release: 0.2 s)"


def _at_a_timed_out_wait_clearing(
    pause: Callable[[], None], paused: list[bool]
) -> Callable[..., None]:
    """A trace function (``sys.settrace``) that, once, calls ``pause()`` where a
    waiter's ``SyncWatch.wait`` that timed out (its event found unset) calls the
    event's ``clear()``: a breakpoint, holding the waiter there meanwhile."""
    clear_code = threading.Event.clear.__code__
    wait_code = wake.SyncWatch.wait.__code__

    def breakpoint_(frame: Any, event: str, arg: Any) -> None:
        if paused or event != "call" or frame.f_code is not clear_code:
            return None
        waiting = frame.f_back
        if waiting is None or waiting.f_code is not wait_code:
            return None
        if waiting.f_locals.get("woken") is not False:
            return None
        paused.append(True)
        pause()
        return None

    return breakpoint_


def _acquire_held_at_the_clearing(
    waiter: Redlock,
    hold: Callable[[], None],
    holding: threading.Event,
    pause: Callable[[], None],
) -> tuple[str, float]:
    """Start ``hold`` in a thread, and once it holds, ``waiter.acquire()`` in this
    thread with ``pause()`` run at the clearing of a timed-out wait
    (``_at_a_timed_out_wait_clearing``). ``pause`` must let ``hold`` end. Return
    how the acquisition ended and when (monotonic)."""
    paused: list[bool] = []
    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    sys.settrace(_at_a_timed_out_wait_clearing(pause, paused))
    try:
        got = waiter.acquire(timeout=20)
    finally:
        sys.settrace(None)
        if not paused:
            pause()  # the holder must still end
        holder.join(10)
    acquired = time.monotonic()
    if got:
        waiter.release()
    if not paused:
        return "never paused", acquired
    return ("acquired" if got else "timed out"), acquired


def _wake_up_lost_to_a_timed_out_wait(urls: list[str]) -> tuple[str, float]:
    """In a forked child: a release's wake-up reaches a barging lock's only waiter
    of the process (the main thread) just as its timed wait ends, between the
    wait's last look at its event and the clearing of it. Then the holder takes
    the lock again, and releases it 0.3 s later, for good. Return whether that
    moment came and how long after the last release the waiter acquired (its
    retry delay is 1 s).

    The waiter is paused at that moment as a debugger's breakpoint would pause
    it: a trace function (``sys.settrace``) sees the call of the event's
    ``clear()`` from a wait that timed out, and holds the thread there while the
    holder releases and the reader thread delivers the release."""
    resource = "wl:timeout-race"
    config: dict[str, Any] = {"nodes": urls}
    holding, release_now, retaken = (threading.Event() for _ in range(3))
    last_release: list[float] = []

    def hold() -> None:  # a lock is released by the thread holding it
        holder = Redlock(resource, **config)
        assert holder.acquire(blocking=False)
        holding.set()
        if release_now.wait(30):
            holder.release()
            assert holder.acquire(timeout=5)  # barges in while the waiter is held
            retaken.set()
            time.sleep(0.3)
        last_release.append(time.monotonic())
        holder.release()

    def pause() -> None:
        release_now.set()
        retaken.wait(10)
        # The release's messages reach this process's reader meanwhile, and it
        # wakes the waiter: the one waiter of the process free to wake.
        time.sleep(0.2)

    waiter = Redlock(resource, retry_delay=1.0, retry_jitter=0, **config)
    outcome, acquired = _acquire_held_at_the_clearing(waiter, hold, holding, pause)
    return outcome, acquired - last_release[0]


def test_a_wake_up_that_races_the_end_of_a_timed_wait_is_not_lost_for_good(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A release naming nobody wakes the first waiter of the process not already
    woken. The wake-up reached a waiter whose wait had just timed out, between its
    last look at the event and the clearing of it: the clearing erased the
    wake-up, and the waiter stayed "woken, not yet seen" for the rest of its wait,
    so every later release of that lock skipped it (and, with no other waiter in
    the process, woke nobody): it acquired only by its timer, 1 s after the lock
    was freed."""
    report = in_forked_child(
        functools.partial(_wake_up_lost_to_a_timed_out_wait, nodes.urls), 90
    )
    assert report.outcome == "done", report
    outcome, lag = report.value
    assert outcome == "acquired", outcome
    assert lag < 0.45, f"acquired {lag:.2f} s after the release (retry delay: 1 s)"


def _hand_off_lost_to_a_timed_out_wait(urls: list[str]) -> tuple[str, float]:
    """In a forked child: a fair lock's release hands the lock to its one waiter
    (the main thread) just as the waiter's wait ends to refresh its queue entry,
    between the wait's last look at its event and the clearing of it. Return
    whether that moment came and how long after the release the waiter acquired
    (its next attempt is due 3 s after its last)."""
    resource = "wl:fair-timeout-race"
    config: dict[str, Any] = {"nodes": urls, "fair": True}
    holding, release_now = threading.Event(), threading.Event()
    released: list[float] = []

    def hold() -> None:  # a lock is released by the thread holding it
        with Redlock(resource, **config):
            holding.set()
            release_now.wait(30)
            released.append(time.monotonic())

    def pause() -> None:
        release_now.set()
        # The release hands the lock over; its messages reach this process's
        # reader meanwhile, which gives the hand-off to the waiter it names.
        time.sleep(0.2)

    waiter = Redlock(resource, retry_delay=3.0, retry_jitter=0, **config)
    outcome, acquired = _acquire_held_at_the_clearing(waiter, hold, holding, pause)
    return outcome, acquired - released[0]


def test_a_hand_off_that_races_the_end_of_a_timed_wait_is_not_dropped(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The fair side of the race above: a release handed the lock to the waiter it
    named as the waiter's wait ended to refresh its queue entry, between the
    wait's last look at the event and the clearing of it. The wait returned "not
    woken" and dropped the hand-off that came with the wake-up, and the lock
    handed to the waiter stayed unused until its next attempt, due 3 s after its
    last, instead of being taken at once."""
    report = in_forked_child(
        functools.partial(_hand_off_lost_to_a_timed_out_wait, nodes.urls), 90
    )
    assert report.outcome == "done", report
    outcome, lag = report.value
    assert outcome == "acquired", outcome
    assert lag < 1.0, f"acquired {lag:.2f} s after the release (next attempt: 3 s)"


class _HeldWithAThreadBehind:
    """A barging lock held by a thread until ``release_now`` is set, and a second
    waiter, a thread with a 30 s retry delay, once ``start_second()`` is called."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.holding, self.release_now = threading.Event(), threading.Event()
        self.released: list[float] = []
        self.second: list[tuple[bool, float]] = []
        self.holder = threading.Thread(target=self._hold)
        self.holder.start()
        self.holding.wait(10)

    def _hold(self) -> None:  # a lock is released by the thread holding it
        with Redlock(self.resource):
            self.holding.set()
            self.release_now.wait(30)
            self.released.append(time.monotonic())

    def _take(self) -> None:
        lock = Redlock(self.resource, retry_delay=SLOW_RETRY, retry_jitter=0)
        got = lock.acquire(timeout=20)
        self.second.append((got, time.monotonic()))
        if got:
            lock.release()

    def start_second(self) -> threading.Thread:
        thread = threading.Thread(target=self._take)
        thread.start()
        return thread

    def report(self, first: str) -> tuple[str, str, float]:
        """How the first waiter ended, how the second did, and how long after the
        release the second acquired."""
        self.release_now.set()
        self.holder.join(10)
        deadline = time.monotonic() + 25
        while not self.second and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.second:
            return first, "still waiting", 0.0
        got, at = self.second[0]
        return first, ("acquired" if got else "timed out"), at - self.released[0]


def _woken_waiter_interrupted_in_its_attempt() -> tuple[str, str, float]:
    """In a forked child: two waiters of one process on a barging lock, the main
    thread first, then a thread (30 s retry delay). The release wakes the main
    thread alone; it is interrupted as its attempt starts (an exception raised
    there, as a signal handler's would be: a Celery soft time limit). Return how
    each acquisition ended and how long after the release the thread acquired.

    The exception comes from a trace function (``sys.settrace``): it sees the
    main thread's wait return woken, then the call of the attempt's fan-out."""
    from redlock_django import sync

    resource = "wl:woken-interrupted"
    hub = wake_hub()
    held = _HeldWithAThreadBehind(resource)
    release_now = held.release_now

    def orchestrate() -> None:
        channel = Redlock(resource)._resolve().spec.key.encode()
        wait_for(lambda: hub.waiting(channel) == 1, "the main thread waits")
        held.start_second()
        wait_for(lambda: hub.waiting(channel) == 2, "the thread waits too")
        wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
        time.sleep(0.05)  # the other nodes' confirmations, and their early retries
        release_now.set()

    wait_code = wake.SyncWatch.wait.__code__
    fanout_code = sync.fanout.__code__
    woken: list[bool] = []
    raised: list[bool] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if raised:
            return None
        if frame.f_code is wait_code:
            if event == "return" and arg and release_now.is_set():
                woken.append(True)  # the release ended the wait
            return trace  # to see the wait return
        if event == "call" and frame.f_code is fanout_code and woken:
            raised.append(True)
            raise _Interrupted("interrupted as the woken attempt starts")
        return None

    threading.Thread(target=orchestrate).start()
    first = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
    sys.settrace(trace)
    try:
        outcome = "acquired" if first.acquire(timeout=20) else "timed out"
    except _Interrupted:
        outcome = "interrupted"
    finally:
        sys.settrace(None)
        release_now.set()
    return held.report(outcome)


def test_a_waiter_woken_alone_and_interrupted_in_its_attempt_passes_the_wake_up_on(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A release naming nobody wakes one waiter of the process. That waiter saw
    its wake-up, then was interrupted as its attempt started (a signal handler's
    exception): the wake-up must go to the process's next waiter, which would
    otherwise sleep out its 30 s retry delay with the lock free. (A waiter
    cancelled before its wait saw the wake-up already passed it on.)"""
    report = in_forked_child(_woken_waiter_interrupted_in_its_attempt, 60)
    assert report.outcome == "done", report
    first, second, lag = report.value
    assert first == "interrupted", first
    assert second == "acquired", second
    assert lag < 2.0, f"the next waiter acquired {lag:.2f} s after the release"


def _woken_task_cancelled_in_its_attempt() -> tuple[str, str, float]:
    """In a forked child: an asyncio task and a thread (30 s retry delay) wait, in
    that order, for a barging lock. The release wakes the task alone; it is
    cancelled as its attempt starts. Return how each acquisition ended and how
    long after the release the thread acquired.

    The cancellation comes from a trace function (``sys.settrace``) on the loop's
    thread: it sees the task's wait return woken, then the start of the attempt's
    fan-out, and cancels the task there."""
    from redlock_django import aio

    resource = "wl:woken-cancelled"
    hub = wake_hub()
    held = _HeldWithAThreadBehind(resource)
    release_now = held.release_now

    wait_code = wake.AsyncWatch.wait.__code__
    fanout_code = aio.fanout.__code__
    woken: list[bool] = []
    cancelled: list[bool] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if cancelled:
            return None
        if frame.f_code is wait_code:
            # A suspended coroutine "returns" what it awaits; its own return is
            # True (or a hand-off) when a wake-up ended the wait.
            woken_now = arg is True or type(arg) is dict
            if event == "return" and woken_now and release_now.is_set():
                woken.append(True)
            return trace
        if event == "call" and frame.f_code is fanout_code and woken:
            task = asyncio.current_task()
            if task is not None:
                cancelled.append(True)
                task.cancel()
        return None

    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever)
    looping.start()
    loop.call_soon_threadsafe(sys.settrace, trace)
    first = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
    task = asyncio.run_coroutine_threadsafe(first.aacquire(timeout=20), loop)
    try:
        channel = first._resolve().spec.key.encode()
        wait_for(lambda: hub.waiting(channel) == 1, "the task waits")
        thread = held.start_second()
        wait_for(lambda: hub.waiting(channel) == 2, "the thread waits too")
        wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
        time.sleep(0.05)  # the other nodes' confirmations, and their early retries
        release_now.set()
        try:
            outcome = "acquired" if task.result(20) else "timed out"
        except concurrent.futures.CancelledError:
            outcome = "cancelled"
        thread.join(25)
    finally:
        release_now.set()
        loop.call_soon_threadsafe(sys.settrace, None)
        loop.call_soon_threadsafe(loop.stop)
        looping.join(10)
        loop.close()
    return held.report(outcome)


def test_an_asyncio_waiter_woken_alone_and_cancelled_in_its_attempt_passes_it_on(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The asyncio side of the interrupted attempt above: a task woken alone by a
    release is cancelled once its wait returned, as its attempt starts (a
    request's timeout, a client gone); the process's next waiter, a thread, is
    woken in its place instead of sleeping out its 30 s retry delay."""
    report = in_forked_child(_woken_task_cancelled_in_its_attempt, 60)
    assert report.outcome == "done", report
    first, second, lag = report.value
    assert first == "cancelled", first
    assert second == "acquired", second
    assert lag < 2.0, f"the next waiter acquired {lag:.2f} s after the release"


class _HeldAndTakenBack:
    """A barging lock held by a thread: released once ``release_now`` is set,
    taken back at once when ``retake`` is (no other client waits then), and
    released for good when ``release_again`` is (its time in ``last_release``)."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.holding, self.release_now, self.retake = (
            threading.Event() for _ in range(3)
        )
        self.retaken, self.release_again = threading.Event(), threading.Event()
        self.last_release: list[float] = []
        self.thread = threading.Thread(target=self._hold)
        self.thread.start()
        self.holding.wait(10)

    def _hold(self) -> None:  # a lock is released by the thread holding it
        holder = Redlock(self.resource)
        assert holder.acquire(blocking=False)
        self.holding.set()
        self.release_now.wait(30)
        holder.release()
        if self.retake.wait(30):
            assert holder.acquire(blocking=False)  # the lock is free: nobody waits
            self.retaken.set()
            self.release_again.wait(30)
            self.last_release.append(time.monotonic())
            holder.release()

    def release_when_waited(self, hub: wake.Hub) -> None:
        """Release once this process's one waiter waits and node 0 confirms it."""
        channel = Redlock(self.resource)._resolve().spec.key.encode()
        wait_for(lambda: hub.waiting(channel) == 1, "the waiter waits")
        wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
        time.sleep(0.05)  # the other nodes' confirmations, and their early retries
        self.release_now.set()

    def take_back(self) -> None:
        """The first breakpoint's work: the holder takes the lock back."""
        self.retake.set()
        self.retaken.wait(10)

    def release_for_good(self) -> None:
        """The second breakpoint's work: the holder releases, and the release's
        messages reach this process's reader meanwhile."""
        self.release_again.set()
        wait_for(lambda: bool(self.last_release), "the holder released")
        time.sleep(0.2)

    def breakpoints(
        self, wait_code: Any, woken: Callable[[Any], bool], paused: list[str]
    ) -> Callable[..., Any]:
        """A trace function (``sys.settrace``): as the waiter's wait (``wait_code``)
        returns ``woken``, the holder takes the lock back; at the next call of
        ``Hub.attempted`` (the refused attempt answered), it releases for good."""
        attempted_code = wake.Hub.attempted.__code__

        def trace(frame: Any, event: str, arg: Any) -> Any:
            if len(paused) == 2:
                return None
            if frame.f_code is wait_code:
                ended = event == "return" and woken(arg)
                if ended and self.release_now.is_set() and not paused:
                    paused.append("woken")
                    self.take_back()
                return trace  # to see the wait return
            if event == "call" and frame.f_code is attempted_code and paused:
                paused.append("refused")
                self.release_for_good()
            return None

        return trace

    def report(
        self, got: bool | None, paused: list[str], acquired: float
    ) -> tuple[str, float]:
        for event in (self.release_now, self.retake, self.release_again):
            event.set()
        self.thread.join(10)
        if paused != ["woken", "refused"]:
            return f"paused at {paused}", 0.0
        outcome = "acquired" if got else "timed out"
        return outcome, acquired - self.last_release[0]


def _release_during_the_woken_attempt() -> tuple[str, float]:
    """In a forked child: the one waiter of the process (the main thread, a 3 s
    retry delay) on a barging lock is woken by the holder's release; the holder
    barges back in before the woken attempt runs, so that attempt is refused;
    then, while the refused attempt is still being answered (before the waiter
    counts it: ``Hub.attempted``), the holder releases for good. Return how the
    acquisition ended and how long after that last release.

    Both moments come from a trace function (``sys.settrace``), as a debugger's
    breakpoints would: it pauses the waiter as its woken wait returns (while the
    holder takes the lock back) and at the call of ``Hub.attempted`` after the
    refused attempt (while the holder releases and the release's messages reach
    this process's reader)."""
    held = _HeldAndTakenBack("wl:released-during-the-woken-attempt")
    paused: list[str] = []
    trace = held.breakpoints(wake.SyncWatch.wait.__code__, bool, paused)
    threading.Thread(target=held.release_when_waited, args=(wake_hub(),)).start()
    waiter = Redlock(held.resource, retry_delay=3.0, retry_jitter=0)
    got = None
    sys.settrace(trace)
    try:
        got = waiter.acquire(timeout=10)
    finally:
        sys.settrace(None)
        report = held.report(got, paused, time.monotonic())
    if got:
        waiter.release()
    return report


def _release_during_the_woken_task_attempt() -> tuple[str, float]:
    """The same with an asyncio task as the waiter: the trace function runs on
    the loop's thread, so each breakpoint holds the whole loop, as a busy loop
    would; the release reaches the process's reader thread meanwhile."""
    held = _HeldAndTakenBack("wl:released-during-the-woken-task-attempt")
    paused: list[str] = []
    # A suspended coroutine "returns" what it awaits; its own return is True
    # when a wake-up ended the wait.
    trace = held.breakpoints(
        wake.AsyncWatch.wait.__code__, lambda value: value is True, paused
    )
    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever)
    looping.start()
    loop.call_soon_threadsafe(sys.settrace, trace)
    threading.Thread(target=held.release_when_waited, args=(wake_hub(),)).start()
    waiter = Redlock(held.resource, retry_delay=3.0, retry_jitter=0)
    acquired: list[float] = []

    async def take() -> bool:
        got = await waiter.aacquire(timeout=10)
        acquired.append(time.monotonic())
        if got:
            await waiter.arelease()
        return got

    got = None
    try:
        got = asyncio.run_coroutine_threadsafe(take(), loop).result(20)
    finally:
        loop.call_soon_threadsafe(sys.settrace, None)
        report = held.report(got, paused, acquired[0] if acquired else 0.0)
        loop.call_soon_threadsafe(loop.stop)
        looping.join(10)
        loop.close()
    return report


def test_a_release_during_a_woken_waiters_refused_attempt_wakes_it_again(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A release naming nobody wakes one waiter of the process, one not already
    woken. A waiter woken alone stays "woken" until its attempt is answered; a
    release heard meanwhile, with no other waiter in the process, woke nobody, so
    when that attempt was refused (the holder had barged back in) the waiter slept
    out its 3 s retry delay with the lock free. The release must reach it: its
    next wait ends at once."""
    report = in_forked_child(_release_during_the_woken_attempt, 60)
    assert report.outcome == "done", report
    outcome, lag = report.value
    assert outcome == "acquired", outcome
    assert lag < 1.0, f"acquired {lag:.2f} s after the release (retry delay: 3 s)"


def test_a_release_during_a_woken_tasks_refused_attempt_wakes_it_again(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The asyncio side: a task woken alone, whose attempt was refused, hears of
    the release that came while that attempt was answered."""
    report = in_forked_child(_release_during_the_woken_task_attempt, 60)
    assert report.outcome == "done", report
    outcome, lag = report.value
    assert outcome == "acquired", outcome
    assert lag < 1.0, f"acquired {lag:.2f} s after the release (retry delay: 3 s)"
